"""golden/tiny-official and the official golden (golden/official/) are consistent with each other, with the shapes the
official simulation needs, and readable by the engine's loaders (no engine run, no official code needed).
Regenerate with `python golden/make_tiny_official.py` and `python golden/make_official_golden.py --official-src DIR`
(golden/README.md)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
MODEL = GOLDEN / "tiny-official"
OFFICIAL = GOLDEN / "official"
REGEN = "regenerate with golden/make_official_golden.py (golden/README.md)"


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig.from_json(MODEL / "config.json")


@pytest.fixture(scope="module")
def meta() -> dict:
    return json.loads((OFFICIAL / "golden.json").read_text())


GOLDENS = [(OFFICIAL, "official"), (GOLDEN / "official-fp32", "official-sim-fp32")]


def test_model_has_the_shapes_the_official_simulation_needs(cfg):
    from golden.make_tiny_official import OFFICIAL_TINY_CONFIG, official_shape_errors

    assert cfg == OFFICIAL_TINY_CONFIG, "golden/tiny-official/config.json differs from make_tiny_official.py"
    assert official_shape_errors(cfg) == []
    assert cfg.index_topk < 20 and {0, 4} < set(cfg.compress_ratios) and max(cfg.compress_ratios) > 4
    assert 0 < cfg.n_hash_layers < cfg.n_layers and cfg.dtype == "fp8" and cfg.expert_dtype == "fp4"
    bad = official_shape_errors(ModelConfig.from_json(GOLDEN / "tiny" / "config.json"))
    assert any("multiple of 64" in e for e in bad)  # the default tiny model cannot run the official simulation


def test_checkpoint_loads_strictly_in_the_official_format(cfg):
    from engine.loader import load_checkpoint, stored_formats

    sd = load_checkpoint(MODEL, cfg)
    assert sd["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    for name in ("layers.1.attn.attn_sink", "layers.1.attn.compressor.ape", "layers.2.ffn.gate.bias",
                 "layers.0.hc_attn_base", "layers.0.ffn.gate.tid2eid"):
        assert float(sd[name].float().abs().sum()) > 0, f"{name} is zero: every parameter must be random"
    formats = stored_formats(MODEL, cfg)
    assert formats["layers.0.attn.wq_a.weight"] == "fp8" and formats["layers.0.ffn.experts.0.w1.weight"] == "fp4"


def test_generator_converts_the_checkpoint_as_convert_py_does(cfg):
    from golden.make_official_golden import official_state_dict

    sd = official_state_dict(MODEL, cfg)
    assert sd["layers.0.attn.wo_a.weight"].dtype == torch.bfloat16 and "layers.0.attn.wo_a.scale" not in sd
    assert sd["layers.0.ffn.experts.3.w2.weight"].dtype == torch.float4_e2m1fn_x2
    assert sd["layers.0.attn.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert sd["layers.0.attn.wq_b.scale"].dtype == torch.float8_e8m0fnu


@pytest.mark.parametrize("golden_dir,numerics", GOLDENS)
def test_meta_matches_the_model_and_the_loader(golden_dir, numerics, cfg):
    from deepinfer_bench.bench.golden import load_golden

    meta = json.loads((golden_dir / "golden.json").read_text())
    assert meta["magic"] == "deepinfer-golden" and meta["format_version"] == 1 and meta["numerics"] == numerics
    assert meta["config_hash"] == cfg.config_hash(), f"golden/tiny-official config changed: {REGEN}"
    digest = hashlib.sha256((MODEL / "model.safetensors").read_bytes()).hexdigest()
    assert meta["model_sha256"] == digest, f"golden/tiny-official weights changed: {REGEN}"
    src = meta["official_source"]
    assert len(src["model_py_sha256"]) == 64 and src["model_py_revision"] != "unknown revision"
    loaded_meta, prompts = load_golden(golden_dir, cfg)
    assert loaded_meta == meta and len(prompts) == len(meta["prompts"])
    for p in prompts:
        assert p.logits.dtype == torch.float32 and p.logits.shape == (len(p.output_ids), cfg.vocab_size)
        assert p.output_ids == p.logits.argmax(dim=-1).tolist()
        top2 = p.logits.topk(2, dim=-1).values
        assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-3, f"{p.name}: near tie in the golden logits"


@pytest.mark.parametrize("golden_dir", [d for d, _ in GOLDENS])
def test_same_prompts_as_the_hf_golden(golden_dir):
    """The official goldens run the HF golden's prompt set (same tokenizer, same raw-id draws)."""
    meta = json.loads((golden_dir / "golden.json").read_text())
    hf = json.loads((GOLDEN / "golden.json").read_text())
    assert [(p["name"], p["prompt_ids"], p["max_new_tokens"]) for p in meta["prompts"]] == \
        [(p["name"], p["prompt_ids"], p["max_new_tokens"]) for p in hf["prompts"]]
    assert (MODEL / "tokenizer.json").read_bytes() == (GOLDEN / "tiny" / "tokenizer.json").read_bytes()


def test_the_indexer_really_selects(meta, cfg):
    """Prompts long enough that CSA entries outnumber index_topk (selection), and HCA entries form."""
    lens = [p["prompt_len"] for p in meta["prompts"]]
    assert max(lens) // 4 > 4 * cfg.index_topk and max(lens) // max(cfg.compress_ratios) >= 16
    assert meta["topk_rows"]["indexer"] > 1000 and meta["topk_rows"]["router"] > 1000
    assert meta["topk_rule"].startswith("ties at the top-k boundary broken by the lower index")


def test_official_golden_differs_from_the_fp32_staging_golden(meta):
    """The bf16 roundings matter: the official golden and its fp32 counterpart are different data."""
    from safetensors.torch import load_file

    a, b = load_file(str(OFFICIAL / "golden.safetensors")), load_file(str(GOLDEN / "official-fp32" /
                                                                           "golden.safetensors"))
    assert set(a) == set(b)
    assert any(not torch.equal(a[k], b[k]) for k in a if k.endswith(".output_ids"))
