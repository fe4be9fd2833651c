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


def _linear(fmt: str | None, n: int, k: int, ops, g: torch.Generator):
    """A Linear of `fmt` with random non-NaN codes and scales near 1 (bf16 for fmt None), on op table `ops`."""
    from engine.model.layers import Linear

    lin = Linear(k, n, fmt)
    if fmt is None:
        lin.weight = torch.nn.Parameter((torch.randn(n, k, generator=g) / k ** 0.5).bfloat16(), requires_grad=False)
    else:
        cols = k if fmt == "fp8" else k // 2
        codes = torch.randint(0, 256, (n, cols), generator=g, dtype=torch.uint8)
        if fmt == "fp8":
            codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
            sshape = (-(-n // 128), -(-k // 128))
        else:
            sshape = (n, k // 32)
        lin.weight = torch.nn.Parameter(codes, requires_grad=False)
        lin.scale = torch.nn.Parameter(torch.randint(120, 127, sshape, generator=g, dtype=torch.uint8),
                                       requires_grad=False)
    lin.ops = ops
    return lin


@pytest.mark.parametrize("fmts", [("fp8", "fp8", "fp8"), ("fp4", None, "fp8"), (None, "fp4", None)])
@pytest.mark.parametrize("t", [1, 3])
def test_attn_qkv_in_one_call_is_the_op_by_op_host_path_bit_for_bit(fmts: tuple, t: int) -> None:
    """The host table's `attn_qkv` (one native call, attn.c) gives exactly what the composite gives op by op on the
    host's own kernels (three GEMVs, two norms, the per-head RMS, two RoPEs), and matches the reference table."""
    from engine.model.ops import REFERENCE, ops_for, with_composites

    host = ops_for("host")
    one_by_one = with_composites(type(host)(**{**vars(host), "attn_qkv_native": None}), fused_attn_tail=False)
    g = torch.Generator().manual_seed(t * 7 + len(str(fmts)))
    dim, ql, heads, hd, rd = 256, 128, 4, 64, 32
    mods = {}
    for name, (n, k), fmt in zip(("wq_a", "wq_b", "wkv"), ((ql, dim), (heads * hd, ql), (hd, dim)), fmts,
                                 strict=True):
        mods[name] = _linear(fmt, n, k, host, g)
    x = torch.randn(t, dim, generator=g)
    qn, kn = torch.rand(ql, generator=g) + 0.5, torch.rand(hd, generator=g) + 0.5
    ang = torch.rand(t, rd // 2, generator=g) * 100
    args = (x, mods["wq_a"], qn, mods["wq_b"], mods["wkv"], kn, ang.cos(), ang.sin(), heads, rd, 1e-6)
    dispatch.reset_counts()
    got = host.attn_qkv(*args)
    assert dispatch.counts() == {("host.attn_qkv", "host"): 1}
    dispatch.reset_counts()
    want = one_by_one.attn_qkv(*args)
    assert ("host.attn_qkv", "host") not in dispatch.counts() and dispatch.counts()[("host.rope_tail", "host")] == 2
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
    # kv alone (the MTP ring fill): the same kv from either path, no query made
    for table in (host, one_by_one):
        q, kv, qr = table.attn_qkv(*args, kv_only=True)
        assert q is None and qr is None and torch.equal(kv, got[1])
    for m in mods.values():
        m.ops = REFERENCE
    ref = REFERENCE.attn_qkv(*args)
    for a, b in zip(got, ref, strict=True):  # normed values of size ~1: fp32 summation order only
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), float((a - b).abs().max())
    assert torch.equal(REFERENCE.attn_qkv(*args, kv_only=True)[1], ref[1])


def test_attn_qkv_other_cases_run_op_by_op_counted() -> None:
    """A weight the native GEMVs do not take (fp32), a bf16 x and more rows than the kernels take run the composite
    op by op (the same results as the table without the native call), counted by reason."""
    from engine.host_kernels import max_m
    from engine.model.ops import ops_for, with_composites

    host = ops_for("host")
    one_by_one = with_composites(type(host)(**{**vars(host), "attn_qkv_native": None}), fused_attn_tail=False)
    g = torch.Generator().manual_seed(11)
    dim, ql, heads, hd, rd = 128, 128, 2, 64, 32
    wa, wb, wk = _linear("fp8", ql, dim, host, g), _linear("fp8", heads * hd, ql, host, g), _linear("fp8", hd, dim,
                                                                                                     host, g)
    qn, kn = torch.ones(ql), torch.ones(hd)

    def args(t: int, x_dtype=torch.float32, wkv=wk):
        ang = torch.rand(t, rd // 2, generator=g)
        return (torch.randn(t, dim, generator=g).to(x_dtype), wa, qn, wb, wkv, kn, ang.cos(), ang.sin(), heads, rd,
                1e-6)

    fp32 = _linear(None, hd, dim, host, g)
    fp32.weight = torch.nn.Parameter(fp32.weight.float(), requires_grad=False)
    limit = min(max_m("fp8"), max_m("mhc"))
    dispatch.reset_counts()
    for a in (args(2, wkv=fp32), args(2, torch.bfloat16), args(limit + 1)):
        for u, v in zip(host.attn_qkv(*a), one_by_one.attn_qkv(*a), strict=True):
            assert torch.equal(u, v)
    got = {why: n for (name, why), n in dispatch.fallbacks().items() if name == "host.attn_qkv"}
    assert got == {"weight": 1, "dtype": 1, f"M > {limit}": 1}
