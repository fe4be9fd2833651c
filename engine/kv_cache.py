"""`BlockManager`: pure-Python accounting of the fixed KV pool and the fixed per-sequence slots. Never touches tensors.

The pool has `num_blocks` blocks of `block_size` TOKEN positions. For a layer with compress ratio m a block holds
block_size/m compressed entries (plus indexer keys on CSA layers), so a sequence of L tokens needs
ceil(L / block_size) blocks whatever the layer mix. Slots (`max_num_seqs` of them) index the per-layer fixed
tensors: the sliding-window ring and the compressor partial states. A sequence holds one slot and a block table
from its first scheduled step until it finishes, is aborted or is preempted.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sequence import Sequence


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The chain hash of a full block: sha256 over the parent block's hash and this block's token ids."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, *, enable_prefix_caching: bool = False,
                 num_snapshots: int = 0) -> None:
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size), ("max_num_seqs", max_num_seqs)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        # Stack: the most recently freed block is reused first.
        self._free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))
        self._used_blocks: set[int] = set()
        self._free_slots: list[int] = list(range(max_num_seqs))  # min-heap: lowest slot first
        self._used_slots: set[int] = set()
        self.peak_used_blocks = 0  # high-water mark since construction or reset_peak()
        # prefix caching (module docstring)
        self.prefix_caching = bool(enable_prefix_caching)
        if self.prefix_caching and num_snapshots < 1:
            raise ValueError(f"prefix caching needs at least one state snapshot, got num_snapshots={num_snapshots}")
        self._ref = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}  # cached block -> its chain hash
        self._cached: dict[bytes, int] = {}  # chain hash -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free blocks that keep a key, least recent first
        self._snaps: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # hash -> (snapshot, token after), LRU
        self._free_snaps: list[int] = list(range(num_snapshots - 1, -1, -1))

    # ---- observable state -----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can take: never used, or free and still holding a cached prefix (evictable)."""
        return len(self._free_blocks) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return len(self._used_blocks)

    @property
    def usage(self) -> float:
        """Fraction of the pool's blocks in use, in [0, 1]."""
        return len(self._used_blocks) / self.num_blocks

    def reset_peak(self) -> None:
        self.peak_used_blocks = len(self._used_blocks)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_used_slots(self) -> int:
        return len(self._used_slots)

    # ---- arithmetic -----------------------------------------------------------------------------------------
    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` fits the whole (empty) pool."""
        return self.num_blocks_for(num_tokens) <= self.num_blocks

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must still get for its table to cover `num_tokens` positions."""
        return max(0, self.num_blocks_for(num_tokens) - len(seq.block_table))

    def max_coverable_tokens(self, seq: Sequence) -> int:
        """Token positions `seq` could cover if it took every free block now."""
        return (len(seq.block_table) + self.num_free_blocks) * self.block_size

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        if seq.slot is None and not self._free_slots:
            return False
        return self.num_new_blocks(seq, num_tokens) <= self.num_free_blocks

    # ---- mutation -------------------------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Give `seq` a slot (if it has none) and grow its block table to cover `num_tokens` positions."""
        if not self.can_allocate(seq, num_tokens):
            raise RuntimeError(f"cannot allocate {num_tokens} tokens for {seq!r}: {self.num_free_blocks} free "
                               f"blocks, {self.num_free_slots} free slots")
        if seq.slot is None:
            seq.slot = heapq.heappop(self._free_slots)
            self._used_slots.add(seq.slot)
        for _ in range(self.num_new_blocks(seq, num_tokens)):
            b = self._free_blocks.pop() if self._free_blocks else self._evict()
            self._ref[b] = 1
            self._used_blocks.add(b)
            seq.block_table.append(b)
        self.peak_used_blocks = max(self.peak_used_blocks, len(self._used_blocks))

    def _evict(self) -> int:
        """The least recently freed cached block, its key (and the snapshot ending with it) forgotten."""
        b, _ = self._evictable.popitem(last=False)
        key = self._key_of.pop(b)
        del self._cached[key]
        snap = self._snaps.pop(key, None)
        if snap is not None:
            self._free_snaps.append(snap[0])
        return b

    def _release(self, b: int) -> None:
        self._ref[b] -= 1
        if self._ref[b]:
            return
        self._used_blocks.remove(b)
        if b in self._key_of:
            self._evictable[b] = None
        else:
            self._free_blocks.append(b)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks of `seq` past what `num_tokens` positions need (rejected speculative drafts)."""
        keep = self.num_blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def free(self, seq: Sequence) -> int | None:
        """Return every block and the slot of `seq`. Returns the released slot (None if it held none)."""
        for b in reversed(seq.block_table):
            if b not in self._used_blocks:
                raise RuntimeError(f"block {b} of {seq!r} is not allocated (double free?)")
            self._release(b)
        seq.block_table = []
        seq.num_cached_blocks = 0
        slot, seq.slot = seq.slot, None
        if slot is not None:
            if slot not in self._used_slots:
                raise RuntimeError(f"slot {slot} of {seq!r} is not allocated (double free?)")
            self._used_slots.remove(slot)
            heapq.heappush(self._free_slots, slot)
        return slot

    # ---- prefix caching -------------------------------------------------------------------------------------
    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chain hashes of `seq`'s first `num_blocks` full blocks (memoised on the sequence: its tokens never
        change, so a preempted sequence keeps them)."""
        hs, bs, toks = seq.block_hashes, self.block_size, seq.all_token_ids
        while len(hs) < num_blocks:
            i = len(hs)
            hs.append(block_hash(hs[-1] if hs else b"", toks[i * bs: (i + 1) * bs]))
        return hs[:num_blocks]

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Key the blocks of `seq` whose positions are all computed (a block another one already caches with the
        same key stays unkeyed: it is freed as a plain block)."""
        if not self.prefix_caching:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if full <= seq.num_cached_blocks:
            return
        for i, key in enumerate(self.block_hashes(seq, full)[seq.num_cached_blocks:], seq.num_cached_blocks):
            b = seq.block_table[i]
            if key not in self._cached and b not in self._key_of:
                self._cached[key], self._key_of[b] = b, key
        seq.num_cached_blocks = full

    def find_prefix(self, seq: Sequence, need_next: bool = False) -> tuple[list[int], int | None]:
        """The cached blocks and the state snapshot of `seq`'s longest hit (([], None): none). `need_next`: the
        snapshot must also have been taken before the same next token (a draft layer's state at the last position
        reads it)."""
        if not self.prefix_caching or seq.num_computed_tokens or seq.block_table:
            return [], None
        if seq.sampling_params.prompt_logprobs is not None:  # every prompt position's logits are asked for (as vLLM)
            return [], None
        hashes = self.block_hashes(seq, (seq.num_tokens - 1) // self.block_size)  # one token left to compute
        blocks: list[int] = []
        for key in hashes:
            b = self._cached.get(key)
            if b is None:
                break
            blocks.append(b)
        toks = seq.all_token_ids
        for k in range(len(blocks), 0, -1):
            snap = self._snaps.get(hashes[k - 1])
            if snap is not None and (not need_next or snap[1] == toks[k * self.block_size]):
                self._snaps.move_to_end(hashes[k - 1])
                return blocks[:k], snap[0]
        return [], None

    def take_prefix(self, seq: Sequence, blocks: list[int]) -> None:
        """Give `seq` (no blocks yet) the cached `blocks` of a hit as the start of its table."""
        if seq.block_table:
            raise RuntimeError(f"{seq!r} already holds blocks")
        for b in blocks:
            if self._ref[b] == 0:
                del self._evictable[b]
                self._used_blocks.add(b)
            self._ref[b] += 1
        seq.block_table = list(blocks)
        seq.num_cached_blocks = len(blocks)
        self.peak_used_blocks = max(self.peak_used_blocks, len(self._used_blocks))

    def snapshot_for(self, seq: Sequence, start: int, spare: int = 0) -> int | None:
        """After a step took `seq` from position `start` to its `num_computed_tokens` (end): the snapshot the slot
        state should be saved to for the block boundary P in (start, end] the slot still holds exactly (end - P <=
        `spare`: the rings keep that many positions past a boundary), or None (no such boundary, its block is not
        cached, or a snapshot of it exists). Taking one evicts the least recently used snapshot when all are in
        use."""
        if not self.may_snapshot(seq, start, spare):
            return None
        k = seq.num_computed_tokens // self.block_size
        if seq.num_cached_blocks < k:
            return None
        key = self.block_hashes(seq, k)[k - 1]
        return self._new_snapshot(seq, k) if key in self._cached else None

    def may_snapshot(self, seq: Sequence, start: int, spare: int = 0) -> bool:
        """Whether `snapshot_for` could save the slot state after this step (a block boundary P in (start, end] with
        end - P <= `spare`): it reads nothing of the cache, so it may be asked before the step's drafts are made."""
        end = seq.num_computed_tokens
        k = end // self.block_size
        return self.prefix_caching and k > 0 and k * self.block_size > start and end - k * self.block_size <= spare

    def reserve_snapshot(self, seq: Sequence, p_end: int) -> int | None:
        """Before a prefill chunk of `seq` passes block boundary `p_end` (<= its token count): the snapshot the chunk
        saves the slot state at `p_end` to as it runs (eager chunks), or None when one of that prefix exists."""
        return self._new_snapshot(seq, p_end // self.block_size) if self.prefix_caching else None

    def _new_snapshot(self, seq: Sequence, k: int) -> int | None:
        """A snapshot for the state after `seq`'s first k blocks (the least recently used one reused when all are
        taken), keyed by the k-th block's chain hash with the token after it; None if that key has one."""
        key = self.block_hashes(seq, k)[k - 1]
        if key in self._snaps:
            self._snaps.move_to_end(key)
            return None
        snap = self._free_snaps.pop() if self._free_snaps else self._snaps.popitem(last=False)[1][0]
        toks = seq.all_token_ids
        self._snaps[key] = (snap, toks[k * self.block_size] if k * self.block_size < len(toks) else -1)
        return snap

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a cached prefix (in use or evictable)."""
        return len(self._key_of)
