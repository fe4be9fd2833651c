"""`deepinfer slice`: a self-consistent small checkpoint cut from a DeepSeek-V4 one (official names, sharded or
not, FP8 / FP4 as stored): a contiguous range of layers (the MTP block kept when present), the first N routed
experts with the router's rows, bias and hash table kept consistent, embeddings and head kept. Streams shard by
shard: peak memory is one output shard, not the checkpoint.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from engine.loader import INDEX_FILE, SINGLE_FILE, split_name

_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


class SliceError(ValueError):
    """A slice that cannot be cut from this checkpoint."""


def parse_layers(spec: str) -> tuple[int, int]:
    """"0-2" -> (0, 2); "3" -> (3, 3)."""
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", spec.strip())
    if not m:
        raise SliceError(f"--layers {spec!r}: expected A-B (a contiguous range, e.g. 0-2) or one layer")
    a, b = int(m.group(1)), int(m.group(2) or m.group(1))
    if b < a:
        raise SliceError(f"--layers {spec!r}: the range is empty")
    return a, b


def slice_config(raw: dict, first: int, last: int, experts: int | None) -> dict:
    """The official config.json of the slice: layers [first, last] renumbered from 0, the hash layers among them,
    their compression ratios (then the MTP layers'), and `experts` routed experts."""
    if "n_layers" not in raw:
        raise SliceError("config.json is not in the official spelling (n_layers, n_routed_experts, ...): slice "
                         "cuts official-format checkpoints")
    n = int(raw["n_layers"])
    if last >= n:
        raise SliceError(f"--layers {first}-{last}: the model has layers 0-{n - 1}")
    out = dict(raw)
    out["n_layers"] = last - first + 1
    out["n_hash_layers"] = max(0, min(last + 1, int(raw.get("n_hash_layers", 0))) - first)
    ratios = list(raw["compress_ratios"])
    out["compress_ratios"] = ratios[first:last + 1] + ratios[n:]
    if experts is not None:
        total = int(raw["n_routed_experts"])
        if not int(raw["n_activated_experts"]) <= experts <= total:
            raise SliceError(f"--experts {experts}: between n_activated_experts ({raw['n_activated_experts']}) and "
                             f"n_routed_experts ({total})")
        out["n_routed_experts"] = experts
    return out


def _rename(name: str, first: int, last: int, experts: int | None) -> str | None:
    """The tensor's name in the slice, or None when the slice drops it."""
    block, idx, suffix = split_name(name)
    if block == "layers":
        if not first <= idx <= last:
            return None
        name = f"layers.{idx - first}.{suffix}"
    m = _EXPERT.match(suffix)
    if m and experts is not None and int(m.group(1)) >= experts:
        return None
    return name


def remap_hash(tid2eid: torch.Tensor, experts: int) -> torch.Tensor:
    """A hash table [vocab, k] cut to the first `experts` experts: a token's kept experts stay where they are, each
    dropped one becomes the lowest kept expert the token does not use yet, so every token still routes to k
    distinct existing experts."""
    out = tid2eid.clone()
    for r in (tid2eid >= experts).any(-1).nonzero().flatten().tolist():
        ids = tid2eid[r].tolist()
        free = iter(sorted(set(range(experts)) - set(ids)))
        out[r] = torch.tensor([i if i < experts else next(free) for i in ids], dtype=tid2eid.dtype)
    return out


def _cut(name: str, t: torch.Tensor, experts: int | None) -> torch.Tensor:
    """The router's tensors cut to the first `experts` experts: gate rows and bias, and the hash table
    (`remap_hash`)."""
    if experts is None:
        return t
    if name.endswith("ffn.gate.weight") or name.endswith("ffn.gate.bias"):
        return t[:experts].contiguous()
    if name.endswith("ffn.gate.tid2eid"):
        return remap_hash(t, experts).contiguous()
    return t


def _shards(model_dir: Path) -> list[Path]:
    if (model_dir / INDEX_FILE).exists():
        weight_map = json.loads((model_dir / INDEX_FILE).read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    if (model_dir / SINGLE_FILE).exists():
        return [model_dir / SINGLE_FILE]
    raise SliceError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE}")


def slice_checkpoint(model_dir: str | Path, out: str | Path, layers: str, experts: int | None = None) -> dict:
    """Cut the slice of `model_dir` into `out` (config.json, shards + index, tokenizer files); returns a summary
    (tensors kept, bytes written, the largest shard in bytes: the peak the cut held in memory)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    model_dir, out = Path(model_dir), Path(out)
    first, last = parse_layers(layers)
    raw = json.loads((model_dir / "config.json").read_text())
    config = slice_config(raw, first, last, experts)
    out.mkdir(parents=True, exist_ok=True)
    shards = _shards(model_dir)
    weight_map: dict[str, str] = {}
    written = biggest = 0
    for i, shard in enumerate(shards):
        kept: dict[str, torch.Tensor] = {}
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                new = _rename(name, first, last, experts)
                if new is not None:
                    kept[new] = _cut(name, f.get_tensor(name), experts)
        if not kept:
            continue
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(kept, str(out / fname), metadata={"format": "pt"})
        size = sum(t.numel() * t.element_size() for t in kept.values())
        written, biggest = written + size, max(biggest, size)
        weight_map.update(dict.fromkeys(kept, fname))
        del kept
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": written}, "weight_map": weight_map},
                                             indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in _TOKENIZER_FILES:
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, out / name)
    return {"tensors": len(weight_map), "bytes": written, "largest_shard_bytes": biggest, "layers": [first, last],
            "n_layers": config["n_layers"], "n_routed_experts": config["n_routed_experts"]}
