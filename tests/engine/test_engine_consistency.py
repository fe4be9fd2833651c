"""The engine against itself: incremental decode == a full no-cache forward; the vectorised decode path == the
per-sequence chunk path; chunked prefill == whole prefill; batching does not cross-contaminate sequences."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.model.cache import SeqStep
from engine.model.dummy import random_weights
from engine.runner import ModelRunner
from tests.engines import build, greedy

TINY = ModelConfig(vocab_size=512, dim=64, n_layers=4, n_mtp_layers=1, compress_ratios=(0, 4, 16, 4, 0),
                   n_hash_layers=2, n_heads=4, head_dim=32, rope_head_dim=16, q_lora_rank=32, o_groups=2,
                   o_lora_rank=16, window_size=16, n_routed_experts=8, n_activated_experts=2, moe_inter_dim=32,
                   index_n_heads=16, index_head_dim=32, index_topk=4, swiglu_limit=1.0, max_position_embeddings=1024)
TOL = 1e-4  # fp32, same math in a different order


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return random_weights(TINY, seed=1)


def _runner(weights, **kw) -> ModelRunner:
    return build(TINY, weights, **kw).runner


def _engine(weights, **kw):
    return build(TINY, weights, **kw)


def _logits_by_chunks(runner: ModelRunner, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    out, start = [], 0
    table = torch.arange(0, 20)
    for n in chunks:
        step = SeqStep(slot=1, start=start, n=n, token_start=0, block_table=table)
        out.append(runner.forward([step], ids[start:start + n], logit_index=torch.arange(n)))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("length", [9, 70])
def test_incremental_equals_full_forward(weights, length: int) -> None:
    """70 tokens cross the window (16), 17 CSA blocks (top-k 4 really selects) and 4 HCA blocks."""
    ids = torch.randint(2, TINY.vocab_size, (length,), generator=torch.Generator().manual_seed(length))
    full = _logits_by_chunks(_runner(weights), ids, [length])
    for chunks in ([1] * length, [5, length - 5], [length // 3, length // 3, length - 2 * (length // 3)]):
        got = _logits_by_chunks(_runner(weights), ids, chunks)
        assert (got - full).abs().max() < TOL, f"chunks {chunks[:4]}..."
    per_seq = _logits_by_chunks(_runner(weights, batch_decode=False), ids, [3] + [1] * (length - 3))
    assert (per_seq - full).abs().max() < TOL


def test_batch_has_no_cross_contamination(weights) -> None:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, TINY.vocab_size, (n,), generator=g).tolist() for n in (2, 19, 64, 101)]
    batched, blog = greedy(_engine(weights), prompts, 12)
    for i, p in enumerate(prompts):
        alone, alog = greedy(_engine(weights), [p], 12)
        assert alone[0] == batched[i]
        assert (alog[0] - blog[i]).abs().max() < TOL


def test_slot_reuse_resets_state(weights) -> None:
    eng = _engine(weights)
    first, _ = greedy(eng, [[5, 6, 7, 8, 9, 10, 11]], 6)  # fills slot 0's compressor state
    again, _ = greedy(eng, [[5, 6]], 6)  # slot 0 again; shorter than a CSA block: stale rows would leak
    fresh, _ = greedy(_engine(weights), [[5, 6]], 6)
    assert again == fresh
    assert first  # ran


def test_block_table_too_small_is_an_error(weights) -> None:
    runner = _runner(weights)
    step = SeqStep(slot=0, start=0, n=40, token_start=0, block_table=torch.arange(1))
    with pytest.raises(ValueError, match="block table"):
        runner.forward([step], torch.zeros(40, dtype=torch.long))


def test_bf16_runs_and_stays_close(weights) -> None:
    ids = torch.randint(2, TINY.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    f32 = _logits_by_chunks(_runner(weights), ids, [40])
    b16 = _logits_by_chunks(_runner(weights, dtype="bfloat16"), ids, [40])
    assert b16.dtype == torch.float32
    assert (b16 - f32).abs().max() < 0.5  # bf16 activations/weights, fp32 reference: loose but bounded


def test_query_tiled_prefill_attention_equals_untiled(weights, monkeypatch) -> None:
    """Prefill attention in query tiles over only the keys a tile can see (attention.ATTN_Q_TILE) == one pass over
    every key with the mask: a 70-token chunk in tiles of 8 (window 16, CSA and HCA entries, cp = 1)."""
    from engine.model import attention

    ids = torch.randint(2, TINY.vocab_size, (70,), generator=torch.Generator().manual_seed(7))
    monkeypatch.setattr(attention, "ATTN_Q_TILE", 10**9)
    whole = _logits_by_chunks(_runner(weights), ids, [70])
    monkeypatch.setattr(attention, "ATTN_Q_TILE", 8)
    tiled = _logits_by_chunks(_runner(weights), ids, [70])
    assert (tiled - whole).abs().max() < TOL
