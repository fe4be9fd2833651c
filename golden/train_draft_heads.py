"""Train the tiny models' draft heads by self-distillation (fixed seeds; a few minutes on 2 CPU cores).

    python golden/train_draft_heads.py            # corpus, MTP -> golden/tiny, DSpark -> golden/tiny-dspark, eval
    python golden/train_draft_heads.py --eval     # only measure the committed heads on the held-out prompts

The random heads of `golden/tiny` accept nothing, so a speculative loop would never take its multi-token path.
Following DeepSpec (which trains DSpark on cached target outputs), the tiny target writes its own corpus: random-id
and pseudo-word prompts (make_tiny_model's syllable grammar, not its fixed sentences) continued greedily by the
target, then one pass over each whole sequence caches what the heads see - the last-layer streams (MTP's input),
the streams entering the DSpark target layers, and the target's logits at every position. The target is the
engine's host eager path in fp32 (not the HF reference): the draft heads are part of the engine and are fed the
engine's states at inference; the engine matches HF to ~1e-5 in fp32 (the golden check), so the distribution is the
same.

Only draft-head tensors are trained (`mtp.*`); the main weights stay byte-identical, so the HF golden data (HF
ignores `mtp.*`) stays valid. The MTP block learns to predict the target's next-next greedy token (cross-entropy
plus a KL term to the target's distribution); the DSpark stages learn a whole block (DeepSpec's recipe: anchors
sampled over each sequence, cross-entropy on the Markov-corrected logits with a position decay, the confidence head
on whether each teacher-forced draft matches the target's greedy token). Weights are written in the checkpoint's
formats (FP8 / FP4 / BF16 / F32), and acceptance is measured through the engine on what was written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig, ModelConfig  # noqa: E402
from engine.loader import load_checkpoint, save_safetensors, split_name, to_official_format  # noqa: E402
from engine.model.cache import KVCache, SeqStep, StepPlan  # noqa: E402
from engine.model.model import Transformer  # noqa: E402
from golden.make_tiny_model import tokenizer_corpus  # noqa: E402

GOLDEN = Path(__file__).resolve().parent
TINY, TINY_DSPARK = GOLDEN / "tiny", GOLDEN / "tiny-dspark"
SEED = 20270
BLOCKS = 32  # KV blocks per corpus sequence (x block_size 16 = 512 positions)
# DSpark head of the tiny model: 2 stages (stage 0 has the context projection, the last one the heads), a 5-token
# block as in V4-Flash-0731, the streams entering the last three main layers (0731: 40, 41, 42 of 43), the noise
# token `<｜read_url｜>` (id 11: a special token the target never continues with).
DSPARK = {"n_mtp_layers": 2, "dspark_block_size": 5, "dspark_noise_token_id": 11,
          "dspark_target_layer_ids": (1, 2, 3), "dspark_markov_rank": 32}


@dataclasses.dataclass
class Corpus:
    """Sequences (prompt + the target's greedy continuation), one entry per sequence: tokens [L]; the target's
    last-layer streams [L, n, dim]; the streams entering the DSpark target layers averaged over hc [L, ncap*dim];
    the target's logits [L, vocab] (fp16) at every position."""

    tokens: list[torch.Tensor]
    streams: list[torch.Tensor]
    captured: list[torch.Tensor]
    logits: list[torch.Tensor]
    prompt_lens: list[int]

    def labels(self, i: int) -> torch.Tensor:
        """The target's greedy token after each position of sequence i [L]."""
        return self.logits[i].float().argmax(-1)


def tiny_runner(max_num_seqs: int, with_mtp: bool = False, model_dir: Path = TINY):
    import engine

    cfg = EngineConfig.from_model_dir(model_dir, max_num_seqs=max_num_seqs, num_kv_blocks=max_num_seqs * BLOCKS,
                                      dtype="float32", with_mtp=with_mtp)
    return engine.build(cfg).runner


def make_prompts(n: int, seed: int, lengths: tuple[int, int]) -> list[list[int]]:
    """Half random ids (BOS first), half pseudo-word text through the tiny tokenizer, lengths in [lo, hi]."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    rng = random.Random(seed)
    lines = tokenizer_corpus()[140:]  # skip the fixed sentences (20 copies of 7): pseudo-words only
    out = []
    for i in range(n):
        want = rng.randint(*lengths)
        if i % 2:
            ids = [0] + [rng.randrange(12, 1021) for _ in range(want - 1)]
        else:
            ids = []
            while len(ids) < want:
                ids += tok.encode(rng.choice(lines)).ids[(1 if ids else 0):]
            ids = ids[:want]
        out.append(ids)
    return out


@torch.no_grad()
def make_corpus(runner, prompts: list[list[int]], new: int, layer_ids: tuple[int, ...]) -> Corpus:
    """Greedy continuations of `new` tokens of each prompt (batched decode through the engine), then one pass
    over each whole sequence caching streams, captured context and logits; sequences cut to a common length."""
    from engine.model.dspark_proposer import hidden_and_capture

    model, bs = runner.model, runner.block_size
    seqs: list[list[int]] = []
    B = runner.max_num_seqs
    for b0 in range(0, len(prompts), B):
        batch = prompts[b0: b0 + B]
        tables = [torch.arange(i * BLOCKS, (i + 1) * BLOCKS) for i in range(len(batch))]
        for i in range(len(batch)):
            runner.free_slot(i)
        flat = torch.tensor([t for p in batch for t in p])
        starts = [sum(len(p) for p in batch[:i]) for i in range(len(batch))]
        steps = [SeqStep(i, 0, len(p), starts[i], tables[i]) for i, p in enumerate(batch)]
        tok = runner.forward(steps, flat).argmax(-1)
        outs = [tok]
        for t in range(new - 1):
            steps = [SeqStep(i, len(p) + t, 1, i, tables[i]) for i, p in enumerate(batch)]
            tok = runner.forward(steps, tok).argmax(-1)
            outs.append(tok)
        cont = torch.stack(outs, 1).tolist()
        seqs += [p + c for p, c in zip(batch, cont, strict=True)]
    streams, captured, logits = [], [], []
    for b0 in range(0, len(seqs), B):
        batch = seqs[b0: b0 + B]
        for i in range(len(batch)):
            runner.free_slot(i)
        starts = [sum(len(q) for q in batch[:i]) for i in range(len(batch))]
        steps = [SeqStep(i, 0, len(q), starts[i], torch.arange(i * BLOCKS, (i + 1) * BLOCKS))
                 for i, q in enumerate(batch)]
        plan = StepPlan.build(steps, bs)
        x, cap = hidden_and_capture(model, torch.tensor([t for q in batch for t in q]), plan, runner.cache,
                                    layer_ids)
        lg = model.logits(x).half()
        for st in steps:
            rows = slice(st.token_start, st.token_start + st.n)
            streams.append(x[rows].clone())
            captured.append(cap[rows].clone())
            logits.append(lg[rows].clone())
    return Corpus([torch.tensor(q) for q in seqs], streams, captured, logits, [len(p) for p in prompts])


# ---- MTP ---------------------------------------------------------------------------------------------------------
def _rows(corpus: Corpus, idx: list[int], shift: int) -> tuple[list[SeqStep], list[int]]:
    """SeqSteps (slot i, positions 0 .. L-1-shift) of sequences idx, rows back to back, and their lengths."""
    steps, t = [], 0
    for i, s in enumerate(idx):
        n = len(corpus.tokens[s]) - shift
        steps.append(SeqStep(i, 0, n, t, torch.zeros(1, dtype=torch.long)))
        t += n
    return steps, [st.n for st in steps]


def mtp_batch(model: Transformer, corpus: Corpus, idx: list[int], block_size: int,
              temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The MTP block over whole sequences (position t: the target's streams at t and token t+1) -> (CE to the
    target's greedy token after t+1, KL(target || draft) at `temperature`, greedy hits) over all rows."""
    cfg = model.cfg
    steps, ns = _rows(corpus, idx, 1)
    x = torch.cat([corpus.streams[s][:n] for s, n in zip(idx, ns, strict=True)])
    nxt = torch.cat([corpus.tokens[s][1:] for s in idx])
    teacher = torch.cat([corpus.logits[s][1:].float() for s in idx])
    cache = KVCache(cfg, len(idx), 1, block_size, torch.float32, [cfg.n_layers])
    out = model.mtp_streams(x, nxt, StepPlan.build(steps, block_size), cache)
    blk = model.mtp[0]
    logits = model.logits(out, blk, blk.norm)
    label = teacher.argmax(-1)
    ce = torch.nn.functional.cross_entropy(logits, label)
    t = temperature
    kl = torch.nn.functional.kl_div(torch.log_softmax(logits / t, -1), torch.log_softmax(teacher / t, -1),
                                    log_target=True, reduction="batchmean") * t * t
    return ce, kl, (logits.argmax(-1) == label).float()


# ---- DSpark --------------------------------------------------------------------------------------------------------
LOSS_DECAY = 4.0  # DeepSpec's loss_decay_gamma: position k of a block weighs exp(-k / 4)
CE_ALPHA, TV_ALPHA, CONF_ALPHA = 0.1, 0.9, 1.0  # DeepSpec's dspark config: ce 0.1, l1 (total variation) 0.9, conf 1


def dspark_batch(model: Transformer, corpus: Corpus, idx: list[int], anchors: int,
                 rng: random.Random) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DeepSpec's training step for `anchors` blocks per sequence: anchor p (a context end in the sequence), block
    input [token p+1, noise...] at positions p+1.., labels = the target's greedy tokens at p+2.. (while inside the
    sequence), previous tokens for the Markov head teacher-forced. Returns (loss, metrics)."""
    from engine.model import dspark_proposer as dspark

    cfg, bs, win = model.cfg, model.cfg.dspark_block_size, model.cfg.window_size
    stages = list(model.mtp)
    ids, pos, ctx_rows, labels, prev, mask, teacher = [], [], [], [], [], [], []
    main_x = dspark.main_context(model, torch.cat([corpus.captured[s] for s in idx]))
    offs = [0]
    for s in idx:
        offs.append(offs[-1] + len(corpus.tokens[s]))
    for j, s in enumerate(idx):
        toks, lab, n = corpus.tokens[s], corpus.labels(s), len(corpus.tokens[s])
        lo = max(0, corpus.prompt_lens[s] - 2)  # anchors from the last prompt positions on
        for p in rng.sample(range(lo, n - 2), min(anchors, n - 2 - lo)):
            q = p + 1 + torch.arange(bs)  # block positions; label k = target's token after q_k
            ok = q < n
            qc = q.clamp(max=n - 1)
            ids.append(torch.cat([toks[p + 1: p + 2], torch.full((bs - 1,), cfg.dspark_noise_token_id)]))
            pos.append(q)
            labels.append(lab[qc])
            prev.append(torch.cat([toks[p + 1: p + 2], lab[qc[:-1]]]))
            mask.append(ok)
            teacher.append(corpus.logits[s][qc].float())
            w = p - win + 1 + torch.arange(win)  # the context window of this block
            ctx_rows.append(torch.where(w >= 0, offs[j] + w, -1))
    ids, pos, labels, prev = (torch.stack(t) for t in (ids, pos, labels, prev))
    mask, teacher, ctx_rows = torch.stack(mask), torch.stack(teacher), torch.stack(ctx_rows)
    all_pos = torch.cat([torch.arange(len(corpus.tokens[s])) for s in idx])
    context = []
    for st in stages:
        kv = st.attn.context_kv(main_x, all_pos)  # [rows, head_dim]
        context.append((kv[ctx_rows.clamp(min=0)], ctx_rows >= 0))
    h, base = dspark.block_head(model, dspark.block_streams(model, ids, pos, context))
    nb = ids.shape[0]
    logits, conf = dspark.teacher_forced(model, base.view(nb, bs, -1), h.view(nb, bs, -1), prev)
    weight = mask.float() * torch.exp(-torch.arange(bs) / LOSS_DECAY)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(nb, bs)
    p_d, p_t = torch.softmax(logits, -1), torch.softmax(teacher, -1)
    tv = 0.5 * (p_d - p_t).abs().sum(-1)  # total variation; 1 - tv = the probabilistic acceptance
    bce = torch.nn.functional.binary_cross_entropy_with_logits(conf, (1 - tv).detach().clamp(0, 1), reduction="none")
    den = weight.sum()
    loss = (CE_ALPHA * ce + TV_ALPHA * 2 * tv + CONF_ALPHA * bce).mul(weight).sum() / den
    hit = (logits.argmax(-1) == labels) & mask
    return loss, {"ce": (ce * weight).sum() / den, "tv": (tv * weight).sum() / den,
                  "acc0": hit[:, 0].float().sum() / mask[:, 0].sum()}


def dspark_config(cfg: ModelConfig) -> ModelConfig:
    """golden/tiny's config with the DSpark head of `DSPARK` in place of the MTP block."""
    ratios = cfg.compress_ratios[: cfg.n_layers] + (0,) * DSPARK["n_mtp_layers"]
    return dataclasses.replace(cfg, compress_ratios=ratios, **DSPARK)


