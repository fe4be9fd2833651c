"""A fake TorchNeuron (torch_neuronx 2.13, Neuron SDK 2.33+) that enforces the SDK's own rules, for tests that cannot
install the SDK. Each rule names the file of the open-source torch-neuronx tree (April 2026, `parmoham-aws/
test-repo-parmoham`) or of the community V4 port (`longdct/vllm-neuron`) it comes from. What the fake proves is that
the engine calls TorchNeuron the way those sources require, not anything of neuronx-cc or a trn2.

`install(monkeypatch, device=...)` puts it in place: `torch_neuronx` (with `nki_hop`), `torch.neuron`, the "neuron"
Dynamo backend, the "neuron" process group and /dev/neuron*; it returns the `FakeSDK` that records what happened.
"""

from __future__ import annotations

import glob
import inspect
import os
import sys
import types
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


class RuleBroken(RuntimeError):
    """The engine called TorchNeuron in a way the SDK refuses."""


@dataclass
class Metric:
    """One compiled graph, as torch_neuronx.get_dynamo_metrics() lists it (neuron_dynamo_backend/metrics.py)."""

    graph_id: str
    graph_name: str
    model_name: str
    torch_neuronx_fx_passes_us: int = 1000
    torch_neuronx_lower_us: int = 2000
    torch_neuronx_compile_us: int = 3000


