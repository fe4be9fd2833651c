/* AVX2 + FMA decoders and tiles of gemv.c, which includes this file when the compiler targets AVX2 and FMA and not
 * AVX-512 (the "avx2" build). Weights are decoded into 8-lane fp32 vectors, 64 elements per chunk, in a
 * fixed permuted element order (gemv.c perm_of; x is permuted the same way once per call):
 *
 *   bf16  shifted into fp32 (even elements by a 16-bit shift, odd ones by a mask): PERM_EVENODD8.
 *   FP4   32 bytes (two 32-element scale blocks, one per 128-bit lane): the nibbles index two 16-entry byte tables
 *         (_mm256_shuffle_epi8) that give each value's bf16 bytes (every e2m1 value is exact in bf16), interleaved
 *         into words and widened to fp32 like bf16. Each vector holds 4 elements of each block. PERM_FP4_AVX2.
 *   FP8   two decoders, one chosen per process (fp8_choose, before the first FP8 call; dk_fp8_decode):
 *         shift  a byte multiply-add puts each code's sign and 7 bits where they make the fp32 pattern of its value
 *                times 2^-120 (PERM_FP8_AVX2): 8 ops per 32 codes. The 14 subnormal e4m3 codes become fp32
 *                subnormals, exact (FP8 calls clear MXCSR.DAZ in their threads), but an Intel core runs every FMA
 *                with a subnormal input through a microcode assist (~100x its time).
 *         f16c   the same multiply-add makes each code's fp16 pattern (the value times 2^-8, subnormal codes
 *                included), which vcvtph2ps widens to fp32: every weight a normal fp32 or zero (PERM_FP8_F16C);
 *                10 ops per 32 codes, 4 of them 2-uop converts.
 *         The process takes f16c where an FMA with a subnormal input measures over 4x the time of one without
 *         (Intel), else shift (AMD Zen 4: 1.0x; there shift takes 0.75..0.9x f16c's time at one x row). Both give
 *         the same products x * w, in another order. The NaN code (|b| = 0x7F) decodes as a finite value: each
 *         row notes whether it holds one (max over b | 0x80), and such a row gives NaN (x * NaN is NaN for every
 *         x, as in the reference).
 *
 * Where the time goes (Zen 3, one thread, weights in cache): the decode, not memory. Per 64-element chunk the FP4
 * decode is 19 vector ops (13 of them shuffles / shifts, which Zen 3 runs on two of its four FP pipes, one shared with
 * the FMAs), the FP8 shift decoder's 16 + 4 for the NaN note (4 shifts: the multiply-adds run on the integer-multiply
 * pipes), plus 8 FMAs (10 and a blend for M = 1 FP4's block scales). Tried and measured no faster here (kept out):
 * eight accumulators for one x row (as an array, as eight variables, with the FP8 NaN note moved to a pass of its own
 * to free registers: 30..40% slower), four for two x rows, pairwise product sums added into the accumulators, a
 * software-pipelined FP4 loop (next chunk decoded between this one's FMAs), two weight rows per pass sharing the x
 * loads, one partial sum per FP4 chunk (longer FMA chain), the FP4 shifts done as integer multiplies (mulhi / mullo) or
 * as byte shuffles, FP4 block scales folded into the bf16 words by a saturating exponent subtraction.
 *
 * Scales. FP8 (128 x 128 blocks): where it is exact, x is pre-scaled once per 128-row block by 2^(b-7) per 128-column
 * block (fp8_prescale; 2^(b-119) for f16c), so each term is one exact FMA product
 * x * 2^(b-7) * (value * 2^-120) = x * w of the reference, and the inner loop has no multiply: "exact" means every
 * block's w = value * 2^(b-127) is a normal fp32 (10 <= b <= 246) and every x * 2^(b-7) is one too (checked against x's
 * exponent range per call, taken from the smallest and largest nonzero |x| bit patterns); other row blocks multiply
 * each decoded vector by 2^120 (2^8) and then by 2^(b-127), the reference's own product. FP4 (1 x 32 blocks): M = 1
 * sums x * value over each block (two partial sums per chunk) and scales the block sums once (the same products in
 * another order, where every 0.5 * 2^(b-127) and 6 * 2^(b-127) is a normal fp32: 2 <= b <= 252 for all of the row's
 * scales, checked once per call over all rows' scales and row by row only when that fails; NaN scales excepted, which
 * take the next path); otherwise each decoded vector is multiplied by its block's scale, the reference's product,
 * before the FMAs. A chunk's two block scales are two broadcast loads and a blend (no shuffle-pipe op).
 */
