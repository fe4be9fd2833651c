"""A fake `ModelRunner` for engine tests: deterministic logits from the token prefix, and contract checks.

Each slot carries a rolling hash of every token processed in it, like the real per-slot window/compressor state;
the logits of a token are a function of that hash. So outputs are wrong unless the scheduler feeds every token
exactly once, in order, into a slot that was reset (`free_slot`) before reuse — and recomputation after
preemption must reproduce the same tokens.
"""

from __future__ import annotations

import time

import torch

from engine.config import EngineConfig, ModelConfig

_MOD = (1 << 61) - 1
NO_EOS = 10**9  # an EOS id the fake vocabulary never produces


def fake_config(max_num_seqs: int = 4, budget: int = 32, num_kv_blocks: int = 16, block_size: int = 8,
                max_model_len: int = 256, *, vocab_size: int = 97, eos_token_id: int = NO_EOS,
                model_dir: str | None = None, **settings) -> EngineConfig:
    """An engine config for the fake runner: a sliding-only ModelConfig (any block size fits) of its vocabulary."""
    cfg = ModelConfig(vocab_size=vocab_size, n_layers=1, n_mtp_layers=0, n_hash_layers=0, compress_ratios=(0,),
                      eos_token_id=eos_token_id, max_position_embeddings=max(max_model_len, 4096))
    return EngineConfig.from_model_config(cfg, model_dir=model_dir, max_num_seqs=max_num_seqs,
                                          max_num_batched_tokens=budget, num_kv_blocks=num_kv_blocks,
                                          block_size=block_size, max_model_len=max_model_len, **settings)


class FakeRunner:
    def __init__(self, max_num_seqs: int = 8, num_kv_blocks: int = 64, block_size: int = 16,
                 max_model_len: int = 4096, vocab_size: int = 97, *, step_delay_s: float = 0.0) -> None:
        self.max_num_seqs, self.num_kv_blocks = max_num_seqs, num_kv_blocks
        self.block_size, self.max_model_len, self.vocab_size = block_size, max_model_len, vocab_size
        self.step_delay_s = step_delay_s
        self.slot_pos = [0] * max_num_seqs  # tokens processed in each slot since its last reset
        self.slot_hash = [0] * max_num_seqs
        self.num_calls = 0
        self.num_tokens = 0
        self.freed: list[int] = []

    def free_slot(self, slot: int) -> None:
        self.slot_pos[slot] = 0
        self.slot_hash[slot] = 0
        self.freed.append(slot)

    def execute(self, batch: list) -> torch.Tensor:
        assert batch, "execute() with an empty batch"
        assert len(batch) <= self.max_num_seqs
        slots = [seq.slot for seq, _ in batch]
        assert len(set(slots)) == len(slots), f"two entries share a slot: {slots}"
        out = torch.empty(len(batch), self.vocab_size)  # [B, V]
        for i, (seq, n) in enumerate(batch):
            start = seq.num_computed_tokens
            assert n >= 1 and start + n <= seq.num_tokens, (seq, n)
            assert self.slot_pos[seq.slot] == start, f"slot {seq.slot} holds {self.slot_pos[seq.slot]} tokens, " \
                                                     f"{seq!r} resumes at {start}"
            need = -(-(start + n) // self.block_size)
            assert len(seq.block_table) >= need, f"{seq!r} needs {need} blocks"
            assert start + n <= self.max_model_len
            h = self.slot_hash[seq.slot]
            for t in seq.all_token_ids[start:start + n]:
                h = (h * 1_000_003 + t + 1) % _MOD
            self.slot_hash[seq.slot] = h
            self.slot_pos[seq.slot] = start + n
            out[i] = self.logits_for_hash(h)
        self.num_calls += 1
        self.num_tokens += sum(n for _, n in batch)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        return out

    def logits_for_hash(self, h: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(h % (1 << 62))
        return torch.randn(self.vocab_size, generator=g) * 3.0  # [V]

    @staticmethod
    def prefix_hash(token_ids: list[int]) -> int:
        h = 0
        for t in token_ids:
            h = (h * 1_000_003 + t + 1) % _MOD
        return h

    def reference_greedy(self, prompt: list[int], max_tokens: int, stop_ids: tuple[int, ...] = ()) -> list[int]:
        """What greedy decoding must produce, computed without any scheduler."""
        toks, out = list(prompt), []
        for _ in range(max_tokens):
            t = int(self.logits_for_hash(self.prefix_hash(toks)).argmax())
            out.append(t)
            toks.append(t)
            if t in stop_ids:
                break
        return out
