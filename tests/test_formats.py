"""FP8 / FP4 / UE8M0 checkpoint formats (nki_kernels/formats.py) against their definitions."""

from __future__ import annotations

import math

import pytest
import torch

from nki_kernels.formats import (
    FP4_VALUES,
    dequant_fp4,
    dequant_fp8_block,
    float_to_fp4_codes,
    pack_fp4,
    pow2_ceil_exponent,
    quant_fp4,
    quant_fp8_block,
    ue8m0_bytes,
    ue8m0_from_exponent,
    ue8m0_to_float,
    unpack_fp4,
)


def _pow2_ceil(x: float) -> int:
    e = math.ceil(math.log2(x))
    # guard float log2 at exact powers of two
    return e - 1 if 2.0 ** (e - 1) >= x else e


def test_ue8m0_bytes_and_values():
    s = ue8m0_from_exponent(torch.tensor([-127, -1, 0, 1, 127]))
    assert s.dtype == torch.float8_e8m0fnu
    assert ue8m0_bytes(s).tolist() == [0, 126, 127, 128, 254]
    assert ue8m0_to_float(s).tolist() == [2.0**-127, 0.5, 1.0, 2.0, 2.0**127]
    raw = torch.tensor([0, 100, 127, 200, 255], dtype=torch.uint8)
    vals = ue8m0_to_float(raw)
    assert vals[:4].tolist() == [2.0 ** (b - 127) for b in (0, 100, 127, 200)]
    assert math.isnan(vals[4])  # byte 255 is NaN
    with pytest.raises(ValueError):
        ue8m0_from_exponent(torch.tensor([128]))


def test_pow2_ceil_exponent_exact():
    x = torch.tensor([1.0, 2.0, 3.0, 0.5, 0.75, 2.0**-100, 1e-4 / 448, 448.0, 1.0000001])
    assert pow2_ceil_exponent(x).tolist() == [_pow2_ceil(float(v)) for v in x]


def test_fp8_quant_scales_follow_formula():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=g) * torch.logspace(-3, 2, 300)  # blocks of very different magnitude
    w[128:, 256:] = 0.0  # an all-zero block -> amax floor 1e-4
    w8, s = quant_fp8_block(w)
    assert w8.dtype == torch.float8_e4m3fn and w8.shape == w.shape
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            amax = float(w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max())
            e = _pow2_ceil(max(amax, 1e-4) / 448.0)
            assert int(ue8m0_bytes(s)[i, j]) == e + 127, (i, j)
    assert int(ue8m0_bytes(s)[1, 2]) == 127 - 22  # ceil(log2(1e-4 / 448)) = -22
    # w8 is exactly the e4m3 rounding of w / s
    sf = ue8m0_to_float(s).repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert torch.equal(w8.float(), (w / sf).to(torch.float8_e4m3fn).float())
    assert float((w / sf).abs().max()) <= 448.0


def test_fp8_round_trip_error_bound():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 384, generator=g)
    w8, s = quant_fp8_block(w)
    back = dequant_fp8_block(w8, s)
    sf = ue8m0_to_float(s).repeat_interleave(128, 0).repeat_interleave(128, 1)
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals, absolute <= 2^-10 * s for subnormals
    assert torch.all((back - w).abs() <= torch.maximum(w.abs() * 2.0**-4, sf * 2.0**-10))


