/* Native host GEMV kernels of `--kernels host` (loaded by engine/host_kernels/__init__.py; built with
 * gcc -O3 -march=native -fPIC -shared -fopenmp, no torch headers).
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
 * AVX-512 (F + BW; VBMI for the FP8 byte tables) where the compiler defines it, else a portable path that gcc
 * auto-vectorises. The AVX-512 decoders produce weight vectors in a fixed permuted element order; x is permuted
 * the same way once per call (PERM_*), so products pair up exactly.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define DK_AVX512 1
#if defined(__AVX512VBMI__)
#define DK_VBMI 1
#endif
#endif

#define DK_ABI 1
#define MT_TILE 4 /* x rows per tile */
#define NT_TILE 2 /* weight rows per tile */

enum { FMT_BF16 = 0, FMT_FP8 = 1, FMT_FP4 = 2 };

static float UE8M0[256];      /* 2^(b - 127); b = 255: NaN */
static float E4M3[256];       /* value of each float8_e4m3fn byte; 0x7F / 0xFF: NaN */
static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
static uint8_t E4M3_BF16_LO[128], E4M3_BF16_HI[128]; /* bf16 bytes of each magnitude (all exact in bf16) */
static int last_threads = 0;

__attribute__((constructor)) static void dk_init(void) {
    for (int b = 0; b < 256; b++) {
        UE8M0[b] = b == 255 ? NAN : ldexpf(1.0f, b - 127);
        int e = (b >> 3) & 0xF, m = b & 7;
        float v = (e == 15 && m == 7) ? NAN : (e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 + m), e - 10));
        E4M3[b] = (b & 0x80) ? -v : v;
    }
    for (int b = 0; b < 128; b++) {
        uint32_t u;
        memcpy(&u, &E4M3[b], 4);
        E4M3_BF16_LO[b] = (uint8_t)(u >> 16);
        E4M3_BF16_HI[b] = (uint8_t)(u >> 24);
    }
}

int dk_abi(void) { return DK_ABI; }

/* 0: portable, 1: AVX-512 F+BW, 2: AVX-512 with VBMI */
int dk_simd(void) {
#if defined(DK_VBMI)
    return 2;
#elif defined(DK_AVX512)
    return 1;
#else
    return 0;
#endif
}

int dk_max_threads(void) { return omp_get_max_threads(); }
int dk_last_threads(void) { return last_threads; }

/* ---- element order of one 64-element chunk as the decoder produces it: slot 16q + j holds element perm(q, j) */
enum { PERM_IDENT = 0, PERM_EVENODD = 1, PERM_FP8_VBMI = 2 };

static int perm_of(int kind, int q, int j) {
    if (kind == PERM_EVENODD) return 32 * (q >> 1) + 2 * j + (q & 1);          /* bf16 / fp4: evens, odds */
    if (kind == PERM_FP8_VBMI) return 16 * (j >> 2) + 8 * (q >> 1) + 2 * (j & 3) + (q & 1); /* in-lane unpacks */
    return 16 * q + j;
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
#else
    (void)fmt;
    return PERM_IDENT;
#endif
}

/* xp[m, kp] (kp = K rounded up to 64, zero padded) = x[m, K] in the decoder's element order */
static void permute_x(const float *x, float *xp, int64_t M, int64_t K, int64_t kp, int kind) {
    int idx[64];
    for (int s = 0; s < 64; s++) idx[s] = perm_of(kind, s >> 4, s & 15);
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * K;
        float *pr = xp + m * kp;
        for (int64_t k0 = 0; k0 < kp; k0 += 64)
            for (int s = 0; s < 64; s++) {
                int64_t k = k0 + idx[s];
                pr[k0 + s] = k < K ? xr[k] : 0.0f;
            }
    }
}

static inline int64_t row_bytes(int fmt, int64_t K) { return fmt == FMT_BF16 ? 2 * K : fmt == FMT_FP4 ? K / 2 : K; }
static inline int64_t chunk_off(int fmt, int64_t k0) { return fmt == FMT_BF16 ? 2 * k0 : fmt == FMT_FP4 ? k0 / 2 : k0; }

#if defined(DK_AVX512)

#if !defined(DK_VBMI)
/* 16 e4m3 codes (uint32 lanes) -> exact fp32 without byte tables: normal codes by exponent re-bias, subnormal
 * codes (|code| < 8) as m * 2^-9, NaN codes as NaN. */
