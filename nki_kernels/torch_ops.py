"""The NKI kernels as torch custom ops: one op per kernel, `torch.ops.deepinfer.<name>`, registered once per process.

Each op takes the kernel's own operands (kernel layouts: kernel_ops.py prepares them) plus two leading strings, the
dispatch key the call is counted under and the executor, and returns the kernel's outputs. It has a fake (meta)
implementation stating the output shapes and dtypes - the shapes of the torch reference's results in the kernel's
layout (checked against the kernels on the NumPy stand-in by tests/kernels/test_torch_ops.py) - so Dynamo traces a
call as one graph node, `fullgraph=True`, without running it. Implementations:

* CPU tensors (executors stand-in, simulator, or a standalone "neuron" run): the kernel on NumPy through
  `dispatch.dispatch` (counted per execution, also inside a compiled graph); the one torch <-> NumPy boundary of
  the op path;
* tensors on a Neuron device (TorchNeuron): the device ops `torch.ops.deepinfer_nki.<name>`, registered only there
  (`device_op`) through `torch_neuronx.nki_op`, whose body launches TorchNeuron's higher-order op: one
  `wrap_nki(kernel)` per kernel, built once (the SDK re-traces and re-registers the kernel on every `wrap_nki` call:
  torch_neuronx/nki_hop.py), launched as `[(lnc,)]` - the April 2026 tree does `tuple(map(int, grid))`, so an int
  subscript raises there, and later builds accept the tuple too - with the LNC of the active Dispatcher, which must
  equal NEURON_LOGICAL_NC_CONFIG (NKI 0.7 reads the LNC from it). `nki_op` makes that body the op's fake and traces
  it into the graph, so it is never registered for host or stand-in graphs (their body runs NumPy). Launches inside
  a compiled graph are traced once, so they are counted only when they run eagerly.

Registration: the host ops through `torch.library.custom_op` + `register_fake`, always; the device ops through
`nki_op` on a TorchNeuron process (torch_neuronx with `nki_op` / `wrap_nki` loaded and the real `nki`). The schema
comes from the typed functions below. Written, not run on the SDK: the device registration and launch (no Neuron SDK
here; tests/fake_torchneuron.py holds them to the SDK's rules). The model's kernel table (kernel_ops.py
`KernelOps._run`) launches every kernel through these ops; the TorchNeuron CPU stand-in cuts a graph at them and
runs each op between its compiled pieces (engine/backends/standin_split.py).

This module imports torch and the kernel modules; never `engine`, and torch_neuronx only when it is loaded already
(TorchNeuron autoloads with torch on a Neuron host).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from nki_kernels import _convert, _nki, dispatch

NAMESPACE = "deepinfer"

# op name -> (kernel module, kernel function name)
KERNELS: dict[str, tuple[str, str]] = {
    "rmsnorm": ("nki_kernels.rmsnorm", "rmsnorm_kernel"),
    "swiglu": ("nki_kernels.swiglu", "swiglu_kernel"),
    "grouped_out_proj": ("nki_kernels.blockquant", "grouped_out_proj_kernel"),
    "fp8_gemm": ("nki_kernels.blockquant", "fp8_gemm_kernel"),
    "fp4_gemm": ("nki_kernels.blockquant", "fp4_gemm_kernel"),
    "hc_mixes": ("nki_kernels.hc_mixes", "hc_mixes_kernel"),
    "hc_collapse": ("nki_kernels.hc_collapse", "hc_collapse_kernel"),
    "hc_expand": ("nki_kernels.hc_expand", "hc_expand_kernel"),
    "hc_attn_out": ("nki_kernels.hc_attn_out", "hc_attn_out_kernel"),
    "compress_pool": ("nki_kernels.compress_pool", "compress_pool_kernel"),
    "index_score": ("nki_kernels.index_score", "index_score_kernel"),
    "sparse_attn": ("nki_kernels.sparse_attn", "sparse_attn_kernel"),
}


def kernel_of(op: str) -> _nki.Kernel:
    module, name = KERNELS[op]
    return getattr(importlib.import_module(module), name)


def op_of(kernel: _nki.Kernel) -> str:
    """The op name of a kernel handle."""
    for op, (_, name) in KERNELS.items():
        if name == kernel.__name__:
            return op
    raise KeyError(f"{kernel.__name__} is not registered as a torch op (nki_kernels/torch_ops.py KERNELS)")


# ---- what every op does --------------------------------------------------------------------------------------------
def _launch(op: str, key: str, executor: str, args: tuple) -> Any:
    """The host op: the kernel on NumPy through `dispatch.dispatch` (CPU tensors only)."""
    kernel = kernel_of(op)
    first = next(a for a in args if isinstance(a, Tensor))
    if first.device.type != "cpu":
        raise RuntimeError(f"{op}: operands on {first.device}: the host op runs CPU tensors; a Neuron device launches "
                           f"torch.ops.{DEVICE_NAMESPACE}.{op} (KernelOps picks it by the operands' device)")
    host = tuple(_convert.to_np(a, copy=False) if isinstance(a, Tensor) else a for a in args)
    out = dispatch.dispatch(key, kernel, host, executor)[1]
    return tuple(_convert.from_np(o) for o in out) if isinstance(out, tuple) else _convert.from_np(out)


_WRAPPED: dict[str, Any] = {}  # op -> wrap_nki(kernel): built once per kernel (wrap_nki re-registers on each call)


def wrapped(op: str) -> Any:
    """TorchNeuron's `wrap_nki(kernel)` of op `op`, built on first use."""
    w = _WRAPPED.get(op)
    if w is None:
        tnx = torchneuron()
        if tnx is None:
            raise RuntimeError(f"{op}: a device launch needs TorchNeuron (torch_neuronx with wrap_nki) loaded in this "
                               "process")
        w = _WRAPPED[op] = tnx.wrap_nki(kernel_of(op).jitted())
    return w


