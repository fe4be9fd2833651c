"""The DSpark proposer: the draft head of DeepSeek-V4-Flash-0731 / -Pro-0813 (stored under `mtp.*`), as model code,
behind the `Proposer` seam (engine/model/proposer.py).

Pinned from public code (read, not copied). DeepSeek's own `DSparkAttention` / `DSparkBlock` / `forward_spec`
(the V4.1-Flash `inference/model.py`, a public vendored copy: same DSpark design on a newer backbone) gives the
block input, the positions, the window + whole-block key set, the capture (mean over hc of the streams entering the
target layers) and the sequential Markov loop. TensorRT-LLM `_torch/models/modeling_dspark.py` (a port of the
V4-Pro-DSpark reference) gives the V4 layout under `mtp.*`: main_proj (FP8) + main_norm on stage 0, norm + hc head +
heads on the last stage, every stage's own wkv / kv_norm over the shared main_x, plain RoPE, the sink. vLLM
`models/deepseek_v4/nvidia/dspark.py` + `qwen3_dspark.py` give the head names (`markov_head.markov_w1/w2`,
`confidence_head.proj`, bias-free), the confidence on the hc-head output before `norm`, and sigmoid(confidence).
`deepseek-ai/DeepSpec` gives the confidence cut and the training recipe. Configs of the 0731 release as quoted by
third parties: dspark_block_size 5, dspark_noise_token_id 128799, dspark_target_layer_ids [40, 41, 42],
dspark_markov_rank 256, 43 + 3 compress_ratios (the Pro-0813 values, e.g. its block size, were not found).

* **Context**: the residual streams *entering* main layers `dspark_target_layer_ids` (mean over the hc streams),
  concatenated -> `mtp.0.main_proj` (FP8) -> `mtp.0.main_norm` = main_x, one vector per target position, shared by
  every stage. Each stage turns main_x at position p into a window key with its own `attn.wkv` + `attn.kv_norm` +
  RoPE at p, kept in that stage's ring (KVCache layer n_layers + s, [win, head_dim] per slot, position p in row
  p % win).
* **Block**: after the target's last final position p (bonus token b = the token at p + 1), the input is
  [b, noise x (block_size - 1)] at positions p + 1 .. p + block_size, embedded with the shared embedding and copied
  into the hc streams. Each stage is a V4 block (mHC, attention, MoE) whose attention is dense: every block query
  attends to the ring (the last `window_size` context positions <= p) and to **all** block positions (non-causal
  inside the block), with the sink; plain RoPE (compress ratio 0: `rope_theta`, no YaRN).
* **Heads** (last stage): `hc_head_*` collapses the streams to h; base logits = head(norm(h)) (shared head);
  the Markov head adds a low-rank bigram bias: logits_k = base_k + markov_w2(markov_w1[prev_k]) with
  prev_0 = b and prev_k = draft k-1 (sequential, drafts drawn left to right); the confidence head gives
  c_k = proj([h_k ; markov_w1[prev_k]]) (fp32, raw logit); the proposal is cut before the first k with
  sigmoid(c_k) < threshold (threshold <= 0: no cut). Draft k (0-based) is the token at p + 2 + k.

Not pinned by public material (choices made here, said again in the report): whether the confidence head reads h
before `norm` (DeepSeek's V4.1 code and vLLM) or after it (TensorRT-LLM passes the normed one) - before, here; the
FP8 quantisation simulation of the window keys (official only; the engine does none anywhere); the threshold (no
published value; 0 = off, as every port runs by default).

State and rollback: only the stages' rings, and they hold context keys of *final* positions only (written by
`write_context` from the target's captured streams after each step); the block's own keys are never stored. So
rejected drafts need no DSpark rollback, as long as the engine writes context for exactly the positions that
became final. Preemption: the slot is reset and the context rebuilt with the prompt's re-prefill.
"""

from __future__ import annotations

import torch

from engine.model.cache import DraftInput, KVCache, StepPlan
from engine.model.dspark_block import DSparkBlock
from engine.model.model import Transformer
from engine.model.proposer import Proposal, Sampler, greedy

