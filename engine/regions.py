"""Region graphs for the decode step (`EngineConfig.graph.mode`; `--graph-mode`, default DEEPINFER_NEURON_GRAPH_MODE).

A **region** is a piece of one decoder layer compiled as one graph by the backend (engine/backends/):
* `regions` mode, two per layer: `attn` = mHC collapse, attn_norm, q/kv, compressor(s), indexer, sparse attention,
  output projection, mHC expand; `moe` = mHC collapse, ffn_norm, gate, experts, shared expert, exchange, mHC expand;
* `layer` mode, one per layer (`layer` = attn then moe): half the graph launches;
* `eager` mode: no graphs (the engine's eager path, unchanged).
Only pure-decode steps (every sequence one new token) run as regions; steps with prefill chunks run eagerly.

**Static shapes.** The batch is padded to a bucket (`BATCH_BUCKETS`) and the block tables to a power-of-two number
of blocks (capped by max_model_len), so each region compiles once per (batch bucket, block bucket) and is reused.
Padded rows point at the cache's scratch slot and scratch block (KVCache(scratch=True)); attention's static variant
(`Attention.decode_static`) gathers every entry the tables can hold and masks by position, and writes that must not
happen go to the scratch slot/block, so there is no host sync and no data-dependent shape inside a graph.
**Lazy cache views.** A region gets the root tensors of its layer's compress ratio (`KVCache.roots[m]`) and slices
its layer inside the graph (`KVCache.layer_view`), instead of a dozen per-layer tensors.

**Stages.** Region code calls `split(stage)` at stage boundaries (`attn.qkv`, `attn.compress`, `attn.index`,
`attn.core`, `attn.out`, `moe.gate`, `moe.experts`, `moe.exchange`, ...). Timing off, `split` is `no_split` and
compiles away. Timing on, `split` is the timer's boundary wrapped by `backend.boundary` (a graph break on the host),
so the region runs stage by stage with a synchronize() and a clock read at every boundary.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from engine.backends import Backend
from engine.config import BATCH_BUCKETS, GraphMode
from engine.model.cache import KVCache, SeqStep
from engine.model.model import Block, Transformer
from engine.profiling import RegionTimer, no_split


def batch_bucket(n: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> int:
    """Smallest bucket >= n (beyond the largest bucket: the next multiple of it)."""
    for b in buckets:
        if b >= n:
            return b
    return -(-n // buckets[-1]) * buckets[-1]


def block_bucket(n: int, max_blocks: int) -> int:
    """Power of two >= n, capped at max_blocks (the block-table width a region is compiled for)."""
    b = 1
    while b < n:
        b *= 2
    return max(n, min(b, max_blocks))


def _attn(blk: Block, cache: KVCache, split: Callable[[str], None], x: torch.Tensor, roots: dict[str, torch.Tensor],
          pos: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    lc = cache.layer_view(blk.layer_id, roots)
    return blk.hc_site(x, "attn", lambda h: blk.attn.decode_static(h, pos, slots, tables, lc, split), split)


def _moe(blk: Block, split: Callable[[str], None], x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    return blk.hc_site(x, "ffn", lambda h: blk.ffn.forward_static(h, input_ids, split), split)


def attn_region(blk: Block, cache: KVCache, split: Callable[[str], None], x: torch.Tensor,
                roots: dict[str, torch.Tensor], pos: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                input_ids: torch.Tensor) -> torch.Tensor:
    """The attention half of layer `blk`: streams x [B, n, dim] -> [B, n, dim] (B a bucket)."""
    return _attn(blk, cache, split, x, roots, pos, slots, tables)


def moe_region(blk: Block, cache: KVCache, split: Callable[[str], None], x: torch.Tensor,
               roots: dict[str, torch.Tensor], pos: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
               input_ids: torch.Tensor) -> torch.Tensor:
    """The MoE half of layer `blk`: x [B, n, dim] -> [B, n, dim]."""
    return _moe(blk, split, x, input_ids)


def layer_region(blk: Block, cache: KVCache, split: Callable[[str], None], x: torch.Tensor,
                 roots: dict[str, torch.Tensor], pos: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                 input_ids: torch.Tensor) -> torch.Tensor:
    """The whole decoder layer as one region: attention half then MoE half."""
    return _moe(blk, split, _attn(blk, cache, split, x, roots, pos, slots, tables), input_ids)


_REGION_FNS = {"attn": attn_region, "moe": moe_region, "layer": layer_region}


class RegionRunner:
    """Runs pure-decode steps of `model` as region graphs over `cache` (which must have a scratch slot/block).

    `launches` counts graph calls; `launches_last_step` is the count of the latest step (2 x layers in `regions`
    mode, 1 x layers in `layer` mode). `compiled` records each (region, layer, batch bucket, block bucket) seen."""

    def __init__(self, model: Transformer, cache: KVCache, mode: GraphMode | str, backend: Backend, max_blocks: int,
                 timer: RegionTimer | None = None, buckets: tuple[int, ...] = BATCH_BUCKETS) -> None:
        mode = GraphMode.parse(mode, "graph mode")
        if mode is GraphMode.EAGER:
            raise ValueError("graph mode 'eager': RegionRunner runs 'regions' or 'layer'")
        if not cache.scratch:
            raise ValueError("region graphs need KVCache(scratch=True) (padded rows write to the scratch slot)")
        self.model, self.cache, self.mode, self.backend = model, cache, mode, backend
        self.max_blocks, self.buckets = max_blocks, buckets
        self.timer = timer
        self.kinds = ("layer",) if mode is GraphMode.LAYER else ("attn", "moe")
        self._graphs: dict[tuple[str, int, bool], Callable[..., torch.Tensor]] = {}
        self._boundary = backend.boundary(self._split)  # kept out of graphs; used only by the timed graphs
        self.launches = 0
        self.launches_last_step = 0
        self.compiled: set[tuple[str, int, int, int]] = set()

    def _split(self, stage: str) -> None:
        if self.timer is not None:
            self.timer.split(stage)

    def _graph(self, kind: str, blk: Block, timed: bool) -> Callable[..., torch.Tensor]:
        key = (kind, blk.layer_id, timed)
        fn = self._graphs.get(key)
        if fn is None:
            split = self._boundary if timed else no_split
            fn = self.backend.compile(functools.partial(_REGION_FNS[kind], blk, self.cache, split))
            self._graphs[key] = fn
        return fn

    def prepare(self, steps: list[SeqStep], input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Padded static inputs: pos, slots, tables [Bp, NB], ids [Bp] (Bp = batch bucket, NB = block bucket)."""
        b = len(steps)
        bp = batch_bucket(b, self.buckets)
        bs = self.cache.block_size
        nb = block_bucket(max(s.start // bs + 1 for s in steps), self.max_blocks)
        scratch_slot, scratch_block = self.cache.num_slots, self.cache.num_blocks
        pos = torch.zeros(bp, dtype=torch.long)
        slots = torch.full((bp,), scratch_slot, dtype=torch.long)
        tables = torch.full((bp, nb), scratch_block, dtype=torch.long)
        ids = torch.zeros(bp, dtype=torch.long)
        for i, s in enumerate(steps):
            pos[i], slots[i], ids[i] = s.start, s.slot, input_ids[s.token_start]
            bt = s.block_table[:nb]
            tables[i, : len(bt)] = bt
        return pos, slots, tables, ids

    def decode_step(self, steps: list[SeqStep], input_ids: torch.Tensor) -> torch.Tensor:
        """One decode step (every step n == 1) -> final streams [T, n, dim] in input_ids order."""
        timer = self.timer
        timed = timer is not None and timer.enabled
        region = timer.region if timer is not None else None
        if region is None:
            pos, slots, tables, ids = self.prepare(steps, input_ids)
            x = self.model.streams(ids)  # [Bp, n, dim]
        else:
            with region("embed"):
                pos, slots, tables, ids = self.prepare(steps, input_ids)
                x = self.model.streams(ids)  # [Bp, n, dim]
        n_launch = 0
        for blk in self.model.layers:
            roots = self.cache.roots[self.cache.where[blk.layer_id][0]]
            for kind in self.kinds:
                fn = self._graph(kind, blk, timed)
                self.compiled.add((kind, blk.layer_id, pos.shape[0], tables.shape[1]))
                if region is None:
                    x = fn(x, roots, pos, slots, tables, ids)
                else:
                    with region(kind, blk.layer_id):
                        x = fn(x, roots, pos, slots, tables, ids)
                n_launch += 1
        self.launches += n_launch
        self.launches_last_step = n_launch
        rows = torch.tensor([s.token_start for s in steps])
        out = torch.empty(len(steps), *x.shape[1:], dtype=x.dtype)
        out[rows] = x[: len(steps)]
        return out


def region_summary(runner: Any) -> dict[str, Any]:
    """Graph facts of a ModelRunner for results metadata."""
    rr = getattr(runner, "regions", None)
    if rr is None:
        return {"graph_mode": "eager", "graph_launches_per_step": 0}
    return {"graph_mode": str(rr.mode), "graph_launches_per_step": rr.launches_last_step,
            "graph_backend": f"{rr.backend.name}:{getattr(rr.backend, 'compiler', '')}",
            "compiled_shapes": len(rr.compiled)}
