/* Native host kernels of `--kernels host` for the small per-token ops of a decode step (loaded with gemv.c as one
 * library by engine/host_kernels/__init__.py; same build flags, no torch headers).
 *
 * At decode sizes (a few tokens, D ~ 1e2..1e4) these ops cost microseconds of arithmetic but tens to hundreds of
 * microseconds as chains of torch / NumPy ops (the mHC mixing weights are ~45 tiny ops per site: a linear, a norm,
 * sigmoids, a softmax and 20 Sinkhorn steps). Each function here is one pass over its inputs with the reference's
 * formula and operation order (nki_kernels/reference.py), fp32 throughout; results differ from the reference by
 * fp32 summation order and the rounding of exp / sqrt only (libm's; sparse_attn's AVX2 path: exp8, within 1.3 ulp).
 *
 *   dk_hc_mixes    reference.hc_mixes     x [T, n*D] fp32, fn [(2+n)*n, n*D] fp32 -> pre [T, n], post [T, n],
 *                                         comb [T, n, n]
 *   dk_rms_norm    reference.rms_norm     x [T, D], weight [D] (or NULL) -> y [T, D]
 *   dk_hc_collapse reference.hc_collapse  x [T, n, D], pre [T, n] -> y [T, D]
 *   dk_hc_expand   reference.hc_expand    y [T, D], x [T, n, D], post [T, n], comb [T, n, n] -> out [T, n, D]
 *   dk_rope_tail   reference.rope_tail    x [T, H, D], cos / sin [T, rd/2] -> y [T, H, D] (bitwise: no FMA)
 *   dk_hc_head     reference.hc_head      x [T, n, D], fn [n, n*D] -> y [T, D]
 *   dk_route       reference.route        router logits [T, E] (after the GEMV) -> weights [T, K], indices [T, K]
 *   dk_keep_rows   engine/runner.py's held rows (ModelRunner._keep / _flush): rows of a step's streams, each
 *                                         source's n streams averaged (DSpark's Capture.tensor) or copied (MTP's)
 *
 * Dot products and sums of squares use 16 independent partial sums (gcc vectorises the lanes; the lane order is
 * fixed, so results do not depend on the thread count). Rows t are split over `nthreads` OpenMP threads when the
 * work is large enough to pay for it.
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <stdint.h>
#include "dk.h"
#include "dk_omp.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define LANES 16
#define PAR_MIN (1 << 16) /* multiply-adds below which one thread does all rows */
#define ATTN_G 2 /* sparse_attn: heads of a query row per pass over its keys (dk_attn_heads_per_pass) */

/* The end of a 16-lane dot product whose whole 16-element steps are in lane[]: the tail a[i..k) * b[i..k) into lane
 * k % 16, then the lanes added in a fixed tree (dot's, and hc_mixes' token tiles') */
static inline float lanes_sum(float *lane, const float *a, const float *b, int64_t i, int64_t k) {
    for (; i < k; i++) lane[i % LANES] += a[i] * b[i];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++) lane[j] += lane[j + w];
    return lane[0];
}

/* sum_k a[k] * b[k] (b == NULL: sum_k a[k]^2) in 16 lanes, lanes added in a fixed tree */
static inline float dot(const float *a, const float *b, int64_t k) {
    float acc[LANES] = {0};
    int64_t i = 0;
    if (b) {
        for (; i + LANES <= k; i += LANES)
            for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
    } else {
        for (; i + LANES <= k; i += LANES)
            for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * a[i + j];
    }
    return lanes_sum(acc, a, b ? b : a, i, k);
}

static inline float sigmoidf(float v) { return 1.0f / (1.0f + expf(-v)); }

/* 1 / sqrt(mean(v^2) + eps) over v[0..n) (the RMS factor of rms_norm and of the mHC mixes) */
static inline float inv_rms(const float *v, int64_t n, float eps) {
    return 1.0f / sqrtf(dot(v, NULL, n) / (float)n + eps);
}

/* an mHC `pre` weight from its mix: sigmoid(scale * mix + base) + hc_eps (hc_mixes' and hc_head's) */
static inline float hc_pre_weight(float mix, float scale, float base, float hc_eps) {
    return sigmoidf(scale * mix + base) + hc_eps;
}

