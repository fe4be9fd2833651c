"""DSpark on the host table's fast path: a verify step with the context capture runs its rows as decode rows (every
layer whose indexer does not select in one native call, never the eager chunk path), and each stage of a draft
block is one native `decode_layer` call over the stage's ring (`BlockDecoder.ring_layer`: the block's keys written
past the last final position). Greedy tokens are plain decoding's, the drafts those of the stages run op by op,
and the block's ring writes leave every context row a later block reads untouched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine
from deepinfer_bench.bench.golden import FP32_LOGIT_TOL
from engine import host_kernels as H
from engine.config import EngineConfig
from engine.host_kernels.block_decoder import HostBlockDecoder
from engine.llm import greedy_with_logits
from engine.model import dspark_proposer as dspark
from engine.model.attention import Attention
from engine.model.cache import DraftInput, SeqStep

TINY_SPEC_DSPARK = Path(__file__).resolve().parents[2] / "golden" / "tiny-spec-dspark"
PROMPTS = [list(range(3, 12)), [7, 300, 41, 2, 2, 9, 13, 600, 5, 8, 21, 34, 55]]
NEW = 24  # past the window (16) and several CSA (4) / HCA (16) blocks


def _engine(speculative: str = "dspark", max_num_seqs: int = 2):
    cfg = EngineConfig.from_model_dir(TINY_SPEC_DSPARK, kernels="host", max_num_seqs=max_num_seqs,
                                      speculative=speculative, enable_prefix_caching=False,
                                      speculative_policy="always")
    return engine.build(cfg)


def _native_rows() -> bool:
    """Whether this build's row limits take a block of 2 sequences natively (not the portable build)."""
    return all(H.max_m(k) >= 10 for k in ("mhc", "sparse_attn", "linear", "fp8", "fp4"))


def _run(monkeypatch: pytest.MonkeyPatch, ring: bool) -> tuple[list, list, int, int, dict, dict, int]:
    """Greedy DSpark on tiny-spec-dspark with host kernels: (tokens, logits, eager chunks past the prompts,
    accepted drafts, dispatch counts of the draft calls, of the target steps, decode steps: every step after the one
    prefill step); `ring` False: the stages op by op."""
    late_chunks = [0]
    real_chunk = Attention._chunk

    def chunk(self, q, kv, aux, s, cache, rows):
        late_chunks[0] += s.start >= len(PROMPTS[0])  # a chunk after the shorter prompt: a verify step's
        return real_chunk(self, q, kv, aux, s, cache, rows)

    with monkeypatch.context() as m:
        m.setattr(Attention, "_chunk", chunk)
        if not ring:
            m.setattr(HostBlockDecoder, "ring_layer", lambda *a: None)
        eng = _engine()
        run = eng.runner
        draft_counts: dict = {}
        real_draft = run.draft

        def draft(requests):
            before = dict(run.dispatcher.counts)
            out = real_draft(requests)
            for k, v in run.dispatcher.counts.items():
                draft_counts[k] = draft_counts.get(k, 0) + v - before.get(k, 0)
            return out

        m.setattr(run, "draft", draft)
        late_chunks[0] = 0
        outs, logits = greedy_with_logits(eng, PROMPTS, NEW)
    target = {k: v - draft_counts.get(k, 0) for k, v in run.dispatcher.counts.items()}
    return (outs, logits, late_chunks[0], eng.spec_stats.num_accepted_tokens, draft_counts, target,
            eng.stats().num_steps - 1)


def test_dspark_verify_and_draft_take_the_native_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    outs, logits, late, accepted, counts, target, steps = _run(monkeypatch, ring=True)
    plain_outs, plain_logits = greedy_with_logits(_engine("none"), PROMPTS, NEW)
    assert outs == plain_outs  # greedy speculation is plain decoding
    dlogit = max(float((a - b).abs().max()) for a, b in zip(logits, plain_logits, strict=True))
    assert dlogit <= FP32_LOGIT_TOL, dlogit
    assert late == 0  # the verify steps with the capture ran as decode rows, not the eager chunk path
    ref_outs, _, _, ref_accepted, ref_counts, _, _ = _run(monkeypatch, ring=False)
    assert ref_outs == outs and accepted == ref_accepted > 0  # the same drafts, accepted as often
    if _native_rows():
        # every decode step (its verify rows and the capture): the target's 4 layers' attention natively, as in
        # a plain decode step, the layers whose indexer does not select in one call
        assert steps > 0 and target[("host.attn_decode", "host")] >= 4 * steps
        assert target[("host.decode_layer", "host")] >= steps
        key = ("host.decode_layer", "host")
        drafts = counts.get(("host.hc_head", "host"), 0)  # one head per block
        assert drafts > 0 and counts.get(key, 0) >= 2 * drafts  # both stages of every block: one call each
        assert ref_counts.get(key, 0) == 0


