/* Native host GEMV kernels of `--kernels host` (loaded by engine/host_kernels/__init__.py, which builds one library
 * per instruction-set variant: gcc -O3 -fPIC -shared -fopenmp plus the variant's -m flags; no torch headers).
 *
 * y[M, N] = x[M, K] @ W^T, x and y fp32 row-major, fp32 accumulation, W one of
 *   dk_bf16_linear  W bf16 [N, K];
 *   dk_fp8_linear   W float8_e4m3fn bytes [N, K], UE8M0 block scales [ceil(N/128), ceil(K/128)];
 *   dk_fp4_linear   W e2m1 nibbles [N, K/2] (low nibble = even element), UE8M0 scales [N, K/32].
 * Every weight element is decoded to the exact fp32 value the torch reference (nki_kernels/reference.py)
 * dequantises it to (code value times 2^(b-127), one rounding-free product; NaN codes/scales give NaN), so the
 * results differ from the reference by fp32 summation order only.
 *
 * Work split: OpenMP over output rows n, schedule(static), `nthreads` threads (the caller passes torch's intra-op
 * thread count; the library shares torch's libgomp.so.1). Each output element is computed by one thread in a fixed
 * order, so results do not depend on the thread count. Weight rows are decoded in registers, 64 elements at a
 * time, once per tile of up to 4 x rows (the rows stay in L1 across tiles).
 *
 * Instruction sets, chosen by what the compiler targets (the variant's flags):
 *   AVX-512 F + BW (VBMI for the FP8 byte tables)  gemv_avx512.h   dk_simd() 1 (2 with VBMI)
 *   AVX2 + FMA + F16C                              gemv_avx2.h     dk_simd() 3
 *   none of these                                  the portable tile below, which gcc auto-vectorises; dk_simd() 0
 * The vector decoders produce weight vectors in a fixed permuted element order; x is permuted the same way once
 * per call (perm_of), so products pair up exactly. dk_cpu_missing() (compiled for the baseline ISA, like the table
 * set-up that runs when the library is loaded) says which of the instruction sets this build uses the running CPU
 * lacks: the loader calls it before any kernel, so a build is never run where it would fault.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "dk.h"
#include "dk_omp.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define DK_AVX512 1
#if defined(__AVX512VBMI__)
#define DK_VBMI 1
#endif
#define NT_TILE 2 /* weight rows per tile */
#elif defined(__AVX2__) && defined(__FMA__)
#define DK_AVX2 1
#else
#define NT_TILE 2
#endif

/* code that runs before the CPU check. clang's target attribute only adds to the command line's features, so there
 * "arch=x86-64" kept AVX-512 (dk_init's loops came out in zmm registers, and loading a refused avx512-vbmi build on
 * an AVX2-only CPU died with SIGILL); "no-sse3" takes away SSE3 and everything built on it, leaving SSE2. */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__clang__)
#define DK_BASELINE __attribute__((target("no-sse3")))
#elif defined(__x86_64__) || defined(__i386__)
#define DK_BASELINE __attribute__((target("arch=x86-64")))
#else
#define DK_BASELINE
#endif

#define DK_ABI 3
#if defined(DK_AVX512)
#define MT_TILE 8 /* most x rows per tile (rows(): up to 8 rows in one tile, more in tiles of 4) */
#else
#define MT_TILE 4 /* x rows per tile */
#endif

enum { FMT_BF16 = 0, FMT_FP8 = 1, FMT_FP4 = 2,
       FMT_FP8X = 3,   /* internal: FP8 against x pre-scaled by fp8_prescale (the decoded values are not scaled) */
       FMT_FP8H = 4 }; /* internal: FP8 through its fp16 pattern (gemv_avx2.h dec_fp8_f16c) */

static float UE8M0[256];      /* 2^(b - 127); b = 255: NaN */
static float E4M3[256];       /* value of each float8_e4m3fn byte; 0x7F / 0xFF: NaN */
static const float E2M1[16] __attribute__((unused)) = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
static uint8_t E4M3_BF16_LO[128], E4M3_BF16_HI[128]; /* bf16 bytes of each magnitude (all exact in bf16) */
static int last_threads = 0;
/* The AVX2 build's FP8 decoder (dk_fp8_decode): FP8_SHIFT or FP8_F16C; chosen once per process, before the first
 * FP8 call (the x permutation and the kernels must agree). Other builds have one decoder: FP8_ONLY. */
enum { FP8_ONLY = 0, FP8_SHIFT = 1, FP8_F16C = 2 };
static int fp8_decoder = FP8_ONLY;
static double subnormal_cost = 0.0; /* what the choice measured (dk_subnormal_cost) */

