"""Packs: the static arguments of one layer's native call (pointers, formats, sizes), made once and made again when
a tensor they point into moves, and the per-call checks of the packed calls."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from engine.host_kernels.native import F32, max_rows

_FMT_CODE = {None: 0, "fp8": 1, "fp4": 2}  # the native weight formats (dk.h gemm: moe.c, attn.c)
_FMT_DTYPE = {None: torch.bfloat16, "fp8": torch.uint8, "fp4": torch.uint8}
_FMT_KEY = {None: "linear", "fp8": "fp8", "fp4": "fp4"}


class Pack:
    """The static arguments of one layer's native call (pointers, formats, sizes, ctypes arrays: `args`; None where
    the kernels do not take these tensors), made once by an op's `*_pack` builder and kept in a `PackStore`
    (block_decoder.py's: one per host op table). It holds every tensor its pointers point into, so they live as
    long as it does, and is made again when one of them has moved (`Tensor.set_`, `.data =`: `fresh`). A pack is
    made at a module's first decode step, when its weights are final (engine/runner.py places them before any
    kernel takes an address)."""

    __slots__ = ("_held", "args", "tag")

    def __init__(self, args: Any, held: tuple[torch.Tensor | None, ...]) -> None:
        self.args, self.tag = args, None
        self._held = tuple((t, t.data_ptr()) for t in held if t is not None)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors the pack holds."""
        return tuple(t for t, _ in self._held)

    def fresh(self) -> bool:
        for t, ptr in self._held:
            if t.data_ptr() != ptr:
                return False
        return True


def _same(a: object, b: object) -> bool:
    """a is b, or both tuples of the same objects."""
    if a is b:
        return True
    return isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) and all(
        u is v for u, v in zip(a, b, strict=True))


class PackStore:
    """Packs by (owner, key), made by `make()` the first time and again once one is not `fresh` or was made for
    another `tag` (an object the pack's tensors come from besides the owner's, e.g. a layer's KV cache: compared by
    identity, and kept alive by the pack). Owners are held weakly: the store keeps no module alive."""

    def __init__(self) -> None:
        self._packs: weakref.WeakKeyDictionary[object, dict[str, Pack]] = weakref.WeakKeyDictionary()

    def get(self, owner: object, key: str, make: Callable[[], Pack], tag: object = None) -> Pack:
        packs = self._packs.get(owner)
        if packs is None:
            packs = self._packs[owner] = {}
        pack = packs.get(key)
        if pack is None or not _same(pack.tag, tag) or not pack.fresh():
            pack = packs[key] = make()
            pack.tag = tag
        return pack


packed = PackStore().get  # a store of the package's own, for callers without one


def held(lin: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """The tensors a Linear's native GEMV reads (weight, and scale for a stored one): what a pack holds for it."""
    return (lin.weight, lin.scale) if lin.fmt is not None else (lin.weight,)


def step_rows(a: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> int | None:
    """The row count B of x [B, n, dim] when a packed call with static arguments `a` (n, dim, rd, limit_keys) takes
    x and the RoPE tables cos / sin [B, rd/2] (`rows_ok`, within every kernel's max_m), else None."""
    b = x.shape[0] if x.dim() == 3 else 0
    limit = max_rows(a.limit_keys)
    ok = rows_ok(x, (b, a.n, a.dim), limit) and rows_ok(cos, (b, a.rd // 2), limit) \
        and rows_ok(sin, (b, a.rd // 2), limit)
    return b if ok else None


def fp32_cpu(*ts: torch.Tensor) -> bool:
    """Every tensor of `ts` is fp32, contiguous and on the CPU: what a pack's static tensors must be."""
    return all(t.dtype is F32 and t.is_contiguous() and t.is_cpu for t in ts)


def rows_ok(x: torch.Tensor, shape: tuple[int, ...], limit: int) -> bool:
    """x is a CPU fp32 contiguous tensor of `shape` with 1..limit rows, outside autograd: the per-call check of a
    packed native call."""
    return x.dtype is F32 and x.is_cpu and tuple(x.shape) == shape and 0 < shape[0] <= limit \
        and x.is_contiguous() and not (x.requires_grad and torch.is_grad_enabled())