def mtp_init(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The MTP block as make_tiny_model first drew it (its seed and draw order): training starts there whatever
    golden/tiny holds now, so the script reproduces the committed weights."""
    from golden.make_tiny_model import SEED as TINY_SEED
    from golden.make_tiny_model import tiny_weights

    return {n: t for n, t in tiny_weights(cfg, TINY_SEED).items() if n.startswith("mtp.")}


def dspark_init(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random initial `mtp.*` tensors of the DSpark head, drawn as make_tiny_model draws every tensor."""
    from engine.loader import expected_tensors
    from golden.make_tiny_model import _init

    g = torch.Generator().manual_seed(seed)
    return {n: _init(n, shape, cfg, g) for n, shape in expected_tensors(cfg).items() if n.startswith("mtp.")}


# ---- training loop, writing, evaluation ----------------------------------------------------------------------------
def train(model: Transformer, step_fn, n_steps: int, lr: float, log: str) -> None:
    """AdamW with a one-cycle schedule on the `mtp.*` parameters only; `step_fn(rng)` -> (loss, metrics)."""
    params = [p for n, p in model.named_parameters() if n.startswith("mtp.")]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=n_steps, pct_start=0.05)
    rng, t0 = random.Random(SEED), time.time()
    for step in range(n_steps):
        loss, metrics = step_fn(rng)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == n_steps - 1:
            shown = " ".join(f"{k} {float(v.detach()):.3f}" for k, v in metrics.items())
            print(f"  {log} step {step:4d} ({time.time() - t0:4.0f} s): loss {float(loss.detach()):.3f} {shown}",
                  flush=True)
    for p in params:
        p.requires_grad_(False)


