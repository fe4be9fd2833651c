"""Every graph an engine's step can run, compiled one by one for `deepinfer compile` on the TorchNeuron backends.

The graphs are those the runner's RegionRunner knows (engine/regions.py): each decode region structure (layer or
attn / moe, by compress ratio and hash routing) at every (batch bucket, block bucket) the config allows, the embedding
and the head at every batch bucket; the prefill chunk-region structures at every (batch bucket, chunk bucket, block
bucket) a chunk run can take, with the chunk embedding and head (`chunk_specs`); and any further graph a RegionRunner
lists through `export_specs(runner)` (each a `GraphSpec`). Each graph gets valid inputs of its
static shape (the engine's own weights, a fresh KV cache of the engine's sizes, a packed step of in-range positions,
slots and blocks) and is compiled on its own by a fresh `torch.compile(fullgraph=True, dynamic=False)`:

* `--backend neuron-standin`: the stand-in pipeline lowers it to StableHLO (no XLA compile), checks the module (no
  f8 type, no unlowered torch op) and writes `<graph>.mlir`; the graph then runs eagerly on the CPU. With the kernel
  table (`--kernels stand-in`) a graph holding kernel ops is cut at them (engine/backends/standin_split.py): its
  pieces are written as `<graph>.p<k>.mlir` (the row's `mlir` lists them; `pieces`, `custom_ops` count them);
* `--backend neuron`: TorchNeuron in compile-only mode (TORCH_NEURONX_COMPILE_ONLY=1,
  NEURON_PLATFORM_TARGET_OVERRIDE=trn2, set before the engine is built: `compile_only_env`) runs the whole lowering
  and neuronx-cc and executes nothing; each graph is named (`options={"model_name": ...}`), compilation artifacts
  are kept under `<out>/artifacts` (TORCH_NEURONX_DEBUG_DIR, set before the engine is built), and a failure's NCC
  error code (NCC_XXXNNN) is read from the error or from that graph's artifact logs.

One manifest row per graph: name, region, structure, buckets, inputs (name, shape, dtype), status (pass / fail),
seconds, error (first line), ncc_error, and on the stand-in the .mlir path, op count and has_fp8. A failing graph
does not stop the others. Written, not run: the neuron path (no Neuron SDK here).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.backends.xla_export import (
    check_selection,
    edge_graph_inputs,
    edge_meta,
    head_params,
    region_graph_inputs,
    selected,
)

NCC_CODE = re.compile(r"NCC_[A-Z]+\d+")

# where TorchNeuron writes its compile artifacts (NEFFs, logs); the SDK fixes the folder at the first compile
DEBUG_DIR = "TORCH_NEURONX_DEBUG_DIR"


@dataclass
class GraphSpec:
    """One graph: `fn(*args)` runs it (static shapes); `meta` goes to the manifest; `inputs` names its tensors."""

    name: str
    fn: Callable[..., Any]
    args: tuple
    meta: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


def _describe(named: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    return [{"name": k, "shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in named.items()]


def _region_fn(reg: Any) -> Callable[..., Any]:
    template = reg.template()

    def run(params: dict[str, torch.Tensor], x: torch.Tensor, roots: dict[str, torch.Tensor], li: torch.Tensor,
            packed: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(template, params, (x, roots, li, packed))

    return run


def _region_specs(inputs: Any) -> list[GraphSpec]:
    """One spec per (structure, shape) of `inputs` (xla_export.region_graph_inputs / chunk_graph_inputs); the
    layers of a structure share one traced function."""
    specs, fns = [], {}
    for name, structure, reg, li, x, roots, packed, meta in inputs:
        if structure not in fns:
            fns[structure] = _region_fn(reg)
        params = reg.params()
        specs.append(GraphSpec(name, fns[structure], (params, x, roots, li, packed), meta,
                               {"x": x, "packed": packed, "layer_index": li,
                                **{f"root.{k}": v for k, v in roots.items()}, **params}))
    return specs


def decode_specs(runner: Any) -> list[GraphSpec]:
    """The decode graphs of `runner` (graph mode regions | layer): region structures x decode shapes, embed and head
    per batch bucket."""
    rr = runner.regions
    if rr is None:
        raise ValueError("deepinfer compile writes region graphs: use --graph-mode regions or layer")
    model = runner.model
    specs = _region_specs(region_graph_inputs(runner))
    for bp, packed, x in edge_graph_inputs(runner):
        specs.append(GraphSpec(f"embed_b{bp}", lambda packed: model.streams(packed[:, 2]), (packed,),
                               edge_meta("embed", bp), {"packed": packed, "embed.weight": model.embed.weight}))
        specs.append(GraphSpec(f"head_b{bp}", model.logits, (x,), edge_meta("head", bp),
                               {"x": x, **head_params(model)}))
    return specs


def chunk_specs(runner: Any) -> list[GraphSpec]:
    """The prefill graphs: chunk-region structures x chunk shapes (batch bucket x chunk bucket x block bucket), the
    chunk embedding and the chunk head (each entry's last row) per (batch bucket, chunk bucket) - what a graph
    backend runs a prefill chunk (or a verify step) as."""

    from engine.backends.xla_export import chunk_edge_inputs, chunk_graph_inputs

    rr, model = runner.regions, runner.model
    specs = _region_specs(chunk_graph_inputs(runner))
    for bp, c, packed, x in chunk_edge_inputs(runner):
        edge = {"structure": [], "ratio": None, "batch_bucket": bp, "chunk_bucket": c, "block_bucket": None}
        specs.append(GraphSpec(f"chunk_embed_b{bp}_c{c}", rr.chunk_embed_fn(c), (packed,),
                               {"region": "chunk.embed", **edge},
                               {"packed": packed, "embed.weight": model.embed.weight}))
        specs.append(GraphSpec(f"chunk_head_b{bp}_c{c}", rr._last_logits, (x, packed),
                               {"region": "chunk.head", **edge}, {"x": x, "packed": packed, **head_params(model)}))
    return specs


def graph_specs(runner: Any, graphs: Sequence[str] = ()) -> list[GraphSpec]:
    """Every graph a step of the runner can run: the decode graphs, the prefill chunk graphs where the engine runs
    chunks as graphs (GraphConfig.chunk_graphs), then whatever the RegionRunner lists itself (`export_specs`); or
    those of them `graphs` selects (glob patterns of names; one that names none is an error, before any compile)."""
    specs = decode_specs(runner) + (chunk_specs(runner) if runner.config.graph.chunk_graphs else [])
    extra = getattr(runner.regions, "export_specs", None)
    if extra is not None:
        specs.extend(extra(runner))
    check_selection([s.name for s in specs], graphs)
    return [s for s in specs if selected(s.name, graphs)]


def compile_each(be: Any, specs: list[GraphSpec], dynamo_backend: Callable[[str], Any],
                 after: Callable[[GraphSpec, dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Compile (and call) every graph on its own through `dynamo_backend(name)`; one manifest row each. A failure is
    recorded (first line of the error, its NCC code if it names one) and the next graph goes on."""
    from engine.backends.host import _raise_recompile_limit

    _raise_recompile_limit()  # every graph is a new cache entry of the same few code objects
    rows = []
    for spec in specs:
        graph = torch.compile(spec.fn, backend=dynamo_backend(spec.name), dynamic=False, fullgraph=True)
        row: dict[str, Any] = {"graph": spec.name, **spec.meta, "inputs": _describe(spec.inputs)}
        t0 = time.perf_counter()
        try:
            with be.grad_context():
                graph(*spec.args)
            row.update(status="pass", error=None, ncc_error=None)
        except Exception as e:  # noqa: BLE001 - one graph's failure is a row of the report, not the end of it
            root = getattr(e, "inner_exception", None) or e  # Dynamo wraps a compiler's error (BackendCompilerFailed)
            text = str(root).strip()
            first = text.splitlines()[0][:400] if text else type(root).__name__
            code = NCC_CODE.search(text) or NCC_CODE.search(str(e))
            row.update(status="fail", error=f"{type(root).__name__}: {first}",
                       ncc_error=code.group(0) if code else None)
        row["seconds"] = round(time.perf_counter() - t0, 3)
        row["_t0"] = t0
        if after is not None:
            after(spec, row)
        row.pop("_t0")
        rows.append(row)
    return rows


def export_standin(be: Any, runner: Any, out: Path, graphs: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The stand-in: every graph lowered to StableHLO under `out` (`<graph>.mlir`), checked, not XLA-compiled."""
    from engine.backends.standin_pipeline import StandinPipeline, _Named, module_problems

    out.mkdir(parents=True, exist_ok=True)
    pipe = StandinPipeline(dump_dir=out, compile_xla=False)

    def after(spec: GraphSpec, row: dict[str, Any]) -> None:
        rec = next((r for r in reversed(pipe.stats.graphs) if r.name == spec.name), None)
        if rec is not None and rec.pieces:  # a graph with kernel ops (--kernels stand-in): its pieces' modules
            files = [Path(r.mlir) for r in pipe.stats.graphs if r.name.startswith(f"{spec.name}.p") and r.mlir]
        else:
            files = [Path(rec.mlir)] if rec is not None and rec.mlir else []
        problems = [p for f in files if f.exists() for p in module_problems(f.read_text())]
        row.update(mlir=str(files[0]) if len(files) == 1 and not (rec and rec.pieces) else
                   ([str(f) for f in files] or None), ops=rec.ops if rec is not None else None,
                   lower_s=round(rec.lower_s, 3) if rec is not None else None,
                   pieces=rec.pieces if rec is not None else None,
                   custom_ops=rec.custom_ops if rec is not None else None,
                   has_fp8=any("float8" in p for p in problems), problems=problems or None)

    return compile_each(be, graph_specs(runner, graphs), lambda name: _Named(pipe, name), after)


def export_neuron(be: Any, runner: Any, out: Path, graphs: Sequence[str] = ()) -> list[dict[str, Any]]:
    """TorchNeuron in compile-only mode: every graph through neuronx-cc for trn2, nothing executed, each named
    (`options={"model_name": <graph>}`); the NCC code of a failure from its error text, else from the artifact logs
    of that graph (by name, else written while it compiled) under TORCH_NEURONX_DEBUG_DIR, which must have been set
    before anything compiled (`compile_only_env`: the SDK fixes the folder at the first compile)."""
    from engine.envs import get_envs

    if not be.compile_only:
        raise ValueError("deepinfer compile --backend neuron compiles only: TORCH_NEURONX_COMPILE_ONLY=1 must be set "
                         "before the engine is built (bench/compile.py does; scripts/trn2_compile.sh too)")
    folder = dict(get_envs().recorded).get(DEBUG_DIR)
    if folder is None:
        raise ValueError(f"deepinfer compile --backend neuron: {DEBUG_DIR} must be set before the engine is built "
                         "(the SDK fixes the artifact folder at the first compile)")
    artifacts = Path(folder)
    artifacts.mkdir(parents=True, exist_ok=True)

    def after(spec: GraphSpec, row: dict[str, Any]) -> None:
        row["has_fp8"] = None  # neuronx-cc's verdict is the status (NCC_EVRF051 names an f8 operand)
        if row["status"] == "fail" and row["ncc_error"] is None:
            row["ncc_error"] = ncc_code_in(artifacts, since=row["_t0"], name=spec.name)

    return compile_each(be, graph_specs(runner, graphs), be._dynamo_backend, after)


def ncc_code_in(folder: Path, since: float, name: str | None = None) -> str | None:
    """The first NCC error code in the text files under `folder` whose path names graph `name` (the SDK names its
    artifacts by the graph's model_name, lower-cased), else in those modified after `since` (time.perf_counter clock
    is not the file clock: compared as wall time via the offset at call)."""
    offset = time.time() - time.perf_counter()
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    named = [p for p in files if name is not None and name.lower() in str(p.relative_to(folder)).lower()]
    recent = [p for p in files if p.stat().st_mtime >= since + offset - 1]
    for path in named or recent:
        try:
            found = NCC_CODE.search(path.read_text(errors="ignore"))
        except OSError:
            continue
        if found:
            return found.group(0)
    return None
