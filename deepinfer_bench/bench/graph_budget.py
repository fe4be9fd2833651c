"""How many graphs an engine config compiles, and what its bucket ladders cost in padding: `deepinfer compile` prints
it before compiling (`--dry-run`: only that), from the config alone (no weights, no engine).

The graphs are what a step of the engine can run (engine/regions.py): each region structure x (batch bucket, block
bucket) for decode, each structure x (batch bucket, chunk bucket, block bucket) that the workload's prefill chunks
reach (`engine_chunk_shapes`: its longest prompt, token budget and batch) when the engine runs chunks as graphs, and
the embedding / head per batch bucket (and per chunk shape). Padding waste is the share of the padded rows (or
context blocks, or chunk rows) that are padding, averaged over every batch size 1..max_num_seqs (every context
length 1..max_blocks blocks, every chunk length 1..the largest chunk) taken as equally likely: a ladder's cost where
the workload is unknown.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


def structures(cfg: Any, mode: str) -> list[tuple]:
    """The region structures of model `cfg` in graph mode `mode` (engine/regions.py `Region.structure`): a layer
    graph per (compress ratio, hash routing); in regions mode an attention graph per ratio and a MoE graph per
    routing."""
    layers = [(cfg.compress_ratios[i], i < cfg.n_hash_layers) for i in range(cfg.n_layers)]
    if mode == "layer":
        return sorted({("layer", r, h) for r, h in layers})
    return sorted({("attn", r) for r, _ in layers}) + sorted({("moe", h) for _, h in layers})


def _waste(sizes: range, bucket: Any) -> float:
    """Mean share of padding over `sizes` padded by `bucket(size)`."""
    return sum((bucket(n) - n) / bucket(n) for n in sizes) / len(sizes)


@dataclass(frozen=True)
class Budget:
    structures: int
    batch_buckets: list[int]
    block_buckets: list[int]
    decode_shapes: int  # (batch bucket, block bucket) pairs, each a graph per structure
    chunk_buckets: list[int]
    chunk_block_buckets: list[int]
    chunk_shapes: int  # (batch bucket, chunk bucket, block bucket) triples, each a graph per structure
    chunk_edges: list[tuple[int, int]]
    decode_graphs: int
    chunk_graphs: int
    edge_graphs: int
    batch_waste: float
    context_waste: float
    chunk_waste: float

    @property
    def total(self) -> int:
        return self.decode_graphs + self.chunk_graphs + self.edge_graphs

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}

    def line(self) -> str:
        return (f"{self.total} graphs: {self.decode_graphs} decode ({self.structures} structures x "
                f"{self.decode_shapes} shapes of batch buckets {self.batch_buckets} x block buckets "
                f"{self.block_buckets}), {self.chunk_graphs} chunk ({self.structures} x {self.chunk_shapes} shapes "
                f"of chunk buckets {self.chunk_buckets or '-'} x block buckets {self.chunk_block_buckets or '-'}), "
                f"{self.edge_graphs} embed / head; padding waste {self.batch_waste:.0%} of batch rows, "
                f"{self.context_waste:.0%} of context blocks, {self.chunk_waste:.0%} of chunk rows")


def budget(config: Any) -> Budget:
    """The graphs `deepinfer compile` writes for `config` (an EngineConfig in a graph mode) and the padding its
    ladders cost."""
    from engine.regions import batch_bucket, block_bucket, block_buckets, engine_chunk_shapes, engine_decode_shapes

    g, c = config.graph, config.cache
    if str(g.mode) == "eager":
        raise ValueError("graph mode eager compiles no graphs: use --graph-mode layer or regions")
    max_blocks, min_blocks = c.max_blocks_per_seq, g.min_blocks(c.block_size)
    n_struct = len(structures(config.model.config, str(g.mode)))
    decode = engine_decode_shapes(config)
    chunks = engine_chunk_shapes(config) if g.chunk_graphs else []
    sizes = g.chunk_sizes(c.max_num_batched_tokens)
    longest = min(sizes[-1], c.input_limit)  # the longest chunk a prompt can have
    bps = sorted({bp for bp, _ in decode})
    chunk_edges = {(bp, cb) for bp, cb, _ in chunks}
    return Budget(structures=n_struct, batch_buckets=bps, block_buckets=block_buckets(max_blocks, min_blocks),
                  decode_shapes=len(decode),
                  chunk_buckets=sorted({cb for _, cb, _ in chunks}),
                  chunk_block_buckets=sorted({nb for _, _, nb in chunks}), chunk_shapes=len(chunks),
                  chunk_edges=sorted(chunk_edges),
                  decode_graphs=n_struct * len(decode),
                  chunk_graphs=n_struct * len(chunks), edge_graphs=2 * len(bps) + 2 * len(chunk_edges),
                  batch_waste=_waste(range(1, c.max_num_seqs + 1), lambda b: batch_bucket(b, g.batch_buckets)),
                  context_waste=_waste(range(1, max_blocks + 1), lambda n: block_bucket(n, max_blocks, min_blocks)),
                  chunk_waste=_waste(range(1, longest + 1), lambda n: batch_bucket(n, sizes)) if chunks else 0.0)
