"""Multi-token steps as graphs (engine/regions.py `ChunkRegion`, engine/model/static_chunk.py): prefill chunks and
speculative verify steps run B sequences x C tokens (a chunk bucket) with static shapes; they must give the eager
chunk path's logits and leave the same KV state (window ring, compressor/indexer states, pool entries) in every real
slot and block.

The fast tests run the region functions without torch.compile (host compiler `none`: the same static-shape code);
one test captures the chunk graphs through dynamo and checks they do not grow with the layer count.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import GraphConfig, ModelConfig
from engine.model.cache import SeqStep
from engine.model.dummy import random_weights
from engine.regions import plan_runs
from engine.scheduler import Scheduler
from tests.engines import build, greedy

TINY = dict(vocab_size=1024, dim=128, n_layers=4, n_mtp_layers=0, compress_ratios=(0, 4, 16, 4), n_hash_layers=2,
            n_heads=4, head_dim=64, rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=32, window_size=16,
            n_routed_experts=8, n_activated_experts=2, moe_inter_dim=64, index_n_heads=16, index_head_dim=32,
            index_topk=4, swiglu_limit=1.0, max_position_embeddings=4096)


def _cfg(**over: object) -> ModelConfig:
    return ModelConfig(**{**TINY, **over})


def _runner(cfg: ModelConfig, weights: dict, **settings: object):
    return build(cfg, weights, max_model_len=512, num_kv_blocks=128, block_size=16, **settings).runner


def _steps(rounds: list[tuple[int, int, int]], tables: dict[int, torch.Tensor]) -> list[SeqStep]:
    out, off = [], 0
    for slot, start, n in rounds:
        out.append(SeqStep(slot=slot, start=start, n=n, token_start=off, block_table=tables[slot]))
        off += n
    return out


def _state(runner, slots: int, blocks: int) -> dict[str, torch.Tensor]:
    """Every real slot's and block's cache tensors (the graph runner's scratch slot/block left out)."""
    out = {}
    for m, roots in runner.cache.roots.items():
        for name, t in roots.items():
            out[f"{m}.{name}"] = t[:, :blocks] if name.endswith("_pool") else t[:, :slots]
    return out


def _compare(rounds: list[list[tuple[int, int, int]]], cfg: ModelConfig, **settings: object) -> object:
    """Each round of (slot, start, n) entries through an eager runner and a layer-graph runner with every row's
    logits requested; logits and the final KV state of real slots/blocks must agree. Returns the graph runner."""
    weights = random_weights(cfg, 0, with_mtp=cfg.n_mtp_layers > 0)
    eager = _runner(cfg, weights, graph_mode="eager", **settings)
    graph = _runner(cfg, weights, graph_mode="layer", host_compiler="none", chunk_graphs=True, **settings)
    g = torch.Generator().manual_seed(3)
    tables = {s: torch.arange(s * 32, s * 32 + 32) for s in range(4)}
    for entries in rounds:
        steps = _steps(entries, tables)
        ids = torch.randint(2, cfg.vocab_size, (sum(n for _, _, n in entries),), generator=g)
        rows = torch.arange(ids.shape[0])
        want = eager.forward(steps, ids, rows)
        got = graph.forward(steps, ids, rows)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-4)
    a, b = _state(eager, 4, 128), _state(graph, 4, 128)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=2e-4, msg=name)
    return graph


def test_chunks_match_the_eager_chunk_path() -> None:
    """Chunks of every length class at starts inside and across the window (16), the CSA (4) and HCA (16) blocks
    and the indexer's top-k (4 entries), batched per chunk bucket with padded entries and padded rows, mixed with
    one-token entries (a decode run); a 200-token chunk (bucket 512: 4 query tiles, only the first sees the ring)."""
    rounds = [[(0, 0, 3), (1, 0, 17), (2, 0, 22)],  # C 8 (batch 1) and C 32 (batch 2)
              [(0, 3, 30), (1, 17, 5), (2, 22, 1), (3, 0, 9)],  # C 32 x 2; C 8 x 1 + the decode row: batch 2
              [(0, 33, 200), (1, 22, 2), (2, 23, 1), (3, 9, 7)],  # C 512 (tiles); C 8 x 2 + decode row: batch 4
              [(0, 233, 3), (1, 24, 3), (2, 24, 3), (3, 16, 3)]]  # verify-sized: one C 8 run of batch 4
    graph = _compare(rounds, _cfg())
    shapes = {k for k in graph.regions.compiled if k[0].startswith("chunk")}
    assert {(b, c) for _, _, b, c, _ in shapes} == {(1, 8), (2, 32), (2, 8), (1, 512), (4, 8)}
    assert graph.regions.launches_last_step == 4  # the last round: one run of the 4 layer graphs


