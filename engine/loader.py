"""DeepSeek-V4 checkpoint loading: safetensors (single or sharded), official <-> HF names, FP8/FP4 dequantisation.

Everything the engine sees uses the **official** tensor names of DeepSeek's `inference/model.py`
(`layers.L.attn.wq_a.weight`, `layers.L.ffn.experts.E.w1.weight`, `mtp.0.e_proj.weight`, ...), see
the tensor listing of the released checkpoints. Three on-disk spellings are recognised:

* ``official``: the released checkpoint and `golden/tiny` (FP8 e4m3 + UE8M0 ``.scale``, FP4 ``I8`` + ``.scale``).
* ``hf``: HF module names (`model.layers.L.self_attn.q_a_proj.weight`, stacked
  `mlp.experts.gate_up_proj` [E, 2I, D] = w1 rows then w3 rows, `mlp.experts.down_proj` [E, D, I]), e.g. a
  `safetensors.torch.save_file(hf_model.state_dict())` or `save_pretrained(save_original_format=False)`.
* ``hf_saved``: what `save_pretrained()` of transformers 5.24 writes by default. Its reverse conversion mapping
  gives official names under a `model.` prefix, except `model.embed_tokens.weight`, `model.hc_head.hc_*`,
  `model.norm.weight`, and `attn.kv_norm` which comes out as `attn.norm` (the reverse of its `.norm.`->`.kv_norm.`
  rule); experts are split per expert again.

HF has no MTP weights (`mtp.*` is dropped), so HF spellings load without them.

Loading is memory-mapped and tensor by tensor (`safetensors.safe_open`), so a subset of layers / experts can be
loaded from a checkpoint larger than RAM: only the requested tensors (and their scales) are read.
"""

from __future__ import annotations

