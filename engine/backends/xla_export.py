"""The decode graphs of an engine on the xla backend as HLO modules for neuronx-cc (`deepinfer compile`,
through `XlaBackend.export_graphs`).

For every graph a decode step runs - each region structure (engine/regions.py `Region.structure`) at every
(batch bucket, block bucket) the engine's config allows, plus the embedding and the head at every batch bucket -
the graph is traced lazily on the XLA device with the engine's own weights and a fresh KV cache of the engine's
sizes as device data (so they are graph parameters, as in a real step), and written as the HLO module text and the
serialized `xla.HloModuleProto` (`<name>.hlo.txt`, `<name>.hlo.pb`). Nothing is executed. `manifest.json` lists
each graph: region, structure, buckets, input names/shapes/dtypes, the sha256 of its proto, and whether any f8
element type appears (neuronx-cc rejects fp8 graph inputs: weights must arrive as uint8 bytes).
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.model.cache import KVCache
from engine.regions import engine_chunk_shapes, engine_decode_shapes

_F8 = re.compile(r"\bf8e\w*\[")


def packed_inputs(runner: Any, bp: int, nb: int) -> torch.Tensor:
    """Valid inputs of the static shape: row i at position i in slot i (or the scratch slot), scratch blocks."""
    cache = runner.cache
    packed = torch.zeros(bp, 3 + nb, dtype=torch.long)
    packed[:, 0] = torch.arange(bp)
    packed[:, 1] = torch.arange(bp).clamp(max=cache.num_slots)
    packed[:, 2] = torch.arange(bp) % runner.cfg.vocab_size
    packed[:, 3:] = cache.num_blocks
    return packed.to(runner.device)


def fresh_cache(runner: Any) -> KVCache:
    c = runner.cache
    layer_ids = list(c.where)
    return KVCache(runner.cfg, c.num_slots, c.num_blocks, c.block_size, runner.dtype, layer_ids, cp=runner.par.cp,
                   device=runner.device, scratch=True, spare=c.spare)


def _inputs(named: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    return [{"name": k, "shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in named.items()]


def selected(name: str, graphs: Sequence[str]) -> bool:
    """Whether graph `name` is one `deepinfer compile --graphs` asks for (glob patterns; none: every graph)."""
    return not graphs or any(fnmatch.fnmatchcase(name, p) for p in graphs)


class GraphSelectionError(ValueError):
    """A `deepinfer compile --graphs` pattern that names none of the engine's graphs."""


def check_selection(names: Sequence[str], graphs: Sequence[str]) -> None:
    """A --graphs pattern that names none of the graphs is a GraphSelectionError, with the names there are."""
    unmatched = [p for p in graphs if not any(selected(n, (p,)) for n in names)]
    if unmatched:
        raise GraphSelectionError(f"--graphs {','.join(unmatched)}: matches none of this engine's {len(names)} "
                                  f"graphs ({', '.join(names)})")


