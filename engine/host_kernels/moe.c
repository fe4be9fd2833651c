/* The MoE FFN of a decode step in one native call (loaded with gemv.c and mhc.c as one library by
 * engine/host_kernels/__init__.py; same build flags, no torch headers).
 *
 *   dk_moe_ffn   engine/model/moe.py MoE.routed_local + shared_experts, fp32:
 *                y [T, D] = sum over the local experts e, ascending, of index_add over the (token, k) pairs routed to
 *                e (token order) of Expert_e(x[t]) * w[t, k] placed before w2, then + SharedExpert(x)
 *
 * Each expert is the reference's `expert_ffn`: h = swiglu(w1 x, w3 x, limit) (reference.swiglu: silu(min(g, limit)) *
 * clamp(u, -limit, limit), NaN passing through), h *= routing weight, out = w2 h; the GEMMs are gemv.c's own
 * (dk_bf16_linear / dk_fp8_linear / dk_fp4_linear on the expert's slice of the stacks), so every product and sum is
 * the one `--kernels host` computes op by op, in the same order; only silu's exp is libm's expf instead of torch's
 * vectorised one (within 1-2 ulp). What it saves is the Python between the GEMMs: ~15 torch ops and 3 op-table
 * calls per (token, expert) pair.
 *
 * Weights: `r` and `s` point to 6 pointers each, w1, s1, w3, s3, w2, s2 (scales NULL for bf16): the routed experts'
 * stacks [E_local, I, D] / [E_local, D, I] in format fmt_r, and the shared expert's [I, D] / [D, I] in fmt_s (s NULL:
 * no shared expert). Formats as in gemv.c: 0 bf16, 1 FP8 e4m3 (128 x 128 UE8M0 blocks), 2 FP4 e2m1 (1 x 32).
 * Returns 0, -1 when out of memory.
 *
 *   dk_ffn_site  engine/model/block.py Block.hc_site("ffn") of a decode step, the MoE half of a block, fp32:
 *                h, post, comb = hc_pre(x)              dk_hc_pre (ffn_norm)
 *                weights, idx  = route(h @ gate^T)      dk_bf16_linear (the router weight as stored), dk_route
 *                out [T, n, D] = hc_expand(dk_moe_ffn(h, ...), x, post, comb)
 *
 * The same kernels with the same arguments, in the same order, as the host op table runs them op by op (hc_pre,
 * gate, moe_ffn, hc_expand), so the result is that path's bit for bit; what it saves is the Python between them:
 * four op-table wrappers, two module calls and their checks per layer and step. x [T, n, D] the residual streams;
 * fn [(2+n)n, nD], scale [3], base [(2+n)n] the site's mHC tensors; gate_w bf16 [E, D]; bias [E] or NULL, hash_ids
 * [T, K] or NULL (hash layers); the experts as in dk_moe_ffn. Returns 0, -1 when out of memory, -2 / -3 as
 * dk_hc_mixes / dk_route (n out of range, a hash-layer expert id outside [0, E)).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dk.h"

/* bytes of one [N, K] weight and of its scales in format fmt */
static int64_t w_bytes(int fmt, int64_t N, int64_t K) { return fmt == 0 ? 2 * N * K : fmt == 2 ? N * K / 2 : N * K; }
static int64_t s_bytes(int fmt, int64_t N, int64_t K) {
    return fmt == 0 ? 0 : fmt == 2 ? N * (K / 32) : ((N + 127) / 128) * ((K + 127) / 128);
}

/* one expert on M rows xg [M, D] (weights of its w1/w3/w2 at p[0..5]), each row's hidden scaled by wt[m] (wt NULL:
 * no scale) -> out [M, D]; h1, h3: scratch [M, I] */
static int expert(int fmt, const uint8_t *const *p, const float *xg, const float *wt, int64_t M, int64_t D,
                  int64_t I, float limit, float *h1, float *h3, float *out, int nt) {
    int rc = gemm(fmt, xg, p[0], p[1], h1, M, I, D, nt);
    rc |= gemm(fmt, xg, p[2], p[3], h3, M, I, D, nt);
    if (rc) return rc;
    for (int64_t m = 0; m < M; m++) {
        float *g = h1 + m * I;
        const float *u = h3 + m * I;
        for (int64_t i = 0; i < I; i++) {
            float gv = g[i], uv = u[i];
            if (limit > 0.0f) { /* comparisons, not fminf / fmaxf: NaN passes through as in torch.clamp */
                uv = uv > limit ? limit : uv < -limit ? -limit : uv;
                gv = gv > limit ? limit : gv;
            }
            g[i] = gv / (1.0f + expf(-gv)) * uv;
        }
        if (wt)
            for (int64_t i = 0; i < I; i++) g[i] *= wt[m];
    }
    return gemm(fmt, h1, p[4], p[5], out, M, D, I, nt);
}

