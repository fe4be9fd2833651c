"""nki_kernels.quant (the official low-precision steps) against their definitions: scale rules, clamps, rounding ties,
subnormals, zero blocks, every code, exact round trips of stored bytes, the GEMM and bf16 index-score semantics.
Host-side float8 casts (torch's float8_e4m3fn, round-to-nearest-even) serve as an independent check of the
bit-arithmetic rounding; hand-computed cases pin the ties."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from nki_kernels import formats, quant

g = torch.Generator().manual_seed(20261203)


def _f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def _e4m3_all_values() -> torch.Tensor:
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = b.view(torch.float8_e4m3fn).float()
    return v[~v.isnan()]


# ---- scales ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("amax,want", [
    (448.0, 0), (449.0, 1), (224.0, -1), (224.5, 0), (448.0 * 2**-20, -20), (896.0, 1), (897.0, 2),
    (0.0, math.ceil(math.log2(1e-4 / 448))), (1e-4, -22), (1e-9, -22), (3.0e38, 120), (448.0 * 2.0**119, 119),
])
def test_fp8_scale_exponent(amax, want):
    got = quant.scale_exponent(torch.tensor([amax]), formats.FP8_MAX, formats.FP8_AMAX_FLOOR)
    assert got.dtype == torch.int32 and int(got) == want


@pytest.mark.parametrize("amax,want", [(6.0, 0), (6.5, 1), (3.0, -1), (0.0, -126), (6 * 2.0**-126, -126),
                                       (1.0, -2), (1.5, -2), (1.51, -1), (12.0, 1)])
def test_fp4_scale_exponent(amax, want):
    got = quant.scale_exponent(torch.tensor([amax]), formats.FP4_MAX, formats.FP4_AMAX_FLOOR)
    assert int(got) == want


def test_scale_exponent_matches_frexp_rule_on_random_blocks():
    """ceil(log2(max(amax, floor) * fp32(1/448))), as `formats.pow2_ceil_exponent` computes it with frexp."""
    amax = torch.cat([torch.rand(4000, generator=g) * 10.0 ** torch.randint(-8, 30, (4000,), generator=g),
                      448.0 * 2.0 ** torch.arange(-30, 30).float()])
    for fmt_max, floor in ((formats.FP8_MAX, formats.FP8_AMAX_FLOOR), (formats.FP4_MAX, formats.FP4_AMAX_FLOOR)):
        a = amax.clamp(min=floor) * _f32(1.0 / fmt_max)
        assert torch.equal(quant.scale_exponent(amax, fmt_max, floor), formats.pow2_ceil_exponent(a))


# ---- element rounding -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("y,want", [
    (1.0625, 1.0), (1.1875, 1.25), (-1.0625, -1.0), (3.0625 * 2, 6.0), (240.0, 240.0), (232.0, 224.0), (248.0, 256.0),
    (440.0, 448.0), (448.0, 448.0), (2.0**-10, 0.0), (3 * 2.0**-10, 2.0**-8), (5 * 2.0**-10, 2.0**-8),
    (7 * 2.0**-10, 4 * 2.0**-9), (2.0**-6 - 2.0**-10, 2.0**-6), (0.0, 0.0),
])
def test_round_e4m3_hand_cases(y, want):
    """Ties go to the even mantissa: 1.0625 is halfway 1.0 / 1.125 -> 1.0; subnormal spacing 2**-9."""
    assert float(quant.round_e4m3(torch.tensor([y]))) == want


def test_round_e4m3_equals_torch_cast_everywhere():
    vals = _e4m3_all_values().unique()
    vals = vals[vals.abs() <= 448]
    mids = (vals[1:] + vals[:-1]) / 2  # every tie between neighbours
    rand = (torch.rand(20000, generator=g) * 2 - 1) * 448 * 2.0 ** -torch.randint(0, 20, (20000,), generator=g)
    y = torch.cat([vals, mids, rand, -mids, torch.tensor([-0.0, 2.0**-12, -(2.0**-12)])])
    got = quant.round_e4m3(y)
    want = y.to(torch.float8_e4m3fn).float()
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))


@pytest.mark.parametrize("y,want", [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0),
                                    (5.0, 4.0), (5.01, 6.0), (-0.75, -1.0), (0.2, 0.0), (0.26, 0.5), (6.0, 6.0)])
def test_round_e2m1_hand_cases(y, want):
    assert float(quant.round_e2m1(torch.tensor([y]))) == want


def test_round_e2m1_matches_checkpoint_quantiser():
    y = (torch.rand(20000, generator=g) * 2 - 1) * 6
    y = torch.cat([y, torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -2.5])])
    want = formats.fp4_codes_to_float(formats.float_to_fp4_codes(y))
    assert torch.equal(quant.round_e2m1(y), want)


# ---- FP8 blocks: quant / dequant / qdq -------------------------------------------------------------------------
def _blocks_input(n_rows: int = 64, width: int = 512) -> torch.Tensor:
    x = torch.randn(n_rows, width, generator=g) * 10.0 ** torch.randint(-6, 4, (n_rows, 1), generator=g)
    x[0] = 0.0  # an all-zero row: every block at the amax floor
    x[1, :64] = 0.0  # one zero block next to non-zero ones
    x[2, 5] = 1e4  # a block with a large outlier: its small values fall into e4m3 subnormals
    x[3, :128] = 448.0 * 2.0**-3  # amax exactly 448 * 2**k
    return x


@pytest.mark.parametrize("block", [64, 128])
def test_fp8_quant_codes_equal_torch_cast(block):
    x = _blocks_input()
    codes, scale = quant.fp8_quant(x, block)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert scale.dtype == torch.uint8 and scale.shape == (x.shape[0], x.shape[1] // block)
    s = formats.ue8m0_to_float(scale).repeat_interleave(block, dim=1)
    want = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(codes, want)
    amax = x.abs().unflatten(-1, (-1, block)).amax(-1)
    want_e = formats.pow2_ceil_exponent(amax.clamp(min=1e-4) * _f32(1 / 448))
    assert torch.equal(scale.to(torch.int32) - 127, want_e)
    # zero blocks: codes 0, scale at the floor (2**-22)
    assert int(codes[0].max()) == 0 and int(scale[0, 0]) == 127 - 22
    # amax exactly 448 * 2**-3: scale 2**-3, that element's code is 448 (0x7e)
    assert int(scale[3, 0]) == 124 and int(codes[3, 0]) == 0x7E


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_dequant_of_quant_is_qdq_bitwise(dtype):
    x = _blocks_input().to(dtype)
    codes, scale = quant.fp8_quant(x, 64)
    qdq = quant.fp8_qdq(x, 64)
    assert qdq.dtype == dtype
    assert torch.equal(quant.fp8_dequant(codes, scale, 64, dtype), qdq)
    # exact in bf16: the fp32 quant-dequant cast to bf16 changes nothing
    assert torch.equal(quant.fp8_qdq(x.float(), 64).to(dtype), qdq)
    # stored bytes round-trip: qdq is idempotent, and re-quantising gives the same values
    assert torch.equal(quant.fp8_qdq(qdq, 64), qdq)
    assert torch.equal(quant.fp8_dequant(*quant.fp8_quant(qdq, 64), 64, dtype), qdq)


def test_e4m3_codes_round_trip_every_byte():
    """Every finite e4m3fn byte: decode = torch's float8 value, and quantising the 254 values as one block (amax 448,
    scale 2**0) gives the bytes back."""
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = quant.e4m3_decode(b)
    want = b.view(torch.float8_e4m3fn).float()
    finite = ~want.isnan()
    assert torch.equal(v.isnan(), ~finite) and torch.equal(v[finite], want[finite])
    vals = torch.cat([v[finite], torch.tensor([448.0, -448.0])]).view(1, 256)
    codes, scale = quant.fp8_quant(vals, 256)
    assert int(scale) == 127 and torch.equal(codes[0, :254], b[finite])


def test_kv_fp8_qdq_leaves_rope_dims_and_blocks_are_independent():
    kv = torch.randn(5, 7, 512, generator=g).to(torch.bfloat16)
    out = quant.kv_fp8_qdq(kv, rope_dim=64)
    assert out.dtype == torch.bfloat16 and torch.equal(out[..., 448:], kv[..., 448:])
    assert torch.equal(out[..., :448], quant.fp8_qdq(kv[..., :448], 64))
    kv2 = kv.clone()
    kv2[..., 64:128] *= 1000  # another block's amax changes nothing in block 0
    assert torch.equal(quant.kv_fp8_qdq(kv2, 64)[..., :64], out[..., :64])
    assert not torch.equal(out[..., :448], kv[..., :448])  # the simulation does change values
    with pytest.raises(ValueError, match="multiple"):
        quant.kv_fp8_qdq(torch.zeros(2, 100), 16)


# ---- FP4 blocks and the Hadamard rotation ---------------------------------------------------------------------
def test_fp4_every_code_and_checkpoint_agreement():
    vals = torch.tensor(formats.FP4_VALUES)  # all 16 codes (incl. -0)
    x = torch.cat([vals, vals]).view(1, 32) * 2.0**-5  # one block, amax 6 * 2**-5 -> scale 2**-5
    codes, scale = quant.fp4_quant(x, 32)
    assert int(scale) == 127 - 5
    assert codes.view(-1).tolist() == list(range(16)) * 2
    assert torch.equal(quant.fp4_dequant(codes, scale, 32), x) and torch.equal(quant.fp4_qdq(x, 32), x)
    w = torch.randn(48, 256, generator=g) * 10.0 ** torch.randint(-3, 3, (48, 1), generator=g)
    w[0, :32] = 0.0
    codes, scale = quant.fp4_quant(w, 32)
    packed, s = formats.quant_fp4(w, 32)
    assert torch.equal(formats.pack_fp4(codes), packed) and torch.equal(scale, s.view(torch.uint8))
    assert torch.equal(quant.fp4_dequant(codes, scale, 32), formats.dequant_fp4(packed, s))
    assert torch.equal(quant.fp4_qdq(w, 32), formats.dequant_fp4(packed, s))
    assert int(scale[0, 0]) == 127 - 126  # zero block: the 6 * 2**-126 floor


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("n", [1, 2, 4, 32, 128])
def test_hadamard_is_orthonormal_sylvester(n):
    x = torch.randn(3, 5, n, generator=g)
    want = (x.double() @ _sylvester(n).T) * n**-0.5
    got = quant.hadamard(x)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.allclose(quant.hadamard(got), x, atol=1e-5)  # H is symmetric and orthonormal: H H = I
    xb = x.to(torch.bfloat16)
    assert torch.equal(quant.hadamard(xb), quant.hadamard(xb.float()).to(torch.bfloat16))


def test_hadamard_rejects_other_sizes():
    with pytest.raises(ValueError, match="power of two"):
        quant.hadamard(torch.zeros(2, 96))


def test_indexer_fp4_qdq_is_rotate_then_fp4():
    x = torch.randn(2, 9, 16, 128, generator=g).to(torch.bfloat16)
    out = quant.indexer_fp4_qdq(x)
    rot = quant.hadamard(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, quant.fp4_qdq(rot, 32))
    # each 32-block of the result holds at most 15 distinct magnitudes on one power-of-two scale
    blocks = out.float().unflatten(-1, (4, 32))
    amax = blocks.abs().amax(-1, keepdim=True).clamp(min=6 * 2.0**-126)
    s = torch.ldexp(torch.ones_like(amax), formats.pow2_ceil_exponent(amax / 6))
    assert torch.equal(quant.round_e2m1(blocks / s), blocks / s) and float((blocks / s).abs().max()) <= 6


# ---- GEMMs ----------------------------------------------------------------------------------------------------
def _fp8_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    w8, s = formats.quant_fp8_block(torch.randn(n, k, generator=g) * 0.05)
    return w8.view(torch.uint8), s.view(torch.uint8)


@pytest.mark.parametrize("n", [64, 200])
def test_fp8_gemm_against_its_formula(n):
    k = 384
    x = torch.randn(6, k, generator=g) * 3
    w_u8, ws_u8 = _fp8_weight(n, k)
    a, sa = quant.fp8_quant(x, 128)
    got32 = quant.fp8_gemm(a, sa, w_u8, ws_u8, torch.float32)
    av = quant.fp8_dequant(a, sa, 128).double()
    wv = formats.dequant_fp8_block(w_u8.view(torch.float8_e4m3fn), ws_u8.view(torch.float8_e8m0fnu)).double()
    want = av @ wv.T
    assert torch.allclose(got32.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # the same loop, spelled out: unscaled codes per 128-block, times a_s * w_s, fp32 accumulation, one rounding
    acc = torch.zeros(6, n)
    sw = formats.ue8m0_to_float(ws_u8).repeat_interleave(128, 0)[:n]
    sav = formats.ue8m0_to_float(sa)
    for kb in range(k // 128):
        blk = slice(kb * 128, kb * 128 + 128)
        p = a[:, blk].view(torch.float8_e4m3fn).float() @ w_u8[:, blk].view(torch.float8_e4m3fn).float().T
        acc = acc + p * (sav[:, kb:kb + 1] * sw[:, kb])
    assert torch.equal(got32, acc)
    assert torch.equal(quant.fp8_gemm(a, sa, w_u8, ws_u8), acc.to(torch.bfloat16))
    assert torch.equal(quant.act_linear(x, w_u8, ws_u8, "fp8"), acc.to(torch.bfloat16))


def test_fp8_gemm_exact_small_case():
    """Hand case: x[k] = (k mod 16) / 4 on one 128 block (amax 3.75 -> scale 2**-6, x / s = 16 * (k mod 16), all
    exact in e4m3), W picks x[1], x[2], x[127] with weights 0.5, 0.5, -0.5 (scale 2**-9, code 256)."""
    x = (torch.arange(128, dtype=torch.float32) % 16).view(1, 128) / 4
    w = torch.zeros(3, 128)
    w[0, 1], w[1, 2], w[2, 127] = 0.5, 0.5, -0.5
    w8, s = formats.quant_fp8_block(w)
    out = quant.act_linear(x, w8.view(torch.uint8), s.view(torch.uint8), "fp8", torch.float32)
    assert out.tolist() == [[0.125, 0.25, -1.875]]
    a, sa = quant.fp8_quant(x, 128)
    assert int(sa) == 127 - 6 and torch.equal(quant.fp8_dequant(a, sa, 128), x)


def test_fp4_gemm_against_its_formula():
    k, n = 256, 40
    x = torch.randn(5, k, generator=g)
    packed, s = formats.quant_fp4(torch.randn(n, k, generator=g) * 0.1)
    a, sa = quant.fp8_quant(x, 128)
    got = quant.fp4_gemm(a, sa, packed.view(torch.uint8), s.view(torch.uint8), torch.float32)
    want = quant.fp8_dequant(a, sa, 128).double() @ formats.dequant_fp4(packed, s).double().T
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    acc = torch.zeros(5, n)
    av, wv = quant.e4m3_decode(a), formats.fp4_codes_to_float(formats.unpack_fp4(packed))
    sav, sw = formats.ue8m0_to_float(sa), formats.ue8m0_to_float(s)
    for kb in range(k // 32):
        blk = slice(kb * 32, kb * 32 + 32)
        acc = acc + (av[:, blk] @ wv[:, blk].T) * sav[:, kb // 4: kb // 4 + 1] * sw[:, kb]
    assert torch.equal(got, acc)
    assert torch.equal(quant.act_linear(x, packed.view(torch.uint8), s.view(torch.uint8), "fp4"),
                       acc.to(torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 128"):
        quant.fp4_gemm(a[:, :96], sa[:, :1], packed[:, :48].view(torch.uint8), s[:, :3].view(torch.uint8))


# ---- the indexer's bf16 scores ------------------------------------------------------------------------------
def test_index_score_bf16_equals_the_official_bf16_expression():
    """The official indexer's torch expression in bf16 (einsum, relu, product with the weights, head sum); inputs on
    a coarse grid so every fp32 sum is exact and summation order cannot matter."""
    q = (torch.randint(-8, 9, (2, 5, 16, 32), generator=g).float() / 8).to(torch.bfloat16)
    k = (torch.randint(-8, 9, (2, 11, 32), generator=g).float() / 4).to(torch.bfloat16)
    w = (torch.randn(2, 5, 16, generator=g)).to(torch.bfloat16)
    w = quant.indexer_weights_bf16(w, n_heads=16, head_dim=32)
    official = torch.einsum("bshd,btd->bsht", q, k)
    official = (official.relu_() * w.unsqueeze(-1)).sum(dim=2)
    got = quant.index_score_bf16(q, k, w)
    assert got.dtype == torch.bfloat16 and torch.equal(got, official)
    # bf16 rounding really happens: the fp32 scores differ
    f32 = (torch.einsum("bshd,btd->bsht", q.float(), k.float()).relu() * w.float().unsqueeze(-1)).sum(2)
    assert not torch.equal(got.float(), f32)


def test_indexer_weights_bf16_is_the_bf16_product():
    w = torch.randn(7, 64, generator=g).to(torch.bfloat16)
    assert torch.equal(quant.indexer_weights_bf16(w, 64, 128), w * (128**-0.5 * 64**-0.5))


# ---- device-safe form -------------------------------------------------------------------------------------------
def test_compile_safe_form():
    """No float8/float4 dtypes, bitcasts, host syncs, exp2/ldexp/pow or data-dependent shapes in the functions."""
    src = "\n".join(inspect.getsource(getattr(quant, n)) for n in quant.__all__ if callable(getattr(quant, n)))
    for bad in ("torch.float8", "torch.float4", ".view(torch.int", ".item()", ".tolist()", "nonzero", "frexp",
                "masked_select", ".numpy()", "torch.exp2", "ldexp(", "torch.pow(", "torch.log2"):
        assert bad not in src, bad


def test_traces_with_torch_export():
    class M(torch.nn.Module):
        def forward(self, kv, x, w, ws):
            codes, scale = quant.fp8_quant(kv[..., :192], 64)
            return (quant.kv_fp8_qdq(kv, 64), codes, scale, quant.indexer_fp4_qdq(kv[..., :128]),
                    quant.act_linear(x, w, ws, "fp8"))

    kv = torch.randn(3, 256, generator=g)
    x = torch.randn(2, 128, generator=g)
    w_u8, ws_u8 = _fp8_weight(64, 128)
    exported = torch.export.export(M(), (kv, x, w_u8, ws_u8))
    for got, want in zip(exported.module()(kv, x, w_u8, ws_u8), M()(kv, x, w_u8, ws_u8), strict=True):
        assert torch.equal(got, want)
