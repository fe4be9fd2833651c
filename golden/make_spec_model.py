"""Write `golden/tiny-spec/`: golden/tiny's architecture with TRAINED main weights, so a draft head can learn what it
says next (fixed seeds; 300 steps, ~25 min on the loaded shared 2-core box, one torch thread).

    python golden/make_spec_model.py              # train, write golden/tiny-spec/, print what the model learned
    python golden/make_spec_model.py --eval       # only the report on the committed golden/tiny-spec/
    python golden/make_golden.py --tiny golden/tiny-spec --out golden/spec            # its HF golden
    python golden/train_draft_heads.py --model-dir golden/tiny-spec ...               # its MTP / DSpark heads

golden/tiny's main weights are random, so its greedy token is close to a hash of the whole context and no draft
head learns it (golden/README.md "Draft heads"). This model has tiny's exact config (sliding / CSA 4 / HCA 16 / CSA
layers, two hash-routed MoE layers, 16 indexer heads top-4, window 16, the MTP layer) and tokenizer; its main
weights are trained on a low-entropy synthetic language (`Language`) in which most continuations follow from the
context:

* two successor maps s_0, s_1 (random cycles over the even / odd content ids): a `chain` segment continues
  x -> s_c(x) from the token before it, c the document's topic;
* the topic is visible only as a statistic of the whole document: 3/4 of its `noise` tokens have the topic's
  parity, and chains stay inside it. After a noise burst longer than the window (16) the next chain token depends
  on tokens the sliding layers cannot see: the compressed (CSA, HCA) entries carry it;
* `repeat` segments repeat the last p tokens (p 2..8: copying inside the window), `recall` segments copy a span
  from anywhere earlier in the document (copying through the compressed / indexer-selected entries), `text`
  segments are make_tiny_model's pseudo-word lines through the tokenizer; noise is random ids.

Training: HF transformers' `DeepseekV4ForCausalLM` (the independent reference the golden comes from; it trains
with plain autograd on batched sequences, where the engine's host path runs a Python loop of per-sequence chunks
writing into its KV pool), fp32, AdamW, next-token cross-entropy, quantisation-aware: every forward uses the
weights as the checkpoint will store them (FP8 128x128 blocks, FP4 1x32 blocks for the routed experts, BF16, F32;
`nki_kernels.formats`) with straight-through gradients, so the written checkpoint is exactly the model that was
trained. The router bias and `tid2eid` (buffers in HF) and the `mtp.*` block keep their make_tiny_model draws;
the MTP / DSpark heads are trained afterwards by `train_draft_heads.py`.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.config import ModelConfig  # noqa: E402
from engine.loader import (  # noqa: E402
    HF_DOWN,
    HF_GATE_UP,
    from_hf_name,
    hf_to_official,
    official_format,
    save_safetensors,
    to_official_format,
)
from golden.make_tiny_model import TINY_CONFIG, tiny_weights, tokenizer_corpus  # noqa: E402
from nki_kernels.formats import dequant_fp4, dequant_fp8_block, quant_fp4, quant_fp8_block  # noqa: E402

GOLDEN = Path(__file__).resolve().parent
OUT_DIR, TINY = GOLDEN / "tiny-spec", GOLDEN / "tiny"
SPEC_CONFIG = TINY_CONFIG
SEED = 20280  # initial weights (make_tiny_model's draw), the language's maps, the corpus, the batch order
CONTENT = range(12, 1021)  # ids that are neither chat special tokens (0-11) nor the visible chat tokens (1021-1023)
# segment kinds and their weights; lengths below
KINDS = {"noise": 0.22, "text": 0.13, "chain": 0.35, "repeat": 0.18, "recall": 0.12}
TOPIC_SHARE = 0.75  # noise tokens of the topic's parity
SEQ_LEN, BATCH = 352, 6  # training documents (the golden's longest prompt + output is 353 tokens)


# ---- the language ------------------------------------------------------------------------------------------------
class Language:
    """The synthetic corpus: documents of segments (see the module docstring), all drawn from `seed`."""

    def __init__(self, seed: int = SEED, vocab: int = SPEC_CONFIG.vocab_size) -> None:
        from tokenizers import Tokenizer

        rng = random.Random(seed)
        self.vocab = vocab
        self.classes = [[i for i in CONTENT if i % 2 == c] for c in (0, 1)]
        self.succ = []  # succ[c][x]: the chain successor of any id x under topic c
        for members in self.classes:
            cycle = members[:]
            rng.shuffle(cycle)
            s = [rng.choice(members) for _ in range(vocab)]  # ids outside the class enter it at a random member
            for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True):
                s[a] = b
            self.succ.append(s)
        tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
        lines = tokenizer_corpus()[140:]  # pseudo-word lines (the fixed sentences are 20 copies of 7 first)
        self.text = [tok.encode(" " + line).ids[1:] for line in lines[:2000]]

    def chain(self, x: int, topic: int, n: int) -> list[int]:
        out = []
        for _ in range(n):
            x = self.succ[topic][x]
            out.append(x)
        return out

    def document(self, rng: random.Random, length: int) -> tuple[list[int], list[str], int]:
        """(ids, the kind of the segment each token belongs to, topic) of one document of `length` tokens."""
        topic = rng.randrange(2)
        ids, kinds = ([0], ["bos"]) if rng.random() < 0.9 else ([], [])
        names, weights = list(KINDS), list(KINDS.values())
        while len(ids) < length:
            kind = rng.choices(names, weights)[0]
            if kind == "noise" or len(ids) < 2:
                kind, seg = "noise", []
                for _ in range(rng.randint(1, 24)):
                    if rng.random() < TOPIC_SHARE:
                        seg.append(rng.choice(self.classes[topic]))
                    else:
                        seg.append(rng.randrange(2, self.vocab))
            elif kind == "text":
                seg = list(rng.choice(self.text))
            elif kind == "chain":
                seg = self.chain(ids[-1], topic, rng.randint(4, 48))
            elif kind == "repeat":
                p = rng.randint(2, min(8, len(ids)))
                seg = [ids[len(ids) - p + i % p] for i in range(rng.randint(p, 4 * p))]
            else:  # recall: a span from anywhere earlier
                if len(ids) < 40:
                    continue
                j, n = rng.randrange(0, len(ids) - 24), rng.randint(4, 20)
                seg = ids[j: j + n]
            ids += seg
            kinds += [kind] * len(seg)
        return ids[:length], kinds[:length], topic


# ---- quantisation-aware training ------------------------------------------------------------------------------------
def stored_format(hf_name: str, cfg: ModelConfig) -> str:
    """How the checkpoint stores the HF parameter `hf_name` (official_format of its official tensor)."""
    if hf_name.endswith((HF_GATE_UP, HF_DOWN)):
        return cfg.expert_dtype or cfg.dtype
    return official_format(from_hf_name(hf_name), cfg)


@torch.no_grad()
def as_stored(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """w as the checkpoint stores it, dequantised (exactly what the engine and the golden load)."""
    if fmt == "fp8":
        return dequant_fp8_block(*quant_fp8_block(w))
    if fmt == "fp4":
        flat = w.reshape(-1, w.shape[-1])  # stacked experts: each row is a row of one expert's matrix
        return dequant_fp4(*quant_fp4(flat)).view_as(w)
    if fmt == "bf16":
        return w.to(torch.bfloat16).float()
    return w


def ste_params(model: torch.nn.Module, formats: dict[str, str]) -> dict[str, torch.Tensor]:
    """Every parameter replaced by its stored value, with a straight-through gradient to the fp32 master."""
    return {n: p + (as_stored(p, formats[n]) - p).detach() if formats[n] != "fp32" else p
            for n, p in model.named_parameters()}


def build(cfg: ModelConfig, seed: int):
    """HF model holding make_tiny_model's draw for `seed` (mtp.* drawn too but HF drops it) -> (model, all weights)."""
    from deepinfer_bench.bench.hf_reference import build_hf_model

    weights = tiny_weights(cfg, seed)
    return build_hf_model(cfg, weights), weights


