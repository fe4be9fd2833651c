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
**Graphs shared across layers.** A region gets the root tensors of its layer's compress ratio flattened over
(layer, slot) and (layer, block) (flattened inside the graph) and its layer index as a device tensor, and offsets its
slot and block indices by it; its weights are the layer's own tensors. So no layer-specific value is a graph
constant: layers of the same structure (attention: compress ratio; MoE: hash routing or not) run the same graph,
and the number of distinct graphs is (region kinds x structures x batch buckets x block buckets), whatever the
number of layers. A backend that captures graphs by tracing with guards on module identity (torch.compile on the
host) compiles one template per structure and feeds each layer's tensors in with `torch.func.functional_call`
(`Backend.compile_region`); a lazy-tensor backend (torch-xla) gets the sharing from its graph cache, with a
`region_end()` (`torch_xla.sync()`) after every region so each region is one graph.

**Stages.** Region code calls `split(stage)` at stage boundaries (`attn.qkv`, `attn.compress`, `attn.index`,
`attn.core`, `attn.out`, `moe.gate`, `moe.experts`, `moe.exchange`, ...). Timing off, `split` is `no_split` and
compiles away. Timing on, `split` is the timer's boundary wrapped by `backend.boundary` (a graph break on the host),
so the region runs stage by stage with a synchronize() and a clock read at every boundary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engine.backends import Backend
from engine.config import BATCH_BUCKETS, GraphMode
from engine.model.block import Block
from engine.model.cache import KVCache, LayerCache, SeqStep
from engine.model.model import Transformer
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


class Region(nn.Module):
    """One region of one decoder layer, as a module over that layer's Block: `forward(x, roots, li, packed)` with
    x [Bp, n, dim] streams -> [Bp, n, dim]. `roots` are the cache's root tensors of the layer's compress ratio
    ([layers of that ratio, slots, ...]; the region flattens (layer, slot) and (layer, block)), `li` the layer's
    index in them as a [1]-shaped device tensor: the region adds li * rows-per-layer to its slot and block indices, so
    nothing layer-specific is a graph constant and layers of the same kind run the same graph."""

    def __init__(self, blk: Block, kind: str, ratio: int, slots_per_layer: int, blocks_per_layer: int,
                 split: Callable[[str], None]) -> None:
        super().__init__()
        self.blk, self.kind, self.split = blk, kind, split
        self.ratio, self.slots_per_layer, self.blocks_per_layer = ratio, slots_per_layer, blocks_per_layer
        self._params: dict[str, torch.Tensor] | None = None
        self.prefixes = {"attn": ("blk.attn.", "blk.attn_norm.", "blk.hc_attn_"),
                         "moe": ("blk.ffn.", "blk.ffn_norm.", "blk.hc_ffn_"), "layer": ("blk.",)}[kind]

    def template(self) -> Region:
        """A region of the same structure over a fresh Block whose parameters are on the meta device (no memory): a
        graph traced over it takes every layer's tensors as inputs (functional_call), and no layer's own tensors
        are baked into it."""
        from engine.model.model import formats_of, use_formats, use_ops

        blk = type(self.blk)(self.blk.cfg, self.blk.layer_id, self.blk.par)
        blk.ffn.capacity, blk.ffn.static_moe = self.blk.ffn.capacity, self.blk.ffn.static_moe
        use_formats(blk, formats_of(self.blk))
        use_ops(blk, self.blk.ops, self.blk.caps)
        if self.blk.ffn._stacked:
            blk.ffn.stack_experts()  # meta buffers of the same names: functional_call swaps the layer's in
        return Region(blk, self.kind, self.ratio, self.slots_per_layer, self.blocks_per_layer, self.split)

    def structure(self) -> tuple:
        """Layers whose regions share a graph: same kind and same structure (attention: compress ratio; MoE: hash
        routing or not; a whole layer: both)."""
        gate_hash = self.blk.ffn.gate.hash
        return {"attn": (self.kind, self.ratio), "moe": (self.kind, gate_hash),
                "layer": (self.kind, self.ratio, gate_hash)}[self.kind]

    def params(self) -> dict[str, torch.Tensor]:
        """This layer's tensors the region reads (the inputs of a shared graph)."""
        if self._params is None:
            tensors = [*self.named_parameters(), *self.named_buffers()]
            # stacked experts run through the stacks (MoE.expert): their per-expert views are not inputs
            skip = ".ffn.experts." if self.blk.ffn._stacked else None
            self._params = {k: v for k, v in tensors if k.startswith(self.prefixes) and not (skip and skip in k)}
        return self._params

    def forward(self, x: torch.Tensor, roots: dict[str, torch.Tensor], li: torch.Tensor,
                packed: torch.Tensor) -> torch.Tensor:
        """`packed` [Bp, 3 + NB] int64: pos, slot, token id, block table (RegionRunner.prepare)."""
        blk, split = self.blk, self.split
        pos, slots, ids, tables = packed[:, 0], packed[:, 1], packed[:, 2], packed[:, 3:]
        roots = {name: t.flatten(0, 1) for name, t in roots.items()}  # (layer, slot) / (layer, block) flattened
        if self.kind in ("attn", "layer"):
            lc = LayerCache(ratio=self.ratio, **roots)
            sl, tl = slots + li * self.slots_per_layer, tables + li * self.blocks_per_layer
            x = blk.hc_site(x, "attn", lambda h: blk.attn.decode_static(h, pos, sl, tl, lc, split), split)
        if self.kind in ("moe", "layer"):
            x = blk.hc_site(x, "ffn", lambda h: blk.ffn.forward_static(h, ids, split), split)
        return x


