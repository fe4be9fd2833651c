"""engine/config.py: both spellings of the real DeepSeek-V4-Flash config, and rejection of bad configs."""

from __future__ import annotations

import json

import pytest

from engine.config import ConfigError, ModelConfig

FLASH_HF = {  # DeepSeek-V4-Flash config.json (model repo root, current revision with expert_dtype)
    "architectures": ["DeepseekV4ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
    "eos_token_id": 1, "hc_eps": 1e-06, "hc_mult": 4, "hc_sinkhorn_iters": 20, "head_dim": 512,
    "hidden_act": "silu", "hidden_size": 4096, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 512,
    "initializer_range": 0.02, "max_position_embeddings": 1048576, "model_type": "deepseek_v4",
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 64, "num_experts_per_tok": 6, "num_hidden_layers": 43, "num_hash_layers": 3,
    "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": 8, "o_lora_rank": 1024,
    "q_lora_rank": 1024, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "sliding_window": 128,
    "swiglu_limit": 10.0, "tie_word_embeddings": False, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1", "use_cache": True, "vocab_size": 129280, "compress_rope_theta": 160000,
    "expert_dtype": "fp4", "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}
FLASH_OFFICIAL = {  # DeepSeek-V4-Flash inference/config.json
    "vocab_size": 129280, "dim": 4096, "moe_inter_dim": 2048, "n_layers": 43, "n_hash_layers": 3, "n_heads": 64,
    "n_routed_experts": 256, "n_shared_experts": 1, "n_activated_experts": 6, "score_func": "sqrtsoftplus",
    "route_scale": 1.5, "swiglu_limit": 10.0, "q_lora_rank": 1024, "head_dim": 512, "rope_head_dim": 64,
    "o_groups": 8, "o_lora_rank": 1024, "window_size": 128, "original_seq_len": 65536, "rope_theta": 10000,
    "rope_factor": 16, "beta_fast": 32, "beta_slow": 1, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20, "dtype": "fp8", "scale_fmt": "ue8m0",
    "expert_dtype": "fp4", "compress_rope_theta": 160000, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}


def test_flash_hf_and_official_spellings_agree(tmp_path):
    (tmp_path / "hf.json").write_text(json.dumps(FLASH_HF))
    (tmp_path / "official.json").write_text(json.dumps(FLASH_OFFICIAL))
    hf = ModelConfig.from_json(tmp_path / "hf.json")
    off = ModelConfig.from_json(tmp_path / "official.json")
    assert hf == off
    assert hf.config_hash() == off.config_hash()  # 16 vs 16.0 must not matter
    assert (hf.dim, hf.n_layers, hf.n_mtp_layers, hf.rope_head_dim, hf.window_size) == (4096, 43, 1, 64, 128)
    assert hf.compress_ratios[:4] == (0, 0, 4, 128) and hf.compress_ratios[-1] == 0 and len(hf.compress_ratios) == 44
    assert (hf.rope_factor, hf.original_seq_len, hf.route_scale, hf.n_hash_layers) == (16.0, 65536, 1.5, 3)
    assert ModelConfig.from_dict(off.to_official_json()) == off


@pytest.mark.reference
def test_hf_normalised_config_agrees():
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.DeepseekV4Config(**FLASH_HF)  # what HF makes of it: layer_types, rope_parameters, ...
    assert ModelConfig.from_dict(hf_cfg.to_dict()) == ModelConfig.from_dict(FLASH_OFFICIAL)


@pytest.mark.parametrize("change, message", [
    ({"n_routed_experts_score": 128}, "unknown config keys: n_routed_experts_score"),
    ({"hidden_size": 2048}, "inconsistent dim"),
    ({"num_key_value_heads": 8}, "num_key_value_heads=8 is not supported"),
    ({"o_groups": 7}, "not divisible by o_groups=7"),
    ({"score_func": "softmax"}, "score_func='softmax'"),
    ({"compress_ratios": [0, 4, 128]}, "compress_ratios has 3 entries"),
    ({"n_activated_experts": 300}, "n_activated_experts=300 > n_routed_experts=256"),
    ({"dim": 0}, "dim must be positive"),
    ({"dtype": "fp4"}, "dtype='fp4'"),
    ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope scaling type 'linear'"),
    ({"rope_scaling": {"type": "yarn", "factor": 32}}, "inconsistent rope_factor"),
])
def test_bad_configs_rejected(change, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_dict({**FLASH_OFFICIAL, **change})


@pytest.mark.parametrize("spelling", ["official", "hf"])
def test_a_missing_size_is_named_not_defaulted(spelling, tmp_path):
    """Every REQUIRED field, dropped from either spelling of the Flash config, is one error naming it (both names);
    a field DeepSeek documents a default for (n_mtp_layers, norm_eps, hc_eps) may be left out."""
    from engine.model_config import _HF_TO_OFFICIAL, REQUIRED

    base = FLASH_OFFICIAL if spelling == "official" else FLASH_HF
    to_hf = {v: k for k, v in _HF_TO_OFFICIAL.items()}
    for name in REQUIRED:
        keys = {name, to_hf.get(name, name)}
        keys |= {"compress_ratios", "layer_types"} if name == "compress_ratios" else set()
        keys |= {"qk_rope_head_dim", "partial_rotary_factor"} if name == "rope_head_dim" else set()
        raw = {k: v for k, v in base.items() if k not in keys}
        (tmp_path / "config.json").write_text(json.dumps(raw))
        with pytest.raises(ConfigError, match=f"config.json: missing required field {name}\\b") as e:
            ModelConfig.from_json(tmp_path)
        assert len(str(e.value).splitlines()) == 1
    relaxed = {k: v for k, v in FLASH_OFFICIAL.items()}
    assert "n_mtp_layers" not in relaxed and "norm_eps" not in relaxed  # ModelArgs defaults: 1, 1e-6
    assert ModelConfig.from_dict(relaxed).n_mtp_layers == 1


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json(tmp_path)


def test_graph_mode_auto_resolves_by_backend():
    """Graph mode "auto" (the DEEPINFER_NEURON_GRAPH_MODE default) is resolved when the config is built: eager ops
    on the host, layer graphs on a device backend; an explicit mode is kept; a built config never holds "auto"."""
    from pathlib import Path

    from engine.config import EngineConfig, GraphMode

    tiny = Path(__file__).resolve().parents[1] / "golden" / "tiny"
    assert EngineConfig.from_model_dir(tiny, graph_mode="auto").graph.mode is GraphMode.EAGER
    assert EngineConfig.from_model_dir(tiny, graph_mode="auto", backend="xla").graph.mode is GraphMode.LAYER
    assert EngineConfig.from_model_dir(tiny, graph_mode="eager", backend="xla").graph.mode is GraphMode.EAGER
    assert EngineConfig.from_model_dir(tiny, graph_mode="regions").graph.mode is GraphMode.REGIONS


def test_a_v41_checkpoint_is_refused_by_its_class(tmp_path, capsys):
    """DeepseekV41ForCausalLM (V4.1, Sept 2026): one line naming the class and what this engine runs, exit 2."""
    import shutil
    from pathlib import Path

    from tests.cli import run_main

    tiny = Path(__file__).resolve().parents[1] / "golden" / "tiny"
    shutil.copytree(tiny, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["DeepseekV41ForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    code, out, err = run_main(["golden", "--model-dir", str(tmp_path / "m"), "--out", str(tmp_path / "o")], capsys)
    line = err.strip()
    assert code == 2 and out == "" and "\n" not in line and "Traceback" not in line
    assert "DeepseekV41ForCausalLM is not a model this engine runs" in line and "DeepseekV4ForCausalLM" in line
    cfg["architectures"] = ["DeepseekV4ForCausalLM"]
    assert ModelConfig.from_dict(cfg) == ModelConfig.from_json(tiny)
