/* The front of the attention of a decode step in one native call, and its attention with the block's attention tail
 * in another (loaded with gemv.c, mhc.c and moe.c as one
 * library by engine/host_kernels/build.py; same build flags, no torch headers). The one contract of every
 * call here: the host table's own kernels in the op-by-op path's order, so that path's numbers bit for bit.
 *
 *   dk_attn_qkv  the op table's `attn_qkv` (engine/model/ops.py; engine/model/attention.py Attention.qkv), fp32:
 *                qr [T, Q]    = rms_norm(x @ wq_a^T, q_norm)
 *                q  [T, H, D] = rope_tail(head_rms(qr @ wq_b^T), cos, sin)   (head_rms: rms_norm, no weight)
 *                kv [T, D]    = rope_tail(rms_norm(x @ wkv^T, kv_norm), cos, sin)
 *
 * The steps are the library's own kernels (gemv.c's GEMVs, mhc.c's dk_rms_norm and dk_rope_tail) called in the
 * composite's order with the arguments `--kernels host` passes them op by op, so the results are that path's bit for
 * bit. What it saves is the Python between them: eight op-table calls per layer and step. Norms and RoPE run in
 * place on the outputs (both read a row before writing it). Weight formats as in dk.h (fa, fb, fk); cos / sin
 * [T, rd/2]. Returns 0, else the first kernel's non-zero code.
 *
 *   dk_attn_decode  a decode-only step's attention after its state writes, through the block's attention tail
 *                   (engine/model/attention.py Attention._decode's keys, _attend and _out; engine/model/block.py's
 *                   attn_out_expand), fp32, B sequences of one token; with `new_kv` also the step's state writes
 *                   before it (Attention.decode_writes):
 *                ring[slots[b], ring_rows[b]] = new_kv[b]                                     (write_ring)
 *                st_kv_c[slots[b], row_c[b]] = kv_c[b]; st_score_c[...] = score_c[b] + ape_c[phase_c[b]]
 *                pool_c[entry w of b] = close_block(the block w that row b closes)
 *                                                                   (Compressor.decode, each of the C compressors)
 *                keys_b [N, D] = ring[slots[b]] (wl rows) ++ pool entries 0..nloc-1 of block table b   N = wl + nloc
 *                picks_b [nloc] = with iqT: the top-k of index_score(iqT[b], iw[b], ipool entries of b)
 *                                 among the entries e < visible[b] (Attention._entries, _select)
 *                valid_b [N]   = ring_valid[b] ++ (entry e < visible[b] and, with `keep` / iqT, their pick)
 *                o [B, H, D]   = sparse_attn(q, keys, valid, sink, scale)
 *                y [B, G*R]    = grouped wo_a (rope_tail(o, cos, sin, rd, inverse))
 *                out [B, n, d] = hc_expand(wo_b y, x, post, comb)
 *
 * The keys and masks are the tensors `_decode` gathers (the same rows, in the same order), and the rest are the
 * kernels the op table runs one by one (dk_sparse_attn on all B rows, dk_rope_tail, dk_bf16_grouped_linear, gemm,
 * dk_hc_expand), so the result is that path's bit for bit. What it saves is the gathers' and concatenations' torch
 * ops and five op-table calls per layer and step. ring [S, wl, D], pool [NB, epb, D] (NULL when nloc is 0), tables
 * [B, nb] int64, keep [B, nloc] (NULL: every causal entry; else the indexer's picks, Attention._select); iqT
 * [B, Di, Hi] (NULL: no selection here), iw [B, Hi]: the indexer's queries (transposed) and head weights, scored
 * against its pool ipool [NB, iepb, Di] with the host table's index_score routine and picked by index_topk's order
 * (order_key), top-k `topk`, after the state writes; wo_a bf16 [G*R, H*D/G], wo_b [dim, G*R] in format fb; per
 * compressor c, cptr[CPTR c..] and cdim[CDIM c..] as dk.h lists them, ceps[c] its norm's eps. The closing blocks
 * pool with the routine the host table's compress_pool runs (dk_compress_pool), then dk_rms_norm and dk_rope_tail as
 * Compressor.finish calls them, so the entries are the op-by-op path's bit for bit. held (or NULL): each row's input
 * streams x averaged (dk_stream_mean) into held row slots[b] * held_rows + held_pos[b] % held_rows (held_width
 * floats a row) - DSpark's context input of this layer at its position, which engine/runner.py holds while
 * speculation is off (`ModelRunner.hold`), written here without a call of its own.
 * Returns 0, -1 when out of memory, -2 for a block id outside the tables, else the first kernel's non-zero code.
 *
 *   dk_attn_front  the front of the attention half of a decode block (engine/host_kernels/block_decoder.py
 *                  HostBlockDecoder.attn_half before its state writes), fp32:
 *                h, post, comb = hc_pre(x)          dk_hc_pre (attn_norm)
 *                qr, q, kv     = dk_attn_qkv(h)
 *                proj_i [T, N_i] = h @ W_i^T         the compressors' wkv and wgate (P of them, formats pf[i])
 *
 * Again the host table's kernels in its order (hc_pre, attn_qkv, then each projection's GEMV), so its numbers bit
 * for bit, without three op-table calls and P GEMV wrappers per layer and step. proj: the P outputs one after the
 * other. Returns 0, -1 when out of memory, else the first kernel's non-zero code.
 *
 *   dk_decode_layer  a whole decode layer (engine/host_kernels/block_decoder.py HostBlockDecoder.layer: a
 *                    decode-only step whose indexer, if any, does not select): dk_attn_front, then dk_attn_decode with the state writes (the
 *                    compressors' kv and score are the front's projections 2c and 2c + 1), then dk_ffn_site, with
 *                    the static arguments of dk_layer (dk.h) and the step's own: x [B, n, dim] -> out; cos / sin
 *                    [B, rd/2]; slots, ring rows [B]; ring_valid [B, wl]; tables [B, nb]; nloc, visible [B];
 *                    crow: per compressor six pointers (state rows, phases [B], closing rows, block ids [K_c],
 *                    cos, sin [K_c, rd/2]), ck[c] = K_c; hash_ids [B, K] or NULL; held .. held_width:
 *                    dk_attn_decode's. The same calls
 *                    the three make one by one, so the same numbers bit for bit; what it saves is the Python
 *                    between them. Returns 0, -1 when out of memory, else the first kernel's non-zero code.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dk.h"

enum { POOL_SLOTS = 512 }; /* the most slots a pooled entry takes: 2m for CSA, m for HCA (V4: m = 4 and 128) */
int dk_pool_slots(void) { return POOL_SLOTS; } /* engine/host_kernels/build.py HostLibrary.pool_slots */

