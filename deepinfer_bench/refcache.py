"""The golden cache: HF reference runs (fp32 and bf16 logits, teacher-forced; per-layer captures on request)
computed once and stored content-addressed, so any later run - on a trn2 host without transformers too - reads
them back. Key: the model's bytes (config.json + *.safetensors), the token sequences, the dtypes, the captured
prompts and the format; nothing of the engine's run (backend, cp / TP, KV dtype) enters it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer_bench.golden import GoldenError
from engine.config import ModelConfig

FORMAT = "deepinfer-reference-v1"
DTYPES = ("float32", "bfloat16")


def default_cache_dir() -> Path:
    """$DEEPINFER_REFERENCE_CACHE, else ~/.cache/deepinfer/reference."""
    env = os.environ.get("DEEPINFER_REFERENCE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "deepinfer" / "reference"


class ReferenceMissing(GoldenError):
    """No cached reference for this key and transformers is not installed to make one."""


@dataclass
class Sequence:
    name: str
    prompt_ids: list[int]
    forced: list[int]


@dataclass
class Reference:
    key: str
    logits: dict[str, dict[str, torch.Tensor]]  # dtype -> prompt -> [N, vocab] fp32
    layers: dict[str, dict[str, dict[str, torch.Tensor]]] = field(default_factory=dict)  # dtype -> prompt -> module
    meta: dict = field(default_factory=dict)


def model_digest(model_dir: Path) -> str:
    """sha256 of config.json and every *.safetensors of `model_dir`, streamed (names sorted)."""
    h = hashlib.sha256()
    for f in [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors"))]:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()


def reference_key(digest: str, seqs: list[Sequence], per_layer: list[str]) -> str:
    body = {"format": FORMAT, "model": digest, "dtypes": list(DTYPES), "per_layer": sorted(per_layer),
            "sequences": [[s.name, list(s.prompt_ids), list(s.forced)] for s in seqs]}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:24]


def get_reference(model_dir: str | Path, cfg: ModelConfig, seqs: list[Sequence], per_layer: list[str] = (),
                  cache_dir: str | Path | None = None, make: bool = True) -> Reference:
    """The reference for `seqs` on the model in `model_dir`: read from `cache_dir` (default_cache_dir) when there,
    else made with HF transformers (`make`) and stored there."""
    model_dir = Path(model_dir)
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    per_layer = list(per_layer)
    key = reference_key(model_digest(model_dir), seqs, per_layer)
    where = cache_dir / key
    if (where / "reference.safetensors").exists():
        return _read(where, key)
    if not make:
        raise ReferenceMissing(f"no reference {key} in {cache_dir}")
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise ReferenceMissing(f"no reference {key} in {cache_dir} and transformers is not installed: make it on a "
                               f"CPU box with `deepinfer reference --model-dir {model_dir} --out DIR` and pass "
                               f"--reference DIR") from e
    ref = _make(model_dir, cfg, seqs, per_layer, key)
    _write(where, ref, model_dir, seqs, per_layer)
    return ref


def _make(model_dir: Path, cfg: ModelConfig, seqs: list[Sequence], per_layer: list[str], key: str) -> Reference:
    from deepinfer_bench.reference import build_hf_model, hf_forced
    from engine.loader import load_checkpoint

    bad = [s.name for s in seqs if max(s.prompt_ids + s.forced) >= cfg.vocab_size]
    if bad:
        raise ValueError(f"token ids past the model's vocabulary ({cfg.vocab_size}) in {bad}")
    state = load_checkpoint(model_dir, cfg, dtype=torch.float32)
    ref = Reference(key=key, logits={}, layers={})
    for dtype in DTYPES:
        model = build_hf_model(cfg, state, dtype=getattr(torch, dtype))
        ref.logits[dtype], ref.layers[dtype] = {}, {}
        for s in seqs:
            logits, cap = hf_forced(model, s.prompt_ids, s.forced, capture=s.name in per_layer)
            ref.logits[dtype][s.name] = logits.contiguous()
            if cap:
                ref.layers[dtype][s.name] = {k: v.contiguous() for k, v in cap.items()}
        del model
    return ref


def _write(where: Path, ref: Reference, model_dir: Path, seqs: list[Sequence], per_layer: list[str]) -> None:
    import transformers
    from safetensors.torch import save_file

    where.mkdir(parents=True, exist_ok=True)
    tensors = {f"logits.{d}.{n}": t for d, per in ref.logits.items() for n, t in per.items()}
    tensors.update({f"layers.{d}.{n}.{m}": t for d, per in ref.layers.items() for n, mods in per.items()
                    for m, t in mods.items()})
    tmp = where / "reference.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": FORMAT, "key": ref.key})
    ref.meta = {"format": FORMAT, "key": ref.key, "model_dir": str(model_dir), "dtypes": list(DTYPES),
                "per_layer": per_layer, "torch_version": torch.__version__,
                "transformers_version": transformers.__version__,
                "reference": "HF DeepseekV4ForCausalLM eager, teacher-forced (one forward of prompt + forced[:-1])",
                "sequences": [{"name": s.name, "prompt_ids": s.prompt_ids, "forced": s.forced} for s in seqs]}
    (where / "meta.json").write_text(json.dumps(ref.meta))
    tmp.replace(where / "reference.safetensors")


def _read(where: Path, key: str) -> Reference:
    from safetensors.torch import load_file

    meta = json.loads((where / "meta.json").read_text())
    if meta.get("format") != FORMAT:
        raise ReferenceMissing(f"{where}: format {meta.get('format')!r}, this deepinfer reads {FORMAT!r}")
    ref = Reference(key=key, logits={}, layers={}, meta=meta)
    for name, t in load_file(str(where / "reference.safetensors")).items():
        kind, dtype, rest = name.split(".", 2)
        if kind == "logits":
            ref.logits.setdefault(dtype, {})[rest] = t
        else:
            prompt, module = rest.rsplit(".", 1)
            ref.layers.setdefault(dtype, {}).setdefault(prompt, {})[module] = t
    return ref
