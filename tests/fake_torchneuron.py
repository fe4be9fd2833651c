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
        return _Caller(self, list(sig.parameters), grid=())

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

    def __init__(self, sdk: FakeSDK, arg_names: list[str], grid: tuple[int, ...]) -> None:
        self.sdk, self.arg_names, self.grid = sdk, arg_names, grid

    def __getitem__(self, grid: Any) -> _Caller:
        # the April 2026 tree: `grid = tuple(map(int, grid))`, so an int subscript raises TypeError
        return _Caller(self.sdk, self.arg_names, tuple(map(int, grid)))

    def __call__(self, *args: Any) -> Any:
        if len(args) > len(self.arg_names):
            raise TypeError(f"{len(args)} operands for a kernel of {len(self.arg_names)} parameters")
        self.sdk.launches.append((self.grid, args))
        if self.sdk.output is not None:
            return self.sdk.output(*args)
        first = next(a for a in args if isinstance(a, torch.Tensor))
        return torch.empty_like(first)


def install(monkeypatch: Any, *, device: bool = True) -> FakeSDK:
    """Put the fake SDK in place for one test (undone by `monkeypatch`)."""
    sdk = FakeSDK(device=device)
    tnx = types.ModuleType("torch_neuronx")
    tnx.__version__ = "2.13.3.1"
    tnx.nki_op = sdk.nki_op
    tnx.wrap_nki = sdk.wrap_nki
    tnx.get_dynamo_metrics = sdk.get_dynamo_metrics
    hop = types.ModuleType("torch_neuronx.nki_hop")
    hop.wrap_nki = sdk.wrap_nki
    hop.nki_op = sdk.nki_op
    tnx.nki_hop = hop
    monkeypatch.setitem(sys.modules, "torch_neuronx", tnx)
    monkeypatch.setitem(sys.modules, "torch_neuronx.nki_hop", hop)
    monkeypatch.setattr(torch, "neuron", types.SimpleNamespace(set_device=sdk.neuron_set_device,
                                                               synchronize=sdk.neuron_synchronize,
                                                               max_memory_allocated=sdk.max_memory_allocated),
                        raising=False)
    real_lookup, real_list = torch._dynamo.lookup_backend, torch._dynamo.list_backends
    monkeypatch.setattr(torch._dynamo, "lookup_backend",
                        lambda name: sdk.backend if name == "neuron" else real_lookup(name))
    monkeypatch.setattr(torch._dynamo, "list_backends", lambda *a, **k: sorted({*real_list(*a, **k), "neuron"}))
    monkeypatch.setattr(dist, "init_process_group", sdk.init_process_group)
    monkeypatch.setattr(dist, "get_rank", lambda *a: sdk.group["local_rank"] if sdk.group else 0)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: int(os.environ.get("WORLD_SIZE",
                                                                               os.environ.get("LOCAL_WORLD_SIZE", 1))))
    monkeypatch.setattr(dist, "new_group", lambda **k: ("control", k["backend"]))
    real_glob = glob.glob
    monkeypatch.setattr(glob, "glob", lambda pat, *a, **k: (["/dev/neuron0"] if device else [])
                        if pat == "/dev/neuron*" else real_glob(pat, *a, **k))
    return sdk


def nki_kernel(fn: Any) -> Any:
    """What the real `nki.jit` returns, as far as wrap_nki reads it: `.func` and `.sign`."""
    return types.SimpleNamespace(func=fn, sign=inspect.signature(fn), __name__=fn.__name__)