/* out[c] = sum_j softmax_j(sc[j][c]) kv[j][c] over n slots (rows given by pointer; NULL: an absent slot, score -inf),
 * per channel c < d: nki_kernels/reference.py compress_pool's softmax pooling, fp32, libm expf. One copy of the code
 * (noinline) for dk_compress_pool and the decode step's closing blocks, so both give the same bits. */
__attribute__((noinline)) static void pool_slots(const float *const *kv, const float *const *sc, int64_t n, int64_t d,
                                                 float *out) {
    float e[POOL_SLOTS];
    for (int64_t c = 0; c < d; c++) {
        float mx = -INFINITY, den = 0.0f, acc = 0.0f;
        for (int64_t j = 0; j < n; j++)
            if (sc[j] != NULL && sc[j][c] > mx) mx = sc[j][c];
        for (int64_t j = 0; j < n; j++) {
            e[j] = sc[j] != NULL ? expf(sc[j][c] - mx) : 0.0f; /* each exp once (n <= POOL_SLOTS: the callers) */
            den += e[j];
        }
        for (int64_t j = 0; j < n; j++)
            if (sc[j] != NULL) acc += kv[j][c] * (e[j] / den);
        out[c] = acc;
    }
}

/* The lightning indexer's scores of one query row over n keys (rows by pointer): s[e] = sum_h w[h] relu(q[h] . k_e),
 * fp32 (nki_kernels/reference.py index_score). qT [Di, Hi]: the row's queries transposed, so one key element meets
 * IS_H heads in one contiguous run. Four keys x 2 IS_H heads at a time in registers, 8 chains in flight (4 x IS_H
 * where the heads are not a multiple of 2 IS_H; gcc / clang vector types of the build's register width: IS_H is 16
 * heads on AVX-512, 8 on AVX2, 4 otherwise); each head's dot is one chain over d, in d order; the weighted ReLU sum
 * in head order. Heads not a multiple of IS_H take the scalar loop. One copy (noinline) for dk_index_score and
 * dk_attn_decode's selection: the same bits. */
#if defined(__AVX512F__)
enum { IS_H = 16 }; /* one accumulator: one register of the build */
#elif defined(__AVX2__)
enum { IS_H = 8 };
#else
enum { IS_H = 4 };
#endif
typedef float is_vec __attribute__((vector_size(4 * IS_H)));

__attribute__((noinline)) static void index_scores_row(const float *restrict qT, const float *restrict w,
                                                      const float *const *keys, int64_t n, int64_t Hi, int64_t Di,
                                                      float *restrict s) {
    for (int64_t e0 = 0; e0 < n; e0 += 4) {
        const float *k[4];
        for (int j = 0; j < 4; j++) k[j] = keys[e0 + j < n ? e0 + j : n - 1]; /* past n: the last, discarded */
        float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (Hi % (2 * IS_H) == 0) { /* two head groups a pass: 8 dot chains in flight, not 4 (FMA latency) */
            for (int64_t h0 = 0; h0 < Hi; h0 += 2 * IS_H) {
                is_vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
                for (int64_t d = 0; d < Di; d++) {
                    is_vec q, r;
                    memcpy(&q, qT + d * Hi + h0, sizeof q);
                    memcpy(&r, qT + d * Hi + h0 + IS_H, sizeof r);
                    const float k0 = k[0][d], k1 = k[1][d], k2 = k[2][d], k3 = k[3][d];
                    a0 += q * k0, a1 += q * k1, a2 += q * k2, a3 += q * k3;
                    b0 += r * k0, b1 += r * k1, b2 += r * k2, b3 += r * k3;
                }
                const is_vec *acc[4][2] = {{&a0, &b0}, {&a1, &b1}, {&a2, &b2}, {&a3, &b3}};
                for (int j = 0; j < 4; j++)
                    for (int g = 0; g < 2; g++)
                        for (int l = 0; l < IS_H; l++) {
                            const float v = (*acc[j][g])[l];
                            t[j] += w[h0 + g * IS_H + l] * (v < 0.0f ? 0.0f : v);
                        }
            }
        } else if (Hi % IS_H == 0) {
            for (int64_t h0 = 0; h0 < Hi; h0 += IS_H) {
                is_vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                for (int64_t d = 0; d < Di; d++) {
                    is_vec q;
                    memcpy(&q, qT + d * Hi + h0, sizeof q);
                    a0 += q * k[0][d], a1 += q * k[1][d], a2 += q * k[2][d], a3 += q * k[3][d];
                }
                const is_vec *acc[4] = {&a0, &a1, &a2, &a3};
                for (int j = 0; j < 4; j++)
                    for (int l = 0; l < IS_H; l++) t[j] += w[h0 + l] * ((*acc[j])[l] < 0.0f ? 0.0f : (*acc[j])[l]);
            }
        } else {
            for (int j = 0; j < 4; j++)
                for (int64_t h = 0; h < Hi; h++) {
                    float a = 0.0f;
                    for (int64_t d = 0; d < Di; d++) a += qT[d * Hi + h] * k[j][d];
                    t[j] += w[h] * (a < 0.0f ? 0.0f : a);
                }
        }
        for (int j = 0; j < 4 && e0 + j < n; j++) s[e0 + j] = t[j];
    }
}

/*   dk_index_score  nki_kernels/reference.py index_score: qT [R, Di, Hi] (each query row's heads transposed), keys
 *                   [B, N, Di] (query row r reads batch r / T), w [R, Hi] -> s [R, N], R = B * T. Returns 0, -1 when
 *                   out of memory. */