def test_verify_steps_with_rejected_drafts_match_eager() -> None:
    """Verify steps (1 + k tokens) whose drafts are then rejected: the next step starts again inside them and
    rewrites those positions (the slot state has `spare` rows, so nothing the later queries need was displaced);
    the graph path leaves the same state as the eager one."""
    cfg = _cfg(n_mtp_layers=1)
    rounds = [[(0, 0, 14), (1, 0, 19)],
              [(0, 14, 3), (1, 19, 3)],  # positions 14..16 and 19..21: drafts at 15, 16 and 20, 21
              [(0, 15, 3), (1, 20, 3)],  # one draft accepted each: 15 and 20 rewritten
              [(0, 16, 1), (1, 21, 3)]]
    _compare(rounds, cfg, speculative="mtp", num_speculative_tokens=2)


# regions mode is opt-in (`pytest -m slow`: ~3x layer mode's time); layer mode, what device backends run, stays
@pytest.mark.parametrize("mode", ["layer", pytest.param("regions", marks=pytest.mark.slow)])
def test_greedy_chunked_prefill_in_graphs_matches_eager(mode: str) -> None:
    """Through the scheduler with a small token budget: prompts prefilled in several bucket-fitted chunks, mixed
    with other sequences' decodes; the tokens and logits are the eager engine's (layer graphs, and the attention /
    MoE halves as two graphs per layer)."""
    cfg = _cfg()
    weights = random_weights(cfg, 0, with_mtp=False)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 1024, (n,), generator=g).tolist() for n in (5, 45, 70)]
    settings = dict(max_model_len=256, max_num_batched_tokens=24)
    want, wl = greedy(build(cfg, weights, graph_mode="eager", **settings), prompts, 6)
    eng = build(cfg, weights, graph_mode=mode, host_compiler="none", chunk_graphs=True, **settings)
    got, gl = greedy(eng, prompts, 6)
    assert got == want
    assert max(float((a - b).abs().max()) for a, b in zip(gl, wl, strict=True)) < 1e-4
    assert eng.runner.regions.chunk_buckets == (8, 24)
    assert {k[3] for k in eng.runner.regions.compiled if k[0].startswith("chunk")} <= {8, 24}


@pytest.mark.slow  # ~30 s alone; the xla lane checks the same bound on real device graphs (tests/test_xla.py)
def test_chunk_graphs_do_not_grow_with_layers() -> None:
    """Through dynamo: chunk regions of one structure share one graph per (batch, chunk, block) bucket, so a 6-layer
    model compiles what its 2 layer structures need, like a 2-layer one."""
    import torch._dynamo.utils as dyn

    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(2, 1024, (n,), generator=g).tolist() for n in (5, 20)]

    def graphs(cfg: ModelConfig) -> tuple[int, int]:
        torch._dynamo.reset()
        dyn.counters.clear()
        eng = build(cfg, random_weights(cfg, 0, with_mtp=False), max_model_len=64, graph_mode="layer",
                    host_compiler="eager", chunk_graphs=True)
        greedy(eng, prompts, 2)
        chunk = {k for k in eng.runner.regions.compiled if k[0].startswith("chunk")}
        return dyn.counters["stats"]["unique_graphs"], len(chunk)

    g2, c2 = graphs(_cfg(n_layers=2, compress_ratios=(4, 16), n_hash_layers=0))
    g6, c6 = graphs(_cfg(n_layers=6, compress_ratios=(4, 16, 4, 16, 4, 16), n_hash_layers=0))
    assert c2 == c6 == 2 * 2  # (CSA, HCA) x the chunk buckets 8 (5 tokens) and 32 (20 tokens)
    assert g6 == g2 > 0, (g2, g6)


def test_plan_runs() -> None:
    b = (8, 32, 128)
    assert plan_runs([1, 1, 1], b) == [(0, [0, 1, 2])]
    assert plan_runs([1, 30, 5, 1, 100], b) == [(0, [0, 3]), (8, [2]), (32, [1]), (128, [4])]
    # verify steps: one-token entries join the verify-sized group when it has at least as many entries
    assert plan_runs([3, 3, 1, 3], b) == [(8, [0, 1, 2, 3])]
    assert plan_runs([1, 1, 3], b) == [(0, [0, 1]), (8, [2])]
    assert plan_runs([600], b) == [(640, [0])]  # past the largest bucket: a multiple of it