class RegionRunner:
    """Runs pure-decode steps of `model` as region graphs over `cache` (which must have a scratch slot/block).

    `launches` counts graph calls; `launches_last_step` is the count of the latest step (2 x layers in `regions`
    mode, 1 x layers in `layer` mode). `compiled` records each distinct graph: (region kind, structure, batch
    bucket, block bucket) - its size does not grow with the number of layers."""

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
        boundary = backend.boundary(self._split)  # kept out of graphs; used only by the timed graphs
        dev = backend.device
        self._regions = {timed: [[Region(blk, kind, cache.where[blk.layer_id][0], cache.num_slots + 1,
                                         cache.num_blocks + 1, boundary if timed else no_split)
                                  for kind in self.kinds] for blk in model.layers] for timed in (False, True)}
        # [1]-shaped, not 0-d: torch-xla turns a 0-d tensor holding 0 or 1 into a graph constant, which would give
        # the layers at index 0 and 1 graphs of their own
        self._li = [torch.tensor([cache.where[blk.layer_id][1]], device=dev) for blk in model.layers]
        self._graphs: dict[tuple, Callable[..., torch.Tensor]] = {}
        self._embed = backend.compile_fn(lambda packed: model.streams(packed[:, 2]), "embed")
        self.head = backend.compile_fn(model.logits, "head")  # the runner's head for region steps
        self.launches = 0
        self.launches_last_step = 0
        self.compiled: set[tuple] = set()

    def representatives(self) -> dict[tuple, tuple[Region, torch.Tensor]]:
        """One (region, layer index tensor) per region structure: what a graph export traces (every layer of a
        structure runs that structure's graph)."""
        reps: dict[tuple, tuple[Region, torch.Tensor]] = {}
        for regions, li in zip(self._regions[False], self._li, strict=True):
            for reg in regions:
                reps.setdefault(reg.structure(), (reg, li))
        return reps

    def decode_shapes(self, max_num_seqs: int) -> list[tuple[int, int]]:
        """(batch bucket, block bucket) pairs a decode step of up to `max_num_seqs` sequences can take."""
        bps = sorted({batch_bucket(b, self.buckets) for b in range(1, max_num_seqs + 1)})
        nbs = sorted({block_bucket(n, self.max_blocks) for n in range(1, self.max_blocks + 1)})
        return [(bp, nb) for bp in bps for nb in nbs]

    def _split(self, stage: str) -> None:
        if self.timer is not None:
            self.timer.split(stage)

    def _graph(self, region: Region, timed: bool) -> Callable[..., torch.Tensor]:
        key = (region.structure(), timed)
        fn = self._graphs.get(key)
        if fn is None:
            fn = self.backend.compile_region(region)
            self._graphs[key] = fn
        return fn

    def prepare(self, steps: list[SeqStep], input_ids: torch.Tensor) -> torch.Tensor:
        """Padded static inputs on the device, in ONE host-to-device copy: [Bp, 3 + NB] int64 rows of (pos, slot,
        token id, block table) (Bp = batch bucket, NB = block bucket; padded rows point at the scratch slot and
        block). The regions slice it inside their graphs."""
        b = len(steps)
        bp = batch_bucket(b, self.buckets)
        bs = self.cache.block_size
        nb = block_bucket(max(s.start // bs + 1 for s in steps), self.max_blocks)
        packed = torch.zeros(bp, 3 + nb, dtype=torch.long)  # pos, slot, id, table...
        packed[:, 1], packed[:, 3:] = self.cache.num_slots, self.cache.num_blocks
        ids = input_ids.cpu().tolist()  # a no-op copy for a CPU tensor
        for i, s in enumerate(steps):
            if s.token_start != i:
                raise ValueError(f"decode step {i} has token_start {s.token_start}: one token per sequence, in order")
            packed[i, 0], packed[i, 1], packed[i, 2] = s.start, s.slot, ids[i]
            bt = s.block_table[:nb]
            packed[i, 3: 3 + len(bt)] = bt
        return packed.to(self.backend.device)

    def decode_step(self, steps: list[SeqStep], input_ids: torch.Tensor, padded: bool = False) -> torch.Tensor:
        """One decode step (every step n == 1) -> final streams [T, n, dim] in input_ids order (`padded`: all Bp rows
        of the batch bucket, the T real ones first - what the head graph takes, so that a batch that shrinks inside
        its bucket compiles nothing new)."""
        timer = self.timer
        timed = timer is not None and timer.enabled
        region = timer.region if timed else None
        if region is None:
            packed = self.prepare(steps, input_ids)
            x = self._embed(packed)  # [Bp, n, dim]
        else:
            with region("embed"):
                packed = self.prepare(steps, input_ids)
                x = self._embed(packed)  # [Bp, n, dim]
        n_launch = 0
        shape = (packed.shape[0], packed.shape[1] - 3)
        for blk, regions, li in zip(self.model.layers, self._regions[timed], self._li, strict=True):
            # the root tensors themselves (the graph flattens them): on a lazy-tensor device a region then always
            # gets its cache as device data and writes it back in place, whatever wrote it last
            roots = self.cache.roots[self.cache.where[blk.layer_id][0]]
            for reg in regions:
                fn = self._graph(reg, timed)
                self.compiled.add((reg.kind, reg.structure()[1:], *shape))
                if region is None:
                    x = fn(reg, x, roots, li, packed)
                else:
                    with region(reg.kind, blk.layer_id):
                        x = fn(reg, x, roots, li, packed)
                self.backend.region_end()
                n_launch += 1
        self.launches += n_launch
        self.launches_last_step = n_launch
        return x if padded else x[: len(steps)]


def region_summary(runner: Any) -> dict[str, Any]:
    """Graph facts of a ModelRunner for results metadata."""
    rr = getattr(runner, "regions", None)
    if rr is None:
        return {"graph_mode": "eager", "graph_launches_per_step": 0}
    return {"graph_mode": str(rr.mode), "graph_launches_per_step": rr.launches_last_step,
            "graph_backend": f"{rr.backend.name}:{getattr(rr.backend, 'compiler', '')}",
            "compiled_shapes": len(rr.compiled), "distinct_graphs": len(rr.compiled)}
