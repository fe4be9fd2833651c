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
* each rank's environment is computed by the parent and given to the rank before it imports torch (`rank_env`:
  `import torch` autoloads torch_neuronx, whose HLO cache reads its variables at import): LOCAL_RANK /
  LOCAL_WORLD_SIZE, one visible NeuronCore (NEURON_RT_VISIBLE_CORES = the local rank, never a range: the SDK's
  process group asserts one visible core per process), the LNC (NEURON_LOGICAL_NC_CONFIG, 1 unless set: see
  `FIRST_CONTACT_LNC`), NEFF and HLO caches of its own, `-O1` for neuronx-cc unless NEURON_CC_FLAGS is set, and no
  silent eager fallback (TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=1);
* ranks join `init_process_group("neuron")` (gloo control group kept) before anything touches the device, then
  `torch.neuron.set_device(local_rank)`: in a process group TorchNeuron makes the device id the local rank
  (`_set_local_device_start_index`), so a rank's device is `neuron:<local_rank>`; the MoE / attention exchanges run
  as functional collectives, legal inside compiled graphs (`Parallel.functional`, engine/parallel.py);
* each graph is named (`options={"model_name": ...}`) and counted; compile counts and seconds come from
  `torch_neuronx.get_dynamo_metrics()` where the build has it;
* compile-only (`deepinfer compile --backend neuron`) on a host without a device traces on `meta` tensors, as the
  community V4 port does in this mode (real `neuron` tensors need a device); the artifact folder
  (TORCH_NEURONX_DEBUG_DIR) is set before the engine is built, as the SDK fixes it at the first compile.

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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.backends import Counters, counted_compiler
from engine.backends.graph_export import DEBUG_DIR
from engine.model.capabilities import DEVICE

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.parallel import Parallel
    from engine.stack import NeuronStack

# a torch.compile(backend="neuron") graph that fails to compile raises instead of running eagerly (the SDK's default,
# made explicit and recorded)
_NO_FALLBACK = {"TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION": "1"}
COMPILE_ONLY = "TORCH_NEURONX_COMPILE_ONLY"
# The LNC of a first contact when NEURON_LOGICAL_NC_CONFIG is not set: 1. The NKI kernels do not split their work by
# nl.program_id, so launched at LNC 2 both physical cores would compute and write the whole output, and a launch's
# LNC must equal neuronx-cc's (NKI docs: `kernel[lnc]` must match the runtime's NEURON_LOGICAL_NC_CONFIG; NCC_EVRF066
# otherwise): a process at LNC 1 is the one way to run them correctly without changing every kernel.
FIRST_CONTACT_LNC = 1
# neuronx-cc flags of a first contact when NEURON_CC_FLAGS is not set: whole-layer graphs at the default level took
# ~120 GiB host RSS in the community V4 port (longdct/vllm-neuron docs/model-dev); -O1 keeps compiles small
FIRST_CONTACT_CC_FLAGS = "-O1"
NOT_MEASURED = "not measured: no Neuron device"
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
    """torch_neuronx, checked for what this backend calls: `nki_op`, `torch_neuronx.nki_hop.wrap_nki` (the module
    the SDK defines it in, torch_neuronx/nki_hop.py) and the "neuron" Dynamo backend."""
    import importlib

    try:
        import torch_neuronx
    except ImportError as e:
        raise ValueError(f"--backend neuron: import torch_neuronx failed ({e}); on this host use {STANDIN_INSTALL}"
                         ) from None
    missing = [] if hasattr(torch_neuronx, "nki_op") else ["nki_op"]
    try:
        if not hasattr(importlib.import_module("torch_neuronx.nki_hop"), "wrap_nki"):
            missing.append("nki_hop.wrap_nki")
    except ImportError:
        missing.append("nki_hop.wrap_nki")
    if "neuron" not in torch._dynamo.list_backends():
        missing.append('the "neuron" torch.compile backend')
    if missing:
        raise ValueError(f"--backend neuron: this torch_neuronx has no {' / '.join(missing)}: not a TorchNeuron "
                         "build (torch-neuronx >= 2.13)")
    return torch_neuronx