/* dot(x + t * K, fn + j * K, K) * r[t] -> mix[t][j] for TT token rows at once: each token keeps `dot`'s 16 lanes
 * (as gcc compiles `dot` here: one 16-lane FMA accumulator with AVX-512, two 8-lane ones with AVX2), its tail and
 * its tree, so every mix is bit for bit the one-token number; what the tile adds is TT independent FMA chains (one
 * token's chain runs at the FMA latency) and one read of each fn row per tile. Zen 4, mid sizes (n 4, D 1024), one
 * thread, a call from Python: 8 tokens 70.5 -> 53.8 us (avx2 build 75.0 -> 52.8), 2 tokens 25.0 -> 22.9, 1 token
 * 17.7 either way; bit-identical outputs at 1-17 tokens. Without AVX2 + FMA: `dot` per token. */
#define HC_TILE 4
#if defined(__AVX2__) && defined(__FMA__)
static inline __attribute__((always_inline)) void
mixes_tile_n(const int TT, const float *x, const float *fn, const float *r, float (*mix)[(2 + 16) * 16], int64_t M,
             int64_t K) {
    for (int64_t j = 0; j < M; j++) {
        const float *b = fn + j * K;
        float lane[HC_TILE][LANES];
        int64_t i = 0;
#if defined(__AVX512F__)
        __m512 acc[HC_TILE];
        for (int t = 0; t < TT; t++) acc[t] = _mm512_setzero_ps();
        for (; i + LANES <= K; i += LANES) {
            const __m512 bv = _mm512_loadu_ps(b + i);
            for (int t = 0; t < TT; t++) acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(x + t * K + i), bv, acc[t]);
        }
        for (int t = 0; t < TT; t++) _mm512_storeu_ps(lane[t], acc[t]);
#else
        __m256 lo[HC_TILE], hi[HC_TILE];
        for (int t = 0; t < TT; t++) lo[t] = hi[t] = _mm256_setzero_ps();
        for (; i + LANES <= K; i += LANES) {
            const __m256 b0 = _mm256_loadu_ps(b + i), b1 = _mm256_loadu_ps(b + i + 8);
            for (int t = 0; t < TT; t++) {
                lo[t] = _mm256_fmadd_ps(_mm256_loadu_ps(x + t * K + i), b0, lo[t]);
                hi[t] = _mm256_fmadd_ps(_mm256_loadu_ps(x + t * K + i + 8), b1, hi[t]);
            }
        }
        for (int t = 0; t < TT; t++) _mm256_storeu_ps(lane[t], lo[t]), _mm256_storeu_ps(lane[t] + 8, hi[t]);
#endif
        for (int t = 0; t < TT; t++) mix[t][j] = lanes_sum(lane[t], x + t * K, b, i, K) * r[t];
    }
}
#endif

static void mixes_tile(const float *x, const float *fn, const float *r, float (*mix)[(2 + 16) * 16], int64_t TT,
                       int64_t M, int64_t K) {
#if defined(__AVX2__) && defined(__FMA__)
    switch (TT) { /* the token count a compile-time constant: the accumulators stay in registers */
    case 1: mixes_tile_n(1, x, fn, r, mix, M, K); break;
    case 2: mixes_tile_n(2, x, fn, r, mix, M, K); break;
    case 3: mixes_tile_n(3, x, fn, r, mix, M, K); break;
    default: mixes_tile_n(4, x, fn, r, mix, M, K); break;
    }
#else
    for (int64_t t = 0; t < TT; t++)
        for (int64_t j = 0; j < M; j++) mix[t][j] = dot(x + t * K, fn + j * K, K) * r[t];
#endif
}

