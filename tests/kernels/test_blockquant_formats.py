"""trn2 FP8 re-blocking and the in-kernel FP4 unpack are exact; kernel wrapper vs reference on random shapes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nki_kernels import blockquant, formats, rmsnorm, swiglu
from nki_kernels.reference import rms_norm
from nki_kernels.reference import swiglu as swiglu_ref


def test_to_trn2_fp8_fits_240_and_dequantises_to_the_same_weight():
    w = torch.randn(200, 300) * 0.05
    w8, s = formats.quant_fp8_block(w)  # OCP e4m3fn, max 448
    assert w8.float().abs().max() > 240  # the checkpoint really uses the e4m3fn range
    codes, sT = blockquant.to_trn2_fp8(w8, s)
    vals = codes.T.view(ml_dtypes.float8_e4m3).astype(np.float32)  # [N, K]
    assert np.isfinite(vals).all() and np.abs(vals).max() <= 240
    scale = torch.from_numpy(sT.T).repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    got = torch.from_numpy(vals) * scale
    want = formats.dequant_fp8_block(w8, s)
    # exact except e4m3 subnormals below 2^-9 of a halved block (they round)
    assert (got - want).abs().max() <= (2.0**-10) * scale.max()
    assert (got == want).float().mean() > 0.99


def test_fp4_unpack_is_exact_for_all_16_codes():
    # 16 codes in each nibble position, scale 2^e: x = identity, so the GEMM returns W^T exactly
    lo = torch.arange(16, dtype=torch.uint8).repeat(2)  # 32 values
    hi = torch.arange(15, -1, -1, dtype=torch.uint8).repeat(2)
    packed = (lo | (hi << 4)).view(torch.int8).reshape(1, 32).repeat(3, 1)  # [N=3, K/2=32]
    scale = formats.ue8m0_from_exponent(torch.tensor([[-3, 0], [2, 5], [-10, 1]]))  # [3, K/32=2]
    eye = torch.eye(64, dtype=torch.bfloat16)
    y = blockquant.fp4_linear(eye, packed, scale, executor="stand-in")  # [64, 3] = W^T
    want = formats.dequant_fp4(packed, scale, torch.float32).t()
    assert torch.equal(y.float(), want)


@settings(max_examples=12, deadline=None)
@given(t=st.integers(1, 150), d=st.integers(1, 300), bf16=st.booleans())
def test_rmsnorm_matches_reference_on_random_shapes(t, d, bf16):
    dt = torch.bfloat16 if bf16 else torch.float32
    x = torch.randn(t, d).to(dt)
    w = torch.rand(d).to(dt)
    got = rmsnorm.rmsnorm(x, w, 1e-6, executor="stand-in").float()
    want = rms_norm(x.float(), w.float(), 1e-6)
    tol = 2e-2 if bf16 else 1e-5
    assert (got - want).abs().max() <= tol * max(1.0, want.abs().max().item())


@settings(max_examples=12, deadline=None)
@given(t=st.integers(1, 140), f=st.integers(1, 2100), limit=st.sampled_from([0.0, 1.0, 10.0]))
def test_swiglu_matches_reference_on_random_shapes(t, f, limit):
    g, u = torch.randn(t, f) * 5, torch.randn(t, f) * 5
    got = swiglu.swiglu(g, u, limit, executor="stand-in")
    assert torch.allclose(got, swiglu_ref(g, u, limit), rtol=1e-5, atol=1e-5)


@settings(max_examples=8, deadline=None)
@given(w=st.integers(1, 9), m=st.sampled_from([1, 4, 16]), d=st.integers(1, 140), overlap=st.booleans(),
       prev=st.booleans())
def test_compress_pool_matches_reference_on_random_shapes(w, m, d, overlap, prev):
    from nki_kernels import compress_pool
    from nki_kernels.reference import compress_pool as pool_ref

    c = 2 * d if overlap else d
    kv, sc = torch.randn(w, m, c), torch.randn(w, m, c) * 3
    pk, ps = (torch.randn(m, c), torch.randn(m, c)) if (prev and overlap) else (None, None)
    got = compress_pool.compress_pool(kv, sc, overlap, pk, ps, executor="stand-in")
    assert torch.allclose(got, pool_ref(kv, sc, overlap, pk, ps), rtol=1e-5, atol=1e-5)


@settings(max_examples=8, deadline=None)
@given(t=st.integers(1, 3), h=st.integers(1, 16), d=st.integers(1, 200), n=st.integers(1, 300),
       p=st.floats(0.0, 1.0))
def test_sparse_attn_matches_reference_on_random_shapes(t, h, d, n, p):
    from nki_kernels import sparse_attn
    from nki_kernels.reference import sparse_attn as attn_ref

    q, kv = torch.randn(1, t, h, d), torch.randn(1, n, d)
    valid = torch.rand(1, t, n) < p
    sink = torch.randn(h)
    got = sparse_attn.sparse_attn(q, kv, valid, sink, d ** -0.5, executor="stand-in")
    assert torch.allclose(got, attn_ref(q, kv, valid, sink, d ** -0.5), rtol=1e-4, atol=1e-5)
