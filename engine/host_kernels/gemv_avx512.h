/* AVX-512 (F + BW; VBMI for the FP8 byte tables) decoders and tiles of gemv.c, which includes this file when the
 * compiler targets AVX-512 F and BW (the "avx512" and "avx512-vbmi" builds). The decoders produce weight vectors in
 * a fixed permuted element order (gemv.c perm_of: PERM_EVENODD, PERM_FP8_VBMI, PERM_IDENT; PERM_FP4_DW for FP4 at up
 * to 3 x rows, tile_fp4dw); x is permuted the same way once per call, so products pair up exactly. FP8 at one x row
 * decodes the values unscaled (FMT_FP8X) against x pre-scaled per 128 x 128 block (gemv.c fp8_prescale, as
 * gemv_avx2.h does), two weight rows at a time (tile_fp8x2): on Zen 4 the four multiplies per 64 decoded elements
 * were half of the FMA pipe's work. */
#include <immintrin.h>

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

/* Weight elements [k0, k0 + 64) of one row, decoded (and scaled) into w[4] in the PERM order: from the row itself
 * (src NULL) or from `src`, a zero-padded copy of a last partial chunk (chunk_copy). */
static inline __attribute__((always_inline)) void
decode(const int fmt, const uint8_t *wrow, const uint8_t *srow, int64_t k0, int64_t K, __m512 w[4],
       const uint8_t *src) {
    const __m512i hi16 = _mm512_set1_epi32((int)0xFFFF0000u);
    if (src == NULL) src = wrow + chunk_off(fmt, k0);
    if (fmt == FMT_BF16) {
        __m512i v0 = _mm512_loadu_si512(src), v1 = _mm512_loadu_si512(src + 64);
        w[0] = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16));
        w[1] = _mm512_castsi512_ps(_mm512_and_si512(v0, hi16));
        w[2] = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16));
        w[3] = _mm512_castsi512_ps(_mm512_and_si512(v1, hi16));
    } else if (fmt == FMT_FP8 || fmt == FMT_FP8X) { /* FP8X: x carries the scale (fp8_prescale) */
        const __m512 sv = _mm512_set1_ps(fmt == FMT_FP8 ? UE8M0[srow[k0 >> 7]] : 1.0f);
#if defined(DK_VBMI)
        const __m512i t0 = _mm512_loadu_si512(E4M3_BF16_LO), t1 = _mm512_loadu_si512(E4M3_BF16_LO + 64);
        const __m512i t2 = _mm512_loadu_si512(E4M3_BF16_HI), t3 = _mm512_loadu_si512(E4M3_BF16_HI + 64);
        __m512i c = _mm512_loadu_si512(src);
        __m512i lo = _mm512_permutex2var_epi8(t0, c, t1); /* index bits 6:0 = magnitude */
        __m512i hi = _mm512_permutex2var_epi8(t2, c, t3);
        hi = _mm512_ternarylogic_epi32(hi, c, _mm512_set1_epi8((char)0x80), 0xF8); /* hi | (c & 0x80) */
        __m512i a = _mm512_unpacklo_epi8(lo, hi), b = _mm512_unpackhi_epi8(lo, hi); /* bf16 words */
        w[0] = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
        w[1] = _mm512_castsi512_ps(_mm512_and_si512(a, hi16));
        w[2] = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
        w[3] = _mm512_castsi512_ps(_mm512_and_si512(b, hi16));
        if (fmt == FMT_FP8)
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++) w[q] = _mm512_mul_ps(w[q], sv);
#else
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) {
            w[q] = fp8_dec16(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + 16 * q))));
            if (fmt == FMT_FP8) w[q] = _mm512_mul_ps(w[q], sv);
        }
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

/* A row's last partial chunk [k0, K) zero-padded into tail[128] (x is zero beyond K too) */
static inline const uint8_t *chunk_copy(const int fmt, const uint8_t *wrow, int64_t k0, int64_t K, uint8_t *tail) {
    memset(tail, 0, 128);
    memcpy(tail, wrow + chunk_off(fmt, k0), (size_t)(row_bytes(fmt, K) - chunk_off(fmt, k0)));
    return tail;
}

/* One chunk [k0, k0 + 64) of `tile`: NT weight rows decoded (from src[r]: NULL, the row itself, else a zero-padded
 * copy of its last partial chunk), each x vector loaded once into a register and fed to NT FMAs (the empty asm keeps
 * gcc from re-loading it per row as a memory operand: with one load per FMA the loop is load-bound). */
#define TILE_CHUNK(src)                                                                                                \
    do {                                                                                                               \
        __m512 w[NT_TILE][4];                                                                                          \
        _Pragma("GCC unroll 2") for (int r = 0; r < NT; r++) decode(fmt, wr[r], sr[r], k0, K, w[r], src);            \
        _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++) _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++) {   \
            __m512 xv = _mm512_loadu_ps(xp + m * kp + k0 + 16 * q);                                                    \
            __asm__("" : "+v"(xv));                                                                                    \
            _Pragma("GCC unroll 2") for (int r = 0; r < NT; r++) acc[m][r][q % NA] =                                 \
                _mm512_fmadd_ps(xv, w[r][q], acc[m][r][q % NA]);                                                       \
        }                                                                                                              \
    } while (0)

