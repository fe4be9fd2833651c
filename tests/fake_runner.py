"""A fake `ModelRunner` for engine tests: deterministic logits from the token prefix, and contract checks.

Each slot carries a rolling hash of every token processed in it, like the real per-slot window/compressor state;
the logits of a token are a function of that hash. So outputs are wrong unless the scheduler feeds every token
exactly once, in order, into a slot that was reset (`free_slot`) before reuse — and recomputation after
preemption must reproduce the same tokens.

`ByteRunner` is the same runner over a byte-level "model" for text tests (the server's, the detokenizer's): with
`ByteTokenizer` (UTF-8 bytes as tokens) its outputs are text, sometimes EOS and a two-byte character split over two
tokens; its logits put all the probability on the model's token, so sampled requests produce it too.
"""

from __future__ import annotations

import time
import zlib

import torch

from engine.config import EngineConfig, ModelConfig

_MOD = (1 << 61) - 1
NO_EOS = 10**9  # an EOS id the fake vocabulary never produces


def fake_config(max_num_seqs: int = 4, budget: int = 32, num_kv_blocks: int = 16, block_size: int = 8,
                max_model_len: int = 256, *, vocab_size: int = 97, eos_token_id: int = NO_EOS,
                model_dir: str | None = None, **settings) -> EngineConfig:
    """An engine config for the fake runner: a sliding-only ModelConfig (any block size fits) of its vocabulary
    (with an MTP layer when `speculative` is among the settings). Prefix caching is off unless the settings turn
    it on: the tests that count steps, blocks and recomputed tokens are about the engine without it."""
    settings.setdefault("enable_prefix_caching", False)
    mtp = int(settings.get("speculative", "none") != "none")
    cfg = ModelConfig(vocab_size=vocab_size, n_layers=1, n_mtp_layers=mtp, n_hash_layers=0,
                      compress_ratios=(0,) * (1 + mtp), eos_token_id=eos_token_id,
                      max_position_embeddings=max(max_model_len, 4096))
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
        self.slot_hashes = [[0] for _ in range(max_num_seqs)]  # hash of the first j tokens, j = 0..slot_pos
        self.draft_tail = [0] * max_num_seqs  # draft positions the slot's last step processed (may roll back)
        self.num_calls = 0
        self.num_tokens = 0
        self.freed: list[int] = []
        self.snapshots: dict[int, tuple[int, list[int]]] = {}  # prefix caching: snapshot -> (position, hashes)
        self.restored: list[tuple[int, int]] = []

    def free_slot(self, slot: int) -> None:
        self.slot_pos[slot] = 0
        self.slot_hashes[slot] = [0]
        self.draft_tail[slot] = 0
        self.freed.append(slot)

    def save_prefix_state(self, slot: int, snap: int) -> None:
        """Prefix caching: keep the slot's hash state as snapshot `snap`."""
        self.snapshots[snap] = (self.slot_pos[slot], list(self.slot_hashes[slot]))

    def restore_prefix_state(self, slot: int, snap: int) -> None:
        """A reset slot takes snapshot `snap`'s state; the sequence may resume at any position it holds (a wrong
        prefix or position shows in the logits: they hash the tokens)."""
        assert self.slot_pos[slot] == 0, f"restore into slot {slot}, which was not reset"
        pos, hashes = self.snapshots[snap]
        self.slot_pos[slot], self.slot_hashes[slot], self.draft_tail[slot] = pos, list(hashes), pos
        self.restored.append((slot, snap))

    def execute(self, batch: list, full_logits=()) -> torch.Tensor:
        """Logits [R, V]: per entry its last token's row, or a row per chunk token for entries in `full_logits`."""
        assert batch, "execute() with an empty batch"
        assert len(batch) <= self.max_num_seqs
        slots = [seq.slot for seq, _ in batch]
        assert len(set(slots)) == len(slots), f"two entries share a slot: {slots}"
        rows = []
        for i, (seq, n) in enumerate(batch):
            start = seq.num_computed_tokens
            drafts = len(seq.draft_token_ids)
            assert n >= 1 and start + n <= seq.num_tokens + drafts, (seq, n)
            pos, tail = self.slot_pos[seq.slot], self.draft_tail[seq.slot]
            # a sequence resumes where its state ends, or inside the draft positions its last step processed
            assert pos - tail <= start <= pos, f"slot {seq.slot} holds {pos} tokens ({tail} drafts), {seq!r} " \
                                               f"resumes at {start}"
            need = -(-(start + n) // self.block_size)
            assert len(seq.block_table) >= need, f"{seq!r} needs {need} blocks"
            assert start + n <= self.max_model_len
            hashes = self.slot_hashes[seq.slot][: start + 1]
            h = hashes[-1]
            for j, t in enumerate(seq.step_token_ids(start, n)):
                h = (h * 1_000_003 + t + 1) % _MOD
                hashes.append(h)
                if i in full_logits or j == n - 1:
                    rows.append(self.logits_for(seq, start + j + 1, h))
            self.slot_hashes[seq.slot] = hashes
            self.slot_pos[seq.slot] = start + n
            self.draft_tail[seq.slot] = max(0, start + n - seq.num_tokens)
        self.num_calls += 1
        self.num_tokens += sum(n for _, n in batch)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        return torch.stack(rows)  # [R, V]

    def logits_for(self, seq, end: int, h: int) -> torch.Tensor:
        """Logits [V] after the first `end` tokens of `seq` with its drafts (rolling hash `h`); subclasses may model
        something else."""
        return self.logits_for_hash(h)

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


# ---- a byte-level model ----------------------------------------------------------------------------------------
BOS, EOS, OFFSET = 1, 2, 3  # byte b is token b + OFFSET
BYTE_VOCAB = 256 + OFFSET


class ByteTokenizer:
    """UTF-8 bytes as tokens; BOS prepended when add_special_tokens."""

    eos_token_id = EOS
    vocab_size = BYTE_VOCAB

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + [b + OFFSET for b in text.encode()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(t - OFFSET for t in ids if t >= OFFSET).decode("utf-8", errors="replace")


def next_token(history: list[int]) -> int:
    """The byte model: a hash of the last 4 tokens -> a letter, space, '.', EOS or the first byte of "é"."""
    if history[-1] == 0xC3 + OFFSET:
        return 0xA9 + OFFSET  # completes "é"
    h = zlib.crc32(bytes(t % 256 for t in history[-4:])) % 40
    if h < 26:
        return ord("a") + h + OFFSET
    return {26: ord(" "), 27: 0xC3, 28: ord("."), 29: EOS - OFFSET}.get(h, ord(" ")) + OFFSET


def byte_greedy(prompt_ids: list[int], max_tokens: int, ignore_eos: bool = False) -> list[int]:
    """What the byte model generates for one request (no scheduler, no engine): up to EOS (included) or max_tokens."""
    toks, out = list(prompt_ids), []
    while len(out) < max_tokens:
        t = next_token(toks)
        toks.append(t)
        out.append(t)
        if t == EOS and not ignore_eos:
            break
    return out


class ByteRunner(FakeRunner):
    """`FakeRunner` (contract checks) whose logits are the byte model's (`next_token`). `step_delay_s`: slow steps;
    `fail_at_step`: that execute() call and every later one raises; `batch_sizes`: sequences per execute() call."""

    def __init__(self, max_num_seqs: int = 8, num_kv_blocks: int = 64, block_size: int = 16,
                 max_model_len: int = 256, *, step_delay_s: float = 0.0, fail_at_step: int | None = None) -> None:
        super().__init__(max_num_seqs, num_kv_blocks, block_size, max_model_len, BYTE_VOCAB,
                         step_delay_s=step_delay_s)
        self.fail_at_step = fail_at_step
        self.batch_sizes: list[int] = []

    def execute(self, batch: list, full_logits=()) -> torch.Tensor:
        if self.fail_at_step is not None and self.num_calls + 1 >= self.fail_at_step:
            raise RuntimeError("injected engine failure")
        self.batch_sizes.append(len(batch))
        return super().execute(batch, full_logits)

    def logits_for(self, seq, end: int, h: int) -> torch.Tensor:
        out = torch.full((self.vocab_size,), -1e4)  # [V]
        out[next_token(seq.step_token_ids(0, end))] = 0.0
        return out


def byte_engine(*, max_num_seqs: int = 8, num_kv_blocks: int = 64, block_size: int = 16, max_model_len: int = 256,
                budget: int = 512, **runner_kw):
    """The real LLMEngine over a `ByteRunner` with `ByteTokenizer` (module level: picklable as a process factory)."""
    from engine.llm import LLMEngine

    cfg = fake_config(max_num_seqs, budget, num_kv_blocks, block_size, max_model_len, vocab_size=BYTE_VOCAB,
                      eos_token_id=EOS)
    runner = ByteRunner(max_num_seqs, num_kv_blocks, block_size, max_model_len, **runner_kw)
    return LLMEngine(cfg, runner, tokenizer=ByteTokenizer())


class SpecFakeRunner(FakeRunner):
    """`FakeRunner` with a draft head: it proposes the model's own greedy continuation, except that every position p
    with p % `wrong_every` == 1 gets a wrong token (so acceptance is partial and every accept length occurs)."""

    def __init__(self, *args, wrong_every: int = 3, **kw) -> None:
        super().__init__(*args, **kw)
        self.wrong_every = wrong_every
        self.draft_calls: list[list] = []

    def draft(self, requests: list) -> list[list[int]]:
        self.draft_calls.append(list(requests))
        out = []
        for r in requests:
            end = r.start + r.n  # the target state is final up to here: hashes[end] covers tokens [0, end)
            assert self.slot_pos[r.slot] >= end and r.next_ids and len(r.next_ids) == r.n
            h = self.slot_hashes[r.slot][end]
            h = (h * 1_000_003 + r.next_ids[-1] + 1) % _MOD  # + the bonus token at position `end`
            toks = []
            for j in range(r.want):
                t = int(self.logits_for_hash(h).argmax())
                if (end + 1 + j) % self.wrong_every == 1:
                    t = (t + 1) % self.vocab_size
                toks.append(t)
                h = (h * 1_000_003 + t + 1) % _MOD
            out.append(toks)
        return out
