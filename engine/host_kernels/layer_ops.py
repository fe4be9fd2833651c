"""A whole decode layer in one native call: attn.c `dk_decode_layer` runs `dk_attn_front`, `dk_attn_decode` with the
step's state writes and `dk_ffn_site` from one struct of static arguments (abi.py `DkLayer`) built from the three
sites' packs; attn.c states the contract (the three calls' kernels in their order: the same numbers bit for bit).
block_decoder.py decides when a step takes it. Dispatch key "host.decode_layer" (+ each site's keys)."""

from __future__ import annotations

import ctypes
import types

import torch

from engine.host_kernels import attn_ops, native, packs
from engine.host_kernels.abi import _F, _I, _P, DkLayer, layout_mismatch  # noqa: F401  (DkLayer's users import here)
from engine.host_kernels.packs import Pack
from engine.host_kernels.step_ops import _SITE_COUNTS, hash_ids_fit


def layer_pack(front: Pack | None, decode: Pack | None, site: Pack | None) -> Pack:
    """`decode_layer`'s pack from the layer's three site packs (attn_ops.front_pack, attn_ops.decode_pack,
    step_ops.site_pack; None: the module has none); args None unless each has arguments, both halves share the mHC
    settings and the layer has at most two compressors (the attention's and the indexer's). It holds every tensor
    the three hold, so it is made again when any of them moves."""
    parts = [p for p in (front, decode, site) if p is not None]
    held = tuple(t for p in parts for t in p.tensors())
    if len(parts) < 3:
        return Pack(None, held)
    fa, da, sa = front.args, decode.args, site.args
    if fa is None or da is None or sa is None or len(da.states) > 2 or fa.head[3:6] != sa.head[3:6] \
            or (fa.n, fa.dim) != (sa.n, sa.d) or len(fa.widths) != 2 * len(da.states):
        return Pack(None, held)
    (fn, scale, base, iters, hc_eps, norm_eps, norm_w, f_a, wa, s_a, q_norm, ql, f_b, wb, s_b, heads, hd, f_k, wk, s_k,
     kv_norm) = fa.head
    rd, eps, k, pf, pw, ps, pn = fa.tail
    wo_a, groups, r, fo, wo, so, _ = da.wo
    ffn, ffn_scale, ffn_base, _, _, _, ffn_norm, gate_w, e, bias = sa.head
    topk, route_scale, inter, limit, e_lo, e_n, fmt_r, ptrs_r, fmt_s, ptrs_s = sa.tail
    pad = 2 - len(da.states)
    st = [p for kv, sc, ape, _, _, norm, pool, *_ in da.states for p in (kv, sc, ape, norm, pool)] + [None] * 5 * pad

    def per_comp(i: int, t: type = _I) -> ctypes.Array:  # field i of each compressor's state tuple
        return (t * 2)(*[c[i] for c in da.states], *[0] * pad)

    layer = DkLayer(
        fn, scale, base, iters, hc_eps, norm_eps, norm_w, f_a, wa, s_a or None, q_norm, ql, f_b, wb, s_b or None,
        heads, hd, f_k, wk, s_k or None, kv_norm, rd, eps, da.scale, k, ctypes.addressof(pf), ctypes.addressof(pw),
        ctypes.addressof(ps), ctypes.addressof(pn), da.ring, da.wl, da.pool, da.epb, da.sink, wo_a, groups, r, fo, wo,
        so or None, len(da.states), (_P * 10)(*st), per_comp(3), per_comp(4), per_comp(7), per_comp(8), per_comp(9),
        per_comp(10, _F), ffn, ffn_scale,
        ffn_base, ffn_norm, gate_w, e, bias, topk, route_scale, limit, inter, e_lo, e_n, fmt_r,
        ctypes.addressof(ptrs_r), fmt_s, ctypes.addressof(ptrs_s) if ptrs_s is not None else None, fa.n, fa.dim)
    return Pack(types.SimpleNamespace(
        layer=layer, ref=ctypes.byref(layer), keep=(pf, pw, ps, pn, ptrs_r, ptrs_s), n=fa.n, dim=fa.dim, rd=rd,
        hashed=sa.hashed, topk=topk, e=e, n_comp=len(da.states),
        limit_keys=tuple(sorted({*fa.limit_keys, *da.limit_keys, *sa.limit_keys})),
        keys=(("host.decode_layer", native.EXECUTOR), *fa.keys, *da.keys, *_SITE_COUNTS)), held)