/* MT x rows against NT weight rows (NA accumulators per output): y[m * N + yo[r]] for m < MT, r < NT. Tile shapes
 * measured on Zen 4 (a C sweep of MT x NT x NA): M = 1: one row, four accumulators (memory-bound); M > 1: row pairs,
 * x tiles of up to 4 (1.3-1.6x the FMA rate of one row at a time). Up to 2 x rows the whole chunks run in a loop of
 * their own and a last partial chunk after it, from a zero-padded copy: with the copy's branch inside the loop gcc
 * kept every decoded vector in memory as well (a store each). Zen 4, one thread, cold, paired runs of a C harness:
 * bf16 8192 x 1024 0.75-0.88x the time at one x row and 0.80-0.87x at two, FP8 1024 x 1024 and 4096 x 1024 at one
 * 0.93-0.95x. From 3 x rows (compute-bound) the same split measured 1.03-1.27x slower (FP8, FP4, bf16 at M = 3, 4, 8),
 * so those tiles keep the branch in the loop. */
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
    if (MT <= 2) {
        int64_t k0 = 0;
        for (; k0 + 64 <= K; k0 += 64) TILE_CHUNK(NULL);
        if (k0 < K) {
            uint8_t tail[NT_TILE][128] __attribute__((aligned(64)));
            TILE_CHUNK(chunk_copy(fmt, wr[r], k0, K, tail[r]));
        }
    } else {
        for (int64_t k0 = 0; k0 < K; k0 += 64) {
            uint8_t tail[NT_TILE][128] __attribute__((aligned(64)));
            if (MT >= 4) /* TILE_PREFETCH */
#pragma GCC unroll 2
                for (int r = 0; r < NT; r++)
                    for (int l = 0; l < (fmt == FMT_BF16 ? 2 : 1); l++)
                        _mm_prefetch((const char *)wr[r] + chunk_off(fmt, k0) + TILE_PREFETCH + 64 * l, _MM_HINT_T0);
            TILE_CHUNK(k0 + 64 <= K ? NULL : chunk_copy(fmt, wr[r], k0, K, tail[r]));
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
#undef TILE_CHUNK

/* FP8, one x row, x pre-scaled (fp8_prescale): weight rows n and n + half, which lie in different 128-row scale
 * blocks, each against its own scaled copy of x (x0, x1): two sequential weight streams, as bf16 and FP4 read at
 * one x row, each prefetched FP8_PREFETCH bytes ahead (a prefetch past a row's end reads the next rows, which come
 * next). Four accumulators per row summed in the one-row tile's order (tile(fmt, 1, 1, 4, ...)), so each output
 * is the same number whichever path computed it. Zen 4, one thread, interleaved against the one-row scaled decode:
 * warm 0.74-0.79x the time (3072 x 1024: 14.3 -> 10.7 cycles per 64 weights); cold 0.79-1.0x by shape and run at
 * 1024 x 1024, 2048 x 512 and 512 x 1024 (the prefetch: 0.84-0.95x of the same without it; distances 256 / 1024 /
 * 4096 / 8192 bytes no better than 2048). */
#define FP8_PREFETCH 2048
static inline void tile_fp8x2(const float *x0, const float *x1, const uint8_t *w0, const uint8_t *w1, int64_t K,
                              float *y0, float *y1) {
    __m512 a0[4], a1[4];
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++) a0[q] = a1[q] = _mm512_setzero_ps();
#define FP8X2_CHUNK(s0, s1)                                                                                            \
    do {                                                                                                               \
        __m512 u[4], v[4];                                                                                             \
        decode(FMT_FP8X, w0, NULL, k0, K, u, s0);                                                                      \
        decode(FMT_FP8X, w1, NULL, k0, K, v, s1);                                                                      \
        _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++) {                                                          \
            a0[q] = _mm512_fmadd_ps(_mm512_loadu_ps(x0 + k0 + 16 * q), u[q], a0[q]);                                   \
            a1[q] = _mm512_fmadd_ps(_mm512_loadu_ps(x1 + k0 + 16 * q), v[q], a1[q]);                                   \
        }                                                                                                              \
    } while (0)
    int64_t k0 = 0;
    for (; k0 + 64 <= K; k0 += 64) { /* whole chunks, then the partial one (as in `tile`) */
        _mm_prefetch((const char *)w0 + k0 + FP8_PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)w1 + k0 + FP8_PREFETCH, _MM_HINT_T0);
        FP8X2_CHUNK(NULL, NULL);
    }
    if (k0 < K) {
        uint8_t t0[128] __attribute__((aligned(64))), t1[128] __attribute__((aligned(64)));
        FP8X2_CHUNK(chunk_copy(FMT_FP8X, w0, k0, K, t0), chunk_copy(FMT_FP8X, w1, k0, K, t1));
    }