int dk_moe_ffn(const float *x, int64_t T, int64_t D, int64_t I, float limit, const int64_t *idx, const float *wts,
               int64_t K, int64_t e_lo, int64_t e_n, int fmt_r, const void *const *r, int fmt_s,
               const void *const *s, float *y, int nthreads) {
    const int64_t P = T * K;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(2 * P * D + 2 * P * I + P + (T > 0 ? T * D : 0)) + 64);
    int64_t *tok = (int64_t *)malloc(sizeof(int64_t) * (size_t)(P > 0 ? P : 1));
    if (buf == NULL || tok == NULL) {
        free(buf), free(tok);
        return -1;
    }
    float *xg = buf, *out = xg + P * D, *h1 = out + P * D, *h3 = h1 + P * I, *wt = h3 + P * I, *sh = wt + P;
    const int64_t w13 = w_bytes(fmt_r, I, D), s13 = s_bytes(fmt_r, I, D), w2 = w_bytes(fmt_r, D, I),
                  s2 = s_bytes(fmt_r, D, I);
    int rc = 0;
    memset(y, 0, sizeof(float) * (size_t)(T * D));
    for (int64_t e = e_lo; e < e_lo + e_n && rc == 0; e++) {
        int64_t c = 0;
        for (int64_t p = 0; p < P; p++) /* the pairs routed to e in (token, k) order, as torch.where gives them */
            if (idx[p] == e) {
                tok[c] = p / K, wt[c] = wts[p];
                memcpy(xg + c * D, x + (p / K) * D, sizeof(float) * (size_t)D);
                c++;
            }
        if (c == 0) continue;
        const int64_t j = e - e_lo;
        const uint8_t *pe[6] = {(const uint8_t *)r[0] + j * w13, r[1] ? (const uint8_t *)r[1] + j * s13 : NULL,
                                (const uint8_t *)r[2] + j * w13, r[3] ? (const uint8_t *)r[3] + j * s13 : NULL,
                                (const uint8_t *)r[4] + j * w2, r[5] ? (const uint8_t *)r[5] + j * s2 : NULL};
        rc = expert(fmt_r, pe, xg, wt, c, D, I, limit, h1, h3, out, nthreads);
        for (int64_t m = 0; m < c && rc == 0; m++) {
            float *yr = y + tok[m] * D;
            const float *o = out + m * D;
            for (int64_t d = 0; d < D; d++) yr[d] += o[d];
        }
    }
    if (s != NULL && rc == 0 && T > 0) {
        const uint8_t *ps[6] = {s[0], s[1], s[2], s[3], s[4], s[5]};
        /* the shared expert on all T rows at once (M = T, like the reference's one call) */
        float *hs1 = (float *)malloc(sizeof(float) * (size_t)(2 * T * I));
        if (hs1 == NULL) {
            rc = -1;
        } else {
            rc = expert(fmt_s, ps, x, NULL, T, D, I, limit, hs1, hs1 + T * I, sh, nthreads);
            for (int64_t i = 0; i < T * D && rc == 0; i++) y[i] = y[i] + sh[i];
            free(hs1);
        }
    }
    free(buf), free(tok);
    return rc ? -1 : 0;
}

int dk_ffn_site(const float *x, int64_t T, int64_t n, int64_t D, const float *fn, const float *scale,
                const float *base, int64_t iters, float hc_eps, float norm_eps, const float *norm_w,
                const uint16_t *gate_w, int64_t E, const float *bias, const int64_t *hash_ids, int64_t K,
                float route_scale, int64_t I, float limit, int64_t e_lo, int64_t e_n, int fmt_r,
                const void *const *r, int fmt_s, const void *const *s, float *out, int nthreads) {
    const int64_t M = T > 0 ? T : 1;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(M * (2 * n + n * n + 3 * D + E + K)) + 64);
    int64_t *idx = (int64_t *)malloc(sizeof(int64_t) * (size_t)(M * K));
    if (buf == NULL || idx == NULL) {
        free(buf), free(idx);
        return -1;
    }
    float *pre = buf, *post = pre + M * n, *comb = post + M * n, *h = comb + M * n * n, *hn = h + M * D,
          *y = hn + M * D, *logits = y + M * D, *wts = logits + M * E;
    int rc = dk_hc_pre(x, fn, scale, base, norm_w, pre, post, comb, h, hn, T, n, D, iters, hc_eps, norm_eps, nthreads);
    if (!rc) rc = dk_bf16_linear(hn, gate_w, logits, T, E, D, nthreads);
    if (!rc) rc = dk_route(logits, bias, hash_ids, wts, idx, T, E, K, route_scale);
    if (!rc) rc = dk_moe_ffn(hn, T, D, I, limit, idx, wts, K, e_lo, e_n, fmt_r, r, fmt_s, s, y, nthreads);
    if (!rc) rc = dk_hc_expand(y, x, post, comb, out, T, n, D, nthreads);
    free(buf), free(idx);
    return rc;
}