int dk_index_score(const float *qT, const float *keys, const float *w, int64_t B, int64_t T, int64_t N, int64_t Hi,
                   int64_t Di, float *s) {
    const float **kp = (const float **)malloc(sizeof(float *) * (size_t)(N > 0 ? N : 1));
    if (kp == NULL) return -1;
    for (int64_t b = 0; b < B; b++) {
        for (int64_t e = 0; e < N; e++) kp[e] = keys + (b * N + e) * Di;
        for (int64_t t = 0; t < T; t++)
            index_scores_row(qT + (b * T + t) * Di * Hi, w + (b * T + t) * Hi, kp, N, Hi, Di, s + (b * T + t) * N);
    }
    free(kp);
    return 0;
}

/* reference.py order_key of (score s, entry e): descending keys order as (score descending, then e ascending); -0.0
 * counts as 0.0; the score's bits made monotonic take the high 32 bits. */
static inline int64_t order_key(float s, int64_t e) {
    if (s == 0.0f) s = 0.0f;
    int32_t bits;
    memcpy(&bits, &s, sizeof bits);
    const int64_t mono = bits < 0 ? -((int64_t)1 << 31) - 1 - (int64_t)bits : (int64_t)bits;
    return mono * ((int64_t)1 << 32) + (((int64_t)1 << 32) - 1 - e);
}

