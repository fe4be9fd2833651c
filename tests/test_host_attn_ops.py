"""The attention-tail host ops (engine/host_kernels/attn_ops.py) against the reference functions, on every build
this CPU runs (the `lib` fixture of tests/test_host_kernels.py), and the model's use of them: `rope_tail` is the
reference bit for bit, `grouped_out_proj` within the fp32 summation-order bound; a bf16 wo_a equals the fp32 one it
replaces under the reference (engine/loader.py holds it as bf16 under `--weights stored`)."""

from __future__ import annotations

import pytest
import torch

from engine.host_kernels import attn_ops as A
from nki_kernels import dispatch
from nki_kernels import reference as R
from tests.test_host_kernels import U, cache_dir, lib  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("lib")  # every test on every build this CPU runs


@pytest.mark.parametrize("x_shape,cs_shape,rd", [((1, 16, 128), (1, 1, 32), 64), ((3, 128), (3, 32), 64),
                                                 ((5, 32, 128), (5, 1, 32), 64), ((2, 7, 40), (2, 1, 20), 40),
                                                 ((4, 64), (4, 32), 64)])
def test_rope_tail_is_the_reference_bit_for_bit(x_shape, cs_shape, rd: int) -> None:
    g = torch.Generator().manual_seed(sum(x_shape))
    x = torch.randn(*x_shape, generator=g) * 10
    ang = torch.rand(*cs_shape, generator=g) * 1000
    cos, sin = ang.cos(), ang.sin()
    for inverse in (False, True):
        dispatch.reset_counts()
        got = A.rope_tail(x, cos, sin, rd, inverse)
        assert dispatch.counts() == {("host.rope_tail", "host"): 1}
        assert torch.equal(got, R.rope_tail(x, cos, sin, rd, inverse))  # separate roundings, as the torch ops


def test_rope_tail_other_cases_run_the_reference() -> None:
    g = torch.Generator().manual_seed(3)
    x, c = torch.randn(2, 4, 64, generator=g), torch.randn(2, 1, 32, generator=g)
    dispatch.reset_counts()
    for args in ((x.bfloat16(), c, c), (x.double(), c.double(), c.double()),  # dtypes
                 (x, c.view(2, 32)[:1].expand(4, 32), c.view(2, 32)[:1].expand(4, 32))):  # [T, rd/2] with 3-D x
        assert torch.equal(A.rope_tail(args[0], args[1], args[2], 64, False),
                           R.rope_tail(args[0], args[1], args[2], 64, False))
    assert dispatch.fallbacks() == {("host.rope_tail", "dtype"): 2, ("host.rope_tail", "shape"): 1}


@pytest.mark.parametrize("t,groups,r,kg", [(1, 4, 256, 512), (3, 4, 256, 512), (8, 2, 64, 100), (2, 8, 32, 64)])
def test_grouped_out_proj_with_a_bf16_weight_matches_reference(t: int, groups: int, r: int, kg: int) -> None:
    g = torch.Generator().manual_seed(t * groups + kg)
    o = torch.randn(t, groups * kg, generator=g)
    w = torch.randn(groups * r, kg, generator=g).bfloat16()
    dispatch.reset_counts()
    got = A.grouped_out_proj(o, w, groups)
    assert dispatch.counts() == {("host.grouped_out_proj", "host"): 1}
    ref = R.grouped_out_proj(o, w, groups)
    terms = torch.einsum("tgd,grd->tgr", o.view(t, groups, kg).abs(), w.float().view(groups, r, kg).abs())
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert bool(((got - ref).abs() <= 2 * kg * U * terms.reshape(t, -1) + 1e-30).all())  # fp32 summation order


def test_grouped_out_proj_other_cases_run_the_reference() -> None:
    g = torch.Generator().manual_seed(4)
    o, w = torch.randn(2, 256, generator=g), torch.randn(64, 64, generator=g)
    dispatch.reset_counts()
    assert torch.equal(A.grouped_out_proj(o, w, 4), R.grouped_out_proj(o, w, 4))  # fp32 weight
    assert torch.equal(A.grouped_out_proj(o.bfloat16(), w.bfloat16(), 4), R.grouped_out_proj(o.bfloat16(),
                                                                                             w.bfloat16(), 4))
    assert dispatch.fallbacks() == {("host.grouped_out_proj", "dtype"): 2}
    with pytest.raises(RuntimeError):
        A.grouped_out_proj(o, w.bfloat16(), 3)  # the reference's own error for a bad group count


def test_fp8_wo_a_is_exact_in_bf16() -> None:
    """Every e4m3 value times a UE8M0 scale 2^(b-127), b >= 3, is exact in bf16 (the smallest, 2^-9 * 2^-124, is
    bf16's smallest subnormal 2^-133), so holding the dequantised wo_a as bf16 changes no value; below that the
    smallest codes are not, which is why the loader checks each tensor and keeps fp32 then."""
    from nki_kernels.formats import dequant_fp8_block

    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    codes = codes[~codes.float().isnan()]
    w8 = codes.repeat(128, 1)[:, :128].contiguous()  # [128, 128]: every code in each row
    for b in (1, 3, 100, 127, 200, 254):
        s = torch.tensor([[b]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
        dense = dequant_fp8_block(w8, s, torch.float32)
        assert torch.equal(dense.bfloat16().float(), dense) == (b >= 3), b
