"""`BlockManager`: pure-Python accounting of the fixed KV pool and the fixed per-sequence slots. Never touches tensors.

The pool has `num_blocks` blocks of `block_size` TOKEN positions. For a layer with compress ratio m a block holds
block_size/m compressed entries (plus indexer keys on CSA layers), so a sequence of L tokens needs
ceil(L / block_size) blocks whatever the layer mix. Slots (`max_num_seqs` of them) index the per-layer fixed
tensors: the sliding-window ring and the compressor partial states. A sequence holds one slot and a block table
from its first scheduled step until it finishes, is aborted or is preempted.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int) -> None:
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

    # ---- observable state -----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

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
        return (len(seq.block_table) + len(self._free_blocks)) * self.block_size

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        if seq.slot is None and not self._free_slots:
            return False
        return self.num_new_blocks(seq, num_tokens) <= len(self._free_blocks)

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
            b = self._free_blocks.pop()
            self._used_blocks.add(b)
            seq.block_table.append(b)
        self.peak_used_blocks = max(self.peak_used_blocks, len(self._used_blocks))

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks of `seq` past what `num_tokens` positions need (rejected speculative drafts)."""
        keep = self.num_blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            b = seq.block_table.pop()
            self._used_blocks.remove(b)
            self._free_blocks.append(b)

    def free(self, seq: Sequence) -> int | None:
        """Return every block and the slot of `seq`. Returns the released slot (None if it held none)."""
        for b in reversed(seq.block_table):
            if b not in self._used_blocks:
                raise RuntimeError(f"block {b} of {seq!r} is not allocated (double free?)")
            self._used_blocks.remove(b)
            self._free_blocks.append(b)
        seq.block_table = []
        slot, seq.slot = seq.slot, None
        if slot is not None:
            if slot not in self._used_slots:
                raise RuntimeError(f"slot {slot} of {seq!r} is not allocated (double free?)")
            self._used_slots.remove(slot)
            heapq.heappush(self._free_slots, slot)
        return slot
