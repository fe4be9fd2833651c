"""Sparse attention with a per-head sink over a shared K = V head.

    o_h = sum_j exp(l_j) kv_j / (sum_j exp(l_j) + exp(sink_h)),  l_j = scale * q_h . kv_j  over the keys valid
    for the query (window keys + the selected / visible compressed entries, gathered by the caller into kv).
The inverse RoPE on o's rope dims is left to the caller (it is `reference.rope_apply(..., inverse=True)`), as
are the gathers: this kernel sees one [N, D] key block per sequence and a [T, N] validity mask.

IO layout
    q     [T, H, D]  HBM bf16/fp32, per query: heads on partitions (H <= 128), D moved onto partitions by PE
                     transposes for the QK^T stationary operand
    kv    [N, D]     HBM, dtype of q: loaded once twice over: K-major kv^T [128, D/128, N] (QK^T moving) and
                     key-major [128, N/128, D] (PV moving, D <= 512)
    bias  [T, N]     HBM fp32: 0 for a valid key, -1e30 otherwise (the wrapper's adapter of `valid`), broadcast
                     over the heads with a ones-matmul
    sink  [H, 1]     HBM fp32
    out   [T, H, D]  shared HBM, dtype of q
Precision
    fp32 PSUM logits, fp32 softmax (max incl. the sink, exp with a [P,1] bias and fused row sum on the Scalar
    Engine); P is rounded to q.dtype for the PV matmul (bf16 x bf16 -> fp32 PSUM), normalised in fp32, one
    rounding to q.dtype.
Constraints
    H <= 128, D <= 512, any N (partial 128-key tiles), N * 4 B * 3 per partition in SBUF.
Tunables
    `N_CHUNK` = 512 keys per QK^T PSUM bank.
"""

from __future__ import annotations

import torch

from nki_kernels import _convert, dispatch
from nki_kernels._nki import nisa, nki, nl
from nki_kernels._tiles import bcast_row, load_xT, transpose_to
from nki_kernels.cases import Case, CaseRun, case, gen_for, randn, timed

NAME = "sparse_attn"
MASKED = -1.0e30


