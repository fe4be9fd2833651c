"""The independent reference: HF transformers' `DeepseekV4ForCausalLM` (>= 5.24) on the same weights as the engine.

Used by the golden generator (`golden/make_golden.py`), the random-config property test and the speed benchmark.
transformers is the optional `reference` extra, so it is imported inside the functions only.
HF runs no FP8/FP4 simulation and has no MTP: it is fed dequantised weights and drops `mtp.*`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.config import ModelConfig
from engine.loader import official_to_hf

if TYPE_CHECKING:
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

# HF keeps these in fp32 whatever the model dtype (`_keep_in_fp32_modules_strict` of DeepseekV4PreTrainedModel).
_FP32_COMPONENTS = ("attn_hc", "ffn_hc", "hc_head", "sinks", "position_bias", "e_score_correction_bias", "q_a_norm",
                    "kv_norm", "input_layernorm", "post_attention_layernorm", "norm")


def hf_config(cfg: ModelConfig) -> DeepseekV4Config:
    """`ModelConfig` -> HF `DeepseekV4Config` (main layers only; HF has no MTP layer); see ModelConfig.to_hf_json."""
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**cfg.to_hf_json())


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


@dataclass(frozen=True)
class Draw:
    """One honest bf16 run of the reference (deepinfer_bench/bench/verdict.py's noise band is the spread of these).
    `policy`: "hf" (HF's own dtypes) or "official" (also the router and the LM head in fp32, as DeepSeek's
    inference/model.py runs them: /work/shared/spec/deepseek_v4.md section 5 row 3); `k_block`: every bf16 GEMM
    summed in fp32 over K blocks of this width, in ascending or (`reverse`) descending order, rounded once - the
    summation order a device's tiled GEMM has (a trn2 sums 128-wide K tiles in PSUM); None: torch's CPU GEMM."""

    name: str
    policy: str = "hf"
    k_block: int | None = None
    reverse: bool = False


# The draws of a bf16 reference: the two precision policies an honest bf16 implementation may follow, each with
# torch's CPU summation order and two tiled orders. On the CPU, torch's bf16 GEMM gives bit-identical results at
# any thread count, so thread counts are no source of draws here. The first is the reference of the per-token
# diagnostics and --per-layer.
DRAWS = (Draw("hf"), Draw("hf-k32", k_block=32), Draw("hf-k8r", k_block=8, reverse=True),
         Draw("official", "official"), Draw("official-k32", "official", 32), Draw("official-k8r", "official", 8, True))


@contextlib.contextmanager
def summation_order(draw: Draw) -> Iterator[None]:
    """Within the block, bf16 x bf16 `F.linear` (every nn.Linear, HF's router) sums in `draw`'s K-block order:
    the products are exact in fp32, only their summation order and so some final roundings change."""
    import torch.nn.functional as F

    if draw.k_block is None:
        yield
        return
    linear, block = F.linear, draw.k_block

    def blocked(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
            return linear(x, w, b)
        starts = list(range(0, x.shape[-1], block))
        acc = None
        for s in reversed(starts) if draw.reverse else starts:
            part = linear(x[..., s: s + block].float(), w[:, s: s + block].float())
            acc = part if acc is None else acc + part
        return (acc if b is None else acc + b.float()).to(x.dtype)

    F.linear = blocked
    try:
        yield
    finally:
        F.linear = linear


def apply_policy(model: DeepseekV4ForCausalLM, policy: str) -> DeepseekV4ForCausalLM:
    """`policy` "official": the router and the LM head of a bf16 `model` run in fp32 on their widened input (their
    weights are bf16 values: exact in fp32), as DeepSeek's inference code runs them; "hf": unchanged."""
    if policy == "hf":
        return model

    def widen(module: torch.nn.Module, args: tuple) -> tuple:
        return tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)

    for layer in model.model.layers:
        layer.mlp.gate.float().register_forward_pre_hook(widen)
    model.lm_head.float().register_forward_pre_hook(widen)
    return model


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


@torch.no_grad()
def hf_forced(model: DeepseekV4ForCausalLM, prompt_ids: list[int], forced: list[int],
              capture: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Teacher forcing in one forward: the prompt followed by the forced tokens but the last. Returns fp32 logits
    [len(forced), vocab] (row i: the distribution forced[i] is scored from) and, with `capture`, the residual streams
    at every position after each layer's attention half ("attn": what enters `ffn_hc`) and after the whole layer
    ("ffn"), fp32 [n_layers, positions, hc_mult, dim] each."""
    if not prompt_ids or not forced:
        raise ValueError("empty prompt or no forced tokens")
    ids = torch.tensor([list(prompt_ids) + list(forced[:-1])], dtype=torch.long)
    grabbed: dict[str, list[torch.Tensor]] = {"attn": [], "ffn": []}
    hooks = []
    if capture:
        for layer in model.model.layers:
            hooks.append(layer.ffn_hc.register_forward_pre_hook(
                lambda m, args: grabbed["attn"].append(args[0][0].float().clone())))
            hooks.append(layer.register_forward_hook(
                lambda m, args, out: grabbed["ffn"].append(out[0].float().clone())))
    try:
        out = model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    logits = out.logits[0, len(prompt_ids) - 1:].float()
    caps = {k: torch.stack(v) for k, v in grabbed.items() if v}
    if capture:
        caps.update(hf_kv_state(model, ids))
    return logits, caps


@torch.no_grad()
def hf_kv_state(model: DeepseekV4ForCausalLM, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The KV state HF's own cache holds after one forward of `ids` [1, T], per layer L, fp32: "kv_window.L" (the
    window keys of the last window - 1 positions, [W, D]), "kv_entries.L" (the compressed entries, [E, D]) and
    "kv_index.L" (the indexer's keys, [E, Di]) where the layer has them."""
    cache = model(input_ids=ids, use_cache=True).cache
    out = {}
    for i, layer in enumerate(cache.layers):
        out[f"kv_window.{i}"] = layer.keys[0, 0].float().clone()
        for name, kind in (("compressor", "kv_entries"), ("indexer", "kv_index")):
            t = getattr(layer, "compressed_kv", {}).get(name)
            if t is not None:
                out[f"{kind}.{i}"] = t[0].float().clone()
    return out