@dataclass
class FakeSDK:
    device: bool
    group: dict[str, Any] | None = None  # the init_process_group call, once made
    touched: list[str] = field(default_factory=list)  # device calls, in order
    set_device: list[int] = field(default_factory=list)
    traces: Counter = field(default_factory=Counter)  # wrap_nki: kernel traces (and registrations) per kernel func
    launches: list[tuple[tuple[int, ...], tuple]] = field(default_factory=list)  # (grid, args) of each HOP call
    compiled: list[dict[str, Any]] = field(default_factory=list)  # one per graph the "neuron" backend compiled
    artifact_dir: Path | None = None
    fail: str | None = None  # a compile error to raise
    fail_on: dict[str, str] = field(default_factory=dict)  # graph name -> NCC code only its artifact log names
    metrics: list[Metric] = field(default_factory=list)
    output: Any = None  # kernel launch -> outputs (default: one tensor shaped like the first operand)
    peak_bytes: dict[int, int] = field(default_factory=dict)  # device index -> peak allocated bytes
    record_dir: Path | None = None  # process mode: where each event is appended (<pid>.jsonl)
    run_kernels: bool = False  # process mode: a launch runs the kernel on the NumPy stand-in (the fake `nki`)
    live_bytes: int = 0
    allocs: int = 0  # tensors allocated on the device

    def log(self, event: str, **data: Any) -> None:
        """Append one event of this process (process mode) for the test to read."""
        if self.record_dir is not None:
            import json

            self.record_dir.mkdir(parents=True, exist_ok=True)
            row = {"event": event, "pid": os.getpid(), "LOCAL_RANK": os.environ.get("LOCAL_RANK"),
                   "NEURON_RT_VISIBLE_CORES": os.environ.get("NEURON_RT_VISIBLE_CORES"), **data}
            with open(self.record_dir / f"{os.getpid()}.jsonl", "a") as f:
                f.write(json.dumps(row, default=str) + "\n")

    def allocated(self, index: int, t: torch.Tensor) -> None:
        """Device memory taken by a new tensor on neuron:<index>: a touch of the device, which in a process group
        must be the local rank's (csrc/core/NeuronDevice.cpp: one visible core, indices start at the local rank)."""
        start = self.group["local_rank"] if self.group is not None else 0
        if index != start:
            raise RuleBroken(f"a tensor on neuron:{index}: this process sees one core, neuron:{start}")
        if not self.allocs:
            self._touch(f"alloc(neuron:{index})")
            self.log("first_alloc", index=index)
        self.allocs += 1
        import weakref

        n = t.untyped_storage().nbytes() if t._base is None else 0
        self.live_bytes += n
        self.peak_bytes[index] = max(self.peak_bytes.get(index, 0), self.live_bytes)
        weakref.finalize(t, self._freed, n)

    def _freed(self, n: int) -> None:
        self.live_bytes -= n

    # -- torch.neuron ----------------------------------------------------------------------------------------------
    def _touch(self, what: str) -> None:
        if not self.device and os.environ.get("TORCH_NEURONX_COMPILE_ONLY") != "1":
            raise RuleBroken(f"{what}: no Neuron device")
        self.touched.append(what)

    def neuron_set_device(self, index: int) -> None:
        # distributed/backend.py: in a process group the device id is the local rank
        # (`_set_local_device_start_index(local_rank)`); csrc/core/NeuronDevice.cpp raises for a lower index
        local = os.environ.get("LOCAL_RANK")
        if self.group is not None and local is not None and index != int(local):
            raise RuleBroken(f"set_device({index}) in a process group: the device id must be the local rank {local}")
        self._touch(f"set_device({index})")
        self.set_device.append(index)
        self.log("set_device", index=index)

    def neuron_synchronize(self) -> None:
        self._touch("synchronize")

    def max_memory_allocated(self, device: Any = None) -> int:
        # torch_neuronx/memory.py: memory_stats(device)["allocated_bytes"]["peak"] of that device index
        self._touch("max_memory_allocated")
        return self.peak_bytes.get(int(getattr(device, "index", device) or 0), 0)

    # -- the "neuron" process group (distributed/backend.py) -------------------------------------------------------
    def init_process_group(self, backend: str, **kw: Any) -> None:
        if backend != "neuron":
            raise RuleBroken(f"init_process_group({backend!r}): the fake holds the 'neuron' group only")
        if self.touched:
            # the runtime must not be initialised before init_process_group (distributed/backend.py)
            raise RuleBroken(f"the device was touched before init_process_group: {self.touched}")
        local = os.environ.get("LOCAL_RANK")
        if local is None:
            raise RuleBroken("init_process_group('neuron') without LOCAL_RANK (torchrun sets it; so must a launcher)")
        cores = os.environ.setdefault("NEURON_RT_VISIBLE_CORES", local)  # the group sets it to the local rank
        if not cores.isdigit():  # distributed/backend.py asserts exactly one visible core per process
            raise RuleBroken(f"NEURON_RT_VISIBLE_CORES={cores!r}: exactly one visible core per process")
        self.group = {"backend": backend, **kw, "local_rank": int(local), "cores": cores}

    # -- torch_neuronx.nki_hop.wrap_nki (torch_neuronx/nki_hop.py) -------------------------------------------------
    def wrap_nki(self, nki_kernel: Any, **kwargs: Any) -> Any:
        # wrap_nki reads `nki_kernel.sign` (the signature) and `nki_kernel.func`, then traces and registers the
        # kernel (register_kernel_to_torch -> TorchNeuronNKIKernel.trace) on every call: no dedupe of wrappers
        sig = nki_kernel.sign
        func = nki_kernel.func
        self.traces[getattr(func, "__name__", repr(func))] += 1
        self.log("wrap_nki", kernel=getattr(func, "__name__", repr(func)))
        return _Caller(self, list(sig.parameters), grid=(), func=func)

    # -- torch_neuronx.nki_op (torch_neuronx/nki_hop.py) -----------------------------------------------------------
    def nki_op(self, name: str, fn: Any = None, mutates_args: Any = ()) -> Any:
        def dec(f: Any) -> Any:
            from torch._library.infer_schema import infer_schema
            from torch._subclasses.functional_tensor import FunctionalTensorMode

            op = torch.library.custom_op(name, f, mutates_args=mutates_args,
                                         schema=infer_schema(f, mutates_args=mutates_args))
            op.register_fake(f)  # the body itself is the fake: it must be traceable on fake tensors

            def functional(mode: Any, op_: Any, types_: Any, args: Any, kwargs: Any) -> Any:
                with mode:  # under compile the body is traced into the graph (FunctionalTensorMode)
                    return f(*args, **kwargs)

            op.register_torch_dispatch(FunctionalTensorMode, functional)
            return op

        return dec if fn is None else dec(fn)

    # -- the "neuron" torch.compile backend (neuron_dynamo_backend/backend.py) -------------------------------------
    def backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any], *, options: dict | None = None,
                mode: str = "default") -> Any:
        name = (options or {}).get("model_name", "model_default")
        if self.artifact_dir is None:  # fixed at the first compile, and made (neuron_dynamo_backend/config.py
            # get_artifacts_directory, lru_cache): a variable set later is never read
            self.artifact_dir = Path(os.environ.get("TORCH_NEURONX_DEBUG_DIR") or "<none set at the first compile>")
            if "TORCH_NEURONX_DEBUG_DIR" in os.environ:
                self.artifact_dir.mkdir(parents=True, exist_ok=True)
        compile_only = os.environ.get("TORCH_NEURONX_COMPILE_ONLY") == "1"
        tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
        if compile_only and not self.device and any(t.device.type != "meta" for t in tensors):
            # real neuron tensors need a device; the community port keeps the batch on meta in this mode
            raise RuleBroken(f"{name}: compile-only without a device got non-meta inputs "
                             f"{sorted({str(t.device) for t in tensors})}")
        if self.artifact_dir.is_dir():
            folder = self.artifact_dir / name
            folder.mkdir(parents=True, exist_ok=True)
            err = self.fail or self.fail_on.get(name)
            (folder / "log-neuron-cc.txt").write_text(f"compiling {name}\n" + (f"ERROR [{err}]\n" if err else ""))
        self.log("compile", name=name, devices=sorted({str(t.device) for t in tensors}))
        self.compiled.append({"name": name, "shapes": [tuple(t.shape) for t in tensors],
                              "devices": sorted({t.device.type for t in tensors}), "compile_only": compile_only})
        self.metrics.append(Metric(f"key{len(self.metrics)}", f"{name}_0_inference_0", name))
        if self.fail is not None:
            raise RuntimeError(f"neuronx-cc failed: {self.fail}")
        if name in self.fail_on:
            raise RuntimeError("neuronx-cc returned 70")  # the code is in the graph's artifact log only
        return gm.forward

    def get_dynamo_metrics(self) -> list[Metric]:
        return list(self.metrics)