def write_checkpoint(src: Path, dst: Path, cfg: ModelConfig, heads: dict[str, torch.Tensor]) -> None:
    """`src`'s safetensors with every `mtp.*` tensor replaced by `heads` (official names, dense) in the
    checkpoint's formats; all other tensors are copied as stored (byte-identical). Writes config.json and the
    tokenizer files when dst is a new directory."""
    from safetensors.torch import load_file

    stored = load_file(str(src / "model.safetensors"))
    kept = {k: v for k, v in stored.items() if split_name(k)[0] != "mtp"}
    new = to_official_format(heads, cfg)
    if any(split_name(k)[0] != "mtp" for k in new):
        raise ValueError("only mtp.* tensors may be written")
    dst.mkdir(parents=True, exist_ok=True)
    save_safetensors({**kept, **new}, dst)
    if dst != src:
        (dst / "config.json").write_text(json.dumps(cfg.to_official_json(), indent=2) + "\n")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (dst / name).write_bytes((src / name).read_bytes())


@torch.no_grad()
def acceptance(model_dir: Path, corpus: Corpus, kind: str, k: int, threshold: float = 0.0) -> dict:
    """Greedy speculative decoding of every sequence of `corpus` after its prompt, simulated with the engine's
    draft code on the checkpoint in `model_dir`: each round drafts k tokens ("mtp") or a DSpark block ("dspark",
    cut by the confidence `threshold`), accepts the longest prefix equal to the target's greedy continuation, and
    feeds the draft head the target's states (cached in the corpus: the target's verify step would compute the
    same) of exactly the positions that became final. Returns per-position and overall acceptance."""
    from engine.model import dspark_proposer as dspark
    from engine.model.mtp_proposer import DraftInput, propose_mtp

    n = len(corpus.tokens)
    runner = tiny_runner(n, with_mtp=True, model_dir=model_dir)
    model, cache = runner.model, runner.cache
    start, cnt = [0] * n, list(corpus.prompt_lens)
    drafted, accepted, rounds = torch.zeros(k), torch.zeros(k), 0
    active = list(range(n))
    while active:
        ins = [DraftInput(i, start[i], cnt[i], torch.arange(i * BLOCKS, (i + 1) * BLOCKS)) for i in active]
        rows = [(i, slice(start[i], start[i] + cnt[i])) for i in active]
        if kind == "mtp":
            hidden = torch.cat([corpus.streams[i][r] for i, r in rows])
            nxt = torch.cat([corpus.tokens[i][r.start + 1: r.stop + 1] for i, r in rows])
            prop = propose_mtp(model, cache, ins, hidden, nxt, k, runner.block_size)
        else:
            dspark.write_context(model, cache, ins, torch.cat([corpus.captured[i][r] for i, r in rows]))
            last = torch.tensor([x.last for x in ins])
            bonus = torch.stack([corpus.tokens[i][x.last + 1] for i, x in zip(active, ins, strict=True)])
            prop = dspark.propose_dspark(model, cache, torch.tensor(active), last, bonus, threshold=threshold)
        nxt_active = []
        for b, (i, x) in enumerate(zip(active, ins, strict=True)):
            ref = corpus.tokens[i]
            m = min(int(prop.num_proposed[b]), k, len(ref) - x.last - 2)  # drafts with a reference token
            a = 0
            while a < m and int(prop.tokens[b, a]) == int(ref[x.last + 2 + a]):
                a += 1
            drafted[:m] += 1
            accepted[:a] += 1
            rounds += 1
            start[i], cnt[i] = x.last + 1, a + 1
            if start[i] + cnt[i] < len(ref) - 1:
                nxt_active.append(i)
        active = nxt_active
    return {"kind": kind, "k": k, "threshold": threshold, "rounds": rounds,
            "drafted": int(drafted.sum()), "accepted": int(accepted.sum()),
            "acceptance_rate": float(accepted.sum() / drafted.sum()),
            "per_position": [round(float(a / d), 4) if d else None for a, d in zip(accepted, drafted, strict=True)],
            "mean_accepted_per_round": float(accepted.sum() / rounds)}