_NO_TABLE = torch.empty(0, dtype=torch.long)  # DSpark's rings are sliding: no block table read


def _stages(model: Transformer) -> list[DSparkBlock]:
    if not model.cfg.has_dspark or not len(model.mtp):
        raise ValueError("the model has no DSpark head (dspark_block_size = 0, or loaded without its draft layers)")
    return list(model.mtp)


class Capture:
    """A target step's DSpark context input, made only where it is read: the streams entering each target layer
    ([T, n, dim] each; a layer returns new streams and never writes its input, so holding them is safe) ->
    `tensor()`: averaged over the hc streams and concatenated, [T, ncap*dim]. A step whose context waits (speculation
    off: `ModelRunner.hold`) pays no op for it until some steps' are written at once."""

    def __init__(self, streams: list[torch.Tensor]) -> None:
        self.streams = streams

    def __len__(self) -> int:
        return self.streams[0].shape[0]

    def rows(self, index: slice | torch.Tensor) -> Capture:
        """The rows `index` (a slice, or a tensor of row numbers) of every layer's streams."""
        if isinstance(index, slice):
            return Capture([s[index] for s in self.streams])
        return Capture([s.index_select(0, index) for s in self.streams])

    @staticmethod
    def cat(parts: list[Capture]) -> Capture:
        """Captures of several steps, rows back to back."""
        return Capture([torch.cat([p.streams[i] for p in parts]) for i in range(len(parts[0].streams))])

    def tensor(self) -> torch.Tensor:
        t, n, dim = self.streams[0].shape
        dtype, dev = self.streams[0].dtype, self.streams[0].device
        if dtype is not torch.float32:
            return torch.cat([s.float().mean(1).to(dtype) for s in self.streams], 1)
        out = torch.empty(t, len(self.streams) * dim, dtype=dtype, device=dev)
        for i, s in enumerate(self.streams):
            torch.sum(s, 1, out=out[:, i * dim: (i + 1) * dim])
        return out.div_(n)  # the sums, then one division: bit for bit torch.mean


def capture_streams(model: Transformer, input_ids: torch.Tensor, plan: StepPlan, cache: KVCache,
                    layer_ids: tuple[int, ...] | None = None) -> tuple[torch.Tensor, Capture]:
    """`Transformer.hidden` that also keeps DSpark's context input (`Capture`) of the layers `layer_ids` (default the
    config's dspark_target_layer_ids) -> (last-layer streams [T, n, dim], its capture)."""
    ids = model.cfg.dspark_target_layer_ids if layer_ids is None else layer_ids
    x = model.streams(input_ids)
    kept: dict[int, torch.Tensor] = {}
    for layer in model.layers:
        if layer.layer_id in ids:
            kept[layer.layer_id] = x
        x = layer(x, plan, cache, input_ids)
    if len(kept) != len(ids):
        raise ValueError(f"dspark_target_layer_ids {list(ids)}: the model's layers are 0..{len(model.layers) - 1}")
    return x, Capture([kept[i] for i in ids])


