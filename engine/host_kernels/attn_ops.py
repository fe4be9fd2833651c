"""Native host ops of the attention's per-token tail (engine/host_kernels `NATIVE_OPS`; the library is the one
`engine.host_kernels` loads):

    op (reference.<op>)   native when                                              dispatch key
    rope_tail             x fp32 [T, D] / [T, H, D], cos / sin fp32 [T, rd/2] (or    "host.rope_tail"
                          [T, 1, rd/2]), T <= max_m("mhc")
    grouped_out_proj      o fp32 [T, G*Kg], wo_a bf16 [G*R, Kg], T <= max_m("linear")  "host.grouped_out_proj"
    attn_qkv_native       x fp32 [T, dim], wq_a / wq_b / wkv FP8, FP4 or bf16, norms   "host.attn_qkv"
                          and cos / sin fp32, T <= max_m of "mhc" and each weight's
                          format (else None: the table's attn_qkv runs op by op)
    attn_front            the attention half's front: hc_pre, attn_qkv_native and the     "host.attn_front" (+
                          compressors' projections (when hc_pre and attn_qkv_native      hc_pre's three, attn_qkv's
                          would run natively and every projection's weight is one the    and each GEMV's keys)
                          native GEMVs take; else None)
    attn_decode           a decode-only step's attention + the block's attention tail    "host.attn_decode" (+
                          (`attn_decode_takes`: fp32 stores, B <= max_m of "mhc",        sparse_attn's, rope_tail's,
                          sparse_attn and wo_b's format, wo_a bf16)                      grouped_out_proj's, wo_b's
                                                                                         and hc_expand's keys)

`rope_tail` (mhc.c `dk_rope_tail`) is the reference bit for bit (no FMA contraction); at decode sizes it is ~15 torch
ops (~50 us) per call, five calls a layer. `grouped_out_proj` (gemv.c `dk_bf16_grouped_linear`) runs V4's wo_a
(held as bf16 under `--weights stored`: engine/loader.py) on the bf16 GEMV kernel, one call for every group, where
the reference widens the weight to fp32 and runs a batched matmul: results differ by fp32 summation order only.
`attn_qkv_native`, `attn_front` and `attn_decode` are attn.c's `dk_attn_qkv`, `dk_attn_front` and `dk_attn_decode`
(their contract is stated there: the op-by-op host path's kernels in its order, bit for bit); block_decoder.py
decides when a step takes the last two, and calls `attn_decode_takes` before it writes any state, so
`attn_decode` itself never declines.
Every other case runs the reference, counted by reason (`dispatch.fallbacks()`).
"""

from __future__ import annotations

import ctypes
import types

import torch

from engine.host_kernels import native, packs
from engine.host_kernels.packs import Pack
from nki_kernels import dispatch, reference


def rope_tail_impl(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rd: int,
                   inverse: bool = False) -> torch.Tensor:
    """`reference.rope_tail` natively (mhc.c)."""
    def ref():
        return reference.rope_tail(x, cos, sin, rd, inverse)

    t = x.shape[0] if x.dim() in (2, 3) else 0
    why = native._why_not_rows("mhc", t, x, cos, sin)
    if why is None and (x.dtype is not torch.float32 or cos.dtype is not torch.float32
                        or sin.dtype is not torch.float32):
        why = "dtype"
    if why is None:
        h2 = rd // 2
        want = (t, h2) if x.dim() == 2 else (t, 1, h2)  # one angle per token (for every head)
        if x.dim() not in (2, 3) or not 0 < rd <= x.shape[-1] or rd % 2 or tuple(cos.shape) != want \
                or tuple(sin.shape) != want:
            why = "shape"
    if why is not None:
        return dispatch.fallback("host.rope_tail", why, ref)
    native._count("host.rope_tail")
    xf, cf, sf = x.contiguous(), cos.contiguous(), sin.contiguous()
    y = torch.empty(*x.shape, dtype=native.F32)
    heads = x.shape[1] if x.dim() == 3 else 1
    native._native().lib.dk_rope_tail(xf.data_ptr(), cf.data_ptr(), sf.data_ptr(), y.data_ptr(), t, heads, x.shape[-1],
                                  rd, int(bool(inverse)))
    return y


