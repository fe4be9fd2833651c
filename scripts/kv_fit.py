"""How much context fits: KV bytes per token and the longest context per sequence at batch 1 / 8 / 32 for
DeepSeek-V4-Flash and -Pro at context parallelism cp, with the KV cache in bf16 (`--kv-cache-dtype auto`) or FP8
(`--kv-cache-dtype fp8`), on a trn2 logical core (24 GiB HBM at LNC=2, minus the rank's weights) and on a
trn2.48xlarge (64 such cores: cp = 64 is the whole instance).

    python scripts/kv_fit.py [--cp 64] [--hbm-gib 24] [--markdown]

Everything comes from the engine's own layout arithmetic, nothing is allocated: the KV bytes from
engine/model/cache.py `kv_bytes` (the `_layer_spec` the KVCache allocates: per-rank pool blocks of block_size
positions, block_size = `default_block_size(cfg, cp)`; the fixed per-sequence state = window ring rows + the
compressors' fp32 partial states), the weights from the engine's model built on the meta device for rank 0 of cp
(engine/model/model.py `Transformer` with `Parallel(rank=0, cp)`: routed experts split n/cp per rank, everything
else replicated) holding the checkpoint's FP8 / FP4 weights as stored bytes (`--weights stored`) and the others in
the dtype the engine keeps them (bf16 compute: fp32 for norms, router, compressor projections, head, mHC, sinks).
Not counted: activations, graph workspaces, the runtime's own reservation - the longest contexts are upper bounds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.config import ModelConfig, default_block_size  # noqa: E402
from engine.model.cache import kv_bytes  # noqa: E402
from engine.model.layers import Linear, keeps_fp32  # noqa: E402
from engine.model.model import Transformer, use_formats  # noqa: E402
from engine.parallel import Parallel  # noqa: E402

GIB = 2**30
TRN2_CORE_GIB = 24  # trn2: 96 GiB HBM per chip, 4 logical cores at LNC=2
TRN2_48XL_CORES = 64  # trn2.48xlarge: 16 chips x 4 logical cores
BATCHES = (1, 8, 32)

_V4 = dict(n_shared_experts=1, score_func="sqrtsoftplus", swiglu_limit=10.0, rope_head_dim=64, norm_eps=1e-6,
           rope_theta=10000.0, compress_rope_theta=160000.0, rope_factor=16.0, original_seq_len=65536, beta_fast=32.0,
           beta_slow=1.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, bos_token_id=0, eos_token_id=1,
           dtype="fp8", scale_fmt="ue8m0", expert_dtype="fp4", vocab_size=129280, head_dim=512, window_size=128,
           index_n_heads=64, index_head_dim=128, n_activated_experts=6, max_position_embeddings=1048576,
           n_hash_layers=3, n_mtp_layers=1)


def v4_flash() -> ModelConfig:
    """spec deepseek_v4.md §1.1: 43 layers (0, 1 sliding; even 2..42 CSA m=4; odd 3..41 HCA m=128) + MTP."""
    ratios = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(2, 43)] + [0]
    return ModelConfig(**_V4, dim=4096, moe_inter_dim=2048, n_layers=43, n_heads=64, n_routed_experts=256,
                       route_scale=1.5, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, index_topk=512,
                       compress_ratios=tuple(ratios))


def v4_pro() -> ModelConfig:
    """spec §1.1: 61 layers (0, 1 HCA; even 2..60 CSA; odd 3..59 HCA) + MTP."""
    ratios = [128, 128] + [4 if i % 2 == 0 else 128 for i in range(2, 61)] + [0]
    return ModelConfig(**_V4, dim=7168, moe_inter_dim=3072, n_layers=61, n_heads=128, n_routed_experts=384,
                       route_scale=2.5, q_lora_rank=1536, o_groups=16, o_lora_rank=1024, index_topk=1024,
                       compress_ratios=tuple(ratios))


_FP8 = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_b", "attn.indexer.wq_b", "shared_experts.w1",
        "shared_experts.w2", "shared_experts.w3")  # spec §4.1 (attn.wo_a: dequantised at load, engine/loader.py)


def rank_weight_bytes(cfg: ModelConfig, cp: int) -> int:
    """Bytes of rank 0's weights (main model, no MTP) as the engine holds them with --weights stored, bf16."""
    model = Transformer(cfg, Parallel(rank=0, cp=cp), with_mtp=False)
    formats = {}
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            if ".experts." in name and ".shared_experts." not in name:
                formats[f"{name}.weight"] = "fp4"
            elif name.endswith(_FP8):
                formats[f"{name}.weight"] = "fp8"
    use_formats(model, formats)
    total = 0
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if p.dtype in (torch.uint8, torch.int8):
            size = 1
        elif p.dtype == torch.int64:
            size = 8
        else:
            size = 4 if keeps_fp32(name) else 2
        total += p.numel() * size
    return total