/* pre [n], post [n] and comb [n, n] of one token from its mixes (sigmoids, softmax, Sinkhorn) */
static void mixes_finish(const float *mix, const float *scale, const float *base, float *pre, float *post, float *a,
                         int64_t n, int64_t iters, float hc_eps) {
    for (int64_t i = 0; i < n; i++) {
        pre[i] = hc_pre_weight(mix[i], scale[0], base[i], hc_eps);
        post[i] = 2.0f * sigmoidf(scale[1] * mix[n + i] + base[n + i]);
    }
    for (int64_t j = 0; j < n; j++) {  /* a[j * n + k]: from stream j to stream k; softmax over k, + eps */
        float *row = a + j * n, mx = -INFINITY, s = 0.0f;
        for (int64_t k = 0; k < n; k++) {
            row[k] = scale[2] * mix[2 * n + j * n + k] + base[2 * n + j * n + k];
            mx = row[k] > mx ? row[k] : mx;
        }
        for (int64_t k = 0; k < n; k++) s += (row[k] = expf(row[k] - mx));
        for (int64_t k = 0; k < n; k++) row[k] = row[k] / s + hc_eps;
    }
    for (int64_t it = 0; it < iters; it++) {
        if (it > 0)  /* rows: divide by (sum over k + eps) */
            for (int64_t j = 0; j < n; j++) {
                float s = 0.0f;
                for (int64_t k = 0; k < n; k++) s += a[j * n + k];
                s += hc_eps;
                for (int64_t k = 0; k < n; k++) a[j * n + k] /= s;
            }
        for (int64_t k = 0; k < n; k++) {  /* columns: divide by (sum over j + eps) */
            float s = 0.0f;
            for (int64_t j = 0; j < n; j++) s += a[j * n + k];
            s += hc_eps;
            for (int64_t j = 0; j < n; j++) a[j * n + k] /= s;
        }
    }
}

static void hc_mixes_tiles(const float *x, const float *fn, const float *scale, const float *base, float *pre,
                           float *post, float *comb, int64_t T, int64_t n, int64_t K, int64_t M, int64_t iters,
                           float hc_eps, float norm_eps) {
    const int64_t tiles = (T + HC_TILE - 1) / HC_TILE;
#pragma omp for schedule(static)
    for (int64_t tile = 0; tile < tiles; tile++) {
        const int64_t t0 = tile * HC_TILE, tt = T - t0 < HC_TILE ? T - t0 : HC_TILE;
        float mixes[HC_TILE][(2 + 16) * 16], r[HC_TILE];
        for (int64_t t = 0; t < tt; t++) r[t] = inv_rms(x + (t0 + t) * K, K, norm_eps);
        mixes_tile(x + t0 * K, fn, r, mixes, tt, M, K);
        for (int64_t t = t0; t < t0 + tt; t++)
            mixes_finish(mixes[t - t0], scale, base, pre + t * n, post + t * n, comb + t * n * n, n, iters, hc_eps);
    }
}

int dk_hc_mixes(const float *x, const float *fn, const float *scale, const float *base, float *pre, float *post,
                float *comb, int64_t T, int64_t n, int64_t D, int64_t iters, float hc_eps, float norm_eps,
                int nthreads) {
    if (n <= 0 || n > 16) return -2;
    const int64_t K = n * D, M = (2 + n) * n;
    DK_PARALLEL(T * M * K >= PAR_MIN, nthreads,
                hc_mixes_tiles(x, fn, scale, base, pre, post, comb, T, n, K, M, iters, hc_eps, norm_eps));
    return 0;
}

static void rms_rows(const float *x, const float *w, float *y, int64_t T, int64_t D, float eps) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * D;
        float *yr = y + t * D;
        const float r = inv_rms(xr, D, eps);
        if (w)
            for (int64_t d = 0; d < D; d++) yr[d] = xr[d] * r * w[d];
        else
            for (int64_t d = 0; d < D; d++) yr[d] = xr[d] * r;
    }
}

int dk_rms_norm(const float *x, const float *w, float *y, int64_t T, int64_t D, float eps, int nthreads) {
    DK_PARALLEL(T * D >= PAR_MIN, nthreads, rms_rows(x, w, y, T, D, eps));
    return 0;
}

static void collapse_rows(const float *x, const float *pre, float *y, int64_t T, int64_t n, int64_t D) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        float *yr = y + t * D;
        const float *xt = x + t * n * D, *p = pre + t * n;
        for (int64_t d = 0; d < D; d++) yr[d] = p[0] * xt[d];
        for (int64_t j = 1; j < n; j++)
            for (int64_t d = 0; d < D; d++) yr[d] += p[j] * xt[j * D + d];
    }
}