__attribute__((constructor)) DK_BASELINE static void dk_init(void) {
    for (int b = 0; b < 256; b++) {
        UE8M0[b] = b == 255 ? NAN : ldexpf(1.0f, b - 127);
        int e = (b >> 3) & 0xF, m = b & 7;
        float v = (e == 15 && m == 7) ? NAN : (e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 + m), e - 10));
        E4M3[b] = (b & 0x80) ? -v : v;
    }
    for (int b = 0; b < 128; b++) {
        /* a union, not memcpy: with _FORTIFY_SOURCE (Ubuntu's gcc sets it by default) memcpy is an always_inline
           wrapper that gcc refuses to inline into this baseline-target function of a -mavx2 / -mavx512f build */
        union { float f; uint32_t u; } v = {.f = E4M3[b]};
        E4M3_BF16_LO[b] = (uint8_t)(v.u >> 16);
        E4M3_BF16_HI[b] = (uint8_t)(v.u >> 24);
    }
}

DK_BASELINE int dk_abi(void) { return DK_ABI; }

/* 0: portable, 1: AVX-512 F+BW, 2: AVX-512 with VBMI, 3: AVX2 + FMA + F16C */
DK_BASELINE int dk_simd(void) {
#if defined(DK_VBMI)
    return 2;
#elif defined(DK_AVX512)
    return 1;
#elif defined(DK_AVX2)
    return 3;
#else
    return 0;
#endif
}

/* Bit i set: this build was compiled for instruction set i and the running CPU (cpuid, with the OS's register-state
 * support, as libgcc reads it) lacks it. i: 0 avx, 1 avx2, 2 fma, 3 avx512f, 4 avx512bw, 5 avx512vbmi, 6 f16c. */
DK_BASELINE int dk_cpu_missing(void) {
    int miss = 0;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
#if defined(__AVX__)
    miss |= !__builtin_cpu_supports("avx") << 0;
#endif
#if defined(__AVX2__)
    miss |= !__builtin_cpu_supports("avx2") << 1;
#endif
#if defined(__FMA__)
    miss |= !__builtin_cpu_supports("fma") << 2;
#endif
#if defined(__AVX512F__)
    miss |= !__builtin_cpu_supports("avx512f") << 3;
#endif
#if defined(__AVX512BW__)
    miss |= !__builtin_cpu_supports("avx512bw") << 4;
#endif
#if defined(__AVX512VBMI__)
    miss |= !__builtin_cpu_supports("avx512vbmi") << 5;
#endif
#if defined(__F16C__) /* cpuid leaf 1 directly (a macro: no call into code built for the variant's ISA): clang 14's
                         __builtin_cpu_supports does not know "f16c" */
    unsigned a, b, c, d;
    __cpuid(1, a, b, c, d);
    (void)a, (void)b, (void)d;
    miss |= !(c & bit_F16C) << 6;
#endif
#endif
    return miss;
}

int dk_max_threads(void) { return omp_get_max_threads(); }
/* 1: the OpenMP pragmas are compiled in (gcc -fopenmp); 0: they are not (clang -fopenmp=libgomp: clang makes OpenMP
 * code for its own libomp only), and every kernel runs on the calling thread */
int dk_parallel(void) {
#if defined(_OPENMP)
    return 1;
#else
    return 0;
#endif
}
int dk_last_threads(void) { return last_threads; }

/* ---- element order of one 64-element chunk as the decoder produces it: slot s holds element perm_of(kind, s) */
enum { PERM_IDENT = 0, PERM_EVENODD = 1, PERM_FP8_VBMI = 2, PERM_EVENODD8 = 3, PERM_FP4_AVX2 = 4, PERM_FP8_AVX2 = 5,
       PERM_FP8_F16C = 6,
       PERM_FP4_DW = 7 }; /* 128-element chunks (gemv_avx512.h tile_fp4dw): slot 16 t + j holds element 8 j + t; the
                             K % 128 elements after the last whole chunk in PERM_EVENODD's 64-element chunks */

static int perm_of(int kind, int s) {
    int q = s >> 4, j = s & 15; /* 16-lane vectors (AVX-512) */
    if (kind == PERM_EVENODD) return 32 * (q >> 1) + 2 * j + (q & 1);          /* bf16 / fp4: evens, odds */
    if (kind == PERM_FP8_VBMI) return 16 * (j >> 2) + 8 * (q >> 1) + 2 * (j & 3) + (q & 1); /* in-lane unpacks */
    q = s >> 3, j = s & 7; /* 8-lane vectors (AVX2) */
    if (kind == PERM_EVENODD8) return 16 * (q >> 1) + 2 * j + (q & 1); /* bf16: evens, odds of each 16 */
    if (kind == PERM_FP4_AVX2) /* gemv_avx2.h dec_fp4: nibble q>>2, unpack half (q>>1)&1, word q&1, lane j>>2 */
        return 32 * (j >> 2) + 16 * ((q >> 1) & 1) + 4 * (j & 3) + 2 * (q & 1) + (q >> 2);
    if (kind == PERM_FP8_AVX2) /* gemv_avx2.h dec_fp8_shift: load q>>2, byte q&3 of dword j */
        return 32 * (q >> 2) + 4 * j + (q & 3);
    if (kind == PERM_FP8_F16C) /* dec_fp8_f16c: load q>>2, its low / high 16 bytes q&1, even / odd codes (q>>1)&1 */
        return 32 * (q >> 2) + 16 * (q & 1) + 2 * j + ((q >> 1) & 1);
    return s;
}

