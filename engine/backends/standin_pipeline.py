"""A CPU stand-in of TorchNeuron's compile pipeline: a Dynamo backend that lowers each graph the way
`torch.compile(backend="neuron")` does and runs it with XLA's CPU compiler in place of neuronx-cc.

    Dynamo graph -> AOTAutograd (inference, functionalised, core-ATen decompositions, input mutations kept in the
    graph) -> aliasing pass (each trailing `copy_` into a graph input becomes an extra output written back into
    that input after the call) -> torch-mlir FX importer -> StableHLO -> XLA CPU executable (jax's PJRT CPU client)

TorchNeuron's own chain is Dynamo -> AOTAutograd with Neuron decompositions -> FX passes -> torch-mlir -> StableHLO ->
neuronx-cc -> NEFF (`/work/shared/spec/nki.md` §3.1); the stand-in shares the front half up to StableHLO and
replaces the back half. What it proves: the engine's graphs lower through upstream torch-mlir to StableHLO with
static shapes, no float8 type and no unlowered `torch.` op, and the lowered program computes the engine's numbers.
What it does not prove: anything about neuronx-cc, the Neuron runtime or trn2 (label results "TorchNeuron pipeline
on a CPU stand-in (torch-mlir + XLA CPU), not neuronx-cc, not trn2").

Like TorchNeuron: static shapes only (one compile per shape; a symbolic shape is refused with a clear error), and a
lowering failure raises unless the pipeline was built with `fallback=True`, in which case the graph runs eagerly
and is counted in `fallbacks`. Tensors cross into XLA and back by DLPack (zero-copy for contiguous, aligned CPU
tensors). torch-mlir and jax are imported when a pipeline is built (the `neuron-standin` extra).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.backends.portable import graph_problems, source_problems

LABEL = "TorchNeuron pipeline on a CPU stand-in (torch-mlir + XLA CPU), not neuronx-cc, not trn2"
_INSTALL = "pip install -e '.[neuron-standin]' (torch-mlir==20261001, jax[cpu]==0.10.2)"
# float8 / float4 element types in MLIR (f8E4M3FN, f8E5M2, f8E8M0FNU, f4E2M1FN, ...): none may reach a module
_F8 = re.compile(r"f[864]E\d\w*")
# an op or type of the torch dialect left after lowering (`torch.aten.*`, `torch.constant.*`, `!torch.vtensor`,
# `torch_c.*`): quoted generic form or pretty form, at the start of an op or as a type
_TORCH_OP = re.compile(r"(?:^|[\s=(,:!\"])torch(?:_c)?\.[a-z_]")


class StandinError(RuntimeError):
    """A graph that the stand-in pipeline could not lower or compile (or a module that failed its checks)."""


@dataclass
class GraphRecord:
    """One compiled graph: its name, input shapes, seconds spent lowering (AOTAutograd + torch-mlir) and in the XLA
    compiler, op count of its StableHLO module and where the module text was written (if dumped)."""

    name: str
    inputs: list[tuple[tuple[int, ...], str]]
    lower_s: float = 0.0  # AOTAutograd (trace, functionalise, decompose) + checks + torch-mlir
    mlir_s: float = 0.0  # of which torch-mlir (FX import + torch backend + StableHLO passes)
    xla_s: float = 0.0
    ops: int = 0
    mutated_inputs: int = 0
    mlir: str | None = None
    fallback: str | None = None  # the lowering error when the graph fell back to eager
    pieces: int = 0  # a graph with kernel custom ops: its pure pieces (engine/backends/standin_split.py)
    custom_ops: int = 0  # ... and the custom-op calls between them

    @property
    def compile_s(self) -> float:
        return self.lower_s + self.xla_s


@dataclass
class StandinStats:
    graphs_compiled: int = 0
    graphs_lowered: int = 0  # lowered and checked but not compiled by XLA (a pipeline built with compile_xla=False)
    executions: int = 0
    compile_s: float = 0.0
    fallbacks: int = 0
    graphs_split: int = 0  # graphs with kernel custom ops, run as pieces + ops (engine/backends/standin_split.py)
    pieces_compiled: int = 0  # pure pieces of those through XLA (or lowered only, compile_xla=False)
    custom_op_calls: Counter[str] = field(default_factory=Counter)  # kernel ops run between pieces, per op
    graphs: list[GraphRecord] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The counters for results metadata (meta.json)."""
        return {"graphs_compiled": self.graphs_compiled, "graphs_lowered": self.graphs_lowered,
                "executions": self.executions, "graphs_split": self.graphs_split,
                "pieces_compiled": self.pieces_compiled, "custom_op_calls": dict(sorted(self.custom_op_calls.items())),
                "compile_s": round(self.compile_s, 3), "fallbacks": self.fallbacks, "label": LABEL}

    def manifest(self) -> list[dict[str, Any]]:
        """One row per graph (compiled or fallen back): what `deepinfer compile` writes next to the .mlir files."""
        return [{"name": r.name, "mlir": r.mlir, "inputs": [[list(sh), dt] for sh, dt in r.inputs], "ops": r.ops,
                 "mutated_inputs": r.mutated_inputs, "lower_s": round(r.lower_s, 3), "mlir_s": round(r.mlir_s, 3),
                 "xla_s": round(r.xla_s, 3), "pieces": r.pieces, "custom_ops": r.custom_ops, "fallback": r.fallback}
                for r in self.graphs]


