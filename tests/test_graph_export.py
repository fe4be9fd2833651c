"""`deepinfer compile`'s list of graphs (engine/backends/graph_export.py `graph_specs`): every decode graph (region
structure x batch bucket x block bucket, embed and head per batch bucket) and every prefill graph (chunk-region
structure x batch bucket x chunk bucket x block bucket, chunk embed and chunk head per (batch, chunk) bucket). Each
listed graph runs on its example inputs (no torch.compile here: the stand-in lane lowers them,
tests/test_neuron_standin.py)."""

from __future__ import annotations

import torch

from deepinfer_bench.bench.graph_budget import budget
from engine.backends.graph_export import chunk_specs, decode_specs, graph_specs
from engine.model.dummy import random_weights
from tests.engines import build
from tests.test_chunk_graphs import _cfg


def test_every_decode_and_prefill_graph_is_listed_and_runs() -> None:
    cfg = _cfg()
    runner = build(cfg, random_weights(cfg, 0, with_mtp=False), max_model_len=64, num_kv_blocks=16, block_size=16,
                   max_num_seqs=2, max_num_batched_tokens=24, graph_mode="layer", host_compiler="none",
                   chunk_graphs=True).runner
    rr = runner.regions
    decode, chunk = decode_specs(runner), chunk_specs(runner)
    assert [s.name for s in graph_specs(runner)] == [s.name for s in decode + chunk]
    plan = budget(runner.config)  # the count `compile` prints before compiling, from the config alone
    assert plan.decode_graphs + 2 * len(plan.batch_buckets) == len(decode) and plan.total == len(decode + chunk)
    reps, chunk_reps = rr.representatives(), rr.representatives(chunk=True)
    dshapes = rr.decode_shapes(runner.max_num_seqs)
    cshapes = rr.chunk_shapes(runner.max_num_seqs, 24)
    pairs = {(bp, c) for bp, c, _ in cshapes}
    assert len(chunk_reps) == len(reps) >= 2  # one chunk structure per decode structure
    assert len(decode) == len(reps) * len(dshapes) + 2 * len({bp for bp, _ in dshapes})
    assert len(chunk) == len(chunk_reps) * len(cshapes) + 2 * len(pairs)
    buckets = {s.meta["chunk_bucket"] for s in chunk}
    assert buckets == set(runner.config.graph.chunk_sizes(24)) == {8, 24}  # every chunk bucket, the budget on top
    assert {s.meta["region"] for s in chunk} == {"chunk.layer", "chunk.embed", "chunk.head"}
    assert len({s.name for s in decode + chunk}) == len(decode + chunk)  # names are unique (one file each)
    with runner.backend.grad_context():
        for spec in [*decode[:1], *chunk]:
            out = spec.fn(*spec.args)
            if spec.meta["region"] == "chunk.layer":
                bp, c = spec.meta["batch_bucket"], spec.meta["chunk_bucket"]
                assert out.shape == (bp * c, cfg.hc_mult, cfg.dim) and torch.isfinite(out).all()
            elif spec.meta["region"] == "chunk.head":
                assert out.shape == (spec.meta["batch_bucket"], cfg.vocab_size)


def test_the_context_ladder_starts_at_the_first_context_bucket_and_chunks_follow_the_engine() -> None:
    """min_context_bucket (tokens) is the first block bucket; graph_specs lists chunk graphs only where the engine
    runs chunks as graphs; the budget's count is what graph_specs lists."""
    from engine.regions import block_bucket

    cfg = _cfg()
    runner = build(cfg, random_weights(cfg, 0, with_mtp=False), max_model_len=128, num_kv_blocks=16, block_size=16,
                   max_num_seqs=2, max_num_batched_tokens=24, graph_mode="layer", host_compiler="none",
                   min_context_bucket=64).runner
    assert runner.regions.min_blocks == 4
    assert [block_bucket(n, 8, 4) for n in (1, 4, 5, 8)] == [4, 4, 8, 8]
    specs = graph_specs(runner)
    assert {s.meta["block_bucket"] for s in specs if s.meta["block_bucket"] is not None} == {4, 8}
    assert not any(s.meta["region"].startswith("chunk.") for s in specs)  # the host runs chunks eagerly
    plan = budget(runner.config)
    assert plan.total == len(specs) and plan.block_buckets == [4, 8] and plan.chunk_graphs == 0
    assert 0 < plan.context_waste < 0.5 and plan.batch_waste == 0.0