def batches(lang: Language, n_steps: int, seed: int):
    rng = random.Random(seed + 1)
    for _ in range(n_steps):
        yield torch.tensor([lang.document(rng, SEQ_LEN)[0] for _ in range(BATCH)])


def train(model, lang: Language, cfg: ModelConfig, n_steps: int, lr: float, seed: int) -> None:
    from torch.func import functional_call

    formats = {n: stored_format(n, cfg) for n, _ in model.named_parameters()}
    model.train()
    params = [p for _, p in model.named_parameters()]
    for p in params:
        p.requires_grad_(True)
    decay = [p for p in params if p.dim() >= 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=n_steps, pct_start=0.05)
    t0, avg = time.time(), None
    for step, ids in enumerate(batches(lang, n_steps, seed)):
        out = functional_call(model, ste_params(model, formats), (), {"input_ids": ids, "labels": ids,
                                                                      "use_cache": False})
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        loss = float(out.loss.detach())
        avg = loss if avg is None else 0.95 * avg + 0.05 * loss
        if step % 25 == 0 or step == n_steps - 1:
            print(f"  step {step:4d} ({time.time() - t0:5.0f} s): loss {loss:.3f} (avg {avg:.3f})", flush=True)
    model.eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(as_stored(p, formats[n]))
            p.requires_grad_(False)


