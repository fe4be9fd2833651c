"""The draft heads (engine/model/mtp_proposer.py: MTP; engine/model/dspark_proposer.py: DSpark) against
re-derivations that share no code with them: the V4 block is HF transformers' `DeepseekV4DecoderLayer` (independent
of the engine, checked against DeepSeek's code in spec §6), the MTP input mixing, the DSpark attention, RoPE, the
Markov head and the confidence head are written out plainly here. Small random configs, fp32."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import ModelConfig
from engine.model.cache import SeqStep, StepPlan
from engine.model.dummy import random_weights
from engine.model.mtp_proposer import DraftInput, propose_mtp
from tests.engines import build

pytest.importorskip("transformers", minversion="5.24", reason="the HF reference needs the `reference` extra")
pytestmark = pytest.mark.reference

from deepinfer_bench.bench.hf_reference import build_hf_model  # noqa: E402

TOL = 2e-4  # fp32 vs fp32 on O(3) logits: summation order only (~1e-5 seen)

BASE = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_mtp_layers=1, compress_ratios=(0, 4, 0), n_hash_layers=1,
                   n_heads=4, head_dim=32, rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16,
                   window_size=8, n_routed_experts=4, n_activated_experts=2, moe_inter_dim=32, index_n_heads=16,
                   index_head_dim=32, index_topk=2, hc_mult=4, swiglu_limit=10.0, max_position_embeddings=512)
DSPARK = dataclasses.replace(BASE, n_mtp_layers=2, compress_ratios=(0, 4, 0, 0), dspark_block_size=4,
                             dspark_noise_token_id=3, dspark_target_layer_ids=(0, 1), dspark_markov_rank=8)
_BLOCK_KEYS = ("attn.", "ffn.", "attn_norm.", "ffn_norm.", "hc_attn_", "hc_ffn_")


def _engine(cfg: ModelConfig, seed: int = 0):
    w = random_weights(cfg, seed=seed, with_mtp=True)
    # an MTP model's cache sized for 4 drafts: the recursion's rows land on the spare ring rows (mtp_proposer.py)
    spec = {} if cfg.has_dspark else {"speculative": "mtp", "num_speculative_tokens": 4}
    return build(cfg, w, with_mtp=True, dtype="float32", max_num_seqs=2, num_kv_blocks=32, **spec), w


def _hf_stack(cfg: ModelConfig, w: dict[str, torch.Tensor]):
    """An HF model whose layer s is draft layer mtp.s (all sliding, no hash routing) and whose hc_head / norm are
    the last draft layer's: the independent V4 block for the re-derivations."""
    n = cfg.n_mtp_layers
    hcfg = dataclasses.replace(cfg, n_layers=n, n_mtp_layers=0, compress_ratios=(0,) * n, n_hash_layers=0,
                               dspark_block_size=0, dspark_noise_token_id=0, dspark_target_layer_ids=(),
                               dspark_markov_rank=0)
    last = f"mtp.{n - 1}."
    sd = {k: w[k] for k in ("embed.weight", "head.weight")}
    sd.update({k: w[last + k] for k in ("norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale")})
    for s in range(n):
        p = f"mtp.{s}."
        sd.update({f"layers.{s}.{k[len(p):]}": v for k, v in w.items() if k.startswith(p)
                   and k[len(p):].startswith(_BLOCK_KEYS)})
    return build_hf_model(hcfg, sd)