def export_decode_graphs(be: Any, runner: Any, out_dir: str | Path, graphs: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Write every decode graph of `runner` (a ModelRunner of XLA backend `be`, in graph mode regions|layer) to
    `out_dir`, or those `graphs` selects (glob patterns of names: `selected`; a pattern that names none is an error
    once the others are written: the names come as the graphs are made); returns the manifest rows."""
    rr = runner.regions
    if rr is None:
        raise ValueError("deepinfer compile traces region graphs: use --graph-mode regions or layer")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    names = []
    model = runner.model

    def emit(name: str, fn: Any, meta: dict[str, Any], inputs: dict[str, torch.Tensor]) -> None:
        names.append(name)
        if not selected(name, graphs):
            return
        with be.grad_context():
            text, proto = be.trace_hlo(fn)
        (out / f"{name}.hlo.txt").write_text(text)
        (out / f"{name}.hlo.pb").write_bytes(proto)
        rows.append({"graph": name, **meta, "inputs": _inputs(inputs), "hlo_bytes": len(proto),
                     "sha256": hashlib.sha256(proto).hexdigest(), "has_fp8": bool(_F8.search(text))})

    for name, _, reg, li, x, roots, packed, meta in region_graph_inputs(runner):
        emit(name, lambda reg=reg, li=li, roots=roots, x=x, p=packed: [reg(x, roots, li, p), *roots.values()], meta,
             {"x": x, "packed": packed, "layer_index": li, **{f"root.{k}": v for k, v in roots.items()},
              **reg.params()})
    for bp, packed, x in edge_graph_inputs(runner):
        emit(f"embed_b{bp}", lambda packed=packed: [model.streams(packed[:, 2])], edge_meta("embed", bp),
             {"packed": packed, "embed.weight": model.embed.weight})
        emit(f"head_b{bp}", lambda x=x: [model.logits(x)], edge_meta("head", bp), {"x": x, **head_params(model)})
    check_selection(names, graphs)
    return rows


def region_graph_inputs(runner: Any) -> Iterator[tuple[str, tuple, Any, Any, torch.Tensor, dict[str, torch.Tensor],
                                                          torch.Tensor, dict[str, Any]]]:
    """Every decode region graph a step can run, with example inputs: (name, structure, region, layer index, x,
    cache roots (a fresh cache each), packed step inputs, meta) per region structure x decode shape (batch bucket x
    block bucket). The one enumeration every graph export walks."""
    rr = runner.regions
    reps = rr.representatives()
    dim, n = runner.cfg.dim, runner.cfg.hc_mult
    for bp, nb in engine_decode_shapes(runner.config):
        packed = packed_inputs(runner, bp, nb)
        x = torch.randn(bp, n, dim, dtype=runner.dtype).to(runner.device)
        for structure, (reg, li) in reps.items():
            roots = fresh_cache(runner).roots[reg.ratio]
            name = f"{'_'.join(map(str, structure))}_b{bp}_nb{nb}".replace("True", "hash").replace("False", "nohash")
            yield name, structure, reg, li, x, roots, packed, {
                "region": reg.kind, "structure": [str(s) for s in structure[1:]], "ratio": reg.ratio,
                "batch_bucket": bp, "block_bucket": nb}


def chunk_packed_inputs(runner: Any, bp: int, c: int, nb: int) -> torch.Tensor:
    """Valid chunk-run inputs of the static shape [bp, 3 + c + nb]: entry i a full chunk of c tokens from position 0
    in slot i (or the scratch slot), scratch blocks (RegionRunner.prepare_chunk's layout)."""
    cache = runner.cache
    packed = torch.zeros(bp, 3 + c + nb, dtype=torch.long)
    packed[:, 1] = c
    packed[:, 2] = torch.arange(bp).clamp(max=cache.num_slots)
    packed[:, 3: 3 + c] = torch.arange(bp * c).reshape(bp, c) % runner.cfg.vocab_size
    packed[:, 3 + c:] = cache.num_blocks
    return packed.to(runner.device)


def chunk_graph_inputs(runner: Any) -> Iterator[tuple[str, tuple, Any, Any, torch.Tensor, dict[str, torch.Tensor],
                                                         torch.Tensor, dict[str, Any]]]:
    """Every prefill chunk-region graph a step can run (engine/regions.py ChunkRegion), with example inputs: as
    `region_graph_inputs`, per chunk structure x chunk shape (batch bucket x chunk bucket x block bucket, the
    scheduler's cap and the workload's reach: `engine.regions.engine_chunk_shapes`)."""
    rr = runner.regions
    reps = rr.representatives(chunk=True)
    dim, n = runner.cfg.dim, runner.cfg.hc_mult
    for bp, c, nb in engine_chunk_shapes(runner.config):
        packed = chunk_packed_inputs(runner, bp, c, nb)
        x = torch.randn(bp * c, n, dim, dtype=runner.dtype).to(runner.device)
        for structure, (reg, li) in reps.items():
            roots = fresh_cache(runner).roots[reg.ratio]
            name = f"{'_'.join(map(str, structure))}_b{bp}_c{c}_nb{nb}".replace("True", "hash").replace(
                "False", "nohash")
            yield name, structure, reg, li, x, roots, packed, {
                "region": f"chunk.{reg.kind}", "structure": [str(s) for s in structure[2:]], "ratio": reg.ratio,
                "batch_bucket": bp, "chunk_bucket": c, "block_bucket": nb}


def chunk_edge_inputs(runner: Any) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """(batch bucket, chunk bucket, packed chunk inputs, streams x [bp*c, n, dim]) for the chunk embed / head graphs
    (their shapes do not depend on the block bucket)."""
    dim, n = runner.cfg.dim, runner.cfg.hc_mult
    for bp, c in sorted({(bp, c) for bp, c, _ in engine_chunk_shapes(runner.config)}):
        yield bp, c, chunk_packed_inputs(runner, bp, c, 1), torch.randn(bp * c, n, dim,
                                                                        dtype=runner.dtype).to(runner.device)


def edge_graph_inputs(runner: Any) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(batch bucket, packed step inputs, streams x) for the embed and head graphs, one per batch bucket."""
    dim, n = runner.cfg.dim, runner.cfg.hc_mult
    for bp in sorted({bp for bp, _ in engine_decode_shapes(runner.config)}):
        yield bp, packed_inputs(runner, bp, 1), torch.randn(bp, n, dim, dtype=runner.dtype).to(runner.device)


def edge_meta(region: str, bp: int) -> dict[str, Any]:
    return {"region": region, "structure": [], "ratio": None, "batch_bucket": bp, "block_bucket": None}


def head_params(model: Any) -> dict[str, torch.Tensor]:
    """The parameters the head graph reads (all but the layers', the draft layers' and the embedding)."""
    return {k: v for k, v in model.named_parameters() if not k.startswith(("layers.", "mtp.", "embed."))}

