"""The independent reference: HF transformers' `DeepseekV4ForCausalLM` (>= 5.24) on the same weights as the engine.

Used by the golden generator (`golden/make_golden.py`), the random-config property test and the speed benchmark.
transformers is the optional `reference` extra, so it is imported inside the functions only.
HF runs no FP8/FP4 simulation and has no MTP: it is fed dequantised weights and drops `mtp.*`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from engine.config import ModelConfig
from engine.loader import official_to_hf

if TYPE_CHECKING:
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

_CSA, _HCA, _SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
# HF keeps these in fp32 whatever the model dtype (`_keep_in_fp32_modules_strict` of DeepseekV4PreTrainedModel).
_FP32_COMPONENTS = ("attn_hc", "ffn_hc", "hc_head", "sinks", "position_bias", "e_score_correction_bias", "q_a_norm",
                    "kv_norm", "input_layernorm", "post_attention_layernorm", "norm")


def hf_config(cfg: ModelConfig) -> DeepseekV4Config:
    """`ModelConfig` -> HF `DeepseekV4Config` (main layers only; HF has no MTP layer).

    Layer types follow the official rule: ratio 0 = sliding, ratio 4 = CSA (overlap + indexer), any other ratio =
    HCA. HF has one HCA rate per model, so all HCA layers must share their ratio.
    """
    from transformers import DeepseekV4Config

    ratios = cfg.compress_ratios[: cfg.n_layers]
    hca = sorted({r for r in ratios if r not in (0, 4)})
    if len(hca) > 1:
        raise ValueError(f"HF DeepseekV4Config supports one HCA compress rate, config has {hca}")
    layer_types = [_SLIDING if r == 0 else _CSA if r == 4 else _HCA for r in ratios]
    rotary = cfg.rope_head_dim / cfg.head_dim
    compress: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.compress_rope_theta,
                                "partial_rotary_factor": rotary}
    if cfg.original_seq_len > 0:  # official applies YaRN whenever original_seq_len > 0, with no attention factor
        compress.update(rope_type="yarn", factor=cfg.rope_factor,
                        original_max_position_embeddings=cfg.original_seq_len, beta_fast=cfg.beta_fast,
                        beta_slow=cfg.beta_slow, attention_factor=1.0)
    return DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, moe_intermediate_size=cfg.moe_inter_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=1,
        head_dim=cfg.head_dim, q_lora_rank=cfg.q_lora_rank, partial_rotary_factor=rotary,
        num_experts_per_tok=cfg.n_activated_experts, n_routed_experts=cfg.n_routed_experts,
        n_shared_experts=cfg.n_shared_experts, scoring_func=cfg.score_func, norm_topk_prob=True,
        routed_scaling_factor=cfg.route_scale, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta, compress_rope_theta=cfg.compress_rope_theta,
        layer_types=layer_types, compress_rates={_CSA: 4, _HCA: hca[0] if hca else 128},
        mlp_layer_types=["hash_moe" if cfg.is_hash_layer(i) else "moe" for i in range(cfg.n_layers)],
        rope_parameters={"main": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                  "partial_rotary_factor": rotary},
                         "compress": compress},
        hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
        swiglu_limit=cfg.swiglu_limit, sliding_window=cfg.window_size, o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank, index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk, num_nextn_predict_layers=cfg.n_mtp_layers, rms_norm_eps=cfg.norm_eps,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=None,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, hidden_act="silu", use_cache=True,
    )


def build_hf_model(cfg: ModelConfig, official_state_dict: dict[str, torch.Tensor],
                   dtype: torch.dtype = torch.float32) -> DeepseekV4ForCausalLM:
    """HF model (eval mode, eager attention) holding `official_state_dict` (official names, dequantised, e.g. from
    `engine.loader.load_checkpoint`). Strict: every HF tensor must come from the dict and every non-MTP tensor of
    the dict must be used. For `dtype` != fp32 the modules HF keeps in fp32 stay fp32, as in `from_pretrained`."""
    from transformers import DeepseekV4ForCausalLM

    config = hf_config(cfg)
    config._attn_implementation = "eager"
    with torch.no_grad():
        model = DeepseekV4ForCausalLM(config)
        hf_sd = official_to_hf(official_state_dict, cfg)
        own = model.state_dict()
        missing = sorted(set(own) - set(hf_sd))
        unexpected = sorted(set(hf_sd) - set(own))
        if missing or unexpected:
            raise ValueError(f"official -> HF state dict mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}")
        bad = [f"{k}: {tuple(v.shape)} vs HF {tuple(own[k].shape)}" for k, v in hf_sd.items()
               if tuple(v.shape) != tuple(own[k].shape)]
        if bad:
            raise ValueError(f"official -> HF shape mismatch: {bad[:8]}")
        model.load_state_dict(hf_sd, strict=True)
        if dtype != torch.float32:
            model.to(dtype)
            for name, t in list(model.named_parameters()) + list(model.named_buffers()):
                if t.is_floating_point() and any(c in _FP32_COMPONENTS for c in name.split(".")):
                    t.data = t.data.float()
    return model.eval()


@torch.no_grad()
def hf_greedy(model: DeepseekV4ForCausalLM, prompt_ids: list[int],
              max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding of one prompt with the HF model and HF's own dynamic V4 cache; no EOS stop.

    The prompt is prefilled in one forward, then one token per forward (what `generate` does; a hand-written loop
    because `generate` always stops at the config's EOS). Returns (output ids: the `max_new_tokens` generated ids,
    logits: fp32 [max_new_tokens, vocab], row i = the distribution token i was chosen from, `argmax` = token i).
    """
    if not prompt_ids:
        raise ValueError("empty prompt")
    ids = torch.tensor([prompt_ids], dtype=torch.long)  # [1, T]
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache = out.cache
    tokens: list[int] = []
    rows = []
    for step in range(max_new_tokens):
        logits = out.logits[0, -1].float()  # [vocab]
        rows.append(logits)
        tokens.append(int(logits.argmax()))
        if step + 1 == max_new_tokens:
            break
        pos = torch.tensor([[len(prompt_ids) + step]], dtype=torch.long)
        out = model(input_ids=torch.tensor([[tokens[-1]]], dtype=torch.long), position_ids=pos, cache=cache,
                    use_cache=True)
        cache = out.cache
    return tokens, torch.stack(rows) if rows else torch.empty(0, model.config.vocab_size)