int dk_hc_collapse(const float *x, const float *pre, float *y, int64_t T, int64_t n, int64_t D, int nthreads) {
    DK_PARALLEL(T * n * D >= PAR_MIN, nthreads, collapse_rows(x, pre, y, T, n, D));
    return 0;
}

/* The front of an mHC site (the op table's hc_pre; moe.c dk_ffn_site, attn.c dk_attn_front): pre, post, comb =
 * hc_mixes(x); y = rms_norm(hc_collapse(x, pre), norm_w). pre [T, n] and h [T, D]: caller scratch. */
int dk_hc_pre(const float *x, const float *fn, const float *scale, const float *base, const float *norm_w,
              float *pre, float *post, float *comb, float *h, float *y, int64_t T, int64_t n, int64_t D, int64_t iters,
              float hc_eps, float norm_eps, int nthreads) {
    int rc = dk_hc_mixes(x, fn, scale, base, pre, post, comb, T, n, D, iters, hc_eps, norm_eps, nthreads);
    if (!rc) rc = dk_hc_collapse(x, pre, h, T, n, D, nthreads);
    if (!rc) rc = dk_rms_norm(h, norm_w, y, T, D, norm_eps, nthreads);
    return rc;
}

static void expand_rows(const float *y, const float *x, const float *post, const float *comb, float *out, int64_t T,
                        int64_t n, int64_t D) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *yr = y + t * D, *xt = x + t * n * D, *p = post + t * n, *c = comb + t * n * n;
        float *ot = out + t * n * D;
        for (int64_t k = 0; k < n; k++) {
            float *o = ot + k * D;
            for (int64_t d = 0; d < D; d++) o[d] = c[k] * xt[d];
            for (int64_t j = 1; j < n; j++)
                for (int64_t d = 0; d < D; d++) o[d] += c[j * n + k] * xt[j * D + d];
            for (int64_t d = 0; d < D; d++) o[d] = p[k] * yr[d] + o[d];
        }
    }
}

int dk_hc_expand(const float *y, const float *x, const float *post, const float *comb, float *out, int64_t T,
                 int64_t n, int64_t D, int nthreads) {
    DK_PARALLEL(T * n * n * D >= PAR_MIN, nthreads, expand_rows(y, x, post, comb, out, T, n, D));
    return 0;
}

#if defined(__AVX2__) && defined(__FMA__)
#define DK_ATTN_AVX2 1

/* exp(x) for x <= 0 (the logits minus their max): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p Cephes' degree-6
 * polynomial: within 1.24 ulp of exp over [-87, 0] (measured against double exp on every 7th float there); x
 * below -87 (where exp(x) < 2^-125) is clamped there, an absolute error under 2^-125, which the weights' sum of at
 * least exp(0) = 1 makes a relative one below 2^-125. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* scale * (q_g . k_i) for the 4 keys k + i * D and the G heads q + g * D (D a multiple of 8) -> lg[g][0..4): per
 * logit one 8-lane accumulator over D, its lanes added in a fixed tree ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 +
 * l7)); each key chunk is loaded once for the G heads */
static inline __attribute__((always_inline)) void logits4(const int G, const float *q, const float *k, int64_t D,
                                                          float scale, float *const *lg) {
    __m256 a[ATTN_G][4];
    for (int g = 0; g < G; g++)
        for (int i = 0; i < 4; i++) a[g][i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m256 qv[ATTN_G];
        for (int g = 0; g < G; g++) qv[g] = _mm256_loadu_ps(q + g * D + d);
        for (int i = 0; i < 4; i++) {
            const __m256 kv = _mm256_loadu_ps(k + i * D + d);
            for (int g = 0; g < G; g++) a[g][i] = _mm256_fmadd_ps(qv[g], kv, a[g][i]);
        }
    }
    for (int g = 0; g < G; g++) {
        const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][1]), _mm256_hadd_ps(a[g][2], a[g][3]));
        _mm_storeu_ps(lg[g], _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)),
                                        _mm_set1_ps(scale)));
    }
}