def _traced(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return torch.compiler.is_compiling() or isinstance(t, FakeTensor | FunctionalTensor)


def _device_launch(op: str, key: str, executor: str, args: tuple) -> Any:
    """The device op's body (traced into the graph by nki_op): `wrap_nki(kernel)[(lnc,)](*args)`."""
    current = dispatch.current()
    if not _traced(next(a for a in args if isinstance(a, Tensor))):
        current.count(key, "neuron")
    return wrapped(op)[(current.lnc,)](*args)


def torchneuron() -> Any:
    """torch_neuronx when it is loaded and is TorchNeuron (has nki_op and wrap_nki), else None."""
    mod = sys.modules.get("torch_neuronx")
    return mod if mod is not None and hasattr(mod, "nki_op") and hasattr(mod, "wrap_nki") else None


# ---- the typed signatures (the ops' schemas) and their fakes ------------------------------------------------------
def rmsnorm(key: str, executor: str, x: Tensor, w: Tensor, eps: float) -> Tensor:
    return _launch("rmsnorm", key, executor, (x, w, eps))


def swiglu(key: str, executor: str, gate: Tensor, up: Tensor, limit: float) -> Tensor:
    return _launch("swiglu", key, executor, (gate, up, limit))


def grouped_out_proj(key: str, executor: str, o: Tensor, woaT: Tensor, groups: int) -> Tensor:
    return _launch("grouped_out_proj", key, executor, (o, woaT, groups))


def fp8_gemm(key: str, executor: str, x: Tensor, w8T: Tensor, sT: Tensor) -> Tensor:
    return _launch("fp8_gemm", key, executor, (x, w8T, sT))


def fp4_gemm(key: str, executor: str, x: Tensor, packed: Tensor, s32: Tensor) -> Tensor:
    return _launch("fp4_gemm", key, executor, (x, packed, s32))


def hc_mixes(key: str, executor: str, x: Tensor, fnT: Tensor, scale: Tensor, base: Tensor, hc_mult: int, iters: int,
             hc_eps: float, norm_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return _launch("hc_mixes", key, executor, (x, fnT, scale, base, hc_mult, iters, hc_eps, norm_eps))


def hc_collapse(key: str, executor: str, x: Tensor, pre: Tensor) -> Tensor:
    return _launch("hc_collapse", key, executor, (x, pre))


def hc_expand(key: str, executor: str, y: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    return _launch("hc_expand", key, executor, (y, residual, post, comb))


def hc_attn_out(key: str, executor: str, o: Tensor, wo_bT: Tensor, residual: Tensor, post: Tensor,
                comb: Tensor) -> Tensor:
    return _launch("hc_attn_out", key, executor, (o, wo_bT, residual, post, comb))


def compress_pool(key: str, executor: str, kvT: Tensor, scT: Tensor, prev_kvT: Tensor, prev_scT: Tensor, m: int,
                  overlap: bool) -> Tensor:
    return _launch("compress_pool", key, executor, (kvT, scT, prev_kvT, prev_scT, m, overlap))


def index_score(key: str, executor: str, q: Tensor, kT: Tensor, w: Tensor, nvis: Tensor, num_heads: int,
                topk: int) -> tuple[Tensor, Tensor]:
    return _launch("index_score", key, executor, (q, kT, w, nvis, num_heads, topk))


def sparse_attn(key: str, executor: str, q: Tensor, kv: Tensor, bias: Tensor, sink: Tensor, scale: float) -> Tensor:
    return _launch("sparse_attn", key, executor, (q, kv, bias, sink, scale))


# Fakes: the outputs' shapes and dtypes from the operands' (the kernels allocate exactly these in nl.shared_hbm)
FAKES: dict[str, Callable[..., Any]] = {
    "rmsnorm": lambda k, e, x, w, eps: x.new_empty(x.shape),
    "swiglu": lambda k, e, gate, up, limit: gate.new_empty(gate.shape),
    "grouped_out_proj": lambda k, e, o, woaT, groups: o.new_empty(o.shape[0], groups * woaT.shape[1]),
    "fp8_gemm": lambda k, e, x, w8T, sT: x.new_empty(x.shape[0], w8T.shape[1]),
    "fp4_gemm": lambda k, e, x, packed, s32: x.new_empty(x.shape[0], packed.shape[0]),
    "hc_mixes": lambda k, e, x, fnT, scale, base, n, iters, he, ne: (
        x.new_empty(x.shape[0], n, dtype=torch.float32), x.new_empty(x.shape[0], n, dtype=torch.float32),
        x.new_empty(x.shape[0], n, n, dtype=torch.float32)),
    "hc_collapse": lambda k, e, x, pre: x.new_empty(x.shape[0], x.shape[2]),
    "hc_expand": lambda k, e, y, residual, post, comb: y.new_empty(residual.shape),
    "hc_attn_out": lambda k, e, o, wo_bT, residual, post, comb: o.new_empty(residual.shape),
    "compress_pool": lambda k, e, kvT, scT, pk, ps, m, overlap: kvT.new_empty(
        kvT.shape[0] // 2 if overlap else kvT.shape[0], kvT.shape[1] // m, dtype=torch.float32),
    "index_score": lambda k, e, q, kT, w, nvis, heads, topk: (
        q.new_empty(q.shape[0], kT.shape[1], dtype=torch.float32), q.new_empty(q.shape[0], topk, dtype=torch.uint32)),
    "sparse_attn": lambda k, e, q, kv, bias, sink, scale: q.new_empty(q.shape),
}
SIGNATURES: dict[str, Callable[..., Any]] = {name: globals()[name] for name in KERNELS}


# ---- registration ---------------------------------------------------------------------------------------------------
DEVICE_NAMESPACE = "deepinfer_nki"


@functools.cache
def registered() -> str:
    """Register every host op (once per process, torch.library); returns "torch.library"."""
    for name, fn in SIGNATURES.items():
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", fn, mutates_args=())
        op.register_fake(FAKES[name])
    return "torch.library"


def _device_body(name: str) -> Callable[..., Any]:
    """The device op's function: `_device_launch` under the schema of SIGNATURES[name]."""

    def body(key: str, executor: str, *args: Any) -> Any:
        return _device_launch(name, key, executor, args)

    body.__signature__ = inspect.signature(SIGNATURES[name])  # type: ignore[attr-defined]
    body.__name__ = body.__qualname__ = name
    body.__annotations__ = dict(SIGNATURES[name].__annotations__)
    return body


@functools.cache
def device_registered() -> str:
    """Register every device op through `torch_neuronx.nki_op` (once per process; only on the device path)."""
    tnx = torchneuron()
    if tnx is None or _nki.real_nki() is None:
        raise RuntimeError("the NKI device ops need TorchNeuron (torch_neuronx with nki_op / wrap_nki) and the real "
                           "`nki` loaded in this process")
    for name in SIGNATURES:
        tnx.nki_op(f"{DEVICE_NAMESPACE}::{name}", mutates_args={})(_device_body(name))
    return "torchneuron"


def device_op(op: str) -> Any:
    """`torch.ops.deepinfer_nki.<op>`, registered on first eager use. Inside a trace it must exist already (the
    neuron backend registers the ops when it is made): Dynamo traces through functools.cache into the registration,
    which imports modules, and that is not traceable."""
    if not torch.compiler.is_compiling():
        device_registered()
    return getattr(getattr(torch.ops, DEVICE_NAMESPACE), op)


def call(kernel: _nki.Kernel, key: str, executor: str, args: tuple) -> Any:
    """Launch `kernel` through its op: `torch.ops.deepinfer.<op>(key, executor, *args)`."""
    registered()
    return getattr(getattr(torch.ops, NAMESPACE), op_of(kernel))(key, executor, *args)