/* The k-th largest of a[0..n) (distinct values; a is reordered), 1 <= k <= n: quickselect. */
static int64_t kth_largest(int64_t *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, want = k - 1; /* index in descending order */
    while (lo < hi) {
        const int64_t pivot = a[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) {
                const int64_t t = a[i];
                a[i] = a[j], a[j] = t;
                i++, j--;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return a[want];
    }
    return a[want];
}

/* reference.py index_topk + the mask attention.py `_picked` makes of it, for one query row: keep[e] = entry e is
 * among the min(k, n) largest order_key(score, e) (entries e >= vis scored -inf) and e < vis. keys: n int64 of
 * scratch. The same selection as the torch top-k for the same scores, ties and -0.0 included. */
static void index_keep(const float *s, int64_t n, int64_t vis, int64_t k, int64_t *keys, uint8_t *keep) {
    for (int64_t e = 0; e < n; e++) keys[e] = order_key(e < vis ? s[e] : -INFINITY, e);
    const int64_t kk = k < n ? k : n;
    if (kk == n) {
        for (int64_t e = 0; e < n; e++) keep[e] = e < vis;
        return;
    }
    int64_t *copy = keys + n;
    memcpy(copy, keys, sizeof(int64_t) * (size_t)n);
    const int64_t thr = kth_largest(copy, n, kk);
    for (int64_t e = 0; e < n; e++) keep[e] = e < vis && keys[e] >= thr;
}

/*   dk_compress_pool  nki_kernels/reference.py compress_pool: kv, score [N, W, m, C], prev_kv / prev_score [N, m, C]
 *                     or NULL (CSA's block before block 0; NULL: absent) -> out [N, W, d], d = C / 2 (overlap) or C.
 *                     Returns 0, -1 when out of memory. */
int dk_compress_pool(const float *kv, const float *score, const float *prev_kv, const float *prev_score, int64_t N,
                     int64_t W, int64_t m, int64_t C, int overlap, float *out) {
    const int64_t d = overlap ? C / 2 : C, n = overlap ? 2 * m : m;
    if (n > POOL_SLOTS) return -2;
    const float **kp = (const float **)malloc(sizeof(float *) * (size_t)(2 * n));
    if (kp == NULL) return -1;
    const float **sp = kp + n;
    for (int64_t i = 0; i < N; i++)
        for (int64_t w = 0; w < W; w++) {
            const float *bk = kv + ((i * W + w) * m) * C, *bs = score + ((i * W + w) * m) * C;
            for (int64_t j = 0; j < m; j++) {
                if (!overlap) {
                    kp[j] = bk + j * C, sp[j] = bs + j * C;
                    continue;
                }
                /* the first m slots: block w - 1's first-half channels (block 0: prev's, or absent) */
                const float *pk = w ? bk - m * C : prev_kv != NULL ? prev_kv + (i * m) * C : NULL;
                const float *ps = w ? bs - m * C : prev_score != NULL ? prev_score + (i * m) * C : NULL;
                kp[j] = pk != NULL ? pk + j * C : NULL, sp[j] = ps != NULL ? ps + j * C : NULL;
                kp[m + j] = bk + j * C + d, sp[m + j] = bs + j * C + d; /* block w's second-half channels */
            }
            pool_slots(kp, sp, n, d, out + (i * W + w) * d);
        }
    free(kp);
    return 0;
}

/* Compressor.decode's closing block for one sequence: block w ends at state row `row` (its last token's), its m rows
 * (CSA: with the m rows of the block before) pooled, then rms_norm with the compressor's norm, RoPE of the trailing
 * rd dims at the block's first position (cs / sn: that position's row), written to dst. The same kernels as the
 * op-by-op path's `finish` (dk_rms_norm, dk_rope_tail) on the same values. */
static int close_block(const float *st_kv, const float *st_sc, int64_t rows, int64_t row, int64_t m, int64_t Wc,
                       int64_t d, const float *norm_w, float eps, const float *cs, const float *sn, int64_t rd,
                       float *dst) {
    const int overlap = Wc == 2 * d;
    const int64_t n = overlap ? 2 * m : m;
    if (n > POOL_SLOTS) return -2;
    const float **kp = (const float **)malloc(sizeof(float *) * (size_t)(2 * n) + sizeof(float) * (size_t)d);
    if (kp == NULL) return -1;
    const float **sp = kp + n;
    float *pooled = (float *)(sp + n);
    for (int64_t j = 0; j < m; j++) {
        const int64_t r = ((row - (m - 1) + j) % rows + rows) % rows;
        if (overlap) {
            const int64_t rp = ((row - (2 * m - 1) + j) % rows + rows) % rows;
            kp[j] = st_kv + rp * Wc, sp[j] = st_sc + rp * Wc;
            kp[m + j] = st_kv + r * Wc + d, sp[m + j] = st_sc + r * Wc + d;
        } else {
            kp[j] = st_kv + r * Wc, sp[j] = st_sc + r * Wc;
        }
    }
    pool_slots(kp, sp, n, d, pooled);
    int rc = dk_rms_norm(pooled, norm_w, pooled, 1, d, eps, 1);
    if (!rc) rc = dk_rope_tail(pooled, cs, sn, dst, 1, 1, d, rd, 0);
    free(kp);
    return rc;
}

int dk_attn_qkv(const float *x, int64_t T, int64_t dim, int fa, const uint8_t *wa, const uint8_t *sa,
                const float *q_norm, int64_t Q, int fb, const uint8_t *wb, const uint8_t *sb, int64_t H, int64_t D,
                int fk, const uint8_t *wk, const uint8_t *sk, const float *kv_norm, const float *cs, const float *sn,
                int64_t rd, float eps, float *qr, float *q, float *kv, int nt) {
    int rc = 0;
    if (q != NULL) { /* NULL: kv only (dk_mtp_draft's ring rows); the kv below does not depend on the query */
        rc = gemm(fa, x, wa, sa, qr, T, Q, dim, nt);
        if (!rc) rc = dk_rms_norm(qr, q_norm, qr, T, Q, eps, nt);
        if (!rc) rc = gemm(fb, qr, wb, sb, q, T, H * D, Q, nt);
        if (!rc) rc = dk_rms_norm(q, NULL, q, T * H, D, eps, nt);
        if (!rc) rc = dk_rope_tail(q, cs, sn, q, T, H, D, rd, 0);
    }
    if (!rc) rc = gemm(fk, x, wk, sk, kv, T, D, dim, nt);
    if (!rc) rc = dk_rms_norm(kv, kv_norm, kv, T, D, eps, nt);
    if (!rc) rc = dk_rope_tail(kv, cs, sn, kv, T, 1, D, rd, 0);
    return rc;
}

int dk_attn_decode(const float *q, int64_t B, int64_t H, int64_t D, float *ring, int64_t wl,
                   const int64_t *slots, const uint8_t *ring_valid, const float *pool, int64_t epb,
                   const int64_t *tables, int64_t nb, int64_t nloc, const int64_t *visible, const uint8_t *keep,
                   const float *iqT, const float *iw, const float *ipool, int64_t iepb, int64_t Hi, int64_t Di,
                   int64_t topk, const float *sink, float scale, const float *cs, const float *sn, int64_t rd,
                   const uint16_t *wo_a, int64_t G, int64_t R, int fb, const uint8_t *wb, const uint8_t *sb,
                   int64_t dim, const float *x, int64_t n, const float *post, const float *comb, float *out,
                   const float *new_kv, const int64_t *ring_rows, int64_t C, const void *const *cptr,
                   const int64_t *cdim, const float *ceps, float *held, const int64_t *held_pos, int64_t held_rows,
                   int64_t held_width, int nt) {
    if (nloc > nb * epb) return -2;
    if (held) /* DSpark's context input: each row's input streams x averaged into its held row */
        for (int64_t b = 0; b < B; b++)
            dk_stream_mean(x + b * n * dim, n, dim,
                           held + (slots[b] * held_rows + held_pos[b] % held_rows) * held_width);
    if (new_kv != NULL) {
        for (int64_t b = 0; b < B; b++)
            memcpy(ring + (slots[b] * wl + ring_rows[b]) * D, new_kv + b * D, sizeof(float) * (size_t)D);
        for (int64_t c = 0; c < C; c++) {
            const void *const *cp = cptr + CPTR * c;
            const int64_t *cd = cdim + CDIM * c;
            const float *kv_c = (const float *)cp[0], *sc_c = (const float *)cp[1], *ape = (const float *)cp[4];
            float *st_kv = (float *)cp[2], *st_sc = (float *)cp[3];
            const int64_t *row = (const int64_t *)cp[5], *phase = (const int64_t *)cp[6];
            const int64_t W = cd[0], rows = cd[1];
            for (int64_t b = 0; b < B; b++) {
                const int64_t at = (slots[b] * rows + row[b]) * W;
                memcpy(st_kv + at, kv_c + b * W, sizeof(float) * (size_t)W);
                for (int64_t i = 0; i < W; i++) st_sc[at + i] = sc_c[b * W + i] + ape[phase[b] * W + i];
            }
            /* the blocks that close: their entries into the compressor's pool (Compressor.decode's pooling) */
            const int64_t K = cd[2], epb = cd[3], m = cd[4], d = cd[5];
            const int64_t *idx = (const int64_t *)cp[7], *blk = (const int64_t *)cp[8];
            const float *ccs = (const float *)cp[9], *csn = (const float *)cp[10], *norm_w = (const float *)cp[11];
            float *cpool = (float *)cp[12];
            for (int64_t k = 0; k < K; k++) {
                const int64_t b = idx[k], u = blk[k];
                if (b < 0 || b >= B || u < 0 || u / epb >= nb) return -2;
                float *dst = cpool + (tables[b * nb + u / epb] * epb + u % epb) * d;
                int rc = close_block(st_kv + slots[b] * rows * W, st_sc + slots[b] * rows * W, rows, row[b], m, W, d,
                                     norm_w, ceps[c], ccs + k * (rd / 2), csn + k * (rd / 2), rd, dst);
                if (rc) return rc;
            }
        }
    }
    uint8_t *picks = NULL;
    if (iqT != NULL && nloc > 0) { /* the indexer's picks (Attention._entries' scores, _select's top-k) */
        if ((nloc - 1) / iepb >= nb) return -2;
        picks = (uint8_t *)malloc((size_t)(B * nloc) + sizeof(float) * (size_t)nloc +
                                  sizeof(int64_t) * (size_t)(2 * nloc) + sizeof(float *) * (size_t)nloc + 64);
        if (picks == NULL) return -1;
        const float **kp = (const float **)(((uintptr_t)(picks + B * nloc) + 15) & ~(uintptr_t)15);
        int64_t *okeys = (int64_t *)(kp + nloc);
        float *sc = (float *)(okeys + 2 * nloc);
        for (int64_t b = 0; b < B; b++) {
            for (int64_t e = 0; e < nloc; e++) kp[e] = ipool + (tables[b * nb + e / iepb] * iepb + e % iepb) * Di;
            index_scores_row(iqT + b * Di * Hi, iw + b * Hi, kp, nloc, Hi, Di, sc);
            index_keep(sc, nloc, visible[b], topk, okeys, picks + b * nloc);
        }
        keep = picks;
    }
    const int64_t N = wl + nloc, threads = nt > 0 ? nt : 1, scratch_n = threads * 2 * dk_attn_heads_per_pass() * N;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(B * N * D + scratch_n + 2 * B * H * D + B * G * R +
                                                          B * dim) + 64);
    uint8_t *valid = (uint8_t *)malloc((size_t)(B * N) + 1);
    if (buf == NULL || valid == NULL) {
        free(buf), free(valid), free(picks);
        return -1;
    }
    float *keys = buf, *scratch = keys + B * N * D, *o = scratch + scratch_n, *o2 = o + B * H * D, *y = o2 + B * H * D,
          *z = y + B * G * R;
    for (int64_t b = 0; b < B; b++) {
        float *kb = keys + b * N * D;
        memcpy(kb, ring + slots[b] * wl * D, sizeof(float) * (size_t)(wl * D));
        for (int64_t e = 0; e < nloc; e++)
            memcpy(kb + (wl + e) * D, pool + (tables[b * nb + e / epb] * epb + e % epb) * D, sizeof(float) * (size_t)D);
        memcpy(valid + b * N, ring_valid + b * wl, (size_t)wl);
        for (int64_t e = 0; e < nloc; e++)
            valid[b * N + wl + e] = e < visible[b] && (keep == NULL || keep[b * nloc + e]);
    }
    int rc = dk_sparse_attn(q, keys, valid, sink, o, scratch, scratch_n, B, 1, H, N, D, scale, nt);
    if (!rc) rc = dk_rope_tail(o, cs, sn, o2, B, H, D, rd, 1);
    if (!rc) rc = dk_bf16_grouped_linear(o2, wo_a, y, B, G, R, H * D / G, nt);
    if (!rc) rc = gemm(fb, y, wb, sb, z, B, dim, G * R, nt);
    if (!rc) rc = dk_hc_expand(z, x, post, comb, out, B, n, dim, nt);
    free(buf), free(valid), free(picks);
    return rc;
}

