/* Native host kernels of `--kernels host` for the small per-token ops of a decode step (loaded with gemv.c as one
 * library by engine/host_kernels/__init__.py; same build flags, no torch headers).
 *
 * At decode sizes (a few tokens, D ~ 1e2..1e4) these ops cost microseconds of arithmetic but tens to hundreds of
 * microseconds as chains of torch / NumPy ops (the mHC mixing weights are ~45 tiny ops per site: a linear, a norm,
 * sigmoids, a softmax and 20 Sinkhorn steps). Each function here is one pass over its inputs with the reference's
 * formula and operation order (nki_kernels/reference.py), fp32 throughout; results differ from the reference by
 * fp32 summation order and libm's exp / sqrt rounding only.
 *
 *   dk_hc_mixes    reference.hc_mixes     x [T, n*D] fp32, fn [(2+n)*n, n*D] fp32 -> pre [T, n], post [T, n],
 *                                         comb [T, n, n]
 *   dk_rms_norm    reference.rms_norm     x [T, D], weight [D] (or NULL) -> y [T, D]
 *   dk_hc_collapse reference.hc_collapse  x [T, n, D], pre [T, n] -> y [T, D]
 *   dk_hc_expand   reference.hc_expand    y [T, D], x [T, n, D], post [T, n], comb [T, n, n] -> out [T, n, D]
 *
 * Dot products and sums of squares use 16 independent partial sums (gcc vectorises the lanes; the lane order is
 * fixed, so results do not depend on the thread count). Rows t are split over `nthreads` OpenMP threads when the
 * work is large enough to pay for it.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <omp.h>

#define LANES 16
#define PAR_MIN (1 << 16) /* multiply-adds below which one thread does all rows */

/* sum_k a[k] * b[k] (b == NULL: sum_k a[k]^2) in 16 lanes, lanes added in a fixed tree */
static inline float dot(const float *a, const float *b, int64_t k) {
    float acc[LANES] = {0};
    int64_t i = 0;
    if (b) {
        for (; i + LANES <= k; i += LANES)
            for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
        for (; i < k; i++) acc[i % LANES] += a[i] * b[i];
    } else {
        for (; i + LANES <= k; i += LANES)
            for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * a[i + j];
        for (; i < k; i++) acc[i % LANES] += a[i] * a[i];
    }
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    return acc[0];
}

static inline float sigmoidf(float v) { return 1.0f / (1.0f + expf(-v)); }

int dk_hc_mixes(const float *x, const float *fn, const float *scale, const float *base, float *pre, float *post,
                float *comb, int64_t T, int64_t n, int64_t D, int64_t iters, float hc_eps, float norm_eps,
                int nthreads) {
    if (n <= 0 || n > 16) return -2;
    const int64_t K = n * D, M = (2 + n) * n;
#pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1) if (T * M * K >= PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *v = x + t * K;
        float mix[(2 + 16) * 16];
        const float r = 1.0f / sqrtf(dot(v, NULL, K) / (float)K + norm_eps);
        for (int64_t j = 0; j < M; j++) mix[j] = dot(v, fn + j * K, K) * r;
        for (int64_t i = 0; i < n; i++) {
            pre[t * n + i] = sigmoidf(scale[0] * mix[i] + base[i]) + hc_eps;
            post[t * n + i] = 2.0f * sigmoidf(scale[1] * mix[n + i] + base[n + i]);
        }
        float *a = comb + t * n * n; /* a[j * n + k]: from stream j to stream k */
        for (int64_t j = 0; j < n; j++) {  /* softmax over k, + eps */
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
    return 0;
}

int dk_rms_norm(const float *x, const float *w, float *y, int64_t T, int64_t D, float eps, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1) if (T * D >= PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * D;
        float *yr = y + t * D;
        const float r = 1.0f / sqrtf(dot(xr, NULL, D) / (float)D + eps);
        if (w)
            for (int64_t d = 0; d < D; d++) yr[d] = xr[d] * r * w[d];
        else
            for (int64_t d = 0; d < D; d++) yr[d] = xr[d] * r;
    }
    return 0;
}

int dk_hc_collapse(const float *x, const float *pre, float *y, int64_t T, int64_t n, int64_t D, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1) if (T * n * D >= PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        float *yr = y + t * D;
        const float *xt = x + t * n * D, *p = pre + t * n;
        for (int64_t d = 0; d < D; d++) yr[d] = p[0] * xt[d];
        for (int64_t j = 1; j < n; j++)
            for (int64_t d = 0; d < D; d++) yr[d] += p[j] * xt[j * D + d];
    }
    return 0;
}

int dk_hc_expand(const float *y, const float *x, const float *post, const float *comb, float *out, int64_t T,
                 int64_t n, int64_t D, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1) if (T * n * n * D >= PAR_MIN)
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
    return 0;
}

/* reference.sparse_attn: q [B, T, H, D] fp32, kv [B, N, D] fp32, valid [B, T, N] bytes (0/1), sink [H] fp32 ->
 * o [B, T, H, D] fp32 = sum_j exp(l_j) kv_j / (sum_j exp(l_j) + exp(sink_h)) over valid keys j, l_j = scale q.kv_j,
 * computed as the reference's partial + merge: m = max valid logit, p_j = exp(l_j - m), acc = sum p_j kv_j,
 * l = sum p_j, M = max(m, sink), w = exp(m - M) (0 with no valid key), o = acc * w / (exp(sink - M) + l * w).
 * `logits` is caller scratch of N floats per thread (nthreads * N). */
int dk_sparse_attn(const float *q, const float *kv, const uint8_t *valid, const float *sink, float *o,
                   float *logits, int64_t B, int64_t T, int64_t H, int64_t N, int64_t D, float scale, int nthreads) {
    const int par = nthreads > 1 && B * T * H * N * D >= PAR_MIN;
#pragma omp parallel num_threads(par ? nthreads : 1)
    {
        float *lg = logits + (int64_t)omp_get_thread_num() * N;
#pragma omp for schedule(static) collapse(2)
        for (int64_t bt = 0; bt < B * T; bt++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t b = bt / T;
                const float *qv = q + (bt * H + h) * D, *keys = kv + b * N * D;
                const uint8_t *ok = valid + bt * N;
                float *out = o + (bt * H + h) * D;
                float m = -INFINITY, l = 0.0f;
                for (int64_t j = 0; j < N; j++)
                    if (ok[j]) {
                        lg[j] = dot(qv, keys + j * D, D) * scale;
                        m = lg[j] > m ? lg[j] : m;
                    }
                for (int64_t d = 0; d < D; d++) out[d] = 0.0f;
                if (m != -INFINITY)
                    for (int64_t j = 0; j < N; j++)
                        if (ok[j]) {
                            const float p = expf(lg[j] - m), *kj = keys + j * D;
                            l += p;
                            for (int64_t d = 0; d < D; d++) out[d] += p * kj[d];
                        }
                const float s = sink[h], mm = m > s ? m : s;
                const float w = m == -INFINITY ? 0.0f : expf(m - mm), den = expf(s - mm) + l * w;
                for (int64_t d = 0; d < D; d++) out[d] = out[d] * w / den;
            }
    }
    return 0;
}
