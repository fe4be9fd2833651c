"""The golden cache: HF reference runs (fp32 and bf16 logits, teacher-forced, bf16 once per draw of the noise band:
hf_reference.DRAWS; per-layer captures on request) computed once and stored content-addressed, so any later run - on
a trn2 host without transformers too - reads them back. Key: the model's bytes (config.json + *.safetensors), the
token sequences, the dtypes, the draws and the format; a prompt's per-layer captures sit beside its logits, made
when first asked for. Nothing of the engine's run (backend, cp / TP, KV dtype) enters the key.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer_bench.errors import GoldenError
from engine.config import ModelConfig

FORMAT = "deepinfer-reference-v2"  # v2: the bf16 draws
DTYPES = ("float32", "bfloat16")


def default_cache_dir() -> Path:
    """DEEPINFER_REFERENCE_CACHE (engine/envs.py), else the user's deepinfer cache."""
    from engine.envs import cache_root, get_envs

    env = get_envs().DEEPINFER_REFERENCE_CACHE
    return Path(env).expanduser() if env else cache_root() / "reference"


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
    logits: dict[str, dict[str, torch.Tensor]]  # dtype (bf16 draws: "bfloat16@DRAW") -> prompt -> [N, vocab] fp32
    layers: dict[str, dict[str, dict[str, torch.Tensor]]] = field(default_factory=dict)  # dtype -> prompt -> module
    meta: dict = field(default_factory=dict)


    def draws(self, dtype: str, prompt: str) -> list[torch.Tensor]:
        """Every stored run of `prompt` in `dtype`: the first draw (stored as `dtype`) and the others."""
        return [self.logits[k][prompt] for k in self.logits if k == dtype or k.startswith(dtype + "@")]


def model_digest(model_dir: Path) -> str:
    """sha256 of config.json and every *.safetensors of `model_dir`, streamed (names sorted)."""
    h = hashlib.sha256()
    for f in [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors"))]:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()


def reference_key(digest: str, seqs: list[Sequence]) -> str:
    from deepinfer_bench.bench.hf_reference import DRAWS

    body = {"format": FORMAT, "model": digest, "dtypes": list(DTYPES), "draws": [repr(d) for d in DRAWS],
            "sequences": [[s.name, list(s.prompt_ids), list(s.forced)] for s in seqs]}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:24]


def get_reference(model_dir: str | Path, cfg: ModelConfig, seqs: list[Sequence], per_layer: list[str] = (),
                  cache_dir: str | Path | None = None, make: bool = True) -> Reference:
    """The reference for `seqs` on the model in `model_dir` (and the per-layer captures of the prompts named in
    `per_layer`): read from `cache_dir` (default_cache_dir) where there, else made with HF transformers (`make`)
    and stored there - the logits under the key's dir, each prompt's captures beside them."""
    model_dir = Path(model_dir)
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    key = reference_key(model_digest(model_dir), seqs)
    where = cache_dir / key
    have = (where / "reference.safetensors").exists()
    missing = [n for n in per_layer if not (where / f"layers-{n}.safetensors").exists()]
    if have and not missing:
        return _read(where, key, list(per_layer))
    if not make:
        raise ReferenceMissing(f"no reference {key} in {cache_dir}"
                               f"{' with the per-layer captures of ' + str(missing) if have else ''}")
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise ReferenceMissing(f"no reference {key} in {cache_dir} and transformers is not installed: make it on a "
                               f"CPU box with `deepinfer reference --model-dir {model_dir} --out DIR` (with the same "
                               f"--per-layer prompts) and pass --reference DIR") from e
    run = seqs if not have else [s for s in seqs if s.name in missing]
    logits, layers = _make(model_dir, cfg, run, missing, logits_wanted=not have)
    where.mkdir(parents=True, exist_ok=True)
    if not have:
        _write_logits(where, key, logits, model_dir, seqs)
    for name in missing:
        _save(where / f"layers-{name}.safetensors", {f"{d}.{m}": layers[d][name][m] for d in DTYPES
                                                     for m in layers[d][name]}, key)
    return _read(where, key, list(per_layer))


