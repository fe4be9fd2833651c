"""Write the tiny random DeepSeek-V4 model `golden/tiny/` (fixed seed, official checkpoint format).

    python golden/make_tiny_model.py                   # golden/tiny/{config.json,model.safetensors,tokenizer*.json}
    python golden/make_tiny_model.py --tokenizer-only  # golden/tiny/tokenizer*.json only (weights untouched)

The config exercises every V4 feature at toy size: layers sliding / CSA (ratio 4) /
HCA (ratio 16) / CSA plus a sliding MTP layer, two hash-routed layers, YaRN on the compressed layers, 16 indexer
heads with top-4, a small `swiglu_limit` so the clamps really trigger. Every parameter is random, including those HF
zero-initialises (sinks, compressor `ape`, gate bias, mHC `base`, `tid2eid`). The weights are stored exactly as the
released checkpoint stores them: FP8 e4m3 + UE8M0 128x128 `.scale`, FP4 I8 + 1x32 `.scale`, BF16, F32, I64.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.chat_encoding import BOS as BOS_TOKEN  # noqa: E402
from engine.chat_encoding import EOS as EOS_TOKEN  # noqa: E402
from engine.chat_encoding import SPECIAL_TOKENS as CHAT_TOKENS  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.loader import expected_tensors, save_safetensors, split_name, to_official_format  # noqa: E402

SEED = 20268  # weights (picked for clear greedy margins: min top1-top2 logit gap 4.8e-3 in the golden)
TOKENIZER_SEED = 20260  # tokenizer training text (independent of the weights' seed)
OUT_DIR = Path(__file__).resolve().parent / "tiny"
# Chat tokens (engine/chat_encoding.py) that stay in decoded text: `decode(skip_special_tokens=True)` (the engine's
# default, used for returned text) keeps them, so a completion still shows where reasoning ends and the DSML tool
# calls are, and `parse_completion` works on it. This is how released reasoning models mark their `<think>` tokens.
# The others (BOS, EOS, role and quick-instruction tokens) are special: they frame turns and are skipped.
VISIBLE_CHAT_TOKENS = ("<think>", "</think>", "｜DSML｜")

TINY_CONFIG = ModelConfig(
    vocab_size=1024, dim=128, n_layers=4, n_mtp_layers=1, compress_ratios=(0, 4, 16, 4, 0), n_hash_layers=2,
    n_heads=4, head_dim=64, rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=32, window_size=16,
    n_routed_experts=8, n_activated_experts=2, moe_inter_dim=64, index_n_heads=16, index_head_dim=32, index_topk=4,
    hc_mult=4, hc_sinkhorn_iters=20, route_scale=1.5, swiglu_limit=1.0, rope_theta=10000.0,
    compress_rope_theta=160000.0, rope_factor=16.0, original_seq_len=65536, beta_fast=32.0, beta_slow=1.0,
    max_position_embeddings=4096, dtype="fp8", expert_dtype="fp4",
)

# Init scales (std multipliers of 1/sqrt(fan_in) unless stated). Chosen so activations stay O(1), the SwiGLU clamp
# (limit 1.0) cuts a fair share of the expert pre-activations, and logits have std ~3 (clear greedy margins).
LOGIT_STD = 3.0
GATE_GAIN = 2.0  # router logits ~N(0, 2): uneven expert scores
COMP_GATE_GAIN = 2.0  # compressor gate logits: a non-uniform softmax over the pooled tokens


def _init(name: str, shape: tuple[int, ...], cfg: ModelConfig, g: torch.Generator) -> torch.Tensor:
    _, _, suffix = split_name(name)
    leaf = suffix.rsplit(".", 2)[-2] if suffix.endswith(".weight") else suffix.rsplit(".", 1)[-1]

    def randn(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std

    if name == "embed.weight":
        return randn(1.0)
    if name == "head.weight":
        return randn(LOGIT_STD / math.sqrt(cfg.dim))
    if suffix.endswith("tid2eid"):
        # distinct random experts per token row
        return torch.rand(shape[0], cfg.n_routed_experts, generator=g).argsort(dim=1)[:, : shape[1]].contiguous()
    if suffix.endswith("attn_sink"):
        return randn(1.0)
    if suffix.endswith(".ape"):
        return randn(0.5)
    if suffix.endswith("gate.bias"):
        return randn(0.2)
    if suffix.endswith("_fn"):  # mHC mixing weights [mix, n*D]: mix ~ N(0, 1)
        return randn(1.0 / math.sqrt(shape[1]))
    if suffix.endswith("_base"):
        return randn(0.5)
    if suffix.endswith("_scale"):
        return 0.5 + torch.rand(shape, generator=g)  # U(0.5, 1.5)
    if len(shape) == 1:  # RMSNorm weights
        return 1.0 + randn(0.1)
    fan_in = shape[1]
    gain = 1.0
    if suffix == "ffn.gate.weight":
        gain = GATE_GAIN
    elif leaf == "wgate":
        gain = COMP_GATE_GAIN
    return randn(gain / math.sqrt(fan_in))


def tiny_weights(cfg: ModelConfig = TINY_CONFIG, seed: int = SEED) -> dict[str, torch.Tensor]:
    """Dense fp32 (int64 for tid2eid) official-named weights of a random V4 model."""
    g = torch.Generator().manual_seed(seed)
    return {name: _init(name, shape, cfg, g) for name, shape in expected_tensors(cfg).items()}


# ---- tokenizer -------------------------------------------------------------------------------------------------
_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "DeepSeek-V4 compresses the key-value cache with a lightning indexer and heavily compressed attention.",
    "Hyper-connections keep four residual streams mixed by a doubly stochastic matrix.",
    "def forward(self, x):\n    return self.w2(silu(self.w1(x)) * self.w3(x))\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his cat.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 128 256 512 1024 4096 65536.",
    "Trainium chips run kernels written in NKI; tiles have 128 partitions.",
]


def tokenizer_corpus(seed: int = TOKENIZER_SEED) -> list[str]:
    """Deterministic training text: fixed sentences plus pseudo-words from a syllable grammar."""
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "tr", "ch"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "ee"]
    codas = ["", "", "n", "r", "s", "t", "l", "ng", "ck"]
    words = ["".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.randint(1, 3)))
             for _ in range(3000)]
    lines = list(_SENTENCES) * 20
    for _ in range(4000):
        n = rng.randint(4, 14)
        line = " ".join(rng.choice(words) for _ in range(n))
        lines.append(line.capitalize() + rng.choice([".", ".", "!", "?", ",", ";"]))
    return lines


def build_tokenizer(vocab_size: int, seed: int = TOKENIZER_SEED):
    """Byte-level BPE with exactly `vocab_size` tokens: id 0 = BOS, id 1 = EOS, then the other chat special tokens,
    the BPE vocabulary, and last the `VISIBLE_CHAT_TOKENS` (added non-special); encode() prepends BOS. Every token
    of `engine.chat_encoding.SPECIAL_TOKENS` is one id."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    special = [BOS_TOKEN, EOS_TOKEN, *(t for t in CHAT_TOKENS if t not in (BOS_TOKEN, EOS_TOKEN, *VISIBLE_CHAT_TOKENS))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(VISIBLE_CHAT_TOKENS), special_tokens=special,
                                  min_frequency=1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(tokenizer_corpus(seed), trainer=trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in VISIBLE_CHAT_TOKENS])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B",
                                                       special_tokens=[(BOS_TOKEN, 0)])
    missing = [t for t in CHAT_TOKENS if tok.token_to_id(t) is None]
    if (tok.get_vocab_size() != vocab_size or tok.token_to_id(BOS_TOKEN) != 0 or tok.token_to_id(EOS_TOKEN) != 1
            or missing):
        raise RuntimeError(f"tokenizer came out with {tok.get_vocab_size()} tokens (want {vocab_size}), "
                           f"bos={tok.token_to_id(BOS_TOKEN)}, eos={tok.token_to_id(EOS_TOKEN)}, missing {missing}")
    return tok


TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": BOS_TOKEN,
    "eos_token": EOS_TOKEN,
    "pad_token": EOS_TOKEN,
    "add_bos_token": True,
    "add_eos_token": False,
    "model_max_length": 4096,
    "clean_up_tokenization_spaces": False,
}


def write_tokenizer(out_dir: Path = OUT_DIR, cfg: ModelConfig = TINY_CONFIG) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(cfg.vocab_size).save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2, ensure_ascii=False) + "\n")


def write_tiny_model(out_dir: Path = OUT_DIR, cfg: ModelConfig = TINY_CONFIG, seed: int = SEED) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg.to_official_json(), indent=2) + "\n")
    save_safetensors(to_official_format(tiny_weights(cfg, seed), cfg), out_dir)
    write_tokenizer(out_dir, cfg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT_DIR)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--tokenizer-only", action="store_true", help="rewrite tokenizer*.json only, not the weights")
    args = p.parse_args()
    if args.tokenizer_only:
        write_tokenizer(args.out, TINY_CONFIG)
    else:
        write_tiny_model(args.out, TINY_CONFIG, args.seed)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"wrote {args.out} ({size / 2**20:.2f} MiB), config_hash {TINY_CONFIG.config_hash()}")


if __name__ == "__main__":
    main()