static inline __m512 fp8_dec16(__m512i v) {
    __m512i mag = _mm512_and_si512(v, _mm512_set1_epi32(0x7F));
    __m512i norm = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
    __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(1.0f / 512.0f));
    __m512 r = _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)), _mm512_castsi512_ps(norm), sub);
    r = _mm512_mask_mov_ps(r, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)), _mm512_set1_ps(NAN));
    __m512i sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(r), sign));
}
#endif

/* Weight elements [k0, k0 + 64) of one row, decoded (and scaled) into w[4] in the PERM order. */
static inline __attribute__((always_inline)) void
decode(const int fmt, const uint8_t *wrow, const uint8_t *srow, int64_t k0, int64_t K, __m512 w[4]) {
    const __m512i hi16 = _mm512_set1_epi32((int)0xFFFF0000u);
    uint8_t tail[128] __attribute__((aligned(64)));
    const uint8_t *src = wrow + chunk_off(fmt, k0);
    if (k0 + 64 > K) { /* last partial chunk: zero codes beyond K (x is zero there too) */
        memset(tail, 0, sizeof tail);
        memcpy(tail, src, (size_t)(row_bytes(fmt, K) - chunk_off(fmt, k0)));
        src = tail;
    }
    if (fmt == FMT_BF16) {
        __m512i v0 = _mm512_loadu_si512(src), v1 = _mm512_loadu_si512(src + 64);
        w[0] = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16));
        w[1] = _mm512_castsi512_ps(_mm512_and_si512(v0, hi16));
        w[2] = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16));
        w[3] = _mm512_castsi512_ps(_mm512_and_si512(v1, hi16));
    } else if (fmt == FMT_FP8) {
        const __m512 sv = _mm512_set1_ps(UE8M0[srow[k0 >> 7]]);
#if defined(DK_VBMI)
        const __m512i t0 = _mm512_loadu_si512(E4M3_BF16_LO), t1 = _mm512_loadu_si512(E4M3_BF16_LO + 64);
        const __m512i t2 = _mm512_loadu_si512(E4M3_BF16_HI), t3 = _mm512_loadu_si512(E4M3_BF16_HI + 64);
        __m512i c = _mm512_loadu_si512(src);
        __m512i lo = _mm512_permutex2var_epi8(t0, c, t1); /* index bits 6:0 = magnitude */
        __m512i hi = _mm512_permutex2var_epi8(t2, c, t3);
        hi = _mm512_ternarylogic_epi32(hi, c, _mm512_set1_epi8((char)0x80), 0xF8); /* hi | (c & 0x80) */
        __m512i a = _mm512_unpacklo_epi8(lo, hi), b = _mm512_unpackhi_epi8(lo, hi); /* bf16 words */
        w[0] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), sv);
        w[1] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(a, hi16)), sv);
        w[2] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), sv);
        w[3] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(b, hi16)), sv);
#else
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++)
            w[q] = _mm512_mul_ps(fp8_dec16(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + 16 * q)))), sv);
#endif
    } else { /* FP4: the 16-entry value table times the block scale, indexed by each nibble */
        const __m512 e2m1 = _mm512_loadu_ps(E2M1);
        const __m512 ta = _mm512_mul_ps(e2m1, _mm512_set1_ps(UE8M0[srow[k0 >> 5]]));
        const __m512 tb = _mm512_mul_ps(e2m1, _mm512_set1_ps(k0 + 32 < K ? UE8M0[srow[(k0 >> 5) + 1]] : 0.0f));
        __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)src));
        __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + 16)));
        w[0] = _mm512_permutexvar_ps(v0, ta); /* index bits 3:0 = low nibble */
        w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v0, 4), ta);
        w[2] = _mm512_permutexvar_ps(v1, tb);
        w[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(v1, 4), tb);
    }
}

/* MT x rows against NT weight rows (NA accumulators per output): y[m * N + yo[r]] for m < MT, r < NT. Each x vector is
 * loaded once into a register and feeds NT FMAs (the empty asm keeps gcc from re-loading it per row as a memory
 * operand: with one load per FMA the loop is load-bound). Tile shapes measured on Zen 4 (a C sweep of MT x NT x NA):
 * M = 1: one row, four accumulators (memory-bound); M > 1: row pairs, x tiles of up to 4 (1.3-1.6x the FMA rate of
 * one row at a time). */