def test_fp8_dequant_exact():
    g = torch.Generator().manual_seed(2)
    raw = torch.randint(0, 256, (130, 260), generator=g, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0  # drop the NaN encodings
    w8 = raw.view(torch.float8_e4m3fn)
    sb = torch.randint(100, 150, (2, 3), generator=g, dtype=torch.uint8)
    s = sb.view(torch.float8_e8m0fnu)
    out = dequant_fp8_block(w8, s)
    ref = torch.empty(130, 260, dtype=torch.float64)
    for i in range(2):
        for j in range(3):
            blk = w8[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].to(torch.float64)
            ref[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = blk * 2.0 ** (int(sb[i, j]) - 127)
    assert torch.equal(out.double(), ref)
    assert torch.equal(dequant_fp8_block(w8, s, torch.bfloat16).double(), ref)  # exact in bf16 too
    with pytest.raises(ValueError):
        dequant_fp8_block(w8, s[:1])


def test_fp4_hand_packed_nibbles():
    # one 1x32 block with amax 6 -> scale 2^0; codes: 0.5 -> 1, -1 -> 0xA, 6 -> 7, 0 -> 0, -6 -> 0xF, 3 -> 5
    row = [0.5, -1.0, 6.0, 0.0, -6.0, 3.0] + [0.0] * 26
    packed, s = quant_fp4(torch.tensor([row]))
    assert packed.dtype == torch.int8 and packed.shape == (1, 16)
    assert ue8m0_bytes(s).tolist() == [[127]]
    b = packed.view(torch.uint8)[0].tolist()
    assert b[:3] == [0xA1, 0x07, 0x5F]  # low nibble = even element, high nibble = odd element
    assert b[3:] == [0] * 13
    assert dequant_fp4(packed, s)[0].tolist() == row
    # a second block with amax 0.75 -> scale 2^ceil(log2(0.125)) = 2^-3: 0.75 / 0.125 = 6 -> code 7
    packed, s = quant_fp4(torch.tensor([[0.75] + [0.0] * 31]))
    assert ue8m0_bytes(s).tolist() == [[124]] and packed.view(torch.uint8)[0, 0] == 0x07


def test_fp4_table_and_dequant_exact():
    g = torch.Generator().manual_seed(3)
    packed = torch.randint(-128, 128, (8, 32), generator=g, dtype=torch.int8)  # [out=8, in=64]
    sb = torch.randint(110, 140, (8, 2), generator=g, dtype=torch.uint8)
    out = dequant_fp4(packed, sb.view(torch.float8_e8m0fnu))
    u = packed.view(torch.uint8)
    for i in range(8):
        for j in range(64):
            code = int(u[i, j // 2]) >> 4 if j % 2 else int(u[i, j // 2]) & 0xF
            assert float(out[i, j]) == FP4_VALUES[code] * 2.0 ** (int(sb[i, j // 32]) - 127)
    codes = torch.randint(0, 16, (5, 64), generator=g, dtype=torch.uint8)
    assert torch.equal(unpack_fp4(pack_fp4(codes)), codes)


def test_fp4_round_to_nearest_even():
    x = torch.tensor([0.24, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, -0.25, -0.75, -5.0, -0.1])
    vals = [FP4_VALUES[c] for c in float_to_fp4_codes(x).tolist()]
    assert vals == [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.0, -1.0, -4.0, -0.0]
    ml_dtypes = pytest.importorskip("ml_dtypes")
    import numpy as np

    grid = torch.linspace(-6.5, 6.5, 2601)
    ours = torch.tensor([FP4_VALUES[c] for c in float_to_fp4_codes(grid).tolist()])
    ref = torch.from_numpy(grid.numpy().astype(ml_dtypes.float4_e2m1fn).astype(np.float32))
    assert torch.equal(ours, ref)


def test_fp4_quant_scales_and_round_trip():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(16, 96, generator=g) * torch.logspace(-4, 1, 16)[:, None]
    packed, s = quant_fp4(w)
    assert packed.shape == (16, 48) and s.shape == (16, 3)
    sb = ue8m0_bytes(s)
    for i in range(16):
        for k in range(3):
            amax = float(w[i, k * 32:(k + 1) * 32].abs().max())
            assert int(sb[i, k]) - 127 == _pow2_ceil(amax / 6.0)
    back = dequant_fp4(packed, s)
    sf = ue8m0_to_float(s).repeat_interleave(32, 1)
    # nearest grid point: error <= half the largest grid gap (2 between 4 and 6) times the scale
    assert torch.all((back - w).abs() <= sf * 1.0)
    # exactly representable inputs come back bit-exact
    exact = dequant_fp4(packed, s)
    assert torch.equal(dequant_fp4(*quant_fp4(exact)), exact)
