"""The engine's host path and the kernels' references are the same functions (one definition per op)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from nki_kernels import (
    blockquant,
    compress_pool,
    dispatch,
    formats,
    hc_attn_out,
    hc_collapse,
    hc_expand,
    hc_mixes,
    index_score,
    reference,
    rmsnorm,
    sparse_attn,
    swiglu,
)


def test_engine_reference_ops_are_the_reference_functions():
    """`--kernels reference` runs exactly the functions the kernels are tested against (one definition per op)."""
    from engine.model import attention
    from engine.model.ops import REFERENCE

    for name in ("rms_norm", "hc_mixes", "hc_collapse", "hc_expand", "hc_attn_out", "swiglu", "linear", "fp8_linear",
                 "fp4_linear", "sparse_attn", "sparse_attn_partial", "compress_pool", "index_score",
                 "grouped_out_proj"):
        assert getattr(REFERENCE, name) is getattr(reference, name), name
    # the reference-only ops the model calls directly are the same functions too
    assert attention.index_topk is reference.index_topk and REFERENCE.rope_tail is reference.rope_tail
    assert REFERENCE.hc_head is reference.hc_head and REFERENCE.gate is reference.gate
    xg, wg, bias = torch.randn(3, 16), torch.randn(8, 16), torch.randn(8)  # the router is route(gate_scores(..))
    for got, want in zip(reference.gate(xg, wg, 2, 1.5, bias=bias), reference.route(
            reference.gate_scores(xg, wg), 2, 1.5, bias=bias), strict=True):
        assert torch.equal(got, want)


T, N, D = 4, 2, 16
g = torch.Generator().manual_seed(0)
x2 = torch.randn(T, D, generator=g)
x3 = torch.randn(T, N, D, generator=g)
pre = torch.rand(T, N, generator=g)
comb = torch.rand(T, N, N, generator=g)
w8, s8 = formats.quant_fp8_block(torch.randn(8, D, generator=g))
w4, s4 = formats.quant_fp4(torch.randn(8, 32, generator=g))
CALLS = {
    "rms_norm": lambda: rmsnorm.rmsnorm(x2, torch.ones(D), 1e-6, executor="reference"),
    "swiglu": lambda: swiglu.swiglu(x2, x2, 10.0, executor="reference"),
    "hc_collapse": lambda: hc_collapse.hc_collapse(x3, pre, executor="reference"),
    "hc_expand": lambda: hc_expand.hc_expand(x2, x3, pre, comb, executor="reference"),
    "hc_mixes": lambda: hc_mixes.hc_mixes(x3, torch.randn(8, N * D), torch.ones(3), torch.zeros(8), N, 2, 1e-6, 1e-6,
                                          executor="reference"),
    "hc_attn_out": lambda: hc_attn_out.hc_attn_out(x2, torch.randn(D, D), x3, pre, comb, executor="reference"),
    "compress_pool": lambda: compress_pool.compress_pool(x3.view(T, 2, 1, D), x3.view(T, 2, 1, D), False,
                                                         executor="reference"),
    "index_score": lambda: index_score.index_score_topk(x3.view(1, T, N, D), torch.randn(1, 10, D),
                                                        torch.rand(1, T, N), torch.full((1, T), 10), 4,
                                                        executor="reference"),
    "sparse_attn": lambda: sparse_attn.sparse_attn(x3.view(1, T, N, D), torch.randn(1, 9, D),
                                                   torch.ones(1, T, 9, dtype=torch.bool), torch.zeros(N), 0.25,
                                                   executor="reference"),
    "grouped_out_proj": lambda: blockquant.grouped_out_proj(x2, torch.randn(6, D // 2), 2, executor="reference"),
    "linear": lambda: (blockquant.fp8_linear(x2, w8, s8, executor="reference"),
                       blockquant.fp4_linear(torch.randn(T, 32), w4, s4, executor="reference")),
}


@pytest.mark.parametrize("op", sorted(CALLS))
def test_reference_path_calls_the_shared_function(monkeypatch, op):
    real = getattr(reference, op)
    seen = []

    def spy(*a, **k):
        seen.append(op)
        return real(*a, **k)

    monkeypatch.setattr(reference, op, spy)
    dispatch.reset_counts()
    CALLS[op]()
    assert seen, f"the reference path of {op} did not call nki_kernels.reference.{op}"
    assert all(ex == "reference" for _, ex in dispatch.counts())


def test_importing_the_package_stays_light():
    code = ("import sys, nki_kernels, nki_kernels.reference; "
            "bad = [m for m in sys.modules if m == 'nki' or m.startswith(('nki.', 'nki_kernels.stand_in', "
            "'nki_kernels._nki', 'nki_kernels.rmsnorm'))]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
