"""The small per-token ops of a decode step (mhc.c, attn.c): mHC mixing, collapse and expand, `hc_pre`, RMSNorm,
sparse attention, the compressors' pooling and the indexer's scores; native for CPU fp32 / bf16 inputs within the
build's row limits, else the reference, counted by reason. They cost microseconds of arithmetic but tens of
microseconds as chains of torch ops, hence native code for such small work."""

from __future__ import annotations

import ctypes
import math

import torch

from engine.host_kernels.native import F32, _count, _f32, _native, _native_op, _why_not_rows, max_m
from nki_kernels import dispatch, reference


def hc_mixes_impl(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_mult: int,
                  iters: int, hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reference.hc_mixes` natively (mhc.c); x [T, n, D]."""
    def ref():
        return reference.hc_mixes(x, fn, scale, base, hc_mult, iters, hc_eps, norm_eps)

    why = _why_not_rows("mhc", x.shape[0] if x.dim() else 0, x, fn, scale, base)
    n = hc_mult
    if why is None and (x.dim() != 3 or x.shape[1] != n or not 0 < n <= 16
                        or tuple(fn.shape) != ((2 + n) * n, n * x.shape[2]) or scale.numel() < 3
                        or base.numel() != (2 + n) * n):
        why = "shape"
    if why is not None:
        return dispatch.fallback("host.hc_mixes", why, ref)
    _count("host.hc_mixes")
    t, _, d = x.shape
    xf, fnf, sf, bf = _f32(x), _f32(fn), _f32(scale), _f32(base)
    pre, post, comb = torch.empty(t, n, dtype=F32), torch.empty(t, n, dtype=F32), torch.empty(t, n, n, dtype=F32)
    _native().lib.dk_hc_mixes(xf.data_ptr(), fnf.data_ptr(), sf.data_ptr(), bf.data_ptr(), pre.data_ptr(),
                              post.data_ptr(), comb.data_ptr(), t, n, d, iters, hc_eps, norm_eps,
                              torch.get_num_threads())
    return pre, post, comb


def hc_pre_impl(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_w: torch.Tensor,
                hc_mult: int, iters: int, hc_eps: float,
                norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The front of an mHC site (engine/model/ops.py `hc_pre`: hc_mixes, hc_collapse with its pre, rms_norm) as one
    native call for fp32 x [T, n, D] (mhc.c `dk_hc_pre`: the three kernels in a row, as dk_ffn_site and
    dk_attn_front call them too): the same native code as the three ops one by one (so the same numbers), without
    two of their three Python wrappers (an mHC site runs twice per layer and step). Counted
    under each op's own key; any other case runs the three ops one by one (each natively or not, as it decides)."""
    n = hc_mult
    why = _why_not_rows("mhc", x.shape[0] if x.dim() else 0, x, fn, scale, base, norm_w)
    if why is None and (x.dtype is not torch.float32 or x.dim() != 3 or x.shape[1] != n or not 0 < n <= 16
                        or tuple(fn.shape) != ((2 + n) * n, n * x.shape[2]) or scale.numel() < 3
                        or base.numel() != (2 + n) * n or tuple(norm_w.shape) != (x.shape[2],)):
        why = "shape"
    if why is not None:
        pre, post, comb = hc_mixes(x, fn, scale, base, hc_mult, iters, hc_eps, norm_eps)
        return rms_norm(hc_collapse(x, pre), norm_w, norm_eps), post, comb
    for key in ("host.hc_mixes", "host.hc_collapse", "host.rms_norm"):
        _count(key)
    t, _, d = x.shape
    xf, fnf, sf, bf, wf = _f32(x), _f32(fn), _f32(scale), _f32(base), _f32(norm_w)
    pre, post, comb = torch.empty(t, n, dtype=F32), torch.empty(t, n, dtype=F32), torch.empty(t, n, n, dtype=F32)
    h, y = torch.empty(t, d, dtype=F32), torch.empty(t, d, dtype=F32)
    _native().lib.dk_hc_pre(xf.data_ptr(), fnf.data_ptr(), sf.data_ptr(), bf.data_ptr(), wf.data_ptr(), pre.data_ptr(),
                            post.data_ptr(), comb.data_ptr(), h.data_ptr(), y.data_ptr(), t, n, d, iters, hc_eps,
                            norm_eps, torch.get_num_threads())
    return y, post, comb


def rms_norm_impl(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`reference.rms_norm` natively (mhc.c)."""
    if x.dim() == 0 or weight is not None and (weight.dim() != 1 or weight.shape[0] != x.shape[-1]):
        return reference.rms_norm(x, weight, eps)  # the reference's behaviour (or error) for odd shapes
    why = _why_not_rows("mhc", x.numel() // max(1, x.shape[-1]), x, weight)
    if why is not None:
        return dispatch.fallback("host.rms_norm", why, lambda: reference.rms_norm(x, weight, eps))
    _count("host.rms_norm")
    d = x.shape[-1]
    xf = _f32(x)
    w = _f32(weight) if weight is not None else None
    y = torch.empty(*x.shape, dtype=F32)
    _native().lib.dk_rms_norm(xf.data_ptr(), w.data_ptr() if w is not None else None, y.data_ptr(),
                              xf.numel() // d, d, eps, torch.get_num_threads())
    return y if x.dtype is torch.float32 else y.to(x.dtype)


def hc_collapse_impl(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """`reference.hc_collapse` natively (mhc.c); x [T, n, D], pre [T, n]."""
    why = _why_not_rows("mhc", x.shape[0] if x.dim() else 0, x, pre)
    if why is None and (x.dim() != 3 or tuple(pre.shape) != tuple(x.shape[:2])):
        why = "shape"
    if why is not None:
        return dispatch.fallback("host.hc_collapse", why, lambda: reference.hc_collapse(x, pre))
    _count("host.hc_collapse")
    t, n, d = x.shape
    xf, pf = _f32(x), _f32(pre)
    y = torch.empty(t, d, dtype=F32)
    _native().lib.dk_hc_collapse(xf.data_ptr(), pf.data_ptr(), y.data_ptr(), t, n, d, torch.get_num_threads())
    return y if x.dtype is torch.float32 else y.to(x.dtype)


def hc_expand_impl(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """`reference.hc_expand` natively (mhc.c); y [T, D], residual [T, n, D], post [T, n], comb [T, n, n]."""
    why = _why_not_rows("mhc", residual.shape[0] if residual.dim() else 0, residual, y, post, comb)
    if why is None and y.dtype is not torch.float32 and y.dtype is not torch.bfloat16:
        why = "dtype"
    if why is None:
        t, n, d = residual.shape if residual.dim() == 3 else (0, 0, 0)
        if residual.dim() != 3 or tuple(y.shape) != (t, d) or tuple(post.shape) != (t, n) or \
                tuple(comb.shape) != (t, n, n):
            why = "shape"
    if why is not None:
        return dispatch.fallback("host.hc_expand", why, lambda: reference.hc_expand(y, residual, post, comb))
    _count("host.hc_expand")
    yf, xf, pf, cf = _f32(y), _f32(residual), _f32(post), _f32(comb)
    out = torch.empty(t, n, d, dtype=F32)
    _native().lib.dk_hc_expand(yf.data_ptr(), xf.data_ptr(), pf.data_ptr(), cf.data_ptr(), out.data_ptr(), t, n, d,
                               torch.get_num_threads())
    return out if y.dtype is torch.float32 else out.to(y.dtype)


def sparse_attn_impl(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """`reference.sparse_attn` natively (mhc.c); q [B, T, H, D], kv [B, N, D], valid [B, T, N], sink [H]."""
    def ref():
        return reference.sparse_attn(q, kv, valid, sink, scale)

    why = _why_not_rows("sparse_attn", q.shape[0] * q.shape[1] if q.dim() == 4 else 0, q, kv, valid, sink)
    if why is None and kv.dtype is not torch.float32 and kv.dtype is not torch.bfloat16:
        why = "dtype"
    if why is None:
        b, t, h, d = q.shape if q.dim() == 4 else (0, 0, 0, 0)
        n = kv.shape[1] if kv.dim() == 3 else -1
        if q.dim() != 4 or tuple(kv.shape) != (b, n, d) or tuple(valid.shape) != (b, t, n) or \
                valid.dtype is not torch.bool or tuple(sink.shape) != (h,):
            why = "shape"
    if why is not None:
        return dispatch.fallback("host.sparse_attn", why, ref)
    _count("host.sparse_attn")
    qf, kf, sf = _f32(q), _f32(kv), _f32(sink)
    vb = valid.contiguous()
    nt = torch.get_num_threads()
    o = torch.empty(b, t, h, d, dtype=F32)
    lib = _native()
    scratch = torch.empty(max(1, 2 * lib.attn_heads * nt * n), dtype=F32)
    if lib.lib.dk_sparse_attn(qf.data_ptr(), kf.data_ptr(), vb.data_ptr(), sf.data_ptr(), o.data_ptr(),
                              scratch.data_ptr(), scratch.numel(), b, t, h, n, d, scale, nt) != 0:
        raise RuntimeError(f"host kernel sparse_attn: scratch of {scratch.numel()} floats is too small")
    return o if q.dtype is torch.float32 else o.to(q.dtype)


def compress_pool_impl(kv: torch.Tensor, score: torch.Tensor, overlap: bool, prev_kv: torch.Tensor | None = None,
                       prev_score: torch.Tensor | None = None) -> torch.Tensor:
    """`reference.compress_pool` natively (attn.c dk_compress_pool: per channel, the slots' max, libm expf, the
    softmax's weights, the weighted sum; the decode step's closing blocks in `dk_attn_decode` pool with the same
    routine): kv, score [..., W, m, C], prev_kv / prev_score [..., m, C] or None -> [..., W, d] fp32."""
    def ref():
        return reference.compress_pool(kv, score, overlap, prev_kv, prev_score)

    why = None
    lead = tuple(kv.shape[:-3])
    if kv.dim() < 3 or score.shape != kv.shape or (prev_kv is None) != (prev_score is None) \
            or overlap and kv.shape[-1] % 2 or kv.shape[-2] * (2 if overlap else 1) > _native().pool_slots \
            or prev_kv is not None and overlap and (
                tuple(prev_kv.shape) != (*lead, *kv.shape[-2:]) or prev_score.shape != prev_kv.shape):
        why = "shape"
    elif any(t is not None and (not t.is_cpu or t.dtype not in (torch.float32, torch.bfloat16))
             for t in (kv, score, prev_kv, prev_score)):
        why = "dtype"
    elif torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (kv, score, prev_kv, prev_score)):
        why = "autograd"
    elif kv.numel() == 0:
        why = "empty"
    elif math.prod(kv.shape[:-2]) > (limit := max_m("pool")):
        why = f"M > {limit}"
    if why is not None:
        return dispatch.fallback("host.compress_pool", why, ref)
    _count("host.compress_pool")
    w, m, c = kv.shape[-3:]
    n = math.prod(lead)
    d = c // 2 if overlap else c
    kf, sf = _f32(kv), _f32(score)
    pk, ps = (_f32(prev_kv), _f32(prev_score)) if overlap and prev_kv is not None else (None, None)
    out = torch.empty(*lead, w, d, dtype=F32)
    if _native().lib.dk_compress_pool(kf.data_ptr(), sf.data_ptr(), pk.data_ptr() if pk is not None else None,
                                      ps.data_ptr() if ps is not None else None, n, w, m, c, int(overlap),
                                      out.data_ptr()) != 0:
        raise MemoryError("host kernel compress_pool: out of memory")
    return out


def index_score_impl(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`reference.index_score` natively for decode rows (attn.c dk_index_score: per entry, every head's dot in one
    pass over the key, the weighted ReLU sum in head order; the routine dk_attn_decode selects with): q [B, 1, Hi,
    Di], keys [B, N, Di], weights [B, 1, Hi] -> [B, 1, N] fp32. Prefill chunks (T > 1) run the reference (one batched
    matmul there)."""
    def ref():
        return reference.index_score(q, keys, weights)

    why = None
    if q.dim() != 4 or keys.dim() != 3 or weights.dim() != 3:
        why = "shape"
    else:
        b, t, hi, di = q.shape
        if t != 1:
            why = "T > 1"
        elif keys.shape[0] != b or keys.shape[2] != di or tuple(weights.shape) != (b, t, hi):
            why = "shape"
        elif any(not x.is_cpu or x.dtype not in (torch.float32, torch.bfloat16) for x in (q, keys, weights)):
            why = "dtype"
        elif torch.is_grad_enabled() and any(x.requires_grad for x in (q, keys, weights)):
            why = "autograd"
        elif keys.shape[1] == 0 or q.numel() == 0:
            why = "empty"
        elif b > (limit := max_m("index")):
            why = f"M > {limit}"
    if why is not None:
        return dispatch.fallback("host.index_score", why, ref)
    _count("host.index_score")
    return index_score_native(q, keys, weights)


def index_score_native(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """dk_index_score itself, whatever the row limit (`index_score_impl` checked the rest): the scores
    `attn_decode` picks by."""
    b, t, hi, di = q.shape
    n = keys.shape[1]
    qT = q.float().transpose(-1, -2).contiguous()  # [B, T, Di, Hi]
    kf, wf = _f32(keys), _f32(weights)
    out = torch.empty(b, t, n, dtype=F32)
    if _native().lib.dk_index_score(qT.data_ptr(), kf.data_ptr(), wf.data_ptr(), b, t, n, hi, di,
                                    out.data_ptr()) != 0:
        raise MemoryError("host kernel index_score: out of memory")
    return out


def keep_rows(sources: list[torch.Tensor], src_rows: list[int], dst_rows: list[int], ids: list[int], mean: bool,
              dst: torch.Tensor, dst_ids: torch.Tensor) -> bool:
    """engine/runner.py `ModelRunner._keep`'s rows written at once (mhc.c dk_keep_rows), where its torch path keeps
    them pending and `_flush` writes them every few steps: rows `src_rows` of every source ([T, n, D] each) into the
    rows `dst_rows` of dst (flat row numbers), ids into dst_ids. `mean`: dst rows [L*D], each source's n streams
    averaged (DSpark's `Capture.tensor`); else [L*n*D], copied (MTP's final streams). The same bits as the torch
    path. False, nothing written, where the call does not fit (not CPU fp32, not contiguous, shapes)."""
    t, n, d = sources[0].shape if sources[0].dim() == 3 else (0, 0, 0)
    width, rows = len(sources) * d * (1 if mean else n), len(src_rows)
    if not t or dst.dtype is not F32 or dst_ids.dtype is not torch.int64 or not dst.is_cpu \
            or not (dst.is_contiguous() and dst_ids.is_contiguous()) or dst.numel() != dst_ids.numel() * width \
            or any(s.dtype is not F32 or not s.is_cpu or not s.is_contiguous() or s.shape != (t, n, d)
                   for s in sources) or not rows == len(dst_rows) == len(ids):
        return False
    if mean and n > 4 and d % 64:  # torch's sum over the streams adds them in order only then (tests pin both)
        return False
    if not rows:
        return True
    if not (0 <= min(src_rows) and max(src_rows) < t and 0 <= min(dst_rows) and max(dst_rows) < dst_ids.numel()):
        raise IndexError(f"keep_rows: a source row outside [0, {t}) or a held row outside [0, {dst_ids.numel()})")
    at = (ctypes.c_int64 * (3 * rows))(*src_rows, *dst_rows, *ids)
    step = ctypes.sizeof(ctypes.c_int64) * rows
    _native().lib.dk_keep_rows((ctypes.c_void_p * len(sources))(*(s.data_ptr() for s in sources)), len(sources), n,
                               d, at, ctypes.addressof(at) + step, ctypes.addressof(at) + 2 * step, rows, int(mean),
                               dst.data_ptr(), dst_ids.data_ptr())
    return True



def _mixes_fake(x, fn, scale, base, hc_mult, *_):
    t, n = x.shape[0], hc_mult
    return x.new_empty(t, n, dtype=torch.float32), x.new_empty(t, n, dtype=torch.float32), \
        x.new_empty(t, n, n, dtype=torch.float32)


hc_mixes = _native_op("hc_mixes", hc_mixes_impl, _mixes_fake)
rms_norm = _native_op("rms_norm", rms_norm_impl, lambda x, weight, eps: torch.empty_like(x))
hc_collapse = _native_op("hc_collapse", hc_collapse_impl, lambda x, pre: x.new_empty(x.shape[0], x.shape[2]))
hc_expand = _native_op("hc_expand", hc_expand_impl, lambda y, residual, post, comb: y.new_empty(residual.shape))
sparse_attn = _native_op("sparse_attn", sparse_attn_impl, lambda q, kv, valid, sink, scale: torch.empty_like(q))
hc_pre = _native_op("hc_pre", hc_pre_impl, lambda x, fn, scale, base, norm_w, hc_mult, *_: (
    x.new_empty(x.shape[0], x.shape[2]), *_mixes_fake(x, fn, scale, base, hc_mult)[1:]))
compress_pool = _native_op("compress_pool", compress_pool_impl, lambda kv, score, overlap, *_: kv.new_empty(
    (*kv.shape[:-2], kv.shape[-1] // 2 if overlap else kv.shape[-1]), dtype=torch.float32))
index_score = _native_op("index_score", index_score_impl,
                         lambda q, keys, weights: q.new_empty(*q.shape[:2], keys.shape[1], dtype=torch.float32))