import functools
import json
import math
import re
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from engine.config import ConfigError, ModelConfig
from engine.model.layers import stored_fp32
from nki_kernels.formats import (
    FP4_BLOCK,
    FP8_BLOCK,
    as_bytes,
    dequant_fp4,
    dequant_fp8_block,
    quant_fp4,
    quant_fp8_block,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that does not match the model config (message names the tensor and the file)."""


# ---- the name table --------------------------------------------------------------------------------------------
# Official per-layer suffix (after `layers.L.`) -> HF module suffix (after `model.layers.L.`). Checked against
# transformers 5.24 `conversion_mapping.py` ("deepseek_v4") and a DeepseekV4ForCausalLM state_dict.
LAYER_NAMES: tuple[tuple[str, str], ...] = (
    ("attn.attn_sink", "self_attn.sinks"),
    ("attn.wq_a.weight", "self_attn.q_a_proj.weight"),
    ("attn.q_norm.weight", "self_attn.q_a_norm.weight"),
    ("attn.wq_b.weight", "self_attn.q_b_proj.weight"),
    ("attn.wkv.weight", "self_attn.kv_proj.weight"),
    ("attn.kv_norm.weight", "self_attn.kv_norm.weight"),
    ("attn.wo_a.weight", "self_attn.o_a_proj.weight"),
    ("attn.wo_b.weight", "self_attn.o_b_proj.weight"),
    ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    ("attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight"),
    ("attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight"),
    ("attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight"),
    ("attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight"),
    ("attn.indexer.weights_proj.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight"),
    ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    ("attn.indexer.compressor.wkv.weight", "self_attn.compressor.indexer.kv_proj.weight"),
    ("attn.indexer.compressor.wgate.weight", "self_attn.compressor.indexer.gate_proj.weight"),
    ("attn.indexer.compressor.norm.weight", "self_attn.compressor.indexer.kv_norm.weight"),
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("hc_attn_fn", "attn_hc.fn"),
    ("hc_attn_base", "attn_hc.base"),
    ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"),
    ("hc_ffn_base", "ffn_hc.base"),
    ("hc_ffn_scale", "ffn_hc.scale"),
    ("ffn.gate.weight", "mlp.gate.weight"),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.tid2eid", "mlp.gate.tid2eid"),
    ("ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"),
    ("ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"),
    ("ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"),
)
GLOBAL_NAMES: tuple[tuple[str, str], ...] = (
    ("embed.weight", "model.embed_tokens.weight"),
    ("head.weight", "lm_head.weight"),
    ("norm.weight", "model.norm.weight"),
    ("hc_head_fn", "model.hc_head.hc_fn"),
    ("hc_head_base", "model.hc_head.hc_base"),
    ("hc_head_scale", "model.hc_head.hc_scale"),
)
# Routed experts: official `ffn.experts.E.{w1,w3,w2}.weight` <-> rows of the HF stacked tensors.
HF_GATE_UP = "mlp.experts.gate_up_proj"  # [E, 2I, D]: rows [0, I) = w1, rows [I, 2I) = w3
HF_DOWN = "mlp.experts.down_proj"  # [E, D, I] = w2
# `save_pretrained()` (hf_saved) spelling of the globals.
_HF_SAVED_GLOBALS = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}

_LAYER_TO_HF = dict(LAYER_NAMES)
_LAYER_FROM_HF = {hf: off for off, hf in LAYER_NAMES}
_GLOBAL_TO_HF = dict(GLOBAL_NAMES)
_GLOBAL_FROM_HF = {hf: off for off, hf in GLOBAL_NAMES}
_LAYER_RE = re.compile(r"^(layers|mtp)\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def split_name(name: str) -> tuple[str, int | None, str]:
    """Official name -> (block, index, suffix): ("layers", 3, "attn.wq_a.weight"), ("global", None, "embed.weight")."""
    m = _LAYER_RE.match(name)
    if m:
        return m.group(1), int(m.group(2)), m.group(3)
    return "global", None, name


def expert_of(name: str) -> tuple[int, str] | None:
    """(expert id, "w1"|"w2"|"w3") for a routed-expert official name, else None."""
    _, _, suffix = split_name(name)
    m = _EXPERT_RE.match(suffix)
    return (int(m.group(1)), m.group(2)) if m else None


def to_hf_name(name: str) -> str | None:
    """Official name -> HF module name; None for `mtp.*` (HF has no MTP) and routed experts (stacked in HF, use
    `official_to_hf`)."""
    block, idx, suffix = split_name(name)
    if block == "mtp" or _EXPERT_RE.match(suffix):
        return None
    if block == "global":
        if name not in _GLOBAL_TO_HF:
            raise KeyError(f"no HF name for official tensor {name!r}")
        return _GLOBAL_TO_HF[name]
    if suffix not in _LAYER_TO_HF:
        raise KeyError(f"no HF name for official tensor {name!r}")
    return f"model.layers.{idx}.{_LAYER_TO_HF[suffix]}"


def from_hf_name(hf_name: str) -> str:
    """HF module name -> official name (not for the stacked expert tensors)."""
    if hf_name in _GLOBAL_FROM_HF:
        return _GLOBAL_FROM_HF[hf_name]
    m = _HF_LAYER_RE.match(hf_name)
    if m and m.group(2) in _LAYER_FROM_HF:
        return f"layers.{m.group(1)}.{_LAYER_FROM_HF[m.group(2)]}"
    raise KeyError(f"no official name for HF tensor {hf_name!r}")


def to_hf_saved_name(name: str) -> str | None:
    """Official name -> the spelling written by transformers 5.24 `save_pretrained()` (None for `mtp.*`)."""
    block, idx, suffix = split_name(name)
    if block == "mtp":
        return None
    if block == "global":
        return _HF_SAVED_GLOBALS.get(name)
    if suffix == "attn.kv_norm.weight":
        suffix = "attn.norm.weight"
    return f"model.layers.{idx}.{suffix}"


def official_to_hf(state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Official-named (dequantised) state dict -> HF `DeepseekV4ForCausalLM` state dict. Stacks the routed experts
    of each layer (all of them must be present); drops `mtp.*`."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[tuple[int, str], torch.Tensor]] = {}
    for name, t in state_dict.items():
        block, idx, _ = split_name(name)
        if block == "mtp":
            continue
        ex = expert_of(name)
        if ex is not None:
            experts.setdefault(idx, {})[ex] = t
            continue
        out[to_hf_name(name)] = t
    for layer, parts in sorted(experts.items()):
        missing = [f"{e}.{w}" for e in range(cfg.n_routed_experts) for w in ("w1", "w2", "w3") if (e, w) not in parts]
        if missing:
            raise KeyError(f"layer {layer}: routed experts missing for HF stacking: {missing[:6]}")
        E = cfg.n_routed_experts
        out[f"model.layers.{layer}.{HF_GATE_UP}"] = torch.stack(
            [torch.cat([parts[(e, "w1")], parts[(e, "w3")]], dim=0) for e in range(E)])  # [E, 2I, D]
        out[f"model.layers.{layer}.{HF_DOWN}"] = torch.stack([parts[(e, "w2")] for e in range(E)])  # [E, D, I]
    return out


def hf_to_official(state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF module-named state dict -> official names; splits the stacked experts."""
    out: dict[str, torch.Tensor] = {}
    inter = cfg.moe_inter_dim
    for hf_name, t in state_dict.items():
        m = _HF_LAYER_RE.match(hf_name)
        if m and m.group(2) == HF_GATE_UP:
            for e in range(t.shape[0]):
                out[f"layers.{m.group(1)}.ffn.experts.{e}.w1.weight"] = t[e, :inter]
                out[f"layers.{m.group(1)}.ffn.experts.{e}.w3.weight"] = t[e, inter:]
        elif m and m.group(2) == HF_DOWN:
            for e in range(t.shape[0]):
                out[f"layers.{m.group(1)}.ffn.experts.{e}.w2.weight"] = t[e]
        else:
            out[from_hf_name(hf_name)] = t
    return out


# ---- what a checkpoint must contain --------------------------------------------------------------------------
# The names and shapes come from the model itself (built on the meta device, no memory): the loader never restates
# them. Only the order is the checkpoint's (the released files list a layer's attention, its norms, its mHC
# parameters, then its FFN; make_tiny_model.py draws its random weights in this order).
_GLOBAL_ORDER = ("embed.", "layers.", "norm.", "head.", "hc_head_", "mtp.")
_LAYER_ORDER = ("attn.", "attn_norm.", "ffn_norm.", "hc_attn_", "hc_ffn_", "ffn.", "e_proj.", "h_proj.", "enorm.",
                "hnorm.", "main_proj.", "main_norm.", "norm.", "hc_head_", "markov_head.", "confidence_head.")


def _rank(name: str, order: tuple[str, ...]) -> int:
    return next(i for i, prefix in enumerate(order) if name.startswith(prefix))


def _checkpoint_order(name: str) -> tuple[int, int, int]:
    block, idx, suffix = split_name(name)
    if block in ("layers", "mtp"):
        return _rank(name, _GLOBAL_ORDER), int(idx), _rank(suffix, _LAYER_ORDER)
    return _rank(name, _GLOBAL_ORDER), 0, 0


def expected_tensors(cfg: ModelConfig, include_mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """Every official tensor name of the model -> its logical (dequantised) shape, in checkpoint order."""
    return dict(_expected(cfg, include_mtp))


@functools.lru_cache(maxsize=8)
def _expected(cfg: ModelConfig, include_mtp: bool) -> tuple[tuple[str, tuple[int, ...]], ...]:
    from engine.model.model import Transformer

    shapes = {k: tuple(v.shape) for k, v in Transformer(cfg, with_mtp=include_mtp).state_dict(keep_vars=True).items()}
    return tuple(sorted(shapes.items(), key=lambda kv: _checkpoint_order(kv[0])))  # stable within a group


_FP8_SUFFIXES = frozenset({
    "attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
    "attn.indexer.wq_b.weight", "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight",
    "ffn.shared_experts.w3.weight", "e_proj.weight", "h_proj.weight", "main_proj.weight",
})


def official_format(name: str, cfg: ModelConfig) -> str:
    """How the released checkpoint stores an official tensor: "fp8" (e4m3 + 128x128 UE8M0 `.scale`),
    "fp4" (I8 packed e2m1 + 1x32 UE8M0 `.scale`), "bf16", "fp32" or "i64"."""
    fixed = _fixed_format(name)
    if fixed is not None:
        return fixed
    _, _, suffix = split_name(name)
    if _EXPERT_RE.match(suffix):
        return cfg.expert_dtype or cfg.dtype
    if suffix in _FP8_SUFFIXES:
        return cfg.dtype
    return "bf16"


def _fixed_format(name: str) -> str | None:
    """"fp32" / "i64" for the tensors whose dtype never follows the checkpoint format, else None."""
    if stored_fp32(name):
        return "fp32"
    if name.endswith("ffn.gate.tid2eid"):
        return "i64"
    return None


def to_official_format(state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Dense official-named tensors -> the tensors of a released-format checkpoint (FP8/FP4 weights get their
    `.scale` companions). Inverse of `load_checkpoint` up to the quantisation."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        fmt = official_format(name, cfg)
        if fmt in ("fp8", "fp4"):
            w, s = quant_fp8_block(t) if fmt == "fp8" else quant_fp4(t)
            out[name] = w
            out[_scale_name(name)] = s
        elif fmt == "fp32":
            out[name] = t.to(torch.float32).contiguous()
        elif fmt == "i64":
            out[name] = t.to(torch.int64).contiguous()
        else:
            out[name] = t.to(torch.bfloat16).contiguous()
    return out


def _scale_name(weight_name: str) -> str:
    return weight_name[: -len(".weight")] + ".scale" if weight_name.endswith(".weight") else weight_name + ".scale"


# ---- safetensors files ---------------------------------------------------------------------------------------
_ST_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2),
    "F8_E4M3": (torch.float8_e4m3fn, 1), "F8_E5M2": (torch.float8_e5m2, 1), "F8_E8M0": (torch.float8_e8m0fnu, 1),
    "I64": (torch.int64, 8), "I32": (torch.int32, 4), "I16": (torch.int16, 2), "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1), "BOOL": (torch.bool, 1),
}
_FLOATS = ("F32", "BF16", "F16")


def _read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Parse and validate a safetensors header without reading tensor data: name -> (dtype, shape)."""
    return _parse_header(path)[0]


def _parse_header(path: Path) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, tuple[int, int]], int]:
    """(name -> (dtype, shape), name -> data byte range, where the data starts in the file)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
            (n,) = struct.unpack("<Q", head)
            if 8 + n > size:
                raise CheckpointError(f"{path}: truncated safetensors header ({n} header bytes, file has {size})")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from e
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    out, offsets = {}, {}
    data_size = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dt, shape, (start, end) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name!r}: {info!r}") from e
        if dt not in _ST_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dt}")
        if end > data_size:
            raise CheckpointError(f"{path}: truncated file: tensor {name!r} needs data bytes [{start}, {end}) but "
                                  f"the file holds only {data_size} data bytes")
        if end - start != math.prod(shape) * _ST_DTYPES[dt][1]:
            raise CheckpointError(f"{path}: corrupt header: tensor {name!r} {dt}{list(shape)} spans {end - start} "
                                  "bytes")
        out[name] = (dt, shape)
        offsets[name] = (int(start), int(end))
    return out, offsets, 8 + n