def visible_core(local_rank: int, recorded: Mapping[str, str]) -> str:
    """The one NeuronCore rank `local_rank` sees: the local rank, or the local_rank-th of the cores the user listed in
    NEURON_RT_VISIBLE_CORES ("4-7" or "4,5,6,7"; a single core is kept). Never a range: TorchNeuron's process group
    asserts exactly one visible core per process (torch_neuronx distributed/backend.py)."""
    raw = recorded.get("NEURON_RT_VISIBLE_CORES")
    if raw is None:
        return str(local_rank)
    cores: list[int] = []
    try:
        for part in raw.split(","):
            lo, _, hi = part.strip().partition("-")
            cores += list(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"NEURON_RT_VISIBLE_CORES={raw!r}: expected a core, a range a-b or a list a,b") from None
    if len(cores) == 1:
        return str(cores[0])
    if local_rank >= len(cores):
        raise ValueError(f"NEURON_RT_VISIBLE_CORES={raw!r} lists {len(cores)} cores, rank {local_rank} needs one of "
                         "its own (one visible core per rank)")
    return str(cores[local_rank])


def neff_cache_dir(recorded: Mapping[str, str], local_rank: int, root: Path) -> str:
    """This rank's NEFF cache: <TORCH_NEURONX_NEFF_CACHE_DIR or root/neff>/rank<local_rank>."""
    return per_rank_dir(recorded, "TORCH_NEURONX_NEFF_CACHE_DIR", local_rank, root / "neff")


def per_rank_dir(recorded: Mapping[str, str], var: str, local_rank: int, default: Path) -> str:
    """<recorded[var] or default>/rank<local_rank> (a rank process that inherited a per-rank directory uses its
    parent)."""
    base = Path(recorded.get(var) or default)
    if base.name.startswith("rank") and base.name[4:].isdigit():
        base = base.parent
    return str(base / f"rank{local_rank}")


def worker_env(local_rank: int, lnc: int, recorded: Mapping[str, str], root: Path,
               compile_only: bool = False, local_world: int = 1) -> dict[str, str]:
    """The TorchNeuron variables of rank `local_rank` of `local_world` on this host, to be in its environment before
    it imports torch (pure: the caller passes what is recorded of the environment). A variable the user set is kept,
    except the per-rank caches (a subdirectory of theirs), the visible core (one of theirs) and the no-fallback
    switch (a graph that fails to compile must raise here)."""
    env = {"LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world),
           "NEURON_RT_VISIBLE_CORES": visible_core(local_rank, recorded),
           "NEURON_LOGICAL_NC_CONFIG": str(lnc),
           "TORCH_NEURONX_NEFF_CACHE_DIR": neff_cache_dir(recorded, local_rank, root),
           # the HLO cache reads these at import (torch_neuronx kernels/cache_utils.py): per rank, so ranks never
           # race on one folder
           "TORCH_NEURONX_HLO_CACHE_DIR": per_rank_dir(recorded, "TORCH_NEURONX_HLO_CACHE_DIR", local_rank,
                                                       root / "hlo"),
           "TORCH_NEURONX_HLO_COMPILE_CACHE": recorded.get("TORCH_NEURONX_HLO_COMPILE_CACHE", "1"),
           "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": per_rank_dir(recorded, "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR",
                                                              local_rank, root / "neff_local"),
           "NEURON_CC_FLAGS": recorded.get("NEURON_CC_FLAGS", FIRST_CONTACT_CC_FLAGS),
           **_NO_FALLBACK}
    if compile_only:
        env[COMPILE_ONLY] = "1"
        env["NEURON_PLATFORM_TARGET_OVERRIDE"] = recorded.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
        env["TORCH_NEURONX_PRESERVE_COMPILATION_ARTIFACTS"] = "1"
    return env


