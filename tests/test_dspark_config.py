"""DSpark's config fields (engine/model_config.py) and checkpoint layout (engine/loader.py): parsed from either
spelling, validated, left out of MTP configs' hash, and loaded strictly under `mtp.*` in the released formats."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import ConfigError, ModelConfig
from engine.loader import expected_tensors, load_checkpoint, official_format, save_safetensors, to_official_format
from engine.model.dummy import random_weights

MTP = ModelConfig(vocab_size=256, dim=64, n_layers=3, n_mtp_layers=1, compress_ratios=(0, 4, 16, 0),
                  n_hash_layers=1, n_heads=4, head_dim=32, rope_head_dim=8, q_lora_rank=32, o_groups=2,
                  o_lora_rank=16, window_size=8, n_routed_experts=4, n_activated_experts=2, moe_inter_dim=32,
                  index_n_heads=16, index_head_dim=32, index_topk=2, max_position_embeddings=512)
DS = {"dspark_block_size": 5, "dspark_noise_token_id": 7, "dspark_target_layer_ids": [0, 1, 2],
      "dspark_markov_rank": 16}


def _official(**changes) -> dict:
    d = MTP.to_official_json()
    d.update(n_mtp_layers=3, compress_ratios=[0, 4, 16, 0, 0, 0], **DS)
    d.update(changes)
    return d


def test_official_spelling_parses_and_round_trips() -> None:
    cfg = ModelConfig.from_dict(_official())
    assert cfg.has_dspark and cfg.n_mtp_layers == 3 and cfg.dspark_target_layer_ids == (0, 1, 2)
    assert ModelConfig.from_dict(cfg.to_official_json()) == cfg
    assert cfg.config_hash() != dataclasses.replace(cfg, dspark_markov_rank=32).config_hash()


def test_hf_spelling_counts_stages_from_compress_ratios() -> None:
    """The 0731 HF config.json keeps num_nextn_predict_layers = 1 and lists 43 + 3 compress ratios."""
    hf = {"hidden_size": 64, "num_hidden_layers": 3, "num_nextn_predict_layers": 1, **DS,
          **{k: v for k, v in _official().items() if k not in ("dim", "n_layers", "n_mtp_layers")}}
    assert ModelConfig.from_dict(hf).n_mtp_layers == 3
    plain = {k: v for k, v in hf.items() if not k.startswith("dspark")}
    plain["compress_ratios"] = [0, 4, 16, 0]
    assert ModelConfig.from_dict(plain).n_mtp_layers == 1  # an MTP config is untouched


def test_mtp_configs_keep_their_hash_and_json() -> None:
    assert "dspark_block_size" not in MTP.to_official_json()
    # the hash of a config written before the DSpark fields existed (golden/tiny's, pinned in golden/golden.json)
    import json
    from pathlib import Path

    golden = Path(__file__).resolve().parent.parent / "golden"
    assert ModelConfig.from_json(golden / "tiny").config_hash() == json.loads((golden / "golden.json").read_text())[
        "config_hash"]


@pytest.mark.parametrize(("changes", "message"), [
    ({"dspark_block_size": 0}, "without dspark_block_size"),
    ({"compress_ratios": [0, 4, 16, 0, 4, 0]}, "dense window"),
    ({"dspark_target_layer_ids": [2, 1]}, "strictly increasing"),
    ({"dspark_target_layer_ids": [1, 3]}, "strictly increasing"),
    ({"dspark_target_layer_ids": []}, "strictly increasing"),
    ({"dspark_markov_rank": 0}, "dspark_markov_rank"),
    ({"dspark_noise_token_id": 256}, "outside the vocabulary"),
    ({"dspark_markov_head_type": "rnn"}, "dspark_markov_head_type"),
    ({"dspark_stages": 3}, "unknown config keys: dspark_stages"),
])
def test_bad_dspark_configs_are_one_line_errors(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(_official(**changes))


def test_dspark_checkpoint_layout_loads_strictly(tmp_path) -> None:
    cfg = ModelConfig.from_dict(_official())
    names = expected_tensors(cfg)
    draft = [n for n in names if n.startswith("mtp.")]
    assert "mtp.0.main_proj.weight" in names and "mtp.1.main_proj.weight" not in names
    assert names["mtp.0.main_proj.weight"] == (64, 3 * 64)
    for head in ("norm.weight", "hc_head_fn", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                 "confidence_head.proj.weight"):
        assert f"mtp.2.{head}" in names and f"mtp.0.{head}" not in names
    assert names["mtp.2.markov_head.markov_w2.weight"] == (256, 16)
    assert names["mtp.2.confidence_head.proj.weight"] == (1, 64 + 16)
    assert not any("e_proj" in n or "compressor" in n for n in draft)
    assert official_format("mtp.0.main_proj.weight", cfg) == "fp8"
    assert official_format("mtp.2.markov_head.markov_w1.weight", cfg) == "bf16"
    assert official_format("mtp.2.hc_head_fn", cfg) == "fp32"
    w = random_weights(cfg, seed=0)
    save_safetensors(to_official_format(w, cfg), tmp_path)
    (tmp_path / "config.json").write_text(__import__("json").dumps(cfg.to_official_json()))
    got = load_checkpoint(tmp_path, dtype=torch.float32)
    assert set(got) == set(names)
    assert (got["mtp.2.markov_head.markov_w1.weight"] - w["mtp.2.markov_head.markov_w1.weight"]).abs().max() < 0.05
    main = load_checkpoint(tmp_path, cfg, dtype=torch.float32, include_mtp=False)  # the main model alone
    assert not any(n.startswith("mtp.") for n in main)


def test_committed_tiny_dspark_is_tiny_plus_a_dspark_head() -> None:
    """golden/tiny-dspark (golden/train_draft_heads.py): tiny's main tensors byte for byte, a DSpark head under
    mtp.*, loadable strictly by its own config."""
    from pathlib import Path

    from safetensors.torch import load_file

    golden = Path(__file__).resolve().parent.parent / "golden"
    cfg = ModelConfig.from_json(golden / "tiny-dspark")
    tiny = ModelConfig.from_json(golden / "tiny")
    assert cfg.has_dspark and cfg.n_mtp_layers == 2 and cfg.dspark_block_size == 5
    assert dataclasses.replace(cfg, n_mtp_layers=1, compress_ratios=cfg.compress_ratios[:5], dspark_block_size=0,
                               dspark_noise_token_id=0, dspark_target_layer_ids=(), dspark_markov_rank=0) == tiny
    a, b = load_file(str(golden / "tiny" / "model.safetensors")), load_file(str(golden / "tiny-dspark" /
                                                                              "model.safetensors"))
    main = [k for k in a if not k.startswith("mtp.")]
    assert main and all(k in b and a[k].dtype == b[k].dtype and a[k].view(torch.uint8).equal(b[k].view(torch.uint8))
                        for k in main)
    assert set(load_checkpoint(golden / "tiny-dspark", cfg, dtype=torch.float32)) == set(expected_tensors(cfg))