def _imports() -> tuple[Any, Any]:
    try:
        import jax
        import torch_mlir.fx  # noqa: F401 - checked here, used by _lower
        from jax.extend.backend import get_backend, get_compile_options
    except ImportError as e:
        raise ValueError(f"the TorchNeuron stand-in needs torch-mlir and jax, not installed here ({e}); {_INSTALL}"
                         ) from None
    # int64 indices and positions cross into XLA as s64: without x64 jax narrows them to int32 on the way in
    jax.config.update("jax_enable_x64", True)
    return get_backend, get_compile_options


def _lower(fw: torch.fx.GraphModule, name: str) -> str:
    """torch-mlir's FX importer -> torch backend IR -> StableHLO; the module's text. The MLIR diagnostics (which
    op failed to legalize) are collected into the error, not lost on the C++ stderr."""
    from torch_mlir import ir
    from torch_mlir.dialects import torch as torch_d
    from torch_mlir.extras.fx_importer import FxImporter
    from torch_mlir.fx import stateless_fx_import

    ctx = ir.Context()
    torch_d.register_dialect(ctx)
    diagnostics: list[str] = []

    def collect(d: Any) -> bool:
        diagnostics.append(str(d.message).splitlines()[0][:400])
        return True

    ctx.attach_diagnostic_handler(collect)
    try:
        module = stateless_fx_import(fw, output_type="stablehlo", fx_importer=FxImporter(context=ctx),
                                     model_name="main")
    except Exception as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        cause = [ln for ln in lines if ln.startswith("python exception:")]
        what = "; ".join([*dict.fromkeys(diagnostics), *cause[:1]]) or (lines[0] if lines else type(e).__name__)
        raise StandinError(f"{name}: torch-mlir could not lower this graph to StableHLO: {what}") from e
    return str(module)


def default_decompositions() -> dict[Any, Callable[..., Any]]:
    """The decomposition table AOTAutograd applies: core ATen decompositions (TorchNeuron's starting point too) as
    torch-mlir's FX path expands them (`torch_mlir.extras.fx_decomp_util`). Nothing in it is specific to this
    engine: the engine's graphs must lower without engine-specific decompositions."""
    from torch_mlir.extras.fx_decomp_util import get_decomposition_table

    return dict(get_decomposition_table())


def module_problems(text: str) -> list[str]:
    """What a lowered module must not contain: float8/float4 element types (neuronx-cc rejects f8 operands on
    trn2, NCC_EVRF051) and torch-dialect ops or types the lowering left behind. One line per kind found."""
    out = []
    f8 = sorted({m.group(0) for m in _F8.finditer(text)})
    if f8:
        out.append(f"float8/float4 types in the module: {', '.join(f8)}")
    torch_ops = sorted({m.group(0).lstrip(" \t\n=(,:!\"") for m in _TORCH_OP.finditer(text)})
    if torch_ops:
        lines = [ln.strip() for ln in text.splitlines() if _TORCH_OP.search(ln)][:3]
        out.append(f"unlowered torch dialect ({', '.join(torch_ops)}...): {' | '.join(lines)}")
    return out


