"""Continuous batching with chunked prefill. Pure Python: decides WHICH tokens run each step, never touches tensors.

Each `schedule()` builds one step under two limits: at most `max_num_seqs` sequences (= fixed KV slots) and at most
`max_num_batched_tokens` tokens. Running sequences that decode get 1 token each first, then running sequences in
the middle of a (chunked) prefill, then waiting requests are admitted in FIFO order with what is left.

Priority is arrival order. When a running sequence cannot grow (pool full), the NEWEST running sequence is
preempted (recompute: blocks and slot freed, requeued at the front of the waiting queue, prefilled again later);
a sequence never preempts an older one. The oldest request can therefore always progress (it fits the empty pool,
or it was rejected on arrival), so every request finishes and none starves. A request that can never fit
(prompt + max_tokens over `max_model_len`, or more blocks than the whole pool) is rejected on arrival.

With prefix caching (`enable_prefix_caching`, engine/kv_cache.py) a request admitted with nothing computed (new or
preempted) starts after its longest cached prefix: its table starts with the cached blocks and the engine restores
the slot state from the prefix's snapshot (`take_restores`) before the step. The slot state at every block
boundary a sequence passes is saved to a snapshot: by the chunk itself as it passes it (`chunk_taps`: eager prefill
chunks, `Sequence.snap_taps`), or after a step that ends on it (`take_snapshots`: decode steps end on each boundary
in turn; where chunks cannot save - chunk graphs, speculative decoding's draft layer - a prefill chunk that crosses
a boundary is cut to end on the last one it crosses, which costs one more step per prompt).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from engine.config import CacheConfig
from engine.kv_cache import BlockManager
from engine.sequence import Sequence, SequenceStatus


class RequestRejected(ValueError):
    """A request that can never be served with this engine configuration."""


@dataclass
class ScheduledBatch:
    """One engine step. `entries` is exactly the runner's `execute` argument."""

    entries: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    @property
    def num_seqs(self) -> int:
        return len(self.entries)

    @property
    def is_empty(self) -> bool:
        return not self.entries

    @property
    def sample_indices(self) -> list[int]:
        """Entries whose chunk reaches the last token (with its drafts, if any): they produce new tokens."""
        return [i for i, (s, n) in enumerate(self.entries)
                if s.num_computed_tokens + n == s.num_tokens + len(s.draft_token_ids)]


