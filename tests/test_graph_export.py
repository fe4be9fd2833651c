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
from engine.regions import engine_chunk_shapes, engine_decode_shapes
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
    dshapes = engine_decode_shapes(runner.config)
    cshapes = engine_chunk_shapes(runner.config)
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


def _reach_oracle(max_num_seqs: int, budget_tokens: int, batch: tuple, chunks: tuple, nbs: list[int], block: int,
                  max_input: int, pool: int) -> set[tuple[int, int, int]]:
    """Independent of engine/regions.py: a (batch bucket, chunk bucket, block bucket) shape is reached iff some
    batch B in the bucket has B entries, each of more tokens than the chunk bucket below (at most max_input) and a
    context inside the block bucket that a prompt of at most max_input tokens has: B within the slots, B x tokens
    within the step budget, B x blocks within the pool."""
    out = set()
    for i, c in enumerate(chunks):
        lo_c = (chunks[i - 1] if i else 1) + 1  # fewest tokens of an entry in bucket c
        for j, nb in enumerate(nbs):
            ctx_lo = max(nbs[j - 1] * block + 1 if j else 1, lo_c)  # fewest context tokens in bucket nb
            if ctx_lo > min(nb * block, max_input) or lo_c > max_input:
                continue
            for k, bp in enumerate(batch):
                lo_b = (batch[k - 1] if k else 0) + 1
                b_ok = [b for b in range(lo_b, bp + 1) if b <= max_num_seqs and b * lo_c <= budget_tokens
                        and b * -(-ctx_lo // block) <= pool]
                if b_ok:
                    out.add((bp, c, nb))
    return out


def test_chunk_ladder_is_what_the_workload_reaches() -> None:
    """The prefill chunk shapes compiled are exactly those a workload reaches (checked against an independent
    enumeration): its longest prompt caps the chunk and block buckets, the step budget and the pool cap the batch;
    verify steps (speculative decoding) keep every context in their bucket; prefix caching lifts the pool bound.
    The budget line says how many and which."""
    from engine.config import EngineConfig, ModelConfig
    from engine.regions import block_buckets, chunk_shapes

    batch, chunks = (1, 2, 4, 8, 16, 32, 64), (8, 32, 128, 512)
    nbs = block_buckets(64, 4)
    for max_input, pool, budget_tokens in ((8192, 64, 2048), (1024, 64, 2048), (300, 4096, 8192), (8192, 4096, 512)):
        got = chunk_shapes(64, budget_tokens, batch, chunks, 64, 4, block_size=128, max_input_len=max_input,
                           pool_blocks=pool)
        assert set(got) == _reach_oracle(64, budget_tokens, batch, chunks, nbs, 128, max_input, pool)
        assert len(got) == len(set(got))
    # uncapped: every shape of the old ladder the budget allows
    full = chunk_shapes(64, 2048, batch, chunks, 64, 4)
    assert set(full) == _reach_oracle(64, 2048, batch, chunks, nbs, 128, 64 * 128, 10**9)
    spec = set(chunk_shapes(64, 2048, batch, chunks, 64, 4, block_size=128, max_input_len=300, verify_tokens=5))
    assert {nb for _, c, nb in spec if c == 8} == set(nbs)  # verify steps of 5 tokens at any context
    assert {nb for _, c, nb in spec if c > 8} == {4}  # prefill of <= 300 tokens: the first block bucket only

    cfg = ModelConfig.from_json("golden/configs/deepseek-v4-flash")
    eng = EngineConfig.from_model_config(cfg, backend="neuron", graph_mode="layer", max_num_seqs=64,
                                         max_model_len=8192)
    before = chunk_shapes(64, eng.cache.max_num_batched_tokens, eng.graph.batch_buckets,
                          eng.graph.chunk_sizes(eng.cache.max_num_batched_tokens), 64, 4)
    plan = budget(eng)
    assert plan.chunk_shapes < len(before) and plan.chunk_graphs == plan.structures * plan.chunk_shapes
    assert set(engine_chunk_shapes(eng)) < set(before)
    capped = budget(eng.replace(max_input_len=1024))
    assert capped.chunk_block_buckets == [4, 8] and capped.chunk_shapes < plan.chunk_shapes
    assert f"{capped.chunk_graphs} chunk ({capped.structures} x {capped.chunk_shapes} shapes" in capped.line()
    shared = budget(eng.replace(enable_prefix_caching=True))  # cached blocks are shared: no pool bound
    assert shared.chunk_shapes == len(before)