static int perm_kind(int fmt) {
#if defined(DK_AVX512)
    if (fmt == FMT_FP8) {
#if defined(DK_VBMI)
        return PERM_FP8_VBMI;
#else
        return PERM_IDENT;
#endif
    }
    return PERM_EVENODD;
#elif defined(DK_AVX2)
    if (fmt == FMT_FP8) return fp8_decoder == FP8_F16C ? PERM_FP8_F16C : PERM_FP8_AVX2;
    return fmt == FMT_BF16 ? PERM_EVENODD8 : PERM_FP4_AVX2;
#else
    (void)fmt;
    return PERM_IDENT;
#endif
}

/* xp[m, kp] (kp = K rounded up to 64, zero padded) = x[m, K] in the decoder's element order. The avx2 build holds no
 * gather, written or made by the vectorizer (hence the attribute and pragma): QEMU 7.2's TCG computes vgatherdps
 * wrong on some hosts (scripts/emulated_cpu_check.sh on an AVX2-only Zen-1-class EPYC: 32 of 320 slots 0 from an
 * 8-gather loop whose masks were all ones; right on the hardware, and under QEMU on a Zen 4 host), and on that core
 * the plain copy took 0.69-0.78x the 8-lane gathers' time (K 1024-7168, 1 and 8 rows). */
#if defined(DK_AVX2) && defined(__clang__)
#define DK_NO_VECTORIZE _Pragma("clang loop vectorize(disable)")
#define DK_NO_VECTORIZE_FN
#elif defined(DK_AVX2)
#define DK_NO_VECTORIZE
#define DK_NO_VECTORIZE_FN __attribute__((optimize("no-tree-vectorize")))
#else
#define DK_NO_VECTORIZE
#define DK_NO_VECTORIZE_FN
#endif
static DK_NO_VECTORIZE_FN void permute_x(const float *x, float *xp, int64_t M, int64_t K, int64_t kp, int kind) {
#if defined(DK_AVX512)
    const int64_t k128 = kind == PERM_FP4_DW ? K & ~(int64_t)127 : 0; /* x[0, k128) in 128-element chunks */
    if (kind == PERM_FP4_DW) kind = PERM_EVENODD;                        /* the rest */
#endif
    int idx[64];
    for (int s = 0; s < 64; s++) idx[s] = perm_of(kind, s);
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * K;
        float *pr = xp + m * kp;
        int64_t k0 = 0;
#if defined(DK_AVX512)
        for (; k0 < k128; k0 += 128)
            for (int s = 0; s < 128; s++) pr[k0 + s] = xr[k0 + 8 * (s & 15) + (s >> 4)];
#endif
        for (; k0 + 64 <= K; k0 += 64) /* whole chunks */
            DK_NO_VECTORIZE
            for (int s = 0; s < 64; s++) pr[k0 + s] = xr[k0 + idx[s]];
        for (; k0 < kp; k0 += 64)
            for (int s = 0; s < 64; s++) {
                int64_t k = k0 + idx[s];
                pr[k0 + s] = k < K ? xr[k] : 0.0f;
            }
    }
}

/* Tiles of 4 or more x rows prefetch each weight row this many bytes ahead (gemv_avx512.h tile, gemv_avx2.h tile and
 * tile2_bf16): there the FMAs per weight byte leave the hardware prefetcher behind on cold weights. Zen 4, one
 * thread, cold, byte-identical copies of each library interleaved (placement alone moved single cells by up to
 * 1.5x): avx512-vbmi bf16 8192 x 1024 0.82-0.85x the time at 4 rows, 0.75-0.79x at 8; FP8 0.82-0.96x at 4, 1.0x
 * at 8; FP4 0.95x at 4, 1.0x at 8; avx2 bf16 0.79-0.81x, FP8 0.81-0.88x / 0.87-0.91x. Tiles of 1-2 rows do not prefetch
 * (no gain there; the FP8 one-row path has its own: FP8_PREFETCH). Batch-8 decode step: mid 60.2 -> 51.9 ms
 * (its head is 129280 x 1024 bf16), mid-v8192 27.7 -> 27.0 ms (avx2 build 33.4 -> 32.4). */
#define TILE_PREFETCH 1024

static inline int64_t row_bytes(int fmt, int64_t K) { return fmt == FMT_BF16 ? 2 * K : fmt == FMT_FP4 ? K / 2 : K; }
static inline int64_t chunk_off(int fmt, int64_t k0) { return fmt == FMT_BF16 ? 2 * k0 : fmt == FMT_FP4 ? k0 / 2 : k0; }