def first_contact_lnc(recorded: Mapping[str, str]) -> int:
    """NEURON_LOGICAL_NC_CONFIG when set (1 or 2), else FIRST_CONTACT_LNC."""
    from engine.stack import logical_nc_config

    return logical_nc_config() if "NEURON_LOGICAL_NC_CONFIG" in recorded else FIRST_CONTACT_LNC


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

        rec = dict(get_envs().recorded)
        self.compile_only = rec.get(COMPILE_ONLY) == "1"
        if config is not None and str(config.kernels) == "nki" and first_contact_lnc(rec) != 1:
            raise ValueError("--kernels nki at NEURON_LOGICAL_NC_CONFIG=2: the NKI kernels do not split their work by "
                             "nl.program_id, so both physical cores would compute and write every output; run them "
                             "at NEURON_LOGICAL_NC_CONFIG=1 (this backend's default)")
        stack = neuron_stack()
        require_torchneuron(stack, self.compile_only)
        self._tnx = _import_torchneuron()
        if config is not None and str(config.kernels) == "nki":
            from nki_kernels.torch_ops import device_registered

            try:
                device_registered()  # the device ops, before any graph traces one (registering is not traceable)
            except RuntimeError as e:
                raise ValueError(f"--kernels nki: {e}") from None
        self._index = 0  # the device index of this rank: its local rank (setup_process)
        # compile-only without a device: graphs are traced on meta tensors (real neuron tensors need a device)
        self._on_meta = self.compile_only and not stack.device
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
        """What the probe finds here: TorchNeuron's version and whether a Neuron device is visible."""
        from engine.stack import neuron_stack

        st = neuron_stack()
        if st.kind != "torchneuron":
            return f"nothing of TorchNeuron: no torch-neuronx >= 2.13 found here ({st.why}); no result is from trn2"
        where = "on a Neuron device (/dev/neuron*)" if st.device else "compile only, no Neuron device visible"
        return (f"TorchNeuron torch-neuronx {st.version or '?'} (torch.compile backend=\"neuron\", neuronx-cc "
                f"NEFFs), {where}")

    @property
    def device_name(self) -> str:
        """`neuron:<local rank>` of this rank (set by `setup_process`; in a process group TorchNeuron makes the
        device id the local rank), `meta` when compiling only without a device."""
        return "meta" if self._on_meta else f"neuron:{self._index}"

    @property
    def device(self) -> torch.device:
        if self._device is None:
            self._device = torch.device(self.device_name)  # TorchNeuron registers "neuron" as the PrivateUse1 name
            self._counters.device = str(self._device)
        return self._device

    def _set_device(self) -> None:
        """`torch.neuron.set_device(local_rank)`: after the process group exists (the runtime must not start
        before `init_process_group`), never when tracing on meta."""
        if not self._on_meta:
            torch.neuron.set_device(self._index)

    # -- the compile step --------------------------------------------------------------------------------------------
    def _dynamo_backend(self, name: str) -> Callable[..., Any]:
        """TorchNeuron's Dynamo backend with the graph named `name` (`options={"model_name": name}`: the SDK names its
        artifacts and metrics by it), counting each graph it compiles and the seconds its compile call takes
        (neuronx-cc runs there or at the graph's first call; `counters` prefers the SDK's own metrics)."""
        from engine.backends.portable import source_problems

        neuron = torch._dynamo.lookup_backend("neuron")

        def named(gm: Any, example_inputs: list[Any]) -> Any:
            problems = source_problems(gm)  # what Neuron's lowering gets wrong without an error (portable.py)
            if problems:
                raise ValueError(f"{name}: " + "; ".join(problems[:5]))
            return neuron(gm, example_inputs, options={"model_name": name})

        return counted_compiler(named, self._counters)

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
        not counted by this backend (torch-neuronx's supported-operator table lists them). Where the build has
        `torch_neuronx.get_dynamo_metrics()` (neuron_dynamo_backend/metrics.py), the graph count and the compile
        seconds (FX passes + lowering + neuronx-cc) are its numbers."""
        c = dataclasses.replace(self._counters, fallback_ops=dict(self._counters.fallback_ops))
        metrics = getattr(self._tnx, "get_dynamo_metrics", None)
        if metrics is not None and not self._on_meta:
            got = list(metrics())
            c.graph_compiles = c.compiles = len(got)
            c.compile_seconds = sum(m.torch_neuronx_fx_passes_us + m.torch_neuronx_lower_us
                                    + m.torch_neuronx_compile_us for m in got) / 1e6
        return c

    def device_peak(self) -> int | str:
        """Peak bytes allocated on this rank's NeuronCore since the process started, as the SDK exposes it
        (`torch.neuron.max_memory_allocated(index)` = `memory_stats(index)["allocated_bytes"]["peak"]`,
        torch_neuronx/memory.py); without a device, the reason it is not measured (never 0)."""
        if self._on_meta:
            return NOT_MEASURED
        return int(torch.neuron.max_memory_allocated(self._index))

    # -- processes -----------------------------------------------------------------------------------------------------
    @classmethod
    def rank_env(cls, rank: int, world: int) -> dict[str, str]:
        """The environment of spawned rank `rank` of `world` on this host, computed by the parent and given to the
        rank before it starts (engine/parallel.py `launch`): `import torch` autoloads torch_neuronx, which reads
        its cache variables at import."""
        from engine.envs import cache_root, get_envs

        rec = dict(get_envs().recorded)
        rec.pop("LOCAL_RANK", None)
        return worker_env(rank, first_contact_lnc(rec), rec, cache_root(), rec.get(COMPILE_ONLY) == "1", world)

    def setup_process(self, threads: int | None = None, rank: int = 0, world: int = 1,
                      master_port: int | None = None) -> None:
        """This rank's variables (already in its environment when the parent spawned it; under torchrun set here,
        before the runtime starts, and the HLO cache's only if torch_neuronx has not read them) and its device
        index, the local rank. A one-rank process sets its device now; a rank of a group after joining it."""
        from engine.backends.host import setup_host_process
        from engine.envs import apply_env, cache_root, get_envs

        rec = dict(get_envs().recorded)
        local = int(rec.get("LOCAL_RANK", rank)) if master_port is None else rank
        local_world = int(rec.get("LOCAL_WORLD_SIZE", world)) if master_port is None else world
        apply_env(worker_env(local, first_contact_lnc(rec), rec, cache_root(), self.compile_only, local_world))
        self._index = local
        self._device = None
        if world <= 1:
            self._set_device()
        setup_host_process(threads)  # the host side of the process (tracing, input packing)

    @classmethod
    def check_parallel(cls, cp: int) -> None:
        """TorchNeuron ranks: one process per logical NeuronCore, joined by the "neuron" process group."""

    def join_group(self, rank: int, world: int, master_port: int | None, timeout_s: float) -> Parallel:
        """The "neuron" process group (torchrun's env:// rendezvous, or our launcher's tcp:// one) with the gloo
        control group, then this rank's device; the model's exchanges run as functional collectives."""
        from engine.parallel import join_group

        if master_port is None:
            par = join_group("neuron", "env://", world, timeout_s, backend=self, functional=True)
        else:
            par = join_group("neuron", f"tcp://127.0.0.1:{master_port}", world, timeout_s, rank=rank, backend=self,
                             functional=True)
        self._set_device()
        return par

    # -- graphs for the offline compiler (deepinfer compile) -----------------------------------------------------------
    @classmethod
    def compile_only_env(cls, out: Path | None = None) -> dict[str, str]:
        """What `deepinfer compile --backend neuron` sets before the engine is built: TorchNeuron's compile-only mode
        (the whole lowering and neuronx-cc, nothing executed, no device needed) for trn2, artifacts kept under
        `out`/artifacts (TORCH_NEURONX_DEBUG_DIR: the SDK fixes the artifact folder at the first compile,
        neuron_dynamo_backend/config.py, so it is set before anything compiles)."""
        env = {COMPILE_ONLY: "1", "NEURON_PLATFORM_TARGET_OVERRIDE": "trn2",
               "TORCH_NEURONX_PRESERVE_COMPILATION_ARTIFACTS": "1", **_NO_FALLBACK}
        if out is not None:
            env[DEBUG_DIR] = str(Path(out) / "artifacts")
        return env

    def export_graphs(self, runner: Any, out_dir: Path, graphs: Sequence[str] = ()) -> list[dict[str, Any]]:
        """Every graph a step of `runner` can run, each compiled on its own in compile-only mode: per graph pass /
        fail, seconds and the NCC error code (engine/backends/graph_export.py)."""
        from engine.backends.graph_export import export_neuron

        return export_neuron(self, runner, Path(out_dir), graphs)


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
        self._index, self._on_meta = 0, False
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

    def device_peak(self) -> int | str:
        """The stand-in runs on the CPU: no device memory to measure."""
        return NOT_MEASURED

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
    def compile_only_env(cls, out: Path | None = None) -> dict[str, str]:
        return {}

    def export_graphs(self, runner: Any, out_dir: Path, graphs: Sequence[str] = ()) -> list[dict[str, Any]]:
        """Every graph a step of `runner` can run, lowered by the stand-in to StableHLO text (`<graph>.mlir`) and
        checked (no f8 type, no torch op left): engine/backends/graph_export.py."""
        from engine.backends.graph_export import export_standin

        return export_standin(self, runner, Path(out_dir), graphs)
