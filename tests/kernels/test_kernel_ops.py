"""kernel_ops: every op == its reference on engine-shaped inputs (tiny model sizes), the kernel ran (dispatch
counters), fallbacks are explicit and counted apart, weight layouts are converted once."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from nki_kernels import cases, dispatch, formats, kernel_ops, reference

CFG = json.loads((Path(__file__).resolve().parents[2] / "golden" / "tiny" / "config.json").read_text())
DIM, H, HD = CFG["dim"], CFG["n_heads"], CFG["head_dim"]  # 128, 4, 64
N, WIN, INTER = CFG["hc_mult"], CFG["window_size"], CFG["moe_inter_dim"]  # 4, 16, 64
HI, DI, QL = CFG["index_n_heads"], CFG["index_head_dim"], CFG["q_lora_rank"]  # 16, 32, 64
GROUPS, RANK, VOCAB, EPS = CFG["o_groups"], CFG["o_lora_rank"], CFG["vocab_size"], CFG["norm_eps"]
MIX = (2 + N) * N
DTYPES = ("float32", "bfloat16")

OPS = kernel_ops.KernelOps("stand-in")


@pytest.fixture(autouse=True)
def _clean_counts():
    dispatch.reset_counts()
    yield
    dispatch.reset_counts()


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(sum(map(ord, "/".join(map(str, key)))) % 2**31)


def rnd(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _mix(g, t):
    post = 2 * torch.rand(t, N, generator=g)
    comb = torch.rand(t, N, N, generator=g)
    return post, comb / comb.sum(-1, keepdim=True)


def _fp8(g, n, k):
    return formats.stored_fp8(*formats.quant_fp8_block(rnd(g, n, k, scale=k ** -0.5)))


def _fp4(g, n, k):
    return formats.stored_fp4(*formats.quant_fp4(rnd(g, n, k, scale=k ** -0.5)))


# op -> [(label, dispatch key, builder(dtype, t, g) -> args)]: the engine's call sites at the tiny model's sizes
def _cases():
    c = []

    def add(op, label, key, build, ts=(1, 7, 130, 300)):
        c.extend((op, label, key, build, t) for t in ts)

    add("rms_norm", "attn_norm [T,128]", "rmsnorm",
        lambda dt, t, g: (rnd(g, t, DIM, dtype=dt, scale=3), rnd(g, DIM, dtype=dt) + 1, EPS))
    add("rms_norm", "q_norm [T,64]", "rmsnorm", lambda dt, t, g: (rnd(g, t, QL, dtype=dt), rnd(g, QL) + 1, EPS))
    add("rms_norm", "per-head weight=None [T,4,64]", "rmsnorm",
        lambda dt, t, g: (rnd(g, t, H, HD, dtype=dt), None, EPS))
    add("rms_norm", "compressed entry fp32 [W,64]", "rmsnorm",
        lambda dt, t, g: (rnd(g, t, HD), rnd(g, HD, dtype=dt) + 1, EPS), ts=(1, 75))
    add("swiglu", "expert [T,64]", "swiglu",
        lambda dt, t, g: (rnd(g, t, INTER, dtype=dt, scale=3), rnd(g, t, INTER, dtype=dt, scale=3),
                          CFG["swiglu_limit"]))
    add("swiglu", "no clamp [T,64]", "swiglu",
        lambda dt, t, g: (rnd(g, t, INTER, dtype=dt), rnd(g, t, INTER, dtype=dt), 0.0), ts=(5,))
    add("linear", "compressor wkv fp32 x [T,128]->[128]", "blockquant.dense",
        lambda dt, t, g: (rnd(g, t, DIM), rnd(g, 2 * HD, DIM, dtype=dt, scale=DIM ** -0.5)))
    add("linear", "weights_proj [T,128]->[16]", "blockquant.dense",
        lambda dt, t, g: (rnd(g, t, DIM, dtype=dt), rnd(g, HI, DIM, dtype=dt, scale=DIM ** -0.5)))
    add("linear", "head [T,128]->[1024]", "blockquant.dense",
        lambda dt, t, g: (rnd(g, t, DIM, dtype=dt), rnd(g, VOCAB, DIM, scale=DIM ** -0.5)), ts=(1, 12, 130))
    add("linear", "mtp h_proj [T,4,128] (leading dims)", "blockquant.dense",
        lambda dt, t, g: (rnd(g, t, N, DIM, dtype=dt), rnd(g, DIM, DIM, dtype=dt, scale=DIM ** -0.5)), ts=(3,))
    add("fp8_linear", "wq_a [T,128]->[64]", "blockquant.fp8",
        lambda dt, t, g: (rnd(g, t, DIM, dtype=dt), *_fp8(g, QL, DIM)))
    add("fp8_linear", "wq_b [T,64]->[256]", "blockquant.fp8",
        lambda dt, t, g: (rnd(g, t, QL, dtype=dt), *_fp8(g, H * HD, QL)))
    add("fp8_linear", "indexer wq_b [T,64]->[512]", "blockquant.fp8",
        lambda dt, t, g: (rnd(g, t, QL, dtype=dt), *_fp8(g, HI * DI, QL)), ts=(1, 130))
    add("fp8_linear", "wo_b [T,64]->[128]", "blockquant.fp8",
        lambda dt, t, g: (rnd(g, t, GROUPS * RANK, dtype=dt), *_fp8(g, DIM, GROUPS * RANK)))
    add("fp4_linear", "expert w1 [T,128]->[64]", "blockquant.fp4",
        lambda dt, t, g: (rnd(g, t, DIM, dtype=dt), *_fp4(g, INTER, DIM)))
    add("fp4_linear", "expert w2 [T,64]->[128]", "blockquant.fp4",
        lambda dt, t, g: (rnd(g, t, INTER, dtype=dt), *_fp4(g, DIM, INTER)))
    add("grouped_out_proj", "wo_a [T,256] G=2", "blockquant.wo_a",
        lambda dt, t, g: (rnd(g, t, H * HD, dtype=dt), rnd(g, GROUPS * RANK, H * HD // GROUPS, dtype=dt,
                                                                 scale=(H * HD // GROUPS) ** -0.5), GROUPS))
    add("hc_mixes", "site [T,4,128]", "hc_mixes",
        lambda dt, t, g: (rnd(g, t, N, DIM, dtype=dt), rnd(g, MIX, N * DIM, scale=(N * DIM) ** -0.5),
                          torch.rand(3, generator=g) + 0.5, rnd(g, MIX, scale=0.5), N, CFG["hc_sinkhorn_iters"],
                          CFG["hc_eps"], EPS))
    add("hc_collapse", "[T,4,128]", "hc_collapse",
        lambda dt, t, g: (rnd(g, t, N, DIM, dtype=dt), torch.rand(t, N, generator=g) + 1e-6))
    add("hc_expand", "[T,4,128]", "hc_expand",
        lambda dt, t, g: (rnd(g, t, DIM, dtype=dt), rnd(g, t, N, DIM, dtype=dt), *_mix(g, t)))
    add("hc_expand", "fp32 y, bf16 streams", "hc_expand",
        lambda dt, t, g: (rnd(g, t, DIM), rnd(g, t, N, DIM, dtype=dt), *_mix(g, t)), ts=(9,))
    add("hc_attn_out", "o [T,64] wo_b [128,64]", "hc_attn_out",
        lambda dt, t, g: (rnd(g, t, GROUPS * RANK, dtype=dt), rnd(g, DIM, GROUPS * RANK, dtype=dt, scale=0.125),
                          rnd(g, t, N, DIM, dtype=dt), *_mix(g, t)))
    add("hc_attn_out", "bf16 o, fp32 streams", "hc_attn_out",
        lambda dt, t, g: (rnd(g, t, GROUPS * RANK, dtype=dt), rnd(g, DIM, GROUPS * RANK, scale=0.125),
                          rnd(g, t, N, DIM), *_mix(g, t)), ts=(9,))

    def pool(w, m, c, overlap, lead=(), prev=True, ninf=False):
        def build(dt, t, g):
            kv, sc = rnd(g, *lead, w, m, c, dtype=dt), rnd(g, *lead, w, m, c, dtype=dt, scale=3)
            if not prev:
                return kv, sc, overlap
            pk, ps = rnd(g, *lead, m, c, dtype=dt), rnd(g, *lead, m, c, dtype=dt, scale=3)
            if ninf:  # a fresh state: the previous block's scores are -inf (engine/model/cache.py)
                ps = torch.full_like(ps, float("-inf"))
            return kv, sc, overlap, pk, ps
        return build

    add("compress_pool", "CSA prefill W=75 m=4 C=128 +prev", "compress_pool", pool(75, 4, 2 * HD, True), ts=(1,))
    add("compress_pool", "CSA prefill, fresh state (-inf prev)", "compress_pool",
        pool(4, 4, 2 * HD, True, ninf=True), ts=(1,))
    add("compress_pool", "CSA indexer W=20 m=4 C=64 no prev", "compress_pool",
        pool(20, 4, 2 * DI, True, prev=False), ts=(1,))
    add("compress_pool", "CSA decode B=12 W=1 +prev", "compress_pool", pool(1, 4, 2 * HD, True, lead=(12,)), ts=(1,))
    add("compress_pool", "CSA decode B=3 W=2 no prev", "compress_pool",
        pool(2, 4, 2 * DI, True, lead=(3,), prev=False), ts=(1,))
    add("compress_pool", "HCA prefill W=20 m=16 C=64", "compress_pool", pool(20, 16, HD, False), ts=(1,))
    add("compress_pool", "HCA decode B=5 W=1 (prev ignored)", "compress_pool",
        pool(1, 16, HD, False, lead=(5,)), ts=(1,))

    def score(b, t_, e):
        return lambda dt, t, g: (rnd(g, b, t_ or t, HI, DI, dtype=dt), rnd(g, b, e, DI, dtype=dt),
                                 rnd(g, b, t_ or t, HI, scale=(DI * HI) ** -0.5))

    add("index_score", "prefill B=1 E=T/4", "index_score", lambda dt, t, g: score(1, t, max(1, t // 4))(dt, t, g))
    add("index_score", "decode B=12 T=1 E=80", "index_score", score(12, 1, 80), ts=(1,))
    add("index_score", "decode B=3 T=1 E=3 (< 8: padded)", "index_score", score(3, 1, 3), ts=(1,))

    def attn(b, t_, nk, none_valid=False):
        def build(dt, t, g):
            tq = t_ or t
            valid = torch.rand(b, tq, nk, generator=g) < 0.6
            if none_valid:
                valid[:, 0] = False
            return (rnd(g, b, tq, H, HD, dtype=dt), rnd(g, b, nk, HD, dtype=dt), valid, rnd(g, H), HD ** -0.5)
        return build

    add("sparse_attn", "prefill B=1 N=T+T/4", "sparse_attn", lambda dt, t, g: attn(1, t, t + t // 4)(dt, t, g),
        ts=(1, 7, 130))
    add("sparse_attn", "decode B=12 T=1 N=16+80", "sparse_attn", attn(12, 1, WIN + 80), ts=(1,))
    add("sparse_attn", "decode, a query with no valid key", "sparse_attn", attn(2, 1, WIN, none_valid=True), ts=(1,))
    return c


CASES = _cases()


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("op,label,key,build,t", CASES, ids=[f"{c[0]}-{c[1]}-T{c[4]}" for c in CASES])
def test_kernel_op_matches_reference(op, label, key, build, t, dt):
    args = build(getattr(torch, dt), t, _gen(op, label, t, dt))
    got = getattr(OPS, op)(*args)
    want = getattr(reference, op)(*args)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    counts = dispatch.counts()
    assert counts.get((key, "stand-in"), 0) >= 1, counts  # the kernel ran
    assert not any(k.endswith(".fallback") for k, _ in counts), counts  # and nothing fell back
    rtol, atol = cases.TOL[dt]
    v = cases.compare(cases.CaseRun(label, list(got), list(want), "stand-in", 0.0), rtol, atol)
    assert v.ok, f"{op} {label} T={t} {dt}: max_abs={v.max_abs_err:.3e} max_rel={v.max_rel_err:.3e}"


def test_every_kernel_op_is_covered_and_has_the_reference_signature():
    assert {c[0] for c in CASES} == set(kernel_ops.KERNEL_OPS) - {"sparse_attn_partial"}
    for name in kernel_ops.KERNEL_OPS:
        ref = inspect.signature(getattr(reference, name))
        mine = inspect.signature(getattr(OPS, name))
        assert list(mine.parameters) == list(ref.parameters), name
        assert [p.default for p in mine.parameters.values()] == [p.default for p in ref.parameters.values()], name


def test_reference_table_is_the_reference_functions():
    table = kernel_ops.make_ops("reference")
    assert set(table) == set(kernel_ops.KERNEL_OPS)
    assert all(fn is getattr(reference, name) for name, fn in table.items())
    assert set(kernel_ops.make_ops("stand-in")) == set(kernel_ops.KERNEL_OPS)
    assert not set(kernel_ops.REFERENCE_ONLY) & set(kernel_ops.KERNEL_OPS)
    assert set(kernel_ops.REFERENCE_ONLY) | set(kernel_ops.KERNEL_OPS) == set(reference.__all__)


def test_kernel_ops_refuse_unavailable_executors():
    with pytest.raises(RuntimeError):
        kernel_ops.KernelOps("neuron")
    with pytest.raises(ValueError):
        kernel_ops.KernelOps("reference")


# ---- fallbacks: explicit, counted apart, same result as the reference --------------------------------------------
def _fallback(op, key, reason, *args):
    dispatch.reset_counts()
    got = getattr(OPS, op)(*args)
    want = getattr(reference, op)(*args)
    counts = dispatch.counts()
    assert counts == {(f"{key}.fallback", "reference"): 1}, counts
    assert dispatch.fallbacks() == {(key, reason): 1}
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,),
                    strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a, b)


def test_empty_inputs_fall_back():
    g = _gen("empty")
    x0 = torch.zeros(0, DIM)
    _fallback("rms_norm", "rmsnorm", "empty", x0, torch.ones(DIM), EPS)
    _fallback("rms_norm", "rmsnorm", "empty", torch.zeros(0, H, HD), None, EPS)
    _fallback("swiglu", "swiglu", "empty", torch.zeros(0, INTER), torch.zeros(0, INTER), 1.0)
    _fallback("linear", "blockquant.dense", "empty", x0, rnd(g, 64, DIM))
    _fallback("fp8_linear", "blockquant.fp8", "empty", x0, *_fp8(g, 64, DIM))
    _fallback("fp4_linear", "blockquant.fp4", "empty", x0, *_fp4(g, 64, DIM))
    _fallback("grouped_out_proj", "blockquant.wo_a", "empty", torch.zeros(0, H * HD), rnd(g, 64, 128), 2)
    _fallback("hc_mixes", "hc_mixes", "empty", torch.zeros(0, N, DIM), rnd(g, MIX, N * DIM), torch.ones(3),
              torch.zeros(MIX), N, 3, 1e-6, 1e-6)
    _fallback("hc_collapse", "hc_collapse", "empty", torch.zeros(0, N, DIM), torch.zeros(0, N))
    _fallback("hc_expand", "hc_expand", "empty", x0, torch.zeros(0, N, DIM), torch.zeros(0, N), torch.zeros(0, N, N))
    _fallback("hc_attn_out", "hc_attn_out", "empty", torch.zeros(0, 64), rnd(g, DIM, 64), torch.zeros(0, N, DIM),
              torch.zeros(0, N), torch.zeros(0, N, N))
    _fallback("compress_pool", "compress_pool", "empty", torch.zeros(0, 1, 4, 128), torch.zeros(0, 1, 4, 128), True,
              torch.zeros(0, 4, 128), torch.zeros(0, 4, 128))
    _fallback("index_score", "index_score", "empty", rnd(g, 1, 3, HI, DI), torch.zeros(1, 0, DI), rnd(g, 1, 3, HI))
    _fallback("sparse_attn", "sparse_attn", "empty", rnd(g, 1, 2, H, HD), torch.zeros(1, 0, HD),
              torch.zeros(1, 2, 0, dtype=torch.bool), rnd(g, H), 0.125)


def test_documented_fallbacks():
    g = _gen("fallbacks")
    _fallback("rms_norm", "rmsnorm", "D > 8192", rnd(g, 2, 8200), None, EPS)
    _fallback("linear", "blockquant.dense", "dtype", rnd(g, 2, 16, dtype=torch.float16), rnd(g, 8, 16))
    _fallback("fp8_linear", "blockquant.fp8", "dtype", rnd(g, 2, DIM, dtype=torch.float16), *_fp8(g, 64, DIM))
    _fallback("swiglu", "swiglu", "broadcast", rnd(g, 3, 8), rnd(g, 1, 8), 1.0)
    _fallback("hc_mixes", "hc_mixes", "iters < 1", rnd(g, 2, N, 16), rnd(g, MIX, N * 16), torch.ones(3),
              torch.zeros(MIX), N, 0, 1e-6, 1e-6)
    _fallback("index_score", "index_score", "Di > 128", rnd(g, 1, 2, 2, 130), rnd(g, 1, 9, 130), rnd(g, 1, 2, 2))
    _fallback("sparse_attn", "sparse_attn", "D > 512", rnd(g, 1, 1, 2, 520), rnd(g, 1, 3, 520),
              torch.ones(1, 1, 3, dtype=torch.bool), rnd(g, 2), 0.1)
    _fallback("sparse_attn_partial", "sparse_attn", "partial", rnd(g, 1, 2, H, HD), rnd(g, 1, 9, HD),
              torch.rand(1, 2, 9, generator=g) < 0.5, 0.125)


def test_other_float_dtypes_are_widened_not_fallen_back():
    """fp16 activations: the reference widens to fp32 and rounds back once; so do the ops (kernel coverage)."""
    g = _gen("fp16")
    x = rnd(g, 5, DIM, dtype=torch.float16)
    for op, args, key in (("rms_norm", (x, None, EPS), "rmsnorm"),
                          ("swiglu", (x, x, 1.0), "swiglu"),
                          ("hc_collapse", (rnd(g, 5, N, DIM, dtype=torch.float16), torch.rand(5, N)), "hc_collapse")):
        dispatch.reset_counts()
        got, want = getattr(OPS, op)(*args), getattr(reference, op)(*args)
        assert dispatch.counts() == {(key, "stand-in"): 1}
        assert got.dtype == want.dtype
        assert torch.allclose(got.float(), want.float(), rtol=1e-3, atol=1e-3)


# ---- layout cache --------------------------------------------------------------------------------------------------
def test_weight_layouts_are_converted_once():
    ops = kernel_ops.KernelOps("stand-in")
    g = _gen("cache")
    x = rnd(g, 3, DIM)
    w8 = _fp8(g, 64, DIM)
    w4 = _fp4(g, 64, DIM)
    w = rnd(g, 64, DIM)
    fn = rnd(g, MIX, N * DIM, scale=0.05)
    norm = rnd(g, DIM) + 1
    wo_a = rnd(g, 64, 128)
    scale, base = torch.ones(3), torch.zeros(MIX)
    for _ in range(3):
        ops.fp8_linear(x, *w8)
        ops.fp4_linear(x, *w4)
        ops.linear(x, w)
        ops.rms_norm(x, norm, EPS)
        ops.grouped_out_proj(rnd(g, 3, 256), wo_a, 2)
        ops.hc_mixes(rnd(g, 3, N, DIM), fn, scale, base, N, 2, 1e-6, 1e-6)
    conv = ops.cache.conversions
    assert conv["trn2_fp8"] == 1 and conv["fp4"] == 1 and conv["T.torch.float32"] == 1
    assert conv["fnT"] == 1 and conv["woaT.torch.float32.2"] == 1
    assert conv["fp32"] == 0  # rms weight, hc scale, hc base are fp32 and contiguous already: used as they are
    bf = norm.bfloat16()
    ops.rms_norm(x, bf, EPS)
    ops.rms_norm(x, bf, EPS)
    assert ops.cache.conversions["fp32"] == 1  # a bf16 norm weight: widened once
    ops.linear(x.bfloat16(), w)  # another activation dtype is another layout
    assert ops.cache.conversions["T.torch.bfloat16"] == 1


def test_cache_follows_in_place_updates_and_new_tensors():
    ops = kernel_ops.KernelOps("stand-in")
    g = _gen("cache2")
    x = rnd(g, 2, DIM)
    w = rnd(g, 64, DIM)
    y0 = ops.linear(x, w)
    with torch.no_grad():
        w.mul_(2)  # a weight reload in place bumps the version counter
    y1 = ops.linear(x, w)
    assert ops.cache.conversions["T.torch.float32"] == 2
    assert torch.allclose(y1, 2 * y0, rtol=1e-6, atol=1e-6)
    w8, s8 = _fp8(g, 64, DIM)
    ops.fp8_linear(x, w8, s8)
    s8b = s8.clone()
    s8b[0, 0] += 1  # same weight bytes, new scale tensor: converted again
    got = ops.fp8_linear(x, w8, s8b)
    assert ops.cache.conversions["trn2_fp8"] == 2
    assert torch.allclose(got, reference.fp8_linear(x, w8, s8b), rtol=1e-3, atol=1e-4)
    del w
    import gc

    gc.collect()
    assert len(ops.cache) == 1  # the dead weight's entry went with it (the fp8 weight remains)


def test_cached_operands_are_read_only():
    """The cache holds torch layouts on the weight's device; on the host every operand the kernel gets (the cached
    weight without a per-call copy, and the activation) is read-only, so a kernel can never write into either."""
    ops = kernel_ops.KernelOps("stand-in")
    g = _gen("ro")
    w, x = rnd(g, 8, 16), rnd(g, 2, 16)
    with dispatch.record() as calls:
        ops.linear(x, w)
        ops.linear(x, w)
    (cached,) = [v[1] for slot in ops.cache._store.values() for v in slot.values()]
    assert isinstance(cached, torch.Tensor) and cached.device == w.device and torch.equal(cached, w.t())
    assert len(calls) == 2
    for _, _, (xa, wa, _groups) in calls:
        assert np.shares_memory(wa, cached.numpy())  # the cached layout itself, not a copy of it
        for arr in (xa, wa):
            assert isinstance(arr, np.ndarray)
            with pytest.raises(ValueError):
                arr[0, 0] = 1.0
    assert torch.equal(cached, w.t()) and ops.cache.conversions["T.torch.float32"] == 1


def test_parameters_and_inference_mode():
    """The engine's weights are nn.Parameters and it runs under inference_mode."""
    ops = kernel_ops.KernelOps("stand-in")
    g = _gen("param")
    lin = torch.nn.Linear(DIM, 64, bias=False)
    with torch.inference_mode():
        x = rnd(g, 4, DIM)
        y = ops.linear(x, lin.weight)
        y2 = ops.linear(x, lin.weight)
        want = reference.linear(x, lin.weight)
    assert torch.allclose(y, want, rtol=1e-3, atol=1e-4) and torch.equal(y, y2)
    assert ops.cache.conversions["T.torch.float32"] == 1