def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def _hf_layer(hf, s: int, x: torch.Tensor, ids: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """HF decoder layer s on streams x [S, n, D] at positions 0..S-1 (sliding-window causal mask)."""
    from transformers.masking_utils import create_sliding_window_causal_mask

    pos = torch.arange(x.shape[0])[None]
    emb = x[None, :, 0]
    mask = create_sliding_window_causal_mask(config=hf.config, inputs_embeds=emb, attention_mask=None, cache=None,
                                             position_ids=pos, allow_is_causal_skip=False) if causal else None
    pe = {t: hf.model.rotary_emb(emb, position_ids=pos, layer_type=t) for t in ("main", "compress")}
    return hf.model.layers[s](x[None], position_embeddings=pe, position_ids=pos, attention_mask=mask,
                              input_ids=ids[None])[0]


def _hf_logits(hf, x: torch.Tensor) -> torch.Tensor:
    return hf.lm_head(hf.model.norm(hf.model.hc_head(x[None])))[0].float()


# ---- MTP ---------------------------------------------------------------------------------------------------------
def _plain_mtp(hf, w: dict[str, torch.Tensor], x: torch.Tensor, nxt: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Official MTPBlock over rows 0..S-1: e = enorm(E[next]), h = hnorm(x) per stream, x0 = e_proj(e) + h_proj(h),
    the block, then its own hc_head / norm and the shared head -> (logits [S, V], output streams [S, n, D])."""
    e = _rms(w["embed.weight"][nxt], w["mtp.0.enorm.weight"])
    h = _rms(x, w["mtp.0.hnorm.weight"])
    x0 = (e @ w["mtp.0.e_proj.weight"].T)[:, None] + h @ w["mtp.0.h_proj.weight"].T
    y = _hf_layer(hf, 0, x0, nxt)
    return _hf_logits(hf, y), y


def _plain_drafts(hf, w, target: torch.Tensor, toks: list[int], k: int) -> tuple[list[int], list[torch.Tensor]]:
    """k greedy drafts after the committed tokens `toks` (target streams [len(toks)-1, n, D] at positions
    0..len-2, the last token is the bonus), recursing as vLLM does: row p+1 gets the block's own output at row p."""
    x, nxt = target, torch.tensor(toks[1:])
    drafts, logits = [], []
    for _ in range(k):
        lg, y = _plain_mtp(hf, w, x, nxt)
        logits.append(lg[-1])
        drafts.append(int(lg[-1].argmax()))
        x = torch.cat([x, y[-1:]])
        nxt = torch.cat([nxt, torch.tensor(drafts[-1:])])
    return drafts, logits


@torch.no_grad()
@pytest.mark.parametrize("accepted", [0, 2])
def test_mtp_drafts_match_plain_recursion_across_rounds(accepted: int) -> None:
    eng, w = _engine(BASE)
    r, m = eng.runner, eng.runner.model
    hf = _hf_stack(BASE, w)
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(4, 256, (21,), generator=g).tolist()  # 20 prompt tokens + the bonus
    table = torch.arange(8)
    target = r.forward([SeqStep(0, 0, 20, 0, table)], torch.tensor(toks[:20]), return_hidden=True)
    k = 3
    prop = propose_mtp(m, r.cache, [DraftInput(0, 0, 20, table)], target, torch.tensor(toks[1:]), k, r.block_size)
    want, want_lg = _plain_drafts(hf, w, target, toks, k)
    assert prop.tokens[0].tolist() == want and prop.num_proposed.tolist() == [k]
    assert (prop.logits[0] - torch.stack(want_lg)).abs().max() < TOL
    # verify: the target runs [bonus, drafts]; `accepted` drafts pass (forced here), the target's token after
    # them is the new bonus; only the bonus + accepted positions become final for the MTP catch-up
    verify = toks[20:] + prop.tokens[0].tolist()
    hidden = r.forward([SeqStep(0, 20, k + 1, 0, table)], torch.tensor(verify), return_hidden=True)
    new_bonus = int(torch.randint(4, 256, (1,), generator=g))
    committed = toks + prop.tokens[0, :accepted].tolist() + [new_bonus]
    n = accepted + 1
    prop2 = propose_mtp(m, r.cache, [DraftInput(0, 20, n, table)], hidden[:n],
                        torch.tensor(committed[21: 21 + n]), k, r.block_size)
    full = torch.cat([target, hidden[:n]])  # the target's states at every final position
    want2, want2_lg = _plain_drafts(hf, w, full, committed, k)
    assert prop2.tokens[0].tolist() == want2
    assert (prop2.logits[0] - torch.stack(want2_lg)).abs().max() < TOL


@torch.no_grad()
def test_mtp_batch_of_sequences_equals_one_by_one() -> None:
    eng, _ = _engine(BASE, seed=3)
    r, m = eng.runner, eng.runner.model
    g = torch.Generator().manual_seed(2)
    lens = (5, 13)
    toks = [torch.randint(4, 256, (n + 1,), generator=g) for n in lens]
    tables = [torch.arange(8), torch.arange(8, 16)]
    ins = [DraftInput(i, 0, n, tables[i]) for i, n in enumerate(lens)]
    steps = [SeqStep(i, 0, n, sum(lens[:i]), tables[i]) for i, n in enumerate(lens)]
    x = r.forward(steps, torch.cat([t[:-1] for t in toks]), return_hidden=True)
    both = propose_mtp(m, r.cache, ins, x, torch.cat([t[1:] for t in toks]), 4, r.block_size)
    for i, n in enumerate(lens):
        r.free_slot(i)
        xi = r.forward([SeqStep(i, 0, n, 0, tables[i])], toks[i][:-1], return_hidden=True)
        one = propose_mtp(m, r.cache, [ins[i]], xi, toks[i][1:], 4, r.block_size)
        assert one.tokens[0].tolist() == both.tokens[i].tolist()
        assert (one.logits[0] - both.logits[i]).abs().max() < TOL


def test_mtp_rejects_a_dspark_model() -> None:
    eng, _ = _engine(DSPARK)
    with pytest.raises(ValueError, match="exactly one MTP block"):
        propose_mtp(eng.runner.model, eng.runner.cache, [], torch.zeros(0, 4, 64), torch.zeros(0), 1, 16)


# ---- DSpark --------------------------------------------------------------------------------------------------------
def _rope(x: torch.Tensor, pos: torch.Tensor, rd: int, theta: float, inverse: bool = False) -> torch.Tensor:
    """Interleaved RoPE on the trailing rd dims, plain base theta (no YaRN); x [S, ..., D], pos [S]."""
    ang = pos.double()[:, None] * theta ** (-torch.arange(0, rd, 2).double() / rd)  # [S, rd/2]
    ang = (-ang if inverse else ang).view(x.shape[0], *([1] * (x.dim() - 2)), rd // 2)
    cos, sin = ang.cos().float(), ang.sin().float()
    a, b = x[..., -rd::2], x[..., -rd + 1::2]
    rot = torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)
    return torch.cat([x[..., :-rd], rot], -1)


class _PlainDSparkAttention(torch.nn.Module):
    """DeepSeek's DSparkAttention for one sequence, plainly: block queries at positions p+1.. attend, with the
    sink, to the context keys and to every block key (no causal mask), inverse RoPE, grouped low-rank output."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, ctx: torch.Tensor,
                 pos: torch.Tensor) -> None:
        super().__init__()
        self.cfg, self.w, self.p, self.ctx, self.pos = cfg, w, prefix, ctx, pos

    def forward(self, x: torch.Tensor, **_) -> tuple[torch.Tensor, None]:
        c, w, p = self.cfg, self.w, self.p
        x = x[0]
        q = (_rms(x @ w[p + "wq_a.weight"].T, w[p + "q_norm.weight"]) @ w[p + "wq_b.weight"].T)
        q = _rope(_rms(q.view(-1, c.n_heads, c.head_dim), None), self.pos, c.rope_head_dim, c.rope_theta)
        kv = _rope(_rms(x @ w[p + "wkv.weight"].T, w[p + "kv_norm.weight"]), self.pos, c.rope_head_dim, c.rope_theta)
        keys = torch.cat([self.ctx, kv])  # every query: all context keys and all block keys
        lg = torch.einsum("shd,nd->shn", q, keys) / c.head_dim ** 0.5
        sink = w[p + "attn_sink"][None, :, None]
        m = torch.maximum(lg.amax(-1, keepdim=True), sink)
        pr = torch.exp(lg - m)
        o = torch.einsum("shn,nd->shd", pr, keys) / (pr.sum(-1, keepdim=True) + torch.exp(sink - m))
        o = _rope(o, self.pos, c.rope_head_dim, c.rope_theta, inverse=True).reshape(len(x), c.o_groups, -1)
        wo_a = w[p + "wo_a.weight"].view(c.o_groups, c.o_lora_rank, -1)
        u = torch.einsum("sgd,grd->sgr", o, wo_a).flatten(1)
        return (u @ w[p + "wo_b.weight"].T)[None], None


def _hf_capture(cfg: ModelConfig, w: dict[str, torch.Tensor], toks: torch.Tensor) -> torch.Tensor:
    """HF's main model over toks: the streams entering each target layer, mean over hc, concatenated."""
    hf = build_hf_model(cfg, w)
    got = {}
    hooks = [hf.model.layers[i].register_forward_pre_hook(
        lambda mod, args, i=i: got.__setitem__(i, args[0][0].mean(1))) for i in cfg.dspark_target_layer_ids]
    hf(input_ids=toks[None])
    for h in hooks:
        h.remove()
    return torch.cat([got[i] for i in cfg.dspark_target_layer_ids], -1)


def _plain_dspark(cfg, w, hf, captured: torch.Tensor, bonus: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """One block after context positions 0..p (captured [p+1, ncap*D]): greedy drafts, their Markov-corrected
    logits and the confidence logits."""
    p, bs = captured.shape[0] - 1, cfg.dspark_block_size
    main_x = _rms(captured @ w["mtp.0.main_proj.weight"].T, w["mtp.0.main_norm.weight"])
    cpos = torch.arange(max(0, p - cfg.window_size + 1), p + 1)  # the window of context positions
    bpos = p + 1 + torch.arange(bs)
    ids = torch.tensor([bonus] + [cfg.dspark_noise_token_id] * (bs - 1))
    x = w["embed.weight"][ids][:, None].expand(bs, cfg.hc_mult, cfg.dim).contiguous()
    for s in range(cfg.n_mtp_layers):
        a = f"mtp.{s}.attn."
        ctx = _rope(_rms(main_x[cpos] @ w[a + "wkv.weight"].T, w[a + "kv_norm.weight"]), cpos, cfg.rope_head_dim,
                    cfg.rope_theta)
        hf.model.layers[s].self_attn = _PlainDSparkAttention(cfg, w, a, ctx, bpos)
        x = _hf_layer(hf, s, x, ids, causal=False)
    last = f"mtp.{cfg.n_mtp_layers - 1}."
    h = hf.model.hc_head(x[None])[0]  # before norm
    base = hf.lm_head(hf.model.norm(h[None]))[0].float()
    w1, w2 = w[last + "markov_head.markov_w1.weight"], w[last + "markov_head.markov_w2.weight"]
    prev, drafts, logits, embs = bonus, [], [], []
    for k in range(bs):
        embs.append(w1[prev])
        logits.append(base[k] + w2 @ w1[prev])
        prev = int(logits[-1].argmax())
        drafts.append(prev)
    conf = torch.cat([h, torch.stack(embs)], -1) @ w[last + "confidence_head.proj.weight"][0]
    return drafts, torch.stack(logits), conf


@torch.no_grad()
def test_capture_is_the_mean_stream_entering_each_target_layer() -> None:
    from engine.model.dspark_proposer import hidden_and_capture

    eng, w = _engine(DSPARK)
    r = eng.runner
    toks = torch.randint(4, 256, (11,), generator=torch.Generator().manual_seed(4))
    plan = StepPlan.build([SeqStep(0, 0, 11, 0, torch.arange(8))], r.block_size)
    _, cap = hidden_and_capture(r.model, toks, plan, r.cache)
    assert cap.shape == (11, 2 * DSPARK.dim)
    assert (cap - _hf_capture(DSPARK, w, toks)).abs().max() < 1e-4


@torch.no_grad()
@pytest.mark.parametrize("prompt", [5, 13])  # inside the window (8), and past it
def test_dspark_block_matches_plain_across_rounds(prompt: int) -> None:
    from engine.model import dspark_proposer as dspark

    eng, w = _engine(DSPARK, seed=5)
    r, m = eng.runner, eng.runner.model
    hf = _hf_stack(DSPARK, w)
    g = torch.Generator().manual_seed(prompt)
    toks = torch.randint(4, 256, (prompt + 1,), generator=g)  # prompt + the bonus
    table = torch.arange(8)
    plan = StepPlan.build([SeqStep(0, 0, prompt, 0, table)], r.block_size)
    _, cap = dspark.hidden_and_capture(m, toks[:prompt], plan, r.cache)
    dspark.write_context(m, r.cache, [DraftInput(0, 0, prompt, table)], cap)
    one = lambda: dspark.propose_dspark(m, r.cache, torch.tensor([0]), torch.tensor([toks.numel() - 2]),  # noqa: E731
                                        toks[-1:])
    prop = one()
    full = _hf_capture(DSPARK, w, toks[:-1])
    want, want_lg, want_conf = _plain_dspark(DSPARK, w, hf, full, int(toks[-1]))
    assert prop.tokens[0].tolist() == want
    assert (prop.logits[0] - want_lg).abs().max() < TOL and (prop.confidence[0] - want_conf).abs().max() < TOL
    # next round: the target verified [bonus, drafts], 2 drafts accepted -> 3 positions final, a new bonus
    verify = torch.cat([toks[-1:], prop.tokens[0]])
    plan = StepPlan.build([SeqStep(0, prompt, len(verify), 0, table)], r.block_size)
    _, cap2 = dspark.hidden_and_capture(m, verify, plan, r.cache)
    dspark.write_context(m, r.cache, [DraftInput(0, prompt, 3, table)], cap2[:3])
    toks = torch.cat([toks, prop.tokens[0, :2], torch.tensor([7])])
    prop2 = one()
    want2, want2_lg, _ = _plain_dspark(DSPARK, w, hf, _hf_capture(DSPARK, w, toks[:-1]), 7)
    assert prop2.tokens[0].tolist() == want2 and (prop2.logits[0] - want2_lg).abs().max() < TOL


@torch.no_grad()
def test_dspark_block_is_non_causal_inside_and_batched() -> None:
    from engine.model import dspark_proposer as dspark

    eng, _ = _engine(DSPARK, seed=6)
    st = eng.runner.model.mtp[0]
    bs, d = DSPARK.dspark_block_size, DSPARK.dim
    h = torch.randn(2 * bs, d, generator=torch.Generator().manual_seed(0))
    pos = (torch.tensor([[9], [30]]) + torch.arange(bs)).flatten()
    ctx = torch.randn(2, 8, DSPARK.head_dim)
    valid = torch.ones(2, 8, dtype=torch.bool)
    out = st.attn.block(h, pos, ctx, valid)
    h2 = h.clone()
    h2[bs - 1] += 1.0  # the last block position of sequence 0
    out2 = st.attn.block(h2, pos, ctx, valid)
    assert (out2[0] - out[0]).abs().max() > 1e-4  # the first position sees a later one: non-causal
    assert (out2[bs:] - out[bs:]).abs().max() == 0  # sequence 1 untouched
    valid[0, 3:] = False  # masked context rows do not count
    ctx2 = ctx.clone()
    ctx2[0, 3:] = 100.0
    assert (st.attn.block(h, pos, ctx2, valid)[:bs] - st.attn.block(h, pos, ctx, valid)[:bs]).abs().max() == 0
    assert (dspark.confident_prefix(torch.tensor([[3.0, 1.0, -1.0, 2.0]]), 0.5)).tolist() == [2]


def test_confidence_cut() -> None:
    from engine.model.dspark_proposer import confident_prefix

    c = torch.tensor([[2.0, 0.5, -0.1, 3.0], [-2.0, 5.0, 5.0, 5.0], [4.0, 4.0, 4.0, 4.0]])
    # sigmoid: [.88 .62 .48 .95], [.12 .99 ...], [.98 ...]
    assert confident_prefix(c, 0.5).tolist() == [2, 0, 4]
    assert confident_prefix(c, 0.7).tolist() == [1, 0, 4]
    assert confident_prefix(c, 0.0).tolist() == [4, 4, 4]  # <= 0: no cut