class _Checkpoint:
    """Lazy view of a (possibly sharded) safetensors checkpoint: headers parsed on first use, data memory-mapped."""

    def __init__(self, model_dir: Path) -> None:
        from safetensors import safe_open  # noqa: F401  (fail early if missing)

        self.dir = model_dir
        self.where: dict[str, Path] = {}
        self._headers: dict[Path, dict[str, tuple[str, tuple[int, ...]]]] = {}
        self._offsets: dict[Path, dict[str, tuple[int, int]]] = {}
        self._data_start: dict[Path, int] = {}
        self._handles: dict[Path, object] = {}
        index = model_dir / INDEX_FILE
        single = model_dir / SINGLE_FILE
        if index.exists():
            self.source = index
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from e
            self.where = {k: model_dir / v for k, v in weight_map.items()}
        elif single.exists():
            self.source = single
            self.where = dict.fromkeys(self._header(single, None), single)
        else:
            raise CheckpointError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE}")

    def _header(self, path: Path, tensor: str | None) -> dict[str, tuple[str, tuple[int, ...]]]:
        if path not in self._headers:
            if not path.exists():
                raise CheckpointError(f"tensor {tensor!r}: shard {path} listed in {self.source.name} is missing")
            self._headers[path], self._offsets[path], self._data_start[path] = _parse_header(path)
        return self._headers[path]

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def info(self, key: str) -> tuple[str, tuple[int, ...]]:
        path = self.where[key]
        header = self._header(path, key)
        if key not in header:
            raise CheckpointError(f"tensor {key!r}: listed in {self.source.name} for {path.name} but not in that file")
        return header[key]

    def read(self, key: str, index: tuple | None = None) -> torch.Tensor:
        """Read one tensor (or `index`, a tuple of ints/slices, of it). A whole tensor is read with plain file I/O
        into its own memory (no memory map: mapped pages of the file would count in the process's resident set
        on top of the copy, up to twice the checkpoint at the peak of a load); a slice through safetensors."""
        path = self.where[key]
        dt, shape = self.info(key)
        if index is None:
            start, end = self._offsets[path][key]
            out = torch.empty(shape, dtype=_ST_DTYPES[dt][0])
            view = out.view(-1).view(torch.uint8) if out.numel() else out.view(torch.uint8)
            with open(path, "rb") as f:
                f.seek(self._data_start[path] + start)
                got = f.readinto(memoryview(view.numpy()))
            if got != end - start:
                raise CheckpointError(f"tensor {key!r} in {path}: read {got} of {end - start} bytes (truncated?)")
            return out
        from safetensors import safe_open

        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error type
                raise CheckpointError(f"tensor {key!r}: cannot open {path}: {e}") from e
        try:
            return self._handles[path].get_slice(key)[index]
        except Exception as e:
            raise CheckpointError(f"tensor {key!r} in {path}: cannot read ({e})") from e