def _op_count(text: str) -> int:
    return sum(1 for ln in text.splitlines() if "stablehlo." in ln or "chlo." in ln)


def _alias_mutations(gm: torch.fx.GraphModule) -> list[int]:
    """TorchNeuron's aliasing pass, for a graph that AOTAutograd made with inference input mutations kept: every
    `copy_(input, value)` into a graph input (a KV-cache write) is removed and `value` appended to the outputs; the
    returned list says which input each extra output belongs to (written back after each call). Anything else that
    mutates is left in place (and will fail to lower, loudly)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {n: i for i, n in enumerate(placeholders)}
    copies = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.copy_.default
              and n.args[0] in index]
    if not copies:
        return []
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    targets = []
    extra = []
    for n in copies:
        dst, src = n.args[0], n.args[1]
        n.replace_all_uses_with(src)  # anything reading the copy's result reads the new value
        gm.graph.erase_node(n)
        targets.append(index[dst])
        extra.append(src)
    outs = out_node.args[0]
    out_node.args = ((*outs, *extra) if isinstance(outs, (tuple, list)) else (outs, *extra),)
    gm.graph.lint()
    gm.recompile()
    return targets


def _lift_constants(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    """Tensor constants of the graph (`get_attr`: lookup tables, index tensors made at trace time) become trailing
    graph inputs, passed at every call: torch-mlir would embed them as `dense_resource` blobs, which XLA does not
    read (and a device graph would carry them in its program instead of as device data)."""
    consts = []
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1:]
    for n in list(gm.graph.nodes):
        if n.op != "get_attr":
            continue
        value = gm
        for part in str(n.target).split("."):
            value = getattr(value, part)
        if not isinstance(value, torch.Tensor):
            continue
        where = gm.graph.inserting_after(last[0]) if last else gm.graph.inserting_before(next(iter(gm.graph.nodes)))
        with where:
            ph = gm.graph.placeholder(f"const_{len(consts)}")
        ph.meta = dict(n.meta)
        if "val" not in ph.meta:
            fake = torch._guards.detect_fake_mode()
            ph.meta["val"] = fake.from_tensor(value) if fake is not None else value
        n.replace_all_uses_with(ph)
        gm.graph.erase_node(n)
        last = [ph]
        consts.append(value)
    if consts:
        gm.graph.lint()
        gm.recompile()
    return consts


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)


def _static_shapes(name: str, tensors: Sequence[Any]) -> list[tuple[tuple[int, ...], str]]:
    shapes = []
    for i, t in enumerate(tensors):
        if isinstance(t, torch.SymInt) or (isinstance(t, torch.Tensor) and any(
                isinstance(s, torch.SymInt) for s in t.shape)):
            raise StandinError(f"{name}: input {i} has a dynamic shape ({getattr(t, 'shape', t)}); the TorchNeuron "
                               "pipeline compiles static shapes only (torch.compile(dynamic=False), pad to a bucket)")
        if isinstance(t, torch.Tensor):
            shapes.append((tuple(int(s) for s in t.shape), str(t.dtype).removeprefix("torch.")))
    return shapes


class _Executable:
    """A compiled XLA executable called with torch tensors: inputs by DLPack, outputs back by DLPack, then the
    aliased outputs copied into the mutated inputs."""

    def __init__(self, exe: Any, n_out: int, mutated: list[int], consts: list[torch.Tensor],
                 stats: StandinStats, count: bool = True) -> None:
        import jax

        self._exe, self._n_out, self._mutated, self._stats, self._count = exe, n_out, mutated, stats, count
        self._consts = consts
        self._from_dlpack = jax.dlpack.from_dlpack

    def _arg(self, t: torch.Tensor) -> Any:
        if not t.is_contiguous():
            t = t.contiguous()
        return self._from_dlpack(t.detach())

    def __call__(self, args: list[Any]) -> list[Any]:
        tensors = list(args)
        args.clear()  # boxed calling convention: the caller's list is ours to empty
        res = self._exe.execute_sharded([self._arg(t) for t in (*tensors, *self._consts)])
        outs = [torch.from_dlpack(a[0]) for a in res.disassemble_into_single_device_arrays()]
        for i, new in zip(self._mutated, outs[self._n_out:], strict=True):
            tensors[i].copy_(new)
        if self._count:  # a piece of a split graph: the split graph counts its execution once
            self._stats.executions += 1
        return outs[: self._n_out]


class StandinPipeline:
    """The stand-in compile step. `pipeline(gm, example_inputs)` is a Dynamo backend (`torch.compile(fn,
    backend=pipeline, dynamic=False)`); `compile_fn` / `compile_region` wrap functions and engine regions the way
    a Backend does. `stats` counts graphs compiled, executions, compile seconds and eager fallbacks; `dump_dir`
    receives each graph's StableHLO text as `<name>.mlir`. `compile_xla=False` stops after the lowering and its checks
    (what `deepinfer compile` writes): the graph then runs eagerly, as AOTAutograd traced it."""

    def __init__(self, *, fallback: bool = False, dump_dir: str | Path | None = None,
                 decompositions: dict[Any, Callable[..., Any]] | None = None, fullgraph: bool = True,
                 compile_xla: bool = True) -> None:
        get_backend, get_compile_options = _imports()
        self._client = get_backend("cpu")
        from jaxlib import _jax

        self._devices = _jax.DeviceList(tuple(self._client.devices()[:1]))
        self._options = get_compile_options(num_replicas=1, num_partitions=1)
        self.fallback, self.fullgraph, self.compile_xla = fallback, fullgraph, compile_xla
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        self.decompositions = default_decompositions() if decompositions is None else decompositions
        self.stats = StandinStats()
        self._names: dict[str, int] = {}

    # -- the Dynamo backend ----------------------------------------------------------------------------------------
    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], name: str = "graph") -> Callable:
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified

        name = self._unique(name)
        record = GraphRecord(name=name, inputs=_static_shapes(name, example_inputs))

        def fw_compiler(fw: torch.fx.GraphModule, fw_inputs: list[Any]) -> Callable:
            try:
                return self._compile(fw, fw_inputs, record)
            except Exception as e:  # noqa: BLE001 - every lowering failure is either raised or counted
                err = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                if not self.fallback:
                    if isinstance(e, StandinError):
                        raise
                    raise StandinError(f"{name}: the TorchNeuron stand-in could not compile this graph ({err})") from e
                record.fallback = err
                self.stats.fallbacks += 1
                self.stats.graphs.append(record)
                return make_boxed_func(fw.forward)

        problems = source_problems(gm)
        if problems:
            raise StandinError(f"{name}: {len(problems)} pattern(s) Neuron's lowering gets wrong: "
                               + "; ".join(problems[:5]))
        t0 = time.perf_counter()
        out = aot_module_simplified(gm, example_inputs, fw_compiler=fw_compiler, decompositions=self.decompositions,
                                    keep_inference_input_mutations=True)
        record.lower_s = time.perf_counter() - t0 - record.xla_s  # AOTAutograd's tracing + torch-mlir
        if record.fallback is None:
            self.stats.compile_s += record.compile_s
        return out

    def _unique(self, name: str) -> str:
        k = self._names.get(name, 0)
        self._names[name] = k + 1
        return name if k == 0 else f"{name}.{k}"

    def _compile(self, fw: torch.fx.GraphModule, fw_inputs: list[Any], record: GraphRecord,
                 piece: bool = False) -> Callable:
        """One graph through the checks, torch-mlir and XLA; a graph with kernel custom ops is split at them and
        each pure piece comes back here (`piece=True`: counted as a piece, not as a graph)."""
        from engine.backends.standin_split import compile_split, custom_op_nodes

        if not piece and custom_op_nodes(fw):
            run = compile_split(self, fw, record)
            if self.compile_xla:
                self.stats.graphs_compiled += 1
            else:
                self.stats.graphs_lowered += 1
            self.stats.graphs.append(record)
            return run
        record.inputs = record.inputs or _static_shapes(record.name, [n.meta.get("val") for n in fw.graph.nodes
                                                                      if n.op == "placeholder"])
        _static_shapes(record.name, [n.meta.get("val") for n in fw.graph.nodes if n.op == "placeholder"])
        out_node = next(n for n in fw.graph.nodes if n.op == "output")
        outs = out_node.args[0]
        n_out = len(outs) if isinstance(outs, (tuple, list)) else 1
        if any(not isinstance(o, torch.fx.Node) for o in (outs if isinstance(outs, (tuple, list)) else [outs])):
            raise StandinError(f"{record.name}: a graph output is not a tensor ({outs})")
        original, fw = fw, _copy(fw)  # the passes below edit the graph; a fallback runs the untouched one
        problems = graph_problems(fw)  # the engine patterns upstream torch-mlir drops or mis-lowers, by name
        if problems:
            raise StandinError(f"{record.name}: {len(problems)} pattern(s) that do not lower to StableHLO as meant: "
                               + "; ".join(problems[:5]))
        mutated = _alias_mutations(fw)
        consts = _lift_constants(fw)  # after the aliasing pass: the inputs it indexes keep their positions
        t0 = time.perf_counter()
        text = _lower(fw, record.name)
        record.mlir_s = time.perf_counter() - t0
        record.ops, record.mutated_inputs = _op_count(text), len(mutated)
        if self.dump_dir is not None:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            path = self.dump_dir / f"{record.name}.mlir"
            path.write_text(text)
            record.mlir = str(path)
        problems = module_problems(text)
        if problems:
            raise StandinError(f"{record.name}: lowered module fails the stand-in's checks: {'; '.join(problems)}")
        if not self.compile_xla:
            from functorch.compile import make_boxed_func

            if piece:
                self.stats.pieces_compiled += 1
            else:
                self.stats.graphs_lowered += 1
            self.stats.graphs.append(record)
            return make_boxed_func(original.forward)
        t1 = time.perf_counter()
        try:
            exe = self._client.compile_and_load(text, self._devices, self._options)
        except Exception as e:
            raise StandinError(f"{record.name}: XLA's CPU compiler rejected the StableHLO module: "
                               f"{str(e).strip().splitlines()[0][:400]}") from e
        record.xla_s = time.perf_counter() - t1
        if piece:
            self.stats.pieces_compiled += 1
        else:
            self.stats.graphs_compiled += 1
        self.stats.graphs.append(record)
        run = _Executable(exe, n_out, mutated, consts, self.stats, count=not piece)
        run._boxed_call = True  # AOTAutograd calls it with one list (the boxed convention)
        return run

    # -- what a Backend does with it -------------------------------------------------------------------------------
    def compile_fn(self, fn: Callable[..., Any], name: str, fullgraph: bool | None = None) -> Callable[..., Any]:
        """`fn` as one stand-in graph per static input shape (`fullgraph`: a graph break is an error)."""
        full = self.fullgraph if fullgraph is None else fullgraph
        return torch.compile(fn, backend=_Named(self, name), dynamic=False, fullgraph=full)

    def compile_region(self, region: Any, fullgraph: bool | None = None) -> Callable[..., Any]:
        """An engine region (engine/regions.py) as a stand-in graph over its meta-parameter template, each layer's
        tensors passed in by `functional_call` (as HostBackend.compile_region): one graph per structure and shape.
        A timed region (its `split` is a boundary, a deliberate graph break) is compiled without fullgraph."""
        from engine.profiling import no_split

        if fullgraph is None:
            fullgraph = self.fullgraph and region.split is no_split
        template = region.template()

        def run(params: dict[str, torch.Tensor], *args: Any) -> Any:
            return torch.func.functional_call(template, params, args)

        name = "region_" + "_".join(str(s) for s in region.structure())
        graph = self.compile_fn(run, name, fullgraph)
        return lambda reg, *args: graph(reg.params(), *args)


class _Named:
    """The pipeline as a Dynamo backend that names the graphs it compiles."""

    def __init__(self, pipeline: StandinPipeline, name: str) -> None:
        self.pipeline, self.name = pipeline, name

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        return self.pipeline(gm, example_inputs, name=self.name)


_DEFAULT: StandinPipeline | None = None


def standin_compile(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
    """The stand-in as a plain Dynamo backend function (`torch.compile(fn, backend=standin_compile,
    dynamic=False)`), over one process-wide pipeline (`default_pipeline()`: its stats, raise on failure)."""
    return default_pipeline()(gm, example_inputs)


def default_pipeline() -> StandinPipeline:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = StandinPipeline()
    return _DEFAULT