def test_chunk_sizes_and_fitted_chunks() -> None:
    from engine.config import CacheConfig

    gc = GraphConfig(mode="layer")
    assert gc.chunk_sizes(956) == (8, 32, 128, 512) and gc.chunk_sizes(24) == (8, 24) and gc.chunk_sizes(8) == (8,)
    assert GraphConfig(mode="layer", chunk_graphs=False).scheduler_buckets(24) == ()  # eager chunks: not fitted
    assert GraphConfig(mode="layer", chunk_graphs=True).scheduler_buckets(24) == (8, 24)
    with pytest.raises(ValueError, match="chunk_buckets"):
        GraphConfig(chunk_buckets=(32, 8))
    assert GraphConfig(chunk_buckets="8, 32").chunk_buckets == (8, 32)  # the CLI's comma list
    with pytest.raises(ValueError, match="chunk_buckets"):
        GraphConfig(chunk_buckets="8,x")
    sched = Scheduler(CacheConfig(max_num_seqs=2, max_num_batched_tokens=956, num_kv_blocks=64, block_size=16,
                                  max_model_len=1024), gc.chunk_sizes(956))
    fit = [sched.fit_chunk(n) for n in (1, 5, 8, 20, 43, 64, 130, 300, 900)]
    assert fit == [1, 5, 8, 20, 32, 32, 128, 128, 512]  # 300: 212 padded rows > 172 deferred tokens
    assert Scheduler(sched.config).fit_chunk(900) == 900  # no buckets: as asked


def test_chunk_graphs_are_resolved_with_the_backend() -> None:
    """Auto: chunk graphs in the graph modes of xla and neuron; the host keeps its eager prefill (and its chunk
    lengths) in every mode; asking for chunk graphs without graphs is an error."""
    from engine.config import EngineConfig

    cfg = _cfg()
    assert EngineConfig.from_model_config(cfg, backend="xla", graph_mode="layer").graph.chunk_graphs is True
    assert EngineConfig.from_model_config(cfg, backend="xla", graph_mode="eager").graph.chunk_graphs is False
    assert EngineConfig.from_model_config(cfg, backend="host", graph_mode="layer").graph.chunk_graphs is False
    # the stand-in opts in (its compiles cost ~40 s each on a CPU): off by default, on when asked
    standin = {"backend": "neuron-standin", "graph_mode": "layer"}
    assert EngineConfig.from_model_config(cfg, **standin).graph.chunk_graphs is False
    assert EngineConfig.from_model_config(cfg, **standin, chunk_graphs=True).graph.chunk_graphs is True
    with pytest.raises(ValueError, match="chunk_graphs needs graph mode"):
        EngineConfig.from_model_config(cfg, graph_mode="eager", chunk_graphs=True)


def test_chunk_graphs_are_portable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunk-region graphs of a CSA layer (window ring, compressor, indexer top-k) captured through AOTAutograd
    have none of the patterns upstream torch-mlir does not lower (engine/backends/portable.py), and the tokens are
    the eager engine's."""
    from engine.backends.portable import LintBackend
    from tests.test_portable import _graphs_via

    cfg = ModelConfig(vocab_size=512, dim=64, n_layers=1, n_mtp_layers=0, compress_ratios=(4,), n_hash_layers=0,
                      n_heads=2, head_dim=64, rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16,
                      window_size=8, n_routed_experts=4, n_activated_experts=2, moe_inter_dim=32, index_n_heads=4,
                      index_head_dim=32, index_topk=2, swiglu_limit=1.0, max_position_embeddings=256)
    weights = random_weights(cfg, 0, with_mtp=False)
    prompts = [[5, 9, 2], list(range(3, 14))]
    want, _ = greedy(build(cfg, weights, max_model_len=64, graph_mode="eager"), prompts, 4)
    lint = LintBackend()
    _graphs_via(lint, monkeypatch)
    eng = build(cfg, weights, max_model_len=64, graph_mode="layer", host_compiler="aot_eager", chunk_graphs=True)
    got, _ = greedy(eng, prompts, 4)
    assert got == want
    assert any(k[0].startswith("chunk") for k in eng.runner.regions.compiled)
    assert lint.graphs > 3 and lint.problems == []


def test_speculative_verify_steps_in_chunk_graphs_give_the_plain_greedy_tokens() -> None:
    """MTP speculation (k = 2) with chunk graphs: every verify step (1 + 2 tokens per sequence) runs in the chunk
    bucket 8 (`plan_runs`), the draft head reads the graph run's final streams; greedy speculation gives exactly the
    tokens of plain greedy decoding on the eager path."""
    cfg = _cfg(n_mtp_layers=1)
    weights = random_weights(cfg, 0, with_mtp=True)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 1024, (n,), generator=g).tolist() for n in (6, 21, 40)]
    want, _ = greedy(build(cfg, weights, graph_mode="eager", max_model_len=256), prompts, 8)
    eng = build(cfg, weights, graph_mode="layer", host_compiler="none", chunk_graphs=True, max_model_len=256,
                speculative="mtp", num_speculative_tokens=2)
    got, _ = greedy(eng, prompts, 8)
    assert got == want
    chunk = {k[2:4] for k in eng.runner.regions.compiled if k[0].startswith("chunk")}
    assert (4, 8) in chunk  # the verify steps: 3 sequences x 3 tokens, batch bucket 4, chunk bucket 8
