/* The library's own kernels as the composed ones call them (moe.c, attn.c): gemv.c's GEMVs, mhc.c's per-token ops
 * (mHC, norms, RoPE, the router) and `gemm`, one GEMV in weight format fmt (0 bf16, 1 FP8 e4m3 with 128 x 128 UE8M0
 * blocks, 2 FP4 e2m1 with 1 x 32 blocks; s: the scale bytes, NULL for bf16). */
#ifndef DK_H
#define DK_H
#include <stdint.h>

int dk_bf16_linear(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K, int nthreads);
int dk_fp8_linear(const float *x, const uint8_t *w, const uint8_t *s, float *y, int64_t M, int64_t N, int64_t K,
                  int nthreads);
int dk_fp4_linear(const float *x, const uint8_t *w, const uint8_t *s, float *y, int64_t M, int64_t N, int64_t K,
                  int nthreads);
int dk_rms_norm(const float *x, const float *w, float *y, int64_t T, int64_t D, float eps, int nthreads);
int dk_rope_tail(const float *x, const float *cs, const float *sn, float *y, int64_t T, int64_t H, int64_t D,
                 int64_t rd, int inverse);
int dk_hc_mixes(const float *x, const float *fn, const float *scale, const float *base, float *pre, float *post,
                float *comb, int64_t T, int64_t n, int64_t D, int64_t iters, float hc_eps, float norm_eps,
                int nthreads);
int dk_hc_collapse(const float *x, const float *pre, float *y, int64_t T, int64_t n, int64_t D, int nthreads);
/* o [D] = the mean of x's n streams ([n, D]) as torch's sum and division make it (Capture.tensor): added in order from
 * 0, then divided by n (torch adds in that order while n <= 4 or D % 64 == 0) */
void dk_stream_mean(const float *x, int64_t n, int64_t D, float *o);
int dk_keep_rows(const float *const *src, int64_t L, int64_t n, int64_t D, const int64_t *src_row,
                 const int64_t *dst_row, const int64_t *ids, int64_t R, int mean, float *dst, int64_t *dst_ids);
int dk_hc_pre(const float *x, const float *fn, const float *scale, const float *base, const float *norm_w,
              float *pre, float *post, float *comb, float *h, float *y, int64_t T, int64_t n, int64_t D, int64_t iters,
              float hc_eps, float norm_eps, int nthreads);
int dk_hc_expand(const float *y, const float *x, const float *post, const float *comb, float *out, int64_t T,
                 int64_t n, int64_t D, int nthreads);
int dk_sparse_attn(const float *q, const float *kv, const uint8_t *valid, const float *sink, float *o,
                   float *scratch, int64_t scratch_n, int64_t B, int64_t T, int64_t H, int64_t N, int64_t D,
                   float scale, int nthreads);
int dk_attn_heads_per_pass(void);
int dk_hc_head(const float *x, const float *fn, const float *scale, const float *base, float *y, int64_t T,
               int64_t n, int64_t D, float hc_eps, float norm_eps, int nthreads);
int dk_bf16_grouped_linear(const float *x, const uint16_t *w, float *y, int64_t M, int64_t G, int64_t R, int64_t Kg,
                           int nthreads);
int dk_route(const float *logits, const float *bias, const int64_t *hash_ids, float *weights, int64_t *indices,
             int64_t T, int64_t E, int64_t K, float route_scale);

int dk_ffn_site(const float *x, int64_t T, int64_t n, int64_t D, const float *fn, const float *scale,
                const float *base, int64_t iters, float hc_eps, float norm_eps, const float *norm_w,
                const uint16_t *gate_w, int64_t E, const float *bias, const int64_t *hash_ids, int64_t K,
                float route_scale, int64_t I, float limit, int64_t e_lo, int64_t e_n, int fmt_r,
                const void *const *r, int fmt_s, const void *const *s, float *out, int nthreads);

/* One decode layer's static arguments (attn.c dk_decode_layer): its three parts' (dk_attn_front, dk_attn_decode,
 * dk_ffn_site) in their order. Python's mirror: engine/host_kernels/layer_ops.py DkLayer (same fields, same types,
 * same order). Integers are int64_t and floats float throughout, so the layout has no padding surprises. */
typedef struct {
    /* the attention site's front */
    const float *a_fn, *a_scale, *a_base;
    int64_t iters;
    float hc_eps, norm_eps;
    const float *a_norm;
    int64_t fa;
    const uint8_t *wa, *sa;
    const float *q_norm;
    int64_t Q, fb;
    const uint8_t *wb, *sb;
    int64_t H, D, fk;
    const uint8_t *wk, *sk;
    const float *kv_norm;
    int64_t rd;
    float eps, scale;
    int64_t P;
    const int *pf;
    const void *const *pw, *const *ps;
    const int64_t *pn;
    /* the attention core and tail */
    float *ring;
    int64_t wl;
    const float *pool;
    int64_t epb;
    const float *sink;
    const uint16_t *wo_a;
    int64_t G, R, fo;
    const uint8_t *wo, *so;
    int64_t C;
    void *states[2][5]; /* per compressor: state kv, state score, ape, its norm's weight, its entry pool */
    int64_t W[2], rows[2], cepb[2], cm[2], cd[2]; /* state width, rows; pool entries per block, ratio, entry dim */
    float ceps[2];                                /* its norm's eps */
    /* the MoE half */
    const float *f_fn, *f_scale, *f_base, *f_norm;
    const uint16_t *gate_w;
    int64_t E;
    const float *bias;
    int64_t K;
    float route_scale, limit;
    int64_t I, e_lo, e_n, fmt_r;
    const void *const *r;
    int64_t fmt_s;
    const void *const *s;
    /* both halves */
    int64_t n, dim;
} dk_layer;

/* dk_attn_decode's per-compressor arguments: CPTR pointers (kv, score [B, W]; state kv, score [S, rows, W]; ape
 * [m, W]; state rows, phases [B]; the closing blocks' rows in the step [K], their block ids [K], cos, sin [K, rd/2]
 * at their first positions; the norm's weight [d]; the entry pool [NB, epb, d]) and CDIM integers (W, rows, K, epb,
 * m, d). engine/host_kernels/attn_ops.py packs them in this order. */
enum { CPTR = 13, CDIM = 6 };

static inline int gemm(int fmt, const float *x, const uint8_t *w, const uint8_t *s, float *y, int64_t M, int64_t N,
                       int64_t K, int nt) {
    if (fmt == 0) return dk_bf16_linear(x, (const uint16_t *)w, y, M, N, K, nt);
    if (fmt == 1) return dk_fp8_linear(x, w, s, y, M, N, K, nt);
    return dk_fp4_linear(x, w, s, y, M, N, K, nt);
}
#endif