class _Caller:
    """NKIHOPCaller (torch_neuronx/nki_hop.py)."""

    def __init__(self, sdk: FakeSDK, arg_names: list[str], grid: tuple[int, ...], func: Any = None) -> None:
        self.sdk, self.arg_names, self.grid, self.func = sdk, arg_names, grid, func

    def __getitem__(self, grid: Any) -> _Caller:
        # the April 2026 tree: `grid = tuple(map(int, grid))`, so an int subscript raises TypeError
        return _Caller(self.sdk, self.arg_names, tuple(map(int, grid)), self.func)

    def __call__(self, *args: Any) -> Any:
        if len(args) > len(self.arg_names):
            raise TypeError(f"{len(args)} operands for a kernel of {len(self.arg_names)} parameters")
        self.sdk.launches.append((self.grid, args))
        self.sdk.log("launch", grid=list(self.grid), devices=sorted({str(a.device) for a in args
                                                                     if isinstance(a, torch.Tensor)}))
        if self.sdk.output is not None:
            return self.sdk.output(*args)
        if self.sdk.run_kernels:
            return _kernel_outputs(self.func, args)
        first = next(a for a in args if isinstance(a, torch.Tensor))
        return torch.empty_like(first)


def install(monkeypatch: Any, *, device: bool = True) -> FakeSDK:
    """Put the fake SDK in place for one test (undone by `monkeypatch`)."""
    sdk = FakeSDK(device=device)
    _patch(monkeypatch, sdk)
    monkeypatch.setattr(torch, "neuron", types.SimpleNamespace(set_device=sdk.neuron_set_device,
                                                               synchronize=sdk.neuron_synchronize,
                                                               max_memory_allocated=sdk.max_memory_allocated),
                        raising=False)
    monkeypatch.setattr(dist, "init_process_group", sdk.init_process_group)
    monkeypatch.setattr(dist, "get_rank", lambda *a: sdk.group["local_rank"] if sdk.group else 0)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: int(os.environ.get("WORLD_SIZE",
                                                                               os.environ.get("LOCAL_WORLD_SIZE", 1))))
    monkeypatch.setattr(dist, "new_group", lambda **k: ("control", k["backend"]))
    return sdk


def _patch(p: Any, sdk: FakeSDK) -> None:
    """What both installs put in place (`p`: a pytest MonkeyPatch, or `_Permanent` for a whole process)."""
    tnx = types.ModuleType("torch_neuronx")
    tnx.__version__ = "2.13.3.1"
    tnx.nki_op = sdk.nki_op
    tnx.wrap_nki = sdk.wrap_nki
    tnx.get_dynamo_metrics = sdk.get_dynamo_metrics
    hop = types.ModuleType("torch_neuronx.nki_hop")
    hop.wrap_nki = sdk.wrap_nki
    hop.nki_op = sdk.nki_op
    tnx.nki_hop = hop
    p.setitem(sys.modules, "torch_neuronx", tnx)
    p.setitem(sys.modules, "torch_neuronx.nki_hop", hop)
    real_lookup, real_list = torch._dynamo.lookup_backend, torch._dynamo.list_backends
    p.setattr(torch._dynamo, "lookup_backend", lambda name: sdk.backend if name == "neuron" else real_lookup(name))
    p.setattr(torch._dynamo, "list_backends", lambda *a, **k: sorted({*real_list(*a, **k), "neuron"}))
    real_glob = glob.glob
    p.setattr(glob, "glob", lambda pat, *a, **k: (["/dev/neuron0"] if sdk.device else [])
              if pat == "/dev/neuron*" else real_glob(pat, *a, **k))