def grouped_out_proj_impl(o: torch.Tensor, wo_a: torch.Tensor, groups: int) -> torch.Tensor:
    """`reference.grouped_out_proj` with a bf16 wo_a natively (gemv.c)."""
    def ref():
        return reference.grouped_out_proj(o, wo_a, groups)

    if o.dim() != 2 or wo_a.dim() != 2 or groups <= 0 or o.shape[1] % groups or wo_a.shape[0] % groups \
            or wo_a.shape[1] * groups != o.shape[1]:
        return ref()  # the reference's behaviour (or error) for odd shapes
    why = native._why_not("linear", o, wo_a)
    if why is None and (o.dtype is not torch.float32 or wo_a.dtype is not torch.bfloat16):
        why = "dtype"
    if why is not None:
        return dispatch.fallback("host.grouped_out_proj", why, ref)
    native._count("host.grouped_out_proj")
    t, g = o.shape[0], groups
    of, w = o.contiguous(), wo_a.contiguous()
    y = torch.empty(t, wo_a.shape[0], dtype=native.F32)
    rc = native._native().lib.dk_bf16_grouped_linear(of.data_ptr(), w.data_ptr(), y.data_ptr(), t, g,
                                                     wo_a.shape[0] // g, wo_a.shape[1], torch.get_num_threads())
    if rc != 0:
        raise MemoryError(f"host kernel grouped_out_proj: out of memory for o [{t}, {o.shape[1]}]")
    return y


rope_tail = native._native_op("rope_tail", rope_tail_impl,
                          lambda x, cos, sin, rd, inverse=False: torch.empty_like(x))
grouped_out_proj = native._native_op("grouped_out_proj", grouped_out_proj_impl,
                                 lambda o, wo_a, groups: o.new_empty(o.shape[0], wo_a.shape[0]))


def _gemm_args(lin: torch.nn.Module) -> tuple[int, int, int, str] | None:
    """(format code, weight pointer, scale pointer, max_m key) of a Linear the native GEMVs take, else None."""
    fmt, w = lin.fmt, lin.weight
    if fmt is None:
        if w.dtype is not torch.bfloat16 or not w.is_contiguous() or not w.is_cpu:
            return None
        return packs._FMT_CODE[None], w.data_ptr(), 0, packs._FMT_KEY[None]
    s = lin.scale
    if w.dtype is not torch.uint8 or s.dtype is not torch.uint8 or not (w.is_contiguous() and s.is_contiguous()) \
            or not (w.is_cpu and s.is_cpu):
        return None
    return packs._FMT_CODE[fmt], w.data_ptr(), s.data_ptr(), packs._FMT_KEY[fmt]


def attn_qkv_native(x: torch.Tensor, wq_a: torch.nn.Module, q_norm_w: torch.Tensor, wq_b: torch.nn.Module,
                    wkv: torch.nn.Module, kv_norm_w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
                    rd: int, eps: float, kv_only: bool = False,
                    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None] | None:
    """engine/model/ops.py `attn_qkv` as one native call (attn.c; `kv_only`: no query, (None, kv, None)), or None
    where the op-by-op path must run: not fp32 CPU inputs, a weight the native GEMVs do not take, more rows than a
    kernel's max_m, autograd (counted by reason under "host.attn_qkv")."""
    t = x.shape[0] if x.dim() == 2 else 0
    why = native._why_not_rows("mhc", t, x, q_norm_w, kv_norm_w, cos, sin)
    if why is None and (x.dtype is not torch.float32 or cos.dtype is not torch.float32
                        or sin.dtype is not torch.float32 or q_norm_w.dtype is not torch.float32
                        or kv_norm_w.dtype is not torch.float32):
        why = "dtype"
    args = [] if why else [_gemm_args(lin) for lin in (wq_a, wq_b, wkv)]
    if why is None and any(a is None for a in args):
        why = "weight"
    if why is None:
        dim, ql, hd = x.shape[1], wq_a.out_features, wkv.out_features
        if (wq_a.in_features, wq_b.in_features, wq_b.out_features, wkv.in_features) != (dim, ql, n_heads * hd, dim) \
                or tuple(q_norm_w.shape) != (ql,) or tuple(kv_norm_w.shape) != (hd,) or not 0 < rd <= hd or rd % 2 \
                or tuple(cos.shape) != (t, rd // 2) or tuple(sin.shape) != (t, rd // 2):
            why = "shape"
        elif t > (limit := native.max_rows(tuple(a[3] for a in args))):
            why = f"M > {limit}"
    if why is not None:
        return dispatch.fallback("host.attn_qkv", why, lambda: None)
    native._count("host.attn_qkv")
    xf, qn, kn, cf, sf = x.contiguous(), q_norm_w.contiguous(), kv_norm_w.contiguous(), cos.contiguous(), \
        sin.contiguous()
    qr = q = None
    if not kv_only:
        qr, q = torch.empty(t, ql, dtype=native.F32), torch.empty(t, n_heads, hd, dtype=native.F32)
    kv = torch.empty(t, hd, dtype=native.F32)
    (fa, wa, sa, _), (fb, wb, sb, _), (fk, wk, sk, _) = args
    rc = native._native().lib.dk_attn_qkv(xf.data_ptr(), t, dim, fa, wa, sa, qn.data_ptr(), ql, fb, wb, sb, n_heads, hd,
                                      fk, wk, sk, kn.data_ptr(), cf.data_ptr(), sf.data_ptr(), rd, eps,
                                      None if qr is None else qr.data_ptr(), None if q is None else q.data_ptr(),
                                      kv.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise MemoryError(f"host kernel attn_qkv: error {rc} for x [{t}, {dim}]")
    return q, kv, qr


_FRONT_KEYS = ("host.attn_front", "host.hc_mixes", "host.hc_collapse", "host.rms_norm", "host.attn_qkv")


def front_pack(site: tuple, wq_a: torch.nn.Module, q_norm_w: torch.Tensor, wq_b: torch.nn.Module,
               wkv: torch.nn.Module, kv_norm_w: torch.Tensor, n_heads: int, rd: int, eps: float,
               projs: tuple[torch.nn.Module, ...]) -> Pack:
    """`attn_front`'s pack for one layer: `site` the mHC site's hc_pre arguments after x (fn, scale, base, norm
    weight, hc_mult, iterations, hc_eps, norm_eps), then attn_qkv's and the projections' (Linear modules); args None
    where a part would not run natively (a weight the native GEMVs do not take, non-fp32 tensors, odd shapes)."""
    fn, scale, base, norm_w, n, iters, hc_eps, norm_eps = site
    lins = (wq_a, wq_b, wkv, *projs)
    keep = (fn, scale, base, norm_w, q_norm_w, kv_norm_w, *(t for lin in lins for t in packs.held(lin)))
    dim, ql, hd = norm_w.shape[0], wq_a.out_features, wkv.out_features
    args = [_gemm_args(lin) for lin in lins]
    ins = (wq_a.in_features, wq_b.in_features, wq_b.out_features, wkv.in_features)
    if not packs.fp32_cpu(fn, scale, base, norm_w, q_norm_w, kv_norm_w) or any(a is None for a in args) \
            or not 0 < n <= 16 or tuple(fn.shape) != ((2 + n) * n, n * dim) or scale.numel() < 3 \
            or base.numel() != (2 + n) * n or ins != (dim, ql, n_heads * hd, dim) \
            or tuple(q_norm_w.shape) != (ql,) or tuple(kv_norm_w.shape) != (hd,) or not 0 < rd <= hd or rd % 2 \
            or any(p.in_features != dim for p in projs):
        return Pack(None, keep)
    k, widths = len(projs), [p.out_features for p in projs]
    (fa, wa, sa, _), (fb, wb, sb, _), (fk, wk, sk, _) = args[:3]
    return Pack(types.SimpleNamespace(
        n=n, dim=dim, ql=ql, hd=hd, heads=n_heads, rd=rd, widths=widths, limit_keys=("mhc", *(a[3] for a in args)),
        keys=tuple((k, native.EXECUTOR) for k in (*_FRONT_KEYS, *(f"host.{a[3]}" for a in args[3:]))),
        head=(fn.data_ptr(), scale.data_ptr(), base.data_ptr(), iters, hc_eps, norm_eps, norm_w.data_ptr(), fa, wa,
              sa, q_norm_w.data_ptr(), ql, fb, wb, sb, n_heads, hd, fk, wk, sk, kv_norm_w.data_ptr()),
        tail=(rd, eps, k, (ctypes.c_int * max(1, k))(*[a[0] for a in args[3:]]),
              (ctypes.c_void_p * max(1, k))(*[a[1] for a in args[3:]]),
              (ctypes.c_void_p * max(1, k))(*[a[2] or None for a in args[3:]]), (ctypes.c_int64 * max(1, k))(*widths))),
        keep)


def attn_front(pack: Pack, x: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """attn.c `dk_attn_front` (module docstring) with `front_pack`'s static arguments: x the residual streams
    [T, n, dim], cos / sin [T, rd/2] -> (post, comb, q, kv, qr, *one output per projection), or None where a part
    would not run natively (nothing counted: the caller runs them one by one)."""
    a = pack.args
    t = None if a is None else packs.step_rows(a, x, cos, sin)
    if t is None:
        return None
    native._count_each(a.keys)
    n = a.n
    post, comb = torch.empty(t, n, dtype=native.F32), torch.empty(t, n, n, dtype=native.F32)
    qr, q, kv = torch.empty(t, a.ql, dtype=native.F32), torch.empty(t, a.heads, a.hd, dtype=native.F32), \
        torch.empty(t, a.hd, dtype=native.F32)
    proj = torch.empty(t * sum(a.widths), dtype=native.F32)
    rc = native._native().lib.dk_attn_front(x.data_ptr(), t, n, a.dim, *a.head, cos.data_ptr(), sin.data_ptr(), *a.tail,
                                        post.data_ptr(), comb.data_ptr(), qr.data_ptr(), q.data_ptr(), kv.data_ptr(),
                                        proj.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise MemoryError(f"host kernel attn_front: error {rc} for x [{t}, {n}, {a.dim}]")
    outs, off = [], 0
    for w in a.widths:
        outs.append(proj[off: off + t * w].view(t, w))
        off += t * w
    return (post, comb, q, kv, qr, *outs)


_DECODE_KEYS = ("host.attn_decode", "host.sparse_attn", "host.rope_tail", "host.grouped_out_proj", "host.hc_expand")
_SELECT_KEY = (("host.attn_decode.select", native.EXECUTOR),)  # attn_decode over the indexer's picks
CLOSE_KEY = (("host.attn_decode.close", native.EXECUTOR),)  # attn_decode pooling the blocks that close


def decode_pack(sink: torch.Tensor, scale: float, rd: int, wo_a: torch.Tensor, groups: int, wo_b: torch.nn.Module,
                win_kv: torch.Tensor, cmp_pool: torch.Tensor | None, states: tuple[tuple, ...]) -> Pack:
    """`attn_decode`'s pack for one layer and its cache: the sink, wo_a (bf16) and wo_b, the window ring [S, wl, D]
    and the entry pool [NB, epb, D] (None: no compressor), and per compressor (the state writes and the closing
    blocks' pooling `attn_decode` can make) its state kv and score [S, rows, W], ape [m, W], its norm's weight [d],
    its entry pool [NB, epb, d], its ratio m and its norm's eps; the tensors fp32 CPU as --kv-cache-dtype auto holds
    them; args None where the kernels do not take them."""
    tensors = tuple(t for st in states for t in st[:5])
    keep = (sink, wo_a, win_kv, cmp_pool, *packs.held(wo_b), *tensors)
    gb = _gemm_args(wo_b)
    if gb is None or not packs.fp32_cpu(sink, win_kv, *tensors) or cmp_pool is not None \
            and not packs.fp32_cpu(cmp_pool) or wo_a.dtype is not torch.bfloat16 or not wo_a.is_contiguous() \
            or wo_a.shape[0] % groups or wo_b.in_features != wo_a.shape[0] \
            or any(st[3].shape != st[4].shape[2:] or st[0].shape[2] not in (st[4].shape[2], 2 * st[4].shape[2])
                   or st[2].shape[0] != st[5] or st[5] * st[0].shape[2] // st[4].shape[2] > native._native().pool_slots
                   for st in states):
        return Pack(None, keep)
    h, d = sink.shape[0], win_kv.shape[2]
    if wo_a.shape[1] * groups != h * d:
        return Pack(None, keep)
    return Pack(types.SimpleNamespace(
        h=h, d=d, wl=win_kv.shape[1], ring=win_kv.data_ptr(), sink=sink.data_ptr(), scale=scale, rd=rd,
        pool=cmp_pool.data_ptr() if cmp_pool is not None else None,
        epb=cmp_pool.shape[1] if cmp_pool is not None else 1,
        wo=(wo_a.data_ptr(), groups, wo_a.shape[0] // groups, *gb[:3], wo_b.out_features),
        states=[(st_kv.data_ptr(), st_score.data_ptr(), ape.data_ptr(), st_kv.shape[2], st_kv.shape[1],
                 norm_w.data_ptr(), pool.data_ptr(), pool.shape[1], m, pool.shape[2], eps)
                for st_kv, st_score, ape, norm_w, pool, m, eps in states],
        limit_keys=("mhc", "sparse_attn", "linear", gb[3]),
        keys=tuple((k, native.EXECUTOR) for k in (*_DECODE_KEYS, f"host.{gb[3]}"))), keep)


def comp_args(states: list[tuple], kv: list[int], score: list[int], step: list[list[int]],
              closing: list[int]) -> tuple[ctypes.Array, ctypes.Array, ctypes.Array]:
    """dk_attn_decode's per-compressor arrays (dk.h CPTR / CDIM order) from the pack's `states` and the step's
    pointers: the projections kv and score, `step` (state rows, phases, closing rows, block ids, cos, sin) and the
    closing block counts -> (cptr, cdim, ceps)."""
    n = len(states)
    cptr = (ctypes.c_void_p * max(1, 13 * n))(*[p for st, k, sc, dyn in zip(states, kv, score, step, strict=True)
                                                for p in (k, sc, *st[:3], *dyn, *st[5:7])])
    cdim = (ctypes.c_int64 * max(1, 6 * n))(*[v for st, k in zip(states, closing, strict=True)
                                             for v in (st[3], st[4], k, *st[7:10])])
    return cptr, cdim, (ctypes.c_float * max(1, n))(*[st[10] for st in states])


def attn_decode_takes(pack: Pack, b: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `attn_decode` takes a decode-only step of b sequences with residual streams x [B, n, dim] and RoPE
    tables cos / sin [B, rd/2]: the pack has arguments (`decode_pack`), x, cos and sin are fp32 (then so are the
    front's outputs), b within every kernel's max_m."""
    a = pack.args
    if a is None:
        return False
    limit = native.max_rows(a.limit_keys)
    return packs.rows_ok(x, (b, x.shape[1] if x.dim() == 3 else 0, a.wo[-1]), limit) \
        and packs.rows_ok(cos, (b, a.rd // 2), limit) and packs.rows_ok(sin, (b, a.rd // 2), limit)


def attn_decode(pack: Pack, q: torch.Tensor, slots: torch.Tensor, ring_valid: torch.Tensor, tables: torch.Tensor,
                nloc: int, visible: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor,
                post: torch.Tensor, comb: torch.Tensor, writes: tuple | None = None,
                keep: torch.Tensor | None = None, index: tuple | None = None,
                hold: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """attn.c `dk_attn_decode` (module docstring) with `decode_pack`'s static arguments -> the block's new streams
    [B, n, dim] fp32. q [B, H, D]; the window ring read at slots [B] with ring_valid [B, (1,) wl] bool; entries
    0..nloc-1 of each sequence through tables [B, nb], seen while their id < visible [B, (1)]; cos / sin [B, rd/2];
    x [B, n, dim], post [B, n], comb [B, n, n]. The caller checked `attn_decode_takes`. `writes`: the step's state
    writes first: (kv [B, D] and its ring rows [B] int64, then per compressor of the pack (kv_c, score_c [B, W]
    fp32, state rows, phases [B] int64, the rows whose block closes [K] int64, those blocks' ids [K] int64 and
    RoPE's cos, sin [K, rd/2] at their first positions): the blocks that close pooled into their pools as
    `Compressor.decode` pools them); None: already written.
    `keep`: the indexer's picks among the entries [B, nloc] bool (Attention._select), None: every causal entry.
    `index`: the indexer's queries [B, Hi, Di] and head weights [B, Hi] fp32 and its top-k, for attn_decode to
    score the entries of the pack's second compressor's pool and pick them itself (after the state writes, as
    Attention._entries and _select do; the host table's `index_score` is the same routine).
    `hold`: (address of fp32 rows, address of the rows' positions [B] int64, rows per slot, row width): each row's
    x averaged over its streams into row slot * rows per slot + position % rows per slot (DSpark's context input,
    engine/runner.py `ModelRunner.hold`)."""
    a = pack.args
    b = q.shape[0]
    native._count_each(a.keys if keep is None and index is None else a.keys + _SELECT_KEY)
    kp = keep.contiguous() if keep is not None and nloc else None
    if kp is not None and (kp.dtype is not torch.bool or tuple(kp.shape) != (b, nloc)):
        raise ValueError(f"attn_decode: keep must be bool [{b}, {nloc}], got {kp.dtype} {tuple(kp.shape)}")
    iqt = iw = None
    ipool, iepb, hi, di, topk = None, 1, 0, 0, 0
    if index is not None and nloc:
        iq, w, topk = index
        hi, di = iq.shape[1], iq.shape[2]
        if len(a.states) != 2 or iq.dtype is not torch.float32 or tuple(iq.shape) != (b, hi, a.states[1][9]) \
                or w.dtype is not torch.float32 or tuple(w.shape) != (b, hi):
            raise ValueError(f"attn_decode: index queries [{b}, Hi, {a.states[1][9] if len(a.states) == 2 else '-'}]"
                             f" and weights [{b}, Hi] fp32 for a pack with the indexer's pool, got {tuple(iq.shape)}, "
                             f"{tuple(w.shape)}")
        iqt, iw = iq.transpose(1, 2).contiguous(), w.contiguous()  # [B, Di, Hi]: dk_index_score's layout
        ipool, iepb = a.states[1][6], a.states[1][7]
    qf, sl, rv, tb = q.contiguous(), slots.contiguous(), ring_valid.contiguous(), tables.contiguous()
    vis = visible.reshape(-1).contiguous() if visible is not None and nloc else None
    n, dim = x.shape[1], x.shape[2]
    out = torch.empty(b, n, dim, dtype=native.F32)
    new_kv = ring_rows = cptr = cdim = ceps = None
    n_comp = 0
    if writes is not None:
        new_kv, ring_rows = writes[0].contiguous(), writes[1].contiguous()
        dyn = [[u.contiguous() for u in c] for c in writes[2:]]  # alive until the call returns
        n_comp = len(dyn)
        closing = [c[4].numel() for c in dyn]
        cptr, cdim, ceps = comp_args(a.states, [c[0].data_ptr() for c in dyn], [c[1].data_ptr() for c in dyn],
                                     [[u.data_ptr() for u in c[2:]] for c in dyn], closing)
        if any(closing):
            native._count_each(CLOSE_KEY)
    rc = native._native().lib.dk_attn_decode(
        qf.data_ptr(), b, a.h, a.d, a.ring, a.wl, sl.data_ptr(), rv.data_ptr(), a.pool if nloc else None, a.epb,
        tb.data_ptr(), tb.shape[1], nloc, vis.data_ptr() if vis is not None else None,
        kp.data_ptr() if kp is not None else None, iqt.data_ptr() if iqt is not None else None,
        iw.data_ptr() if iw is not None else None, ipool, iepb, hi, di, topk, a.sink, a.scale,
        cos.contiguous().data_ptr(), sin.contiguous().data_ptr(), a.rd, *a.wo[:-1], dim, x.data_ptr(), n,
        post.contiguous().data_ptr(), comb.contiguous().data_ptr(), out.data_ptr(),
        new_kv.data_ptr() if new_kv is not None else None, ring_rows.data_ptr() if ring_rows is not None else None,
        n_comp, cptr, cdim, ceps, *(hold or (None, None, 0, 0)), torch.get_num_threads())
    if rc != 0:
        raise MemoryError(f"host kernel attn_decode: error {rc} for q [{b}, {a.h}, {a.d}] over {a.wl} + {nloc} keys")
    return out
