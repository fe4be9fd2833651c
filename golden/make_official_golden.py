"""Golden outputs of `golden/tiny-official` from DeepSeek's own inference code (official numerics).

    python golden/make_official_golden.py --official-src DIR                # golden/official/golden.{json,safetensors}
    python golden/official_crosscheck.py --official-src DIR                 # vs HF: golden/official/crosscheck.json

DIR is a local copy of the official `inference/` folder (model.py; never vendored into this repo). The public mirror
this project read: `git clone https://github.com/Nicooo-Wang/DeepSeek-V4-Pro-code && git -C DeepSeek-V4-Pro-code
checkout 0ec3a03c2fc34f29b2e72696ceaed9ae7a373aeb`, then DIR = DeepSeek-V4-Pro-code/inference (the current official
model.py plus a hadamard fallback and a `__main__` demo; the HF repos deepseek-ai/DeepSeek-V4-{Flash,Pro} carry the
same model.py in `inference/`).

How it runs the official code: `golden/official_kernels.py` (CPU versions of the tilelang `kernel.py` functions)
is installed as the `kernel` and `fast_hadamard_transform` modules, model.py is imported from DIR, and the model is
built and run as the official `generate.py` does: default dtype bf16, `Transformer(ModelArgs(**config))` (the keys of
config.json that ModelArgs has; max_batch_size 1), the checkpoint converted as `convert.py` does for one rank (`wo_a`
dequantised to bf16, FP4 experts viewed as float4_e2m1fn_x2), `load_state_dict(strict=False)` (only the MTP block's
shared embed/head are absent), then per prompt a fresh model: one prefill forward from position 0, then one token per
forward, greedy (`argmax` of the fp32 logits), no EOS stop. Recorded per prompt: prompt ids, generated ids and the
fp32 logits each token was chosen from, in the format `deepinfer_bench.bench.golden.load_golden` reads.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import torch

GOLDEN_DIR = Path(__file__).resolve().parent
ROOT = GOLDEN_DIR.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.config import ModelConfig  # noqa: E402
from golden import official_kernels  # noqa: E402
from golden.make_golden import FORMAT_VERSION, MAGIC, PROMPTS, dumps_meta, prompt_ids  # noqa: E402
from golden.make_golden import SEED as PROMPT_SEED  # noqa: E402
from golden.make_tiny_official import OUT_DIR as MODEL_DIR  # noqa: E402
from golden.make_tiny_official import SEED as MODEL_SEED  # noqa: E402

OUT_DIR = GOLDEN_DIR / "official"
MIN_MARGIN = 1e-3
OFFICIAL_REPO = "https://github.com/Nicooo-Wang/DeepSeek-V4-Pro-code"
OFFICIAL_COMMIT = "0ec3a03c2fc34f29b2e72696ceaed9ae7a373aeb"
# sha256 of the model.py revisions read for the spec (§7); any other model.py runs too, its hash is recorded.
KNOWN_MODEL_PY = {
    "3a5d80e746f373d17d6e55f85c26a12cd751015feef3c05dc2b1703b03942221":
        "current revision (shared-expert clamp) + hadamard fallback + __main__ demo, Nicooo-Wang/DeepSeek-V4-Pro-code",
    "6380e70f3690227155ae17fa40b99c8e6900623d00925fd8a8ccc9588e02e818":
        "first upload (no shared-expert clamp), Mockingjay1316/deepseek-v4-flash-spark",
}
HOW_TO_GET = (f"get the official inference folder: git clone {OFFICIAL_REPO} && git -C DeepSeek-V4-Pro-code checkout "
              f"{OFFICIAL_COMMIT}; then pass --official-src DeepSeek-V4-Pro-code/inference")


# ---- the official code ----------------------------------------------------------------------------------------
def load_official(src: Path):
    """Import DIR/model.py with the CPU kernels installed; returns the module."""
    path = Path(src) / "model.py"
    if not path.exists():
        raise SystemExit(f"no model.py in {src}: {HOW_TO_GET}")
    official_kernels.install()
    spec = importlib.util.spec_from_file_location("deepseek_v4_official_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def source_info(src: Path) -> dict:
    """Where the official code came from: model.py's sha256, plus the git remote / commit when DIR is a checkout."""
    path = Path(src) / "model.py"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    info = {"model_py_sha256": digest, "model_py_revision": KNOWN_MODEL_PY.get(digest, "unknown revision"),
            "repo": None, "commit": None}
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        git = ["git", "-C", str(path.parent)]
        info["commit"] = subprocess.check_output([*git, "rev-parse", "HEAD"], text=True,
                                                 stderr=subprocess.DEVNULL).strip()
        info["repo"] = subprocess.check_output([*git, "config", "--get", "remote.origin.url"], text=True,
                                               stderr=subprocess.DEVNULL).strip()
    if info["commit"] is None and digest in KNOWN_MODEL_PY and "Nicooo" in KNOWN_MODEL_PY[digest]:
        info["repo"], info["commit"] = OFFICIAL_REPO, OFFICIAL_COMMIT
    return info