#if defined(DK_AVX512) || defined(DK_AVX2)
/* ---------------------------------------------------------------------------------------------------------------
 * FP8: x pre-scaled once per 128-row scale block where that is exact (gemv_avx2.h, gemv_avx512.h), in 8-lane
 * vectors (the AVX-512 builds target AVX2 too) */

/* x's exponent range over its nonzero entries (ilogbf; inf / NaN: emax 128), scalar */
static void exp_range_scalar(const float *x, int64_t n, int *emin, int *emax) {
    int lo = 1000, hi = -1000;
    for (int64_t i = 0; i < n; i++) {
        if (x[i] == 0.0f) continue;
        int e = isfinite(x[i]) ? ilogbf(x[i]) : 128;
        lo = e < lo ? e : lo;
        hi = e > hi ? e : hi;
    }
    *emin = lo, *emax = hi;
}

/* the same from the smallest and largest nonzero |x| bit patterns, 8 at a time (the exponent field is monotonic in
 * them; inf / NaN have field 255: 128); subnormal entries (rare: their ilogbf is below the field's -127) take the
 * scalar pass */
static void exp_range(const float *x, int64_t n, int *emin, int *emax) {
    const __m256i abs = _mm256_set1_epi32(0x7FFFFFFF), zero = _mm256_setzero_si256();
    __m256i lo = _mm256_set1_epi32(-1), hi = zero;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i b = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i)), abs);
        lo = _mm256_min_epu32(lo, _mm256_or_si256(b, _mm256_cmpeq_epi32(b, zero))); /* zeros as 0xFFFFFFFF */
        hi = _mm256_max_epu32(hi, b);
    }
    uint32_t l[8], h[8], mn = 0xFFFFFFFFu, mx = 0;
    _mm256_storeu_si256((__m256i *)l, lo);
    _mm256_storeu_si256((__m256i *)h, hi);
    for (int j = 0; j < 8; j++) mn = l[j] < mn ? l[j] : mn, mx = h[j] > mx ? h[j] : mx;
    for (; i < n; i++) {
        uint32_t b;
        memcpy(&b, x + i, 4);
        b &= 0x7FFFFFFFu;
        mn = b != 0 && b < mn ? b : mn, mx = b > mx ? b : mx;
    }
    if (mn < 0x00800000u) { /* a subnormal entry */
        exp_range_scalar(x, n, emin, emax);
        return;
    }
    *emin = mn == 0xFFFFFFFFu ? 1000 : (int)(mn >> 23) - 127;
    *emax = mx == 0 ? -1000 : (int)(mx >> 23) - 127;
}

/* xs[m, k] = x[m, k] * 2^(b_kb - bias) for row block `srow`'s scales (bias: 7 where the decoder gives each value
 * times 2^-120, gemv_avx2.h's shift decoder, 119 for times 2^-8, its f16c one; 127 where it gives the value itself,
 * gemv_avx512.h); 0 (and xs untouched) where that is not exact: every block's w = value * 2^(b-127) a normal fp32
 * (10 <= b <= 246) and every x * 2^(b-bias) one too (against x's exponent range emin..emax from exp_range) */
static int fp8_prescale(const float *x, float *xs, int64_t M, int64_t kp, int64_t K, const uint8_t *srow, int bias,
                        int emin, int emax) {
    const int64_t nkb = (K + 127) / 128;
    for (int64_t kb = 0; kb < nkb; kb++) {
        const int b = srow[kb], e = b - bias;
        if (b < 10 || b > 246 || (emax >= -1000 && (emax + e > 127 || emin + e < -126))) return 0;
    }
    for (int64_t kb = 0; kb < nkb; kb++) {
        const __m256 s = _mm256_set1_ps(ldexpf(1.0f, srow[kb] - bias));
        const int64_t k1 = kb * 128 + 128 < kp ? kb * 128 + 128 : kp;
        for (int64_t m = 0; m < M; m++)
            for (int64_t k = kb * 128; k < k1; k += 8)
                _mm256_storeu_ps(xs + m * kp + k, _mm256_mul_ps(_mm256_loadu_ps(x + m * kp + k), s));
    }
    return 1;
}

/* FP4: a block scale b can be applied to the block's sum instead of to each decoded value (the same products in
 * another order) where every e2m1 value times 2^(b-127) is a normal fp32: b in 2..252 (NaN scales, 255, excluded).
 * Whether every one of the n scales at s is, 32 at a time (b - 2 <= 250 as a byte); gemv_avx2.h's one-row kernel and
 * gemv_avx512.h's tile_fp4dw. */
