"""reference.fp8_linear / fp4_linear on stored bytes: exact dequantisation, linear() semantics, compile-safe form."""

from __future__ import annotations

import inspect

import pytest
import torch

from nki_kernels import formats, reference

g = torch.Generator().manual_seed(1234)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality, except that every NaN equals every NaN (payloads are not part of the formats)."""
    nan = torch.isnan(a)
    return bool(torch.equal(nan, torch.isnan(b)) and torch.equal(_bits(a)[~nan], _bits(b)[~nan]))


def test_every_ue8m0_byte_decodes_exactly():
    b = torch.arange(256, dtype=torch.uint8)
    assert _same_bits(reference.ue8m0_decode(b), formats.ue8m0_to_float(b))
    assert torch.isnan(reference.ue8m0_decode(b)[255])
    assert reference.ue8m0_decode(b)[0].item() == 2.0**-127  # the fp32 subnormal, not flushed


def test_every_e4m3fn_byte_decodes_exactly():
    b = torch.arange(256, dtype=torch.uint8)
    got = reference._lut(reference._E4M3FN_LUT, b)
    assert _same_bits(got, b.view(torch.float8_e4m3fn).float())
    assert torch.signbit(got[0x80])  # -0.0 keeps its sign


def test_every_e2m1_code_decodes_exactly():
    codes = torch.arange(16, dtype=torch.uint8)
    assert _same_bits(reference._lut(reference._E2M1_LUT, codes), formats.fp4_codes_to_float(codes))


@pytest.mark.parametrize("n,k", [(128, 128), (300, 200), (130, 4096), (64, 96), (1, 1)])
def test_fp8_dequant_is_bit_exact(n, k):
    w8, s = formats.quant_fp8_block(torch.randn(n, k, generator=g) * 0.05)
    w_u8, s_u8 = formats.stored_fp8(w8, s)
    want = formats.dequant_fp8_block(w8, s)
    assert _same_bits(reference.fp8_dequant_rows(w_u8, s_u8, 0, n), want)
    if n > 128:  # a chunk that starts on a block boundary
        assert _same_bits(reference.fp8_dequant_rows(w_u8, s_u8, 128, n), want[128:])


def test_fp8_dequant_rejects_unaligned_chunks():
    w8, s = formats.quant_fp8_block(torch.randn(256, 128, generator=g))
    with pytest.raises(ValueError, match="multiple"):
        reference.fp8_dequant_rows(*formats.stored_fp8(w8, s), 64, 256)


def test_fp8_extreme_scales_and_codes_exact():
    w_u8 = torch.randint(0, 256, (256, 256), generator=g, dtype=torch.uint8)
    w_u8[w_u8 & 0x7F == 0x7F] = 0x7E  # no NaN codes
    s_u8 = torch.tensor([[0, 254], [127, 100]], dtype=torch.uint8)
    want = formats.dequant_fp8_block(w_u8.view(torch.float8_e4m3fn), s_u8.view(torch.float8_e8m0fnu))
    assert _same_bits(reference.fp8_dequant_rows(w_u8, s_u8, 0, 256), want)


@pytest.mark.parametrize("n,k", [(64, 64), (200, 160), (130, 4096), (3, 32)])
def test_fp4_dequant_is_bit_exact(n, k):
    packed, s = formats.quant_fp4(torch.randn(n, k, generator=g) * 0.05)
    p_u8, s_u8 = formats.stored_fp4(packed, s)
    assert _same_bits(reference.fp4_dequant_rows(p_u8, s_u8, 0, n), formats.dequant_fp4(packed, s))


def test_fp4_all_codes_and_extreme_scales_exact():
    p_u8 = torch.randint(0, 256, (8, 64), generator=g, dtype=torch.uint8)
    s_u8 = torch.tensor([[0, 1, 127, 254]] * 8, dtype=torch.uint8)
    want = formats.dequant_fp4(p_u8.view(torch.int8), s_u8.view(torch.float8_e8m0fnu))
    assert _same_bits(reference.fp4_dequant_rows(p_u8, s_u8, 0, 8), want)


def _fp32_sum_tol(x: torch.Tensor, w: torch.Tensor) -> float:
    """A bound for fp32 summation-order differences of x @ w^T: K * eps * max_i sum_k |x w| ."""
    k = x.shape[-1]
    return float(k * 2.0**-23 * (x.float().abs() @ w.float().abs().t()).max()) + 1e-30


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,lead", [(300, 200, (7,)), (128, 128, (2, 3)), (600, 64, (5,))])
def test_fp8_linear_equals_linear_of_dequant(dtype, n, k, lead):
    w8, s = formats.quant_fp8_block(torch.randn(n, k, generator=g) * 0.05)
    x = torch.randn(*lead, k, generator=g).to(dtype)
    got = reference.fp8_linear(x, *formats.stored_fp8(w8, s))
    want = reference.linear(x, formats.dequant_fp8_block(w8, s, dtype))
    assert got.dtype == dtype and got.shape == (*lead, n)
    if dtype == torch.float32:
        assert (got - want).abs().max().item() <= _fp32_sum_tol(x, formats.dequant_fp8_block(w8, s))
    else:  # fp32 accumulation, one rounding to bf16 (as F.linear in bf16 on the host): at most 1 bf16 ulp apart
        assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_linear_equals_linear_of_dequant(dtype):
    packed, s = formats.quant_fp4(torch.randn(200, 160, generator=g) * 0.05)
    x = torch.randn(9, 160, generator=g).to(dtype)
    got = reference.fp4_linear(x, *formats.stored_fp4(packed, s))
    want = reference.linear(x, formats.dequant_fp4(packed, s, dtype))
    assert got.dtype == dtype and got.shape == (9, 200)
    if dtype == torch.float32:
        assert (got - want).abs().max().item() <= _fp32_sum_tol(x, formats.dequant_fp4(packed, s))
    else:
        assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=1e-6)


def test_chunked_decode_matches_one_chunk(monkeypatch):
    """Row chunks (small budget here) give the same result as one full decode: wq_b-like N >> chunk rows."""
    w8, s = formats.quant_fp8_block(torch.randn(1000, 256, generator=g) * 0.05)
    packed, s4 = formats.quant_fp4(torch.randn(1000, 256, generator=g) * 0.05)
    x = torch.randn(4, 256, generator=g)
    full8 = reference.fp8_linear(x, *formats.stored_fp8(w8, s))
    full4 = reference.fp4_linear(x, *formats.stored_fp4(packed, s4))
    monkeypatch.setattr(reference, "DEQUANT_CHUNK_ELEMS", 128 * 256)
    assert reference.dequant_rows(256) == 128
    assert torch.equal(reference.fp8_linear(x, *formats.stored_fp8(w8, s)), full8)
    assert torch.equal(reference.fp4_linear(x, *formats.stored_fp4(packed, s4)), full4)


def test_chunk_rows_at_v4_flash_widths():
    assert reference.dequant_rows(4096) == 512  # expert w1/w3 [2048, 4096]: 4 chunks of 8 MiB fp32
    assert reference.dequant_rows(1024) == 2048  # wq_b [32768, 1024]: 16 chunks
    assert reference.dequant_rows(10**7) == 128  # never below one FP8 block row


def test_empty_tokens():
    w8, s = formats.quant_fp8_block(torch.randn(256, 128, generator=g))
    packed, s4 = formats.quant_fp4(torch.randn(256, 128, generator=g))
    x = torch.zeros(0, 128)
    assert reference.fp8_linear(x, *formats.stored_fp8(w8, s)).shape == (0, 256)
    assert reference.fp4_linear(x.bfloat16(), *formats.stored_fp4(packed, s4)).shape == (0, 256)


def test_shape_checks():
    w8, s = formats.quant_fp8_block(torch.randn(256, 128, generator=g))
    w_u8, s_u8 = formats.stored_fp8(w8, s)
    with pytest.raises(ValueError):
        reference.fp8_linear(torch.randn(2, 128), w_u8, s_u8[:1])
    with pytest.raises(ValueError):
        reference.fp8_linear(torch.randn(2, 64), w_u8, s_u8)
    with pytest.raises(ValueError):
        reference.fp4_linear(torch.randn(2, 64), torch.zeros(8, 32, dtype=torch.uint8), torch.zeros(8, 1,
                                                                                               dtype=torch.uint8))


def test_stored_views_are_zero_copy_and_checked():
    w8, s = formats.quant_fp8_block(torch.randn(256, 128, generator=g))
    w_u8, s_u8 = formats.stored_fp8(w8, s)
    assert w_u8.dtype == s_u8.dtype == torch.uint8
    assert w_u8.data_ptr() == w8.data_ptr() and s_u8.data_ptr() == s.data_ptr()
    packed, s4 = formats.quant_fp4(torch.randn(8, 64, generator=g))
    p_u8, s4_u8 = formats.stored_fp4(packed, s4)
    assert p_u8.data_ptr() == packed.data_ptr() and p_u8.dtype == torch.uint8
    assert formats.as_bytes(p_u8) is p_u8
    with pytest.raises(TypeError):
        formats.as_bytes(torch.zeros(3))
    with pytest.raises(ValueError):
        formats.stored_fp8(w8, s[:1])
    with pytest.raises(ValueError):
        formats.stored_fp4(packed, s4[:, :1])
    with pytest.raises(TypeError):
        formats.stored_fp4(torch.zeros(8, 32), s4)


def test_compile_safe_form():
    """No float8 bitcasts, no host syncs, no data-dependent shapes in the stored-weight path."""
    src = "\n".join(inspect.getsource(f) for f in (
        reference.ue8m0_decode, reference._lut, reference.fp8_dequant_rows, reference.fp4_dequant_rows,
        reference._stored_linear, reference.fp8_linear, reference.fp4_linear))
    for bad in (".view(torch.float8", "float8_e4m3fn)", "float8_e8m0fnu", ".item()", ".tolist()", "nonzero",
                "masked_select", ".numpy()", "torch.exp2", "ldexp(", "torch.pow("):
        assert bad not in src, bad


def test_traces_with_torch_fx():
    """torch.export traces the whole path into one graph (no data-dependent control flow or host sync)."""
    w8, s = formats.quant_fp8_block(torch.randn(256, 200, generator=g) * 0.05)
    w_u8, s_u8 = formats.stored_fp8(w8, s)
    x = torch.randn(3, 200, generator=g)

    class M(torch.nn.Module):
        def forward(self, x, w, sc):
            return reference.fp8_linear(x, w, sc)

    exported = torch.export.export(M(), (x, w_u8, s_u8))
    assert torch.equal(exported.module()(x, w_u8, s_u8), reference.fp8_linear(x, w_u8, s_u8))