@torch.no_grad()
def test_a_block_on_the_ring_writes_past_the_context_only() -> None:
    """The block's ring writes land on the rows of its own positions (past the last final one): every row a
    later block reads (the window up to `last`) is unchanged, and the drafts and logits are those of the stages
    run over the gathered context (op by op)."""
    eng = _engine(max_num_seqs=1)
    run = eng.runner
    model, cache = run.model, run.cache
    prompt = torch.tensor(PROMPTS[1] * 2)  # 26 tokens: past the window
    steps = [DraftInput(0, 0, len(prompt), torch.arange(4))]
    run.forward([SeqStep(0, 0, len(prompt), 0, torch.arange(4))], prompt, return_hidden=True)
    dspark.write_context(model, cache, steps, run._last[2].tensor())  # the step's Capture, made
    last, bs = len(prompt) - 1, model.cfg.dspark_block_size
    stages = [cache.layers[st.layer_id] for st in model.mtp]
    wl = stages[0].win_kv.shape[1]
    assert wl >= model.cfg.window_size + bs  # the engine's ring has the spare rows a block needs
    before = [lc.win_kv[0].clone() for lc in stages]
    with run.dispatcher.active():
        on_ring = dspark.propose_dspark(model, cache, torch.tensor([0]), torch.tensor([last]), torch.tensor([5]))
    window = torch.tensor([p % wl for p in range(last - model.cfg.window_size + 1, last + 1)])
    block = torch.tensor([p % wl for p in range(last + 1, last + 1 + bs)])
    for lc, old in zip(stages, before, strict=True):
        assert torch.equal(lc.win_kv[0, window], old[window])
        if _native_rows():
            assert not torch.equal(lc.win_kv[0, block], old[block])  # the block's keys
    real = HostBlockDecoder.ring_layer
    try:
        HostBlockDecoder.ring_layer = lambda *a: None
        op_by_op = dspark.propose_dspark(model, cache, torch.tensor([0]), torch.tensor([last]), torch.tensor([5]))
    finally:
        HostBlockDecoder.ring_layer = real
    assert torch.equal(on_ring.tokens, op_by_op.tokens)
    assert (on_ring.logits - op_by_op.logits).abs().max() <= FP32_LOGIT_TOL
    # the engine asks for no more drafts than a request wants: the first ones, the same
    short = dspark.propose_dspark(model, cache, torch.tensor([0]), torch.tensor([last]), torch.tensor([5]), drafts=2)
    assert torch.equal(short.tokens, on_ring.tokens[:, :2]) and short.num_proposed.tolist() == [2]
    # a ring without spare rows for the block: no ring inputs (its writes would land on context rows)
    attn = model.mtp[0].attn
    pos = last + 1 + torch.arange(bs)[None]
    narrow = type("Ring", (), {"win_kv": torch.zeros(1, model.cfg.window_size + bs - 1, 1)})()
    assert attn.ring_inputs(narrow, torch.tensor([0]), pos, torch.ones(1, wl, dtype=torch.bool)) is None
    assert attn.ring_inputs(stages[0], torch.tensor([0]), pos, torch.ones(1, wl, dtype=torch.bool)) is not None


def test_the_capture_is_the_hc_mean_of_the_streams_entering_each_target_layer() -> None:
    """`Capture.tensor()` (the sums, then one division) is torch.mean over the hc streams bit for bit, in the
    config's layer order, and `rows` / `cat` select and join rows as the made tensor's would."""
    from engine.model.dspark_proposer import Capture

    g = torch.Generator().manual_seed(5)
    streams = [torch.randn(6, 4, 32, generator=g) for _ in range(3)]
    cap = Capture(streams)
    want = torch.cat([s.mean(1) for s in streams], 1)
    assert torch.equal(cap.tensor(), want)
    assert torch.equal(cap.rows(torch.tensor([4, 1])).tensor(), want[[4, 1]])
    assert torch.equal(Capture.cat([cap.rows(slice(0, 2)), cap.rows(slice(3, 6))]).tensor(), want[[0, 1, 3, 4, 5]])
    odd = Capture([torch.randn(5, 3, 8, generator=g)])  # a stream count that is no power of two
    assert torch.equal(odd.tensor(), odd.streams[0].mean(1))
