"""Lightning-indexer scores and their causal top-k.

    I(t, w) = sum_h weights[t, h] * relu(q[t, h] . keys[w]);   keep the top k' = min(k, N) entries among the
    visible ones (w < num_visible[t]); picks beyond the visible entries are returned but marked invalid.

IO layout
    q      [T, Hi*Di]  HBM bf16/fp32 (queries on partitions; each head's [tp, Di] block PE-transposed to
                       [Di, tp] for the stationary operand; Di <= 128)
    kT     [Di, N]     HBM, dtype of q: the indexer keys, channel-major (wrapper layout adapter), SBUF-resident
    w      [T, Hi]     HBM fp32 head weights (already scaled by Di^-0.5 * Hi^-0.5); column h is a [P,1] operand
    nvis   [T, 1]      HBM fp32 number of visible entries per query (causality)
    outs   scores [T, N] fp32 (unmasked), idx [T, k'] uint32 (top-k order: higher score first, ties by lower index)
Precision
    q.k products on the PE array with fp32 PSUM; relu * weight and the head sum in fp32 on the Vector Engine.
    The official code scores in bf16, the reference (and this kernel) in fp32.
Top-k
    `k'/8` rounds of `max8` + `nc_match_replace8` (which also returns the indices) on a masked copy of the
    scores: invisible entries are pushed to -1e30, picked entries to -3e38. trn2 has no `nisa.topk` before
    NKI 0.6, and this form needs nothing newer.
Constraints
    Di <= 128; any T, N >= 8 (partial tiles); N * 4 B * 3 tiles must fit in an SBUF partition (N <= 8192).
Tunables
    `N_CHUNK` = 512 (one PSUM bank).
"""

from __future__ import annotations

import torch

from nki_kernels import _convert, dispatch
from nki_kernels._nki import nisa, nki, nl
from nki_kernels._tiles import load_xT
from nki_kernels.cases import Case, CaseRun, case, gen_for, randn, timed

NAME = "index_score"
MASKED = -1.0e30
PICKED = -3.0e38