#include <immintrin.h>
#include <x86intrin.h> /* __rdtsc */

#define FP4_HI 0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, 0x80, 0xBF, 0xBF, 0xBF, 0xC0, 0xC0, 0xC0, 0xC0
#define FP4_LO 0x00, 0x00, 0x80, 0xC0, 0x00, 0x40, 0x80, 0xC0, 0x00, 0x00, 0x80, 0xC0, 0x00, 0x40, 0x80, 0xC0
#define XV(x, m, k) _mm256_loadu_ps((x) + (m) * kp + (k))

static inline float hsum8(__m256 v) { /* fixed order: results depend on the inputs only */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The row's bytes of elements [k0, k0 + 64); the last partial chunk as a zero-padded copy in `tail` (x is zero
 * there too). */
static inline const uint8_t *chunk_src(const int fmt, const uint8_t *wrow, int64_t k0, int64_t K, uint8_t *tail) {
    const uint8_t *src = wrow + chunk_off(fmt, k0);
    if (k0 + 64 <= K) return src;
    memset(tail, 0, 128);
    memcpy(tail, src, (size_t)(row_bytes(fmt, K) - chunk_off(fmt, k0)));
    return tail;
}

static inline __attribute__((always_inline)) void dec_bf16(const uint8_t *src, __m256 w[8]) {
    const __m256i hi16 = _mm256_set1_epi32((int)0xFFFF0000u);
#pragma GCC unroll 4
    for (int t = 0; t < 4; t++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(src + 32 * t));
        w[2 * t] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        w[2 * t + 1] = _mm256_castsi256_ps(_mm256_and_si256(v, hi16));
    }
}

/* 64 FP4 elements (32 bytes: two scale blocks, block k0/32 in the low 128-bit lane) -> w[8], exact e2m1 values */
static inline __attribute__((always_inline)) void dec_fp4(const uint8_t *src, __m256 w[8]) {
    const __m256i thi = _mm256_setr_epi8(FP4_HI, FP4_HI), tlo = _mm256_setr_epi8(FP4_LO, FP4_LO);
    const __m256i m0f = _mm256_set1_epi8(0x0F), hi16 = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256i v = _mm256_loadu_si256((const __m256i *)src);
    __m256i lo = _mm256_and_si256(v, m0f), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m0f);
    __m256i lh = _mm256_shuffle_epi8(thi, lo), ll = _mm256_shuffle_epi8(tlo, lo);
    __m256i hh = _mm256_shuffle_epi8(thi, hi), hl = _mm256_shuffle_epi8(tlo, hi);
    __m256i a = _mm256_unpacklo_epi8(ll, lh), b = _mm256_unpackhi_epi8(ll, lh); /* bf16 words, even elements */
    __m256i c = _mm256_unpacklo_epi8(hl, hh), d = _mm256_unpackhi_epi8(hl, hh); /* odd elements */
    w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
    w[1] = _mm256_castsi256_ps(_mm256_and_si256(a, hi16));
    w[2] = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
    w[3] = _mm256_castsi256_ps(_mm256_and_si256(b, hi16));
    w[4] = _mm256_castsi256_ps(_mm256_slli_epi32(c, 16));
    w[5] = _mm256_castsi256_ps(_mm256_and_si256(c, hi16));
    w[6] = _mm256_castsi256_ps(_mm256_slli_epi32(d, 16));
    w[7] = _mm256_castsi256_ps(_mm256_and_si256(d, hi16));
}

/* 64 FP8 codes -> w[8], their e4m3 values times 2^-120 (PERM_FP8_AVX2): the shift decoder. A byte multiply-add
 * with the codes as the signed operand (_mm256_maddubs_epi16 against 16, 0 or 0, 16 per byte pair) gives each even
 * (odd) code times 16 as a sign-extended 16-bit word: sign copies in bits 15..11, b & 0x7F in 10..4. Masked with
 * 0x87F0 that is the top half of the fp32 sign(b) << 31 | (b & 0x7F) << 20; the word in a dword's high half is used
 * in place (a mask), the low one shifted up by 16. So per 32 codes: 2 multiplies (integer-multiply pipes), 2
 * shifts, 4 masks. The 14 subnormal codes become fp32 subnormals (m * 2^-129: exact, with MXCSR.DAZ cleared).
 * *nan collects max(b | 0x80) (0xFF: a NaN code). */
