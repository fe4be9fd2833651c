"""engine/loader.py: the official <-> HF name table, expected tensors, and loading of every checkpoint spelling."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine import loader
from engine.config import ModelConfig
from engine.loader import (
    CheckpointError,
    expected_tensors,
    load_checkpoint,
    official_format,
    official_to_hf,
    save_safetensors,
    to_official_format,
)
from tests.test_config import FLASH_OFFICIAL  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "golden" / "tiny"



@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig.from_json(TINY)


@pytest.fixture(scope="module")
def tiny_sd(cfg) -> dict[str, torch.Tensor]:
    return load_checkpoint(TINY, cfg)


@pytest.fixture(scope="module")
def official_tensors() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(TINY / "model.safetensors"))


def _write(dirpath: Path, tensors: dict[str, torch.Tensor], num_shards: int = 1) -> Path:
    dirpath.mkdir(parents=True, exist_ok=True)
    shutil.copy(TINY / "config.json", dirpath / "config.json")
    save_safetensors(tensors, dirpath, num_shards=num_shards)
    return dirpath


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# ---- expected tensors and formats -----------------------------------------------------------------------------
def test_expected_tensors_flash_matches_released_checkpoint():
    cfg = ModelConfig.from_dict(FLASH_OFFICIAL)
    names = expected_tensors(cfg)
    stored = len(names) + sum(official_format(n, cfg) in ("fp8", "fp4") for n in names)
    assert stored == 69187  # tensor count of the released DeepSeek-V4-Flash safetensors (46 shards)
    assert names["layers.2.attn.compressor.ape"] == (4, 1024)
    assert names["layers.3.attn.compressor.ape"] == (128, 512)
    assert names["layers.2.attn.indexer.compressor.wkv.weight"] == (256, 4096)
    assert names["layers.2.ffn.gate.tid2eid"] == (129280, 6) and "layers.3.ffn.gate.tid2eid" not in names
    assert names["layers.3.ffn.gate.bias"] == (256,) and "layers.2.ffn.gate.bias" not in names
    assert names["layers.0.attn.wo_a.weight"] == (8192, 4096)
    assert names["layers.42.ffn.experts.255.w2.weight"] == (4096, 2048)
    assert names["mtp.0.e_proj.weight"] == (4096, 4096) and names["mtp.0.ffn.gate.bias"] == (256,)
    assert not any(n.startswith("mtp.0.attn.compressor") for n in names)
    assert names["hc_head_fn"] == (4, 16384) and names["layers.0.hc_attn_fn"] == (24, 16384)
    fmt = {n: official_format(n, cfg) for n in ("layers.0.attn.wq_a.weight", "layers.0.ffn.experts.3.w1.weight",
                                                "layers.2.attn.indexer.weights_proj.weight", "layers.0.attn.attn_sink",
                                                "layers.0.ffn.gate.tid2eid", "mtp.0.h_proj.weight", "embed.weight",
                                                "layers.3.attn.compressor.ape", "layers.3.ffn.gate.bias")}
    assert list(fmt.values()) == ["fp8", "fp4", "bf16", "fp32", "i64", "fp8", "bf16", "fp32", "fp32"]


def test_tiny_checkpoint_is_in_official_format(cfg, official_tensors):
    for name in expected_tensors(cfg):
        fmt = official_format(name, cfg)
        t = official_tensors[name]
        want = {"fp8": torch.float8_e4m3fn, "fp4": torch.int8, "bf16": torch.bfloat16, "fp32": torch.float32,
                "i64": torch.int64}[fmt]
        assert t.dtype == want, name
        if fmt in ("fp8", "fp4"):
            assert official_tensors[name[: -len(".weight")] + ".scale"].dtype == torch.float8_e8m0fnu, name


def test_tiny_loads_dequantised(cfg, tiny_sd, official_tensors, tmp_path):
    assert list(tiny_sd) == list(expected_tensors(cfg))
    for name, shape in expected_tensors(cfg).items():
        t = tiny_sd[name]
        assert tuple(t.shape) == shape, name
        fixed = official_format(name, cfg)
        assert t.dtype == {"i64": torch.int64}.get(fixed, torch.float32), name
    # the dequantised weights are exactly representable: quantising them again and loading gives them back
    d = _write(tmp_path / "again", to_official_format(tiny_sd, cfg))
    _same(load_checkpoint(d, cfg), tiny_sd)
    bf16 = load_checkpoint(TINY, cfg, dtype=torch.bfloat16, layers=[0], experts=[0])
    assert bf16["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16
    assert torch.equal(bf16["layers.0.attn.wq_a.weight"].float(), tiny_sd["layers.0.attn.wq_a.weight"])  # exact
    assert bf16["layers.0.hc_attn_fn"].dtype == torch.float32 and bf16["layers.0.attn.attn_sink"].dtype == torch.float32


# ---- HF names -------------------------------------------------------------------------------------------------
@pytest.mark.reference
def test_name_table_matches_hf_model_and_its_save_format(cfg, tiny_sd, tmp_path):
    pytest.importorskip("transformers")
    from deepinfer_bench.bench.hf_reference import build_hf_model

    model = build_hf_model(cfg, tiny_sd)  # strict: every HF key comes from the table
    hf_sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert set(hf_sd) == set(official_to_hf(tiny_sd, cfg))
    no_mtp = {k: v for k, v in tiny_sd.items() if not k.startswith("mtp.")}

    # HF module names with stacked experts
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    model.config.save_pretrained(hf_dir)
    save_safetensors(hf_sd, hf_dir)
    _same(load_checkpoint(hf_dir, cfg), no_mtp)

    # transformers' own save_pretrained() (its reverse conversion mapping)
    saved = tmp_path / "hf_saved"
    model.save_pretrained(saved)
    _same(load_checkpoint(saved, cfg), no_mtp)
    one = load_checkpoint(saved, cfg, layers=[1], experts=[5])
    assert torch.equal(one["layers.1.ffn.experts.5.w3.weight"], tiny_sd["layers.1.ffn.experts.5.w3.weight"])


def test_hf_stacked_experts_read_per_expert(cfg, tiny_sd, tmp_path, monkeypatch):
    hf_dir = _write(tmp_path / "hf", {k: v.contiguous() for k, v in official_to_hf(tiny_sd, cfg).items()})
    reads = []
    orig = loader._Checkpoint.read
    monkeypatch.setattr(loader._Checkpoint, "read", lambda self, key, index=None: reads.append((key, index))
                        or orig(self, key, index))
    got = load_checkpoint(hf_dir, cfg, layers=[2], experts=[3])
    assert torch.equal(got["layers.2.ffn.experts.3.w1.weight"], tiny_sd["layers.2.ffn.experts.3.w1.weight"])
    assert torch.equal(got["layers.2.ffn.experts.3.w3.weight"], tiny_sd["layers.2.ffn.experts.3.w3.weight"])
    assert torch.equal(got["layers.2.ffn.experts.3.w2.weight"], tiny_sd["layers.2.ffn.experts.3.w2.weight"])
    stacked = [(k, i) for k, i in reads if k.endswith(("gate_up_proj", "down_proj"))]
    assert stacked and all(i is not None and i[0] == 3 for _, i in stacked)  # slices of expert 3 only


# ---- sharding and subsets -------------------------------------------------------------------------------------
def test_sharded_index_and_subset_reads_only_requested(cfg, tiny_sd, official_tensors, tmp_path, monkeypatch):
    d = _write(tmp_path / "sharded", official_tensors, num_shards=4)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 4
    _same(load_checkpoint(d, cfg), tiny_sd)

    reads = []
    orig = loader._Checkpoint.read
    monkeypatch.setattr(loader._Checkpoint, "read", lambda self, key, index=None: reads.append(key)
                        or orig(self, key, index))
    sub = load_checkpoint(d, cfg, layers=[1], experts=lambda e: e in (0, 7), include_mtp=False)
    want = {n for n in expected_tensors(cfg, include_mtp=False)
            if not n.startswith("layers.") or (n.startswith("layers.1.") and (".experts." not in n or
                                                                            ".experts.0." in n or ".experts.7." in n))}
    assert set(sub) == want
    for k in sub:
        assert torch.equal(sub[k], tiny_sd[k]), k
    allowed = want | {n[: -len(".weight")] + ".scale" for n in want}
    assert reads and set(reads) <= allowed

    # a shard the subset does not need may be absent; the full load names it
    needed = {index["weight_map"][k] for k in reads}
    spare = sorted(set(index["weight_map"].values()) - needed)
    assert spare
    (d / spare[0]).unlink()
    load_checkpoint(d, cfg, layers=[1], experts=[0, 7], include_mtp=False)
    with pytest.raises(CheckpointError, match=spare[0]) as e:
        load_checkpoint(d, cfg)
    assert "tensor '" in str(e.value)


# ---- errors ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case, tensor", [
    ("missing", "layers.1.attn.wq_b.weight"),
    ("shape", "layers.0.attn_norm.weight"),
    ("dtype", "layers.0.ffn.gate.tid2eid"),
    ("dtype_norm", "layers.2.ffn_norm.weight"),
    ("scale", "layers.3.ffn.shared_experts.w2.weight"),
    ("scale_shape", "layers.2.ffn.experts.1.w1.weight"),
])
def test_bad_tensor_errors_name_tensor_and_file(cfg, official_tensors, tmp_path, case, tensor):
    t = dict(official_tensors)
    if case == "missing":
        del t[tensor]
    elif case == "shape":
        t[tensor] = t[tensor][:-1].clone()
    elif case == "dtype":
        t[tensor] = t[tensor].float()
    elif case == "dtype_norm":
        t[tensor] = t[tensor].to(torch.int32)
    elif case == "scale":
        del t[tensor[: -len(".weight")] + ".scale"]
    elif case == "scale_shape":
        k = tensor[: -len(".weight")] + ".scale"
        t[k] = t[k][:, :1].clone()
    d = _write(tmp_path / case, t)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(d, cfg)
    msg = str(e.value)
    assert tensor in msg and "model.safetensors" in msg, msg


def test_truncated_and_corrupt_files(cfg, official_tensors, tmp_path):
    d = _write(tmp_path / "trunc", official_tensors)
    f = d / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(raw[:-1000])
    with pytest.raises(CheckpointError, match=r"truncated file: tensor '.+'") as e:
        load_checkpoint(d, cfg)
    assert str(f) in str(e.value)
    f.write_bytes(raw[:4])
    with pytest.raises(CheckpointError, match="truncated safetensors file"):
        load_checkpoint(d, cfg)
    f.write_bytes(raw[:100])
    with pytest.raises(CheckpointError, match="truncated safetensors header"):
        load_checkpoint(d, cfg)
    f.write_bytes(raw[:8] + b"\xff" * (len(raw) - 8))
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        load_checkpoint(d, cfg)


def test_directory_errors(cfg, official_tensors, tmp_path):
    d = _write(tmp_path / "noconf", official_tensors)
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(d)  # without a config the directory's config.json is read
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(TINY / "config.json", empty / "config.json")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_checkpoint(empty, cfg)
    other = ModelConfig.from_dict({**cfg.to_official_json(), "moe_inter_dim": 32})
    with pytest.raises(CheckpointError, match=r"experts\.0\.w1\.weight.*shape \[64, 64\], expected \[32, 64\]"):
        load_checkpoint(TINY, other)  # a config that does not describe the checkpoint: the first tensor that differs
    extra = dict(official_tensors, **{"layers.0.attn.bogus": torch.zeros(2)})
    d2 = _write(tmp_path / "extra", extra)
    with pytest.raises(CheckpointError, match="layers.0.attn.bogus"):
        load_checkpoint(d2, cfg)
    assert "layers.0.attn.bogus" not in load_checkpoint(d2, cfg, strict=False)