int dk_attn_front(const float *x, int64_t T, int64_t n, int64_t dim, const float *fn, const float *scale,
                  const float *base, int64_t iters, float hc_eps, float norm_eps, const float *norm_w, int fa,
                  const uint8_t *wa, const uint8_t *sa, const float *q_norm, int64_t Q, int fb, const uint8_t *wb,
                  const uint8_t *sb, int64_t H, int64_t D, int fk, const uint8_t *wk, const uint8_t *sk,
                  const float *kv_norm, const float *cs, const float *sn, int64_t rd, float eps, int64_t P,
                  const int *pf, const void *const *pw, const void *const *ps, const int64_t *pn, float *post,
                  float *comb, float *qr, float *q, float *kv, float *proj, int nt) {
    const int64_t M = T > 0 ? T : 1;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(M * (n + 2 * dim)) + 64);
    if (buf == NULL) return -1;
    float *pre = buf, *h = pre + M * n, *hn = h + M * dim;
    int rc = dk_hc_pre(x, fn, scale, base, norm_w, pre, post, comb, h, hn, T, n, dim, iters, hc_eps, norm_eps, nt);
    if (!rc)
        rc = dk_attn_qkv(hn, T, dim, fa, wa, sa, q_norm, Q, fb, wb, sb, H, D, fk, wk, sk, kv_norm, cs, sn, rd, eps, qr,
                         q, kv, nt);
    for (int64_t i = 0; i < P && rc == 0; i++) {
        rc = gemm(pf[i], hn, (const uint8_t *)pw[i], (const uint8_t *)ps[i], proj, T, pn[i], dim, nt);
        proj += T * pn[i];
    }
    free(buf);
    return rc;
}

int dk_decode_layer(const dk_layer *L, const float *x, float *out, int64_t B, const float *cs, const float *sn,
                    const int64_t *slots, const int64_t *ring_rows, const uint8_t *ring_valid, const int64_t *tables,
                    int64_t nb, int64_t nloc, const int64_t *visible, const void *const *crow, const int64_t *ck,
                    const int64_t *hash_ids, float *held, const int64_t *held_pos, int64_t held_rows,
                    int64_t held_width, int nt) {
    const int64_t n = L->n, dim = L->dim;
    int64_t proj_n = 0;
    for (int64_t i = 0; i < L->P; i++) proj_n += L->pn[i];
    float *buf = (float *)malloc(sizeof(float) * (size_t)(B * (n + n * n + L->Q + L->H * L->D + L->D + proj_n +
                                                               n * dim)) + 64);
    if (buf == NULL) return -1;
    float *post = buf, *comb = post + B * n, *qr = comb + B * n * n, *q = qr + B * L->Q, *kv = q + B * L->H * L->D,
          *proj = kv + B * L->D, *x2 = proj + B * proj_n;
    int rc = dk_attn_front(x, B, n, dim, L->a_fn, L->a_scale, L->a_base, L->iters, L->hc_eps, L->norm_eps, L->a_norm,
                           (int)L->fa, L->wa, L->sa, L->q_norm, L->Q, (int)L->fb, L->wb, L->sb, L->H, L->D, (int)L->fk,
                           L->wk, L->sk, L->kv_norm, cs, sn, L->rd, L->eps, L->P, L->pf, L->pw, L->ps, L->pn, post,
                           comb, qr, q, kv, proj, nt);
    const void *cptr[2 * CPTR];
    int64_t cdim[2 * CDIM];
    for (int64_t c = 0; c < L->C && c < 2; c++) {
        int64_t off = 0;
        for (int64_t i = 0; i < 2 * c; i++) off += B * L->pn[i];
        const void **cp = cptr + CPTR * c;
        const void *const *cr = crow + 6 * c; /* state rows, phases, closing rows, block ids, cos, sin */
        cp[0] = proj + off, cp[1] = proj + off + B * L->pn[2 * c];
        cp[2] = L->states[c][0], cp[3] = L->states[c][1], cp[4] = L->states[c][2];
        for (int i = 0; i < 6; i++) cp[5 + i] = cr[i];
        cp[11] = L->states[c][3], cp[12] = L->states[c][4];
        int64_t *cd = cdim + CDIM * c;
        cd[0] = L->W[c], cd[1] = L->rows[c], cd[2] = ck[c], cd[3] = L->cepb[c], cd[4] = L->cm[c], cd[5] = L->cd[c];
    }
    if (!rc)
        rc = dk_attn_decode(q, B, L->H, L->D, L->ring, L->wl, slots, ring_valid, nloc ? L->pool : NULL, L->epb, tables,
                            nb, nloc, visible, NULL, NULL, NULL, NULL, 1, 0, 0, 0, L->sink, L->scale, cs, sn, L->rd,
                            L->wo_a, L->G, L->R, (int)L->fo, L->wo, L->so, dim, x, n, post, comb, x2, kv, ring_rows,
                            L->C, cptr, cdim, L->ceps, held, held_pos, held_rows, held_width, nt);
    if (!rc)
        rc = dk_ffn_site(x2, B, n, dim, L->f_fn, L->f_scale, L->f_base, L->iters, L->hc_eps, L->norm_eps, L->f_norm,
                         L->gate_w, L->E, L->bias, hash_ids, L->K, L->route_scale, L->I, L->limit, L->e_lo, L->e_n,
                         (int)L->fmt_r, L->r, (int)L->fmt_s, L->s, out, nt);
    free(buf);
    return rc;
}