def decode_layer(pack: Pack, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                 ring_rows: torch.Tensor, ring_valid: torch.Tensor, tables: torch.Tensor, nloc: int,
                 visible: torch.Tensor | None, crow: tuple[tuple[torch.Tensor, ...], ...],
                 hash_ids: torch.Tensor | None, hold: tuple[int, int, int, int] | None = None) -> torch.Tensor | None:
    """attn.c `dk_decode_layer` with `layer_pack`'s static arguments: x the residual streams [B, n, dim] -> the
    layer's output streams, or None where it does not take this call (nothing counted, no state written: the
    caller runs the layer's sites). cos / sin [B, rd/2]; slots, ring_rows [B] int64; ring_valid [B, (1,) wl] bool;
    tables [B, nb]; entries 0..nloc-1 seen while their id < visible [B, (1)]; crow: per compressor its state rows
    and phases [B] int64, the rows whose block closes [K] int64, those blocks' ids [K] int64 and RoPE's cos, sin
    [K, rd/2] at their first positions (attn_ops.attn_decode's `writes`); hash_ids [B, K] int64 for a hash layer;
    hold: attn_ops.attn_decode's."""
    a = pack.args
    b = None if a is None else packs.step_rows(a, x, cos, sin)
    if b is None or len(crow) != a.n_comp or not hash_ids_fit(a, hash_ids, b):
        return None
    native._count_each(a.keys)
    h = hash_ids.contiguous() if hash_ids is not None else None
    out = torch.empty(b, a.n, a.dim, dtype=native.F32)
    args, keep = _step_args(cos, sin, slots, ring_rows, ring_valid, tables, nloc, visible, crow)
    rc = native._native().lib.dk_decode_layer(a.ref, x.data_ptr(), out.data_ptr(), b, *args,
                                              h.data_ptr() if h is not None else None, *(hold or (None, None, 0, 0)),
                                              torch.get_num_threads())
    del keep
    native.check_rc(rc, "decode_layer", x, ValueError(f"gate: a hash-layer expert id is outside [0, {a.e})"))
    return out


def _step_args(cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, ring_rows: torch.Tensor,
               ring_valid: torch.Tensor, tables: torch.Tensor, nloc: int, visible: torch.Tensor | None,
               crow: tuple[tuple[torch.Tensor, ...], ...]) -> tuple[tuple, list]:
    """dk_decode_layer's step arguments from cos to ck (the tensors made contiguous, counted where a block closes)
    and what must stay alive until the call returns."""
    sl, rr, rv, tb = slots.contiguous(), ring_rows.contiguous(), ring_valid.contiguous(), tables.contiguous()
    vis = visible.reshape(-1).contiguous() if visible is not None and nloc else None
    rows = [t.contiguous() for c in crow for t in c]
    cptr = (_P * max(1, len(rows)))(*[t.data_ptr() for t in rows])
    ck = (_I * max(1, len(crow)))(*[c[2].numel() for c in crow])
    if any(ck):
        native._count_each(attn_ops.CLOSE_KEY)
    args = (cos.data_ptr(), sin.data_ptr(), sl.data_ptr(), rr.data_ptr(), rv.data_ptr(), tb.data_ptr(), tb.shape[1],
            nloc, vis.data_ptr() if vis is not None else None, cptr, ck)
    return args, [sl, rr, rv, tb, vis, rows, cos, sin]


def _mtp_rows(a, ia, ha, x: torch.Tensor, ids: torch.Tensor, rows: list[int], cos: torch.Tensor, sin: torch.Tensor,
              crow: tuple) -> int | None:
    """The row count B of an MTP pass (`mtp_pass`) over x [B, n, dim], ids [B] and the head over `rows`, where the
    three packs' arguments `a` (layer), `ia` (input), `ha` (head) take it, else None."""
    b = None if a is None or ia is None or ha is None else packs.step_rows(a, x, cos, sin)
    if b is None or len(crow) != a.n_comp or not hash_ids_fit(a, None, b) \
            or (ia.dim, ha.dim, ha.n) != (a.dim, a.dim, a.n) or b * a.n > native.max_rows(ia.limit_keys) \
            or ids.dtype is not torch.int64 or not ids.is_cpu or tuple(ids.shape) != (b,) \
            or not 0 < len(rows) <= native.max_rows(ha.limit_keys) or not 0 <= min(rows) <= max(rows) < b:
        return None
    return b