def official_args(module, cfg: ModelConfig):
    fields = {f.name for f in dataclasses.fields(module.ModelArgs)}
    raw = {k: v for k, v in cfg.to_official_json().items() if k in fields}
    return module.ModelArgs(**raw, max_batch_size=1, max_seq_len=cfg.max_position_embeddings)


def official_state_dict(model_dir: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The checkpoint as the official `convert.py` leaves it for one rank: names unchanged, `attn.wo_a` dequantised
    to bf16 (its `.scale` dropped), FP4 expert bytes viewed as float4_e2m1fn_x2, everything else as stored."""
    from safetensors import safe_open

    from nki_kernels.formats import dequant_fp8_block

    files = sorted(Path(model_dir).glob("*.safetensors"))
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            sd.update({k: st.get_tensor(k) for k in st.keys()})  # noqa: SIM118 (safe_open has no __iter__)
    for name in [k for k in sd if k.endswith("attn.wo_a.weight")]:
        sd[name] = dequant_fp8_block(sd[name], sd.pop(name[: -len("weight")] + "scale"), torch.bfloat16)
    for name, t in sd.items():
        if ".experts." in name and t.dtype == torch.int8:
            sd[name] = t.view(torch.float4_e2m1fn_x2)
    return sd


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def build_official(module, args, sd: dict[str, torch.Tensor], dtype: torch.dtype):
    """A fresh official Transformer holding `sd` (call inside `default_dtype(dtype)`). dtype bf16 is the official
    run; fp32 (cross-checks only) also widens the two explicitly-bf16 weights (wo_a, weights_proj), which the
    official code multiplies with activations of the default dtype."""
    model = module.Transformer(args)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    bad = [k for k in missing if not (k.startswith("mtp.") and (".embed." in k or ".head." in k))]
    if bad or unexpected:
        raise RuntimeError(f"official model vs checkpoint: missing {bad[:6]}, unexpected {unexpected[:6]}")
    if dtype == torch.float32:
        for p in model.parameters():
            if p.dtype == torch.bfloat16:
                p.data = p.data.float()
    return model.eval()


class StableTopk:
    """While active, `Tensor.topk` (the official indexer's and router's selection) breaks ties by the lower index:
    the (k)-th and (k+1)-th scores being equal, torch's CPU quickselect and CUDA's radix select pick different
    entries, and neither is specified; bf16 index scores tie at ~1% of the CSA selections on tiny-official. Without a
    tie the picks are those of `torch.topk`. This is the tie rule of the engine's `reference.index_topk`. Also
    counts the selections with a tie at the boundary, the indexer's and the router's."""

    def __init__(self) -> None:
        self.rows = {"indexer": 0, "router": 0}
        self.ties = {"indexer": 0, "router": 0}
        self._orig = torch.Tensor.topk

    def __enter__(self) -> StableTopk:
        orig, watch = self._orig, self

        def topk(t, k, dim=-1, largest=True, sorted=True):  # noqa: A002 (torch's own signature)
            if not largest or k >= t.size(dim):
                return orig(t, k, dim, largest, sorted)
            order = torch.sort(t, dim=dim, descending=True, stable=True)
            vals, idx = order.values.narrow(dim, 0, k + 1), order.indices.narrow(dim, 0, k)
            kth, nxt = vals.select(dim, k - 1), vals.select(dim, k)
            kind = "indexer" if t.dim() == 3 else "router"  # index scores [b, s, entries]; router [tokens, experts]
            watch.rows[kind] += kth.numel()
            watch.ties[kind] += int(((kth == nxt) & torch.isfinite(kth)).sum())
            return torch.return_types.topk((vals.narrow(dim, 0, k), idx))

        torch.Tensor.topk = topk
        return self

    def __exit__(self, *exc) -> None:
        torch.Tensor.topk = self._orig


@torch.inference_mode()
def official_greedy(model, ids: list[int], max_new: int, forced: list[int] | None = None):
    """generate.py's loop for one prompt: prefill from position 0, then one token per forward. Greedy, or the
    `forced` tokens (teacher forcing). Returns (tokens, fp32 logits [max_new, vocab])."""
    logits = model.forward(torch.tensor([ids]), 0)
    rows, tokens = [], []
    for step in range(max_new):
        row = logits[0].float()
        rows.append(row)
        tokens.append(forced[step] if forced is not None else int(row.argmax()))
        if step + 1 < max_new:
            logits = model.forward(torch.tensor([[tokens[-1]]]), len(ids) + step)
    return tokens, torch.stack(rows)


def golden_prompts(model_dir: Path, cfg: ModelConfig) -> list[tuple[str, str, str | int, int, list[int]]]:
    """make_golden's prompt set through tiny-official's tokenizer (the same 1024-token tokenizer as golden/tiny,
    the same raw-id draws): (name, kind, spec, max_new, ids)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    g = torch.Generator().manual_seed(PROMPT_SEED)
    return [(name, kind, spec, max_new, prompt_ids(name, kind, spec, cfg, tok, g)) for name, kind, spec, max_new
            in PROMPTS]


def run_official(module, model_dir: Path, dtype: torch.dtype = torch.bfloat16,
                 sim: official_kernels.Simulation | None = None,
                 forced: dict[str, list[int]] | None = None) -> tuple[dict[str, tuple[list[int], torch.Tensor]],
                                                                      StableTopk]:
    """Every golden prompt through the official model (top-k ties by lower index, see StableTopk):
    {name: (tokens, logits)} and the top-k tie counts."""
    cfg = ModelConfig.from_json(Path(model_dir) / "config.json")
    sd = official_state_dict(model_dir, cfg)
    args = official_args(module, cfg)
    saved, rotate = dataclasses.replace(official_kernels.SIM), module.rotate_activation
    if dtype == torch.float32:  # rotate_activation asserts bf16; the fp32 cross-checks rotate in fp32
        module.rotate_activation = official_kernels.quant.hadamard
    if sim is not None:
        for f in dataclasses.fields(sim):
            setattr(official_kernels.SIM, f.name, getattr(sim, f.name))
    out = {}
    try:
        with default_dtype(dtype), StableTopk() as watch:
            for name, _, _, max_new, ids in golden_prompts(model_dir, cfg):
                model = build_official(module, args, sd, dtype)
                out[name] = official_greedy(model, ids, max_new, None if forced is None else forced[name])
    finally:
        module.rotate_activation = rotate
        for f in dataclasses.fields(saved):
            setattr(official_kernels.SIM, f.name, getattr(saved, f.name))
    return out, watch


REFERENCE = {
    torch.bfloat16: ("official", "official inference/model.py, bf16 default dtype + its FP8/FP4 simulation, CPU "
                     "kernels (golden/official_kernels.py); prefill from 0 + 1-token steps, greedy, no EOS"),
    torch.float32: ("official-sim-fp32", "official inference/model.py with fp32 default dtype (NOT what it runs: wo_a "
                    "and weights_proj widened to fp32, the Hadamard without its bf16 assert) + its FP8/FP4 simulation, "
                    "CPU kernels (golden/official_kernels.py); prefill from 0 + 1-token steps, greedy, no EOS"),
}


def make_golden(src: Path, model_dir: Path = MODEL_DIR, out_dir: Path = OUT_DIR,
                dtype: torch.dtype = torch.bfloat16) -> dict:
    from safetensors.torch import save_file

    from engine.stack import blas_mode

    module = load_official(src)
    cfg = ModelConfig.from_json(Path(model_dir) / "config.json")
    torch.manual_seed(PROMPT_SEED)
    results, watch = run_official(module, model_dir, dtype)
    entries, tensors = [], {}
    for name, kind, spec, max_new, ids in golden_prompts(model_dir, cfg):
        tokens, logits = results[name]
        top2 = logits.topk(2, dim=-1).values
        margin = float((top2[:, 0] - top2[:, 1]).min())
        entries.append({"name": name, "kind": kind, "text": spec if kind == "text" else None, "prompt_len": len(ids),
                        "max_new_tokens": max_new, "prompt_ids": ids, "output_ids": tokens, "min_margin": margin})
        tensors[f"{name}.prompt_ids"] = torch.tensor(ids, dtype=torch.int64)
        tensors[f"{name}.output_ids"] = torch.tensor(tokens, dtype=torch.int64)
        tensors[f"{name}.logits"] = logits.contiguous()
    worst = min(e["min_margin"] for e in entries)
    if worst <= MIN_MARGIN:
        bad = [e["name"] for e in entries if e["min_margin"] <= MIN_MARGIN]
        raise RuntimeError(f"greedy logit margin {worst:.2e} <= {MIN_MARGIN} in {bad}: change the model seed")
    meta = {
        "magic": MAGIC,
        "format_version": FORMAT_VERSION,
        "seed": PROMPT_SEED,
        "model_seed": MODEL_SEED,
        "torch_version": torch.__version__,
        "transformers_version": None,
        "config_hash": cfg.config_hash(),
        "model_sha256": hashlib.sha256((Path(model_dir) / "model.safetensors").read_bytes()).hexdigest(),
        "reference": REFERENCE[dtype][1],
        "numerics": REFERENCE[dtype][0],
        "official_source": source_info(src),
        "kernels": "golden/official_kernels.py (CPU, plain torch; the tilelang kernel.py does not run on a CPU)",
        "model_dir": "golden/tiny-official",
        "host_math": blas_mode(),
        "min_logit_margin": worst,
        "topk_rule": "ties at the top-k boundary broken by the lower index (stable sort); torch.topk otherwise",
        "topk_rows": watch.rows,
        "topk_boundary_ties": watch.ties,
        "prompts": entries,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "golden.safetensors"),
              metadata={"magic": MAGIC, "format_version": str(FORMAT_VERSION), "config_hash": cfg.config_hash()})
    (out_dir / "golden.json").write_text(dumps_meta(meta))
    return meta