def _detect_scheme(ckpt: _Checkpoint, cfg: ModelConfig) -> str:
    names = [n for n in expected_tensors(cfg, include_mtp=False) if expert_of(n) is None]
    hits = {
        "official": sum(n in ckpt for n in names),
        "hf": sum(to_hf_name(n) in ckpt for n in names),
        "hf_saved": sum(to_hf_saved_name(n) in ckpt for n in names),
    }
    best = max(hits, key=hits.get)
    if hits[best] == 0:
        raise CheckpointError(f"{ckpt.source}: none of the expected DeepSeek-V4 tensors found (e.g. 'embed.weight', "
                              f"'model.embed_tokens.weight'); first keys: {sorted(ckpt.where)[:5]}")
    return best


# ---- loading ---------------------------------------------------------------------------------------------------
def _dir_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.exists():
        raise CheckpointError(f"{model_dir}: no config.json")
    try:
        return ModelConfig.from_json(path)
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from e


def _wanted(cfg: ModelConfig, layers: Iterable[int] | None, experts: Iterable[int] | Callable[[int], bool] | None,
            include_mtp: bool) -> dict[str, tuple[int, ...]]:
    layer_set = None if layers is None else {int(x) for x in layers}
    if layer_set is not None and any(not 0 <= x < cfg.n_layers for x in layer_set):
        raise ValueError(f"layers {sorted(layer_set)} outside [0, {cfg.n_layers})")
    if experts is None or callable(experts):
        expert_ok = experts or (lambda e: True)
    else:
        expert_set = {int(x) for x in experts}
        expert_ok = expert_set.__contains__
    out = {}
    for name, shape in expected_tensors(cfg, include_mtp=include_mtp).items():
        block, idx, _ = split_name(name)
        if block == "layers" and layer_set is not None and idx not in layer_set:
            continue
        ex = expert_of(name)
        if ex is not None and not expert_ok(ex[0]):
            continue
        out[name] = shape
    return out