/* out_g[d0 .. d0 + 8 nv) = sum over valid keys j, in key order, of p_g[j] k_j (one FMA chain per column, from 0) for
 * the G heads; each key chunk is loaded once for the G heads */
static inline __attribute__((always_inline)) void values32(const int G, const float *keys, const uint8_t *ok,
                                                           float *const *pj, float *out, int64_t N, int64_t D,
                                                           int64_t d0, int nv) {
    __m256 acc[ATTN_G][4];
    for (int g = 0; g < G; g++)
        for (int i = 0; i < 4; i++) acc[g][i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < N; j++)
        if (ok[j]) {
            const float *kj = keys + j * D + d0;
            __m256 p[ATTN_G];
            for (int g = 0; g < G; g++) p[g] = _mm256_set1_ps(pj[g][j]);
            for (int i = 0; i < nv; i++) {
                const __m256 kv = _mm256_loadu_ps(kj + 8 * i);
                for (int g = 0; g < G; g++) acc[g][i] = _mm256_fmadd_ps(p[g], kv, acc[g][i]);
            }
        }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < nv; i++) _mm256_storeu_ps(out + g * D + d0 + 8 * i, acc[g][i]);
}
#endif

/* The logits of G heads (G <= ATTN_G, a compile-time constant where inlined) over the N keys: 8 keys at a time in
 * two logits4 with AVX2 and D a multiple of 8 (the rest one key at a time with `dot`) */
static inline __attribute__((always_inline)) void attn_logits(const int G, const float *q, const float *keys,
                                                              float *const *lg, int64_t N, int64_t D, float scale,
                                                              int vec) {
    int64_t j0 = 0;
#if defined(DK_ATTN_AVX2)
    if (vec)
        for (; j0 + 8 <= N; j0 += 8)
            for (int64_t j = j0; j < j0 + 8; j += 4) {
                float *at[ATTN_G];
                for (int g = 0; g < G; g++) at[g] = lg[g] + j;
                logits4(G, q, keys + j * D, D, scale, at);
            }
#else
    (void)vec;
#endif
    for (int g = 0; g < G; g++)
        for (int64_t j = j0; j < N; j++) lg[g][j] = dot(q + g * D, keys + j * D, D) * scale;
}

/* m = the largest valid logit (-inf: none), p_j = exp(l_j - m) for valid keys (0 elsewhere), returns their sum l */
static float attn_probs(const float *lg, float *pj, const uint8_t *ok, int64_t N, float *m_out, int vec) {
    float m = -INFINITY, l = 0.0f;
    for (int64_t j = 0; j < N; j++)
        if (ok[j]) m = lg[j] > m ? lg[j] : m;
    *m_out = m;
    if (m == -INFINITY) return 0.0f;
    int64_t j = 0;
#if defined(DK_ATTN_AVX2)
    if (vec) {
        const __m256 mv = _mm256_set1_ps(m);
        __m256 lv = _mm256_setzero_ps();
        for (; j + 8 <= N; j += 8) {
            const __m256i okv = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ok + j)));
            const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(okv, _mm256_setzero_si256()));
            const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(lg + j), mv)), keep);
            _mm256_storeu_ps(pj + j, p);
            lv = _mm256_add_ps(lv, p);
        }
        float t[8];
        _mm256_storeu_ps(t, lv);
        for (int i = 0; i < 8; i++) l += t[i];
    }
#else
    (void)vec;
#endif
    for (; j < N; j++) {
        pj[j] = ok[j] ? expf(lg[j] - m) : 0.0f;
        l += pj[j];
    }
    return l;
}

/* out_g = sum over valid keys of p_g[j] k_j for G heads (rows out + g * D) */
static inline __attribute__((always_inline)) void attn_values(const int G, const float *keys, const uint8_t *ok,
                                                              float *const *pj, float *out, int64_t N, int64_t D,
                                                              int vec) {
#if defined(DK_ATTN_AVX2)
    if (vec) {
        for (int64_t d0 = 0; d0 < D; d0 += 32)
            values32(G, keys, ok, pj, out, N, D, d0, D - d0 >= 32 ? 4 : (int)(D - d0) / 8);
        return;
    }
#else
    (void)vec;
#endif
    for (int g = 0; g < G; g++) {
        float *o = out + g * D;
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        for (int64_t j = 0; j < N; j++)
            if (ok[j]) {
                const float p = pj[g][j], *kj = keys + j * D;
                for (int64_t d = 0; d < D; d++) o[d] += p * kj[d];
            }
    }
}