def eval_prompts(seed: int) -> list[list[int]]:
    """Held-out prompts of 7, 40 and 130 tokens (the lengths of the engine loop's check), text and random ids."""
    out = []
    for n in (7, 40, 130):
        out += make_prompts(8, seed + n, (n, n))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--eval", action="store_true", help="only measure the committed heads (no training, no writes)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: the box is shared; 2 threads thrash)")
    p.add_argument("--train-seqs", type=int, default=384)
    p.add_argument("--mtp-steps", type=int, default=300)
    p.add_argument("--dspark-steps", type=int, default=300)
    p.add_argument("--model-dir", type=Path, default=TINY,
                   help="the target (main weights kept; its mtp.* rewritten): golden/tiny or golden/tiny-spec")
    p.add_argument("--dspark-dir", type=Path, default=TINY_DSPARK,
                   help="where the DSpark checkpoint goes (main tensors copied from --model-dir); '' to skip DSpark")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    t0 = time.time()
    src = args.model_dir
    dsp = args.dspark_dir if str(args.dspark_dir) not in ("", ".") else None
    base = ModelConfig.from_json(src)
    runner = tiny_runner(128, model_dir=src)
    ids = DSPARK["dspark_target_layer_ids"]
    held = make_corpus(runner, eval_prompts(SEED + 1), 64, ids)
    if not args.eval:
        corpus = make_corpus(runner, make_prompts(args.train_seqs, SEED, (4, 140)), 64, ids)
        print(f"corpus: {sum(map(len, corpus.tokens))} tokens in {len(corpus.tokens)} sequences "
              f"({time.time() - t0:.0f} s)", flush=True)
        del runner
        model = Transformer(base, with_mtp=True)
        main = load_checkpoint(src, base, dtype=torch.float32, include_mtp=False)
        model.load_weights({**main, **mtp_init(base)}, torch.float32)

        def mtp_step(rng: random.Random):
            ce, kl, hit = mtp_batch(model, corpus, rng.sample(range(len(corpus.tokens)), 16), runner_bs(base))
            return ce + kl, {"ce": ce, "kl": kl, "acc": hit.mean()}

        train(model, mtp_step, args.mtp_steps, 3e-3, "mtp")
        heads = {k: v for k, v in model.state_dict().items() if k.startswith("mtp.")}
        write_checkpoint(src, src, base, heads)
        if dsp is not None:
            cfg = dspark_config(base)
            model = Transformer(cfg, with_mtp=True)
            model.load_weights({**main, **dspark_init(cfg, SEED)}, torch.float32)
            train(model, lambda rng: dspark_batch(model, corpus, rng.sample(range(len(corpus.tokens)), 16), 16, rng),
                  args.dspark_steps, 3e-3, "dspark")
            heads = {k: v for k, v in model.state_dict().items() if k.startswith("mtp.")}
            write_checkpoint(src, dsp, cfg, heads)
        print(f"trained and written ({time.time() - t0:.0f} s)", flush=True)
    bs = DSPARK["dspark_block_size"]
    results = [acceptance(src, held, "mtp", 2), acceptance(src, held, "mtp", 3)]
    if dsp is not None:
        results += [acceptance(dsp, held, "dspark", bs), acceptance(dsp, held, "dspark", bs, threshold=0.5)]
    for r in results:
        print(json.dumps(r))
    print(f"done in {time.time() - t0:.0f} s")


def runner_bs(cfg: ModelConfig) -> int:
    from engine.config import default_block_size

    return default_block_size(cfg)


if __name__ == "__main__":
    main()
