"""Host weights on huge pages: every CPU parameter and buffer of a model moved into one 2 MiB-aligned anonymous
mapping that asks the kernel for transparent huge pages (`madvise(MADV_HUGEPAGE)`).

Why: a decode step streams every weight byte once, and on 4 KiB pages that stream pays a TLB miss every 4 KiB.
Measured on a Zen 4 VM (one thread): torch's sum over 1 GiB reads 30-32 GB/s on 4 KiB pages and 35-36 GB/s on huge
pages; the mid-v8192 decode step (engine-vs-hf's model, two engines interleaved in one process, one with its weights
here) batch 1 8.26 -> 8.00 ms (fastest quarter; median 8.63 -> 8.12), batch 8 27.6 -> 27.0 ms; mid (a 265 MB bf16
head) batch 1 18.3 -> 17.2 ms. The FP4 experts, bound by their decode, barely move; the bf16 and FP8 GEMVs do.
Linux gives anonymous memory huge pages only where asked when THP is in `madvise` mode (the default of Ubuntu and
Debian), and torch's allocator does not ask (unless `THP_MEM_ALLOC_ENABLE` is set, and then only for allocations of
2 MiB or more: most weight tensors are smaller).

The values are untouched (a byte copy); each tensor keeps its shape, strides and dtype and becomes a view of the
arena (`Tensor.set_`), so views among the weights (the MoE stacks and their experts) stay views. Call it once the
model is final and before anything has read a weight's address (the host kernels take addresses per call).
`DEEPINFER_HOST_HUGE_PAGES=off` keeps torch's own allocations.
"""

from __future__ import annotations

import contextlib
import mmap
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

HUGE = 2 << 20  # bytes of one x86-64 transparent huge page
ALIGN = 64  # each storage's offset in the arena: a cache line
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path | None = None) -> str:
    """The kernel's transparent-huge-page mode (`always`, `madvise` or `never`; `unavailable` where the kernel has
    none, or off Linux). `path`: default THP_ENABLED."""
    try:
        text = (path or THP_ENABLED).read_text()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1: end] if 0 <= start < end else "unavailable"


def why_not(mode: str = "auto") -> str | None:
    """Why host weights do not go on huge pages here in `mode` (DEEPINFER_HOST_HUGE_PAGES; None: they do)."""
    if mode == "off":
        return "off (DEEPINFER_HOST_HUGE_PAGES)"
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return "not Linux"
    thp = thp_mode()
    return None if thp in ("always", "madvise") else f"transparent huge pages: {thp}"


@dataclass
class Placement:
    """Where a model's host weights live (`ModelRunner.weights_memory`; golden's meta.json `weights.memory`)."""

    huge_pages: str  # "requested" (the arena asked for them) or why not
    thp: str  # the kernel's THP mode
    tensors: int = 0  # tensors moved
    bytes: int = 0  # bytes of the arena's storages
    huge_bytes: int | None = None  # of those, resident on huge pages (/proc/self/smaps), None where unreadable

    def as_dict(self) -> dict:
        return asdict(self)


class _Arena:
    """One private anonymous mapping of `nbytes` (+ one huge page of slack for the 2 MiB alignment), advised for
    huge pages; `tensor` is its 2 MiB-aligned uint8 view (which keeps the mapping alive)."""

    def __init__(self, nbytes: int) -> None:
        self.map = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.map.madvise(mmap.MADV_HUGEPAGE)
        whole = torch.frombuffer(self.map, dtype=torch.uint8)
        start = -whole.data_ptr() % HUGE
        self.tensor = whole[start: start + nbytes]


def _host_tensors(module: nn.Module) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in (*module.parameters(), *module.buffers()):
        if id(t) not in seen and t.device.type == "cpu" and not t.is_sparse and t.numel():
            seen.add(id(t))
            out.append(t)
    return out


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """Bytes [lo, hi) of its storage that `t` reads."""
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return t.storage_offset() * t.element_size(), (t.storage_offset() + last + 1) * t.element_size()