@nki.jit
def sparse_attn_kernel(q, kv, bias, sink, scale):
    num_t = q.shape[0]
    num_h = q.shape[1]
    num_d = q.shape[2]
    num_n = kv.shape[0]
    ndc = (num_d + 127) // 128
    nnc = (num_n + 127) // 128
    out = nl.ndarray((num_t, num_h, num_d), dtype=q.dtype, buffer=nl.shared_hbm)
    q_rows = q.reshape((num_t * num_h, num_d))
    out_rows = out.reshape((num_t * num_h, num_d))
    ones = nl.ndarray((1, 128), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(ones, 1.0)
    sink_t = nl.ndarray((num_h, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(sink_t, sink)
    kvT = nl.ndarray((128, ndc, num_n), dtype=q.dtype, buffer=nl.sbuf)
    kv_n = nl.ndarray((128, nnc, num_d), dtype=q.dtype, buffer=nl.sbuf)
    for nc in range(nnc):
        n0 = nc * 128
        nb = min(128, num_n - n0)
        load_xT(kvT, kv, n0, nb, 0, num_d, n0, q.dtype)
        nisa.dma_copy(kv_n[0:nb, nc, 0:num_d], kv[n0:n0 + nb, 0:num_d])
    for t in range(num_t):
        qT = nl.ndarray((128, ndc, num_h), dtype=q.dtype, buffer=nl.sbuf)
        load_xT(qT, q_rows, t * num_h, num_h, 0, num_d, 0, q.dtype)
        brow = nl.ndarray((1, num_n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(brow, bias[t:t + 1, 0:num_n])
        lg = nl.ndarray((num_h, num_n), dtype=nl.float32, buffer=nl.sbuf)
        bcast_row(lg, brow, ones)
        for n0 in range(0, num_n, 512):
            nw = min(512, num_n - n0)
            ps = nl.ndarray((num_h, nw), dtype=nl.float32, buffer=nl.psum)
            for dc in range(ndc):
                dw = min(128, num_d - dc * 128)
                nisa.nc_matmul(ps, qT[0:dw, dc, 0:num_h], kvT[0:dw, dc, n0:n0 + nw])
            s = nl.ndarray((num_h, nw), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(s, ps, nl.multiply, scale)
            nisa.tensor_tensor(lg[0:num_h, n0:n0 + nw], lg[0:num_h, n0:n0 + nw], s, nl.add)
        # softmax with the sink: m = max(max_j l_j, sink)
        mx = nl.ndarray((num_h, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(mx, nl.maximum, lg, axis=(1,))
        nisa.tensor_tensor(mx, mx, sink_t, nl.maximum)
        negm = nl.ndarray((num_h, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(negm, mx, nl.multiply, -1.0)
        p = nl.ndarray((num_h, num_n), dtype=nl.float32, buffer=nl.sbuf)
        lsum = nl.ndarray((num_h, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(p, nl.exp, lg, bias=negm, reduce_op=nl.add, reduce_res=lsum,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        es = nl.ndarray((num_h, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(es, nl.exp, sink_t, bias=negm)
        nisa.tensor_tensor(lsum, lsum, es, nl.add)
        rden = nl.ndarray((num_h, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(rden, lsum)
        # o = P @ kv: keys onto partitions
        p_lo = nl.ndarray((num_h, num_n), dtype=q.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(p_lo, p)
        pT = nl.ndarray((128, nnc, num_h), dtype=q.dtype, buffer=nl.sbuf)
        for nc in range(nnc):
            n0 = nc * 128
            nb = min(128, num_n - n0)
            transpose_to(pT[0:nb, nc, 0:num_h], p_lo[0:num_h, n0:n0 + nb])
        po = nl.ndarray((num_h, num_d), dtype=nl.float32, buffer=nl.psum)
        for nc in range(nnc):
            nb = min(128, num_n - nc * 128)
            nisa.nc_matmul(po, pT[0:nb, nc, 0:num_h], kv_n[0:nb, nc, 0:num_d])
        o = nl.ndarray((num_h, num_d), dtype=q.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(o, po, nl.multiply, rden)
        nisa.dma_copy(out_rows[t * num_h:(t + 1) * num_h, 0:num_d], o)
    return out


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor, scale: float, *,
                executor: str | None = None) -> torch.Tensor:
    """q [B, T, H, D], kv [B, N, D], valid [B, T, N] bool, sink [H] -> [B, T, H, D] in q.dtype."""
    from nki_kernels import reference

    b, t, h, d = q.shape
    n = kv.shape[1]
    if kv.shape != (b, n, d) or valid.shape != (b, t, n) or sink.shape != (h,):
        raise ValueError(f"sparse_attn: q {tuple(q.shape)}, kv {tuple(kv.shape)}, valid {tuple(valid.shape)}, "
                         f"sink {tuple(sink.shape)} disagree")
    if h > 128 or d > 512:
        raise ValueError(f"sparse_attn: needs H <= 128 and D <= 512 (got H={h}, D={d})")
    if executor == "reference":
        return dispatch.dispatch(NAME, sparse_attn_kernel, (), executor,
                                 reference=lambda: reference.sparse_attn(q, kv, valid, sink, scale))[1]
    sink_np = _convert.to_np(sink.float().reshape(h, 1))
    outs = []
    for bi in range(b):
        bias = torch.where(valid[bi], 0.0, MASKED).float()  # layout adapter: additive mask
        args = (_convert.to_np(q[bi]), _convert.to_np(kv[bi].to(q.dtype)), _convert.to_np(bias), sink_np,
                float(scale))
        _, out = dispatch.dispatch(NAME, sparse_attn_kernel, args, executor)
        outs.append(_convert.from_np(out))
    return torch.stack(outs)


CASES: list[Case] = []
for _dt in ("float32", "bfloat16"):
    CASES += [
        case(NAME, "tiny-model B=1 T=4 H=4 D=64 N=24", _dt, b=1, t=4, h=4, d=64, n=24),
        case(NAME, "tile edge B=2 T=3 H=8 D=200 N=300", _dt, b=2, t=3, h=8, d=200, n=300),
        case(NAME, "no valid keys B=1 T=2 H=4 D=64 N=16", _dt, b=1, t=2, h=4, d=64, n=16, none_valid=True),
        case(NAME, "V4 decode B=2 T=1 H=64 D=512 N=640", _dt, b=2, t=1, h=64, d=512, n=640),
        case(NAME, "V4 prefill chunk B=1 T=16 H=64 D=512 N=640", _dt, b=1, t=16, h=64, d=512, n=640),
        case(NAME, "V4 B=1 T=64 H=64 D=512 N=1024", _dt, slow=True, b=1, t=64, h=64, d=512, n=1024),
    ]


def run_case(c: Case, executor: str) -> CaseRun:
    from nki_kernels import reference

    p, g, dt = c.p, gen_for(c), c.torch_dtype
    b, t, h, d, n = p["b"], p["t"], p["h"], p["d"], p["n"]
    q = randn((b, t, h, d), g, dt)
    kv = randn((b, n, d), g, dt)
    valid = torch.rand(b, t, n, generator=g) < 0.7
    if p.get("none_valid"):
        valid[:, 0] = False
    sink = randn((h,), g)
    scale = d ** -0.5
    o, ms = timed(lambda: sparse_attn(q, kv, valid, sink, scale, executor=executor))
    want = reference.sparse_attn(q.float(), kv.float(), valid, sink, scale)
    return CaseRun(f"q[{b},{t},{h},{d}] kv[{b},{n},{d}]", [o], [want], dispatch.resolve_executor(executor), ms)
