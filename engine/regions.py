"""Region graphs for the decode step (`EngineConfig.graph.mode`; `--graph-mode`, default DEEPINFER_NEURON_GRAPH_MODE).

A **region** is a piece of one decoder layer compiled as one graph by the backend (engine/backends/):
* `regions` mode, two per layer: `attn` = mHC collapse, attn_norm, q/kv, compressor(s), indexer, sparse attention,
  output projection, mHC expand; `moe` = mHC collapse, ffn_norm, gate, experts, shared expert, exchange, mHC expand;
* `layer` mode, one per layer (`layer` = attn then moe): half the graph launches;
* `eager` mode: no graphs (the engine's eager path, unchanged).
Every step runs as graphs: its one-token entries (decodes) through the decode regions, its multi-token entries
(prefill chunks, speculative verify steps of 1 + k tokens) through **chunk regions** (`ChunkRegion`: B sequences x C
tokens, C a chunk bucket, engine/model/static_chunk.py), grouped by chunk bucket (`plan_runs`); each group is one
run of the layers. Sequences do not interact, so splitting a step into runs is exact.

**Static shapes.** The batch is padded to a bucket (`BATCH_BUCKETS`) and the block tables to a power-of-two number
of blocks (capped by max_model_len), so each region compiles once per (batch bucket, block bucket) and is reused;
a chunk region once per (batch bucket, chunk bucket, block bucket).
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

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engine.backends import Backend
from engine.config import BATCH_BUCKETS, CHUNK_BUCKETS, GraphMode
from engine.model.block import Block
from engine.model.cache import KVCache, LayerCache, SeqStep
from engine.model.model import Transformer
from engine.model.static_chunk import attention_chunk
from engine.profiling import RegionTimer, no_split


def batch_bucket(n: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> int:
    """Smallest bucket >= n (beyond the largest bucket: the next multiple of it)."""
    for b in buckets:
        if b >= n:
            return b
    return -(-n // buckets[-1]) * buckets[-1]


def block_bucket(n: int, max_blocks: int, min_blocks: int = 1) -> int:
    """Power of two >= max(n, min_blocks), capped at max_blocks (the block-table width a region is compiled for):
    contexts below `min_blocks` blocks share the first bucket (a smaller one would save little and cost a graph)."""
    b = 1
    while b < max(n, min_blocks):
        b *= 2
    return max(n, min(b, max_blocks))


def block_buckets(max_blocks: int, min_blocks: int = 1) -> list[int]:
    """Every block bucket a sequence of up to `max_blocks` blocks can take."""
    return sorted({block_bucket(n, max_blocks, min_blocks) for n in range(1, max_blocks + 1)})


def decode_shapes(max_num_seqs: int, buckets: tuple[int, ...], max_blocks: int,
                  min_blocks: int = 1, pool_blocks: int = 0) -> list[tuple[int, int]]:
    """(batch bucket, block bucket) pairs a decode step of up to `max_num_seqs` sequences can take (with a pool of
    `pool_blocks` blocks not shared between sequences: only batches it holds, `pool_fits`)."""
    nbs = block_buckets(max_blocks, min_blocks)
    fits = pool_fits(nbs, pool_blocks, max_num_seqs)
    bps = {nb: {batch_bucket(b, buckets) for b in range(1, fits[nb] + 1)} for nb in nbs}
    return [(bp, nb) for bp in sorted(set().union(*bps.values())) for nb in nbs if bp in bps[nb]]


def pool_fits(nbs: list[int], pool_blocks: int, max_num_seqs: int) -> dict[int, int]:
    """{block bucket: most sequences at once}: a sequence in block bucket nb holds more blocks than the bucket
    before it, so a pool of `pool_blocks` blocks not shared between sequences (0: unbounded) holds at most
    pool_blocks // (previous bucket + 1) of them."""
    return {nb: min(max_num_seqs, pool_blocks // (low + 1)) if pool_blocks else max_num_seqs
            for low, nb in zip([0, *nbs[:-1]], nbs, strict=True)}


def chunk_shapes(max_num_seqs: int, max_num_batched_tokens: int, buckets: tuple[int, ...],
                 chunk_buckets: tuple[int, ...], max_blocks: int, min_blocks: int = 1, *, block_size: int = 0,
                 max_input_len: int = 0, verify_tokens: int = 0, pool_blocks: int = 0) -> list[tuple[int, int, int]]:
    """(batch bucket, chunk bucket, block bucket) triples a chunk run can take when the scheduler caps chunks at the
    largest chunk bucket: B entries of a bucket C need B x (C_prev + 1) <= max_num_batched_tokens tokens. With the
    workload's longest prompt (`max_input_len` tokens, blocks of `block_size`), only what a prefill chunk reaches:
    no chunk bucket above the one that prompt fills, no block bucket past its context, and none below the context
    the chunk itself fills (an entry of bucket C holds > C_prev tokens). Verify steps (`verify_tokens` = 1 + drafts,
    speculative decoding) reach every context in the bucket that holds them. A pool of `pool_blocks` blocks not
    shared between sequences (no prefix caching) holds only the entries `pool_fits` allows."""
    out = []
    nbs = block_buckets(max_blocks, min_blocks)
    fits = pool_fits(nbs, pool_blocks, max_num_seqs)

    def blocks(tokens: int) -> int:
        return block_bucket(-(-tokens // block_size), max_blocks, min_blocks)

    top = blocks(max_input_len) if max_input_len and block_size else max_blocks
    prev = 1
    for c in chunk_buckets:
        verify = prev < verify_tokens <= c
        if max_input_len and prev >= max_input_len and not verify:
            break  # no prompt has more than prev tokens: no prefill chunk reaches this bucket
        low = blocks(prev + 1) if block_size else 0
        most = min(max_num_seqs, max(1, max_num_batched_tokens // (prev + 1)))
        bps = {nb: {batch_bucket(b, buckets) for b in range(1, min(most, fits[nb]) + 1)} for nb in nbs}
        out += [(bp, c, nb) for bp in sorted(set().union(*bps.values())) for nb in nbs
                if bp in bps[nb] and (verify or low <= nb <= top)]
        prev = c
    return out


def _pool(config: Any) -> int:
    """The pool blocks that bound a batch: none with prefix caching (sequences share cached blocks)."""
    return 0 if config.cache.enable_prefix_caching else config.cache.num_kv_blocks


def engine_decode_shapes(config: Any) -> list[tuple[int, int]]:
    """`decode_shapes` of an EngineConfig (its batch, context and pool)."""
    g, c = config.graph, config.cache
    return decode_shapes(c.max_num_seqs, g.batch_buckets, c.max_blocks_per_seq, g.min_blocks(c.block_size),
                         _pool(config))


def engine_chunk_shapes(config: Any) -> list[tuple[int, int, int]]:
    """`chunk_shapes` of an EngineConfig: the chunk runs its workload reaches (its sizes, its longest prompt, its
    verify steps). One definition for the compile budget and the graphs the engine lists."""
    g, c = config.graph, config.cache
    return chunk_shapes(c.max_num_seqs, c.max_num_batched_tokens, g.batch_buckets,
                        g.chunk_sizes(c.max_num_batched_tokens), c.max_blocks_per_seq, g.min_blocks(c.block_size),
                        block_size=c.block_size, max_input_len=c.max_input_len,
                        verify_tokens=1 + config.spare_positions if config.spec.enabled else 0,
                        pool_blocks=_pool(config))


def plan_runs(ns: list[int], chunk_buckets: tuple[int, ...] = CHUNK_BUCKETS) -> list[tuple[int, list[int]]]:
    """How a step of entries with `ns` tokens each runs: a list of (C, entry indices), C = 0 for the decode run
    (one-token entries, decode regions) and a chunk bucket for each group of multi-token entries whose length
    falls in that bucket (a chunk-region run of [batch bucket, C]). One-token entries join the smallest chunk
    group instead of running apart when that group is in the smallest bucket and has at least as many entries
    (verify steps: one run of the layers, not two). Entry order is kept inside each run."""
    dec = [k for k, n in enumerate(ns) if n == 1]
    groups: dict[int, list[int]] = {}
    for k, n in enumerate(ns):
        if n > 1:
            groups.setdefault(batch_bucket(n, chunk_buckets), []).append(k)
    small = chunk_buckets[0]
    if dec and small in groups and len(dec) <= len(groups[small]):
        groups[small] = sorted(groups[small] + dec)
        dec = []
    return ([(0, dec)] if dec else []) + sorted(groups.items())


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
        return type(self)(blk, self.kind, self.ratio, self.slots_per_layer, self.blocks_per_layer, self.split)

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


class ChunkRegion(Region):
    """A region over B sequences x C new tokens each (prefill chunks, verify steps): `forward(x, roots, li, packed)`
    with x [Bp*C, n, dim] (row b*C + i: token i of sequence b) and `packed` [Bp, 3 + C + NB] int64 rows of (start,
    n real tokens, slot, C token ids, block table) (RegionRunner.prepare_chunk). C and NB are read off the shapes;
    everything else is data, so one graph serves every layer of a structure at a (Bp, C, NB) shape."""

    def structure(self) -> tuple:
        return ("chunk", *super().structure())

    def forward(self, x: torch.Tensor, roots: dict[str, torch.Tensor], li: torch.Tensor,
                packed: torch.Tensor) -> torch.Tensor:
        blk, split = self.blk, self.split
        c = x.shape[0] // packed.shape[0]
        start, n, slots = packed[:, 0], packed[:, 1], packed[:, 2]
        ids, tables = packed[:, 3: 3 + c].flatten(), packed[:, 3 + c:]
        roots = {name: t.flatten(0, 1) for name, t in roots.items()}
        if self.kind in ("attn", "layer"):
            lc = LayerCache(ratio=self.ratio, **roots)
            sl, tl = slots + li * self.slots_per_layer, tables + li * self.blocks_per_layer
            x = blk.hc_site(x, "attn", lambda h: attention_chunk(blk.attn, h, start, n, sl, tl, lc, split), split)
        if self.kind in ("moe", "layer"):
            x = blk.hc_site(x, "ffn", lambda h: blk.ffn.forward_static(h, ids, split), split)
        return x


@dataclasses.dataclass
class StepResult:
    """A step run as graphs (RegionRunner.step): `logits` fp32 [len(rows), vocab] on the host, in the order of the
    requested rows; `hidden` the final streams [T, n, dim] of every token in input order (on the device), or None."""

    logits: torch.Tensor | None
    hidden: torch.Tensor | None


class RegionRunner:
    """Runs steps of `model` as region graphs over `cache` (which must have a scratch slot/block): pure-decode steps
    through `decode_step`, any step through `step` (decode run + chunk runs, `plan_runs`).

    `launches` counts graph calls; `launches_last_step` is the count of the latest step (2 x layers in `regions`
    mode, 1 x layers in `layer` mode, per run). `compiled` records each distinct graph: (region kind, structure,
    batch bucket, block bucket) for decode regions, ("chunk.<kind>", structure, batch bucket, chunk bucket, block
    bucket) for chunk regions - its size does not grow with the number of layers."""

    def __init__(self, model: Transformer, cache: KVCache, mode: GraphMode | str, backend: Backend, max_blocks: int,
                 timer: RegionTimer | None = None, buckets: tuple[int, ...] = BATCH_BUCKETS,
                 chunk_buckets: tuple[int, ...] = CHUNK_BUCKETS, min_blocks: int = 1) -> None:
        mode = GraphMode.parse(mode, "graph mode")
        if mode is GraphMode.EAGER:
            raise ValueError("graph mode 'eager': RegionRunner runs 'regions' or 'layer'")
        if not cache.scratch:
            raise ValueError("region graphs need KVCache(scratch=True) (padded rows write to the scratch slot)")
        self.model, self.cache, self.mode, self.backend = model, cache, mode, backend
        self.max_blocks, self.buckets, self.chunk_buckets = max_blocks, buckets, chunk_buckets
        self.min_blocks = min_blocks  # the first block bucket (GraphConfig.min_context_bucket in blocks)
        self.timer = timer
        self.kinds = ("layer",) if mode is GraphMode.LAYER else ("attn", "moe")
        boundary = backend.boundary(self._split)  # kept out of graphs; used only by the timed graphs
        dev = backend.device

        def regions(cls: type, split: Callable[[str], None]) -> list[list[Region]]:
            return [[cls(blk, kind, cache.where[blk.layer_id][0], cache.num_slots + 1, cache.num_blocks + 1, split)
                     for kind in self.kinds] for blk in model.layers]

        self._regions = {timed: regions(Region, boundary if timed else no_split) for timed in (False, True)}
        self._chunk_regions = regions(ChunkRegion, no_split)  # timed as a whole region per layer ("chunk")
        # [1]-shaped, not 0-d: torch-xla turns a 0-d tensor holding 0 or 1 into a graph constant, which would give
        # the layers at index 0 and 1 graphs of their own
        self._li = [torch.tensor([cache.where[blk.layer_id][1]], device=dev) for blk in model.layers]
        self._graphs: dict[tuple, Callable[..., torch.Tensor]] = {}
        self._embed = backend.compile_fn(lambda packed: model.streams(packed[:, 2]), "embed")
        self._chunk_embeds: dict[int, Callable[..., torch.Tensor]] = {}
        self.head = backend.compile_fn(model.logits, "head")  # the runner's head for region steps
        self._head_last = backend.compile_fn(self._last_logits, "chunk_head")
        self.launches = 0
        self.launches_last_step = 0
        self.compiled: set[tuple] = set()

    def representatives(self, chunk: bool = False) -> dict[tuple, tuple[Region, torch.Tensor]]:
        """One (region, layer index tensor) per region structure (`chunk`: of the chunk regions): what a graph export
        traces (every layer of a structure runs that structure's graph)."""
        reps: dict[tuple, tuple[Region, torch.Tensor]] = {}
        for regions, li in zip(self._chunk_regions if chunk else self._regions[False], self._li, strict=True):
            for reg in regions:
                reps.setdefault(reg.structure(), (reg, li))
        return reps

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

    def _layers(self, regions: list[list[Region]], x: torch.Tensor, packed: torch.Tensor, shape: tuple, timed: bool,
                label: str | None = None) -> tuple[torch.Tensor, int]:
        """x through every layer's regions (one graph call each) -> (x, graph calls). `label`: time each layer as
        that one region (chunk runs); else each region by its kind when `timed`."""
        region = self.timer.region if self.timer is not None and self.timer.enabled else None
        n_launch = 0
        for blk, regs, li in zip(self.model.layers, regions, self._li, strict=True):
            # the root tensors themselves (the graph flattens them): on a lazy-tensor device a region then always
            # gets its cache as device data and writes it back in place, whatever wrote it last
            roots = self.cache.roots[self.cache.where[blk.layer_id][0]]
            for reg in regs:
                fn = self._graph(reg, timed)
                st = reg.structure()
                self.compiled.add((f"chunk.{reg.kind}", st[2:], *shape) if st[0] == "chunk" else
                                  (reg.kind, st[1:], *shape))
                if region is None:
                    x = fn(reg, x, roots, li, packed)
                else:
                    with region(label or reg.kind, blk.layer_id):
                        x = fn(reg, x, roots, li, packed)
                self.backend.region_end()
                n_launch += 1
        self.launches += n_launch
        return x, n_launch

    def prepare(self, steps: list[SeqStep], input_ids: torch.Tensor) -> torch.Tensor:
        """Padded static inputs on the device, in ONE host-to-device copy: [Bp, 3 + NB] int64 rows of (pos, slot,
        token id, block table) (Bp = batch bucket, NB = block bucket; padded rows point at the scratch slot and
        block). The regions slice it inside their graphs."""
        b = len(steps)
        bp = batch_bucket(b, self.buckets)
        bs = self.cache.block_size
        nb = block_bucket(max(s.start // bs + 1 for s in steps), self.max_blocks, self.min_blocks)
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
        x, self.launches_last_step = self._decode_run(steps, input_ids)
        return x if padded else x[: len(steps)]

    def _decode_run(self, steps: list[SeqStep], input_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        timer = self.timer
        timed = timer is not None and timer.enabled
        with timer.region("embed") if timed else contextlib.nullcontext():
            packed = self.prepare(steps, input_ids)
            x = self._embed(packed)  # [Bp, n, dim]
        return self._layers(self._regions[timed], x, packed, (packed.shape[0], packed.shape[1] - 3), timed)

    # -- multi-token entries: chunk regions ------------------------------------------------------------------------
    def prepare_chunk(self, steps: list[SeqStep], ids: list[list[int]], c: int) -> torch.Tensor:
        """The static inputs of a chunk run on the device, in ONE host-to-device copy: [Bp, 3 + C + NB] int64 rows of
        (start, n, slot, C token ids, block table); padded entries have n = 0 and the scratch slot, padded table
        columns the scratch block."""
        bp = batch_bucket(len(steps), self.buckets)
        bs = self.cache.block_size
        nb = block_bucket(max(-(-(s.start + s.n) // bs) for s in steps), self.max_blocks, self.min_blocks)
        packed = torch.zeros(bp, 3 + c + nb, dtype=torch.long)
        packed[:, 2], packed[:, 3 + c:] = self.cache.num_slots, self.cache.num_blocks
        for j, (s, toks) in enumerate(zip(steps, ids, strict=True)):
            if not 1 <= s.n <= c or len(toks) != s.n:
                raise ValueError(f"chunk entry {j}: {s.n} tokens ({len(toks)} ids) in a chunk of {c}")
            packed[j, 0], packed[j, 1], packed[j, 2] = s.start, s.n, s.slot
            packed[j, 3: 3 + s.n] = torch.tensor(toks, dtype=torch.long)
            bt = s.block_table[:nb]
            packed[j, 3 + c: 3 + c + len(bt)] = bt
        return packed.to(self.backend.device)

    def _chunk_embed(self, c: int) -> Callable[[torch.Tensor], torch.Tensor]:
        fn = self._chunk_embeds.get(c)
        if fn is None:
            fn = self.backend.compile_fn(self.chunk_embed_fn(c), f"chunk_embed_c{c}")
            self._chunk_embeds[c] = fn
        return fn

    def chunk_run(self, steps: list[SeqStep], ids: list[list[int]], c: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """B entries of at most `c` tokens each through the chunk regions -> (final streams [Bp*C, n, dim] (row
        b*C + i: token i of entry b), the packed inputs, graph calls)."""
        timer = self.timer
        timed = timer is not None and timer.enabled
        with timer.region("embed") if timed else contextlib.nullcontext():
            packed = self.prepare_chunk(steps, ids, c)
            x = self._chunk_embed(c)(packed)  # [Bp*C, n, dim]
        shape = (packed.shape[0], c, packed.shape[1] - 3 - c)
        x, n = self._layers(self._chunk_regions, x, packed, shape, False, label="chunk" if timed else None)
        return x, packed, n

    def chunk_embed_fn(self, c: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """The function a chunk run's embedding compiles as (token ids in packed columns 3 .. 3 + c)."""
        return functools.partial(_embed_chunk, self.model, c)

    def _last_logits(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """The head over each entry's last real row of a chunk run: x [Bp*C, n, dim] -> fp32 [Bp, vocab]."""
        bp = packed.shape[0]
        c = x.shape[0] // bp
        rows = torch.arange(bp, device=x.device) * c + (packed[:, 1] - 1).clamp(min=0)
        return self.model.logits(x[rows])

    def step(self, steps: list[SeqStep], input_ids: torch.Tensor, rows: list[int], hidden: bool) -> StepResult:
        """Any step as graphs: its runs (`plan_runs`: one-token entries through the decode regions, multi-token
        ones through the chunk regions per chunk bucket), then the head of each run over what the requested token
        `rows` need (the last rows of a chunk run's entries by a gather in the head graph, else all its rows): one
        device-to-host copy per run. `hidden`: also the final streams of every token, in input order."""
        ids = input_ids.cpu().tolist()
        where: list[tuple[int, int]] = [(-1, -1)] * len(ids)  # token row -> (run, row of the run's output)
        outs: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []
        launches = 0
        for r, (c, members) in enumerate(plan_runs([s.n for s in steps], self.chunk_buckets)):
            sub = [steps[k] for k in members]
            if c == 0:
                dec = [dataclasses.replace(s, token_start=j) for j, s in enumerate(sub)]
                x, n = self._decode_run(dec, torch.tensor([ids[s.token_start] for s in sub], dtype=torch.long))
                packed = None
                for j, s in enumerate(sub):
                    where[s.token_start] = (r, j)
            else:
                x, packed, n = self.chunk_run(sub, [ids[s.token_start: s.token_start + s.n] for s in sub], c)
                for j, s in enumerate(sub):
                    for t in range(s.n):
                        where[s.token_start + t] = (r, j * c + t)
            launches += n
            outs.append((c, x, packed))
        self.launches_last_step = launches
        last = {s.token_start + s.n - 1 for s in steps}
        timer = self.timer
        with timer.region("head") if timer is not None and timer.enabled else contextlib.nullcontext():
            heads = []
            for r, (c, x, packed) in enumerate(outs):
                want = [t for t in rows if where[t][0] == r]
                if not want:
                    heads.append(None)
                elif c and all(t in last for t in want):  # one row per entry: the head over Bp rows
                    heads.append((self._head_last(x, packed), {t: where[t][1] // c for t in want}))
                else:
                    heads.append((self.head(x), {t: where[t][1] for t in want}))
            self.backend.step_end()
            host = [None if h is None else (self.backend.to_host(h[0]), h[1]) for h in heads]
            logits = None
            if rows:
                logits = torch.stack([host[where[t][0]][0][host[where[t][0]][1][t]] for t in rows])
        x_all = None
        if hidden:
            offsets, off = [], 0
            for _, x, _ in outs:
                offsets.append(off)
                off += x.shape[0]
            index = torch.tensor([offsets[r] + j for r, j in where], dtype=torch.long)
            x_all = torch.cat([x for _, x, _ in outs]) if len(outs) > 1 else outs[0][1]
            x_all = x_all[index.to(x_all.device)]
        return StepResult(logits, x_all)


def _embed_chunk(model: Transformer, c: int, packed: torch.Tensor) -> torch.Tensor:
    """The residual streams of a chunk run's token ids (packed columns 3 .. 3 + c): [Bp*C, n, dim]."""
    return model.streams(packed[:, 3: 3 + c].flatten())


def region_summary(runner: Any) -> dict[str, Any]:
    """Graph facts of a ModelRunner for results metadata."""
    rr = getattr(runner, "regions", None)
    if rr is None:
        return {"graph_mode": "eager", "graph_launches_per_step": 0}
    return {"graph_mode": str(rr.mode), "graph_launches_per_step": rr.launches_last_step,
            "graph_backend": ":".join(filter(None, (rr.backend.name, str(getattr(rr.backend, "compiler", "") or "")))),
            "compiled_shapes": len(rr.compiled), "distinct_graphs": len(rr.compiled)}