# Quantised in the checkpoint but always dequantised at load, as the official convert.py does: wo_a runs in a
# grouped bf16 einsum (and the grouped wo_a kernel takes a dense weight). Under `weights=stored` an fp32 model holds
# it as bf16 (every FP8 x UE8M0 value is exact there; checked): half the bytes a decode step reads, same values.
DEQUANT_ALWAYS = ("attn.wo_a.weight",)


def keeps_stored(name: str) -> bool:
    """Under `weights=stored`, whether a quantised tensor stays as its bytes (else it is dequantised at load)."""
    return not name.endswith(DEQUANT_ALWAYS)


def _dequant(ckpt: _Checkpoint, name: str, key: str, shape: tuple[int, ...], dtype: torch.dtype,
             stored: bool = False) -> torch.Tensor | tuple[str, torch.Tensor, torch.Tensor]:
    """Read official tensor `name` stored under `key` and return it dequantised: fp32 for the spec's fp32 tensors,
    int64 for tid2eid, `dtype` for everything else. With `stored`, an FP8/FP4 weight comes back as it is stored:
    ("fp8" | "fp4", weight bytes uint8, scale bytes uint8) - zero-copy views of what was read."""
    path = ckpt.where[key]
    where = f"tensor {name!r} (stored as {key!r} in {path})"
    st_dtype, st_shape = ckpt.info(key)
    fmt = _fixed_format(name)
    if fmt == "i64":
        if st_dtype not in ("I64", "I32"):
            raise CheckpointError(f"{where}: dtype {st_dtype}, expected I64 (or I32)")
        if st_shape != shape:
            raise CheckpointError(f"{where}: shape {list(st_shape)}, expected {list(shape)}")
        return ckpt.read(key).to(torch.int64)
    out_dtype = torch.float32 if fmt == "fp32" else dtype
    if st_dtype in _FLOATS:
        if st_shape != shape:
            raise CheckpointError(f"{where}: shape {list(st_shape)}, expected {list(shape)}")
        t = ckpt.read(key)
        return t if stored and fmt != "fp32" else t.to(out_dtype)  # stored: float tensors as they are
    quantisable = len(shape) == 2 and name.endswith(".weight")
    if st_dtype not in ("F8_E4M3", "I8", "U8") or not quantisable:
        allowed = ", ".join(_FLOATS + (("F8_E4M3 + .scale", "I8 (FP4) + .scale") if quantisable else ()))
        raise CheckpointError(f"{where}: dtype {st_dtype} not allowed here (expected {allowed})")
    scale_key = next((k for k in (_scale_name(key), key + "_scale_inv") if k in ckpt), None)
    if scale_key is None:
        raise CheckpointError(f"{where}: {st_dtype} weight without its scale {_scale_name(key)!r}")
    sc_dtype, sc_shape = ckpt.info(scale_key)
    out_f, in_f = shape
    if st_dtype == "F8_E4M3":
        want_w, want_s = shape, (math.ceil(out_f / FP8_BLOCK), math.ceil(in_f / FP8_BLOCK))
    else:
        want_w, want_s = (out_f, in_f // 2), (out_f, in_f // FP4_BLOCK)
    if st_shape != want_w:
        raise CheckpointError(f"{where}: {st_dtype} shape {list(st_shape)}, expected {list(want_w)} "
                              f"(logical {list(shape)})")
    if sc_dtype != "F8_E8M0" or sc_shape != want_s:
        raise CheckpointError(f"{where}: scale {scale_key!r} in {ckpt.where[scale_key]} is {sc_dtype}"
                              f"{list(sc_shape)}, expected F8_E8M0{list(want_s)}")
    w, s = ckpt.read(key), ckpt.read(scale_key)
    if stored and keeps_stored(name):
        return ("fp8" if st_dtype == "F8_E4M3" else "fp4"), as_bytes(w), as_bytes(s)
    if st_dtype == "F8_E4M3":
        dense = dequant_fp8_block(w, s, out_dtype)
        if stored and out_dtype == torch.float32:  # DEQUANT_ALWAYS: held as bf16 (as convert.py does) where exact
            narrow = dense.to(torch.bfloat16)  # e4m3 x 2^k: exact in bf16 unless below 2^-133
            return narrow if torch.equal(narrow.float(), dense) else dense
        return dense
    return dequant_fp4(w, s, out_dtype)


def _read_hf_expert(ckpt: _Checkpoint, name: str, cfg: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
    block, layer, _ = split_name(name)
    e, w = expert_of(name)
    inter = cfg.moe_inter_dim
    key = f"model.layers.{layer}.{HF_DOWN if w == 'w2' else HF_GATE_UP}"
    if key not in ckpt:
        raise CheckpointError(f"tensor {name!r}: stacked HF tensor {key!r} not found in {ckpt.source}")
    st_dtype, st_shape = ckpt.info(key)
    want = ((cfg.n_routed_experts, cfg.dim, inter) if w == "w2"
            else (cfg.n_routed_experts, 2 * inter, cfg.dim))
    where = f"tensor {name!r} (stored in {key!r} in {ckpt.where[key]})"
    if st_dtype not in _FLOATS:
        raise CheckpointError(f"{where}: dtype {st_dtype}, expected one of {', '.join(_FLOATS)}")
    if st_shape != want:
        raise CheckpointError(f"{where}: shape {list(st_shape)}, expected {list(want)}")
    rows = {"w1": slice(0, inter), "w3": slice(inter, 2 * inter), "w2": slice(None)}[w]
    return ckpt.read(key, (e, rows)).to(dtype)


def load_checkpoint(model_dir: str | Path, cfg: ModelConfig | None = None, *, dtype: torch.dtype = torch.float32,
                    layers: Iterable[int] | None = None,
                    experts: Iterable[int] | Callable[[int], bool] | None = None,
                    include_mtp: bool = True, strict: bool = True, stored: bool = False) -> dict[str, torch.Tensor]:
    """Load a DeepSeek-V4 checkpoint directory into a dict keyed by **official** names.

    Args:
        model_dir: directory with `config.json` and `model.safetensors` or `model.safetensors.index.json` + shards,
            in official, HF-module or HF-`save_pretrained` naming (detected).
        cfg: the model config (the engine passes the one its EngineConfig parsed); None reads
            `model_dir/config.json`. Every tensor is checked against the shapes this config implies.
        dtype: dtype of the returned weights. FP8/FP4 are dequantised exactly. The tensors the spec keeps in
            fp32 (`hc_*`, `attn_sink`, `ape`, `gate.bias`) are always float32, `tid2eid` int64.
        layers: main-layer ids to load (None = all). Global tensors (embed, head, norm, hc_head_*) always load.
        experts: routed-expert ids to load, as an iterable or a predicate `f(expert_id) -> bool` (None = all).
        include_mtp: also load `mtp.*` (official checkpoints only; HF spellings have no MTP and skip it).
        strict: on a full load (no `layers`/`experts` subset), tensors in the checkpoint that nothing consumed
            are an error.
        stored: keep FP8 / FP4 weights as stored - `<name>` = the weight's bytes (uint8: e4m3 codes [out, in], or
            packed e2m1 [out, in/2]) and `<name[:-7]>.scale` = its UE8M0 scale bytes (uint8) - instead of
            dequantising them (`stored_formats` says which; `DEQUANT_ALWAYS` are dequantised anyway), and float
            tensors in their stored dtype (`dtype` is not applied). Nothing is widened: what stays in memory is
            the checkpoint's bytes.

    Returns: {official name: tensor with the logical shape of `expected_tensors(cfg)`}.
    Raises: CheckpointError naming the tensor and the file (missing/mis-shaped/mis-typed tensor, missing scale,
        truncated or corrupt file, missing shard, missing config.json).
    """
    model_dir = Path(model_dir)
    cfg = cfg if cfg is not None else _dir_config(model_dir)
    ckpt = _Checkpoint(model_dir)
    scheme = _detect_scheme(ckpt, cfg)
    if scheme != "official":
        include_mtp = False
    wanted = _wanted(cfg, layers, experts, include_mtp)
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for name, shape in wanted.items():
        if scheme == "hf" and expert_of(name) is not None:
            out[name] = _read_hf_expert(ckpt, name, cfg, dtype)
            used.update(k for k in ckpt.where if k.endswith((HF_GATE_UP, HF_DOWN)))
            continue
        key = {"official": name, "hf": to_hf_name(name), "hf_saved": to_hf_saved_name(name)}[scheme]
        if key is None or key not in ckpt:
            raise CheckpointError(f"tensor {name!r} (looked for {key!r}, {scheme} naming) missing from {ckpt.source}")
        got = _dequant(ckpt, name, key, shape, dtype, stored)
        if isinstance(got, tuple):
            _, out[name], out[_scale_name(name)] = got
        else:
            out[name] = got
        used.update((key, _scale_name(key), key + "_scale_inv"))
    if strict and layers is None and experts is None:
        extra = sorted(k for k in ckpt.where if k not in used
                       and not ((scheme != "official" or not include_mtp) and k.startswith("mtp.")))
        if extra:
            raise CheckpointError(f"{ckpt.source}: {len(extra)} unexpected tensors for this config, e.g. "
                                  f"{extra[:5]} (in {ckpt.where[extra[0]]}); pass strict=False to ignore")
    return out


def stored_formats(model_dir: str | Path, cfg: ModelConfig, include_mtp: bool = False) -> dict[str, str]:
    """{official weight name: "fp8" | "fp4"} for every weight the checkpoint stores quantised and a `weights=stored`
    load keeps as bytes (headers only, nothing read). Empty for an HF-named (float) checkpoint."""
    ckpt = _Checkpoint(Path(model_dir))
    if _detect_scheme(ckpt, cfg) != "official":
        return {}
    out = {}
    for name in expected_tensors(cfg, include_mtp=include_mtp):
        if name in ckpt and keeps_stored(name):
            st_dtype = ckpt.info(name)[0]
            if st_dtype == "F8_E4M3":
                out[name] = "fp8"
            elif st_dtype in ("I8", "U8"):
                out[name] = "fp4"
    return out


def save_safetensors(tensors: dict[str, torch.Tensor], model_dir: str | Path, num_shards: int = 1) -> None:
    """Write `tensors` as `model.safetensors`, or as `num_shards` shards plus `model.safetensors.index.json`
    (a tensor and its `.scale` stay in the same shard)."""
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if num_shards <= 1:
        save_file(tensors, str(model_dir / SINGLE_FILE), metadata={"format": "pt"})
        return
    groups: dict[str, list[str]] = {}
    for k in tensors:
        base = k[: -len(".scale")] + ".weight" if k.endswith(".scale") and k[: -6] + ".weight" in tensors else k
        groups.setdefault(base, []).append(k)
    keys = list(groups)
    per = math.ceil(len(keys) / num_shards)
    weight_map = {}
    for i in range(num_shards):
        fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        shard = {k: tensors[k] for base in keys[i * per:(i + 1) * per] for k in groups[base]}
        save_file(shard, str(model_dir / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (model_dir / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                   indent=1))