static inline int fp4_deferrable(const uint8_t *s, int64_t n) {
    int64_t i = 0;
    int ok = 1;
    if (n >= 32) {
        const __m256i two = _mm256_set1_epi8(2), top = _mm256_set1_epi8((char)250);
        __m256i m = _mm256_setzero_si256();
        for (; i + 32 <= n; i += 32)
            m = _mm256_max_epu8(m, _mm256_sub_epi8(_mm256_loadu_si256((const __m256i *)(s + i)), two));
        ok = _mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_max_epu8(m, top), top)) == -1;
    }
    for (; i < n; i++) ok &= s[i] >= 2 && s[i] <= 252;
    return ok;
}

#endif
#if defined(DK_AVX512)
#include "gemv_avx512.h"
#elif defined(DK_AVX2)
#include "gemv_avx2.h"
#else /* portable */

static inline __attribute__((always_inline)) void
tile(const int fmt, const int MT, const int NT, const int NA, const float *xp, int64_t kp,
     const uint8_t *const *wr, const uint8_t *const *sr, int64_t K, float *y, int64_t N, const int64_t *yo) {
    (void)NA;
    for (int r = 0; r < NT; r++) {
        const uint8_t *wrow = wr[r], *srow = sr[r];
        float acc[MT_TILE][16];
        for (int m = 0; m < MT; m++)
            for (int j = 0; j < 16; j++) acc[m][j] = 0.0f;
        for (int64_t k0 = 0; k0 < K; k0 += 64) {
            float w[64];
            int n = K - k0 < 64 ? (int)(K - k0) : 64;
            if (fmt == FMT_BF16) {
                const uint16_t *p = (const uint16_t *)wrow + k0;
                for (int j = 0; j < 64; j++) {
                    uint32_t u = j < n ? (uint32_t)p[j] << 16 : 0;
                    memcpy(&w[j], &u, 4);
                }
            } else if (fmt == FMT_FP8) {
                const float s = UE8M0[srow[k0 >> 7]];
                for (int j = 0; j < 64; j++) w[j] = j < n ? E4M3[wrow[k0 + j]] * s : 0.0f;
            } else {
                const uint8_t *p = wrow + k0 / 2;
                for (int j = 0; j < 64; j++)
                    w[j] = j < n ? E2M1[(p[j >> 1] >> (4 * (j & 1))) & 0xF] * UE8M0[srow[(k0 + j) >> 5]] : 0.0f;
            }
            for (int m = 0; m < MT; m++)
                for (int q = 0; q < 4; q++)
                    for (int j = 0; j < 16; j++) acc[m][j] += xp[m * kp + k0 + 16 * q + j] * w[16 * q + j];
        }
        for (int m = 0; m < MT; m++) {
            float t = 0.0f;
            for (int j = 0; j < 16; j++) t += acc[m][j];
            y[m * N + yo[r]] = t;
        }
    }
}

#endif

#if !defined(DK_AVX2) /* gemv_avx2.h has its own driver */
/* Output rows wr[0..NT) (y columns yo[r]) for every x row, in tiles of up to MT_TILE x rows (the weight rows stay
 * in L1 across tiles). */
static inline __attribute__((always_inline)) void
rows(const int fmt, const int NT, const float *xp, int64_t M, int64_t kp, const uint8_t *const *wr,
     const uint8_t *const *sr, int64_t K, float *y, int64_t N, const int64_t *yo) {
    if (M == 1) {
        tile(fmt, 1, NT, NT == 1 ? 4 : 2, xp, kp, wr, sr, K, y, N, yo);
        return;
    }
    /* up to MT_TILE rows in one tile, so each weight chunk is decoded once (AVX-512, Zen 4, one thread, cold,
     * interleaved A/B against tiles of 4: 0.79-0.93x the time at M = 5 and 8 for FP8, FP4 and bf16); more rows in
     * tiles of 4 (tiles of 8 measured 1.17-1.37x slower for bf16 from M = 16) */
    const int64_t mt = M <= MT_TILE ? M : 4;
    for (int64_t m0 = 0; m0 < M; m0 += mt) {
        const float *xt = xp + m0 * kp;
        float *yt = y + m0 * N;
        switch (M - m0 < mt ? (int)(M - m0) : (int)mt) {
        case 1: tile(fmt, 1, NT, 2, xt, kp, wr, sr, K, yt, N, yo); break;
        case 2: tile(fmt, 2, NT, 1, xt, kp, wr, sr, K, yt, N, yo); break;
        case 3: tile(fmt, 3, NT, 1, xt, kp, wr, sr, K, yt, N, yo); break;
#if MT_TILE > 4
        case 5: tile(fmt, 5, NT, 1, xt, kp, wr, sr, K, yt, N, yo); break;
        case 6: tile(fmt, 6, NT, 1, xt, kp, wr, sr, K, yt, N, yo); break;
        case 7: tile(fmt, 7, NT, 1, xt, kp, wr, sr, K, yt, N, yo); break;
        case 8: tile(fmt, 8, NT, 1, xt, kp, wr, sr, K, yt, N, yo); break;
#endif
        default: tile(fmt, 4, NT, 1, xt, kp, wr, sr, K, yt, N, yo); break;
        }
    }
}

