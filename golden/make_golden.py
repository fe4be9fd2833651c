"""Regenerate the golden outputs of the tiny model from the independent HF reference.

    python golden/make_tiny_model.py   # only if the tiny model itself should change
    python golden/make_golden.py       # writes golden/golden.safetensors + golden/golden.json

Loads `golden/tiny` through `engine.loader.load_checkpoint` (FP8/FP4 dequantised exactly to fp32), runs HF
`DeepseekV4ForCausalLM` in fp32 (eager attention, HF's dynamic V4 cache, `generate`, greedy, no EOS stop) and
stores per prompt the prompt ids, the generated ids and the fp32 logits each generated token was chosen from.
Fails if any step's top1 - top2 logit margin is below `MIN_MARGIN` (near ties would make the golden flaky).

Files:
* golden.safetensors: `{name}.prompt_ids` int64 [P], `{name}.output_ids` int64 [N], `{name}.logits` fp32 [N, vocab]
* golden.json: meta header (magic, format_version, seed, torch / transformers versions, config_hash, model_sha256)
  and the prompts (name, kind "text"/"ids", text, prompt_ids, max_new_tokens, output_ids, min_margin).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

import torch

GOLDEN_DIR = Path(__file__).resolve().parent
ROOT = GOLDEN_DIR.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.config import ModelConfig  # noqa: E402
from engine.loader import load_checkpoint  # noqa: E402
from golden.make_tiny_model import SEED as MODEL_SEED  # noqa: E402

MAGIC = "deepinfer-golden"
FORMAT_VERSION = 1
SEED = 20260  # raw-id prompts
MIN_MARGIN = 1e-3
TINY_DIR = GOLDEN_DIR / "tiny"

_LONG_TEXT = ("DeepSeek-V4 compresses the key-value cache with a lightning indexer and heavily compressed attention. "
              "Hyper-connections keep four residual streams mixed by a doubly stochastic matrix. Trainium chips run "
              "kernels written in NKI; tiles have 128 partitions. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 128 256 512 "
              "1024 4096 65536.")

# (name, kind, text or raw length, max_new_tokens). Lengths cross the window (16), the CSA ratio (4), the HCA ratio
# (16) and the indexer top-k threshold 4 * (index_topk + 1) = 20, in the prompt or during decode.
PROMPTS: tuple[tuple[str, str, str | int, int], ...] = (
    ("text_hi", "text", "Hi", 48),
    ("text_hello", "text", "Hello!", 48),
    ("ids_16", "ids", 16, 48),
    ("ids_17", "ids", 17, 40),
    ("ids_20", "ids", 20, 40),
    ("ids_21_nobos", "ids", 21, 40),
    ("text_fox", "text", "The quick brown fox jumps over the lazy dog.", 32),
    ("text_story", "text", "Once upon a time, in a small village by the sea, there lived an old fisherman and his "
     "cat.", 32),
    ("ids_64", "ids", 64, 32),
    ("text_long", "text", _LONG_TEXT, 32),
    ("ids_257", "ids", 257, 32),
    ("ids_321_eos", "ids", 321, 32),
)


def prompt_ids(name: str, kind: str, spec: str | int, cfg: ModelConfig, tokenizer, g: torch.Generator) -> list[int]:
    """Token ids of one prompt: text through the tiny tokenizer (which prepends BOS), raw ids drawn from `g`
    (BOS first unless the name says `nobos`; `eos` prompts carry a few EOS ids inside)."""
    if kind == "text":
        return tokenizer.encode(spec).ids
    ids = torch.randint(2, cfg.vocab_size, (int(spec),), generator=g).tolist()
    if "nobos" not in name:
        ids[0] = cfg.bos_token_id
    if "eos" in name:
        for pos in (50, 51, 200):
            ids[pos] = cfg.eos_token_id
    return ids


def run_reference(tiny_dir: Path = TINY_DIR) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Run every prompt of `PROMPTS` through the HF reference: (json entries, golden tensors)."""
    from tokenizers import Tokenizer

    from deepinfer_bench.bench.hf_reference import build_hf_model, hf_greedy
    from engine.backends.host import setup_host_process

    setup_host_process()  # the engine's reproducible host math (MKL CNR mode, fixed threads) for the reference too
    torch.manual_seed(SEED)
    cfg = ModelConfig.from_json(tiny_dir / "config.json")
    tokenizer = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    model = build_hf_model(cfg, load_checkpoint(tiny_dir, cfg, dtype=torch.float32), dtype=torch.float32)
    g = torch.Generator().manual_seed(SEED)
    tensors: dict[str, torch.Tensor] = {}
    entries = []
    for name, kind, spec, max_new in PROMPTS:
        ids = prompt_ids(name, kind, spec, cfg, tokenizer, g)
        out_ids, logits = hf_greedy(model, ids, max_new)
        top2 = logits.topk(2, dim=-1).values
        margin = float((top2[:, 0] - top2[:, 1]).min())
        entries.append({"name": name, "kind": kind, "text": spec if kind == "text" else None, "prompt_len": len(ids),
                        "max_new_tokens": max_new, "prompt_ids": ids, "output_ids": out_ids, "min_margin": margin})
        tensors[f"{name}.prompt_ids"] = torch.tensor(ids, dtype=torch.int64)
        tensors[f"{name}.output_ids"] = torch.tensor(out_ids, dtype=torch.int64)
        tensors[f"{name}.logits"] = logits.contiguous()
    return entries, tensors