/* Heads h0 .. h0 + G of query row bt (G a compile-time constant where inlined): logits, probabilities, values and
 * the sink, into out (G rows of D). A head without a valid key gets 0. */
static inline __attribute__((always_inline)) void attn_heads(const int G, const float *q, const float *keys,
                                                             const uint8_t *ok, const float *sink, float *out,
                                                             float *buf, int64_t N, int64_t D, float scale, int vec) {
    float *lg[ATTN_G], *pj[ATTN_G], m[ATTN_G], l[ATTN_G];
    for (int g = 0; g < G; g++) lg[g] = buf + 2 * g * N, pj[g] = lg[g] + N;
    attn_logits(G, q, keys, lg, N, D, scale, vec);
    int any_none = 0;
    for (int g = 0; g < G; g++) {
        l[g] = attn_probs(lg[g], pj[g], ok, N, &m[g], vec);
        any_none |= m[g] == -INFINITY;
    }
    if (!any_none)
        attn_values(G, keys, ok, pj, out, N, D, vec);
    else  /* a head with m -inf (no valid key, or only NaN / -inf logits) gets 0, the others their values alone */
        for (int g = 0; g < G; g++)
            if (m[g] == -INFINITY)
                for (int64_t d = 0; d < D; d++) out[g * D + d] = 0.0f;
            else
                attn_values(1, keys, ok, &pj[g], out + g * D, N, D, vec);
    for (int g = 0; g < G; g++) {
        const float s = sink[g], mm = m[g] > s ? m[g] : s;
        const float w = m[g] == -INFINITY ? 0.0f : expf(m[g] - mm), den = expf(s - mm) + l[g] * w;
        float *o = out + g * D;
        for (int64_t d = 0; d < D; d++) o[d] = o[d] * w / den;
    }
}

/* ATTN_G for the caller, which sizes sparse_attn's scratch by it (HostLibrary.attn_heads) */
int dk_attn_heads_per_pass(void) { return ATTN_G; }

/* sparse_attn's (query row, head group) items, each thread with its own slice of the scratch */
static void attn_rows(const float *q, const float *kv, const uint8_t *valid, const float *sink, float *o,
                      float *scratch, int64_t B, int64_t T, int64_t H, int64_t N, int64_t D, float scale, int vec) {
    const int64_t groups = (H + ATTN_G - 1) / ATTN_G;
    float *buf = scratch + (int64_t)omp_get_thread_num() * 2 * ATTN_G * N;
#pragma omp for schedule(static) collapse(2)
    for (int64_t bt = 0; bt < B * T; bt++)
        for (int64_t hg = 0; hg < groups; hg++) {
            const int64_t b = bt / T, h0 = hg * ATTN_G;
            const float *qr = q + (bt * H + h0) * D, *keys = kv + b * N * D;
            const uint8_t *ok = valid + bt * N;
            float *out = o + (bt * H + h0) * D;
            if (H - h0 >= ATTN_G)
                attn_heads(ATTN_G, qr, keys, ok, sink + h0, out, buf, N, D, scale, vec);
            else
                for (int64_t h = h0; h < H; h++)
                    attn_heads(1, q + (bt * H + h) * D, keys, ok, sink + h, o + (bt * H + h) * D, buf, N, D,
                               scale, vec);
        }
}

