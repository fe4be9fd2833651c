"""Weight layouts of the kernels: every conversion of a weight into a kernel's operand layout (transposes, dtype
casts, fp32 scales, `blockquant.to_trn2_fp8`, stacked experts), made once per weight and kept, so that no
conversion ever runs inside a traced graph.

A conversion is named by a tag (`tag(kind, dt, groups)`, e.g. "T.torch.float32", "trn2_fp8", "woaT.torch.bfloat16.2")
and made by `make(kind, weight, *deps, dt=, groups=)`. Converted values live in two places:

* `WeightCache` (one per `KernelOps`): keyed on the weight tensor object, revalidated on every eager call (version
  counter, data pointer, shape, dtype, device of the weight and its `deps`), `conversions` counts the `make()` calls;
* the weight tensor itself, attribute `LAYOUTS` ({tag: value}): what a traced call reads. Dynamo reads an attribute
  of a graph input as another graph input (the converted tensor enters the graph as a parameter, the conversion is
  not in it), and guards on the dict's keys only, so the layers of one structure still share one graph.

The engine converts every weight a kernel will read at load (`KernelOps.prepare_*`, engine/model/kernel_weights.py),
before any graph is traced; a traced call whose layout was not prepared raises one line naming it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

LAYOUTS = "_deepinfer_layouts"  # attribute of a weight tensor: {tag: converted value}


def tag(kind: str, dt: torch.dtype | None = None, groups: int | None = None) -> str:
    return ".".join([kind, *([str(dt)] if dt is not None else []), *([str(groups)] if groups is not None else [])])


def attached(weight: torch.Tensor, name: str) -> Any:
    """The layout `name` attached to `weight` (None if absent); trace-safe."""
    found = getattr(weight, LAYOUTS, None)
    return None if found is None else found.get(name)


def attach(weight: torch.Tensor, name: str, value: Any) -> None:
    """Keep `value` on `weight` as its layout `name` (eager only)."""
    found = weight.__dict__.get(LAYOUTS)
    if found is None:
        found = {}
        setattr(weight, LAYOUTS, found)
    found[name] = value


def _sig(t: torch.Tensor) -> tuple:
    try:
        version = t._version
    except RuntimeError:  # inference tensors have no version counter
        version = -1
    return (id(t), version, t.data_ptr(), tuple(t.shape), t.dtype, str(t.device))


class WeightCache:
    """Layout conversions of weights, made once per (weight tensor, tag): `get(tag, weight, make, *deps)` returns
    the cached value while `weight` (and `deps`, e.g. the scale of an FP8 weight) are unchanged, else calls
    `make()` again. Entries die with their weight tensor. `conversions` counts the `make()` calls per tag."""

    def __init__(self) -> None:
        self._store: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.conversions: Counter[str] = Counter()

    def get(self, tag: str, weight: torch.Tensor, make: Callable[[], Any], *deps: torch.Tensor) -> Any:
        sig = tuple(_sig(t) for t in (weight, *deps))
        slot = self._store.get(weight)
        if slot is None:
            slot = {}
            self._store[weight] = slot
        hit = slot.get(tag)
        if hit is not None and hit[0] == sig:
            return hit[1]
        value = make()
        slot[tag] = (sig, value)
        self.conversions[tag] += 1
        return value

    def __len__(self) -> int:
        return sum(len(v) for v in self._store.values())


# ---- the conversions ------------------------------------------------------------------------------------------------
def _fp32(w: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
    return w.detach().float().contiguous()


def _transposed(w: torch.Tensor, *, dt: torch.dtype, **_: Any) -> torch.Tensor:
    return w.detach().to(dt).t().contiguous()


def _trn2_fp8(w_u8: torch.Tensor, scale_u8: torch.Tensor, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """On the host once per weight (NumPy e4m3 re-blocking), then to the weight's device once."""
    from nki_kernels import blockquant

    codes, sT = blockquant.to_trn2_fp8(w_u8.detach().cpu().view(torch.float8_e4m3fn), scale_u8.detach().cpu())
    return torch.from_numpy(codes).to(w_u8.device), torch.from_numpy(sT).to(w_u8.device)


def _fp4(packed_u8: torch.Tensor, scale_u8: torch.Tensor, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed bytes as they are; the UE8M0 scales decoded on the host once, then moved once."""
    from nki_kernels import formats

    s32 = formats.ue8m0_to_float(scale_u8.detach().cpu()).contiguous()
    return packed_u8.detach().contiguous(), s32.to(packed_u8.device)


def _woaT(wo_a: torch.Tensor, *, dt: torch.dtype, groups: int, **_: Any) -> torch.Tensor:
    kg, r = wo_a.shape[1], wo_a.shape[0] // groups
    return wo_a.detach().to(dt).view(groups, r, kg).transpose(1, 2).reshape(groups * kg, r).contiguous()


def _fnT(fn: torch.Tensor, **_: Any) -> torch.Tensor:
    return fn.detach().float().t().contiguous()


def _sink(sink: torch.Tensor, **_: Any) -> torch.Tensor:
    return sink.detach().float().reshape(-1, 1).contiguous()


def _stack_T(stack: torch.Tensor, *, dt: torch.dtype, **_: Any) -> torch.Tensor:
    """Dense expert stack [E, N, K] -> [E, K, N] in dt (each expert's `linear` layout)."""
    return stack.detach().to(dt).transpose(1, 2).contiguous()


def _stack_fp8(stack: torch.Tensor, scales: torch.Tensor, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [_trn2_fp8(stack[e], scales[e]) for e in range(stack.shape[0])]
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


def _stack_fp4(stack: torch.Tensor, scales: torch.Tensor, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return _fp4(stack, scales)  # elementwise decode: the stacked layout is the stack of the experts' layouts


MAKERS: dict[str, Callable[..., Any]] = {
    "fp32": _fp32, "T": _transposed, "trn2_fp8": _trn2_fp8, "fp4": _fp4, "woaT": _woaT, "fnT": _fnT, "sink": _sink,
    "stackT": _stack_T, "stack_fp8": _stack_fp8, "stack_fp4": _stack_fp4}


def make(kind: str, weight: torch.Tensor, *deps: torch.Tensor, dt: torch.dtype | None = None,
         groups: int | None = None) -> Any:
    return MAKERS[kind](weight, *deps, dt=dt, groups=groups)