static inline __attribute__((always_inline)) void
rows_fmt(const int fmt, const float *xp, int64_t M, int64_t kp, const uint8_t *w, const uint8_t *s, int64_t K,
         float *y, int64_t N, int64_t n, int64_t step, int nt) {
    const int64_t wstride = row_bytes(fmt, K), kb = (K + 127) / 128, sk = K / 32;
    const uint8_t *wr[NT_TILE], *sr[NT_TILE];
    int64_t yo[NT_TILE];
    for (int r = 0; r < nt; r++) {
        int64_t nr = n + r * step;
        yo[r] = nr;
        wr[r] = w + nr * wstride;
        sr[r] = fmt == FMT_FP8 || fmt == FMT_FP8X ? s + (nr >> 7) * kb : fmt == FMT_FP4 ? s + nr * sk : NULL;
    }
    if (nt == NT_TILE)
        rows(fmt, NT_TILE, xp, M, kp, wr, sr, K, y, N, yo);
    else
        rows(fmt, 1, xp, M, kp, wr, sr, K, y, N, yo);
}

#endif

#if defined(DK_AVX512)
/* rows_fmt for FP4 on tile_fp4dw (M <= 3, deferrable scales, x in PERM_FP4_DW) */
static void rows_fp4dw(const float *xp, int64_t M, int64_t kp, const uint8_t *w, const uint8_t *s, int64_t K, float *y,
                       int64_t N, int64_t n, int64_t step, int nt) {
    const uint8_t *wr[NT_TILE], *sr[NT_TILE];
    int64_t yo[NT_TILE];
    for (int r = 0; r < nt; r++) yo[r] = n + r * step, wr[r] = w + yo[r] * (K / 2), sr[r] = s + yo[r] * (K / 32);
#define DW(MT)                                                                                                         \
    (nt == NT_TILE ? tile_fp4dw(MT, NT_TILE, xp, kp, wr, sr, K, y, N, yo)                                              \
                   : tile_fp4dw(MT, 1, xp, kp, wr, sr, K, y, N, yo))
    if (M == 1) DW(1);
    else if (M == 2) DW(2);
    else DW(3);
#undef DW
}
#endif

#if defined(DK_AVX512)
/* run1_fp8's items (a parallel region's share of them, or all): rows i and i + half */
static void run1_fp8_items(const float *xp, int64_t kp, const uint8_t *w, const uint8_t *s, int64_t K, float *y,
                           int64_t N, int emin, int emax) {
    const int64_t kb = (K + 127) / 128, half = (N + 1) / 2;
    if (omp_get_thread_num() == 0) last_threads = omp_get_num_threads();
    float *xs = (float *)aligned_alloc(64, (size_t)(2 * kp) * sizeof(float));
    int64_t cur[2] = {-1, -1};
    int exact[2] = {0, 0};
#pragma omp for schedule(static)
    for (int64_t i = 0; i < half; i++) {
        const int cnt = i + half < N ? 2 : 1;
        const int64_t nr[2] = {i, i + half};
        for (int r = 0; r < cnt && xs != NULL; r++)
            if (nr[r] >> 7 != cur[r])
                cur[r] = nr[r] >> 7,
                exact[r] = fp8_prescale(xp, xs + r * kp, 1, kp, K, s + cur[r] * kb, 127, emin, emax);
        if (cnt == 2 && exact[0] && exact[1]) {
            tile_fp8x2(xs, xs + kp, w + nr[0] * K, w + nr[1] * K, K, y + nr[0], y + nr[1]);
            continue;
        }
        for (int r = 0; r < cnt; r++)
            if (exact[r])
                rows_fmt(FMT_FP8X, xs + r * kp, 1, kp, w, s, K, y, N, nr[r], 0, 1);
            else
                rows_fmt(FMT_FP8, xp, 1, kp, w, s, K, y, N, nr[r], 0, 1);
    }
    free(xs);
}

/* FP8, one x row (AVX-512): x pre-scaled per 128-row scale block where that is exact (fp8_prescale), one per-thread
 * copy for each of an item's two rows (rows n and n + half: they lie in different blocks), and the decoded values
 * used unscaled on tile_fp8x2: the same products (x * 2^(b-127)) * value = x * (value * 2^(b-127)), without a
 * multiply per decoded vector; a row whose block is not exact (or without memory for the copies) on the one-row tile
 * with the scaled decode, which sums in the same order. Returns 0 (needs no memory it cannot do without). */
static __attribute__((noinline)) int run1_fp8(const float *xp, int64_t kp, const uint8_t *w, const uint8_t *s,
                                              int64_t K, float *y, int64_t N, int nthreads, int par) {
    int emin = 0, emax = 0;
    exp_range(xp, kp, &emin, &emax);
    DK_PARALLEL(par, nthreads, run1_fp8_items(xp, kp, w, s, K, y, N, emin, emax));
    return 0;
}
#endif

