"""The model's op table: `OpTable` declares every op the model calls; `ops_for(EngineConfig.kernels)` builds the one
in use. Tables: `reference` (nki_kernels/reference.py, the single definition each kernel is tested against),
`stand-in` / `nki` (the NKI kernels through nki_kernels/kernel_ops.py, on the NumPy stand-in or a Neuron device) and
`host` (engine/host_kernels: native CPU kernels, and `block_decoder`, the fused decode sites). A table that lacks an
op fails at construction, naming it; the numerics hooks (engine/model/numerics.py) are applied first, the
composites (`with_composites`) over them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from engine.model.capabilities import HOST, Capabilities
from engine.model.numerics import with_numerics
from nki_kernels import reference
from nki_kernels.kernel_ops import KERNEL_OPS, make_ops

__all__ = ["KERNEL_OPS", "REFERENCE", "BlockDecoder", "OpByOp", "OpTable", "OpsUser", "make_table", "ops_for",
           "with_composites"]

T = torch.Tensor
Op = Callable[..., Any]


class BlockDecoder(Protocol):
    """A table's fused decode of one Block (engine/host_kernels/block_decoder.py implements it; its docstring holds
    the contract); each returns the new residual streams, or None where it does not take the step (the block then
    runs its ops one by one)."""

    def layer(self, block: Any, x: T, plan: Any, lc: Any, input_ids: T) -> T | None: ...

    def attn_half(self, block: Any, x: T, plan: Any, lc: Any) -> T | None: ...

    def ffn_half(self, block: Any, x: T, plan: Any, input_ids: T) -> T | None: ...

    def mtp_input(self, model: Any, blk: Any, x: T, next_ids: T) -> T | None: ...

    def logits(self, model: Any, x: T, hc: Any, norm: Any) -> T | None: ...

    def mtp_pass(self, model: Any, blk: Any, x: T, next_ids: T, plan: Any, lc: Any,
                 rows: list[int]) -> tuple[T, T, T] | None: ...

    def mtp_draft(self, model: Any, blk: Any, x: T, next_ids: T, seqs: list, lc: Any,
                  k: int) -> tuple[T, T] | None: ...

    def attn_front(self, block: Any, x: T, cos: T, sin: T) -> tuple[T, ...] | None:
        """The attention half's front alone (hc_pre, q, kv, the compressors' projections): (post, comb, q, kv before
        the KV numerics, qr, *projections), or None (the DSpark block attends its own keys after it)."""
        ...

    def ring_layer(self, block: Any, x: T, lc: Any, slots: T, ring_rows: T, ring_valid: T, cos: T, sin: T,
                   input_ids: T) -> T | None:
        """A sliding-only block over rows whose ring rows and masks the caller gives (each row's kv written at its
        ring row first), in one call, or None."""
        ...


class OpByOp:
    """The `BlockDecoder` of tables without fused decode sites: it takes no step."""

    def layer(self, *_: Any) -> None:
        return None

    def attn_half(self, *_: Any) -> None:
        return None

    def ffn_half(self, *_: Any) -> None:
        return None

    def mtp_input(self, *_: Any) -> None:
        return None

    def logits(self, *_: Any) -> None:
        return None

    def mtp_pass(self, *_: Any) -> None:
        return None

    def mtp_draft(self, *_: Any) -> None:
        return None

    def attn_front(self, *_: Any) -> None:
        return None

    def ring_layer(self, *_: Any) -> None:
        return None


def _no_moe_ffn(moe: Any, x: T, weights: T, indices: T) -> None:
    """`moe_ffn` of tables without a one-call MoE FFN: it takes no call."""
    return None


@dataclasses.dataclass(kw_only=True, eq=False)
class OpTable:
    """Every op the model calls (signatures as nki_kernels/reference.py's, where it defines them)."""

    kernels: str  # reference | stand-in | neuron | host
    numerics: str  # hf | official
    kernel_ops: Any  # a kernel table's KernelOps (its weight layouts, its FP8-activation GEMMs), else None
    # the kernel ops (nki_kernels/kernel_ops.py KERNEL_OPS)
    rms_norm: Callable[[T, T | None, float], T]
    swiglu: Callable[[T, T, float], T]
    linear: Callable[[T, T], T]
    fp8_linear: Callable[[T, T, T], T]  # x, weight bytes, UE8M0 scale bytes
    fp4_linear: Callable[[T, T, T], T]
    grouped_out_proj: Callable[[T, T, int], T]  # o, wo_a, groups
    hc_mixes: Callable[..., tuple[T, T, T]]  # x, fn, scale, base, hc_mult, iters, hc_eps, norm_eps -> pre, post, comb
    hc_collapse: Callable[[T, T], T]
    hc_expand: Callable[[T, T, T, T], T]  # y, residual, post, comb
    hc_attn_out: Callable[[T, T, T, T, T], T]  # o, wo_b (dense), residual, post, comb
    compress_pool: Callable[..., T]  # kv, score, overlap, prev_kv=None, prev_score=None
    index_score: Callable[[T, T, T], T]  # q, keys, weights
    sparse_attn: Callable[[T, T, T, T, float], T]  # q, kv, valid, sink, scale
    sparse_attn_partial: Callable[[T, T, T, float], tuple[T, T, T]]
    # ops no kernel family covers (the reference's unless the table has its own)
    rope_tail: Callable[..., T]  # x, cos, sin, rd, inverse=False
    gate: Callable[[T, T, int, float, T | None, T | None], tuple[T, T]]  # x, weight, topk, scale, bias, hash_ids
    hc_head: Callable[[T, T, T, T, float, float], T]
    # the numerics hooks (engine/model/numerics.py)
    kv_quant: Callable[[T, int], T]
    act_quant: Callable[[T], T]
    head_rms: Callable[[T, float], T]
    index_query_quant: Callable[[T], T]
    index_key_quant: Callable[[T], T]
    index_weights: Callable[[T, float], T]
    entry_in: Callable[[T, torch.dtype], T]
    # composites over the table's own ops (`with_composites`)
    hc_pre: Callable[..., tuple[T, T, T]]  # x, fn, scale, base, norm_w, hc_mult, iters, hc_eps, norm_eps
    attn_out_expand: Callable[[T, Any, T, T, T], T]  # o, wo_b (Linear), residual, post, comb
    stack_linear: Callable[[T, T, T | None, int | T, str | None], T]  # x, stack, scales, i, fmt
    attn_qkv: Callable[..., tuple[T, T, T]]  # Attention.qkv's front before the KV numerics
    attn_qkv_native: Callable[..., tuple[T, T, T] | None] | None  # what attn_qkv tries first (None: nothing)
    # fused paths: a table without them declines every call (`OpByOp`, `_no_moe_ffn`)
    moe_ffn: Callable[[Any, T, T, T], T | None]  # MoE module, x, weights, indices -> routed + shared, or None
    block_decoder: BlockDecoder
    # the runner's held rows written at once (engine/runner.py `ModelRunner._keep`; None: its torch path)
    keep_rows: Callable[..., bool] | None


_FIELDS = tuple(f.name for f in dataclasses.fields(OpTable))


def make_table(name: str, ops: Mapping[str, Any]) -> OpTable:
    """An OpTable of the ops in `ops` (extra names ignored); a ValueError naming every op it lacks."""
    missing = [f for f in _FIELDS if f not in ops]
    if missing:
        raise ValueError(f"op table {name!r} lacks {', '.join(missing)}")
    return OpTable(**{f: ops[f] for f in _FIELDS})


def with_composites(ops: OpTable | Mapping[str, Any], fused_attn_tail: bool) -> OpTable:
    """The table of `ops` with the composites the model needs, bound to the new table itself (so a table built from
    another one, like the host table, gets composites over its own ops):
    * `attn_out_expand(o, wo_b, residual, post, comb)`: the attention tail hc_expand(wo_b(o), ...), or the fused
      `hc_attn_out` kernel with `fused_attn_tail` (it takes wo_b dense: a stored wo_b's activation quantisation
      comes first);
    * `stack_linear(x, stack, scales, i, fmt)`: x @ stack[i]^T for a 1-element index tensor i (the MoE gather path:
      a device index, no host sync) or an int i, through the table's own GEMMs; fmt None | "fp8" | "fp4" (scales:
      the matching stack of scale bytes, or None). A kernel table runs its GEMM kernels on the stack's kernel
      layout, converted once at load (nki_kernels/kernel_ops.py `KernelOps.stack_linear`), after the numerics'
      activation quantisation;
    * `hc_pre`: the front of an mHC site (hc_mixes, hc_collapse, rms_norm), unless the table has a fused one;
    * `attn_qkv`: the attention's front (`Attention.qkv` before the KV numerics), through `attn_qkv_native` first
      where the table has one and it takes the call, outside traced graphs;
    and the reference's `rope_tail`, `gate` and `hc_head` where the table has none of its own."""
    d = dict(vars(ops)) if isinstance(ops, OpTable) else dict(ops)
    table: OpTable  # bound below: the composites call the finished table's ops
    kops = d.get("kernel_ops")

    def stack_linear(x: T, stack: T, scales: T | None, i: int | T, fmt: str | None) -> T:
        if kops is not None:
            return kops.stack_linear(table.act_quant(x) if fmt else x, stack, scales, i, fmt)
        pick = (lambda t: t[i]) if isinstance(i, int) else (lambda t: t.index_select(0, i)[0])  # noqa: E731
        weight = pick(stack)
        if fmt is None:
            return table.linear(x, weight)
        fn = table.fp8_linear if fmt == "fp8" else table.fp4_linear
        return fn(x, weight, pick(scales))

    def fused_tail(o: T, wo_b: Any, residual: T, post: T, comb: T) -> T:
        return table.hc_attn_out(table.act_quant(o) if wo_b.fmt else o, wo_b.dense(o.dtype), residual, post, comb)

    def tail(o: T, wo_b: Any, residual: T, post: T, comb: T) -> T:
        return table.hc_expand(wo_b(o), residual, post, comb)

    def hc_pre(x: T, fn: T, scale: T, base: T, norm_w: T, hc_mult: int, iters: int, hc_eps: float,
               norm_eps: float) -> tuple[T, T, T]:
        pre, post, comb = table.hc_mixes(x, fn, scale, base, hc_mult, iters, hc_eps, norm_eps)
        return table.rms_norm(table.hc_collapse(x, pre), norm_w, norm_eps), post, comb

    def attn_qkv(x: T, wq_a: Any, q_norm_w: T, wq_b: Any, wkv: Any, kv_norm_w: T, cos: T, sin: T, n_heads: int,
                 rd: int, eps: float, kv_only: bool = False) -> tuple[T | None, T, T | None]:
        """x [T, dim] -> q [T, H, D] (low-rank q, per-head RMS, RoPE), kv [T, D] (normed, RoPE), qr [T, q_lora];
        wq_a / wq_b / wkv are the Linear modules. `kv_only`: (None, kv, None), the same kv (it does not depend on
        the query)."""
        native = table.attn_qkv_native
        if native is not None and not torch.compiler.is_compiling():
            out = native(x, wq_a, q_norm_w, wq_b, wkv, kv_norm_w, cos, sin, n_heads, rd, eps, kv_only)
            if out is not None:
                return out
        kv = table.rope_tail(table.rms_norm(wkv(x), kv_norm_w, eps), cos, sin, rd)
        if kv_only:
            return None, kv, None
        t = x.shape[0]
        qr = table.rms_norm(wq_a(x), q_norm_w, eps)  # [T, q_lora]
        q = table.head_rms(wq_b(qr).view(t, n_heads, -1), eps)  # per-head unweighted RMS
        q = table.rope_tail(q, cos.unsqueeze(1), sin.unsqueeze(1), rd)  # [T, H, D]
        return q, kv, qr

    d.update(attn_out_expand=fused_tail if fused_attn_tail else tail, stack_linear=stack_linear, attn_qkv=attn_qkv)
    for name, default in (("hc_pre", hc_pre), ("rope_tail", reference.rope_tail), ("gate", reference.gate),
                          ("hc_head", reference.hc_head), ("attn_qkv_native", None), ("moe_ffn", _no_moe_ffn),
                          ("block_decoder", OpByOp()), ("keep_rows", None)):
        d.setdefault(name, default)
    table = make_table(str(d.get("kernels")), d)
    return table


def _table(executor: str, numerics: str = "hf", kv_cache_dtype: str = "auto") -> OpTable:
    ops = make_ops(executor)
    aq_ops = getattr(ops.get("fp8_linear"), "__self__", None)  # KernelOps: its GEMMs take FP8 activations themselves
    aq = {n: getattr(aq_ops, f"{n}_aq") for n in ("fp8_linear", "fp4_linear")} if aq_ops is not None else None
    table = with_numerics({**ops, "kernels": executor, "kernel_ops": aq_ops}, numerics, kv_cache_dtype, aq)
    return with_composites(table, fused_attn_tail=executor != "reference")


REFERENCE = _table("reference")

# the host's fused decode sites, each present while engine/host_kernels NATIVE_OPS lists it
_HOST_SITES = {"layer": "decode_layer", "front": "attn_front", "decode": "attn_decode_takes", "ffn": "ffn_site_pack",
               "moe": "moe_ffn", "mtp": "mtp_input", "head": "lm_head", "draft": "mtp_draft"}


def _host_table(numerics: str = "hf", kv_cache_dtype: str = "auto") -> OpTable:
    """The reference ops with engine/host_kernels' native ops in place of the reference's, the numerics hooks and
    the composites over them, `stack_linear` reading the chosen expert in place (after the activation quantisation
    of the official numerics) and the fused decode sites (`block_decoder`; none under official numerics: they
    quantise no activations). Builds / loads the native library now (the engine's first use of it), so a missing
    compiler fails here with one line, not at the first forward."""
    from engine import host_kernels
    from engine.host_kernels.block_decoder import HostBlockDecoder

    host_kernels.ensure_loaded()
    native = host_kernels.NATIVE_OPS
    ops = with_numerics({**make_ops("reference"), **native, "kernels": "host", "kernel_ops": None}, numerics,
                        kv_cache_dtype)
    if ops["numerics"] == "official":
        ops.update(attn_qkv_native=None, moe_ffn=_no_moe_ffn, block_decoder=OpByOp())
    else:
        decoder = HostBlockDecoder(**{k: name in native for k, name in _HOST_SITES.items()})
        ops.update(moe_ffn=decoder.moe_ffn, block_decoder=decoder)
    table = with_composites(ops, fused_attn_tail=False)
    stack = host_kernels.stack_linear
    if table.numerics == "official":
        table.stack_linear = lambda x, st, scales, i, fmt: stack(table.act_quant(x) if fmt else x, st, scales, i, fmt)
    else:
        table.stack_linear = stack
    return table


def ops_for(kernels: Any, numerics: Any = "hf", kv_cache_dtype: Any = "auto") -> OpTable:
    """The op table of `--kernels reference | stand-in | nki | host` with the hooks of `--numerics hf | official`
    and `--kv-cache-dtype auto | fp8` (engine/model/numerics.py)."""
    name, num, kvd = str(kernels), str(numerics), str(kv_cache_dtype)
    if name == "reference":
        return REFERENCE if (num, kvd) == ("hf", "auto") else _table("reference", num, kvd)
    if name == "host":
        return _host_table(num, kvd)
    if name == "stand-in":
        return _table("stand-in", num, kvd)
    if name == "nki":
        from engine.stack import check_nki_version, versions

        check_nki_version(versions()["nki"])
        return _table("neuron", num, kvd)
    raise ValueError(f"kernels {name!r}: expected reference, stand-in, nki or host")


class OpsUser:
    """Mixin of the modules that call ops: `self.ops` is the table in use, `self.caps` what the device allows
    (engine/model/capabilities.py; both set by `engine.model.model.use_ops`)."""

    ops: OpTable = REFERENCE
    caps: Capabilities = HOST


def dequant(weight: torch.Tensor, scale: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """A stored FP8 / FP4 weight (bytes) dequantised: for kernels that take dense weights only."""
    from nki_kernels import formats

    if fmt == "fp8":
        return formats.dequant_fp8_block(weight.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu), dtype)
    return formats.dequant_fp4(weight.view(torch.int8), scale.view(torch.float8_e8m0fnu), dtype)
