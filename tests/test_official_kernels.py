"""golden/official_kernels.py (CPU versions of the official kernel.py functions) against hand-computed cases and the
engine's references; and the generator's checkpoint conversion. The official model.py itself is not in this repo
(golden/make_official_golden.py imports it from a checkout), so these tests run without it."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from golden import official_kernels as ok
from nki_kernels import formats, quant, reference

g = torch.Generator().manual_seed(7)


@pytest.fixture(autouse=True)
def _all_simulation_on():
    ok.SIM.act = ok.SIM.kv_fp8 = ok.SIM.indexer_fp4 = True
    yield
    ok.SIM.act = ok.SIM.kv_fp8 = ok.SIM.indexer_fp4 = True


# ---- act_quant / fp4_act_quant ------------------------------------------------------------------------------
def test_act_quant_returns_float8_codes_and_ue8m0_scales():
    x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    y, s = ok.act_quant(x, 128, "ue8m0", torch.float8_e8m0fnu)
    assert y.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (3, 2)
    codes, scale = quant.fp8_quant(x, 128)
    assert torch.equal(y.view(torch.uint8), codes) and torch.equal(s.view(torch.uint8), scale)
    y32, s32 = ok.act_quant(x, 128, "ue8m0", torch.float32)
    assert s32.dtype == torch.float32 and torch.equal(s32, formats.ue8m0_to_float(scale))
    with pytest.raises(NotImplementedError, match="power-of-two"):
        ok.act_quant(x, 128, None, torch.float32)


def test_act_quant_in_place_on_the_non_rope_view():
    """The model calls act_quant(kv[..., :-rd], 64, 'ue8m0', ..., True): a non-contiguous view, changed in place."""
    kv = torch.randn(2, 5, 256, generator=g).to(torch.bfloat16)
    before = kv.clone()
    out = ok.act_quant(kv[..., :-64], 64, "ue8m0", torch.float8_e8m0fnu, True)
    assert out.data_ptr() == kv.data_ptr()
    assert torch.equal(kv[..., -64:], before[..., -64:])
    assert torch.equal(kv, quant.kv_fp8_qdq(before, 64))
    ok.SIM.kv_fp8 = False
    again = before.clone()
    ok.act_quant(again[..., :-64], 64, "ue8m0", torch.float8_e8m0fnu, True)
    assert torch.equal(again, before)


def test_fp4_act_quant_in_place_and_packed():
    q = torch.randn(1, 3, 16, 128, generator=g).to(torch.bfloat16)
    before = q.clone()
    ok.fp4_act_quant(q, 32, True)
    assert torch.equal(q, quant.fp4_qdq(before, 32))
    packed, s = ok.fp4_act_quant(before, 32)
    assert packed.dtype == torch.float4_e2m1fn_x2 and packed.shape == (1, 3, 16, 64) and s.shape == (1, 3, 16, 4)
    codes, scale = quant.fp4_quant(before, 32)
    assert torch.equal(packed.view(torch.uint8), formats.pack_fp4(codes).view(torch.uint8))
    ok.SIM.indexer_fp4 = False
    q2 = before.clone()
    ok.fp4_act_quant(q2, 32, True)
    assert torch.equal(q2, before)


# ---- GEMMs --------------------------------------------------------------------------------------------------
def test_fp8_gemm_hand_case_and_default_dtype():
    """x = 1.5 everywhere (K = 128, exact in e4m3); W row 0 = 0.25, row 1 = -2 (exact): C = 48, -384."""
    w = torch.stack([torch.full((128,), 0.25), torch.full((128,), -2.0)])
    w8, ws = formats.quant_fp8_block(w)
    x = torch.full((1, 1, 128), 1.5, dtype=torch.bfloat16)
    a, s = ok.act_quant(x, 128, "ue8m0", torch.float8_e8m0fnu)
    prev = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.bfloat16)
        c = ok.fp8_gemm(a, s, w8, ws, torch.float8_e8m0fnu)
    finally:
        torch.set_default_dtype(prev)
    assert c.dtype == torch.bfloat16 and c.shape == (1, 1, 2) and c.float().flatten().tolist() == [48.0, -384.0]
    ok.SIM.act = False  # unquantised activations: plain x @ W^T in fp32, out in the default dtype (fp32 here)
    xr = torch.randn(4, 128, generator=g)
    a, s = ok.act_quant(xr, 128, "ue8m0", torch.float8_e8m0fnu)
    assert a is xr
    assert torch.allclose(ok.fp8_gemm(a, s, w8, ws), xr @ formats.dequant_fp8_block(w8, ws).T, atol=1e-5)


def test_fp4_gemm_hand_case():
    """W row 0 = 0.5 (codes 1), row 1 = -6 * 2**-3 (code 15, scale 2**-3); x = 1 (K = 128): C = 64, -96."""
    w = torch.stack([torch.full((128,), 0.5), torch.full((128,), -0.75)])
    packed, ws = formats.quant_fp4(w)
    b = packed.view(torch.float4_e2m1fn_x2)
    a, s = ok.act_quant(torch.ones(1, 128), 128, "ue8m0", torch.float8_e8m0fnu)
    c = ok.fp4_gemm(a, s, b, ws, torch.float8_e8m0fnu)
    assert c.tolist() == [[64.0, -96.0]]


# ---- sparse attention ---------------------------------------------------------------------------------------
def test_sparse_attn_hand_case():
    """One head, q = [1, 0]; keys k0 = [0, 0], k1 = [2, 0], k2 = [0, 1]; picks {0, 2, none} with scale 1, sink 0:
    logits 0, 0 and the sink 0 -> o = (k0 + k2) / 3. Picks {1}: o = e^2 k1 / (e^2 + 1)."""
    q = torch.tensor([[[[1.0, 0.0]]]])
    kv = torch.tensor([[[0.0, 0.0], [2.0, 0.0], [0.0, 1.0]]])
    sink = torch.zeros(1)
    o = ok.sparse_attn(q, kv, sink, torch.tensor([[[0, 2, -1]]], dtype=torch.int32), 1.0)
    assert torch.allclose(o, torch.tensor([[[[0.0, 1 / 3]]]]))
    o = ok.sparse_attn(q, kv, sink, torch.tensor([[[1, -1, -1]]], dtype=torch.int32), 1.0)
    e2 = math.exp(2)
    assert torch.allclose(o, torch.tensor([[[[2 * e2 / (e2 + 1), 0.0]]]]))


@pytest.mark.parametrize("topk", [20, 150])  # one 64-key block, and three (online softmax across blocks)
def test_sparse_attn_matches_engine_reference_fp32(topk):
    b, m, h, d, n = 2, 3, 4, 32, 200
    q, kv = torch.randn(b, m, h, d, generator=g), torch.randn(b, n, d, generator=g)
    sink = torch.randn(h, generator=g)
    idx = torch.stack([torch.randperm(n, generator=g)[:topk] for _ in range(b * m)]).view(b, m, topk)
    idx[..., 1::3] = -1
    valid = torch.zeros(b, m, n, dtype=torch.bool)
    for bi in range(b):
        for mi in range(m):
            sel = idx[bi, mi][idx[bi, mi] >= 0]
            valid[bi, mi, sel] = True
    got = ok.sparse_attn(q, kv, sink, idx.int(), d**-0.5)
    want = reference.sparse_attn(q, kv, valid, sink, d**-0.5)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)


def test_sparse_attn_bf16_rounds_probabilities_like_the_kernel():
    """bf16 inputs: P = exp(l - max) is rounded to bf16 before P @ V, the denominator is not."""
    q = torch.randn(1, 2, 3, 16, generator=g).to(torch.bfloat16)
    kv = torch.randn(1, 10, 16, generator=g).to(torch.bfloat16)
    sink = torch.randn(3, generator=g)
    idx = torch.arange(10).view(1, 1, 10).expand(1, 2, 10).int()
    got = ok.sparse_attn(q, kv, sink, idx, 0.25)
    logits = torch.einsum("bmhd,bnd->bmhn", q.float(), kv.float()) * 0.25
    mx = logits.amax(-1, keepdim=True)
    p = torch.exp(logits - mx)
    num = torch.einsum("bmhn,bnd->bmhd", p.to(torch.bfloat16).float(), kv.float())
    den = p.sum(-1, keepdim=True) + torch.exp(sink.view(1, 1, 3, 1) - mx)
    assert got.dtype == torch.bfloat16 and torch.equal(got, (num / den).to(torch.bfloat16))


# ---- mHC sinkhorn -------------------------------------------------------------------------------------------
def test_hc_split_sinkhorn_hand_case_one_stream():
    """n = 1: pre = sigmoid(m0 s0 + b0) + eps, post = 2 sigmoid(m1 s1 + b1); comb starts at 1 + eps, then each of
    the 2*iters - 1 normalisations maps c to c / (c + eps)."""
    eps = 1e-3
    mixes = torch.tensor([[[0.5, -1.0, 2.0]]])
    scale, base = torch.tensor([2.0, 0.5, 1.0]), torch.tensor([0.1, 0.2, -0.3])
    pre, post, comb = ok.hc_split_sinkhorn(mixes, scale, base, 1, 3, eps)
    assert math.isclose(float(pre), 1 / (1 + math.exp(-(0.5 * 2 + 0.1))) + eps, rel_tol=1e-6)
    assert math.isclose(float(post), 2 / (1 + math.exp(-(-1.0 * 0.5 + 0.2))), rel_tol=1e-6)
    c = 1 + eps
    for _ in range(5):
        c = c / (c + eps)
    assert math.isclose(float(comb), c, rel_tol=1e-6)


def test_hc_split_sinkhorn_matches_engine_reference():
    n, iters, eps = 4, 20, 1e-6
    mixes = torch.randn(2, 3, (2 + n) * n, generator=g)
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn((2 + n) * n, generator=g)
    pre, post, comb = ok.hc_split_sinkhorn(mixes, scale, base, n, iters, eps)
    m = mixes.view(-1, (2 + n) * n)
    c0 = (scale[2] * m[:, 2 * n:] + base[2 * n:]).view(-1, n, n).softmax(-1) + eps
    want = reference._sinkhorn_(c0.clone(), iters, eps).view(2, 3, n, n)
    assert torch.allclose(comb, want, atol=1e-7)
    assert torch.allclose(comb.sum(-2), torch.ones(2, 3, n), atol=1e-5)  # doubly stochastic
    assert torch.allclose(pre, torch.sigmoid(scale[0] * mixes[..., :n] + base[:n]) + eps)
    assert torch.allclose(post, 2 * torch.sigmoid(scale[1] * mixes[..., n:2 * n] + base[n:2 * n]))


# ---- hadamard and installation --------------------------------------------------------------------------------
def test_hadamard_transform_and_install():
    x = torch.randn(3, 128, generator=g).to(torch.bfloat16)
    assert torch.equal(ok.hadamard_transform(x, 128**-0.5), quant.hadamard(x))
    with pytest.raises(NotImplementedError):
        ok.hadamard_transform(x, 1.0)
    saved = {k: sys.modules.get(k) for k in ("kernel", "fast_hadamard_transform")}
    try:
        ok.install()
        import fast_hadamard_transform
        import kernel

        assert kernel.sparse_attn is ok.sparse_attn and kernel.act_quant is ok.act_quant
        assert fast_hadamard_transform.hadamard_transform is ok.hadamard_transform
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
