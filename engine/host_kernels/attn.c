/* The front of the attention of a decode step in one native call (loaded with gemv.c, mhc.c and moe.c as one
 * library by engine/host_kernels/__init__.py; same build flags, no torch headers).
 *
 *   dk_attn_qkv  the op table's `attn_qkv` (engine/model/ops.py; engine/model/attention.py Attention._qkv), fp32:
 *                qr [T, Q]    = rms_norm(x @ wq_a^T, q_norm)
 *                q  [T, H, D] = rope_tail(head_rms(qr @ wq_b^T), cos, sin)   (head_rms: rms_norm, no weight)
 *                kv [T, D]    = rope_tail(rms_norm(x @ wkv^T, kv_norm), cos, sin)
 *
 * The steps are the library's own kernels (gemv.c's GEMVs, mhc.c's dk_rms_norm and dk_rope_tail) called in the
 * composite's order with the arguments `--kernels host` passes them op by op, so the results are that path's bit for
 * bit. What it saves is the Python between them: eight op-table calls per layer and step. Norms and RoPE run in
 * place on the outputs (both read a row before writing it). Weight formats as in dk.h (fa, fb, fk); cos / sin
 * [T, rd/2]. Returns 0, else the first kernel's non-zero code.
 */
#include <stddef.h>
#include <stdint.h>

#include "dk.h"

int dk_attn_qkv(const float *x, int64_t T, int64_t dim, int fa, const uint8_t *wa, const uint8_t *sa,
                const float *q_norm, int64_t Q, int fb, const uint8_t *wb, const uint8_t *sb, int64_t H, int64_t D,
                int fk, const uint8_t *wk, const uint8_t *sk, const float *kv_norm, const float *cs, const float *sn,
                int64_t rd, float eps, float *qr, float *q, float *kv, int nt) {
    int rc = gemm(fa, x, wa, sa, qr, T, Q, dim, nt);
    if (!rc) rc = dk_rms_norm(qr, q_norm, qr, T, Q, eps, nt);
    if (!rc) rc = gemm(fb, qr, wb, sb, q, T, H * D, Q, nt);
    if (!rc) rc = dk_rms_norm(q, NULL, q, T * H, D, eps, nt);
    if (!rc) rc = dk_rope_tail(q, cs, sn, q, T, H, D, rd, 0);
    if (!rc) rc = gemm(fk, x, wk, sk, kv, T, D, dim, nt);
    if (!rc) rc = dk_rms_norm(kv, kv_norm, kv, T, D, eps, nt);
    if (!rc) rc = dk_rope_tail(kv, cs, sn, kv, T, 1, D, rd, 0);
    return rc;
}