def make_golden(tiny_dir: Path = TINY_DIR, out_dir: Path = GOLDEN_DIR) -> dict:
    import transformers
    from safetensors.torch import save_file

    from engine.stack import blas_mode

    entries, tensors = run_reference(tiny_dir)
    cfg = ModelConfig.from_json(tiny_dir / "config.json")
    worst = min(e["min_margin"] for e in entries)
    if worst <= MIN_MARGIN:
        bad = [e["name"] for e in entries if e["min_margin"] <= MIN_MARGIN]
        raise RuntimeError(f"greedy logit margin {worst:.2e} <= {MIN_MARGIN} in {bad}: change the seed or scales")
    meta = {
        "magic": MAGIC,
        "format_version": FORMAT_VERSION,
        "seed": SEED,
        # make_tiny_model's seed labels only the tiny model; other models (tiny-spec: make_spec_model.py, trained)
        # are identified by model_dir and model_sha256
        "model_seed": MODEL_SEED if tiny_dir.resolve() == TINY_DIR.resolve() else None,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "config_hash": cfg.config_hash(),
        "model_sha256": hashlib.sha256((tiny_dir / "model.safetensors").read_bytes()).hexdigest(),
        "reference": "HF DeepseekV4ForCausalLM fp32 eager, dynamic cache, greedy (prefill + 1-token steps), no EOS",
        "model_dir": _repo_path(tiny_dir),
        "min_logit_margin": worst,
        "host_math": blas_mode(),
        "prompts": entries,
    }
    save_file(tensors, str(out_dir / "golden.safetensors"),
              metadata={"magic": MAGIC, "format_version": str(FORMAT_VERSION), "config_hash": cfg.config_hash()})
    (out_dir / "golden.json").write_text(dumps_meta(meta))
    return meta


def _repo_path(path: Path) -> str:
    """`path` relative to the repository root where it is inside it (golden/tiny, golden/tiny-spec)."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def dumps_meta(meta: dict) -> str:
    """golden.json text: indented, but each prompt's id lists on one line (a readable diff on regeneration)."""
    text = json.dumps(meta, indent=1, ensure_ascii=False)
    return re.sub(r"\[\s*(-?\d+(?:,\s*-?\d+)*)\s*\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",")
                  + "]", text) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description="Regenerate golden/golden.{safetensors,json} from the HF reference.")
    p.add_argument("--tiny", type=Path, default=TINY_DIR)
    p.add_argument("--out", type=Path, default=GOLDEN_DIR)
    args = p.parse_args()
    meta = make_golden(args.tiny, args.out)
    for e in meta["prompts"]:
        print(f"{e['name']:>14}: prompt {e['prompt_len']:4d} + {e['max_new_tokens']} tokens, "
              f"min margin {e['min_margin']:.4f}")
    print(f"min logit margin {meta['min_logit_margin']:.4f}, config_hash {meta['config_hash']}")


if __name__ == "__main__":
    main()