static inline __attribute__((always_inline)) void
tile(const int fmt, const int MT, const int NT, const int NA, const float *xp, int64_t kp,
     const uint8_t *const *wr, const uint8_t *const *sr, int64_t K, float *y, int64_t N, const int64_t *yo) {
    __m512 acc[MT_TILE][NT_TILE][4];
#pragma GCC unroll 8
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 2
        for (int r = 0; r < NT; r++)
#pragma GCC unroll 4
            for (int a = 0; a < NA; a++) acc[m][r][a] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += 64) {
        __m512 w[NT_TILE][4];
#pragma GCC unroll 2
        for (int r = 0; r < NT; r++) decode(fmt, wr[r], sr[r], k0, K, w[r]);
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++)
#pragma GCC unroll 8
            for (int m = 0; m < MT; m++) {
                __m512 xv = _mm512_loadu_ps(xp + m * kp + k0 + 16 * q);
                __asm__("" : "+v"(xv));
#pragma GCC unroll 2
                for (int r = 0; r < NT; r++) acc[m][r][q % NA] = _mm512_fmadd_ps(xv, w[r][q], acc[m][r][q % NA]);
            }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 2
        for (int r = 0; r < NT; r++) {
            __m512 t = acc[m][r][0];
#pragma GCC unroll 4
            for (int a = 1; a < NA; a++) t = _mm512_add_ps(t, acc[m][r][a]);
            y[m * N + yo[r]] = _mm512_reduce_add_ps(t);
        }
}

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

/* Output rows wr[0..NT) (y columns yo[r]) for every x row, in tiles of up to MT_TILE x rows (the weight rows stay
 * in L1 across tiles). */
static inline __attribute__((always_inline)) void
rows(const int fmt, const int NT, const float *xp, int64_t M, int64_t kp, const uint8_t *const *wr,
     const uint8_t *const *sr, int64_t K, float *y, int64_t N, const int64_t *yo) {
    if (M == 1) {
        tile(fmt, 1, NT, NT == 1 ? 4 : 2, xp, kp, wr, sr, K, y, N, yo);
        return;
    }
    for (int64_t m0 = 0; m0 < M; m0 += MT_TILE) {
        const float *xt = xp + m0 * kp;
        float *yt = y + m0 * N;
        switch (M - m0 < MT_TILE ? (int)(M - m0) : MT_TILE) {
        case 1: tile(fmt, 1, NT, 2, xt, kp, wr, sr, K, yt, N, yo); break;
        case 2: tile(fmt, 2, NT, 1, xt, kp, wr, sr, K, yt, N, yo); break;
        case 3: tile(fmt, 3, NT, 1, xt, kp, wr, sr, K, yt, N, yo); break;
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
        sr[r] = fmt == FMT_FP8 ? s + (nr >> 7) * kb : fmt == FMT_FP4 ? s + nr * sk : NULL;
    }
    if (nt == NT_TILE)
        rows(fmt, NT_TILE, xp, M, kp, wr, sr, K, y, N, yo);
    else
        rows(fmt, 1, xp, M, kp, wr, sr, K, y, N, yo);
}

static int run(const int fmt, const float *x, const uint8_t *w, const uint8_t *s, float *y, int64_t M, int64_t N,
               int64_t K, int nthreads) {
    if (M <= 0 || N <= 0) return 0;
    const int64_t kp = (K + 63) / 64 * 64;
    float *xp = NULL;
    if (kp > 0) {
        xp = (float *)aligned_alloc(64, (size_t)(M * kp) * sizeof(float));
        if (xp == NULL) return -1;
        permute_x(x, xp, M, K, kp, perm_kind(fmt));
    }
    /* weight rows per work item: M = 1: one (a single sequential stream per thread runs at the memory roof);
     * M > 1: rows n and n + half (two far-apart sequential streams; adjacent row pairs stream ~2x slower here) */
    const int nt = M == 1 ? 1 : NT_TILE;
    const int64_t half = (N + nt - 1) / nt, items = half;
    const int par = nthreads > 1 && N * (K + 1) * M >= (1 << 16);
#pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1) if (par)
    {
        if (omp_get_thread_num() == 0) last_threads = omp_get_num_threads();
#pragma omp for schedule(static)
        for (int64_t i = 0; i < items; i++) {
            const int cnt = (nt == NT_TILE && i + half >= N) ? 1 : nt;
            if (fmt == FMT_BF16)
                rows_fmt(FMT_BF16, xp, M, kp, w, s, K, y, N, i, half, cnt);
            else if (fmt == FMT_FP8)
                rows_fmt(FMT_FP8, xp, M, kp, w, s, K, y, N, i, half, cnt);
            else
                rows_fmt(FMT_FP4, xp, M, kp, w, s, K, y, N, i, half, cnt);
        }
    }
    free(xp);
    return 0;
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
