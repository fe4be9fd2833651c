"""Compressor pooling: per-channel softmax over the tokens of a block.

HCA (`overlap=False`, m = 128): entry_w[c] = sum_j softmax_j(score[w, j, c]) * kv[w, j, c] over the m tokens.
CSA (`overlap=True`, m = 4, C = 2d): entry_w pools 2m slots: first-half channels of block w-1 (or of `prev`, or
absent for w = 0) and second-half channels of block w. RMSNorm / RoPE / FP8-simulation of the entries are the
caller's (they are `rmsnorm` and the engine's rope), as in `reference.compress_pool`.

IO layout (channel-major: channels on partitions, the softmax runs along the free axis)
    kvT, scT        [C, W*m]  HBM fp32 (or bf16, widened on load): `kv`/`score` [W, m, C] transposed by the
                              wrapper's layout adapter (a projection can emit this layout directly: W x^T)
    prev_kvT/scT    [C, m]    HBM fp32: the block before w = 0 (CSA); absent = kv 0, score -1e30 (exp -> 0)
    out             [d, W]    shared HBM fp32 (d = C for HCA, C/2 for CSA); the wrapper returns [W, d]
Precision
    fp32: per-block max (negated by the reduction), exp with the max as a [P,1] bias and the fused row-sum on
    the Scalar Engine, weighted sum, one reciprocal multiply.
Constraints
    Any W, C (partial channel tiles); one slot tile [128, WB, 2m] fp32 per chunk of WB blocks.
Tunables
    `SLOT_BYTES` = 16 KiB per partition per slot tile -> WB = 4096 // (2m) blocks per chunk.
"""

from __future__ import annotations

import torch

from nki_kernels import _convert, dispatch
from nki_kernels._nki import nisa, nki, nl
from nki_kernels.cases import Case, CaseRun, case, gen_for, randn, timed

NAME = "compress_pool"
NEG = -1.0e30  # "absent slot" score: exp(NEG - max) == 0 in fp32