/* The MTP block's input (engine/model/model.py Transformer.mtp_input): out [T, n, dim] = e_proj(rms_norm(embed[ids],
 * enorm)) on every stream + h_proj(rms_norm(x, hnorm)) over the T*n stream rows of x [T, n, dim]; embed [V, dim] rows
 * bf16 (ebf16) or fp32, widened exactly; e_proj / h_proj [dim, dim] in format fe / fh (dk.h gemm). The host table's
 * ops in the op-by-op order, so the same bits. -1: out of memory, -3: an id outside [0, V). */
int dk_mtp_input(const float *x, const int64_t *ids, const void *embed, int ebf16, int64_t V, const float *enorm,
                 const float *hnorm, float eps, int fe, const uint8_t *we, const uint8_t *se, int fh, const uint8_t *wh,
                 const uint8_t *sh, float *out, int64_t T, int64_t n, int64_t dim, int nt) {
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= V) return -3;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(3 * T * dim + T * n * dim) + 64);
    if (buf == NULL) return -1;
    float *e = buf, *en = e + T * dim, *ep = en + T * dim, *hn = ep + T * dim;
    for (int64_t t = 0; t < T; t++) {
        if (ebf16) {
            const uint16_t *row = (const uint16_t *)embed + ids[t] * dim;
            for (int64_t d = 0; d < dim; d++) {
                const uint32_t bits = (uint32_t)row[d] << 16;
                memcpy(e + t * dim + d, &bits, sizeof(float));
            }
        } else {
            memcpy(e + t * dim, (const float *)embed + ids[t] * dim, sizeof(float) * (size_t)dim);
        }
    }
    int rc = dk_rms_norm(e, enorm, en, T, dim, eps, nt);
    if (!rc) rc = gemm(fe, en, we, se, ep, T, dim, dim, nt);
    if (!rc) rc = dk_rms_norm(x, hnorm, hn, T * n, dim, eps, nt);
    if (!rc) rc = gemm(fh, hn, wh, sh, out, T * n, dim, dim, nt);
    for (int64_t t = 0; t < T && !rc; t++)
        for (int64_t j = 0; j < n; j++)
            for (int64_t d = 0; d < dim; d++) out[(t * n + j) * dim + d] = ep[t * dim + d] + out[(t * n + j) * dim + d];
    free(buf);
    return rc;
}

/* The LM head (engine/model/model.py Transformer.logits): logits [T, V] = head(rms_norm(hc_head(x), norm_w)) for the
 * streams x [T, n, dim], head [V, dim] in format fmt (dk.h gemm); the host table's ops in their order. -1: out of
 * memory, -2: n outside hc_head's range. */
int dk_lm_head(const float *x, int64_t T, int64_t n, int64_t dim, const float *fn, const float *scale,
               const float *base, float hc_eps, float norm_eps, const float *norm_w, int fmt, const uint8_t *w,
               const uint8_t *s, int64_t V, float *logits, int nt) {
    float *buf = (float *)malloc(sizeof(float) * (size_t)(2 * T * dim) + 64);
    if (buf == NULL) return -1;
    float *h = buf, *hn = h + T * dim;
    int rc = dk_hc_head(x, fn, scale, base, h, T, n, dim, hc_eps, norm_eps, nt);
    if (!rc) rc = dk_rms_norm(h, norm_w, hn, T, dim, norm_eps, nt);
    if (!rc) rc = gemm(fmt, hn, w, s, logits, T, V, dim, nt);
    free(buf);
    return rc;
}

/* One pass of an MTP block as the draft head runs it (engine/model/model.py Transformer.mtp_pass): dk_mtp_input
 * (x [B, n, dim], ids [B]; `in`: its static arguments) -> dk_decode_layer (L and the step's arguments, as that takes
 * them) -> streams [B, n, dim]; then dk_lm_head (`hd`) over the R rows `rows` of them, copied out first as the
 * op-by-op path indexes them -> logits [R, V], and each row's first largest logit -> tokens [R] (torch.argmax). */
typedef struct {
    const void *embed;
    int64_t ebf16, V;
    const float *enorm, *hnorm;
    float eps;
    int64_t fe;
    const uint8_t *we, *se;
    int64_t fh;
    const uint8_t *wh, *sh;
} dk_mtp_in;

typedef struct {
    const float *fn, *scale, *base;
    float hc_eps, norm_eps;
    const float *norm_w;
    int64_t fmt;
    const uint8_t *w, *s;
    int64_t V;
} dk_head;