static inline __attribute__((always_inline)) void dec_fp8_shift(const uint8_t *src, __m256 w[8], __m256i *nan) {
    const __m256i ev = _mm256_set1_epi16(16), od = _mm256_set1_epi16(16 << 8);
    const __m256i keep = _mm256_set1_epi32((int)0x87F00000u), x80 = _mm256_set1_epi8((char)0x80);
#pragma GCC unroll 2
    for (int t = 0; t < 2; t++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(src + 32 * t));
        *nan = _mm256_max_epu8(*nan, _mm256_or_si256(v, x80));
        const __m256i pe = _mm256_maddubs_epi16(ev, v), po = _mm256_maddubs_epi16(od, v);
        w[4 * t] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(pe, 16), keep));
        w[4 * t + 1] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(po, 16), keep));
        w[4 * t + 2] = _mm256_castsi256_ps(_mm256_and_si256(pe, keep));
        w[4 * t + 3] = _mm256_castsi256_ps(_mm256_and_si256(po, keep));
    }
}

/* 64 FP8 codes -> w[8], their e4m3 values times 2^-8 (PERM_FP8_F16C), every one a normal fp32 or zero: the F16C
 * decoder. The multiply-add against 128, 0 or 0, 128 gives each even (odd) code times 128: sign copies in bits
 * 15..14, b & 0x7F in 13..7; masked with 0xBF80 that is the fp16 pattern sign(b) << 15 | (b & 0x7F) << 7, the e4m3
 * exponent field as fp16's (bias 15 against 7) and the mantissa its top 3 bits: the value times 2^-8, subnormal
 * codes included (fp16 subnormals continue the e4m3 ones with the same factor), which vcvtph2ps widens to fp32.
 * Per 32 codes: 2 multiplies, 2 masks, 2 extracts, 4 converts (2 uops each). */
static inline __attribute__((always_inline)) void dec_fp8_f16c(const uint8_t *src, __m256 w[8], __m256i *nan) {
    const __m256i ev = _mm256_set1_epi16(128), od = _mm256_set1_epi16((short)(128 << 8));
    const __m256i keep = _mm256_set1_epi16((short)0xBF80), x80 = _mm256_set1_epi8((char)0x80);
#pragma GCC unroll 2
    for (int t = 0; t < 2; t++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(src + 32 * t));
        *nan = _mm256_max_epu8(*nan, _mm256_or_si256(v, x80));
        const __m256i pe = _mm256_and_si256(_mm256_maddubs_epi16(ev, v), keep);
        const __m256i po = _mm256_and_si256(_mm256_maddubs_epi16(od, v), keep);
        w[4 * t] = _mm256_cvtph_ps(_mm256_castsi256_si128(pe));
        w[4 * t + 1] = _mm256_cvtph_ps(_mm256_extracti128_si256(pe, 1));
        w[4 * t + 2] = _mm256_cvtph_ps(_mm256_castsi256_si128(po));
        w[4 * t + 3] = _mm256_cvtph_ps(_mm256_extracti128_si256(po, 1));
    }
}

/* TSC ticks of 512 FMAs (8 independent chains) with `a` as an input and a normal product, the best of 7 */
static uint64_t fma_ticks(float a) {
    __m256 va = _mm256_set1_ps(a), acc[8];
    const __m256 vb = _mm256_set1_ps(0x1p100f);
    uint64_t best = UINT64_MAX;
    for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
    for (int r = 0; r < 7; r++) {
        const uint64_t t0 = __rdtsc();
        for (int i = 0; i < 64; i++) {
            __asm__ volatile("" : "+x"(va)); /* a value the compiler cannot fold */
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) acc[c] = _mm256_fmadd_ps(va, vb, acc[c]);
        }
        const uint64_t t = __rdtsc() - t0;
        best = t < best ? t : best;
    }
    for (int c = 1; c < 8; c++) acc[0] = _mm256_add_ps(acc[0], acc[c]);
    volatile float sink = _mm256_cvtss_f32(acc[0]);
    (void)sink;
    return best;
}

