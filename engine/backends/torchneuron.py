"""TorchNeuron: the engine on the Neuron SDK's native PyTorch backend (`--backend neuron`), and the same backend with
its compile step swapped for a CPU stand-in of that compile pipeline (`--backend neuron-standin`).

TorchNeuron (torch-neuronx >= 2.13 with torch 2.13 / 2.14, Neuron SDK 2.33+; `/work/shared/spec/nki.md` §3.1) is a
PrivateUse1 device, `neuron`, with `torch.compile(backend="neuron")`: Dynamo -> AOTAutograd with Neuron
decompositions (inference input mutations kept) -> torch-mlir -> StableHLO -> neuronx-cc -> NEFF, one graph per static
shape (`dynamic=True` is rejected). Here:

* weights, KV-cache roots and each step's inputs live on `neuron:<i>`; a step's logits come back in one copy;
* decode regions / layer graphs (engine/regions.py) and the embedding / head are `torch.compile(..., dynamic=False)`
  graphs, `fullgraph=True` wherever a graph has no deliberate timing boundary (a timed region breaks at its split
  points, `boundary`); every layer of one structure runs one graph (the layer's tensors are graph inputs through
  `torch.func.functional_call` over a meta-parameter template, as on the host);
* eager ops (prefill chunks, `--graph-mode eager`) run as TorchNeuron's eager mode;
* `synchronize` is `torch.neuron.synchronize()`;
* each rank's process is set up before its runtime starts (`setup_process`): its NeuronCores
  (NEURON_RT_VISIBLE_CORES), the LNC (NEURON_LOGICAL_NC_CONFIG), a NEFF cache directory of its own
  (TORCH_NEURONX_NEFF_CACHE_DIR/rank<i>) and no silent eager fallback of a graph that fails to compile
  (TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=1: the failure raises);
* ranks join `init_process_group("neuron")` (gloo control group kept) and the MoE / attention exchanges run as
  functional collectives, legal inside compiled graphs (`Parallel.functional`, engine/parallel.py).

Device index: a rank whose cores this backend reserved (NEURON_RT_VISIBLE_CORES = that rank's logical core) sees one
core, `neuron:0`; when the user set NEURON_RT_VISIBLE_CORES to a range shared by the ranks (torchrun style), a rank
uses `neuron:<LOCAL_RANK>`.

`--backend neuron-standin` is the same class with the compile step replaced by `StandinPipeline`
(engine/backends/standin_pipeline.py: Dynamo -> AOTAutograd -> torch-mlir StableHLO -> XLA CPU executable) and the
device CPU: what it proves is that the engine's graphs lower the way TorchNeuron lowers them and compute the engine's
numbers, not anything about neuronx-cc or trn2; its results say so (`measured_on`). Nothing Neuron is imported
there. `deepinfer compile` writes every graph for both (engine/backends/graph_export.py).

Written, not run (no Neuron SDK installs here): everything under `--backend neuron` past the checks that fakes can
exercise (tests/test_torchneuron.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.backends import Counters, counted_compiler
from engine.model.capabilities import DEVICE

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.parallel import Parallel
    from engine.stack import NeuronStack

# a torch.compile(backend="neuron") graph that fails to compile raises instead of running eagerly (the SDK's default,
# made explicit and recorded)
_NO_FALLBACK = {"TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION": "1"}
COMPILE_ONLY = "TORCH_NEURONX_COMPILE_ONLY"
STANDIN_INSTALL = "--backend neuron-standin (its compile pipeline on a CPU stand-in) or --backend host"


def require_torchneuron(stack: NeuronStack, compile_only: bool = False) -> None:
    """Raise one line naming what is missing for `--backend neuron` (the TorchNeuron stack and, unless compiling only,
    a Neuron device). The advice never names the PyTorch/XLA packages: inside a TorchNeuron environment they would
    replace its torch."""
    v = stack.version or "?"
    if stack.kind == "absent":
        raise ValueError("--backend neuron runs on TorchNeuron (torch-neuronx >= 2.13 from the AWS Neuron pip "
                         "repository, Neuron SDK 2.33+), which is not installed here; on this host use "
                         + STANDIN_INSTALL)
    if stack.kind == "placeholder":
        raise ValueError(f"torch-neuronx {v} here is the PyPI placeholder, not the Neuron SDK's: --backend neuron "
                         "needs TorchNeuron from the AWS Neuron pip repository (Neuron SDK 2.33+); on this host use "
                         + STANDIN_INSTALL)
    if stack.kind == "xla":
        raise ValueError(f"torch-neuronx {v} here is the PyTorch/XLA stack, not TorchNeuron (torch-neuronx >= 2.13): "
                         "--backend neuron needs a TorchNeuron environment of the Neuron SDK 2.33+; this one runs as "
                         "--backend xla (PJRT_DEVICE=NEURON)")
    if not stack.device and not compile_only:
        raise ValueError(f"torch-neuronx {v} (TorchNeuron) is installed but no Neuron device is visible (no "
                         "/dev/neuron*): --backend neuron runs on a trn2; here use --backend host (what auto picks), "
                         f"{STANDIN_INSTALL.split(' or ')[0]}, or `deepinfer compile --backend neuron` (compile only)")


def _import_torchneuron() -> Any:
    try:
        import torch_neuronx
    except ImportError as e:
        raise ValueError(f"--backend neuron: import torch_neuronx failed ({e}); on this host use {STANDIN_INSTALL}"
                         ) from None
    missing = [n for n in ("nki_op", "wrap_nki") if not hasattr(torch_neuronx, n)]
    if missing:
        raise ValueError(f"--backend neuron: this torch_neuronx has no {' / '.join(missing)}: not a TorchNeuron "
                         "build (torch-neuronx >= 2.13)")
    return torch_neuronx


def neff_cache_dir(recorded: Mapping[str, str], local_rank: int, root: Path) -> str:
    """This rank's NEFF cache: <TORCH_NEURONX_NEFF_CACHE_DIR or root/neff>/rank<local_rank> (a rank process that
    inherited a per-rank directory uses its parent)."""
    base = Path(recorded.get("TORCH_NEURONX_NEFF_CACHE_DIR") or root / "neff")
    if base.name.startswith("rank") and base.name[4:].isdigit():
        base = base.parent
    return str(base / f"rank{local_rank}")


def worker_env(local_rank: int, lnc: int, recorded: Mapping[str, str], root: Path,
               compile_only: bool = False) -> dict[str, str]:
    """The TorchNeuron runtime variables of rank `local_rank` on this host (set before the runtime starts; pure: the
    caller passes what is recorded of the environment). A variable the user set is kept, except the per-rank NEFF
    cache (a subdirectory of theirs) and the no-fallback switch (a graph that fails to compile must raise here)."""
    env = {"NEURON_LOGICAL_NC_CONFIG": str(lnc), "TORCH_NEURONX_NEFF_CACHE_DIR": neff_cache_dir(recorded, local_rank,
                                                                                                 root),
           **_NO_FALLBACK}
    if "NEURON_RT_VISIBLE_CORES" not in recorded:
        env["NEURON_RT_VISIBLE_CORES"] = str(local_rank)  # one logical core (LNC physical cores) per rank
    if compile_only:
        env[COMPILE_ONLY] = "1"
        env["NEURON_PLATFORM_TARGET_OVERRIDE"] = recorded.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
        env["TORCH_NEURONX_PRESERVE_COMPILATION_ARTIFACTS"] = "1"
    return env


class TorchNeuronBackend:
    """`--backend neuron`. The compile step is `_dynamo_backend(name)` (TorchNeuron's "neuron" Dynamo backend,
    counted); `NeuronStandinBackend` swaps it and the device, and nothing else."""

    name = "neuron"
    kernel_tables = ("reference", "nki")
    capabilities = DEVICE

    def __init__(self, config: EngineConfig | None = None) -> None:
        from engine.backends.host import _raise_recompile_limit
        from engine.envs import get_envs
        from engine.stack import neuron_stack

        self.compile_only = dict(get_envs().recorded).get(COMPILE_ONLY) == "1"
        require_torchneuron(neuron_stack(), self.compile_only)
        self._tnx = _import_torchneuron()
        self._index = 0  # the device index of this rank (setup_process)
        self._device: torch.device | None = None
        self._counters = Counters(device="neuron")
        _raise_recompile_limit()

    @classmethod
    def kernel_hint(cls, kernels: str) -> str:
        return {"stand-in": ": the NumPy stand-in of the NKI kernels runs on the host (--backend host)",
                "host": ": the native CPU kernels run on the host (--backend host)"}.get(kernels, "")

    @classmethod
    def available(cls, compile_only: bool = False) -> None:
        """One line (ValueError) when TorchNeuron or, unless compiling only, a Neuron device is missing here."""
        from engine.envs import get_envs
        from engine.stack import neuron_stack

        require_torchneuron(neuron_stack(), compile_only or dict(get_envs().recorded).get(COMPILE_ONLY) == "1")

    @classmethod
    def measured_on(cls) -> str:
        return "TorchNeuron (torch.compile backend=\"neuron\", neuronx-cc NEFFs) on a Neuron device"

    @property
    def device_name(self) -> str:
        """`neuron:<index>` of this rank (set by `setup_process`)."""
        return f"neuron:{self._index}"

    @property
    def device(self) -> torch.device:
        if self._device is None:
            self._device = torch.device(self.device_name)  # TorchNeuron registers "neuron" as the PrivateUse1 name
            self._counters.device = str(self._device)
        return self._device

    # -- the compile step --------------------------------------------------------------------------------------------
    def _dynamo_backend(self, name: str) -> Callable[..., Any]:
        """TorchNeuron's Dynamo backend, counting each graph it compiles and the seconds its compile call takes
        (neuronx-cc runs there or at the graph's first call: the first call's time is then not in compile_seconds)."""
        return counted_compiler(torch._dynamo.lookup_backend("neuron"), self._counters)

    def _count_execution(self) -> None:
        self._counters.executions += 1

    def _compile(self, fn: Callable[..., Any], name: str, fullgraph: bool) -> Callable[..., Any]:
        return torch.compile(fn, backend=self._dynamo_backend(name), dynamic=False, fullgraph=fullgraph)

    # -- graphs --------------------------------------------------------------------------------------------------------
    def compile_region(self, region: Any) -> Callable[..., Any]:
        """One graph per region structure (and static shape) over the region's meta-parameter template, each layer's
        tensors passed in by `functional_call`; fullgraph unless the region is timed (its split points are graph
        breaks)."""
        from engine.profiling import no_split

        template = region.template()

        def run(params: dict[str, torch.Tensor], *args: Any) -> Any:
            return torch.func.functional_call(template, params, args)

        graph = self._compile(run, "region_" + "_".join(str(s) for s in region.structure()),
                              fullgraph=region.split is no_split)

        def call(reg: Any, *args: Any) -> Any:
            self._count_execution()
            return graph(reg.params(), *args)

        return call

    def compile_fn(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        graph = self._compile(fn, name, fullgraph=True)

        def call(*args: Any) -> Any:
            self._count_execution()
            return graph(*args)

        return call

    def region_end(self) -> None:
        """Each region call ran its graph already."""

    def step_end(self) -> None:
        """Nothing to cut: graphs are launched as they are called."""

    def synchronize(self) -> None:
        torch.neuron.synchronize()

    def boundary(self, fn: Callable[[str], None]) -> Callable[[str], None]:
        return torch.compiler.disable(fn)  # a graph break: the stages before and after become separate graphs

    def grad_context(self) -> Any:
        return torch.no_grad()

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t
        self._counters.transfers_to_host += 1
        return t.cpu()

    def counters(self) -> Counters:
        """Graphs compiled (`compiles` = `graph_compiles`: eager mode's per-op compiles are not visible from here),
        graph executions, compile seconds, step results copied to the host; `fallbacks` stays 0: a graph that fails
        to compile raises (TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=1), and eager CPU fallbacks of single ops are
        not counted by this backend (torch-neuronx's supported-operator table lists them)."""
        return dataclasses.replace(self._counters, fallback_ops=dict(self._counters.fallback_ops))

    # -- processes -----------------------------------------------------------------------------------------------------
    def setup_process(self, threads: int | None = None, rank: int = 0, world: int = 1,
                      master_port: int | None = None) -> None:
        from engine.backends.host import setup_host_process
        from engine.envs import apply_env, cache_root, get_envs
        from engine.stack import logical_nc_config

        rec = dict(get_envs().recorded)
        local = int(rec.get("LOCAL_RANK", rank)) if master_port is None else rank
        user_cores = "NEURON_RT_VISIBLE_CORES" in rec
        apply_env(worker_env(local, logical_nc_config(), rec, cache_root(), self.compile_only))
        self._index = local if user_cores else 0
        self._device = None
        setup_host_process(threads)  # the host side of the process (tracing, input packing)

    @classmethod
    def check_parallel(cls, cp: int) -> None:
        """TorchNeuron ranks: one process per logical NeuronCore, joined by the "neuron" process group."""

    def join_group(self, rank: int, world: int, master_port: int | None, timeout_s: float) -> Parallel:
        """The "neuron" process group (torchrun's env:// rendezvous, or our launcher's tcp:// one) with the gloo
        control group; the model's exchanges run as functional collectives."""
        from engine.parallel import join_group

        if master_port is None:
            return join_group("neuron", "env://", world, timeout_s, backend=self, functional=True)
        return join_group("neuron", f"tcp://127.0.0.1:{master_port}", world, timeout_s, rank=rank, backend=self,
                          functional=True)

    # -- graphs for the offline compiler (deepinfer compile) -----------------------------------------------------------
    @classmethod
    def compile_only_env(cls) -> dict[str, str]:
        """What `deepinfer compile --backend neuron` sets before the engine is built: TorchNeuron's compile-only mode
        (the whole lowering and neuronx-cc, nothing executed, no device needed) for trn2, artifacts kept."""
        return {COMPILE_ONLY: "1", "NEURON_PLATFORM_TARGET_OVERRIDE": "trn2",
                "TORCH_NEURONX_PRESERVE_COMPILATION_ARTIFACTS": "1", **_NO_FALLBACK}

    def export_graphs(self, runner: Any, out_dir: Path) -> list[dict[str, Any]]:
        """Every graph a step of `runner` can run, each compiled on its own in compile-only mode: per graph pass /
        fail, seconds and the NCC error code (engine/backends/graph_export.py)."""
        from engine.backends.graph_export import export_neuron

        return export_neuron(self, runner, Path(out_dir))


class NeuronStandinBackend(TorchNeuronBackend):
    """`--backend neuron-standin`: TorchNeuronBackend with the compile step on the CPU stand-in (StandinPipeline:
    torch-mlir StableHLO -> XLA CPU) and the device CPU. A lowering failure raises (no eager fallback); counters
    come from the pipeline (graphs compiled, executions, compile seconds, fallbacks)."""

    name = "neuron-standin"
    # the kernels' torch ops have no StableHLO lowering: a graph holding them is cut at them and the ops run their
    # NumPy stand-in between the compiled pieces (engine/backends/standin_split.py); on a trn2 each is a NEFF call
    kernel_tables = ("reference", "stand-in")

    def __init__(self, config: EngineConfig | None = None) -> None:
        from engine.backends.host import _raise_recompile_limit
        from engine.backends.standin_pipeline import StandinPipeline

        self.compile_only = False
        self.pipeline = StandinPipeline()  # one clear line when torch-mlir / jax are missing
        self._index = 0
        self._device = torch.device("cpu")
        self._counters = Counters(device="cpu")
        _raise_recompile_limit()

    @classmethod
    def available(cls, compile_only: bool = False) -> None:
        """One line (ValueError) when torch-mlir or jax (the `neuron-standin` extra) is missing here."""
        import importlib.util

        from engine.backends.standin_pipeline import _INSTALL

        missing = [m for m in ("torch_mlir", "jax") if importlib.util.find_spec(m) is None]
        if missing:
            raise ValueError(f"--backend neuron-standin needs {' and '.join(missing)} (the TorchNeuron compile "
                             f"pipeline's CPU stand-in), not installed here: {_INSTALL}")

    @classmethod
    def kernel_hint(cls, kernels: str) -> str:
        if kernels == "nki":
            return (": --kernels nki launches the NKI kernels on a Neuron device (--backend neuron); here --kernels "
                    "stand-in runs the same kernel ops inside the stand-in's graphs, on the NumPy stand-in")
        return ": the stand-in lowers the torch reference ops (--kernels reference) or runs the kernel ops (stand-in)"

    @classmethod
    def measured_on(cls) -> str:
        from engine.backends.standin_pipeline import LABEL

        return LABEL

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def _dynamo_backend(self, name: str) -> Callable[..., Any]:
        from engine.backends.standin_pipeline import _Named

        return _Named(self.pipeline, name)

    def _count_execution(self) -> None:
        """The pipeline counts the executions of its XLA executables."""

    def synchronize(self) -> None:
        """XLA CPU executables return when done."""

    def counters(self) -> Counters:
        s = self.pipeline.stats
        fallen = {r.name: 1 for r in s.graphs if r.fallback is not None}
        return Counters(device="cpu (TorchNeuron stand-in: torch-mlir + XLA CPU)", compiles=s.graphs_compiled,
                        graph_compiles=s.graphs_compiled, executions=s.executions,
                        transfers_to_host=self._counters.transfers_to_host, fallbacks=s.fallbacks,
                        compile_seconds=s.compile_s, fallback_ops=fallen, graph_pieces=s.pieces_compiled,
                        custom_op_calls=dict(sorted(s.custom_op_calls.items())))

    def setup_process(self, threads: int | None = None, rank: int = 0, world: int = 1,
                      master_port: int | None = None) -> None:
        from engine.backends.host import setup_host_process

        setup_host_process(threads)

    @classmethod
    def check_parallel(cls, cp: int) -> None:
        if cp > 1:
            raise ValueError(f"cp={cp} on --backend neuron-standin: the stand-in lowers each graph for one XLA CPU "
                             "device and has no lowering of collectives across processes; run cp > 1 with --backend "
                             "host (gloo ranks) here, or --backend neuron on a trn2")

    def join_group(self, rank: int, world: int, master_port: int | None, timeout_s: float) -> Parallel:
        raise ValueError("--backend neuron-standin runs one rank (cp=1)")

    @classmethod
    def compile_only_env(cls) -> dict[str, str]:
        return {}

    def export_graphs(self, runner: Any, out_dir: Path) -> list[dict[str, Any]]:
        """Every graph a step of `runner` can run, lowered by the stand-in to StableHLO text (`<graph>.mlir`) and
        checked (no f8 type, no torch op left): engine/backends/graph_export.py."""
        from engine.backends.graph_export import export_standin

        return export_standin(self, runner, Path(out_dir))