def rows(cp: int, hbm_gib: float) -> list[dict]:
    out = []
    for label, cfg in (("V4-Flash", v4_flash()), ("V4-Pro", v4_pro())):
        weights = rank_weight_bytes(cfg, cp)
        free = hbm_gib * GIB - weights
        bs = default_block_size(cfg, cp)
        for kv in ("auto", "fp8"):
            lay = kv_bytes(cfg, list(range(cfg.n_layers)), torch.bfloat16, bs, cp=cp, kv_dtype=kv)
            out.append({"model": label, "kv": "bf16" if kv == "auto" else "fp8", "weights_gib": weights / GIB,
                        "free_gib": free / GIB, "bytes_per_token": lay.per_token,
                        "per_slot_mib": lay.per_slot / 2**20, "block_size": bs,
                        "max_len": cfg.max_position_embeddings,
                        "seqs_at_max": max(0, int(free // lay.rank_bytes(cfg.max_position_embeddings))),
                        **{f"ctx_b{b}": lay.longest_context(free, b) for b in BATCHES}})
    return out


def fmt_ctx(n: int, cap: int) -> str:
    """Tokens that fit, shown against the model's max_position_embeddings (the longest context it takes)."""
    if n <= 0:
        return "does not fit"
    text = f"{n / 2**20:.2f} M" if n >= 2**20 else f"{n // 1024} K"
    return f"{cap / 2**20:.0f} M (max; {text} fit)" if n >= cap else text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cp", type=int, default=64)
    ap.add_argument("--hbm-gib", type=float, default=TRN2_CORE_GIB, help="HBM of one logical core")
    args = ap.parse_args()
    table = rows(args.cp, args.hbm_gib)
    inst = args.cp // TRN2_48XL_CORES if args.cp % TRN2_48XL_CORES == 0 else None
    print(f"cp = {args.cp} ranks, {args.hbm_gib:g} GiB per rank (a trn2 logical core, LNC=2); a trn2.48xlarge = "
          f"{TRN2_48XL_CORES} ranks" + (f" (cp={args.cp}: {inst} instance(s))" if inst else ""))
    print()
    print("| model | KV | KV bytes / token (all ranks) | weights / rank | free / rank | fixed state / seq / rank "
          "| longest context / seq, batch 1 | batch 8 | batch 32 | sequences of max length that fit "
          "| free on a trn2.48xlarge |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['model']} | {r['kv']} | {r['bytes_per_token']:,.0f} B | {r['weights_gib']:.2f} GiB | "
              f"{r['free_gib']:.2f} GiB | {r['per_slot_mib']:.1f} MiB | {fmt_ctx(r['ctx_b1'], r['max_len'])} | "
              f"{fmt_ctx(r['ctx_b8'], r['max_len'])} | {fmt_ctx(r['ctx_b32'], r['max_len'])} | {r['seqs_at_max']} | "
              f"{r['free_gib'] * TRN2_48XL_CORES:,.0f} GiB |")


if __name__ == "__main__":
    main()