/* Choose the FP8 decoder by what a subnormal FMA input costs on this core (DAZ off, as in the kernels). Intel cores
 * run such an FMA through a microcode assist (on a Xeon the shift decoder's FP8 GEMV took 17..57x the avx512-vbmi
 * build's time on random codes, 5.5 % of them subnormal; checkpoints hold ~1e-4, heavy-tailed blocks more); AMD Zen 4
 * takes none, and there the shift decoder is 0.75..0.9x the F16C one's time at one x row. Both give the same products;
 * only their order (the element permutation) differs. */
static void fp8_choose(void) {
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr & ~0x40u);
    fma_ticks(0x1p-100f); /* warm up */
    const uint64_t normal = fma_ticks(0x1p-100f), sub = fma_ticks(0x1p-130f);
    _mm_setcsr(csr);
    subnormal_cost = (double)sub / (double)(normal ? normal : 1);
    fp8_decoder = subnormal_cost > 4.0 ? FP8_F16C : FP8_SHIFT;
}

/* ---------------------------------------------------------------------------------------------------------------
 * FP4 scales and the one-row FP4 kernel */

/* the scales of chunk k0's two blocks, 4 lanes each: UE8M0 b as fp32 bits b << 23 (b in 1..254) */
static inline __m256 fp4_scales_bits(const uint8_t *srow, int64_t k0) {
    const __m256i pick = _mm256_setr_epi8(0, -1, -1, -1, 0, -1, -1, -1, 0, -1, -1, -1, 0, -1, -1, -1,
                                          1, -1, -1, -1, 1, -1, -1, -1, 1, -1, -1, -1, 1, -1, -1, -1);
    uint16_t two;
    memcpy(&two, srow + (k0 >> 5), 2);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_shuffle_epi8(_mm256_set1_epi16((short)two), pick), 23));
}

/* the same from the UE8M0 table (any b, 0 and 255 included); a missing second block (K % 64 == 32) scales by 0 */
static inline __m256 fp4_scales(const uint8_t *srow, int64_t k0, int64_t K) {
    const float sb = k0 + 32 < K ? UE8M0[srow[(k0 >> 5) + 1]] : 0.0f;
    return _mm256_set_m128(_mm_set1_ps(sb), _mm_set1_ps(UE8M0[srow[k0 >> 5]]));
}

/* chunk k0's two block scales as one vector (low lane: block k0/32, high lane: the next), from two broadcast loads
 * and a blend (no shuffle-port op) */
static inline __m256 fp4_scales2(const uint8_t *srow, int64_t k0) {
    return _mm256_blend_ps(_mm256_broadcast_ss(&UE8M0[srow[k0 >> 5]]), _mm256_broadcast_ss(&UE8M0[srow[(k0 >> 5) + 1]]),
                           0xF0);
}

/* the products of chunk k0 (decoded w) with x, summed per lane in two partial sums, scaled by sv into acc0/acc1 */
#define FP4_CHUNK1(x, k0, w, sv, acc0, acc1)                                                                        \
    do {                                                                                                           \
        __m256 ba_ = _mm256_mul_ps(_mm256_loadu_ps((x) + (k0)), (w)[0]);                                           \
        __m256 bb_ = _mm256_mul_ps(_mm256_loadu_ps((x) + (k0) + 8), (w)[1]);                                       \
        for (int q_ = 1; q_ < 4; q_++) {                                                                           \
            ba_ = _mm256_fmadd_ps(_mm256_loadu_ps((x) + (k0) + 16 * q_), (w)[2 * q_], ba_);                        \
            bb_ = _mm256_fmadd_ps(_mm256_loadu_ps((x) + (k0) + 16 * q_ + 8), (w)[2 * q_ + 1], bb_);                \
        }                                                                                                          \
        acc0 = _mm256_fmadd_ps(ba_, (sv), acc0);                                                                   \
        acc1 = _mm256_fmadd_ps(bb_, (sv), acc1);                                                                   \
    } while (0)