int dk_mtp_pass(const dk_layer *L, const dk_mtp_in *in, const dk_head *hd, const float *x, const int64_t *ids,
                float *streams, int64_t B, const float *cs, const float *sn, const int64_t *slots,
                const int64_t *ring_rows, const uint8_t *ring_valid, const int64_t *tables, int64_t nb, int64_t nloc,
                const int64_t *visible, const void *const *crow, const int64_t *ck, const int64_t *rows, int64_t R,
                float *logits, int64_t *tokens, int nt) {
    const int64_t n = L->n, dim = L->dim, V = hd->V;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(B * n * dim + R * n * dim) + 64);
    if (buf == NULL) return -1;
    float *h = buf, *sel = h + B * n * dim;
    int rc = dk_mtp_input(x, ids, in->embed, (int)in->ebf16, in->V, in->enorm, in->hnorm, in->eps, (int)in->fe, in->we,
                          in->se, (int)in->fh, in->wh, in->sh, h, B, n, dim, nt);
    if (!rc)
        rc = dk_decode_layer(L, h, streams, B, cs, sn, slots, ring_rows, ring_valid, tables, nb, nloc, visible, crow,
                             ck, NULL, NULL, NULL, 0, 0, nt);
    for (int64_t r = 0; r < R && !rc; r++)
        memcpy(sel + r * n * dim, streams + rows[r] * n * dim, sizeof(float) * (size_t)(n * dim));
    if (!rc)
        rc = dk_lm_head(sel, R, n, dim, hd->fn, hd->scale, hd->base, hd->hc_eps, hd->norm_eps, hd->norm_w,
                        (int)hd->fmt, hd->w, hd->s, V, logits, nt);
    for (int64_t r = 0; r < R && !rc; r++) {
        const float *l = logits + r * V;
        int64_t best = 0;
        for (int64_t v = 1; v < V; v++)
            if (l[v] > l[best] || (l[v] != l[v] && l[best] == l[best])) best = v; /* NaN is the largest, as torch */
        tokens[r] = best;
    }
    free(buf);
    return rc;
}

/* Ring rows and masks of window-ring queries at positions pos [B] (one rank; engine/model/attention.py
 * Attention._ring_valid): row pos % wl; ring row i holds position pos - d_i, d_i = (pos - i) mod wl, seen iff
 * d_i < win and d_i <= pos. */
static void ring_index(const int64_t *pos, int64_t B, int64_t wl, int64_t win, int64_t *rows, uint8_t *valid) {
    for (int64_t b = 0; b < B; b++) {
        rows[b] = pos[b] % wl;
        for (int64_t i = 0; i < wl; i++) {
            const int64_t d = ((pos[b] - i) % wl + wl) % wl;
            valid[b * wl + i] = (uint8_t)(d < win && d <= pos[b]);
        }
    }
}

/* MTP drafting in one call (engine/model/mtp_proposer.py propose_mtp, greedy drafts) for a sliding-only block (no
 * entries, no compressor; one rank): the catch-up over x [B, n, dim], ids [B] at positions pos [B] of slots [B], then
 * K - 1 recursion passes over the R sequences. `rows`: each sequence's last row; every other row is before its
 * sequence's last within the window, and a later query reads nothing of it but its ring row, the kv of its block
 * input: those rows run dk_mtp_input and the kv half of dk_attn_front (no query) and write their ring rows first,
 * then the R last rows run one dk_mtp_pass -> drafts 1. Recursion pass j is fed the streams of pass j - 1's rows and
 * its tokens, at positions pos[rows[r]] + j. RoPE rows are those positions' rows of the tables tcs / tsn [P, rd/2]
 * (the block's Rope over positions P0..P0+P-1), ring rows and masks made from the positions (ring_index; `win`: the
 * attention's window). -> logits [K, R, V], tokens [K, R]; the same calls as propose_mtp's op-by-op catch-up
 * (mtp_fill_ring over the earlier rows, one mtp_pass over the last ones) and passes, so the same bits. -1: out of
 * memory, -3: an id out of range, -4: the layer has entries or compressors, -5: a position outside [P0, P0 + P) or a
 * row outside [0, B) or given twice. */