/* reference.sparse_attn: q [B, T, H, D] fp32, kv [B, N, D] fp32, valid [B, T, N] bytes (0/1), sink [H] fp32 ->
 * o [B, T, H, D] fp32 = sum_j exp(l_j) kv_j / (sum_j exp(l_j) + exp(sink_h)) over valid keys j, l_j = scale q.kv_j,
 * computed as the reference's partial + merge: m = max valid logit, p_j = exp(l_j - m), acc = sum p_j kv_j,
 * l = sum p_j, M = max(m, sink), w = exp(m - M) (0 with no valid key), o = acc * w / (exp(sink - M) + l * w).
 * The heads of a query row share its keys and mask (one K = V head): they go ATTN_G at a time, so each key chunk is
 * loaded once for ATTN_G heads in both passes (Zen 4, H 16, D 128, one thread, a call: N 140 32.1 -> 23.5 us, 8
 * rows x N 400 603 -> 417 us, the avx2 build alike; 3 or 4 heads at a time were slower). `scratch` is caller scratch
 * of `scratch_n` >= 2 * ATTN_G * N floats per thread (nthreads of them). With AVX2 and D a multiple of 8 the logits
 * of each 8 keys are taken as two blocks of 4, the exps 8 at a time (exp8) and acc in register blocks of 32 columns;
 * otherwise one key at a time with libm's expf. Each number is the one of a head alone, bit for bit: the grouping
 * changes which loads feed the FMAs, not their order. */
int dk_sparse_attn(const float *q, const float *kv, const uint8_t *valid, const float *sink, float *o,
                   float *scratch, int64_t scratch_n, int64_t B, int64_t T, int64_t H, int64_t N, int64_t D,
                   float scale, int nthreads) {
    const int nt = nthreads > 0 ? nthreads : 1;
    if (scratch_n < (int64_t)nt * 2 * ATTN_G * N) return -2;
    const int par = nt > 1 && B * T * H * N * D >= PAR_MIN;
#if defined(DK_ATTN_AVX2)
    const int vec = D % 8 == 0;
#else
    const int vec = 0;
#endif
    DK_PARALLEL(par, nt, attn_rows(q, kv, valid, sink, o, scratch, B, T, H, N, D, scale, vec));
    return 0;
}

/* reference.rope_apply on the trailing rd dims of x [T, H, D] (reference.rope_tail): cos / sin [T, rd/2], one angle
 * per token for all H heads (inverse: the negative angle); the leading D - rd dims are copied. Compiled without FMA
 * contraction: every product and sum is rounded on its own, as the reference's separate torch ops round them, so the
 * result is the reference's bit for bit. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
int dk_rope_tail(const float *x, const float *cs, const float *sn, float *y, int64_t T, int64_t H, int64_t D,
                 int64_t rd, int inverse) {
    const int64_t h2 = rd / 2, nope = D - rd;
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            const float *xr = x + (t * H + h) * D, *c = cs + t * h2, *s = sn + t * h2;
            float *yr = y + (t * H + h) * D;
            for (int64_t i = 0; i < nope; i++) yr[i] = xr[i];
            for (int64_t i = 0; i < h2; i++) {
                const float a = xr[nope + 2 * i], b = xr[nope + 2 * i + 1], si = inverse ? -s[i] : s[i];
                const float ac = a * c[i], bs = b * si, as = a * si, bc = b * c[i];
                yr[nope + 2 * i] = ac - bs;
                yr[nope + 2 * i + 1] = as + bc;
            }
        }
    return 0;
}
#pragma GCC pop_options

/* reference.route after reference.gate_scores' GEMV: logits [T, E] fp32 (x @ gate^T) -> weights [T, K] fp32,
 * indices [T, K] int64. s = sqrt(softplus(l)) (torch's softplus: l above 20 is kept, else log1p(exp(l))); the
 * experts are hash_ids [T, K] when given (hash layers), else the K largest s + bias (bias NULL: s) in descending
 * order, ties to the lower expert id; weights = their s / sum * route_scale. */