/* one x row, FP4 with deferrable scales: each block's sum scaled once (two partial sums per chunk); the whole
 * chunks in a branch-free loop, a partial last chunk after it */
static inline float gemv1_fp4(const float *x, const uint8_t *wrow, const uint8_t *srow, int64_t K) {
    const int64_t kfull = K & ~(int64_t)63;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), w[8];
    int64_t k0 = 0;
    for (; k0 < kfull; k0 += 64) {
        dec_fp4(wrow + k0 / 2, w);
        FP4_CHUNK1(x, k0, w, fp4_scales2(srow, k0), acc0, acc1);
    }
    if (k0 < K) {
        uint8_t tail[128] __attribute__((aligned(32)));
        dec_fp4(chunk_src(FMT_FP4, wrow, k0, K, tail), w);
        FP4_CHUNK1(x, k0, w, fp4_scales(srow, k0, K), acc0, acc1);
    }
    return hsum8(_mm256_add_ps(acc0, acc1));
}

/* MT x rows against one weight row -> y[m * N]. FP8: x pre-scaled (scaled = 0) or plain with the weights scaled
 * (scaled = 1); a NaN code in the row makes the result NaN. Two accumulators per x row (four with one row) keep
 * each FMA chain short of the FMA latency. */
static inline __attribute__((always_inline)) void
tile(const int fmt, const int MT, const int scaled, const float *x, int64_t kp, const uint8_t *wrow,
     const uint8_t *srow, int64_t K, float *y, int64_t N) {
    const int A = MT == 1 ? 4 : 2;
    uint8_t tail[128] __attribute__((aligned(32)));
    __m256 acc[MT_TILE][4], w[8];
    __m256i nan = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 4
        for (int a = 0; a < A; a++) acc[m][a] = _mm256_setzero_ps();
#define TILE_CHUNK(src_)                                                                                              \
    do {                                                                                                              \
        const uint8_t *src = (src_);                                                                                  \
        if (fmt == FMT_BF16) {                                                                                        \
            dec_bf16(src, w);                                                                                         \
        } else if (fmt == FMT_FP8 || fmt == FMT_FP8H) {                                                               \
            if (fmt == FMT_FP8H)                                                                                      \
                dec_fp8_f16c(src, w, &nan);                                                                           \
            else                                                                                                      \
                dec_fp8_shift(src, w, &nan);                                                                          \
            if (scaled) {                                                                                             \
                const __m256 sv = _mm256_broadcast_ss(&UE8M0[srow[k0 >> 7]]);                                         \
                const __m256 up = _mm256_set1_ps(fmt == FMT_FP8H ? 0x1p8f : 0x1p120f);                                \
                _Pragma("GCC unroll 8") for (int q = 0; q < 8; q++) w[q] = _mm256_mul_ps(_mm256_mul_ps(w[q], up), sv); \
            }                                                                                                         \
        } else {                                                                                                      \
            const __m256 sv = k0 + 64 <= K ? fp4_scales2(srow, k0) : fp4_scales(srow, k0, K);                         \
            dec_fp4(src, w);                                                                                          \
            _Pragma("GCC unroll 8") for (int q = 0; q < 8; q++) w[q] = _mm256_mul_ps(w[q], sv);                       \
        }                                                                                                             \
        _Pragma("GCC unroll 8") for (int q = 0; q < 8; q++) _Pragma("GCC unroll 4") for (int m = 0; m < MT; m++)     \
            acc[m][q % A] = _mm256_fmadd_ps(XV(x, m, k0 + 8 * q), w[q], acc[m][q % A]);                               \
    } while (0)
    if (MT <= 2) { /* whole chunks, then the partial one, as gemv_avx512.h `tile` (FP8 at 2 x rows: 0.78x the time) */
        int64_t k0 = 0;
        for (; k0 + 64 <= K; k0 += 64) TILE_CHUNK(wrow + chunk_off(fmt, k0));
        if (k0 < K) TILE_CHUNK(chunk_src(fmt, wrow, k0, K, tail));
    } else {
        for (int64_t k0 = 0; k0 < K; k0 += 64) {
            if (MT >= 4) /* TILE_PREFETCH */
                for (int l = 0; l < (fmt == FMT_BF16 ? 2 : 1); l++)
                    _mm_prefetch((const char *)wrow + chunk_off(fmt, k0) + TILE_PREFETCH + 64 * l, _MM_HINT_T0);
            TILE_CHUNK(chunk_src(fmt, wrow, k0, K, tail));
        }
    }
#undef TILE_CHUNK
    const int bad = (fmt == FMT_FP8 || fmt == FMT_FP8H) &&
                    _mm256_movemask_epi8(_mm256_cmpeq_epi8(nan, _mm256_set1_epi8((char)0xFF)));
#pragma GCC unroll 4
    for (int m = 0; m < MT; m++) {
        __m256 t = acc[m][0];
#pragma GCC unroll 4
        for (int a = 1; a < A; a++) t = _mm256_add_ps(t, acc[m][a]);
        y[m * N] = bad ? NAN : hsum8(t);
    }
}