def nki_kernel(fn: Any) -> Any:
    """What the real `nki.jit` returns, as far as wrap_nki reads it: `.func` and `.sign`."""
    return types.SimpleNamespace(func=fn, sign=inspect.signature(fn), __name__=fn.__name__)


# -- a whole process under the fake (the rank processes of `golden --backend neuron --cp 2`) ----------------------
# `import torch` loads every `torch.backends` entry point (torch/__init__.py `_import_device_backends`): that is how
# torch_neuronx is loaded on a Neuron host, and how tests/fake_sdk/ (a dist-info naming `autoload` below, put on
# PYTHONPATH by the test) loads this fake in every process of a command, the spawned ranks included, before any of
# the engine's code runs. It does nothing unless FAKE_TORCHNEURON=1.
FAKE_VAR, RECORD_VAR = "FAKE_TORCHNEURON", "FAKE_TORCHNEURON_RECORD"


class _Permanent:
    """MonkeyPatch's setattr / setitem, never undone (the process is the test's)."""

    @staticmethod
    def setattr(obj: Any, name: str, value: Any, raising: bool = True) -> None:
        setattr(obj, name, value)

    @staticmethod
    def setitem(d: Any, key: Any, value: Any) -> None:
        d[key] = value


_SDK: FakeSDK | None = None


def autoload() -> None:
    """The `torch.backends` entry point: the fake for this whole process when FAKE_TORCHNEURON=1."""
    if os.environ.get(FAKE_VAR) == "1":
        install_process(os.environ.get(RECORD_VAR))


def install_process(record: str | None = None) -> FakeSDK:
    """The fake SDK, a Neuron device and the "neuron" process group for this whole process: `neuron:<i>` tensors
    hold CPU tensors (`NeuronTensor`), the group runs on gloo once its rules are checked, and each rule-relevant event
    is appended to `<record>/<pid>.jsonl`."""
    global _SDK
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    sdk = _SDK = FakeSDK(device=True, run_kernels=True)
    sdk.record_dir = Path(record) if record else None
    _patch(_Permanent, sdk)
    # the standalone `nki` (its own package on a Neuron host): `nki.jit` keeps `.func` / `.sign` as wrap_nki reads
    # them, and its language is the NumPy stand-in, so a launch can compute (`_kernel_outputs`)
    from nki_kernels import stand_in

    nki = types.ModuleType("nki")
    nki.jit, nki.language, nki.isa = nki_kernel, stand_in.language, stand_in.isa
    sys.modules.update({"nki": nki, "nki.language": stand_in.language, "nki.isa": stand_in.isa})
    # TorchNeuron registers "neuron" as the PrivateUse1 device and torch.neuron as its device module (neuron.py)
    _setup_privateuseone_for_python_backend("neuron", backend_module=_DeviceModule(sdk))
    lib = torch.library.Library("_", "IMPL")
    lib.fallback(lambda op, *a, **k: _on_cpu(op, a, k), "PrivateUse1")  # factories with device="neuron:<i>"
    aten = torch.library.Library("aten", "IMPL")
    for name in ("arange", "arange.start", "arange.start_step", "linspace"):
        # these fill an empty(0) `out` they resize: a device tensor's shape cannot follow, so they run whole here
        op = getattr(torch.ops.aten, name.split(".")[0])
        overload = getattr(op, name.split(".")[1] if "." in name else "default")
        aten.impl(name, lambda *a, _op=overload, **k: _on_cpu(_op, a, k), "PrivateUse1")
    _LIBS.extend([lib, aten])  # kept alive: a dropped Library unregisters its kernels
    real_init = dist.init_process_group

    def init_process_group(backend: str, **kw: Any) -> None:
        sdk.init_process_group(backend, **kw)  # the SDK's rules, then a real group on gloo for the collectives
        sdk.log("init_process_group", group={k: v for k, v in sdk.group.items() if k != "timeout"})
        real_init("gloo", **kw)

    dist.init_process_group = init_process_group
    real_tensor, real_as_tensor = torch.tensor, torch.as_tensor

    def tensor(data: Any, *a: Any, device: Any = None, **k: Any) -> torch.Tensor:
        # torch.tensor(..., device=) copies under a dispatch guard a Python device cannot serve: copy after
        t = real_tensor(data, *a, **k)
        return t if device is None else t.to(device)

    def as_tensor(data: Any, *a: Any, device: Any = None, **k: Any) -> torch.Tensor:
        t = real_as_tensor(data, *a, **k)
        return t if device is None else t.to(device)

    torch.tensor, torch.as_tensor = tensor, as_tensor
    return sdk