@nki.jit
def compress_pool_kernel(kvT, scT, prev_kvT, prev_scT, m, overlap):
    num_c = kvT.shape[0]
    num_w = kvT.shape[1] // m
    num_d = num_c // 2 if overlap else num_c
    slots = 2 * m if overlap else m
    wb = max(1, 4096 // slots)
    out = nl.ndarray((num_d, num_w), dtype=nl.float32, buffer=nl.shared_hbm)
    for c0 in range(0, num_d, 128):
        cp = min(128, num_d - c0)
        for w0 in range(0, num_w, wb):
            ww = min(wb, num_w - w0)
            z = nl.ndarray((cp, ww, slots), dtype=nl.float32, buffer=nl.sbuf)
            v = nl.ndarray((cp, ww, slots), dtype=nl.float32, buffer=nl.sbuf)
            if overlap:
                # slots m..2m-1: second-half channels of block w
                nisa.dma_copy(z[0:cp, 0:ww, m:slots], scT[num_d + c0:num_d + c0 + cp, w0 * m:(w0 + ww) * m])
                nisa.dma_copy(v[0:cp, 0:ww, m:slots], kvT[num_d + c0:num_d + c0 + cp, w0 * m:(w0 + ww) * m])
                # slots 0..m-1: first-half channels of block w-1
                if w0 == 0:
                    nisa.dma_copy(z[0:cp, 0, 0:m], prev_scT[c0:c0 + cp, 0:m])
                    nisa.dma_copy(v[0:cp, 0, 0:m], prev_kvT[c0:c0 + cp, 0:m])
                    if ww > 1:
                        nisa.dma_copy(z[0:cp, 1:ww, 0:m], scT[c0:c0 + cp, 0:(ww - 1) * m])
                        nisa.dma_copy(v[0:cp, 1:ww, 0:m], kvT[c0:c0 + cp, 0:(ww - 1) * m])
                else:
                    nisa.dma_copy(z[0:cp, 0:ww, 0:m], scT[c0:c0 + cp, (w0 - 1) * m:(w0 + ww - 1) * m])
                    nisa.dma_copy(v[0:cp, 0:ww, 0:m], kvT[c0:c0 + cp, (w0 - 1) * m:(w0 + ww - 1) * m])
            else:
                nisa.dma_copy(z, scT[c0:c0 + cp, w0 * m:(w0 + ww) * m])
                nisa.dma_copy(v, kvT[c0:c0 + cp, w0 * m:(w0 + ww) * m])
            negmax = nl.ndarray((cp, ww), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(negmax, nl.maximum, z, axis=(2,), negate=True)
            den = nl.ndarray((cp, ww), dtype=nl.float32, buffer=nl.sbuf)
            for w in range(ww):
                nisa.activation(z[0:cp, w, 0:slots], nl.exp, z[0:cp, w, 0:slots], bias=negmax[0:cp, w:w + 1],
                                reduce_op=nl.add, reduce_res=den[0:cp, w:w + 1],
                                reduce_cmd=nisa.reduce_cmd.reset_reduce)
            nisa.tensor_tensor(v, v, z, nl.multiply)
            num = nl.ndarray((cp, ww), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(num, nl.add, v, axis=(2,))
            rden = nl.ndarray((cp, ww), dtype=nl.float32, buffer=nl.sbuf)
            nisa.reciprocal(rden, den)
            res = nl.ndarray((cp, ww), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(res, num, rden, nl.multiply)
            nisa.dma_copy(out[c0:c0 + cp, w0:w0 + ww], res)
    return out


def compress_pool(kv: torch.Tensor, score: torch.Tensor, overlap: bool, prev_kv: torch.Tensor | None = None,
                  prev_score: torch.Tensor | None = None, *, executor: str | None = None) -> torch.Tensor:
    """kv, score [..., W, m, C] (+ prev [..., m, C]) -> [..., W, d] fp32, as `reference.compress_pool`."""
    from nki_kernels import reference

    if kv.shape != score.shape or kv.dim() < 3:
        raise ValueError(f"compress_pool: kv {tuple(kv.shape)} and score {tuple(score.shape)} must be [..., W, m, C]")
    if overlap and kv.shape[-1] % 2:
        raise ValueError("compress_pool: CSA needs an even channel count C = 2d")
    if (prev_kv is None) != (prev_score is None):
        raise ValueError("compress_pool: prev_kv and prev_score go together")
    if executor == "reference":
        return dispatch.dispatch(NAME, compress_pool_kernel, (), executor, reference=lambda: reference.compress_pool(
            kv, score, overlap, prev_kv, prev_score))[1]
    *lead, w, m, c = kv.shape
    kv3, sc3 = kv.reshape(-1, w, m, c), score.reshape(-1, w, m, c)
    pkv = prev_kv.reshape(-1, m, c) if prev_kv is not None else None
    psc = prev_score.reshape(-1, m, c) if prev_score is not None else None
    outs = []
    for b in range(kv3.shape[0]):
        kvT = kv3[b].reshape(w * m, c).t().contiguous()  # layout adapter: channel-major
        scT = sc3[b].reshape(w * m, c).t().contiguous()
        if pkv is not None:
            pk, ps_ = pkv[b].float().t().contiguous(), psc[b].float().t().contiguous()
        else:
            pk, ps_ = torch.zeros(c, m), torch.full((c, m), NEG)
        args = (_convert.to_np(kvT), _convert.to_np(scT), _convert.to_np(pk), _convert.to_np(ps_), int(m),
                bool(overlap))
        _, out = dispatch.dispatch(NAME, compress_pool_kernel, args, executor)
        outs.append(_convert.from_np(out).t())
    return torch.stack(outs).reshape(*lead, w, -1)


CASES: list[Case] = []
for _dt in ("float32", "bfloat16"):
    CASES += [
        case(NAME, "HCA tiny-model W=2 m=16 d=64", _dt, w=2, m=16, d=64, overlap=False, prev=False),
        case(NAME, "CSA tiny-model W=8 m=4 d=32", _dt, w=8, m=4, d=32, overlap=True, prev=False),
        case(NAME, "CSA with prev W=5 m=4 d=64", _dt, w=5, m=4, d=64, overlap=True, prev=True),
        case(NAME, "HCA tile edge W=3 m=16 d=200", _dt, w=3, m=16, d=200, overlap=False, prev=False),
        case(NAME, "CSA tile edge W=600 m=4 d=130", _dt, w=600, m=4, d=130, overlap=True, prev=True),
        case(NAME, "V4 HCA W=8 m=128 d=512", _dt, w=8, m=128, d=512, overlap=False, prev=False),
        case(NAME, "V4 CSA W=64 m=4 d=512", _dt, w=64, m=4, d=512, overlap=True, prev=True),
        case(NAME, "V4 indexer CSA W=64 m=4 d=128", _dt, w=64, m=4, d=128, overlap=True, prev=False),
        case(NAME, "V4 HCA prefill W=32 m=128 d=512", _dt, slow=True, w=32, m=128, d=512, overlap=False, prev=False),
    ]


def run_case(c: Case, executor: str) -> CaseRun:
    from nki_kernels import reference

    p, g, dt = c.p, gen_for(c), c.torch_dtype
    w, m, d = p["w"], p["m"], p["d"]
    ch = 2 * d if p["overlap"] else d
    kv = randn((w, m, ch), g, dt)
    sc = randn((w, m, ch), g, dt, scale=3.0)
    pk = randn((m, ch), g, dt) if p["prev"] else None
    ps_ = randn((m, ch), g, dt, scale=3.0) if p["prev"] else None
    y, ms = timed(lambda: compress_pool(kv, sc, p["overlap"], pk, ps_, executor=executor))
    want = reference.compress_pool(kv.float(), sc.float(), p["overlap"],
                                   None if pk is None else pk.float(), None if ps_ is None else ps_.float())
    kind = "CSA" if p["overlap"] else "HCA"
    return CaseRun(f"kv,score[{w},{m},{ch}] {kind}{' +prev' if p['prev'] else ''}", [y], [want],
                   dispatch.resolve_executor(executor), ms)
