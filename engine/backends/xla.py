"""The PyTorch/XLA lane (`--backend xla`): the engine on a torch-xla device, the PyTorch/XLA way (lazy tensors cut
into graphs by `torch_xla.sync()`).

* PJRT_DEVICE=CPU (the default on a host without the legacy Neuron stack): real graph compilation, caching and
  execution by XLA's CPU backend - a verification path of the device code;
* PJRT_DEVICE=NEURON: the legacy Neuron stack (torch-neuronx 2.9 + torch-xla 2.9, the Neuron PJRT plugin; chosen by
  auto where that stack and a Neuron device are), with each rank's Neuron runtime variables set before the runtime
  starts. PyTorch/XLA inference is unsupported on trn2 from Neuron SDK 2.34: the current stack is TorchNeuron,
  `--backend neuron` (engine/backends/torchneuron.py). The class that ran this lane as `--backend neuron` is gone;
  `neuron` is TorchNeuron now.

Weights, the KV-cache roots, RoPE tables and each step's inputs live on the device; a step's inputs go up in one
copy and only its logits come back. Execution follows torch-xla 2.x's documented split: **eager mode**
(`torch_xla.experimental.eager_mode(True)`: every op outside a compiled function runs at once, compiled per op and
shape and cached) for the engine's eager path - prefill chunks and `--graph-mode eager`, whose host reads and
data-dependent shapes would otherwise cut a lazily traced step into dozens of large graphs recompiled per shape -
and **`torch_xla.compile`** for the decode regions of `--graph-mode regions|layer`: each region call is traced
and run as one XLA graph, cached by its IR hash; a layer's weights and cache roots are device data (graph inputs),
so every layer of the same structure runs the same graph (engine/regions.py). Counters come from
`torch_xla.debug.metrics` (`counters()`).

torch-xla is imported here only, when the backend is built. On PJRT CPU, XLA collectives do not run across
processes (pytorch/xla#5005, #9089), so cp > 1 is refused there (`check_parallel`); on Neuron, ranks join the
"xla" process group with `init_method="xla://"` (`join_group`).
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.backends import Counters
from engine.model.capabilities import DEVICE

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.parallel import Parallel

_INSTALL = "pip install torch==2.9.0 torch-xla==2.9.0 (a separate venv; PJRT_DEVICE=CPU on a CPU host)"
# torch-xla keeps compiled graphs in an LRU of XLA_COMPILATION_CACHE_SIZE entries (default 2048). Eager mode compiles
# one graph per op and shape: the golden's prefill alone makes ~6400, which evicted graphs compiled before it (the
# slot reset; on a long-running server, the decode regions) and recompiled them after warm-up. Set before the
# runtime starts, unless the environment sets it.
COMPILATION_CACHE_SIZE = "65536"


def apply_runtime_env() -> None:
    """The PJRT runtime's settings (read once, when the runtime starts): call before anything in the process touches
    an XLA device. The backend's setup_process does; a process that starts the runtime itself first keeps
    torch-xla's defaults (a 2048-graph cache) for its whole life."""
    from engine.envs import apply_env, get_envs

    if "XLA_COMPILATION_CACHE_SIZE" not in dict(get_envs().recorded):
        # torch-xla's own check (torch_xla/runtime.py uses it); a private API, so absent -> no warning
        started = getattr(getattr(sys.modules.get("torch_xla"), "_XLAC", None), "_xla_runtime_is_initialized", None)
        if started is not None and started():
            warnings.warn("the PJRT runtime was started before the engine's backend set XLA_COMPILATION_CACHE_SIZE: "
                          "torch-xla keeps its 2048-graph cache, so eager per-op graphs can evict the decode graphs "
                          f"(recompiles after warm-up); set XLA_COMPILATION_CACHE_SIZE={COMPILATION_CACHE_SIZE} in the "
                          "environment, or build the engine before touching an XLA device", stacklevel=2)
        apply_env({"XLA_COMPILATION_CACHE_SIZE": COMPILATION_CACHE_SIZE})


def _import_torch_xla() -> Any:
    try:
        import torch_xla
    except ImportError as e:
        from engine.stack import neuron_stack

        stack = neuron_stack()
        if stack.native:  # a TorchNeuron environment: its own torch must stay; the PyTorch/XLA lane is another venv
            raise ValueError(f"--backend xla is the PyTorch/XLA lane, which this TorchNeuron environment "
                             f"(torch-neuronx {stack.version}) does not have: use --backend neuron here") from None
        raise ValueError(f"backend xla needs torch-xla, which is not installed here ({e}); {_INSTALL}") from None
    return torch_xla