/* bf16, MT x rows (1..MT_TILE) against two weight rows w0, w1 -> y[m * N], y[m * N + 1]: each x vector is loaded
 * once for both rows and each decoded weight vector used for MT rows (16 FMAs per 10 loads at MT = 4, where the
 * one-row tile needs 18 loads per 16 FMAs and is load-bound from M ~ 4 on). One accumulator per (x row, weight
 * row), 16 elements (one load of each weight row) per step. */
static inline __attribute__((always_inline)) void
tile2_bf16(const int MT, const float *x, int64_t kp, const uint8_t *w0, const uint8_t *w1, int64_t K, float *y,
           int64_t N, int64_t dy) {
    const __m256i hi16 = _mm256_set1_epi32((int)0xFFFF0000u);
    uint8_t tail0[128] __attribute__((aligned(32))), tail1[128] __attribute__((aligned(32)));
    __m256 acc[MT_TILE][2];
#pragma GCC unroll 4
    for (int m = 0; m < MT; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += 64) {
        if (MT >= 4) /* TILE_PREFETCH */
            for (int l = 0; l < 2; l++) {
                _mm_prefetch((const char *)w0 + 2 * k0 + TILE_PREFETCH + 64 * l, _MM_HINT_T0);
                _mm_prefetch((const char *)w1 + 2 * k0 + TILE_PREFETCH + 64 * l, _MM_HINT_T0);
            }
        const uint8_t *s0 = chunk_src(FMT_BF16, w0, k0, K, tail0), *s1 = chunk_src(FMT_BF16, w1, k0, K, tail1);
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(s0 + 32 * t));
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(s1 + 32 * t));
            const __m256 a0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
            const __m256 b0 = _mm256_castsi256_ps(_mm256_and_si256(v0, hi16));
            const __m256 a1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
            const __m256 b1 = _mm256_castsi256_ps(_mm256_and_si256(v1, hi16));
#pragma GCC unroll 4
            for (int m = 0; m < MT; m++) {
                const __m256 xa = XV(x, m, k0 + 16 * t), xb = XV(x, m, k0 + 16 * t + 8);
                acc[m][0] = _mm256_fmadd_ps(xb, b0, _mm256_fmadd_ps(xa, a0, acc[m][0]));
                acc[m][1] = _mm256_fmadd_ps(xb, b1, _mm256_fmadd_ps(xa, a1, acc[m][1]));
            }
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MT; m++) {
        y[m * N] = hsum8(acc[m][0]);
        y[m * N + dy] = hsum8(acc[m][1]);
    }
}

/* every x row against bf16 weight rows w0 and w1 -> y[m * N], y[m * N + dy] */
static void rows2_bf16(const float *x, int64_t M, int64_t kp, const uint8_t *w0, const uint8_t *w1, int64_t K,
                       float *y, int64_t N, int64_t dy) {
    for (int64_t m0 = 0; m0 < M; m0 += MT_TILE) {
        const float *xt = x + m0 * kp;
        float *yt = y + m0 * N;
        switch (M - m0 < MT_TILE ? (int)(M - m0) : MT_TILE) {
        case 1: tile2_bf16(1, xt, kp, w0, w1, K, yt, N, dy); break;
        case 2: tile2_bf16(2, xt, kp, w0, w1, K, yt, N, dy); break;
        case 3: tile2_bf16(3, xt, kp, w0, w1, K, yt, N, dy); break;
        default: tile2_bf16(4, xt, kp, w0, w1, K, yt, N, dy); break;
        }
    }
}

