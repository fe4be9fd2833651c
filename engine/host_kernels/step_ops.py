"""Native host ops of the MoE router and of the head's stream collapse (engine/host_kernels `NATIVE_OPS`; the
library is the one `engine.host_kernels` loads):

    op (reference.<op>)   native when                                                    dispatch key
    ffn_site              every one of hc_pre, gate, moe_ffn and hc_expand would run     "host.ffn_site" (+ each
                          natively: x fp32 [T, n, D], T <= max_m("mhc"), the router      of the four's keys)
                          weight bf16, expert weights as moe_ffn takes them
    gate                  x fp32 [T, D], T <= max_m("mhc"); router weight bf16 (held     "host.gate"
                          as stored) or fp32 [E, D], E <= 1024; bias fp32 [E] / hash
                          ids int64 [T, K]
    hc_head               x fp32 [T, n, D], T <= max_m("mhc"), fn [n, n*D], scale [1],   "host.hc_head"
                          base [n] fp32

    mtp_input             every op of Transformer.mtp_input would run natively: x fp32   "host.mtp_input" (+ its
                          [T, n, D], T*n <= max_m("mhc") and the projections' limit      ops' keys)
    lm_head               every op of Transformer.logits would run natively: x fp32      "host.lm_head" (+ its
                          [T, n, D], T <= max_m("mhc") and the head's limit, head bf16   ops' keys)
                          or stored FP8 / FP4

`mtp_input` / `lm_head` (attn.c `dk_mtp_input` / `dk_lm_head`: the MTP block's input, the head's hc_head + final
norm + GEMM) are the op-by-op host path's kernels in its order, one call each, bit for bit; a draft head runs them
for every drafted token, where the ~12 op calls around them cost more than the kernels at small widths.

`ffn_site` is moe.c `dk_ffn_site`, the MoE half of a decode block (hc_pre + gate + moe_ffn + hc_expand) in one
call with the same kernels in the same order (bit for bit); it declines (None, nothing counted) wherever one of them
would not run natively. block_decoder.py `HostBlockDecoder.ffn_half` calls it.

`hc_head` (once a step, before the final norm and the head: ~10 torch ops) is mhc.c `dk_hc_head`, hc_mixes' `pre`
formula over the head's n-row fn followed by dk_hc_collapse: results differ by fp32 summation order and libm's expf.

`reference.gate` is ~11 torch ops per layer and step (the router GEMV on a widened copy of the bf16 weight,
softplus, sqrt, the bias, top-k, gather and the normalisation), ~60 us at decode sizes. Here the GEMV is the bf16
(or, for an fp32 weight, torch's) GEMV and the rest one pass in mhc.c `dk_route`: softplus as torch computes it
(threshold 20), sqrt, top-k descending with ties to the lower expert id, weights normalised in the reference's
order. Results differ from the reference by the GEMV's fp32 summation order and libm's expf / log1pf (an ulp or
two): an expert choice changes only where two scores tie within that. Every other case runs the reference, counted
by reason (`dispatch.fallbacks()`).
"""

from __future__ import annotations

import ctypes
import types

import torch
import torch.nn.functional as F

from engine.host_kernels import moe_ops, native, packs
from engine.host_kernels.abi import DkHead, DkMtpIn
from engine.host_kernels.packs import Pack
from nki_kernels import dispatch, reference