# ---- writing and the report -----------------------------------------------------------------------------------------
def write(model, init: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: Path) -> None:
    """The trained main tensors (HF -> official names) + the untrained mtp.* draw, in the checkpoint's formats."""
    official = hf_to_official({k: v.detach() for k, v in model.state_dict().items()}, cfg)
    missing = sorted(set(init) - set(official) - {k for k in init if k.startswith("mtp.")})
    if missing:
        raise KeyError(f"trained model lacks {missing[:4]}")
    tensors = {name: official.get(name, init[name]) for name in init}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg.to_official_json(), indent=2) + "\n")
    save_safetensors(to_official_format(tensors, cfg), out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TINY / name, out_dir / name)


@torch.no_grad()
def report(model, lang: Language, n_docs: int = 24, seed: int = SEED + 7) -> dict:
    """Teacher-forced next-token accuracy per segment kind on held-out documents (what the model learned), and
    for the chain kind whether the model used the document's topic."""
    rng = random.Random(seed)
    docs = [lang.document(rng, SEQ_LEN) for _ in range(n_docs)]
    ids = torch.tensor([d[0] for d in docs])
    pred = model(input_ids=ids, use_cache=False).logits.argmax(-1)  # [B, L]
    hits: dict[str, list[int]] = {}
    for b, (toks, kinds, _) in enumerate(docs):
        for t in range(1, len(toks)):
            key = kinds[t] + ("(first)" if kinds[t] != kinds[t - 1] else "")
            hits.setdefault(key, []).append(int(pred[b, t - 1] == toks[t]))
    return {k: (round(sum(v) / len(v), 3), len(v)) for k, v in sorted(hits.items())}


def continuations(model, lang: Language, prompts: list[list[int]], new: int = 32) -> list[dict]:
    """Greedy continuations (HF, no cache) of `prompts`: how many generated tokens follow a chain rule."""
    from deepinfer_bench.bench.hf_reference import hf_greedy

    out = []
    for p in prompts:
        toks, logits = hf_greedy(model, p, new)
        seq = p + toks
        chain = [sum(seq[len(p) + i] == lang.succ[c][seq[len(p) + i - 1]] for i in range(new)) for c in (0, 1)]
        top2 = logits.topk(2, -1).values
        out.append({"prompt_len": len(p), "chain_topic0": chain[0], "chain_topic1": chain[1],
                    "min_margin": round(float((top2[:, 0] - top2[:, 1]).min()), 4), "tokens": toks[:12]})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT_DIR)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: the box is shared)")
    p.add_argument("--eval", action="store_true", help="only report on the model in --out")
    args = p.parse_args()
    from engine.backends.host import setup_host_process

    setup_host_process(args.threads)
    torch.manual_seed(args.seed)
    cfg, t0 = SPEC_CONFIG, time.time()
    lang = Language(args.seed)
    if args.eval:
        from deepinfer_bench.bench.hf_reference import build_hf_model
        from engine.loader import load_checkpoint

        model = build_hf_model(cfg, load_checkpoint(args.out, cfg, dtype=torch.float32))
    else:
        model, init = build(cfg, args.seed)
        n = sum(q.numel() for q in model.parameters())
        print(f"training {n:,} parameters for {args.steps} steps of {BATCH} x {SEQ_LEN} tokens", flush=True)
        train(model, lang, cfg, args.steps, args.lr, args.seed)
        write(model, init, cfg, args.out)
        size = sum(f.stat().st_size for f in args.out.iterdir())
        print(f"wrote {args.out} ({size / 2**20:.2f} MiB) in {time.time() - t0:.0f} s", flush=True)
    print("held-out accuracy per segment kind (accuracy, tokens):", json.dumps(report(model, lang)))
    from tokenizers import Tokenizer

    from golden.make_golden import PROMPTS, prompt_ids

    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    g = torch.Generator().manual_seed(20260)
    for (name, *_), r in zip(PROMPTS, continuations(model, lang, [prompt_ids(nm, k, s, cfg, tok, g)
                                                                  for nm, k, s, _ in PROMPTS]), strict=True):
        print(f"  {name:>14}: {json.dumps(r)}")
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
