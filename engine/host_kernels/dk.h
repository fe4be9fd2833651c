/* The library's own kernels as the composed ones call them (moe.c, attn.c): gemv.c's GEMVs and mhc.c's per-token
 * ops, and `gemm`, one GEMV in weight format fmt (0 bf16, 1 FP8 e4m3 with 128 x 128 UE8M0 blocks, 2 FP4 e2m1 with
 * 1 x 32 blocks; s: the scale bytes, NULL for bf16). */
#ifndef DK_H
#define DK_H
#include <stdint.h>

/* The OpenMP runtime calls the library makes, declared here, not by <omp.h>: the library uses torch's libgomp (gcc's
 * -fopenmp; clang's -fopenmp=libgomp, build.py), and clang has no omp.h of its own without libomp installed. */
int omp_get_thread_num(void);
int omp_get_num_threads(void);
int omp_get_max_threads(void);

int dk_bf16_linear(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K, int nthreads);
int dk_fp8_linear(const float *x, const uint8_t *w, const uint8_t *s, float *y, int64_t M, int64_t N, int64_t K,
                  int nthreads);
int dk_fp4_linear(const float *x, const uint8_t *w, const uint8_t *s, float *y, int64_t M, int64_t N, int64_t K,
                  int nthreads);
int dk_rms_norm(const float *x, const float *w, float *y, int64_t T, int64_t D, float eps, int nthreads);
int dk_rope_tail(const float *x, const float *cs, const float *sn, float *y, int64_t T, int64_t H, int64_t D,
                 int64_t rd, int inverse);

static inline int gemm(int fmt, const float *x, const uint8_t *w, const uint8_t *s, float *y, int64_t M, int64_t N,
                       int64_t K, int nt) {
    if (fmt == 0) return dk_bf16_linear(x, (const uint16_t *)w, y, M, N, K, nt);
    if (fmt == 1) return dk_fp8_linear(x, w, s, y, M, N, K, nt);
    return dk_fp4_linear(x, w, s, y, M, N, K, nt);
}
#endif