int dk_mtp_draft(const dk_layer *L, const dk_mtp_in *in, const dk_head *hd, const float *x, const int64_t *ids,
                 int64_t B, const float *tcs, const float *tsn, int64_t P0, int64_t P, const int64_t *slots,
                 const int64_t *pos, const int64_t *rows, int64_t R, int64_t K, int64_t win, float *logits,
                 int64_t *tokens, int nt) {
    if (L->C != 0 || L->pool != NULL) return -4;
    const int64_t n = L->n, dim = L->dim, nd = n * dim, half = L->rd / 2, V = hd->V, wl = L->wl, D = L->D,
                  F = B - R, M = B + (K - 1) * R;
    if (F < 0) return -5;
    for (int64_t b = 0; b < B; b++) {
        if (ids[b] < 0 || ids[b] >= in->V) return -3; /* before any ring row is written */
        if (pos[b] < P0 || pos[b] - P0 >= P) return -5;
    }
    for (int64_t r = 0; r < R; r++)
        if (rows[r] < 0 || rows[r] >= B || pos[rows[r]] + K - 1 - P0 >= P) return -5;
    /* pass rows m: the catch-up's earlier rows (F), its last rows (R), then each recursion pass's R */
    float *buf = (float *)malloc(sizeof(float) * (size_t)(B * nd + F * nd + 2 * R * nd + 2 * M * half +
                                                          F * (n + n * n + D)) + 64);
    int64_t *ix = (int64_t *)malloc(sizeof(int64_t) * (size_t)(4 * M + R + B) + 8);
    uint8_t *valid = (uint8_t *)malloc((size_t)(M * wl + B) + 8);
    if (buf == NULL || ix == NULL || valid == NULL) {
        free(buf);
        free(ix);
        free(valid);
        return -1;
    }
    float *xin = buf, *h = xin + B * nd, *xs = h + F * nd, *out = xs + R * nd, *cs = out + R * nd, *sn = cs + M * half,
          *post = sn + M * half, *comb = post + F * n, *kv = comb + F * n * n;
    int64_t *ring = ix, *at = ring + M, *sl = at + M, *src = sl + M, *every = src + M, *ids_in = every + R;
    uint8_t *is_last = valid + M * wl;
    memset(is_last, 0, (size_t)B);
    for (int64_t r = 0; r < R; r++) {
        if (is_last[rows[r]]) { /* a row given twice: the earlier rows below would not be B - R */
            free(buf);
            free(ix);
            free(valid);
            return -5;
        }
        is_last[rows[r]] = 1;
    }
    int rc = 0;
    for (int64_t b = 0, f = 0; b < B; b++)
        if (!is_last[b]) src[f++] = b;
    for (int64_t r = 0; r < R; r++) {
        src[F + r] = rows[r], every[r] = r;
        for (int64_t j = 1; j < K; j++) {
            const int64_t m = B + (j - 1) * R + r;
            at[m] = pos[rows[r]] + j, sl[m] = slots[rows[r]];
        }
    }
    for (int64_t m = 0; m < B; m++) {
        at[m] = pos[src[m]], sl[m] = slots[src[m]], ids_in[m] = ids[src[m]];
        memcpy(xin + m * nd, x + src[m] * nd, sizeof(float) * (size_t)nd);
    }
    for (int64_t m = 0; m < M; m++) { /* the passes' RoPE rows */
        memcpy(cs + m * half, tcs + (at[m] - P0) * half, sizeof(float) * (size_t)half);
        memcpy(sn + m * half, tsn + (at[m] - P0) * half, sizeof(float) * (size_t)half);
    }
    ring_index(at, M, wl, win, ring, valid);
    if (F > 0 && !rc) /* the earlier rows: their ring rows only */
        rc = dk_mtp_input(xin, ids_in, in->embed, (int)in->ebf16, in->V, in->enorm, in->hnorm, in->eps, (int)in->fe,
                          in->we, in->se, (int)in->fh, in->wh, in->sh, h, F, n, dim, nt);
    if (F > 0 && !rc)
        rc = dk_attn_front(h, F, n, dim, L->a_fn, L->a_scale, L->a_base, L->iters, L->hc_eps, L->norm_eps, L->a_norm,
                           (int)L->fa, L->wa, L->sa, L->q_norm, L->Q, (int)L->fb, L->wb, L->sb, L->H, D, (int)L->fk,
                           L->wk, L->sk, L->kv_norm, cs, sn, L->rd, L->eps, 0, NULL, NULL, NULL, NULL, post, comb, NULL,
                           NULL, kv, NULL, nt);
    for (int64_t m = 0; m < F && !rc; m++)
        memcpy(L->ring + (sl[m] * wl + ring[m]) * D, kv + m * D, sizeof(float) * (size_t)D);
    if (!rc) /* the last rows: the whole pass -> drafts 1 */
        rc = dk_mtp_pass(L, in, hd, xin + F * nd, ids_in + F, xs, R, cs + F * half, sn + F * half, sl + F, ring + F,
                         valid + F * wl, NULL, 0, 0, NULL, NULL, NULL, every, R, logits, tokens, nt);
    for (int64_t j = 1; j < K && !rc; j++) {
        const int64_t o = (j - 1) * R, m = B + o;
        rc = dk_mtp_pass(L, in, hd, xs, tokens + o, out, R, cs + m * half, sn + m * half, sl + m, ring + m,
                         valid + m * wl, NULL, 0, 0, NULL, NULL, NULL, every, R, logits + j * R * V, tokens + o + R,
                         nt);
        float *t = xs;
        xs = out, out = t;
    }
    free(buf);
    free(ix);
    free(valid);
    return rc;
}

/* dk_layer's size and its fields' offsets, in dk.h's order: engine/host_kernels/layer_ops.py checks its ctypes
 * mirror against them when it loads the library. Returns the number of fields; out (room for cap values): the
 * size, then each offset. */
int64_t dk_layer_layout(int64_t *out, int64_t cap) {
    static const int64_t offs[] = {
        offsetof(dk_layer, a_fn), offsetof(dk_layer, a_scale), offsetof(dk_layer, a_base), offsetof(dk_layer, iters),
        offsetof(dk_layer, hc_eps), offsetof(dk_layer, norm_eps), offsetof(dk_layer, a_norm), offsetof(dk_layer, fa),
        offsetof(dk_layer, wa), offsetof(dk_layer, sa), offsetof(dk_layer, q_norm), offsetof(dk_layer, Q),
        offsetof(dk_layer, fb), offsetof(dk_layer, wb), offsetof(dk_layer, sb), offsetof(dk_layer, H),
        offsetof(dk_layer, D), offsetof(dk_layer, fk), offsetof(dk_layer, wk), offsetof(dk_layer, sk),
        offsetof(dk_layer, kv_norm), offsetof(dk_layer, rd), offsetof(dk_layer, eps), offsetof(dk_layer, scale),
        offsetof(dk_layer, P), offsetof(dk_layer, pf), offsetof(dk_layer, pw), offsetof(dk_layer, ps),
        offsetof(dk_layer, pn), offsetof(dk_layer, ring), offsetof(dk_layer, wl), offsetof(dk_layer, pool),
        offsetof(dk_layer, epb), offsetof(dk_layer, sink), offsetof(dk_layer, wo_a), offsetof(dk_layer, G),
        offsetof(dk_layer, R), offsetof(dk_layer, fo), offsetof(dk_layer, wo), offsetof(dk_layer, so),
        offsetof(dk_layer, C), offsetof(dk_layer, states), offsetof(dk_layer, W), offsetof(dk_layer, rows),
        offsetof(dk_layer, cepb), offsetof(dk_layer, cm), offsetof(dk_layer, cd), offsetof(dk_layer, ceps),
        offsetof(dk_layer, f_fn), offsetof(dk_layer, f_scale), offsetof(dk_layer, f_base), offsetof(dk_layer, f_norm),
        offsetof(dk_layer, gate_w), offsetof(dk_layer, E), offsetof(dk_layer, bias), offsetof(dk_layer, K),
        offsetof(dk_layer, route_scale), offsetof(dk_layer, limit), offsetof(dk_layer, I), offsetof(dk_layer, e_lo),
        offsetof(dk_layer, e_n), offsetof(dk_layer, fmt_r), offsetof(dk_layer, r), offsetof(dk_layer, fmt_s),
        offsetof(dk_layer, s), offsetof(dk_layer, n), offsetof(dk_layer, dim)};
    const int64_t n = (int64_t)(sizeof(offs) / sizeof(offs[0]));
    if (cap > 0) out[0] = (int64_t)sizeof(dk_layer);
    for (int64_t i = 0; i < n && i + 1 < cap; i++) out[i + 1] = offs[i];
    return n;
}