@nki.jit
def index_score_kernel(q, kT, w, nvis, num_heads, topk):
    num_t = q.shape[0]
    num_di = kT.shape[0]
    num_n = kT.shape[1]
    rounds = (topk + 7) // 8
    scores = nl.ndarray((num_t, num_n), dtype=nl.float32, buffer=nl.shared_hbm)
    idx = nl.ndarray((num_t, topk), dtype=nl.uint32, buffer=nl.shared_hbm)
    k_sb = nl.ndarray((num_di, num_n), dtype=kT.dtype, buffer=nl.sbuf)
    nisa.dma_copy(k_sb, kT)
    pos = nl.ndarray((128, num_n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(pos, [[1, num_n]], offset=0, channel_multiplier=0)
    for t0 in range(0, num_t, 128):
        tp = min(128, num_t - t0)
        w_t = nl.ndarray((tp, num_heads), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(w_t, w[t0:t0 + tp, 0:num_heads])
        acc = nl.ndarray((tp, num_n), dtype=nl.float32, buffer=nl.sbuf)
        for h in range(num_heads):
            qT = nl.ndarray((128, 1, tp), dtype=q.dtype, buffer=nl.sbuf)
            load_xT(qT, q, t0, tp, h * num_di, num_di, 0, q.dtype)
            for n0 in range(0, num_n, 512):
                nw = min(512, num_n - n0)
                ps = nl.ndarray((tp, nw), dtype=nl.float32, buffer=nl.psum)
                nisa.nc_matmul(ps, qT[0:num_di, 0, 0:tp], k_sb[0:num_di, n0:n0 + nw])
                if h == 0:
                    nisa.tensor_scalar(acc[0:tp, n0:n0 + nw], ps, nl.maximum, 0.0, op1=nl.multiply,
                                       operand1=w_t[0:tp, 0:1])
                else:
                    tmp = nl.ndarray((tp, nw), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.tensor_scalar(tmp, ps, nl.maximum, 0.0, op1=nl.multiply, operand1=w_t[0:tp, h:h + 1])
                    nisa.tensor_tensor(acc[0:tp, n0:n0 + nw], acc[0:tp, n0:n0 + nw], tmp, nl.add)
        nisa.dma_copy(scores[t0:t0 + tp, 0:num_n], acc)
        # causal mask: pen = (pos < nvis ? 0 : -1e30)
        nv = nl.ndarray((tp, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(nv, nvis[t0:t0 + tp, 0:1])
        pen = nl.ndarray((tp, num_n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(pen, pos[0:tp, 0:num_n], nl.greater_equal, nv, op1=nl.multiply, operand1=-1.0e30)
        work = nl.ndarray((tp, num_n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(work, acc, pen, nl.add)
        vals = nl.ndarray((tp, 8), dtype=nl.float32, buffer=nl.sbuf)
        picks = nl.ndarray((tp, rounds * 8), dtype=nl.uint32, buffer=nl.sbuf)
        for r in range(rounds):
            nisa.max8(vals, work)
            nisa.nc_match_replace8(work, work, vals, -3.0e38, dst_idx=picks[0:tp, r * 8:r * 8 + 8])
        nisa.dma_copy(idx[t0:t0 + tp, 0:topk], picks[0:tp, 0:topk])
    return scores, idx


def index_score_topk(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, num_visible: torch.Tensor,
                     k: int, *, executor: str | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, T, Hi, Di], keys [B, N, Di], weights [B, T, Hi], num_visible [B, T] ->
    (scores [B, T, N] fp32, idx [B, T, k'] int64, valid [B, T, k'] bool), as `reference.index_score` followed by
    `reference.index_topk` (indices may differ from the reference only where scores tie within rounding)."""
    from nki_kernels import reference

    b, t, hi, di = q.shape
    n = keys.shape[1]
    if keys.shape != (b, n, di) or weights.shape != (b, t, hi) or num_visible.shape != (b, t):
        raise ValueError(f"index_score: q {tuple(q.shape)}, keys {tuple(keys.shape)}, weights "
                         f"{tuple(weights.shape)}, num_visible {tuple(num_visible.shape)} disagree")
    if di > 128 or n < 8 or n > 8192:
        raise ValueError(f"index_score: needs Di <= 128 and 8 <= N <= 8192 (got Di={di}, N={n})")
    kk = min(k, n)

    def ref():
        s = reference.index_score(q, keys, weights)
        return (s, *reference.index_topk(s, num_visible, k))

    if executor == "reference":
        return dispatch.dispatch(NAME, index_score_kernel, (), executor, reference=ref)[1]
    all_s, all_i = [], []
    for bi in range(b):
        args = (_convert.to_np(q[bi].reshape(t, hi * di)), _convert.to_np(keys[bi].to(q.dtype).t().contiguous()),
                _convert.to_np(weights[bi].float()), _convert.to_np(num_visible[bi].float().reshape(t, 1)),
                int(hi), int(kk))
        _, (s, i) = dispatch.dispatch(NAME, index_score_kernel, args, executor)
        all_s.append(_convert.from_np(s))
        all_i.append(torch.from_numpy(i.astype("int64")))
    idx = torch.stack(all_i)
    valid = idx < num_visible.unsqueeze(-1)
    return torch.stack(all_s), idx, valid


CASES: list[Case] = []
for _dt in ("float32", "bfloat16"):
    CASES += [
        case(NAME, "tiny-model T=8 Hi=16 Di=32 N=24 k=4", _dt, b=1, t=8, hi=16, di=32, n=24, k=4),
        case(NAME, "tile edge T=130 Hi=4 Di=64 N=300 k=20", _dt, b=1, t=130, hi=4, di=64, n=300, k=20),
        case(NAME, "k > N B=2 T=6 Hi=16 Di=32 N=10 k=16", _dt, b=2, t=6, hi=16, di=32, n=10, k=16),
        case(NAME, "V4 decode T=8 Hi=64 Di=128 N=1024 k=512", _dt, b=1, t=8, hi=64, di=128, n=1024, k=512),
        case(NAME, "V4 prefill T=128 Hi=64 Di=128 N=2048 k=512", _dt, slow=True, b=1, t=128, hi=64, di=128,
             n=2048, k=512),
    ]


def run_case(c: Case, executor: str) -> CaseRun:
    from nki_kernels import reference

    p, g, dt = c.p, gen_for(c), c.torch_dtype
    b, t, hi, di, n, k = p["b"], p["t"], p["hi"], p["di"], p["n"], p["k"]
    q = randn((b, t, hi, di), g, dt)
    keys = randn((b, n, di), g, dt)
    weights = randn((b, t, hi), g, scale=(di * hi) ** -0.5)
    # causal: a query at absolute position s sees floor((s+1)/4) entries; place the queries at the end
    start = 4 * n - t
    nvis = ((torch.arange(t) + start + 1) // 4).clamp(max=n).expand(b, t).contiguous()
    (s, idx, valid), ms = timed(lambda: index_score_topk(q, keys, weights, nvis, k, executor=executor))
    want_s = reference.index_score(q, keys, weights)
    want_idx, want_valid = reference.index_topk(want_s, nvis, k)
    # picks are compared by the reference score they select (ties within rounding may pick other indices)
    got_v = want_s.gather(-1, idx.clamp(max=n - 1)).masked_fill(~valid, 0.0)
    want_v = want_s.gather(-1, want_idx).masked_fill(~want_valid, 0.0)
    structural = bool((valid == want_valid).all()) and all(
        len(set(row.tolist())) == row.numel() for row in idx.reshape(-1, idx.shape[-1]))
    return CaseRun(f"q[{b},{t},{hi},{di}] keys[{b},{n},{di}] k={k}", [s, got_v], [want_s, want_v],
                   dispatch.resolve_executor(executor), ms, extra_ok=structural,
                   note="" if structural else "top-k validity/distinctness differs from the reference")