/* every x row against one weight row (its scales srow) -> y[m * N] */
static inline __attribute__((always_inline)) void
row(const int fmt, const int scaled, const float *x, int64_t M, int64_t kp, const uint8_t *wrow,
    const uint8_t *srow, int64_t K, float *y, int64_t N, int defer) {
    if (M == 1 && fmt == FMT_FP4 && (defer || fp4_deferrable(srow, K / 32))) {
        y[0] = gemv1_fp4(x, wrow, srow, K);
        return;
    }
    for (int64_t m0 = 0; m0 < M; m0 += MT_TILE) {
        const float *xt = x + m0 * kp;
        float *yt = y + m0 * N;
        switch (M - m0 < MT_TILE ? (int)(M - m0) : MT_TILE) {
        case 1: tile(fmt, 1, scaled, xt, kp, wrow, srow, K, yt, N); break;
        case 2: tile(fmt, 2, scaled, xt, kp, wrow, srow, K, yt, N); break;
        case 3: tile(fmt, 3, scaled, xt, kp, wrow, srow, K, yt, N); break;
        default: tile(fmt, 4, scaled, xt, kp, wrow, srow, K, yt, N); break;
        }
    }
}

enum { RB = 16 }; /* weight rows per work item; divides 128, so an item lies in one FP8 scale block */

/* FP8 weight rows [r0, r1) (one scale block) against x pre-scaled (xs) where that is exact, else plain (xp): fmt
 * FMT_FP8 (the shift decoder) or FMT_FP8H (f16c). One function per decoder (noinline): with all four FP8 tile
 * families in one function the shift decoder's FP8 GEMV measured 3..13 % slower (Zen 4). */
static inline __attribute__((always_inline)) void
fp8_rows(const int fmt, int exact, const float *xp, const float *xs, int64_t M, int64_t kp, const uint8_t *w,
         const uint8_t *srow, int64_t K, float *y, int64_t N, int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; n++) {
        if (exact)
            row(fmt, 0, xs, M, kp, w + n * K, srow, K, y + n, N, 0);
        else
            row(fmt, 1, xp, M, kp, w + n * K, srow, K, y + n, N, 0);
    }
}
static __attribute__((noinline)) void fp8_rows_shift(int exact, const float *xp, const float *xs, int64_t M,
                                                     int64_t kp, const uint8_t *w, const uint8_t *srow, int64_t K,
                                                     float *y, int64_t N, int64_t r0, int64_t r1) {
    fp8_rows(FMT_FP8, exact, xp, xs, M, kp, w, srow, K, y, N, r0, r1);
}
static __attribute__((noinline)) void fp8_rows_f16c(int exact, const float *xp, const float *xs, int64_t M,
                                                    int64_t kp, const uint8_t *w, const uint8_t *srow, int64_t K,
                                                    float *y, int64_t N, int64_t r0, int64_t r1) {
    fp8_rows(FMT_FP8H, exact, xp, xs, M, kp, w, srow, K, y, N, r0, r1);
}

/* FP4 weight rows [r0, r1): a function of its own, as fp8_rows_shift (with FP4's tiles in avx2_rows beside bf16's
 * a change to one format's tile moved the other's time by up to 1.2x, Zen 4) */
static __attribute__((noinline)) void fp4_rows(const float *xp, int64_t M, int64_t kp, const uint8_t *w,
                                               const uint8_t *s, int64_t K, float *y, int64_t N, int defer, int64_t r0,
                                               int64_t r1) {
    for (int64_t n = r0; n < r1; n++) row(FMT_FP4, 0, xp, M, kp, w + n * (K / 2), s + n * (K / 32), K, y + n, N, defer);
}