_LIBS: list[Any] = []


class _DeviceModule:
    """torch.neuron (torch_neuronx/neuron.py), as far as the engine and torch call it."""

    def __init__(self, sdk: FakeSDK) -> None:
        self.sdk = sdk
        self.set_device, self.synchronize = sdk.neuron_set_device, sdk.neuron_synchronize
        self.max_memory_allocated = sdk.max_memory_allocated

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return bool(self.sdk.touched)

    def current_device(self) -> int:
        return self.sdk.set_device[-1] if self.sdk.set_device else 0

    def device_count(self) -> int:
        return 1  # one visible core per process

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        """The fake device draws no random numbers: nothing to seed."""


class NeuronTensor(torch.Tensor):
    """A tensor on `neuron:<i>` whose data is a CPU tensor (`cpu`): every op on it runs on the CPU data and its
    results are put back on the device (a fake device: the SDK's rules are what it checks, not its numbers)."""

    cpu: torch.Tensor

    @staticmethod
    def __new__(cls, cpu: torch.Tensor, index: int) -> NeuronTensor:
        t = torch.Tensor._make_wrapper_subclass(cls, cpu.shape, strides=cpu.stride(),
                                                storage_offset=cpu.storage_offset(), dtype=cpu.dtype,
                                                device=torch.device("neuron", index),
                                                requires_grad=cpu.requires_grad)
        t.cpu_data = cpu
        return t

    def __repr__(self, **kw: Any) -> str:
        return f"NeuronTensor({self.cpu_data!r}, device='{self.device}')"

    def __tensor_flatten__(self) -> tuple[list[str], int]:
        return ["cpu_data"], self.device.index

    @staticmethod
    def __tensor_unflatten__(inner: dict, index: int, outer_size: Any, outer_stride: Any) -> NeuronTensor:
        return NeuronTensor(inner["cpu_data"], index)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types_: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return _on_cpu(func, args, kwargs or {})


def _on_cpu(op: Any, args: tuple, kwargs: dict) -> Any:
    """Run `op` on the CPU data of its device operands; results back on the device (unless it asked for the CPU)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_map

    index: list[int] = []
    given: dict[int, torch.Tensor] = {}  # id of a CPU datum -> its device tensor (an op returning its input)

    def unwrap(a: Any) -> Any:
        if isinstance(a, NeuronTensor):
            index.append(a.device.index)
            given[id(a.cpu_data)] = a
            return a.cpu_data
        if isinstance(a, FakeTensor) and a.device.type == "neuron":  # tracing: a factory's fake result
            index.append(a.device.index)
            with a.fake_mode:
                return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="cpu")
        if isinstance(a, torch.device) and a.type == "neuron":
            index.append(a.index or 0)
            return torch.device("cpu")
        return a

    cargs, ckwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
    dev = kwargs.get("device")
    to_cpu = dev is not None and torch.device(dev).type == "cpu"
    out = op(*cargs, **ckwargs)
    if to_cpu or not index:
        return out
    at = index[0]

    def wrap(o: Any) -> Any:
        if not isinstance(o, torch.Tensor):
            return o
        if id(o) in given:
            t = given[id(o)]
            if (t.shape, t.stride(), t.storage_offset()) != (o.shape, o.stride(), o.storage_offset()):
                raise RuleBroken(f"fake device: {op} changed the shape of a device tensor in place (unsupported)")
            return t
        if _SDK is not None and not isinstance(o, FakeTensor):  # a traced result allocates nothing
            _SDK.allocated(at, o)
        return NeuronTensor(o, at)

    return tree_map(wrap, out)


def _kernel_outputs(func: Any, args: tuple) -> Any:
    """A kernel launch of the process-mode fake: the kernel on the NumPy stand-in. Traced (fake tensors), it runs on
    zeros of the operands' shapes for its outputs' shapes and dtypes only, as the SDK traces a kernel for them."""
    import numpy as np
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    from nki_kernels import _convert, stand_in

    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    traced = any(isinstance(t, FakeTensor | FunctionalTensor) for t in tensors)
    host = tuple((np.zeros(a.shape, _convert.np_dtype(a.dtype)) if traced else _convert.to_np(a))
                 if isinstance(a, torch.Tensor) else a for a in args)
    out = stand_in.run(func, *host)
    outs = out if isinstance(out, tuple) else (out,)
    if traced:
        res = tuple(tensors[0].new_empty(o.shape, dtype=_convert.from_np(np.zeros(0, o.dtype)).dtype) for o in outs)
    else:
        res = tuple(_convert.from_np(o) for o in outs)
    return res if isinstance(out, tuple) else res[0]
