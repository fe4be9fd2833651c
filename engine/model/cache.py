"""Decode-time state as fixed tensors, and the per-step plan.

Two kinds of storage per layer:
* fixed **slots** (one per running sequence): the sliding-window KV ring [S, win + spare, D] (position p at row
  p % (win + spare); under cp, a rank's share) and the compressor partial state [S, coff*m + spare, coff*D] fp32
  (token p's projections at row p % rows: a closing block reads its own m rows and, CSA, the previous block's;
  score rows hold gate logit + ape and start at -inf, which is how "no previous block" is expressed). `spare` is
  the number of speculative draft positions past the last accepted token (0 without speculation): both rings are
  indexed by position and are that much larger, so rolling rejected drafts back needs no state change at all -
  what they wrote is rewritten by real tokens before anything reads it, and nothing they wrote displaced a row a
  later query needs (engine/model/attention.py);
* a **KV pool** of `num_blocks` blocks of `block_size` token positions shared by all layers: a block holds
  block_size/m compressed entries of each compressed layer and, in CSA layers, as many indexer keys. A sequence
  owns a block table; compressed entry w of a layer with ratio m lives in block `table[w // (block_size/m)]`,
  row `w % (block_size/m)`. Block accounting is token arithmetic only (engine/kv_cache.py).

**KV dtype** (`--kv-cache-dtype`, `kv_dtype`): "auto" stores the window ring, the compressed entries and the
indexer keys in the compute dtype; "fp8" stores the head_dim - rope_dim non-RoPE dims of every window row and
compressed entry as e4m3 bytes with one UE8M0 byte per 64 (`<name>_scale`) and the RoPE dims in the compute dtype
(`<name>_rope`), and the indexer keys as e4m3 bytes + one UE8M0 byte per 128 (`index_keys="fp8"`, hf numerics) or
e2m1 codes two per byte + one UE8M0 byte per 32 (`index_keys="fp4"`, official numerics: its keys are FP4 values,
which this stores exactly; e4m3 with one scale per 128 holds them only while a key's 32-block scales stay within
~2^12 of each other). No float8 dtype anywhere: bytes are uint8, (de)quantised by nki_kernels/quant.py's bit
arithmetic. The model reads and writes each store through `KVStore` (`LayerCache.win_store` / `cmp_store` /
`idx_store`), indexed like the tensor of values it holds.

The plan of a step is built once and reused by every layer (FlashInfer's plan/run split).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import INDEX_FP4_BLOCK, INDEX_FP8_BLOCK, KV_FP8_BLOCK, ModelConfig
from nki_kernels import quant

KVKey = torch.Tensor | tuple  # what indexes a store's leading dims


class KVStore:
    """One store of a layer (its window ring, compressed-entry pool or indexer-key pool) read and written like a
    tensor of values [..., D] in the compute dtype: `store[idx]` dequantises the rows at `idx` (leading dims only),
    `store[idx] = values` quantises and writes them, `shape` is the values' shape. Formats, told apart by the
    tensors (module docstring): "auto" (`data` holds the values), "fp8" (`data` e4m3 bytes of the non-RoPE dims,
    `scale` one byte per 64, `rope` the RoPE dims), "fp8/128" (`data` e4m3 bytes of all dims, `scale` one byte per
    128), "fp4" (`data` e2m1 codes two per byte, `scale` one byte per 32)."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor | None = None, rope: torch.Tensor | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self.data, self.scale, self.rope = data, scale, rope
        if scale is None:
            self.fmt, width = "auto", data.shape[-1]
        elif rope is not None:
            self.fmt, width = "fp8", data.shape[-1] + rope.shape[-1]
        elif data.shape[-1] == INDEX_FP8_BLOCK * scale.shape[-1]:
            self.fmt, width = "fp8/128", data.shape[-1]
        else:
            self.fmt, width = "fp4", 2 * data.shape[-1]
        self.dtype = data.dtype if scale is None else rope.dtype if rope is not None else dtype
        self.shape = (*data.shape[:-1], width)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.data, self.scale, self.rope) if t is not None)

    def __getitem__(self, idx: KVKey) -> torch.Tensor:
        if self.fmt == "auto":
            return _rows(self.data, idx)
        if self.fmt == "fp8":
            nope = quant.fp8_dequant(_rows(self.data, idx), _rows(self.scale, idx), KV_FP8_BLOCK, self.dtype)
            return torch.cat([nope, _rows(self.rope, idx)], -1)
        if self.fmt == "fp8/128":
            return quant.fp8_dequant(_rows(self.data, idx), _rows(self.scale, idx), INDEX_FP8_BLOCK, self.dtype)
        return quant.fp4_dequant(quant.unpack_nibbles(_rows(self.data, idx)), _rows(self.scale, idx),
                                 INDEX_FP4_BLOCK, self.dtype)

    def __setitem__(self, idx: KVKey, values: torch.Tensor) -> None:
        if self.fmt == "auto":
            self.data[idx] = values.to(self.data.dtype)
            return
        if self.fmt == "fp8":
            nope = self.data.shape[-1]
            codes, scale = quant.fp8_quant(values[..., :nope], KV_FP8_BLOCK)
            self.rope[idx] = values[..., nope:].to(self.rope.dtype)
        elif self.fmt == "fp8/128":
            codes, scale = quant.fp8_quant(values, INDEX_FP8_BLOCK)
        else:
            codes, scale = quant.fp4_quant(values, INDEX_FP4_BLOCK)
            codes = quant.pack_nibbles(codes)
        self.data[idx] = codes
        self.scale[idx] = scale


