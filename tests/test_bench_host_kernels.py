"""scripts/bench_host_kernels.py: its checkpoint-like FP8 weights are what a checkpoint holds (the bench's numbers on
them stand for real weights), and each timed call reads a weight copy no other call of its round read."""

from __future__ import annotations

import torch

from nki_kernels import reference as R
from tests.scripts import load_script


def _script():
    return load_script("scripts/bench_host_kernels.py")


def test_checkpoint_like_fp8_weights_are_the_quantised_gaussian() -> None:
    bench = _script()
    n, k = 300, 640  # partial 128-blocks on both sides
    codes, scales = bench._fp8_checkpoint(n, k, torch.Generator().manual_seed(3))
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3))
    assert codes.dtype == scales.dtype == torch.uint8 and scales.shape == (3, 5)
    dense = R.fp8_dequant_rows(codes, scales, 0, n)
    step = torch.exp2(scales.float() - 127).repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    # e4m3 keeps 3 mantissa bits: each element within half a spacing (2^-4 relative, or 2^-10 absolute below 2^-6)
    assert bool(((dense - w).abs() <= torch.maximum(w.abs() / 16, step * 2.0**-10)).all())
    assert int(((codes & 0x7F) == 0x7F).sum()) == 0  # no NaN code
    for b in range(3):  # amax / scale fits e4m3 (<= 448) and uses its top binade (> 224)
        for c in range(5):
            blk = w[128 * b:128 * (b + 1), 128 * c:128 * (c + 1)].abs().max() / 2.0 ** (int(scales[b, c]) - 127)
            assert 224 < float(blk) <= 448
    sub = ((codes & 0x7F) >= 1) & ((codes & 0x7F) <= 7)
    assert float(sub.float().mean()) < 1e-3  # random bytes: 14 / 256


def test_each_call_reads_its_own_weight_copy() -> None:
    bench = _script()
    seen: list[int] = []
    fns = {name: (lambda j: seen.append(j)) for name in ("reference", "a", "b")}
    bench._timed(fns, {}, repeats=5, budget_s=60.0)
    assert seen == list(range(len(seen))) and len(seen) == 3 * 6


def test_a_turn_is_a_burst_of_calls_in_a_row_timed_per_call() -> None:
    bench = _script()
    calls: list[tuple[str, int]] = []
    fns = {name: (lambda j, n=name: calls.append((n, j))) for name in ("reference", "a", "b")}
    times = bench._timed(fns, {}, repeats=4, budget_s=60.0, burst=3)
    assert [j for _, j in calls] == list(range(3 * 5 * 3))  # still one copy per call
    turns = [calls[i:i + 3] for i in range(0, len(calls), 3)]
    assert all(len({n for n, _ in t}) == 1 for t in turns)  # a turn is one impl's calls in a row
    assert all(len(v) == 4 for v in times.values())  # one time per turn after the warm-up round


def test_cold_copies_fill_twice_the_last_level_cache_for_small_weights() -> None:
    bench = _script()
    one = bench._weights("fp4", *bench.SHAPES["expert_w1"][1:], 0)  # the smallest bench shape, ~270 KiB
    copies = bench._copies(bench._bytes(one), warm=False)
    assert copies * bench._bytes(one) >= 2 * bench.last_level_cache()  # a cap of 64 copies gave 17 MiB here
    assert bench._copies(bench._bytes(one), warm=True) == 1