#if defined(DK_AVX512)
/* runm_fp8's items (a parallel region's share of them, or all): the 128-row scale blocks */
static void runm_fp8_items(const float *xp, int64_t M, int64_t kp, const uint8_t *w, const uint8_t *s, int64_t K,
                           float *y, int64_t N, int emin, int emax) {
    const int64_t kb = (K + 127) / 128, nblk = (N + 127) / 128;
    if (omp_get_thread_num() == 0) last_threads = omp_get_num_threads();
    float *xs = (float *)aligned_alloc(64, (size_t)(M * kp) * sizeof(float));
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < nblk; blk++) {
        const int64_t r0 = blk * 128, rows = N - r0 < 128 ? N - r0 : 128, half = (rows + 1) / 2;
        const int exact = xs != NULL && fp8_prescale(xp, xs, M, kp, K, s + blk * kb, 127, emin, emax);
        for (int64_t i = 0; i < half; i++) {
            const int cnt = i + half < rows ? NT_TILE : 1;
            if (exact)
                rows_fmt(FMT_FP8X, xs, M, kp, w, s, K, y, N, r0 + i, half, cnt);
            else
                rows_fmt(FMT_FP8, xp, M, kp, w, s, K, y, N, r0 + i, half, cnt);
        }
    }
    free(xs);
}

/* FP8 at 2..MT_TILE x rows (AVX-512): each 128-row scale block in one pass, its rows paired within it (n and
 * n + half of the block's rows: two sequential streams, as at one row), x pre-scaled once per block where that is
 * exact (fp8_prescale, as run1_fp8) so the tiles decode the values unscaled (FMT_FP8X: no multiply per decoded
 * vector); a block where it is not exact (or without memory for the copy) on the scaled decode. Each output is the
 * same number either way (the same products, summed in the tile's order). Zen 4, one thread, cold, paired medians
 * of 5 runs of a C harness against the rows n, n + N/2 tiles with the scaled decode: 0.89-0.91x the time at 2 x rows
 * (1024 x 1024, 4096 x 1024, 512 x 1024), 0.91x at 3, 0.92x at 4, 0.92-0.95x at 8. Returns 0. */
static __attribute__((noinline)) int runm_fp8(const float *xp, int64_t M, int64_t kp, const uint8_t *w,
                                              const uint8_t *s, int64_t K, float *y, int64_t N, int nthreads,
                                              int par) {
    int emin = 0, emax = 0;
    exp_range(xp, M * kp, &emin, &emax);
    DK_PARALLEL(par, nthreads, runm_fp8_items(xp, M, kp, w, s, K, y, N, emin, emax));
    return 0;
}
#endif

/* The FP8 decoder this process uses (FP8_ONLY in builds with one): want FP8_SHIFT or FP8_F16C sets it (tests: each
 * must be exact; not while a kernel runs), -1 asks, choosing on the first call (gemv_avx2.h fp8_choose). */
int dk_fp8_decode(int want) {
#if defined(DK_AVX2)
    if (want == FP8_SHIFT || want == FP8_F16C) fp8_decoder = want;
    else if (fp8_decoder == FP8_ONLY) fp8_choose();
#else
    (void)want;
#endif
    return fp8_decoder;
}

/* An FMA with a subnormal input against one with normal inputs, time ratio, as the choice measured (0: not run) */
double dk_subnormal_cost(void) { return subnormal_cost; }

#if !defined(DK_AVX2)
/* run's items (a parallel region's share of them, or all): weight rows i and i + half (nt == NT_TILE; one row for
 * the last item where N is odd), or row i */
static void run_items(const int fmt, const int dw, const float *xp, int64_t M, int64_t kp, const uint8_t *w,
                      const uint8_t *s, int64_t K, float *y, int64_t N, const int nt) {
    const int64_t half = (N + nt - 1) / nt, items = half;
    if (omp_get_thread_num() == 0) last_threads = omp_get_num_threads();
#pragma omp for schedule(static)
    for (int64_t i = 0; i < items; i++) {
        const int cnt = (nt == NT_TILE && i + half >= N) ? 1 : nt;
        if (fmt == FMT_BF16)
            rows_fmt(FMT_BF16, xp, M, kp, w, s, K, y, N, i, half, cnt);
        else if (fmt == FMT_FP8)
            rows_fmt(FMT_FP8, xp, M, kp, w, s, K, y, N, i, half, cnt);
#if defined(DK_AVX512)
        else if (dw)
            rows_fp4dw(xp, M, kp, w, s, K, y, N, i, half, cnt);
#endif
        else
            rows_fmt(FMT_FP4, xp, M, kp, w, s, K, y, N, i, half, cnt);
    }
}
#endif