int dk_route(const float *logits, const float *bias, const int64_t *hash_ids, float *weights, int64_t *indices,
             int64_t T, int64_t E, int64_t K, float route_scale) {
    if (E <= 0 || E > 1024 || K <= 0 || K > E) return -2;
    for (int64_t t = 0; t < T; t++) {
        float s[1024], sel[1024];
        const float *l = logits + t * E;
        for (int64_t e = 0; e < E; e++) {
            const float sp = l[e] > 20.0f ? l[e] : log1pf(expf(l[e]));
            s[e] = sqrtf(sp);
            sel[e] = bias ? s[e] + bias[e] : s[e];
        }
        int64_t *idx = indices + t * K;
        if (hash_ids) {
            for (int64_t k = 0; k < K; k++) {
                idx[k] = hash_ids[t * K + k];
                if (idx[k] < 0 || idx[k] >= E) return -3;
            }
        } else {
            unsigned char taken[1024] = {0};
            for (int64_t k = 0; k < K; k++) { /* the k-th largest not yet taken (NaN above every number) */
                int64_t best = -1;
                for (int64_t e = 0; e < E; e++) {
                    if (taken[e]) continue;
                    if (best < 0 || (isnan(sel[e]) && !isnan(sel[best])) || sel[e] > sel[best]) best = e;
                }
                idx[k] = best;
                taken[best] = 1;
            }
        }
        float sum = 0.0f;
        for (int64_t k = 0; k < K; k++) sum += s[idx[k]];
        for (int64_t k = 0; k < K; k++) weights[t * K + k] = s[idx[k]] / sum * route_scale;
    }
    return 0;
}

/* reference.hc_head: x [T, n, D] -> y [T, D] = hc_collapse(x, pre), pre = sigmoid(mix * scale + base) + hc_eps with
 * mix_j = (v . fn_j) / sqrt(mean(v^2) + norm_eps) over the flattened streams v (fn [n, n*D], scale [1], base [n]):
 * hc_mixes' `pre` over a fn of n rows, then dk_hc_collapse. */
int dk_hc_head(const float *x, const float *fn, const float *scale, const float *base, float *y, int64_t T,
               int64_t n, int64_t D, float hc_eps, float norm_eps, int nthreads) {
    if (n <= 0 || n > 16) return -2;
    const int64_t K = n * D;
    float *pre = (float *)malloc((size_t)(T * n) * sizeof(float));
    if (pre == NULL) return -1;
    for (int64_t t = 0; t < T; t++) {
        const float *v = x + t * K;
        const float r = inv_rms(v, K, norm_eps);
        for (int64_t j = 0; j < n; j++)
            pre[t * n + j] = hc_pre_weight(dot(v, fn + j * K, K) * r, scale[0], base[j], hc_eps);
    }
    const int rc = dk_hc_collapse(x, pre, y, T, n, D, nthreads);
    free(pre);
    return rc;
}

/* dk.h: the mean of n streams in torch's order (Capture.tensor), one row of dk_keep_rows or attn.c's held rows */
void dk_stream_mean(const float *x, int64_t n, int64_t D, float *o) {
    for (int64_t d = 0; d < D; d++) o[d] = 0.0f + x[d]; /* from 0, as torch's sum: -0 + 0 is +0 */
    for (int64_t j = 1; j < n; j++)
        for (int64_t d = 0; d < D; d++) o[d] += x[j * D + d];
    for (int64_t d = 0; d < D; d++) o[d] /= (float)n;
}

/* ModelRunner._keep's rows written at once (engine/runner.py; its _flush is the torch path, bit for bit): for each
 * r < R, row src_row[r] of each of the L sources (src[l]: [T, n, D] fp32, contiguous) into row dst_row[r] of dst
 * and ids[r] into dst_ids[dst_row[r]]. mean: dst rows [L*D], source l's n streams summed in order from 0 and then
 * divided by n (torch.sum over the streams, then div_: dspark_proposer.Capture.tensor); else dst rows [L*n*D],
 * copied. A row kept twice: the later wins. */
int dk_keep_rows(const float *const *src, int64_t L, int64_t n, int64_t D, const int64_t *src_row,
                 const int64_t *dst_row, const int64_t *ids, int64_t R, int mean, float *dst, int64_t *dst_ids) {
    const int64_t width = mean ? L * D : L * n * D;
    for (int64_t r = 0; r < R; r++) {
        float *out = dst + dst_row[r] * width;
        for (int64_t l = 0; l < L; l++) {
            const float *x = src[l] + src_row[r] * n * D;
            if (!mean) {
                for (int64_t i = 0; i < n * D; i++) out[l * n * D + i] = x[i];
                continue;
            }
            dk_stream_mean(x, n, D, out + l * D);
        }
        dst_ids[dst_row[r]] = ids[r];
    }
    return 0;
}