def main() -> None:
    p = argparse.ArgumentParser(description="Golden outputs of golden/tiny-official from the official inference code.")
    p.add_argument("--official-src", type=Path, required=True, help=f"the official inference/ folder ({HOW_TO_GET})")
    p.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    p.add_argument("--out", type=Path, default=None, help="default: golden/official (golden/official-fp32 with "
                   "--dtype float32)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="default dtype of the official run: bfloat16 = what the official code runs (the golden); "
                        "float32 = its simulation steps without the bf16 roundings (a staging target)")
    args = p.parse_args()
    from engine.backends.host import setup_host_process

    setup_host_process(threads=1)  # MKL's reproducible mode, one thread (tiny matmuls; no oversubscription)
    dtype = getattr(torch, args.dtype)
    out = args.out or (OUT_DIR if dtype == torch.bfloat16 else GOLDEN_DIR / "official-fp32")
    meta = make_golden(args.official_src, args.model_dir, out, dtype)
    for e in meta["prompts"]:
        print(f"{e['name']:>14}: prompt {e['prompt_len']:4d} + {e['max_new_tokens']} tokens, "
              f"min margin {e['min_margin']:.4f}")
    print(f"min logit margin {meta['min_logit_margin']:.4f}, top-k boundary ties {meta['topk_boundary_ties']} of "
          f"{meta['topk_rows']} selections, config_hash {meta['config_hash']}, model.py "
          f"{meta['official_source']['model_py_sha256'][:12]} ({meta['official_source']['model_py_revision']})")


if __name__ == "__main__":
    main()