def _make(model_dir: Path, cfg: ModelConfig, seqs: list[Sequence], per_layer: list[str],
          logits_wanted: bool = True) -> tuple[dict, dict]:
    """HF teacher-forced runs of `seqs` in every dtype of DTYPES, bf16 once per draw of hf_reference.DRAWS:
    ({dtype: {prompt: logits}} with the later draws as "bfloat16@NAME", {dtype: {prompt: {module: captures}}} for
    the prompts in `per_layer`, of the first draw)."""
    from deepinfer_bench.bench.hf_reference import DRAWS, apply_policy, build_hf_model, hf_forced, summation_order
    from engine.loader import load_checkpoint

    bad = [s.name for s in seqs if max(s.prompt_ids + s.forced) >= cfg.vocab_size]
    if bad:
        raise ReferenceMissing(f"token ids past the model's vocabulary ({cfg.vocab_size}) in {bad}")
    state = load_checkpoint(model_dir, cfg, dtype=torch.float32)
    logits: dict = {}
    layers: dict = {}
    runs = [("float32", None, None)] + [(f"bfloat16@{d.name}" if i else "bfloat16", d, "bfloat16")
                                        for i, d in enumerate(DRAWS)]
    if not logits_wanted:
        runs = [r for r in runs if "@" not in r[0]]
    model, policy = None, None
    for key, draw, dtype in runs:
        want = (draw.policy if draw else "fp32")
        if model is None or want != policy:
            model = build_hf_model(cfg, state, dtype=getattr(torch, dtype or key))
            model, policy = apply_policy(model, draw.policy) if draw else model, want
        logits[key] = {}
        with summation_order(draw) if draw else contextlib.nullcontext():
            for s in seqs:
                capture = s.name in per_layer and "@" not in key
                lg, cap = hf_forced(model, s.prompt_ids, s.forced, capture=capture)
                logits[key][s.name] = lg.contiguous()
                if cap:
                    layers.setdefault(key, {})[s.name] = {k: v.contiguous() for k, v in cap.items()}
    return logits, layers


def _save(path: Path, tensors: dict[str, torch.Tensor], key: str) -> None:
    """Write through a temporary name, so a reader never sees half a file."""
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": FORMAT, "key": key})
    tmp.replace(path)


def _write_logits(where: Path, key: str, logits: dict, model_dir: Path, seqs: list[Sequence]) -> None:
    import transformers

    from deepinfer_bench.bench.hf_reference import DRAWS

    meta = {"format": FORMAT, "key": key, "model_dir": str(model_dir), "dtypes": list(DTYPES),
            "draws": [vars(d) for d in DRAWS],
            "torch_version": torch.__version__, "transformers_version": transformers.__version__,
            "reference": "HF DeepseekV4ForCausalLM eager, teacher-forced (one forward of prompt + forced[:-1])",
            "sequences": [{"name": s.name, "prompt_ids": s.prompt_ids, "forced": s.forced} for s in seqs]}
    (where / "meta.json").write_text(json.dumps(meta))
    _save(where / "reference.safetensors", {f"{d}.{n}": t for d, per in logits.items() for n, t in per.items()},
          key)


def _read(where: Path, key: str, per_layer: list[str]) -> Reference:
    from safetensors.torch import load_file

    meta = json.loads((where / "meta.json").read_text())
    if meta.get("format") != FORMAT:
        raise ReferenceMissing(f"{where}: format {meta.get('format')!r}, this deepinfer reads {FORMAT!r}")
    ref = Reference(key=key, logits={}, layers={}, meta=meta)
    for name, t in load_file(str(where / "reference.safetensors")).items():
        dtype, prompt = name.split(".", 1)
        ref.logits.setdefault(dtype, {})[prompt] = t
    for prompt in per_layer:
        for name, t in load_file(str(where / f"layers-{prompt}.safetensors")).items():
            dtype, module = name.split(".", 1)
            ref.layers.setdefault(dtype, {}).setdefault(prompt, {})[module] = t
    return ref
