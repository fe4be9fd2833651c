"""The model's op table: which implementation every kernel-family op runs, chosen by `EngineConfig.kernels`.

* `reference`: the torch definitions in nki_kernels/reference.py (the single definition each kernel is tested
  against; compile-safe on a torch-xla device: uint8 weight inputs decoded arithmetically);
* `stand-in`: the NKI kernels themselves, executed on the NumPy stand-in inside the model (host only), through
  nki_kernels/kernel_ops.py (same signatures; dispatch counters prove which path ran);
* `nki`: the same kernel ops on a Neuron device (executor "neuron"; written, not run here);
* `host`: the reference table with `linear` / `fp8_linear` / `fp4_linear` on native CPU GEMV kernels and the small
  per-token ops (`hc_mixes`, `hc_collapse`, `hc_expand`, `rms_norm`, `sparse_attn`) on native ones for decode-size
  inputs (engine/host_kernels; its `stack_linear` reads the chosen expert's weight in place instead of gathering a
  copy), plus `moe_ffn`, the MoE FFN after the gate in one native call (engine/model/moe.py `MoE.forward` uses it
  where the table has it).

Modules read `self.ops` (an `OpsUser` class attribute: the reference table unless `Transformer.use_ops` set
another). Besides the kernel ops, the table has two composites the model needs (`with_composites`): `attn_out_expand`,
the attention tail `hc_expand(wo_b(o), residual, post, comb)`, which the kernel table runs as the fused
`hc_attn_out` kernel, and `stack_linear`, a GEMM with one expert's weight picked from a stack by a device index;
and `rope_tail` (RoPE on the trailing dims: `reference.rope_tail`, native in the host table); and `attn_qkv`, the
attention's front (engine/model/attention.py `_qkv` before the KV numerics), which a table's `attn_qkv_native` (the
host's: one native call, engine/host_kernels/attn_ops.py) takes first where it can.
Every table also carries the numerics hooks of `--numerics` / `--kv-cache-dtype` (engine/model/numerics.py
`with_numerics`; identities for hf numerics and an auto cache), applied before the composites so these run over
them.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from engine.model.capabilities import HOST, Capabilities
from engine.model.numerics import with_numerics
from nki_kernels import reference
from nki_kernels.kernel_ops import KERNEL_OPS, make_ops

__all__ = ["KERNEL_OPS", "REFERENCE", "OpsUser", "ops_for", "with_composites"]


def with_composites(ops: types.SimpleNamespace, fused_attn_tail: bool) -> types.SimpleNamespace:
    """`ops` with the composites the model needs, bound to `ops` itself (so a table built from another one, like
    the host table, gets composites over its own ops):
    * `attn_out_expand(o, wo_b, residual, post, comb)`: the attention tail hc_expand(wo_b(o), ...), or the fused
      `hc_attn_out` kernel with `fused_attn_tail`;
    * `stack_linear(x, stack, scales, i, fmt)`: x @ stack[i]^T for a 1-element index tensor i (the MoE gather path:
      a device index, no host sync) or an int i, through the table's own GEMMs; fmt None | "fp8" | "fp4" (scales:
      the matching stack of scale bytes, or None). A kernel table (`ops.kernel_ops`) runs its GEMM kernels on the
      stack's kernel layout, converted once at load (nki_kernels/kernel_ops.py `KernelOps.stack_linear`), after
      the numerics' activation quantisation."""
    kops = getattr(ops, "kernel_ops", None)

    def stack_linear(x: torch.Tensor, stack: torch.Tensor, scales: torch.Tensor | None, i: int | torch.Tensor,
                     fmt: str | None) -> torch.Tensor:
        if kops is not None:
            return kops.stack_linear(ops.act_quant(x) if fmt else x, stack, scales, i, fmt)
        pick = (lambda t: t[i]) if isinstance(i, int) else (lambda t: t.index_select(0, i)[0])  # noqa: E731
        weight = pick(stack)
        if fmt is None:
            return ops.linear(x, weight)
        fn = ops.fp8_linear if fmt == "fp8" else ops.fp4_linear
        return fn(x, weight, pick(scales))

    if fused_attn_tail:  # the fused kernel takes wo_b dense: a stored wo_b's activation quantisation comes first
        ops.attn_out_expand = lambda o, wo_b, residual, post, comb: ops.hc_attn_out(
            ops.act_quant(o) if wo_b.fmt else o, wo_b.dense(o.dtype), residual, post, comb)
    else:
        ops.attn_out_expand = lambda o, wo_b, residual, post, comb: ops.hc_expand(wo_b(o), residual, post, comb)
    ops.stack_linear = stack_linear
    if not hasattr(ops, "hc_pre"):  # the front of an mHC site over the table's own ops, unless it has a fused one
        def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_w: torch.Tensor,
                   hc_mult: int, iters: int, hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, ...]:
            pre, post, comb = ops.hc_mixes(x, fn, scale, base, hc_mult, iters, hc_eps, norm_eps)
            return ops.rms_norm(ops.hc_collapse(x, pre), norm_w, norm_eps), post, comb

        ops.hc_pre = hc_pre

    def attn_qkv(x: torch.Tensor, wq_a: Any, q_norm_w: torch.Tensor, wq_b: Any, wkv: Any, kv_norm_w: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, n_heads: int, rd: int,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention's front (Attention._qkv before the KV numerics): x [T, dim] -> q [T, H, D] (low-rank q,
        per-head RMS, RoPE), kv [T, D] (normed, RoPE), qr [T, q_lora]; wq_a / wq_b / wkv are the Linear modules.
        A table's `attn_qkv_native` (the host's: one native call) takes it first where it can (None: it does
        not), outside traced graphs."""
        native = getattr(ops, "attn_qkv_native", None)
        if native is not None and not torch.compiler.is_compiling():
            out = native(x, wq_a, q_norm_w, wq_b, wkv, kv_norm_w, cos, sin, n_heads, rd, eps)
            if out is not None:
                return out
        t = x.shape[0]
        qr = ops.rms_norm(wq_a(x), q_norm_w, eps)  # [T, q_lora]
        q = ops.head_rms(wq_b(qr).view(t, n_heads, -1), eps)  # per-head unweighted RMS
        q = ops.rope_tail(q, cos.unsqueeze(1), sin.unsqueeze(1), rd)  # [T, H, D]
        kv = ops.rope_tail(ops.rms_norm(wkv(x), kv_norm_w, eps), cos, sin, rd)
        return q, kv, qr

    ops.attn_qkv = attn_qkv
    if not hasattr(ops, "rope_tail"):  # RoPE on the trailing dims: the reference's, unless the table has its own
        ops.rope_tail = reference.rope_tail
    if not hasattr(ops, "gate"):  # the MoE router: the reference's, unless the table has its own
        ops.gate = reference.gate
    if not hasattr(ops, "hc_head"):  # the head's stream collapse: the reference's, unless the table has its own
        ops.hc_head = reference.hc_head
    return ops


def _table(executor: str, numerics: str = "hf", kv_cache_dtype: str = "auto") -> types.SimpleNamespace:
    ops = make_ops(executor)
    aq_ops = getattr(ops.get("fp8_linear"), "__self__", None)  # KernelOps: its GEMMs take FP8 activations themselves
    aq = {n: getattr(aq_ops, f"{n}_aq") for n in ("fp8_linear", "fp4_linear")} if aq_ops is not None else None
    table = with_numerics(types.SimpleNamespace(**ops, kernels=executor, kernel_ops=aq_ops), numerics, kv_cache_dtype,
                          aq)
    return with_composites(table, fused_attn_tail=executor != "reference")


REFERENCE = _table("reference")


def _host_table(numerics: str = "hf", kv_cache_dtype: str = "auto") -> types.SimpleNamespace:
    """The reference ops with engine/host_kernels' native ops in place of the reference's, the numerics hooks and
    the composites over them, and `stack_linear` reading the chosen expert in place (after the activation
    quantisation of the official numerics); builds / loads the native library now, so a missing compiler fails
    here with one line, not at the first forward."""
    from engine import host_kernels

    host_kernels.ensure_loaded()
    ops = types.SimpleNamespace(**{**make_ops("reference"), **host_kernels.NATIVE_OPS, "kernels": "host"})
    ops = with_composites(with_numerics(ops, numerics, kv_cache_dtype), fused_attn_tail=False)
    native = host_kernels.stack_linear
    if ops.numerics == "official":
        ops.stack_linear = lambda x, stack, scales, i, fmt: native(ops.act_quant(x) if fmt else x, stack, scales, i,
                                                                   fmt)
    else:
        ops.stack_linear = native
    return ops


def ops_for(kernels: Any, numerics: Any = "hf", kv_cache_dtype: Any = "auto") -> types.SimpleNamespace:
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

    ops: types.SimpleNamespace = REFERENCE
    caps: Capabilities = HOST


def dequant(weight: torch.Tensor, scale: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """A stored FP8 / FP4 weight (bytes) dequantised: for kernels that take dense weights only."""
    from nki_kernels import formats

    if fmt == "fp8":
        return formats.dequant_fp8_block(weight.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu), dtype)
    return formats.dequant_fp4(weight.view(torch.int8), scale.view(torch.float8_e8m0fnu), dtype)