def _rows(t: torch.Tensor, idx: KVKey) -> torch.Tensor:
    """`t[idx]`; an index tensor alone (whole rows of the leading dim: a decode step's ring and pool reads) by
    `index_select`, the same values: tensor indexing runs torch's generic index kernel, which copied a [8, 128, 128]
    ring 5.5x slower than index_select's row copies (81 vs 15 us; a [1, 128, 128] ring 12 vs 3.3 us)."""
    if isinstance(idx, torch.Tensor) and idx.dtype in (torch.int64, torch.int32):
        return t.index_select(0, idx.reshape(-1)).view(*idx.shape, *t.shape[1:])
    return t[idx]


# The KV state is written and read through these four helpers only (one place per kind of access); each store is a
# `KVStore` (engine/model/cache.py: values in, values out, whatever bytes --kv-cache-dtype keeps).
def write_ring(win_kv: KVStore, slots: torch.Tensor | int, rows: torch.Tensor, kv: torch.Tensor) -> None:
    """Window-ring write: kv [..., D] into win_kv [S, wl, D] at (slots, rows) (broadcast index tensors)."""
    win_kv[slots, rows] = kv


def ring_keys(win_kv: KVStore, slots: torch.Tensor | int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Window-ring read: the whole ring of each slot (`rows` None: [B, wl, D]) or the rows (slots, rows)."""
    return win_kv[slots] if rows is None else win_kv[slots, rows]


def write_pool(pool: KVStore, blocks: torch.Tensor, rows: torch.Tensor, entries: torch.Tensor) -> None:
    """Pool write: entries [..., D] into pool [NB, epb, D] at (blocks, rows) (compressed entries, indexer keys)."""
    pool[blocks, rows] = entries


def gather_pool(pool: KVStore, tables: torch.Tensor) -> torch.Tensor:
    """Pool read: every entry of the blocks of `tables` [B, nb] in order -> [B, nb * epb, D]."""
    return pool[tables].flatten(1, 2)


def gather_entries(pool: KVStore | torch.Tensor, tables: torch.Tensor, num: int) -> torch.Tensor:
    """Local entries 0..num-1 of each sequence: pool [NB, epb, D] (a KVStore: values), tables [B, max_blocks] ->
    [B, num, D]."""
    epb = pool.shape[1]
    nblk = -(-num // epb)
    return gather_pool(pool, tables[:, :nblk])[:, :num]


@dataclass
class LayerCache:
    ratio: int
    win_kv: torch.Tensor  # [S, win, D]
    cmp_kv: torch.Tensor | None = None  # [S, coff*m, coff*D] fp32
    cmp_score: torch.Tensor | None = None  # [S, coff*m, coff*D] fp32
    cmp_pool: torch.Tensor | None = None  # [NB, block_size/m, D]
    idx_kv: torch.Tensor | None = None  # [S, 2m, 2*Di] fp32 (CSA only)
    idx_score: torch.Tensor | None = None
    idx_pool: torch.Tensor | None = None  # [NB, block_size/m, Di]
    # kv_dtype "fp8" (module docstring): win_kv / cmp_pool / idx_pool then hold the bytes, these the rest
    win_kv_scale: torch.Tensor | None = None
    win_kv_rope: torch.Tensor | None = None
    cmp_pool_scale: torch.Tensor | None = None
    cmp_pool_rope: torch.Tensor | None = None
    idx_pool_scale: torch.Tensor | None = None
    # prefix caching: this layer's views of the slot-state snapshots (KVCache.snap_roots), eager chunks write them
    snap: LayerCache | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype the stores read back in."""
        return (self.win_kv if self.win_kv_rope is None else self.win_kv_rope).dtype

    def __post_init__(self) -> None:
        """The stores, made once (a decode step reads them in every layer; a LayerCache's tensors are never
        reassigned): `win_store`, and for compressed layers `cmp_store` and, CSA, `idx_store` (else None)."""
        self.win_store = KVStore(self.win_kv, self.win_kv_scale, self.win_kv_rope)
        self.cmp_store = KVStore(self.cmp_pool, self.cmp_pool_scale, self.cmp_pool_rope) \
            if self.cmp_pool is not None else None
        self.idx_store = KVStore(self.idx_pool, self.idx_pool_scale, dtype=self.dtype) \
            if self.idx_pool is not None else None

    def reset_slot(self, slot: int) -> None:
        for st in self.win_store.tensors():
            st[slot].zero_()
        for st in (self.cmp_kv, self.idx_kv):
            if st is not None:
                st[slot].zero_()
        for st in (self.cmp_score, self.idx_score):
            if st is not None:
                st[slot].fill_(float("-inf"))


def ring_rows(win: int, cp: int, spare: int = 0) -> int:
    """Window-ring rows per rank: this rank's share of a window (win / cp) plus room for `spare` positions past the
    last accepted one (speculative drafts), so a rejected draft never overwrites a position a later query needs."""
    return win // cp + -(-spare // cp)


Spec = dict[str, tuple[tuple[int, ...], torch.dtype]]


def _kv_spec(name: str, lead: tuple[int, ...], d: int, rd: int, dtype: torch.dtype, kv_dtype: str) -> Spec:
    """A window ring / compressed pool of rows [*lead, d] (the trailing rd dims RoPE) in the KV dtype's layout."""
    if kv_dtype == "auto":
        return {name: ((*lead, d), dtype)}
    nope = d - rd
    return {name: ((*lead, nope), torch.uint8), f"{name}_scale": ((*lead, nope // KV_FP8_BLOCK), torch.uint8),
            f"{name}_rope": ((*lead, rd), dtype)}


def _key_spec(name: str, lead: tuple[int, ...], di: int, dtype: torch.dtype, kv_dtype: str, index_keys: str) -> Spec:
    """An indexer-key pool of rows [*lead, di]: compute dtype, e4m3 + 1/128 scales or packed e2m1 + 1/32 scales."""
    if kv_dtype == "auto":
        return {name: ((*lead, di), dtype)}
    if index_keys == "fp4":
        return {name: ((*lead, di // 2), torch.uint8), f"{name}_scale": ((*lead, di // INDEX_FP4_BLOCK), torch.uint8)}
    return {name: ((*lead, di), torch.uint8), f"{name}_scale": ((*lead, di // INDEX_FP8_BLOCK), torch.uint8)}


def _layer_spec(cfg: ModelConfig, m: int, num_slots: int, num_blocks: int, block_size: int, cp: int,
                dtype: torch.dtype, spare: int = 0, kv_dtype: str = "auto", index_keys: str = "fp8") -> Spec:
    """Shapes and dtypes of one layer's tensors (compress ratio m) in the `kv_dtype` layout (module docstring)."""
    d, di, win, rd = cfg.head_dim, cfg.index_head_dim, cfg.window_size, cfg.rope_head_dim
    spec = _kv_spec("win_kv", (num_slots, ring_rows(win, cp, spare)), d, rd, dtype, kv_dtype)
    if m:
        csa = ModelConfig.ratio_is_csa(m)
        coff = 2 if csa else 1
        spec["cmp_kv"] = spec["cmp_score"] = ((num_slots, coff * m + spare, coff * d), torch.float32)
        spec.update(_kv_spec("cmp_pool", (num_blocks, block_size // (m * cp)), d, rd, dtype, kv_dtype))
        if csa:
            spec["idx_kv"] = spec["idx_score"] = ((num_slots, 2 * m + spare, 2 * di), torch.float32)
            spec.update(_key_spec("idx_pool", (num_blocks, block_size // (m * cp)), di, dtype, kv_dtype, index_keys))
    return spec


@dataclass(frozen=True)
class KVBytes:
    """Bytes of the cache layout (`_layer_spec`, the tensors KVCache allocates) for a set of layers, on one of `cp`
    ranks: `per_block` = one pool block (the compressed entries and indexer keys of `block_size` token positions,
    with their scales; this rank's share), `per_slot` = one sequence's fixed state (window ring with its scales and
    RoPE part, compressor and indexer partial states)."""

    block_size: int
    per_block: int
    per_slot: int
    cp: int = 1

    @property
    def per_token(self) -> float:
        """KV bytes per token of context, all ranks together, asymptotically (the pool; the fixed state amortised
        away): sum over compressed layers of (entry + indexer key bytes) / compress ratio."""
        return self.per_block * self.cp / self.block_size

    def rank_bytes(self, context: int, batch: int = 1) -> int:
        """Bytes on one rank for `batch` sequences of `context` tokens each (whole blocks, as the pool allocates)."""
        return batch * (self.per_slot + -(-context // self.block_size) * self.per_block)

    def per_token_at(self, context: int) -> float:
        """KV bytes per token of one sequence of `context` tokens, fixed state and block rounding included."""
        return self.rank_bytes(context) * self.cp / context

    def longest_context(self, free_bytes: float, batch: int = 1) -> int:
        """The longest context per sequence (whole blocks) of `batch` sequences that fits `free_bytes` on a rank."""
        per_seq = free_bytes / batch - self.per_slot
        return max(0, int(per_seq // self.per_block)) * self.block_size if per_seq > 0 and self.per_block else 0


def kv_bytes(cfg: ModelConfig, layer_ids: list[int], dtype: torch.dtype, block_size: int, cp: int = 1,
             spare: int = 0, kv_dtype: str = "auto", index_keys: str = "fp8") -> KVBytes:
    """`KVBytes` of `layer_ids` from the same `_layer_spec` KVCache allocates from (no tensor is made)."""
    per_block = per_slot = 0
    for lid in layer_ids:
        spec = _layer_spec(cfg, cfg.compress_ratios[lid], 1, 1, block_size, cp, dtype, spare, str(kv_dtype),
                           index_keys)
        for name, (shape, dt) in spec.items():
            n = math.prod(shape) * torch.empty((), dtype=dt).element_size()
            if "_pool" in name:
                per_block += n
            else:
                per_slot += n
    return KVBytes(block_size=block_size, per_block=per_block, per_slot=per_slot, cp=cp)


class KVCache:
    """All layers' state for `num_slots` sequences and a pool of `num_blocks` x `block_size` positions.

    Storage is a few **root tensors** per compress ratio, stacked over the layers of that ratio
    (`roots[m]["win_kv"]` is [L_m, S, win, D], ...); `layers[lid]` holds views into them. A compiled region takes
    the roots of its layer's ratio and slices its layer inside the graph (`layer_view`), instead of being passed
    every per-layer tensor. With `scratch=True` there is one extra slot (index num_slots) and one extra pool block
    (index num_blocks) that padded rows of a static-shape decode batch write to (engine/regions.py).
    """

    def __init__(self, cfg: ModelConfig, num_slots: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                 layer_ids: list[int], cp: int = 1, device: torch.device | str = "cpu", scratch: bool = False,
                 spare: int = 0, kv_dtype: str = "auto", index_keys: str = "fp8", snapshots: int = 0) -> None:
        """Under context parallelism (cp > 1) this holds one rank's share: win/cp ring rows and block_size/(m*cp)
        entries per block (engine/parallel.py). `spare`: draft positions past the last accepted token that the
        slot state must hold without displacing anything (speculative decoding; see the module docstring).
        `kv_dtype` "auto" | "fp8" and `index_keys` "fp8" | "fp4": the stores' layout (module docstring).
        `snapshots`: copies of a slot's state kept for prefix caching (`save_state`)."""
        for lid in layer_ids:
            m = cfg.compress_ratios[lid]
            if m and block_size % (m * cp):
                raise ValueError(f"block_size={block_size} is not a multiple of compress ratio {m} x cp {cp} "
                                 f"(layer {lid})")
        if cfg.window_size % cp:
            raise ValueError(f"window_size={cfg.window_size} is not divisible by cp={cp}")
        self.num_slots, self.num_blocks, self.block_size = num_slots, num_blocks, block_size
        self.scratch, self.spare = scratch, spare
        self.layout = kv_bytes(cfg, layer_ids, dtype, block_size, cp, spare, str(kv_dtype), index_keys)
        extra = 1 if scratch else 0
        by_ratio: dict[int, list[int]] = {}
        for lid in layer_ids:
            by_ratio.setdefault(cfg.compress_ratios[lid], []).append(lid)
        self.roots: dict[int, dict[str, torch.Tensor]] = {}
        self.where: dict[int, tuple[int, int]] = {}  # layer id -> (ratio, index in its ratio's roots)
        for m, lids in by_ratio.items():
            spec = _layer_spec(cfg, m, num_slots + extra, num_blocks + extra, block_size, cp, dtype, spare,
                               str(kv_dtype), index_keys)
            roots = {}
            for name, (shape, dt) in spec.items():
                fill = float("-inf") if name.endswith("_score") else 0.0
                roots[name] = torch.full((len(lids), *shape), fill, dtype=dt, device=device)
            self.roots[m] = roots
            for i, lid in enumerate(lids):
                self.where[lid] = (m, i)
        self.layers: dict[int, LayerCache] = {lid: self.layer_view(lid, self.roots[self.where[lid][0]])
                                              for lid in layer_ids}
        # Prefix caching: snapshots of the slot state at a cached block boundary P (engine/kv_cache.py). The window
        # ring (every row: it is indexed by position) and, on CSA ratios, the compressor and indexer partial states
        # (the block before P is pooled with the first block after it). HCA states are not kept: at a boundary the
        # current block is empty and HCA pools no previous block, so a reset slot is already that state.
        self.snap_roots: dict[int, dict[str, torch.Tensor]] = {}
        if snapshots:
            for m, roots in self.roots.items():
                csa = ModelConfig.ratio_is_csa(m)
                keep = [n for n in roots if "_pool" not in n and (n.startswith("win_kv") or csa)]
                self.snap_roots[m] = {n: torch.zeros((roots[n].shape[0], snapshots, *roots[n].shape[2:]),
                                                     dtype=roots[n].dtype, device=roots[n].device) for n in keep}
            for lid, lc in self.layers.items():
                m, i = self.where[lid]
                lc.snap = LayerCache(ratio=m, **{name: t[i] for name, t in self.snap_roots[m].items()})

    def save_state(self, slot: int, snap: int) -> None:
        """Copy slot `slot`'s snapshot-kept state (every layer) into snapshot `snap`."""
        self._copy_state(slot, snap, save=True)

    def restore_state(self, slot: int, snap: int) -> None:
        """Slot `slot`'s state from snapshot `snap` (the slot was reset: the states a snapshot omits are reset)."""
        self._copy_state(slot, snap, save=False)

    def _copy_state(self, slot: int, snap: int, save: bool) -> None:
        if not self.snap_roots:
            raise RuntimeError("this KV cache keeps no prefix snapshots (prefix caching is off)")
        for m, snaps in self.snap_roots.items():
            for name, st in snaps.items():
                live = self.roots[m][name]
                if save:
                    st[:, snap].copy_(live[:, slot])
                else:
                    live[:, slot].copy_(st[:, snap])

    def layer_view(self, lid: int, roots: dict[str, torch.Tensor]) -> LayerCache:
        """Layer `lid`'s tensors as views of `roots` (the roots of its ratio); cheap, so graphs call it inside."""
        m, i = self.where[lid]
        return LayerCache(ratio=m, **{name: t[i] for name, t in roots.items()})

    def reset_slot(self, slot: int) -> None:
        """Clear a slot's window ring and compressor states in every layer (the pool needs no reset: a sequence
        only reads entries it wrote). The slot index is a tensor, so on a graph backend one graph serves all slots."""
        idx = torch.tensor([slot], device=next(iter(self.roots.values()))["win_kv"].device)
        for roots in self.roots.values():
            for name, t in roots.items():
                if "_pool" in name:
                    continue
                t.index_fill_(1, idx, float("-inf") if name.endswith("_score") else 0.0)

    def nbytes(self) -> int:
        """Bytes of the state tensors, prefix snapshots included."""
        return sum(t.numel() * t.element_size() for group in (self.roots, self.snap_roots)
                   for roots in group.values() for t in roots.values())

    @property
    def bytes_per_token(self) -> float:
        """KV bytes per token of context (all cp ranks, this process's layers; `KVBytes.per_token`)."""
        return self.layout.per_token


def tap_ring(lc: LayerCache, slot: int, start: int, kv: torch.Tensor, taps: tuple[tuple[int, int], ...],
             win: int) -> None:
    """Prefix caching, in a chunk of one sequence (positions [start, start + len(kv)), cp = 1): for each (P, j) in
    `taps`, the window-ring rows a query at block boundary P reads (positions [P - win + 1, P)) into snapshot j,
    the earlier positions' rows copied as stored, the chunk's written as the ring write does (same bytes)."""
    ring, snap = lc.win_store, lc.snap.win_store
    wl = ring.shape[1]
    dev = kv.device
    for p_end, j in taps:
        lo = max(0, p_end - win + 1)
        old = torch.arange(lo, max(lo, min(start, p_end)), device=dev) % wl
        if old.numel():
            for st, lt in zip(snap.tensors(), ring.tensors(), strict=True):
                st[j, old] = lt[slot, old]
        new = torch.arange(max(lo, start), p_end, device=dev)
        if new.numel():
            write_ring(snap, j, new % wl, kv[new - start])


@dataclass
class SeqStep:
    """One sequence's share of a step: tokens [token_start, token_start + n) of the flat input are its positions
    [start, start + n). `snaps`: (block boundary P, snapshot j) pairs in (start, start + n] whose slot state the
    chunk saves as it passes them (prefix caching; eager chunks only)."""

    slot: int
    start: int
    n: int
    token_start: int
    block_table: torch.Tensor  # [num_blocks_of_seq] int64
    snaps: tuple[tuple[int, int], ...] = ()


@dataclass
class StepPlan:
    seqs: list[SeqStep]
    positions: torch.Tensor  # [T] int64
    block_size: int
    # decode group (sequences with one new token), batched: indices into the flat tokens, slots, positions, tables
    dec_tokens: torch.Tensor | None = None  # [B]
    dec_slots: torch.Tensor | None = None  # [B]
    dec_pos: torch.Tensor | None = None  # [B]
    dec_tables: torch.Tensor | None = None  # [B, max_blocks] (padded with 0; masked by position)
    dec_list: tuple[int, ...] = ()  # dec_pos on the host: what the layers derive without a device sync
    prefill: tuple[SeqStep, ...] = ()
    # where the host table's native attention averages a layer's input streams, at each row's slot and position
    # (attn_ops.attn_decode `hold`: DSpark's context input, engine/runner.py `ModelRunner.hold`): ({layer id: address
    # of its part of held row 0}, rows per slot, row width); and how many layers did
    hold: tuple[dict[int, int], int, int] | None = None
    held: int = 0
    # tensors every layer of the step derives alike from the plan (RoPE tables, window masks), made once: `shared`
    memo: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def shared(self, key: tuple, make: Callable[[], Any]) -> Any:
        """`make()` the first time a layer asks for `key` in this step, the same (read-only) value after that."""
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    @staticmethod
    def build(seqs: list[SeqStep], block_size: int, batch_decode: bool = True,
              device: torch.device | str = "cpu", decode_rows: int = 1) -> StepPlan:
        """Index tensors of the step, built on the host and copied to `device` (prefill block tables too).
        `decode_rows`: a sequence of up to that many tokens (a verify step: the last token + its drafts; a draft
        head's catch-up) joins the decode group as one row per token - queries at consecutive positions of one slot,
        causal among themselves - so it runs the decode path (and its native one-call layer) like plain decode rows.
        Exact while decode_rows - 1 <= the cache's `spare` positions: the step writes every row's state before any
        row reads, and a row's ring and compressor-state writes then land on rows no earlier row of the step reads
        (the rings are indexed by position with `spare` extra rows; `_ring_valid` masks the later rows' positions)."""
        if batch_decode and decode_rows > 1:
            seqs = _as_rows(seqs, decode_rows)
        # index lists on the host, one tensor each (a step's plan is built every step: per-sequence tensors cost more
        # than the layers' native calls at small widths)
        positions = torch.tensor([p for s in seqs for p in range(s.start, s.start + s.n)])
        plan = StepPlan(seqs=seqs, positions=positions.to(device), block_size=block_size)
        dec = [s for s in seqs if s.n == 1] if batch_decode else []
        plan.prefill = tuple(dataclasses.replace(s, block_table=s.block_table.to(device))
                             for s in seqs if not (batch_decode and s.n == 1))
        if dec:
            plan.dec_tokens = torch.tensor([s.token_start for s in dec], device=device)
            plan.dec_slots = torch.tensor([s.slot for s in dec], device=device)
            plan.dec_list = tuple(s.start for s in dec)
            plan.dec_pos = (positions if len(dec) == len(seqs) else torch.tensor(plan.dec_list)).to(device)
            tables = [s.block_table for s in dec]
            width = max(1, max(len(t) for t in tables))
            if all(len(t) == width for t in tables):
                plan.dec_tables = torch.stack(tables).to(device)
            else:
                plan.dec_tables = torch.zeros(len(dec), width, dtype=torch.long)
                for i, t in enumerate(tables):
                    plan.dec_tables[i, : len(t)] = t
                plan.dec_tables = plan.dec_tables.to(device)
        return plan


def _as_rows(seqs: list[SeqStep], most: int) -> list[SeqStep]:
    """`seqs` with each sequence of 2..`most` tokens and no prefix-cache taps split into one-token steps."""
    if all(s.n == 1 or s.n > most or s.snaps for s in seqs):
        return seqs
    out = []
    for s in seqs:
        if 1 < s.n <= most and not s.snaps:
            out += [SeqStep(s.slot, s.start + j, 1, s.token_start + j, s.block_table) for j in range(s.n)]
        else:
            out.append(s)
    return out


@dataclass
class DraftInput:
    """One sequence's share of a draft call: the target just processed positions [start, start + n) of slot `slot`
    and their states are final (n = 1 + accepted drafts after a verify step; a prefill chunk's length after one)."""

    slot: int
    start: int
    n: int
    # the sequence's block table, a tensor or the engine's list (the MTP layer is sliding-only: read for a plan only)
    block_table: torch.Tensor | list[int]

    @property
    def last(self) -> int:
        """The last final position: the drafts are the tokens at last + 2, last + 3, ... (last + 1 = the bonus)."""
        return self.start + self.n - 1