class Scheduler:
    def __init__(self, config: CacheConfig, chunk_buckets: tuple[int, ...] = ()) -> None:
        """`chunk_buckets` (graph modes: the sizes multi-token steps are compiled for, increasing): a prefill chunk
        is at most the largest, and is cut down to a bucket when padding it up would cost more rows than the cut
        defers (`fit_chunk`)."""
        self.config = config
        self.chunk_buckets = tuple(chunk_buckets)
        self.prefix_caching = bool(config.enable_prefix_caching)
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size, config.max_num_seqs,
                                          enable_prefix_caching=self.prefix_caching,
                                          num_snapshots=config.prefix_snapshots)
        self.need_next_token = False  # a draft layer's slot state at a boundary reads the token after it (MTP)
        self.chunk_taps = False  # the runner's prefill chunks save the state at the boundaries they pass
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries)
        self.prefix_hits = 0  # of which found cached (vLLM's prefix_cache_hits)
        self._restores: list[tuple[int, int]] = []
        self.waiting: list[Sequence] = []  # sorted by arrival order
        self.running: list[Sequence] = []  # sorted by arrival order
        self.num_preemptions = 0
        self._freed_slots: list[int] = []

    # ---- requests in and out --------------------------------------------------------------------------------
    def check_request(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise RequestRejected (with the reason) if such a request could never be served."""
        cfg = self.config
        total = num_prompt_tokens + max_tokens
        if num_prompt_tokens < 1:
            raise RequestRejected("the prompt is empty")
        if cfg.max_input_len and num_prompt_tokens > cfg.max_input_len:
            raise RequestRejected(f"prompt ({num_prompt_tokens} tokens) exceeds max_input_len={cfg.max_input_len} "
                                  "(the longest prompt this engine was sized and compiled for)")
        if total > cfg.max_model_len:
            raise RequestRejected(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} "
                                  f"exceeds the maximum context length max_model_len={cfg.max_model_len}")
        if not self.block_manager.can_ever_fit(total):
            raise RequestRejected(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} tokens needs "
                f"{self.block_manager.num_blocks_for(total)} KV blocks of {cfg.block_size} tokens, more than the "
                f"whole pool (num_kv_blocks={cfg.num_kv_blocks}); raise --num-kv-blocks or lower max_tokens")

    def add(self, seq: Sequence) -> None:
        self.check_request(seq.num_prompt_tokens, seq.sampling_params.max_tokens)
        seq.status = SequenceStatus.WAITING
        self._insert(self.waiting, seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take `seq` out (finished or aborted): its blocks and slot go back to the pool."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time = time.perf_counter()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def take_restores(self) -> list[tuple[int, int]]:
        """(slot, snapshot) pairs of the prefix hits admitted since the last call: the engine restores each slot's
        state from the snapshot (after resetting the freed slots, before the step)."""
        out, self._restores = self._restores, []
        return out

    def take_snapshots(self, batch: ScheduledBatch, starts: list[int], spare: int = 0) -> list[tuple[int, int]]:
        """After `batch` ran (tokens appended, drafts made): (slot, snapshot) pairs to save, one for each running
        sequence that ended its step on a cached block boundary with no snapshot yet (`spare`: positions past the
        boundary the slot state still holds exactly)."""
        out = []
        for (seq, _), start in zip(batch.entries, starts, strict=True):
            if seq.status is SequenceStatus.RUNNING and seq.slot is not None:
                snap = self.block_manager.snapshot_for(seq, start, spare)
                if snap is not None:
                    out.append((seq.slot, snap))
        return out

    def take_freed_slots(self) -> list[int]:
        """Slots released since the last call; the engine resets their state in the runner before reuse."""
        slots, self._freed_slots = self._freed_slots, []
        return slots

    # ---- one step -------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        cfg, bm = self.config, self.block_manager
        budget = cfg.max_num_batched_tokens
        plan: dict[Sequence, int] = {}  # insertion order = batch order: decodes, then prefill chunks
        for seq in self.running:
            if budget and seq.num_uncomputed_tokens == 1:  # a decode (with its drafts: a verify step)
                if len(seq.draft_token_ids) >= budget:
                    seq.draft_token_ids = seq.draft_token_ids[: budget - 1]
                plan[seq] = 1 + len(seq.draft_token_ids)
                budget -= plan[seq]
        for seq in self.running:
            if budget and seq not in plan and seq.num_uncomputed_tokens:
                plan[seq] = self._on_boundary(seq, self.fit_chunk(min(seq.num_uncomputed_tokens, budget)))
                budget -= plan[seq]

        # Reserve blocks oldest first; a sequence may only evict sequences newer than itself.
        batch = ScheduledBatch()
        for seq in list(self.running):
            if seq not in plan or seq.status is not SequenceStatus.RUNNING:
                continue
            n = plan[seq]
            while not bm.can_allocate(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                if victim is not seq:
                    self._preempt(victim, batch)
                    plan.pop(victim, None)
                    continue
                # Nobody newer to evict (older sequences hold the pool). A decode that cannot grow is preempted
                # (requeued at the front); a prefill chunk shrinks to what fits, or waits a step holding its blocks.
                if seq.num_uncomputed_tokens == 1:
                    self._preempt(seq, batch)
                    n = 0
                else:
                    n = max(0, min(n, bm.max_coverable_tokens(seq) - seq.num_computed_tokens))
                if not n:
                    plan.pop(seq)
                break
            if n:
                bm.allocate(seq, seq.num_computed_tokens + n)
                plan[seq] = n
        budget = cfg.max_num_batched_tokens - sum(plan.values())

        # Admit waiting requests in strict FIFO order (no overtaking, hence no starvation); not in a step that had
        # to preempt (the pool is contended: admitting now would only be evicted again).
        while not batch.preempted and self.waiting and budget and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            hit, snap = bm.find_prefix(seq, self.need_next_token) if self.prefix_caching else ([], None)
            if hit:
                bm.take_prefix(seq, hit)
                seq.num_computed_tokens = len(hit) * cfg.block_size
            n = self._on_boundary(seq, self.fit_chunk(min(seq.num_uncomputed_tokens, budget,
                                                          bm.max_coverable_tokens(seq) - seq.num_computed_tokens)))
            if n < 1 or not bm.can_allocate(seq, seq.num_computed_tokens + n):
                if hit:  # not admitted after all: the cached blocks go back as they were
                    bm.free(seq)
                    seq.num_computed_tokens = 0
                break
            self.waiting.pop(0)
            if self.prefix_caching:
                self.prefix_queries += seq.num_tokens
                self.prefix_hits += seq.num_computed_tokens
                seq.num_cached_tokens = seq.num_computed_tokens
            bm.allocate(seq, seq.num_computed_tokens + n)
            if snap is not None and hit:
                self._restores.append((seq.slot, snap))
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.perf_counter()
            self._insert(self.running, seq)
            plan[seq] = n
            budget -= n
        batch.entries = list(plan.items())
        if self.prefix_caching and self.chunk_taps:
            bs = cfg.block_size
            for seq, n in batch.entries:
                if n > 1:
                    first = seq.num_computed_tokens // bs + 1
                    seq.snap_taps = tuple((k * bs, j) for k in range(first, (seq.num_computed_tokens + n) // bs + 1)
                                          if (j := bm.reserve_snapshot(seq, k * bs)) is not None)
        return batch

    def fit_chunk(self, n: int) -> int:
        """A prefill chunk of up to n tokens, fitted to the chunk buckets (none: n): at most the largest bucket; cut
        down to the largest bucket <= n when the padding up to n's bucket would be more rows than the tokens the
        cut defers to later steps (130 -> 128 with buckets 8/32/128/512, not 512 rows; 22 stays 22 with 8/24)."""
        bk = self.chunk_buckets
        if not bk or n <= 1:
            return n
        n = min(n, bk[-1])
        up = next(b for b in bk if b >= n)
        down = max((b for b in bk if b <= n), default=0)
        return down if down and up - n > n - down else n

    def _on_boundary(self, seq: Sequence, n: int) -> int:
        """A prefill chunk of n tokens cut to end on the last block boundary it crosses (prefix caching: the slot
        state is saved at step ends only); unchanged when it crosses none."""
        if not self.prefix_caching or self.chunk_taps or n <= 1:
            return n
        bs, start = self.config.block_size, seq.num_computed_tokens
        last = (start + n) // bs * bs
        return last - start if last > start else n

    def advance(self, batch: ScheduledBatch) -> None:
        """After the runner executed `batch`: those tokens are now in the KV state (a verify step's drafts only as
        far as `settle` says); blocks now fully computed are keyed in the prefix cache."""
        for seq, n in batch.entries:
            seq.num_computed_tokens += n
            seq.snap_taps = ()
            if not seq.draft_token_ids:
                self.block_manager.cache_full_blocks(seq)

    def settle(self, seq: Sequence) -> None:
        """After a verify step appended the accepted drafts and the bonus token: everything before the last token is
        computed (the accepted drafts' state is the target's), the rejected drafts' blocks go back to the pool."""
        seq.clear_drafts()
        if seq.status is SequenceStatus.RUNNING:
            seq.num_computed_tokens = seq.num_tokens - 1
            self.block_manager.trim(seq, seq.num_tokens)
            self.block_manager.cache_full_blocks(seq)

    # ---- internals ------------------------------------------------------------------------------------------
    @staticmethod
    def _insert(queue: list[Sequence], seq: Sequence) -> None:
        bisect.insort(queue, seq, key=lambda s: s.order)

    def _release(self, seq: Sequence) -> None:
        slot = self.block_manager.free(seq)
        if slot is not None:
            self._freed_slots.append(slot)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.clear_drafts()
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self._insert(self.waiting, seq)
        self.num_preemptions += 1
        batch.preempted.append(seq)