def hidden_and_capture(model: Transformer, input_ids: torch.Tensor, plan: StepPlan, cache: KVCache,
                       layer_ids: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`capture_streams` with the context made: (last-layer streams [T, n, dim], captured [T, ncap*dim]) - the
    streams entering each target layer, averaged over the hc streams and concatenated."""
    x, cap = capture_streams(model, input_ids, plan, cache, layer_ids)
    return x, cap.tensor()


def main_context(model: Transformer, captured: torch.Tensor) -> torch.Tensor:
    """main_x = main_norm(main_proj(captured)): [T, ncap*dim] -> [T, dim] (stage 0's; every stage's input)."""
    s0 = _stages(model)[0]
    return model.ops.rms_norm(s0.main_proj(captured.to(model.dtype)), s0.main_norm.weight, model.cfg.norm_eps)


def write_context(model: Transformer, cache: KVCache, seqs: list[DraftInput], captured: torch.Tensor) -> None:
    """After a target step: write the context keys of the positions that became final (rows of `captured` back to
    back, `hidden_and_capture`'s output for exactly those rows) into every stage's ring."""
    stages = _stages(model)
    a0 = stages[0].attn
    rows, slots, pos = a0.context_rows(seqs)
    if not rows:
        return
    if rows != list(range(captured.shape[0])):  # else every row, in order: no gather
        captured = captured.index_select(0, torch.tensor(rows, device=captured.device))
    slots, pos = torch.tensor([slots, pos], dtype=torch.long, device=captured.device)
    # which rows and their RoPE: the same for every stage (one window, the plain base: DSparkAttention)
    at = (slots, pos, a0.rope.cos_sin(pos))
    main_x = main_context(model, captured)
    for st in stages:
        st.attn.write_context(main_x, seqs, cache.layers[st.layer_id], at)


def block_streams(model: Transformer, ids: torch.Tensor, pos: torch.Tensor,
                  context: list[tuple[torch.Tensor, torch.Tensor]], rings: list | None = None) -> torch.Tensor:
    """The stages over a block: ids / pos [B, bs], `context` per stage (keys [B, N, head_dim], valid [B, N]) ->
    the last stage's streams [B*bs, n, dim]. `rings`: per stage its `ring_inputs` (or None), where the block runs
    over the stages' rings in the cache."""
    stages = _stages(model)
    ids, pos = ids.flatten(), pos.flatten()
    x = model.streams(ids)
    rope = stages[0].attn.rope.cos_sin(pos)  # every stage's: the plain base (DSparkAttention)
    masks: dict[int, torch.Tensor] = {}  # per context mask, made where a stage needs it: stages share one
    for i, (st, (ctx, valid)) in enumerate(zip(stages, context, strict=True)):
        ring = rings[i] if rings is not None else None
        if ring is None and id(valid) not in masks:
            masks[id(valid)] = st.attn.block_valid(valid, ids.shape[0] // valid.shape[0])
        x = st.block_forward(x, ids, pos, ctx, valid, rope, masks.get(id(valid)), ring)
    return x


def block_head(model: Transformer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Last stage's streams [M, n, dim] -> (h [M, dim] = hc_head output before `norm`, base logits [M, vocab] fp32)."""
    last, c = _stages(model)[-1], model.cfg
    h = model.ops.hc_head(x, last.hc_head_fn, last.hc_head_scale, last.hc_head_base, c.hc_eps, c.norm_eps)
    return h, model.head(model.ops.rms_norm(h, last.norm.weight, c.norm_eps).float())


def teacher_forced(model: Transformer, base: torch.Tensor, h: torch.Tensor,
                   prev_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Markov-corrected logits and confidence logits for given previous tokens (training; the sequential proposal
    feeds its own drafts instead): base [..., vocab], h [..., dim], prev_ids [...] -> ([..., vocab], [...])."""
    last = _stages(model)[-1]
    emb = last.markov_head.embed(prev_ids)
    return base + last.markov_head.bias(emb), last.confidence_head(h, emb)


def confident_prefix(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """How many leading drafts to keep: the index of the first k with sigmoid(c_k) < threshold, else all;
    threshold <= 0 keeps all. confidence [B, bs] -> [B] int64."""
    b, bs = confidence.shape
    if threshold <= 0:
        return torch.full((b,), bs, dtype=torch.long, device=confidence.device)
    below = torch.sigmoid(confidence) < threshold
    first = torch.where(below, torch.arange(bs, device=confidence.device), bs)
    return first.min(-1).values


def propose_dspark(model: Transformer, cache: KVCache, slots: torch.Tensor, last: torch.Tensor,
                   bonus: torch.Tensor, sample: Sampler = greedy, threshold: float = 0.0,
                   confidence: bool = True, drafts: int | None = None) -> Proposal:
    """One DSpark block per sequence: slots [B], last [B] = the last final position (its context written by
    `write_context`), bonus [B] = the token at last + 1. Returns dspark_block_size drafts (tokens at last + 2 ...),
    drawn left to right through the Markov head, and how many survive the confidence cut (`confidence` False and
    no threshold: the confidence head does not run, `Proposal.confidence` is None). `drafts`: only the first that
    many go through the Markov head (no caller wants more; the block itself runs whole: its attention is
    non-causal)."""
    stages, cfg = _stages(model), model.cfg
    bs = cfg.dspark_block_size
    dev = model.embed.weight.device
    slots, last, bonus = slots.to(dev), last.to(dev), bonus.to(dev)
    ids = torch.full((len(slots), bs), cfg.dspark_noise_token_id, dtype=torch.long, device=dev)
    ids[:, 0] = bonus
    pos = last[:, None] + 1 + torch.arange(bs, device=dev)
    valid: dict[tuple[int, int], torch.Tensor] = {}  # per (window, ring length): the stages share one
    rings: dict[tuple[int, int], tuple | None] = {}
    context, stage_rings = [], []
    for st in stages:
        lc = cache.layers[st.layer_id]
        key = (st.attn.win, lc.win_kv.shape[1])
        if key not in valid:
            valid[key] = st.attn._ring_valid(last, key[1])
            rings[key] = st.attn.ring_inputs(lc, slots, pos, valid[key])
        ring = None if rings[key] is None else (lc, *rings[key][1:])
        # the context keys: gathered now for a stage that runs op by op, else by block_forward where it must
        context.append((None if ring else st.attn.ring_context(slots, last, lc, valid[key])[0], valid[key]))
        stage_rings.append(ring)
    h, base = block_head(model, block_streams(model, ids, pos, context, stage_rings))
    h, base = h.view(len(slots), bs, -1), base.view(len(slots), bs, -1)
    markov = stages[-1].markov_head
    prev, tokens, logits, embs = bonus, [], [], []
    for k, base_k in enumerate(base.unbind(1)[:drafts]):
        embs.append(markov.embed(prev))
        logits.append(base_k + markov.bias(embs[-1]))
        prev = sample(logits[-1], k)
        tokens.append(prev)
    conf = stages[-1].confidence_head(h[:, :len(embs)], torch.stack(embs, 1)) if confidence or threshold > 0 \
        else None
    keep = confident_prefix(conf, threshold) if conf is not None else torch.full((len(slots),), len(tokens),
                                                                                  device=dev)
    return Proposal(tokens=torch.stack(tokens, 1), logits=torch.stack(logits, 1), num_proposed=keep,
                    confidence=conf)


class DSparkProposer:
    """The DSpark head as a `Proposer`: the target step captures its context (`hidden_and_capture`); every request's
    final positions get their context keys, the ones that want drafts one block each."""

    captures = True

    def hidden_and_capture(self, model: Transformer, input_ids: torch.Tensor, plan: StepPlan,
                           cache: KVCache) -> tuple[torch.Tensor, Capture]:
        return capture_streams(model, input_ids, plan, cache)

    def propose(self, model: Transformer, cache: KVCache, steps: list, hidden: torch.Tensor,
                captured: torch.Tensor | None, requests: list, block_size: int) -> list[list[int]]:
        if captured is None:
            raise RuntimeError("DSpark drafting needs the captured context of the target step")
        rows = [j for r in requests for j in range(steps[r.entry].token_start, steps[r.entry].token_start + r.n)]
        seqs = [DraftInput(slot=r.slot, start=r.start, n=r.n, block_table=_NO_TABLE) for r in requests]
        if rows == list(range(len(rows))):  # the step's rows in order (a decode step): no gather
            captured = captured[: len(rows)]
        else:
            captured = captured.index_select(0, torch.tensor(rows, device=captured.device))
        write_context(model, cache, seqs, captured)
        want = [i for i, r in enumerate(requests) if r.want > 0]
        out: list[list[int]] = [[] for _ in requests]
        if want:
            p = propose_dspark(model, cache, torch.tensor([requests[i].slot for i in want]),
                               torch.tensor([seqs[i].last for i in want]),
                               torch.tensor([requests[i].next_ids[-1] for i in want]), confidence=False,
                               drafts=max(requests[i].want for i in want))
            keep = p.num_proposed.tolist()
            for j, (i, toks) in enumerate(zip(want, p.tokens.tolist(), strict=True)):
                out[i] = toks[: min(requests[i].want, keep[j])]
        return out