static int run(const int fmt, const float *x, const uint8_t *w, const uint8_t *s, float *y, int64_t M, int64_t N,
               int64_t K, int nthreads) {
    if (M <= 0 || N <= 0) return 0;
#if defined(DK_AVX2)
    if (fmt == FMT_FP8 && fp8_decoder == FP8_ONLY) dk_fp8_decode(-1); /* before x is permuted for it */
#endif
    const int64_t kp = (K + 63) / 64 * 64;
#if defined(DK_AVX512) /* FP4 at up to 3 x rows, every row's scales deferrable: tile_fp4dw */
    const int dw = fmt == FMT_FP4 && M <= 3 && fp4_deferrable(s, N * (K / 32));
#else
    const int dw = 0;
#endif
    float *xp = NULL;
    if (kp > 0) {
        xp = (float *)aligned_alloc(64, (size_t)(M * kp) * sizeof(float));
        if (xp == NULL) return -1;
        permute_x(x, xp, M, K, kp, dw ? PERM_FP4_DW : perm_kind(fmt));
    }
    const int par = nthreads > 1 && N * (K + 1) * M >= (1 << 16);
#if defined(DK_AVX2)
    const int rc = avx2_run(fmt, xp, M, kp, w, s, K, y, N, par ? nthreads : 1);
    free(xp);
    return rc;
#else
#if defined(DK_AVX512)
    if (M == 1 && fmt == FMT_FP8) { /* run1_fp8: a function of its own, so the tiles below compile as before */
        const int rc = run1_fp8(xp, kp, w, s, K, y, N, nthreads, par);
        free(xp);
        return rc;
    }
    if (M <= MT_TILE && fmt == FMT_FP8) { /* runm_fp8: likewise */
        const int rc = runm_fp8(xp, M, kp, w, s, K, y, N, nthreads, par);
        free(xp);
        return rc;
    }
#endif
    /* weight rows per work item: M > 1: rows n and n + half (two far-apart sequential streams; adjacent row pairs
     * stream ~2x slower here); M = 1: one row, but on AVX-512 two for bf16 and FP4 (Zen 4, one thread, interleaved
     * A/B against one row: bf16 0.79x the time at 129280 x 1024, the V4 head, 0.83x at 8192 and 512 x 1024, cold;
     * FP4 0.85-0.92x at 512 x 1024 and 1024 x 512, warm or cold; FP8 up to MT_TILE x rows: run1_fp8 / runm_fp8) */
#if defined(DK_AVX512)
    const int nt = NT_TILE;
#else
    const int nt = M == 1 ? 1 : NT_TILE;
#endif
    DK_PARALLEL(par, nthreads, run_items(fmt, dw, xp, M, kp, w, s, K, y, N, nt));
    free(xp);
    return 0;
#endif
}

int dk_bf16_linear(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K, int nthreads) {
    return run(FMT_BF16, x, (const uint8_t *)w, NULL, y, M, N, K, nthreads);
}

int dk_fp8_linear(const float *x, const uint8_t *w, const uint8_t *s, float *y, int64_t M, int64_t N, int64_t K,
                  int nthreads) {
    return run(FMT_FP8, x, w, s, y, M, N, K, nthreads);
}

int dk_fp4_linear(const float *x, const uint8_t *w, const uint8_t *s, float *y, int64_t M, int64_t N, int64_t K,
                  int nthreads) {
    return run(FMT_FP4, x, w, s, y, M, N, K, nthreads);
}

/* reference.grouped_out_proj with a bf16 weight: y [M, G*R] = concat_g x[:, g*Kg:(g+1)*Kg] @ W[g*R:(g+1)*R]^T,
 * x fp32 [M, G*Kg], W bf16 [G*R, Kg] (V4's wo_a): each group one dk_bf16_linear on a contiguous copy of its x
 * columns. -1: out of memory. */
int dk_bf16_grouped_linear(const float *x, const uint16_t *w, float *y, int64_t M, int64_t G, int64_t R, int64_t Kg,
                           int nthreads) {
    float *xg = (float *)malloc((size_t)(M * Kg) * sizeof(float));
    float *yg = (float *)malloc((size_t)(M * R) * sizeof(float));
    int rc = xg == NULL || yg == NULL ? -1 : 0;
    for (int64_t g = 0; g < G && rc == 0; g++) {
        for (int64_t m = 0; m < M; m++) memcpy(xg + m * Kg, x + (m * G + g) * Kg, (size_t)Kg * sizeof(float));
        rc = run(FMT_BF16, xg, (const uint8_t *)(w + g * R * Kg), NULL, yg, M, R, Kg, nthreads);
        for (int64_t m = 0; m < M; m++) memcpy(y + m * G * R + g * R, yg + m * R, (size_t)R * sizeof(float));
    }
    free(xg);
    free(yg);
    return rc;
}