def place_weights(module: nn.Module, mode: str = "auto") -> Placement:
    """Move every CPU parameter and buffer of `module` (with any views among them) into one huge-page arena
    (`place`)."""
    return place(_host_tensors(module), mode)


def place(tensors: list[torch.Tensor], mode: str = "auto") -> Placement:
    """Move CPU `tensors` into one huge-page arena, each in place (`Tensor.set_`): same values, shape, strides and
    dtype. `mode` "off" (or a machine without THP) leaves them where they are; the returned `Placement` says which.
    Tensors sharing a storage share its copy: the span of that storage they read (from a cache line boundary)."""
    mode_thp = thp_mode()
    if (why := why_not(mode)) is not None:
        return Placement(huge_pages=why, thp=mode_thp)
    spans: dict[int, list] = {}  # storage address -> [storage, lo, hi, users]
    for t in tensors:
        s = t.untyped_storage()
        lo, hi = _extent(t)
        span = spans.setdefault(s.data_ptr(), [s, lo, hi, []])
        span[1], span[2] = min(span[1], lo), max(span[2], hi)
        span[3].append(t)
    offsets, total = {}, 0
    for key, span in spans.items():
        span[1] -= span[1] % ALIGN  # every dtype's offsets stay multiples of its size
        offsets[key] = total
        total += -(-(span[2] - span[1]) // ALIGN) * ALIGN
    if total == 0:
        return Placement(huge_pages="nothing to place", thp=mode_thp)
    try:
        arena = _Arena(total)
    except OSError as e:  # madvise refused (a kernel built without THP): the tensors stay where they are
        return Placement(huge_pages=f"madvise(MADV_HUGEPAGE) failed: {e}", thp=mode_thp)
    dest = arena.tensor.untyped_storage()
    base = arena.tensor.storage_offset()  # bytes: the arena view's start in the mapping's storage
    with torch.no_grad():
        for key in list(spans):
            s, lo, hi, users = spans.pop(key)  # dropped as it goes: the peak is the weights plus one storage
            at = base + offsets[key] - lo  # a byte b of the old storage is byte at + b of the mapping
            whole = torch.empty(0, dtype=torch.uint8).set_(s)
            arena.tensor[offsets[key]: offsets[key] + hi - lo].copy_(whole[lo:hi])
            for t in users:  # same shape, strides, dtype and offset within the span, now in the arena
                t.set_(dest, (at + t.storage_offset() * t.element_size()) // t.element_size(), t.shape, t.stride())
            del s, users, whole
    return Placement(huge_pages="requested", thp=mode_thp, tensors=len(tensors), bytes=total,
                     huge_bytes=_at_most(huge_resident_bytes(arena.tensor), total))


def _at_most(n: int | None, limit: int) -> int | None:
    return None if n is None else min(n, limit)  # the mapping's count includes its alignment slack


def host_buffer(nbytes: int, mode: str = "auto") -> tuple[torch.Tensor, bool]:
    """(a uint8 tensor of `nbytes`, whether it asked for huge pages): placed like `place_weights` places weights in
    `mode`, so a bandwidth probe reads memory the way the weights are read."""
    if why_not(mode) is None:
        with contextlib.suppress(OSError):  # madvise refused: torch's allocation, as where THP is never
            return _Arena(nbytes).tensor, True
    return torch.empty(nbytes, dtype=torch.uint8), False


def huge_resident_bytes(t: torch.Tensor, smaps: Path = Path("/proc/self/smaps")) -> int | None:
    """Bytes of the mapping that holds `t` resident on transparent huge pages (`AnonHugePages` in smaps); None
    where smaps cannot be read or holds no such mapping."""
    addr = t.data_ptr()
    try:
        lines = smaps.read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, _, hi = head.partition("-")
            try:
                inside = int(lo, 16) <= addr < int(hi, 16)
            except ValueError:
                inside = False
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return None
