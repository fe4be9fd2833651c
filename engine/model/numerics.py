"""The numerics table: the op-table entries where `--numerics official` and `--kv-cache-dtype fp8` change the
model's numbers (engine/model/ops.py builds every op table through `with_numerics`).

The model calls these hooks at the points DeepSeek's official `inference/model.py` applies a simulation step or
rounds to its compute dtype (golden/README.md, "Where the official forward applies each step"); with hf numerics
and an auto cache each hook is the identity or the op the model called before, so that path is unchanged bit for
bit. The functions are nki_kernels/quant.py's (device-safe: no float8 dtype, no host sync), so the same table runs
on every backend, kernel table and in the static decode graphs.

Hooks (model call site): hf / hf with the fp8 cache / official.
* `fp8_linear`, `fp4_linear` (every GEMM of a stored FP8 / FP4 weight): the table's / the table's / per-token FP8
  activation quantisation (128-blocks, UE8M0 scales) then the GEMM - the official `linear()`; the kernel tables'
  blockquant GEMMs take the quantised activation's bytes and scales (`aq_kernels`);
* `act_quant(o)` (the fused attention tail's wo_b input): identity / identity / the same quantisation;
* `head_rms(q, eps)` (per-head query norm): `rms_norm(q, None)` / same / `q * rsqrt(mean(q^2) + eps)` in q's dtype;
* `kv_quant(kv, rd)` (window KV after RoPE, every compressed entry): identity / FP8 64-blocks / FP8 64-blocks;
* `index_query_quant(q)` (indexer queries after RoPE): identity / identity / Hadamard + FP4 32-blocks;
* `index_key_quant(k)` (every indexer key): identity / FP8 128-blocks / Hadamard + FP4 32-blocks;
* `index_weights(w, c)` (weights_proj output times its constant): `w.float() * c` / same / rounded to w's dtype;
* `entry_in(pooled, dtype)` (a pooled entry before its norm): identity / identity / cast to the compute dtype;
* `index_score`: the table's / the table's / bf16: every official rounding (`quant.index_score_rounded`), fp32:
  the table's;
* `sparse_attn`, `sparse_attn_partial`: the table's / the table's / bf16: probabilities rounded before P @ V, fp32:
  the table's.

**Exact accumulation (official numerics, bf16).** In bf16 every op output is rounded and the official numerics are
discontinuous (an e4m3 / e2m1 rounding boundary, a block amax crossing a power of two, a top-k boundary), so the
fp32 summation order of a GEMM or of attention - which depends on the batch (how many tokens share a GEMM, how many
padded keys a batch of sequences carries) - flips some bf16 roundings, and a flip can move the tiny model's logits
by ~3. The bf16 official hooks therefore sum exactly (float64: the products of FP8 / bf16 values and their sums
are exact) and round once: the stored-weight GEMMs of the host tables (`quant.act_linear_exact`), the bf16-weight
ones (`linear_exact`: weights_proj; `grouped_out_proj_exact`: wo_a), the index scores (`index_score_exact`), the
per-head query norm (`head_rms`, its rsqrt rounded once as a GPU rounds it) and attention (`sparse_attn_exact`).
These give the same numbers whatever the batch, up to fp32 noise (tests/test_numerics.py: a prompt alone and among
others; the fp32 norms, mHC and head still sum in torch's batch-dependent order). What that costs against the bf16
golden is measured in deepinfer_bench/bench/golden.py OFFICIAL_TOL. The stand-in / nki tables keep their blockquant
kernels (fp32 PSUM accumulation, FP8 activations: `aq_kernels`); fp32 keeps fp32 sums (the staging golden is
fp32-accumulated).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from engine.config import ACT_BLOCK, INDEX_FP8_BLOCK, KVCacheDType, Numerics
from nki_kernels import quant

__all__ = ["index_key_format", "with_numerics"]


def _identity(x: torch.Tensor, *_: Any) -> torch.Tensor:
    return x


def act_quant(x: torch.Tensor) -> torch.Tensor:
    """The official per-token activation quantisation before an FP8 / FP4 GEMM, as values in x.dtype (exact)."""
    return quant.fp8_qdq(x, ACT_BLOCK)


def index_key_format(numerics: Numerics | str) -> str:
    """How an fp8 cache stores indexer keys under `numerics`: "fp4" (official: its keys are FP4 values) or "fp8"."""
    return "fp4" if str(numerics) == Numerics.OFFICIAL.value else "fp8"


def _by_dtype(fp32: Callable[..., Any], other: Callable[..., Any]) -> Callable[..., Any]:
    """`fp32(q, ...)` when the first argument is fp32, else `other(q, ...)`."""
    return lambda q, *a: fp32(q, *a) if q.dtype == torch.float32 else other(q, *a)


def with_numerics(ops: dict[str, Any], numerics: Numerics | str = Numerics.HF,
                  kv_cache_dtype: KVCacheDType | str = KVCacheDType.AUTO,
                  aq_kernels: dict[str, Callable[..., Any]] | None = None) -> dict[str, Any]:
    """A copy of the ops `ops` (by name) with the numerics hooks (module docstring) for `numerics` and
    `kv_cache_dtype`.
    `aq_kernels`: GEMMs that take the quantised activation themselves ({"fp8_linear": f(codes, scales, w, s,
    out_dtype), ...}: the NKI blockquant kernels with FP8 activations); the others quantise in torch first."""
    base = types.SimpleNamespace(**ops)
    t = types.SimpleNamespace(**ops)
    official = str(Numerics.parse(numerics, "numerics")) == Numerics.OFFICIAL.value
    fp8 = str(KVCacheDType.parse(kv_cache_dtype, "kv_cache_dtype")) == KVCacheDType.FP8.value
    t.numerics = "official" if official else "hf"
    t.kv_quant = (lambda kv, rd: quant.kv_fp8_qdq(kv, rd)) if official or fp8 else _identity
    t.index_query_quant = quant.indexer_fp4_qdq if official else _identity
    if official:
        t.index_key_quant = quant.indexer_fp4_qdq
    else:
        t.index_key_quant = (lambda k: quant.fp8_qdq(k, INDEX_FP8_BLOCK)) if fp8 else _identity
    if not official:
        t.act_quant = _identity
        t.head_rms = lambda q, eps: base.rms_norm(q, None, eps)
        t.index_weights = lambda w, c: w.float() * c
        t.entry_in = _identity
        return vars(t)
    t.act_quant = act_quant
    for name in ("fp8_linear", "fp4_linear"):
        kernel = (aq_kernels or {}).get(name)
        if kernel is not None:
            setattr(t, name, lambda x, w, s, k=kernel: k(*quant.fp8_quant(x, ACT_BLOCK), w, s, x.dtype))
        else:  # fp32: the table's GEMM on the quantised activation; bf16: summed exactly (module docstring)
            setattr(t, name, _by_dtype(lambda x, w, s, f=getattr(base, name): f(act_quant(x), w, s),
                                       lambda x, w, s, fmt=name[:3]: quant.act_linear_exact(x, w, s, fmt)))
    t.head_rms = quant.head_rms
    t.index_weights = quant.indexer_weights_rounded
    t.entry_in = lambda pooled, dtype: pooled.to(dtype)
    t.index_score = _by_dtype(base.index_score, quant.index_score_exact)
    t.linear = _by_dtype(base.linear, quant.linear_exact)
    t.grouped_out_proj = _by_dtype(base.grouped_out_proj, quant.grouped_out_proj_exact)
    t.sparse_attn = _by_dtype(base.sparse_attn, quant.sparse_attn_exact)
    t.sparse_attn_partial = _by_dtype(base.sparse_attn_partial, quant.sparse_attn_partial_exact)
    return vars(t)
