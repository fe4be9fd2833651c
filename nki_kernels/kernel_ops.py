"""Kernel-backed ops: the engine's op table for `--kernels stand-in | nki`.

`make_ops(executor)` returns {name: callable} for every op of `KERNEL_OPS`. With executor "reference" the callables
ARE the functions of `nki_kernels.reference`; otherwise each one has exactly the reference's signature and return
contract (shapes, dtypes, `weight=None`, leading batch dims, empty inputs) and runs its family's NKI kernel through
`dispatch` on that executor ("stand-in" on the host, "neuron" on a device, "simulator", or "auto"). The ops the
engine calls that no kernel family covers are listed in `REFERENCE_ONLY`: the engine keeps calling the reference
for those in every mode.

Which kernel runs (dispatch key in `dispatch.counts()`):
    rms_norm            rmsnorm_kernel                      "rmsnorm"   (weight=None: a cached ones vector, exact)
    swiglu              swiglu_kernel on fp32 operands      "swiglu"    (the reference widens first and returns fp32)
    linear              grouped_out_proj_kernel, 1 group    "blockquant.dense"
    fp8_linear          fp8_gemm_kernel                     "blockquant.fp8"
    fp4_linear          fp4_gemm_kernel                     "blockquant.fp4"
    grouped_out_proj    grouped_out_proj_kernel             "blockquant.wo_a"
    hc_mixes / hc_collapse / hc_expand / hc_attn_out        their own names
    compress_pool       compress_pool_kernel, ONE call for all leading batch rows (below)   "compress_pool"
    index_score         index_score_kernel per batch row, top-k of 1 discarded              "index_score"
    sparse_attn         sparse_attn_kernel per batch row                                    "sparse_attn"
    sparse_attn_partial always the reference (see fallbacks)                                "sparse_attn.fallback"

Layout adapters that keep the reference's exact contract (not fallbacks: the kernel computes every value):
    * dtypes the kernel does not take are widened to fp32 first where the reference widens too (rms_norm,
      swiglu, hc_mixes, hc_collapse, hc_expand with y.dtype != residual.dtype, index_score / sparse_attn with
      q.dtype != keys.dtype), and the fp32 kernel result is cast once to the reference's output dtype (one
      rounding, as the reference);
    * compress_pool: HCA rows of all leading batch entries are one block list; CSA with batch B > 1 interleaves
      [prev_b | blocks_b] (a zero / -1e30 "absent" block where prev is None) so every block's predecessor is
      the right one, and drops the B extra outputs;
    * index_score: fewer than 8 keys are zero-padded to 8 (a zero key scores exactly 0) and cut off again.

Explicit fallbacks to the reference (`dispatch.fallback`: counted as "<family>.fallback", reason in
`dispatch.fallbacks()`; none of these happen in the tiny model's golden run except `empty`, and never silently):
    every op            "empty"         an empty tensor (T = 0, no keys, ...): the kernels allocate no 0-size tiles
    rms_norm            "D > 8192"      the SBUF plan of the kernel
    linear, fp8/fp4_linear, grouped_out_proj, hc_attn_out   "dtype"   x not fp32/bf16 (the reference computes
                                                            in x.dtype, which has no PE-array type here)
    hc_mixes            "M > 512" / "n > 8" / "iters < 1"   (one PSUM bank; mixing tiles; the kernel always does
                                                            the column normalisation, the reference not for 0)
    hc_collapse         "n > 16";  hc_expand, hc_attn_out: "n > 8"
    swiglu              "broadcast"     gate.shape != up.shape (the reference broadcasts)
    index_score         "Di > 128" / "N > 8192"
    sparse_attn         "H > 128" / "D > 512" / "N > 16384"
    sparse_attn_partial "partial"       the kernel returns the normalised output only (no max / sum-exp), so the
                                        context-parallel merge inputs cannot come from it

Torch first. Every op prepares its kernel operands as torch tensors: activations stay on their device and every
adapter above (widening, reshapes, transposes, padding, concatenation, the compress_pool interleave, the ones
vector of `weight=None`, index_score's visible-key counts) is a torch op on that device. Weight layout conversions
(transposes, dtype casts, fp32 scales, `blockquant.to_trn2_fp8`, expert stacks: nki_kernels/weight_layouts.py) are
made once per weight tensor: at load for the engine (`KernelOps.prepare`, engine/model/kernel_weights.py), else on
first use, cached (`WeightCache`: keyed on the tensor object, invalidated when its version counter, data pointer,
shape or dtype changes) and kept on the weight tensor, where a traced graph reads them as graph inputs; a traced
call never converts a weight (a missing layout raises). A weight already in the kernel's layout (an fp32 norm
weight) is used as is. `_run` makes non-contiguous operands contiguous with torch, on their device.

Every kernel launch goes through the kernel's torch op, `torch.ops.deepinfer.<kernel>` (nki_kernels/torch_ops.py),
so that the same call is one node of a compiled graph (`fullgraph=True`) and an eager call alike:
    * "stand-in" / "simulator" (CPU tensors): the op's CPU implementation is the torch <-> NumPy boundary: every
      tensor operand becomes a bit-exact, read-only NumPy array (`_convert.to_np` with copy=False: no copy of a
      contiguous CPU tensor, so a cached weight is not copied per call, and a kernel can never write into a weight
      or an activation), the kernel runs through `dispatch` (counted per execution, inside a graph too), the
      NumPy result comes back as torch;
    * "neuron" on a TorchNeuron device: the device op (`torch.ops.deepinfer_nki.<kernel>`, registered through
      `nki_op` only there) launches `wrap_nki(kernel)[(lnc,)]` (a custom call inside the NEFF);
    * "neuron" on another device (torch-xla's lazy tensors, the PyTorch/XLA lane): the torch tensors go unchanged
      to the real `nki.jit` callable (`Kernel.run`), whose PyTorch integration makes the kernel a custom call on
      the device tensors, with no host copy. Its torch result is used as is; operands on more than one device are
      refused, never moved.
The per-kernel wrappers of the kernel modules (`deepinfer kernels`, the trn2 check) keep passing NumPy arrays: a
standalone run, which is what those compare.

Output convention (checked here against the source, not on a device): every kernel allocates its outputs with
`nl.ndarray(..., buffer=nl.shared_hbm)` and returns them (rmsnorm, swiglu, the three blockquant GEMMs, hc_mixes'
three, hc_collapse, hc_expand, hc_attn_out, compress_pool, index_score's scores + indices, sparse_attn); the stand-in's
`run` refuses anything else. That is the convention under which `nki.jit` returns framework tensors when called with
torch tensors. Not verified (nothing here runs on a Neuron device or with torch-neuronx): that each kernel compiles
through the PyTorch integration with these operand dtypes (uint8 FP8 codes / FP4 nibbles, fp32 scales, bf16), that
index_score's uint32 index output is accepted there (it is discarded), that `kernel[lnc]` launches through it, and
how non-tensor arguments (ints, floats, bools: compile-time values) are specialised. `tests/kernels/
test_kernel_ops_neuron_route.py` proves the calling convention with a fake real `nki` on the host (and on `xla:0`
in the xla lane).

This module imports torch and the kernel modules (so the stand-in / `nki` resolution; no NumPy: the boundary is the
torch ops'); `nki_kernels` never imports `engine`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from nki_kernels import blockquant as _bq
from nki_kernels import compress_pool as _pool
from nki_kernels import dispatch, quant, reference, torch_ops
from nki_kernels import hc_attn_out as _hao
from nki_kernels import hc_collapse as _hcc
from nki_kernels import hc_expand as _hce
from nki_kernels import hc_mixes as _hcm
from nki_kernels import index_score as _idx
from nki_kernels import rmsnorm as _rms
from nki_kernels import sparse_attn as _sa
from nki_kernels import swiglu as _swi
from nki_kernels import weight_layouts as _wl

KERNEL_OPS = ("rms_norm", "swiglu", "linear", "fp8_linear", "fp4_linear", "grouped_out_proj", "hc_mixes",
              "hc_collapse", "hc_expand", "hc_attn_out", "compress_pool", "index_score", "sparse_attn",
              "sparse_attn_partial")
# reference ops the engine calls that no kernel family covers (the engine keeps the reference for these)
REFERENCE_ONLY = ("rope_inv_freq", "rope_cos_sin", "rope_apply", "hc_head", "index_topk", "sparse_attn_merge",
                  "gate_scores", "route")

_NATIVE = (torch.float32, torch.bfloat16)  # activation dtypes the kernels take
SPARSE_ATTN_MAX_N = 16384  # kvT / logits / probabilities rows per SBUF partition (see sparse_attn.py)


def make_ops(executor: str = "stand-in") -> dict[str, Callable[..., Any]]:
    """The op table: the reference functions themselves for "reference", else `KernelOps(executor).table()`."""
    if str(executor) == "reference":
        return {name: getattr(reference, name) for name in KERNEL_OPS}
    return KernelOps(executor).table()


# ---- the ops ---------------------------------------------------------------------------------------------------
class KernelOps:
    """The kernel-backed ops on one executor, with one weight cache. `table()` is the engine's op table."""

    def __init__(self, executor: str = "stand-in") -> None:
        executor = str(executor)
        if executor == "reference":
            raise ValueError("KernelOps runs kernels; use make_ops('reference') for the reference table")
        dispatch.resolve_executor(executor)  # fail early when the executor is unavailable here
        self.executor = executor
        self.cache = _wl.WeightCache()
        self._ones: dict[tuple[int, str], torch.Tensor] = {}
        torch_ops.registered()
        # kernel function name -> its torch op (resolved now: a traced call only looks it up)
        self._ops = {kname: getattr(getattr(torch.ops, torch_ops.NAMESPACE), op)
                     for op, (_, kname) in torch_ops.KERNELS.items()}

    def table(self) -> dict[str, Callable[..., Any]]:
        return {name: getattr(self, name) for name in KERNEL_OPS}

    def _run(self, name: str, kernel, args: tuple):
        """Launch kernel `name` on torch operands (plus compile-time scalars); returns torch. Through its torch op
        `torch.ops.deepinfer.<op>` (nki_kernels/torch_ops.py: one graph node when traced; on CPU tensors the op runs
        the kernel on the host executor, counted; on a TorchNeuron device the device op,
        `wrap_nki(kernel)[(lnc,)]`), except executor "neuron" on a device of another stack (torch-xla): there the
        real `nki.jit` is called with the torch tensors (its own PyTorch integration, a custom call in the lazy XLA
        graph)."""
        args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        device = tensors[0].device  # the activation (every kernel's first operand)
        ex = self.executor if self.executor != "auto" else dispatch.resolve(self.executor)
        if ex != "neuron":  # stand-in / simulator: the op's host implementation (NumPy in, NumPy out)
            return self._ops[kernel.__name__](name, ex, *args)
        others = {str(t.device) for t in tensors} - {str(device)}
        if others:
            raise ValueError(f"{name}: kernel operands on {str(device)} and {sorted(others)}; the weights must be on "
                             "the activations' device (nothing is copied between devices here)")
        if device.type == "neuron":  # TorchNeuron: the device op launches wrap_nki(kernel)[(lnc,)] (in a graph too)
            return torch_ops.device_op(torch_ops.op_of(kernel))(name, ex, *args)
        out = dispatch.dispatch(name, kernel, args, ex)[1]  # the PyTorch integration of the real nki.jit
        for o in out if isinstance(out, tuple) else (out,):
            if not isinstance(o, torch.Tensor):
                raise TypeError(f"{name}: nki.jit called with torch tensors returned {type(o).__name__}, not a "
                                "torch.Tensor")
        return out

    def _layout(self, kind: str, weight: torch.Tensor, *deps: torch.Tensor, dt: torch.dtype | None = None,
                groups: int | None = None) -> Any:
        """`weight` (with `deps`) converted to kernel layout `kind` (nki_kernels/weight_layouts.py). Eager: from the
        weight cache (converted on first use or when the weight changed) and kept on the weight for traced calls.
        Traced: the layout kept on the weight at load - a graph input, never a conversion inside the graph; a
        missing one raises. A weight already in the layout (an fp32 contiguous one for "fp32") is used as is."""
        if kind == "fp32" and weight.dtype == torch.float32 and weight.is_contiguous():
            return weight
        name = _wl.tag(kind, dt, groups)
        if torch.compiler.is_compiling():
            found = _wl.attached(weight, name)
            if found is None and kind in ("T", "stackT") and dt is not None:  # in the weight's dtype: a cast here
                other = _wl.attached(weight, _wl.tag(kind, weight.dtype))
                if other is not None:
                    return other.to(dt)
            if found is None:
                raise RuntimeError(f"kernel weight layout {name!r} of a {tuple(weight.shape)} {weight.dtype} weight "
                                   "was not prepared at load (KernelOps.prepare_*: engine/model/kernel_weights.py); "
                                   "a traced graph does not convert weights")
            return found
        value = self.cache.get(name, weight, lambda: _wl.make(kind, weight, *deps, dt=dt, groups=groups), *deps)
        _wl.attach(weight, name, value)
        return value

    def prepare(self, kind: str, weight: torch.Tensor, *deps: torch.Tensor, dt: torch.dtype | None = None,
                groups: int | None = None) -> Any:
        """Convert `weight` to kernel layout `kind` now (at load, before any graph is traced) and keep it on the
        weight: what engine/model/kernel_weights.py calls for every weight a kernel of this table reads."""
        if torch.compiler.is_compiling():
            raise RuntimeError("KernelOps.prepare runs at load, not inside a traced graph")
        return self._layout(kind, weight, *deps, dt=dt, groups=groups)

    def _ones_for(self, d: int, device: torch.device) -> torch.Tensor:
        if torch.compiler.is_compiling():  # a constant of the graph (not a weight)
            return torch.ones(d, dtype=torch.float32, device=device)
        key = (d, str(device))
        if key not in self._ones:
            self._ones[key] = torch.ones(d, dtype=torch.float32, device=device)
        return self._ones[key]

    # -- norms, activations --------------------------------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        d = x.shape[-1]
        if weight is not None and tuple(weight.shape) != (d,):
            raise ValueError(f"rms_norm: weight {tuple(weight.shape)} must be [{d}]")
        if x.numel() == 0:
            return dispatch.fallback(_rms.NAME, "empty", lambda: reference.rms_norm(x, weight, eps))
        if d > _rms.MAX_D:
            return dispatch.fallback(_rms.NAME, "D > 8192", lambda: reference.rms_norm(x, weight, eps))
        if weight is None:
            w = self._ones_for(d, x.device)
        else:
            w = self._layout("fp32", weight)
        xk = x if x.dtype in _NATIVE else x.float()  # the reference widens too; one rounding back below
        out = self._run(_rms.NAME, _rms.rmsnorm_kernel, (xk.reshape(-1, d), w, float(eps)))
        return out.reshape(x.shape).to(x.dtype)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
        if gate.shape != up.shape:
            return dispatch.fallback(_swi.NAME, "broadcast", lambda: reference.swiglu(gate, up, limit))
        if gate.numel() == 0:
            return dispatch.fallback(_swi.NAME, "empty", lambda: reference.swiglu(gate, up, limit))
        f = gate.shape[-1]
        # the reference widens both to fp32 and returns fp32: the kernel then runs in fp32 end to end
        g2, u2 = gate.float().reshape(-1, f), up.float().reshape(-1, f)
        out = self._run(_swi.NAME, _swi.swiglu_kernel, (g2, u2, float(limit)))
        return out.reshape(gate.shape)

    # -- projections ---------------------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
            raise ValueError(f"linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} [N, K] disagree")
        if x.numel() == 0 or weight.numel() == 0:
            return dispatch.fallback("blockquant.dense", "empty", lambda: reference.linear(x, weight))
        if x.dtype not in _NATIVE:
            return dispatch.fallback("blockquant.dense", "dtype", lambda: reference.linear(x, weight))
        dt = x.dtype
        wT = self._layout("T", weight, dt=dt)
        k, n = weight.shape[1], weight.shape[0]
        out = self._run("blockquant.dense", _bq.grouped_out_proj_kernel, (x.reshape(-1, k), wT, 1))
        return out.reshape(*x.shape[:-1], n)

    def fp8_linear(self, x: torch.Tensor, w_u8: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
        n, k = w_u8.shape
        if tuple(scale_u8.shape) != (math.ceil(n / 128), math.ceil(k / 128)) or x.shape[-1] != k:
            raise ValueError(f"fp8_linear: x {tuple(x.shape)}, w {tuple(w_u8.shape)}, scale "
                             f"{tuple(scale_u8.shape)} disagree")
        ref = lambda: reference.fp8_linear(x, w_u8, scale_u8)  # noqa: E731
        if x.numel() == 0:
            return dispatch.fallback("blockquant.fp8", "empty", ref)
        if x.dtype not in _NATIVE:
            return dispatch.fallback("blockquant.fp8", "dtype", ref)
        codes, sT = self._layout("trn2_fp8", w_u8, scale_u8)
        out = self._run("blockquant.fp8", _bq.fp8_gemm_kernel, (x.reshape(-1, k), codes, sT))
        return out.reshape(*x.shape[:-1], n)

    def fp4_linear(self, x: torch.Tensor, packed_u8: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
        n, k = packed_u8.shape[0], packed_u8.shape[1] * 2
        if k % 32 or tuple(scale_u8.shape) != (n, k // 32) or x.shape[-1] != k:
            raise ValueError(f"fp4_linear: x {tuple(x.shape)}, packed {tuple(packed_u8.shape)}, scale "
                             f"{tuple(scale_u8.shape)} disagree")
        ref = lambda: reference.fp4_linear(x, packed_u8, scale_u8)  # noqa: E731
        if x.numel() == 0:
            return dispatch.fallback("blockquant.fp4", "empty", ref)
        if x.dtype not in _NATIVE:
            return dispatch.fallback("blockquant.fp4", "dtype", ref)
        packed, s32 = self._layout("fp4", packed_u8, scale_u8)
        out = self._run("blockquant.fp4", _bq.fp4_gemm_kernel, (x.reshape(-1, k), packed, s32))
        return out.reshape(*x.shape[:-1], n)

    def fp8_linear_aq(self, a_codes: torch.Tensor, a_scale: torch.Tensor, w_u8: torch.Tensor, scale_u8: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
        """The official `linear()` of an FP8 weight: the activation already quantised per token (e4m3 bytes
        [..., K] + UE8M0 bytes [..., K/128], `quant.fp8_quant(x, 128)`) -> [..., N] in out_dtype."""
        return self.fp8_linear(quant.fp8_dequant(a_codes, a_scale, quant.ACT_BLOCK, out_dtype), w_u8, scale_u8)

    def fp4_linear_aq(self, a_codes: torch.Tensor, a_scale: torch.Tensor, packed_u8: torch.Tensor,
                      scale_u8: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """`fp8_linear_aq` for an FP4 expert weight."""
        return self.fp4_linear(quant.fp8_dequant(a_codes, a_scale, quant.ACT_BLOCK, out_dtype), packed_u8, scale_u8)

    def stack_linear(self, x: torch.Tensor, stack: torch.Tensor, scales: torch.Tensor | None, i: int | torch.Tensor,
                     fmt: str | None) -> torch.Tensor:
        """x @ stack[i]^T for local expert i of an expert stack [E, N, ...] (an int, or a 1-element index tensor
        gathered on the device), `fmt` None | "fp8" | "fp4" (`scales`: the stack of scale bytes): the GEMM kernel of
        `linear` / `fp8_linear` / `fp4_linear` on expert i's slice of the stack's layout, converted once for the
        whole stack (never per expert per call). The activation comes quantised already where the numerics say so
        (engine/model/ops.py `with_composites`)."""
        pick = (lambda t: t[i]) if isinstance(i, int) else (lambda t: t.index_select(0, i)[0])  # noqa: E731
        key = {None: "blockquant.dense", "fp8": "blockquant.fp8", "fp4": "blockquant.fp4"}[fmt]
        if x.numel() == 0 or x.dtype not in _NATIVE:
            ref = {None: lambda: reference.linear(x, pick(stack)),
                   "fp8": lambda: reference.fp8_linear(x, pick(stack), pick(scales)),
                   "fp4": lambda: reference.fp4_linear(x, pick(stack), pick(scales))}[fmt]
            return dispatch.fallback(key, "empty" if x.numel() == 0 else "dtype", ref)
        k, n = x.shape[-1], stack.shape[1]
        if fmt is None:
            args = (x.reshape(-1, k), pick(self._layout("stackT", stack, dt=x.dtype)), 1)
            out = self._run(key, _bq.grouped_out_proj_kernel, args)
        else:
            a, b = (pick(t) for t in self._layout(f"stack_{fmt}", stack, scales))
            out = self._run(key, _bq.fp8_gemm_kernel if fmt == "fp8" else _bq.fp4_gemm_kernel, (x.reshape(-1, k), a, b))
        return out.reshape(*x.shape[:-1], n)

    def grouped_out_proj(self, o: torch.Tensor, wo_a: torch.Tensor, groups: int) -> torch.Tensor:
        t, hd = o.shape
        if hd % groups or wo_a.shape[1] != hd // groups or wo_a.shape[0] % groups:
            raise ValueError(f"grouped_out_proj: o {tuple(o.shape)}, wo_a {tuple(wo_a.shape)}, groups {groups} "
                             "disagree")
        ref = lambda: reference.grouped_out_proj(o, wo_a, groups)  # noqa: E731
        if o.numel() == 0:
            return dispatch.fallback("blockquant.wo_a", "empty", ref)
        if o.dtype not in _NATIVE:
            return dispatch.fallback("blockquant.wo_a", "dtype", ref)
        woaT = self._layout("woaT", wo_a, dt=o.dtype, groups=int(groups))
        return self._run("blockquant.wo_a", _bq.grouped_out_proj_kernel, (o, woaT, int(groups)))

    # -- mHC -----------------------------------------------------------------------------------------------------
    def hc_mixes(self, x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_mult: int,
                 iters: int, hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = hc_mult
        m = (2 + n) * n
        if x.dim() != 3 or x.shape[1] != n or tuple(fn.shape) != (m, n * x.shape[2]):
            raise ValueError(f"hc_mixes: x {tuple(x.shape)} [T, {n}, D] and fn {tuple(fn.shape)} [{m}, nD] disagree")
        ref = lambda: reference.hc_mixes(x, fn, scale, base, hc_mult, iters, hc_eps, norm_eps)  # noqa: E731
        for bad, why in ((x.numel() == 0, "empty"), (m > 512, "M > 512"), (n > 8, "n > 8"),
                         (iters < 1, "iters < 1")):
            if bad:
                return dispatch.fallback(_hcm.NAME, why, ref)
        fnT, sc, bs = self._layout("fnT", fn), self._layout("fp32", scale), self._layout("fp32", base)
        xk = x if x.dtype in _NATIVE else x.float()
        args = (xk.reshape(x.shape[0], -1), fnT, sc, bs, int(n), int(iters), float(hc_eps), float(norm_eps))
        return tuple(self._run(_hcm.NAME, _hcm.hc_mixes_kernel, args))

    def hc_collapse(self, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or tuple(pre.shape) != tuple(x.shape[:2]):
            raise ValueError(f"hc_collapse: x {tuple(x.shape)} must be [T, n, D] and pre {tuple(pre.shape)} [T, n]")
        ref = lambda: reference.hc_collapse(x, pre)  # noqa: E731
        if x.numel() == 0:
            return dispatch.fallback(_hcc.NAME, "empty", ref)
        if x.shape[1] > 16:
            return dispatch.fallback(_hcc.NAME, "n > 16", ref)
        xk = x if x.dtype in _NATIVE else x.float()
        return self._run(_hcc.NAME, _hcc.hc_collapse_kernel, (xk, pre.float())).to(x.dtype)

    def hc_expand(self, y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                  comb: torch.Tensor) -> torch.Tensor:
        if residual.dim() != 3:
            raise ValueError(f"hc_expand: residual {tuple(residual.shape)} must be [T, n, D]")
        t, n, d = residual.shape
        if tuple(y.shape) != (t, d) or tuple(post.shape) != (t, n) or tuple(comb.shape) != (t, n, n):
            raise ValueError(f"hc_expand: y {tuple(y.shape)} [T,D], residual {tuple(residual.shape)} [T,n,D], "
                             f"post {tuple(post.shape)} [T,n], comb {tuple(comb.shape)} [T,n,n] disagree")
        ref = lambda: reference.hc_expand(y, residual, post, comb)  # noqa: E731
        if residual.numel() == 0:
            return dispatch.fallback(_hce.NAME, "empty", ref)
        if n > 8:
            return dispatch.fallback(_hce.NAME, "n > 8", ref)
        if y.dtype == residual.dtype and y.dtype in _NATIVE:
            yk, rk = y, residual
        else:  # the reference widens both; the kernel then rounds once to fp32 and the cast below once more
            yk, rk = y.float(), residual.float()
        return self._run(_hce.NAME, _hce.hc_expand_kernel, (yk, rk, post.float(), comb.float())).to(y.dtype)

    def hc_attn_out(self, o: torch.Tensor, wo_b: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                    comb: torch.Tensor) -> torch.Tensor:
        t, n, d = residual.shape
        if o.dim() != 2 or tuple(wo_b.shape) != (d, o.shape[1]) or o.shape[0] != t or \
                tuple(post.shape) != (t, n) or tuple(comb.shape) != (t, n, n):
            raise ValueError(f"hc_attn_out: o {tuple(o.shape)} [T,K], wo_b {tuple(wo_b.shape)} [D,K], residual "
                             f"{tuple(residual.shape)} [T,n,D], post {tuple(post.shape)}, comb {tuple(comb.shape)}")
        ref = lambda: reference.hc_attn_out(o, wo_b, residual, post, comb)  # noqa: E731
        for bad, why in ((residual.numel() == 0 or o.numel() == 0, "empty"), (o.dtype not in _NATIVE, "dtype"),
                         (n > 8, "n > 8")):
            if bad:
                return dispatch.fallback(_hao.NAME, why, ref)
        dt = o.dtype
        wT = self._layout("T", wo_b, dt=dt)
        rk = residual if residual.dtype in _NATIVE else residual.float()  # loaded into fp32 tiles either way
        return self._run(_hao.NAME, _hao.hc_attn_out_kernel, (o, wT, rk, post.float(), comb.float()))

    # -- compressor, indexer, attention --------------------------------------------------------------------------
    def compress_pool(self, kv: torch.Tensor, score: torch.Tensor, overlap: bool, prev_kv: torch.Tensor | None = None,
                      prev_score: torch.Tensor | None = None) -> torch.Tensor:
        if kv.shape != score.shape or kv.dim() < 3:
            raise ValueError(f"compress_pool: kv {tuple(kv.shape)} and score {tuple(score.shape)} must be "
                             "[..., W, m, C]")
        if overlap and kv.shape[-1] % 2:
            raise ValueError("compress_pool: CSA needs an even channel count C = 2d")
        if (prev_kv is None) != (prev_score is None):
            raise ValueError("compress_pool: prev_kv and prev_score go together")
        if kv.numel() == 0:
            return dispatch.fallback(_pool.NAME, "empty", lambda: reference.compress_pool(
                kv, score, overlap, prev_kv, prev_score))
        *lead, w, m, c = kv.shape
        b = math.prod(lead)
        kv4, sc4 = kv.float().reshape(b, w, m, c), score.float().reshape(b, w, m, c)
        absent_kv, absent_sc = kv4.new_zeros(m, c), kv4.new_full((m, c), _pool.NEG)  # on the activations' device
        use_prev = overlap and prev_kv is not None
        if not overlap or b == 1:
            blocks_kv, blocks_sc = kv4.reshape(b * w, m, c), sc4.reshape(b * w, m, c)
            pk = prev_kv.float().reshape(b, m, c)[0] if use_prev else absent_kv
            ps = prev_score.float().reshape(b, m, c)[0] if use_prev else absent_sc
            keep = None
        else:  # [prev_b | blocks_b] per batch row: block j of row b pools the first half of its own predecessor
            pk = prev_kv.float().reshape(b, 1, m, c) if use_prev else absent_kv.expand(b, 1, m, c)
            ps = prev_score.float().reshape(b, 1, m, c) if use_prev else absent_sc.expand(b, 1, m, c)
            blocks_kv = torch.cat([pk, kv4], 1).reshape(b * (w + 1), m, c)
            blocks_sc = torch.cat([ps, sc4], 1).reshape(b * (w + 1), m, c)
            pk, ps, keep = absent_kv, absent_sc, w + 1
        nb = blocks_kv.shape[0]
        args = (blocks_kv.reshape(nb * m, c).t(), blocks_sc.reshape(nb * m, c).t(), pk.t(), ps.t(), int(m),
                bool(overlap))  # [C, nb*m] layouts (made contiguous on the device by _run)
        out = self._run(_pool.NAME, _pool.compress_pool_kernel, args).t()  # [nb, d]
        if keep is not None:
            out = out.reshape(b, keep, -1)[:, 1:]
        return out.reshape(*lead, w, -1).contiguous()

    def index_score(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        b, t, hi, di = q.shape
        n = keys.shape[1]
        if tuple(keys.shape) != (b, n, di) or tuple(weights.shape) != (b, t, hi):
            raise ValueError(f"index_score: q {tuple(q.shape)}, keys {tuple(keys.shape)}, weights "
                             f"{tuple(weights.shape)} disagree")
        ref = lambda: reference.index_score(q, keys, weights)  # noqa: E731
        for bad, why in ((q.numel() == 0 or n == 0, "empty"), (di > 128, "Di > 128"), (n > 8192, "N > 8192")):
            if bad:
                return dispatch.fallback(_idx.NAME, why, ref)
        if q.dtype == keys.dtype and q.dtype in _NATIVE:
            qk, kk = q, keys
        else:  # the reference scores in fp32
            qk, kk = q.float(), keys.float()
        npad = max(n, 8)  # max8 needs >= 8 entries: zero keys score exactly 0 and are cut off below
        if npad != n:
            kk = torch.cat([kk, kk.new_zeros(b, npad - n, di)], 1)
        nvis = torch.full((t, 1), float(npad), dtype=torch.float32, device=q.device)
        wk = weights.float()
        out = []
        for bi in range(b):
            args = (qk[bi].reshape(t, hi * di), kk[bi].t(), wk[bi], nvis, int(hi), 1)
            s, _ = self._run(_idx.NAME, _idx.index_score_kernel, args)
            out.append(s[:, :n])
        return torch.stack(out)

    def sparse_attn(self, q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                    scale: float) -> torch.Tensor:
        b, t, h, d = q.shape
        n = kv.shape[1]
        if tuple(kv.shape) != (b, n, d) or tuple(valid.shape) != (b, t, n) or tuple(sink.shape) != (h,):
            raise ValueError(f"sparse_attn: q {tuple(q.shape)}, kv {tuple(kv.shape)}, valid {tuple(valid.shape)}, "
                             f"sink {tuple(sink.shape)} disagree")
        ref = lambda: reference.sparse_attn(q, kv, valid, sink, scale)  # noqa: E731
        for bad, why in ((q.numel() == 0 or n == 0, "empty"), (h > 128, "H > 128"), (d > 512, "D > 512"),
                         (n > SPARSE_ATTN_MAX_N, "N > 16384")):
            if bad:
                return dispatch.fallback(_sa.NAME, why, ref)
        if q.dtype == kv.dtype and q.dtype in _NATIVE:
            qk, kvk = q, kv
        else:  # the reference computes in fp32 from both
            qk, kvk = q.float(), kv.float()
        sink_t = self._layout("sink", sink)
        bias = torch.where(valid, 0.0, _sa.MASKED).float()
        out = []
        for bi in range(b):
            out.append(self._run(_sa.NAME, _sa.sparse_attn_kernel, (qk[bi], kvk[bi], bias[bi], sink_t, float(scale))))
        return torch.stack(out).to(q.dtype)

    def sparse_attn_partial(self, q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return dispatch.fallback(_sa.NAME, "partial", lambda: reference.sparse_attn_partial(q, kv, valid, scale))