def gate_impl(x: torch.Tensor, gate_weight: torch.Tensor, topk: int, route_scale: float,
              bias: torch.Tensor | None = None,
              hash_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.gate` natively (the GEMV, then mhc.c `dk_route`)."""
    def ref():
        return reference.gate(x, gate_weight, topk, route_scale, bias=bias, hash_ids=hash_ids)

    t = x.shape[0] if x.dim() == 2 else 0
    why = native._why_not_rows("mhc", t, x, gate_weight, bias, hash_ids)
    if why is None and (x.dtype is not torch.float32 or gate_weight.dtype not in (torch.bfloat16, torch.float32)
                        or bias is not None and bias.dtype is not torch.float32
                        or hash_ids is not None and hash_ids.dtype is not torch.int64):
        why = "dtype"
    if why is None:
        e = gate_weight.shape[0] if gate_weight.dim() == 2 else 0
        if x.dim() != 2 or gate_weight.dim() != 2 or gate_weight.shape[1] != x.shape[1] or not 0 < topk <= e <= 1024 \
                or bias is not None and tuple(bias.shape) != (e,) \
                or hash_ids is not None and tuple(hash_ids.shape) != (t, topk):
            why = "shape"
    if why is not None:
        return dispatch.fallback("host.gate", why, ref)
    native._count("host.gate")
    xf = x.contiguous()
    if gate_weight.dtype is torch.bfloat16:
        logits = torch.empty(t, e, dtype=native.F32)
        w = gate_weight.contiguous()
        native._native().lib.dk_bf16_linear(xf.data_ptr(), w.data_ptr(), logits.data_ptr(), t, e, x.shape[1],
                                        torch.get_num_threads())
    else:
        logits = F.linear(xf, gate_weight).contiguous()
    weights, indices = torch.empty(t, topk, dtype=native.F32), torch.empty(t, topk, dtype=torch.int64)
    b = bias.contiguous() if bias is not None else None
    h = hash_ids.contiguous() if hash_ids is not None else None
    rc = native._native().lib.dk_route(logits.data_ptr(), b.data_ptr() if b is not None else None,
                                   h.data_ptr() if h is not None else None, weights.data_ptr(), indices.data_ptr(), t,
                                   e, topk, route_scale)
    if rc == -3:
        raise ValueError(f"gate: a hash-layer expert id is outside [0, {e})")
    return weights, indices


_SITE_KEYS = ("host.ffn_site", "host.hc_mixes", "host.hc_collapse", "host.rms_norm", "host.gate", "host.moe_ffn",
              "host.hc_expand")
_SITE_COUNTS = tuple((k, native.EXECUTOR) for k in _SITE_KEYS)


def site_pack(site: tuple, gate_weight: torch.Tensor, topk: int, route_scale: float, bias: torch.Tensor | None,
              hashed: bool, limit: float, e_lo: int, routed: tuple[str | None, tuple[torch.Tensor | None, ...]],
              shared: tuple[str | None, tuple[torch.Tensor | None, ...]] | None) -> Pack:
    """`ffn_site`'s pack for one layer: `site` the mHC site's hc_pre arguments after x (fn, scale, base, norm
    weight, hc_mult, iterations, hc_eps, norm_eps), then the router's (`hashed`: a hash layer, ids given per call)
    and moe_ffn's; args None where one of the four ops would not run natively on these tensors."""
    fn, scale, base, norm_w, n, iters, hc_eps, norm_eps = site
    parts = [routed] + ([shared] if shared is not None else [])
    keep = (fn, scale, base, norm_w, gate_weight, bias, *(u for _, ts in parts for u in ts))
    d = norm_w.shape[0]
    e = gate_weight.shape[0] if gate_weight.dim() == 2 else 0
    if not packs.fp32_cpu(fn, scale, base, norm_w, *((bias,) if bias is not None else ())) or not 0 < n <= 16 \
            or tuple(fn.shape) != ((2 + n) * n, n * d) or scale.numel() < 3 \
            or base.numel() != (2 + n) * n or gate_weight.dtype is not torch.bfloat16 or not gate_weight.is_cpu \
            or tuple(gate_weight.shape) != (e, d) or not gate_weight.is_contiguous() or not 0 < topk <= e <= 1024 \
            or bias is not None and tuple(bias.shape) != (e,) or moe_ops._moe_weights_why_not(0, parts) is not None \
            or any(u is not None and not u.is_cpu for _, ts in parts for u in ts):
        return Pack(None, keep)
    fmt_r, rw = routed
    ptrs = [(ctypes.c_void_p * 6)(*[u.data_ptr() if u is not None else None for u in ts]) for _, ts in parts]
    return Pack(types.SimpleNamespace(
        n=n, d=d, topk=topk, hashed=hashed, e=e,
        limit_keys=("mhc", *(packs._FMT_KEY[f] for f, _ in parts)),
        head=(fn.data_ptr(), scale.data_ptr(), base.data_ptr(), iters, hc_eps, norm_eps, norm_w.data_ptr(),
              gate_weight.data_ptr(), e, bias.data_ptr() if bias is not None else None),
        tail=(topk, route_scale, rw[0].shape[1], limit, e_lo, rw[0].shape[0], packs._FMT_CODE[fmt_r], ptrs[0],
              packs._FMT_CODE[shared[0]] if shared is not None else 0, ptrs[1] if shared is not None else None)), keep)


def hash_ids_fit(a: object, hash_ids: torch.Tensor | None, t: int) -> bool:
    """Whether `hash_ids` is what a pack with the router arguments `a` (hashed, topk) takes for t token rows: int64
    CPU [t, topk] for a hash layer, None for a scored one."""
    if hash_ids is None:
        return not a.hashed
    return a.hashed and hash_ids.dtype is torch.int64 and tuple(hash_ids.shape) == (t, a.topk) and hash_ids.is_cpu


def ffn_site(pack: Pack, x: torch.Tensor, hash_ids: torch.Tensor | None = None) -> torch.Tensor | None:
    """The MoE half of a decode block (`Block.hc_site("ffn")`: ops hc_pre, gate, moe_ffn, hc_expand) as one native
    call (moe.c `dk_ffn_site`) with `site_pack`'s static arguments -> the new residual streams [T, n, D] fp32; None
    where any of the four would not run natively (nothing counted: the caller runs them one by one). x [T, n, D];
    hash_ids [T, K] int64 for a hash layer. Eager only (the caller checks it is not being compiled)."""
    a = pack.args
    if a is None:
        return None
    t = x.shape[0] if x.dim() == 3 else 0
    if not packs.rows_ok(x, (t, a.n, a.d), native.max_rows(a.limit_keys)):
        return None
    if not hash_ids_fit(a, hash_ids, t):
        return None
    native._count_each(_SITE_COUNTS)
    h = hash_ids.contiguous() if hash_ids is not None else None
    out = torch.empty(t, a.n, a.d, dtype=native.F32)
    rc = native._native().lib.dk_ffn_site(x.data_ptr(), t, a.n, a.d, *a.head, h.data_ptr() if h is not None else None,
                                      *a.tail, out.data_ptr(), torch.get_num_threads())
    if rc == -3:
        raise ValueError(f"gate: a hash-layer expert id is outside [0, {a.e})")
    if rc != 0:
        raise MemoryError(f"host kernel ffn_site: out of memory for x [{t}, {a.n}, {a.d}]")
    return out


def _fake(x: torch.Tensor, gate_weight: torch.Tensor, topk: int, *_: object) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape[0], topk, dtype=torch.float32), x.new_empty(x.shape[0], topk, dtype=torch.int64)


gate = native._native_op("gate", gate_impl, _fake)


def hc_head_impl(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_eps: float,
                 norm_eps: float) -> torch.Tensor:
    """`reference.hc_head` natively (mhc.c `dk_hc_head`)."""
    def ref():
        return reference.hc_head(x, fn, scale, base, hc_eps, norm_eps)

    why = native._why_not_rows("mhc", x.shape[0] if x.dim() else 0, x, fn, scale, base)
    if why is None and (x.dtype is not torch.float32 or fn.dtype is not torch.float32
                        or scale.dtype is not torch.float32 or base.dtype is not torch.float32):
        why = "dtype"
    n = x.shape[1] if x.dim() == 3 else 0
    if why is None and (x.dim() != 3 or not 0 < n <= 16 or tuple(fn.shape) != (n, n * x.shape[2])
                        or scale.numel() != 1 or tuple(base.shape) != (n,)):
        why = "shape"
    if why is not None:
        return dispatch.fallback("host.hc_head", why, ref)
    native._count("host.hc_head")
    t, n, d = x.shape
    xf, ff, sf, bf = x.contiguous(), fn.contiguous(), scale.contiguous(), base.contiguous()
    y = torch.empty(t, d, dtype=native.F32)
    if native._native().lib.dk_hc_head(xf.data_ptr(), ff.data_ptr(), sf.data_ptr(), bf.data_ptr(), y.data_ptr(), t, n,
                                       d, hc_eps, norm_eps, torch.get_num_threads()) == -1:
        raise MemoryError(f"host kernel hc_head: out of memory for x [{t}, {n}, {d}]")
    return y


hc_head = native._native_op("hc_head", hc_head_impl,
                        lambda x, fn, scale, base, hc_eps, norm_eps: x.new_empty(x.shape[0], x.shape[2]))


def _gemm_args(lin: torch.nn.Module) -> tuple[int, torch.Tensor, torch.Tensor | None] | None:
    """(format code, weight, scale) of a Linear whose GEMM the host table runs natively on x fp32 (a bf16 or stored
    FP8 / FP4 weight, contiguous, on the CPU), else None (an fp32 weight runs torch's GEMM)."""
    w, s = lin.weight, getattr(lin, "scale", None) if lin.fmt is not None else None
    if lin.fmt is None and w.dtype is not torch.bfloat16 or lin.fmt is not None and w.dtype is not torch.uint8:
        return None
    if not w.is_cpu or not w.is_contiguous() or s is not None and (not s.is_cpu or not s.is_contiguous()):
        return None
    return packs._FMT_CODE[lin.fmt], w, s


def mtp_input_pack(embed: torch.Tensor, enorm_w: torch.Tensor, hnorm_w: torch.Tensor, e_proj: torch.nn.Module,
                   h_proj: torch.nn.Module, eps: float) -> Pack:
    """`mtp_input`'s static arguments (Pack(None) where the weights are not what dk_mtp_input takes)."""
    e, h = _gemm_args(e_proj), _gemm_args(h_proj)
    keep = (embed, enorm_w, hnorm_w, *(t for g in (e, h) if g is not None for t in g[1:]))
    dim = embed.shape[-1] if embed.dim() == 2 else 0
    if e is None or h is None or embed.dim() != 2 or embed.dtype not in (torch.bfloat16, torch.float32) \
            or not embed.is_cpu or not embed.is_contiguous() or not packs.fp32_cpu(enorm_w, hnorm_w) \
            or any(tuple(t.shape) != (dim,) for t in (enorm_w, hnorm_w)) \
            or any(lin.in_features != dim or lin.out_features != dim for lin in (e_proj, h_proj)):
        return Pack(None, keep)
    keys = ("host.mtp_input", "host.rms_norm", _FMT_COUNT[e_proj.fmt], "host.rms_norm", _FMT_COUNT[h_proj.fmt])
    norms = (embed.data_ptr(), int(embed.dtype is torch.bfloat16), embed.shape[0], enorm_w.data_ptr(),
             hnorm_w.data_ptr(), eps)
    gemms = tuple(v for code, w, sc in (e, h) for v in (code, w.data_ptr(), None if sc is None else sc.data_ptr()))
    return Pack(types.SimpleNamespace(
        dim=dim, vocab=embed.shape[0], keys=tuple((k, native.EXECUTOR) for k in keys),
        limit_keys=("mhc", packs._FMT_KEY[e_proj.fmt], packs._FMT_KEY[h_proj.fmt]), norms=norms, gemms=gemms,
        struct=DkMtpIn(*norms, *gemms)), keep)


def mtp_input(pack: Pack, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
    """Transformer.mtp_input in one native call (attn.c `dk_mtp_input`): x [T, n, D] fp32 streams, ids [T] int64 the
    next tokens -> the block's input streams [T, n, D]; None where an op of it would not run natively (nothing
    counted: the caller runs them one by one)."""
    a = pack.args
    if a is None or x.dim() != 3 or ids.dtype is not torch.int64 or not ids.is_cpu or tuple(ids.shape) != x.shape[:1]:
        return None
    t, n = x.shape[0], x.shape[1]
    if n < 1 or not packs.rows_ok(x, (t, n, a.dim), native.max_rows(a.limit_keys) // n):  # T*n rows
        return None
    native._count_each(a.keys)
    out = torch.empty(t, n, a.dim, dtype=native.F32)
    idc = ids.contiguous()
    rc = native._native().lib.dk_mtp_input(x.data_ptr(), idc.data_ptr(), *a.norms, *a.gemms, out.data_ptr(), t, n,
                                           a.dim, torch.get_num_threads())
    native.check_rc(rc, "mtp_input", x, IndexError(f"mtp_input: a token id outside [0, {a.vocab})"))
    return out


def lm_head_pack(fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_w: torch.Tensor,
                 head: torch.nn.Module, hc_eps: float, norm_eps: float) -> Pack:
    """`lm_head`'s static arguments (Pack(None) where the weights are not what dk_lm_head takes)."""
    g = _gemm_args(head)
    keep = (fn, scale, base, norm_w, *(g[1:] if g is not None else ()))
    n = base.numel()
    dim = norm_w.shape[0] if norm_w.dim() == 1 else 0
    if g is None or not packs.fp32_cpu(fn, scale, base, norm_w) or not 0 < n <= 16 or scale.numel() != 1 \
            or tuple(fn.shape) != (n, n * dim) or head.in_features != dim:
        return Pack(None, keep)
    keys = ("host.lm_head", "host.hc_head", "host.rms_norm", _FMT_COUNT[head.fmt])
    front = (fn.data_ptr(), scale.data_ptr(), base.data_ptr(), hc_eps, norm_eps, norm_w.data_ptr())
    gemm = (g[0], g[1].data_ptr(), g[2].data_ptr() if g[2] is not None else None)
    return Pack(types.SimpleNamespace(
        n=n, dim=dim, vocab=head.out_features, keys=tuple((k, native.EXECUTOR) for k in keys),
        limit_keys=("mhc", packs._FMT_KEY[head.fmt]), front=front, gemm=gemm,
        struct=DkHead(*front, *gemm, head.out_features)), keep)


def lm_head(pack: Pack, x: torch.Tensor) -> torch.Tensor | None:
    """Transformer.logits in one native call (attn.c `dk_lm_head`): x [T, n, D] fp32 streams -> fp32 logits [T, V];
    None where an op of it would not run natively (nothing counted)."""
    a = pack.args
    if a is None:
        return None
    t = x.shape[0] if x.dim() == 3 else 0
    if not packs.rows_ok(x, (t, a.n, a.dim), native.max_rows(a.limit_keys)):
        return None
    native._count_each(a.keys)
    out = torch.empty(t, a.vocab, dtype=native.F32)
    rc = native._native().lib.dk_lm_head(x.data_ptr(), t, a.n, a.dim, *a.front, *a.gemm, a.vocab, out.data_ptr(),
                                         torch.get_num_threads())
    native.check_rc(rc, "lm_head", x)
    return out


_FMT_COUNT = {None: "host.linear", "fp8": "host.fp8", "fp4": "host.fp4"}  # the GEMMs' dispatch keys (gemm.py)