#undef FP8X2_CHUNK
    __m512 t0 = a0[0], t1 = a1[0];
#pragma GCC unroll 3
    for (int q = 1; q < 4; q++) t0 = _mm512_add_ps(t0, a0[q]), t1 = _mm512_add_ps(t1, a1[q]);
    *y0 = _mm512_reduce_add_ps(t0);
    *y1 = _mm512_reduce_add_ps(t1);
}

/* FP4 against MT <= 3 x rows whose weight rows' scales are all deferrable (gemv.c fp4_deferrable, checked once a call
 * by run()): each 128-element chunk of a weight row is loaded as 16 dwords of 8 nibbles, and nibble t of every dword
 * (shifted down by 4 t) indexes the unscaled 16-entry value table directly (_mm512_permutexvar_ps reads index bits
 * 3:0 only: no widening load and no mask), so vector t holds elements 8 j + t (PERM_FP4_DW). Lane j lies in scale
 * block j / 4: a chunk's products are summed per lane (one partial sum per x row and weight row) and scaled once by
 * the vector of its four block scales (fp32 bits b << 23), the same products in another order. Per 128 elements: 8
 * look-ups and 7 shifts, against the scaled-table decode's 8 look-ups, 4 shifts, 4 widening loads and 4 table
 * multiplies. Elements from K & ~127 on (K % 128 of them): the scaled-table decode (PERM_EVENODD chunks). Zen 4, one
 * thread, 512 x 1024 weights (a C harness, both tiles on the same rows): 0.83x the cycles of `tile` at one x row,
 * 0.90x at 2, 0.88x at 3, but 1.13x at 4 and 1.31x at 8 (the partial sums no longer fit in registers). */
static inline __attribute__((always_inline)) void
tile_fp4dw(const int MT, const int NT, const float *xp, int64_t kp, const uint8_t *const *wr,
           const uint8_t *const *sr, int64_t K, float *y, int64_t N, const int64_t *yo) {
    const __m512 e2m1 = _mm512_loadu_ps(E2M1);
    const __m128i spread = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const int64_t k128 = K & ~(int64_t)127;
    __m512 acc[3][NT_TILE];
#pragma GCC unroll 3
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 2
        for (int r = 0; r < NT; r++) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < k128; k0 += 128) {
        __m512i v[NT_TILE];
        __m512 c[3][NT_TILE];
#pragma GCC unroll 2
        for (int r = 0; r < NT; r++) v[r] = _mm512_loadu_si512(wr[r] + k0 / 2);
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            __m512 w[NT_TILE];
#pragma GCC unroll 2
            for (int r = 0; r < NT; r++) w[r] = _mm512_permutexvar_ps(t ? _mm512_srli_epi32(v[r], 4 * t) : v[r], e2m1);
#pragma GCC unroll 3
            for (int m = 0; m < MT; m++) {
                __m512 xv = _mm512_loadu_ps(xp + m * kp + k0 + 16 * t);
                __asm__("" : "+v"(xv));
#pragma GCC unroll 2
                for (int r = 0; r < NT; r++) c[m][r] = t ? _mm512_fmadd_ps(xv, w[r], c[m][r]) : _mm512_mul_ps(xv, w[r]);
            }
        }
#pragma GCC unroll 2
        for (int r = 0; r < NT; r++) {
            uint32_t b4;
            memcpy(&b4, sr[r] + k0 / 32, 4);
            const __m512 sv = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128((int)b4), spread)), 23));
#pragma GCC unroll 3
            for (int m = 0; m < MT; m++) acc[m][r] = _mm512_fmadd_ps(c[m][r], sv, acc[m][r]);
        }
    }
    for (int64_t k0 = k128; k0 < K; k0 += 64) {
        __m512 w[NT_TILE][4];
        uint8_t tail[NT_TILE][128] __attribute__((aligned(64)));
#pragma GCC unroll 2
        for (int r = 0; r < NT; r++)
            decode(FMT_FP4, wr[r], sr[r], k0, K, w[r],
                   k0 + 64 <= K ? NULL : chunk_copy(FMT_FP4, wr[r], k0, K, tail[r]));
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++)
#pragma GCC unroll 3
            for (int m = 0; m < MT; m++)
#pragma GCC unroll 2
                for (int r = 0; r < NT; r++)
                    acc[m][r] = _mm512_fmadd_ps(_mm512_loadu_ps(xp + m * kp + k0 + 16 * q), w[r][q], acc[m][r]);
    }
#pragma GCC unroll 3
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 2
        for (int r = 0; r < NT; r++) y[m * N + yo[r]] = _mm512_reduce_add_ps(acc[m][r]);
}