/* work items [i0, i1) (rows r0 .. r0 + RB - 1 for r0 = RB * i) in one thread; -1: out of memory */
static int avx2_rows(const int fmt, const float *xp, int64_t M, int64_t kp, const uint8_t *w, const uint8_t *s,
                     int64_t K, float *y, int64_t N, int64_t half, int defer, int emin, int emax, int64_t i0,
                     int64_t i1) {
    const int64_t nkb = (K + 127) / 128, wstride = row_bytes(fmt, K);
    const int pairs = fmt == FMT_BF16 && M > 1, f16c = fp8_decoder == FP8_F16C;
    const unsigned csr = _mm_getcsr();
    /* DAZ off: the shift decoder's subnormals are values, and so are f16c's fp16 subnormals (vcvtph2ps ignores DAZ
     * on the CPUs measured; QEMU's flushes them) */
    if (fmt == FMT_FP8) _mm_setcsr(csr & ~0x40u);
    float *xs = fmt == FMT_FP8 && i0 < i1 ? (float *)aligned_alloc(32, (size_t)(M * kp) * sizeof(float)) : NULL;
    int64_t cur = -1;
    int exact = 0;
    const int fail = fmt == FMT_FP8 && i0 < i1 && xs == NULL;
    for (int64_t i = fail ? i1 : i0; i < i1; i++) {
        const int64_t r0 = i * RB, r1 = r0 + RB < half ? r0 + RB : half;
        if (fmt == FMT_FP8) {
            if (r0 >> 7 != cur)
                cur = r0 >> 7, exact = fp8_prescale(xp, xs, M, kp, K, s + cur * nkb, f16c ? 119 : 7, emin, emax);
            (f16c ? fp8_rows_f16c : fp8_rows_shift)(exact, xp, xs, M, kp, w, s + cur * nkb, K, y, N, r0, r1);
            continue;
        }
        if (fmt == FMT_FP4) {
            fp4_rows(xp, M, kp, w, s, K, y, N, defer, r0, r1);
            continue;
        }
        for (int64_t n = r0; n < r1; n++) {
            const uint8_t *wrow = w + n * wstride;
            if (fmt == FMT_BF16 && pairs && n + half < N)
                rows2_bf16(xp, M, kp, wrow, wrow + half * wstride, K, y + n, N, half);
            else
                row(FMT_BF16, 0, xp, M, kp, wrow, NULL, K, y + n, N, 0);
        }
    }
    free(xs);
    _mm_setcsr(csr);
    return fail ? -1 : 0;
}

/* The AVX2 driver (gemv.c run() hands every call here): work items of RB weight rows, split into contiguous
 * ranges over `nthreads` OpenMP threads (one thread: called directly, no parallel region: ~0.6 us less per call),
 * each weight row read once, whole, against every x row in tiles of up to MT_TILE rows. FP8 and FP4: one weight row
 * at a time (with 16 vector registers a second row's decoded vectors do not fit); FP8: x pre-scaled once per
 * 128-row scale block where that is exact (see the top), in a per-thread copy. bf16 with M > 1: rows n and
 * n + ceil(N/2) in one tile (tile2_bf16; two far-apart sequential streams: two adjacent rows read side by side
 * streamed ~1.5x slower here). (Sweeping the rows k-block by k-block so that x stays in L1 for M > 4 measured
 * slower here: the per-block sums and the row jumps cost more than the L2 reads of x save.) Each output element is
 * computed by one thread in the same order whatever the split. */
static int avx2_run(const int fmt, const float *xp, int64_t M, int64_t kp, const uint8_t *w, const uint8_t *s,
                    int64_t K, float *y, int64_t N, int nthreads) {
    const int64_t half = fmt == FMT_BF16 && M > 1 ? (N + 1) / 2 : N; /* bf16 pairs: item n is rows n, n + half */
    const int64_t items = (half + RB - 1) / RB;
    int emin = 0, emax = 0, fail = 0;
    if (fmt == FMT_FP8) exp_range(xp, M * kp, &emin, &emax);
    /* FP4, one x row: every row's scales deferrable (checked once over all of them), else row by row */
    const int defer = fmt == FMT_FP4 && M == 1 && fp4_deferrable(s, N * (K / 32));
    if (nthreads <= 1) {
        last_threads = 1;
        return avx2_rows(fmt, xp, M, kp, w, s, K, y, N, half, defer, emin, emax, 0, items);
    }
#pragma omp parallel num_threads(nthreads) reduction(| : fail)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        if (t == 0) last_threads = (int)nt;
        fail |= avx2_rows(fmt, xp, M, kp, w, s, K, y, N, half, defer, emin, emax, items * t / nt,
                          items * (t + 1) / nt);
    }
    return fail ? -1 : 0;
}

#undef XV