def _pjrt_device(recorded: dict[str, str]) -> str:
    """PJRT_DEVICE as set, else NEURON where the legacy Neuron stack and a device are, else CPU."""
    if "PJRT_DEVICE" in recorded:
        return recorded["PJRT_DEVICE"]
    from engine.stack import neuron_stack

    stack = neuron_stack()
    return "NEURON" if stack.kind == "xla" and stack.device else "CPU"


class XlaBackend:
    name = "xla"
    kernel_tables = ("reference", "nki")
    capabilities = dataclasses.replace(DEVICE, bitcast=False)  # view(dtype) falls back to the CPU in torch-xla 2.9

    def __init__(self, config: EngineConfig | None = None) -> None:
        self._txla = _import_torch_xla()
        import torch_xla.core.xla_model as xm
        import torch_xla.debug.metrics as met

        self._xm, self._met = xm, met
        self._device: torch.device | None = None  # the PJRT runtime starts on first use, after setup_process
        self._graph_compiles = 0

    @classmethod
    def kernel_hint(cls, kernels: str) -> str:
        return {"stand-in": ": the NumPy stand-in of the NKI kernels runs on the host (--backend host)",
                "host": ": the native CPU kernels run on the host (--backend host)"}.get(kernels, "")

    @classmethod
    def measured_on(cls) -> str:
        """Timings of the xla backend on PJRT CPU are XLA's CPU backend running the device graphs, not trn2
        numbers, and say so."""
        from engine.envs import get_envs

        device = dict(get_envs().recorded).get("PJRT_DEVICE", "CPU")
        if device == "CPU":
            return f"{cls.name} (the PyTorch/XLA lane) on PJRT CPU (not trn2 numbers)"
        return f"{cls.name} (the PyTorch/XLA lane) on PJRT {device}"

    @property
    def device(self) -> torch.device:
        if self._device is None:
            self._eager_mode()
            self._device = self._txla.device()
        return self._device

    @staticmethod
    def _eager_mode() -> None:
        from torch_xla.experimental import eager_mode

        eager_mode(True)

    @property
    def pjrt_device(self) -> str:
        import torch_xla.runtime as xr

        return str(xr.device_type())

    # -- graphs ----------------------------------------------------------------------------------------------------
    def compile_region(self, region: Any) -> Callable[..., Any]:
        """`torch_xla.compile`: the region's ops are traced and run as one graph per call (syncs before and after),
        compiled once per IR hash. The layer's own tensors are device data, i.e. graph inputs, so layers of one
        structure hit one graph."""
        name = "region_" + "_".join(map(str, region.structure()))
        return self.compile_fn(lambda reg, *args: reg(*args), name)

    def compile_fn(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        """`torch_xla.compile(fn)`, counting the compiles its calls cause (`graph_compiles` in metrics(): the
        engine's own graphs, apart from the per-op compiles of eager mode)."""
        self._eager_mode()
        graph = self._txla.compile(fn, name=name)

        def run(*args: Any) -> Any:
            before = self._met.counter_value("UncachedCompile") or 0
            out = graph(*args)
            self._graph_compiles += (self._met.counter_value("UncachedCompile") or 0) - before
            return out

        return run

    def region_end(self) -> None:
        """torch_xla.compile ran the region's graph already."""

    def step_end(self) -> None:
        self._txla.sync()

    def synchronize(self) -> None:
        self._txla.sync()
        self._xm.wait_device_ops()

    def boundary(self, fn: Callable[[str], None]) -> Callable[[str], None]:
        return fn  # the timer's synchronize() at each boundary cuts the graph there

    def grad_context(self) -> Any:
        # inference_mode tensors cannot be viewed/updated in place by later XLA ops (version counters): no_grad
        return torch.no_grad()

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.cpu()

    # -- HLO export (deepinfer compile) -----------------------------------------------------------------------------
    def trace_hlo(self, fn: Callable[[], list[torch.Tensor]]) -> tuple[str, bytes]:
        """Trace `fn()` lazily (no execution) and return the HLO module of the tensors it returns, as text and as a
        serialized `xla.HloModuleProto` (what `neuronx-cc compile --framework XLA` takes). The caller drops the
        returned tensors afterwards, so the traced computation is never run."""
        from torch_xla.experimental import eager_mode_context

        with eager_mode_context(False):
            tensors = fn()
            text = self._txla._XLAC._get_xla_tensors_hlo(tensors)
            proto = self._txla._XLAC._get_xla_tensors_hlo_proto(tensors)
        return text, proto

    # -- counters --------------------------------------------------------------------------------------------------
    def counters(self) -> Counters:
        """Cumulative torch_xla counters: compiles (`UncachedCompile`; `graph_compiles`: those of the engine's
        compiled graphs - regions, embed, head - as opposed to eager mode's per-op compiles), graph executions
        (`ExecuteComputation`), host<->device transfers (samples of `TransferFromDeviceTime` /
        `TransferToDeviceTime`), XLA compile seconds (`CompileTime`) and CPU fallbacks (every `aten::*` counter)."""
        met = self._met

        def counter(name: str) -> int:
            return int(met.counter_value(name) or 0)

        def metric(name: str) -> tuple[int, float]:
            data = met.metric_data(name)
            return (int(data[0]), float(data[1])) if data else (0, 0.0)

        fallbacks = {n: counter(n) for n in met.counter_names() if n.startswith("aten::")}
        return Counters(device=f"{self.device} (PJRT {self.pjrt_device})", compiles=counter("UncachedCompile"),
                        graph_compiles=self._graph_compiles, executions=counter("ExecuteComputation"),
                        transfers_to_host=metric("TransferFromDeviceTime")[0],
                        transfers_to_device=metric("TransferToDeviceTime")[0],
                        fallbacks=sum(fallbacks.values()), compile_seconds=metric("CompileTime")[1] / 1e9,
                        fallback_ops=fallbacks)

    # -- graphs for neuronx-cc (deepinfer compile) ------------------------------------------------------------------
    def export_graphs(self, runner: Any, out_dir: Path, graphs: Sequence[str] = ()) -> list[dict[str, Any]]:
        """Every decode graph of `runner` (or those `graphs` selects) as HLO (text + proto) for neuronx-cc
        (engine/backends/xla_export.py)."""
        from engine.backends.xla_export import export_decode_graphs

        return export_decode_graphs(self, runner, out_dir, graphs)

    # -- processes -------------------------------------------------------------------------------------------------
    @classmethod
    def check_parallel(cls, cp: int) -> None:
        from engine.envs import get_envs

        device = _pjrt_device(dict(get_envs().recorded))
        if cp > 1 and device == "CPU":
            raise ValueError(f"cp={cp} on --backend xla with PJRT_DEVICE=CPU: XLA collectives do not run across "
                             "processes on PJRT CPU (pytorch/xla#5005, #9089), so ranks would silently see world "
                             "size 1. Run cp > 1 with --backend host (gloo ranks) here, or on a Neuron device")

    def join_group(self, rank: int, world: int, master_port: int | None, timeout_s: float) -> Parallel:
        """The "xla" process group through torch-xla's `xla://` rendezvous (the rank's PJRT / torchrun variables
        were set by `setup_process`, or by torchrun); torch-xla assigns the rank."""
        import torch_xla.distributed.xla_backend  # noqa: F401 - registers the "xla" process-group backend

        from engine.parallel import join_group

        return join_group("xla", "xla://", world, timeout_s, backend=self)

    def setup_process(self, threads: int | None = None, rank: int = 0, world: int = 1,
                      master_port: int | None = None) -> None:
        """PJRT_DEVICE (recorded in meta), the runtime's cache size; on PJRT CPU XLA's -O0; on PJRT NEURON (the legacy
        stack) the rank's Neuron runtime variables - its NeuronCores, LNC, the Neuron PJRT process layout and, under our
        launcher, torchrun's variables - before the runtime starts."""
        from engine.backends.host import setup_host_process
        from engine.envs import apply_env, get_envs, neuron_worker_env
        from engine.stack import logical_nc_config

        rec = dict(get_envs().recorded)
        device = _pjrt_device(rec)
        if device == "NEURON":
            apply_env(neuron_worker_env(rank, world_size=world, logical_nc_config=logical_nc_config(),
                                        master_port=master_port))
        elif "PJRT_DEVICE" not in rec:
            apply_env({"PJRT_DEVICE": device})  # torch-xla's own default, made explicit (and recorded in meta)
        apply_runtime_env()
        rec = dict(get_envs().recorded)
        flags = rec.get("XLA_FLAGS", "")  # `import torch_xla` itself puts --xla_cpu_enable_fast_math=false here
        if device == "CPU" and "--xla_backend_optimization_level" not in flags:
            # PJRT CPU is the verification path: XLA's CPU compiler at -O0 compiles a decode region ~2-6x faster
            # (measured 5.4 s -> 0.9 s on a 40-op chain); what runs is the same HLO. Set the flag to override.
            apply_env({"XLA_FLAGS": f"{flags} --xla_backend_optimization_level=0".strip()})
        setup_host_process(threads)  # the host side of the process (tracing, input packing)