def mtp_pass(layer: Pack, inp: Pack, head: Pack, x: torch.Tensor, ids: torch.Tensor, rows: list[int],
             cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, ring_rows: torch.Tensor,
             ring_valid: torch.Tensor, tables: torch.Tensor, nloc: int, visible: torch.Tensor | None,
             crow: tuple[tuple[torch.Tensor, ...], ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """attn.c `dk_mtp_pass`: an MTP block's pass in one call - step_ops.mtp_input (`inp`), decode_layer (`layer`,
    the step's arguments as decode_layer takes them) and step_ops.lm_head (`head`) over the streams' rows `rows`
    (R of them) - with each one's checks; -> (streams [B, n, dim], logits [R, V], their argmax [R]), or None where
    one of the three would not take its part (nothing counted, no state written)."""
    a, ia, ha = layer.args, inp.args, head.args
    b = _mtp_rows(a, ia, ha, x, ids, rows, cos, sin, crow)
    if b is None:
        return None
    for keys in (ia.keys, a.keys, ha.keys):
        native._count_each(keys)
    r = len(rows)
    out, logits = torch.empty(b, a.n, a.dim, dtype=native.F32), torch.empty(r, ha.vocab, dtype=native.F32)
    tokens = torch.empty(r, dtype=torch.int64)
    idc, rc_ = ids.contiguous(), torch.tensor(rows, dtype=torch.int64)
    args, keep = _step_args(cos, sin, slots, ring_rows, ring_valid, tables, nloc, visible, crow)
    rc = native._native().lib.dk_mtp_pass(
        a.ref, ctypes.byref(ia.struct), ctypes.byref(ha.struct), x.data_ptr(), idc.data_ptr(), out.data_ptr(), b,
        *args, rc_.data_ptr(), r, logits.data_ptr(), tokens.data_ptr(), torch.get_num_threads())
    del keep
    native.check_rc(rc, "mtp_pass", x, IndexError(f"mtp_input: a token id outside [0, {ia.vocab})"))
    return out, logits, tokens


_FILL_KEYS = tuple((k, native.EXECUTOR) for k in attn_ops._FRONT_KEYS[1:])  # hc_pre, then attn_qkv


def mtp_draft(layer: Pack, inp: Pack, head: Pack, x: torch.Tensor, ids: torch.Tensor, pos: list[int],
              slots: list[int], rows: list[int], k: int, tables: tuple[torch.Tensor, torch.Tensor, int],
              win: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """attn.c `dk_mtp_draft`: k greedy drafts of a sliding-only MTP block (no entries, no compressor; one rank) in
    one call - the catch-up over x [B, n, dim], ids [B] at positions `pos` of `slots` (B each: the rows before each
    sequence's last, within its window, write their ring rows only; its R last rows `rows` run one `mtp_pass`), then
    k - 1 passes over the R rows at positions pos[rows] + 1 .. + k - 1, each fed the
    previous pass's streams and tokens; RoPE rows read from `tables` (cos, sin [P, rd/2], p0: the block's Rope
    over positions p0..p0+P-1), ring rows and masks made from the positions (`win`: the attention's window). -> (logits
    [k, R, V], tokens [k, R]), or None where an argument does not fit (nothing counted, no state written)."""
    a, ia, ha = layer.args, inp.args, head.args
    b, r = len(pos), len(rows)
    if a is None or ia is None or ha is None or a.layer.pool or a.n_comp or k < 1 or b != len(slots) \
            or (ia.dim, ha.dim, ha.n) != (a.dim, a.dim, a.n) or not hash_ids_fit(a, None, b):
        return None
    cos, sin, p0 = tables
    if not packs.rows_ok(x, (b, a.n, a.dim), native.max_rows(a.limit_keys)) \
            or b * a.n > native.max_rows(ia.limit_keys) \
            or not 0 < r <= native.max_rows(ha.limit_keys) \
            or ids.dtype is not torch.int64 or not ids.is_cpu or tuple(ids.shape) != (b,) or not ids.is_contiguous() \
            or cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != a.rd // 2 or not packs.fp32_cpu(cos, sin):
        return None
    native._count("host.mtp_draft")
    for keys in (ia.keys, a.keys, ha.keys):  # and as k mtp_pass calls
        native._count_each(keys, k)
    if b > r:  # and as the catch-up's ring fill of the rows before the last (mtp_proposer.mtp_fill_ring's ops)
        native._count_each(ia.keys)
        native._count_each(_FILL_KEYS)
    logits, tokens = torch.empty(k, r, ha.vocab, dtype=native.F32), torch.empty(k, r, dtype=torch.int64)
    at = (ctypes.c_int64 * (2 * b + r))(*pos, *slots, *rows)
    step = ctypes.sizeof(ctypes.c_int64)
    rc = native._native().lib.dk_mtp_draft(
        a.ref, ctypes.byref(ia.struct), ctypes.byref(ha.struct), x.data_ptr(), ids.data_ptr(), b, cos.data_ptr(),
        sin.data_ptr(), p0, cos.shape[0], ctypes.addressof(at) + step * b, ctypes.addressof(at), ctypes.addressof(at)
        + step * 2 * b, r, k, win, logits.data_ptr(), tokens.data_ptr(), torch.get_num_threads())
    if rc == -5:
        raise IndexError(f"mtp_draft: a position outside the RoPE table's [{p0}, {p0 + cos.shape[0]}) or a row "
                         f"outside the {b} rows")
    native.check_rc(rc, "mtp_draft", x, IndexError(f"mtp_input: a token id outside [0, {ia.vocab})"))
    return logits, tokens
