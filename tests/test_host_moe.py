"""`--kernels host`'s one-call MoE FFN (engine/host_kernels/moe.c `dk_moe_ffn`, `host_kernels.moe_ffn`) against the
same FFN written op by op with the torch reference (nki_kernels/reference.py): routed experts in expert order with
the routing weight before w2, plus the shared expert; stored FP4 / FP8 and bf16 weights; and the cases it leaves to
the module's own path (counted by reason)."""

from __future__ import annotations

import pytest
import torch

from engine import host_kernels as H
from nki_kernels import dispatch, formats
from nki_kernels import reference as R
from tests.test_host_kernels import cache_dir, lib  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("lib")  # every test on every build this CPU runs

E, K, D, INTER = 6, 2, 256, 128


def _quant(w: torch.Tensor, fmt: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    if fmt is None:
        return w.bfloat16(), None
    q, s = formats.quant_fp8_block(w) if fmt == "fp8" else formats.quant_fp4(w)
    return q.view(torch.uint8), s.view(torch.uint8)  # the stored bytes, as the engine holds them


def _expert(g: torch.Generator, fmt: str | None) -> tuple[torch.Tensor | None, ...]:
    """(w1, s1, w3, s3, w2, s2) of one expert in format fmt."""
    out: list[torch.Tensor | None] = []
    for n, k in ((INTER, D), (INTER, D), (D, INTER)):
        out += _quant(torch.randn(n, k, generator=g) / k**0.5, fmt)
    return tuple(out)


def _gemm(fmt: str | None, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    if fmt is None:
        return R.linear(x, w)
    return (R.fp8_linear if fmt == "fp8" else R.fp4_linear)(x, w, s)


def _ffn_ref(fmt, p, x, wt, limit):
    h = R.swiglu(_gemm(fmt, x, p[0], p[1]), _gemm(fmt, x, p[2], p[3]), limit)
    return _gemm(fmt, h if wt is None else h * wt, p[4], p[5])


def _moe_ref(x, weights, indices, limit, e_lo, routed, shared):
    """engine/model/moe.py routed_local + shared expert, with the reference's ops."""
    fmt, stacks = routed
    y = torch.zeros(x.shape)
    for j in range(stacks[0].shape[0]):
        tok, k = torch.where(indices == e_lo + j)
        if len(tok):
            p = [None if s is None else s[j] for s in stacks]
            y.index_add_(0, tok, _ffn_ref(fmt, p, x[tok], weights[tok, k, None], limit))
    if shared is not None:
        y = y + _ffn_ref(shared[0], shared[1], x, None, limit)
    return y


def _case(t: int, fmt_r: str | None, fmt_s: str | None, seed: int = 0, e_lo: int = 0):
    g = torch.Generator().manual_seed(seed)
    experts = [_expert(g, fmt_r) for _ in range(E)]
    stacks = tuple(None if experts[0][i] is None else torch.stack([ex[i] for ex in experts]) for i in range(6))
    x = torch.randn(t, D, generator=g)
    indices = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]) + e_lo
    weights = torch.rand(t, K, generator=g) + 0.25
    return x, weights, indices, (fmt_r, stacks), (fmt_s, _expert(g, fmt_s))


def _bound(ref: torch.Tensor) -> torch.Tensor:
    # fp32 sums of up to D = 256 terms in another order (at most 2 * L * u of the sum of |terms|, with |terms|
    # bounded here by a few times the output scale) plus silu's exp (libm's expf vs torch's: 1-2 ulp)
    return 2 * D * 2.0**-24 * 8 * (ref.abs() + ref.abs().mean()) + 1e-6


@pytest.mark.parametrize("t", [1, 3, 16])
@pytest.mark.parametrize("fmt_r,fmt_s", [("fp4", "fp8"), ("fp8", "fp8"), (None, None), ("fp4", None)])
@pytest.mark.parametrize("limit", [10.0, 0.5, 0.0])
def test_moe_ffn_matches_the_reference(t: int, fmt_r: str | None, fmt_s: str | None, limit: float) -> None:
    x, weights, indices, routed, shared = _case(t, fmt_r, fmt_s, seed=t)
    ref = _moe_ref(x, weights, indices, limit, 0, routed, shared)
    dispatch.reset_counts()
    got = H.moe_ffn(x, weights, indices, limit, 0, routed, shared, lambda: pytest.fail("fell back"))
    assert dispatch.counts() == {("host.moe_ffn", "host"): 1}
    assert got.dtype is torch.float32 and got.shape == ref.shape
    assert ((got - ref).abs() <= _bound(ref)).all(), float((got - ref).abs().max())


def test_moe_ffn_local_experts_and_no_shared_expert() -> None:
    """Expert parallelism: the stacks hold experts e_lo.. only; pairs routed elsewhere add nothing here."""
    x, weights, indices, routed, _ = _case(5, "fp4", None, seed=9, e_lo=0)
    fmt, stacks = routed
    local = (fmt, tuple(None if s is None else s[2:5] for s in stacks))  # experts 2, 3, 4 of 6
    ref = _moe_ref(x, weights, indices, 10.0, 2, local, None)
    got = H.moe_ffn(x, weights, indices, 10.0, 2, local, None, lambda: pytest.fail("fell back"))
    assert ((got - ref).abs() <= _bound(ref)).all()
    assert ref.abs().sum() > 0  # some pairs were local


def test_moe_ffn_leaves_other_cases_to_the_module_counted() -> None:
    x, weights, indices, routed, shared = _case(2, "fp4", "fp8")
    sentinel = torch.full((2, D), 7.0)
    cases = {"dtype": (x.bfloat16(), weights, indices, routed, shared),
             "M > ": (torch.randn(H.max_m("mhc") + 1, D), weights, indices, routed, shared)}
    for why, (xx, ww, ii, rr, ss) in cases.items():
        dispatch.reset_counts()
        assert H.moe_ffn(xx, ww, ii, 10.0, 0, rr, ss, lambda: sentinel) is sentinel
        assert dispatch.counts() == {("host.moe_ffn.fallback", "reference"): 1}, why
        assert [r for (k, r) in dispatch.fallbacks()] == [r for (k, r) in dispatch.fallbacks() if r.startswith(why)]
        assert len(dispatch.fallbacks()) == 1, why


# ---------------------------------------------------------------------------------------------------------------
# The router (engine/host_kernels/step_ops.py `gate`, mhc.c `dk_route`)

@pytest.mark.parametrize("t,e,k", [(1, 32, 4), (5, 64, 6), (8, 8, 8)])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_gate_matches_the_reference(t: int, e: int, k: int, wdtype: torch.dtype) -> None:
    """The same experts as `reference.gate` (biased top-k and hash layers) and their weights within a few fp32 ulp
    (the GEMV's summation order and libm's expf / log1pf); counted as native."""
    g = torch.Generator().manual_seed(t * 100 + e)
    x = torch.randn(t, D, generator=g)
    w = (torch.randn(e, D, generator=g) / D**0.5).to(wdtype)
    bias = torch.randn(e, generator=g) * 0.1
    hash_ids = torch.randint(0, e, (t, k), generator=g)
    for b, h in ((bias, None), (None, None), (None, hash_ids)):
        dispatch.reset_counts()
        got_w, got_i = H.step_ops.gate(x, w, k, 1.5, b, h)
        assert dispatch.counts() == {("host.gate", "host"): 1}
        ref_w, ref_i = R.gate(x, w, k, 1.5, bias=b, hash_ids=h)
        assert got_i.dtype == torch.int64 and torch.equal(got_i, ref_i)
        assert got_w.dtype == torch.float32 and torch.allclose(got_w, ref_w, rtol=8 * 2.0**-23, atol=0)


def test_gate_leaves_other_cases_to_the_reference() -> None:
    """bf16 activations and more rows than max_m("mhc") run the reference itself, counted by reason."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, D, generator=g).bfloat16()
    bias = torch.zeros(16)
    dispatch.reset_counts()
    for x, why in ((torch.randn(2, D, generator=g).bfloat16(), "dtype"),
                   (torch.randn(H.max_m("mhc") + 1, D, generator=g), f"M > {H.max_m('mhc')}")):
        got = H.step_ops.gate(x, w, 4, 1.0, bias, None)
        ref = R.gate(x, w, 4, 1.0, bias=bias)
        assert torch.equal(got[1], ref[1]) and torch.equal(got[0], ref[0])
        assert dispatch.fallbacks()[("host.gate", why)] == 1


# ---------------------------------------------------------------------------------------------------------------
# The head's stream collapse (step_ops.py `hc_head`, mhc.c `dk_hc_head`)

@pytest.mark.parametrize("t,n,d", [(1, 4, 1024), (3, 4, 128), (8, 2, 100)])
def test_hc_head_matches_the_reference(t: int, n: int, d: int) -> None:
    """Against float64: the native result may be off by twice the fp32 reference's own error plus 1e-6 (outputs of
    magnitude ~1-5; fp32 reordering of the n*D-term dots moves them by ~1e-7..2e-6). A wrong formula, eps or stream
    order moves them by >= 1e-3."""
    g = torch.Generator().manual_seed(t * 10 + d)
    x = torch.randn(t, n, d, generator=g)
    fn = torch.randn(n, n * d, generator=g) / (n * d) ** 0.5
    scale, base = torch.rand(1, generator=g) + 0.5, torch.randn(n, generator=g)
    dispatch.reset_counts()
    got = H.step_ops.hc_head(x, fn, scale, base, 1e-6, 1e-6)
    assert dispatch.counts() == {("host.hc_head", "host"): 1}
    ref = R.hc_head(x, fn, scale, base, 1e-6, 1e-6)
    v = x.double().flatten(-2)
    mix = (v @ fn.double().T) * torch.rsqrt(v.square().mean(-1, keepdim=True) + 1e-6)
    pre = torch.sigmoid(mix * scale.double() + base.double()) + 1e-6
    exact = (pre.unsqueeze(-1) * x.double()).sum(-2)
    ref_err = float((ref.double() - exact).abs().max())
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert float((got.double() - exact).abs().max()) <= 2 * ref_err + 1e-6


# ---------------------------------------------------------------------------------------------------------------
# The MoE half of a block in one call (step_ops.py `ffn_site`, moe.c `dk_ffn_site`)

N_HC = 4


def _site_case(t: int, fmt_r: str | None, fmt_s: str | None, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, N_HC, D, generator=g)
    fn = torch.randn((2 + N_HC) * N_HC, N_HC * D, generator=g) / (N_HC * D) ** 0.5
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn((2 + N_HC) * N_HC, generator=g) * 0.1
    norm_w = torch.rand(D, generator=g) + 0.5
    gate_w = (torch.randn(E, D, generator=g) / D**0.5).bfloat16()
    bias, hash_ids = torch.randn(E, generator=g) * 0.1, torch.randint(0, E, (t, K), generator=g)
    _, _, _, routed, shared = _case(t, fmt_r, fmt_s, seed=seed)
    return x, (fn, scale, base, norm_w, N_HC, 2, 1e-6, 1e-6), gate_w, bias, hash_ids, routed, shared


@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("fmt_r,fmt_s", [("fp4", "fp8"), ("fp8", None), (None, None)])
@pytest.mark.parametrize("routing", ["bias", "hash"])
def test_ffn_site_is_the_four_ops_bit_for_bit(t: int, fmt_r: str | None, fmt_s: str | None, routing: str) -> None:
    """One native call equals hc_pre, gate, moe_ffn and hc_expand of the host table run one by one, bit for bit
    (the same kernels in the same order); counted under its own key and each of the four's."""
    x, mhc, gate_w, bias, hash_ids, routed, shared = _site_case(t, fmt_r, fmt_s, seed=t * 7 + len(routing))
    b, h = (bias, None) if routing == "bias" else (None, hash_ids)
    h_, post, comb = H.hc_pre(x, *mhc)
    w, idx = H.step_ops.gate(h_, gate_w, K, 1.5, b, h)
    y = H.moe_ffn(h_, w, idx, 10.0, 0, routed, shared, lambda: pytest.fail("fell back"))
    ref = H.hc_expand(y, x, post, comb)
    pack = H.step_ops.site_pack(mhc, gate_w, K, 1.5, b, h is not None, 10.0, 0, routed, shared)
    dispatch.reset_counts()
    got = H.step_ops.ffn_site(pack, x, h)
    assert got is not None and got.dtype is torch.float32 and torch.equal(got, ref)
    assert dispatch.counts() == {(k, "host"): 1 for k in H.step_ops._SITE_KEYS}


def test_ffn_site_declines_what_an_op_would_not_take_natively() -> None:
    """None (the block then runs the four ops, each deciding for itself) and nothing counted: bf16 streams, an fp32
    router weight (torch's GEMV in `gate`: the pack has no arguments), more rows than max_m("mhc"), a hash id
    tensor of the wrong shape or none for a hash layer."""
    x, mhc, gate_w, bias, hash_ids, routed, shared = _site_case(2, "fp4", "fp8", seed=5)
    plain = H.step_ops.site_pack(mhc, gate_w, K, 1.5, bias, False, 10.0, 0, routed, shared)
    hashed = H.step_ops.site_pack(mhc, gate_w, K, 1.5, None, True, 10.0, 0, routed, shared)
    fp32_gate = H.step_ops.site_pack(mhc, gate_w.float(), K, 1.5, bias, False, 10.0, 0, routed, shared)
    assert plain.args is not None and fp32_gate.args is None
    big = torch.randn(H.max_m("mhc") + 1, N_HC, D)
    cases = {"bf16 x": (plain, x.bfloat16(), None), "fp32 gate": (fp32_gate, x, None), "rows": (plain, big, None),
             "hash shape": (hashed, x, hash_ids[:1]), "no hash ids": (hashed, x, None)}
    for why, (pack, xx, h) in cases.items():
        dispatch.reset_counts()
        assert H.step_ops.ffn_site(pack, xx, h) is None, why
        assert dispatch.counts() == {}, why


def test_ffn_site_bad_hash_id_is_a_clear_error() -> None:
    x, mhc, gate_w, _, hash_ids, routed, shared = _site_case(2, "fp4", None, seed=6)
    pack = H.step_ops.site_pack(mhc, gate_w, K, 1.5, None, True, 10.0, 0, routed, shared)
    with pytest.raises(ValueError, match="hash-layer expert id"):
        H.step_ops.ffn_site(pack, x, hash_ids + E)


def test_a_pack_is_made_again_when_a_tensor_it_points_into_moves() -> None:
    """`host_kernels.packed` keeps a module's pack while every tensor it holds lies where it did and it is asked for
    with the same tag; a tensor moved in place (`Tensor.set_`, as engine/host_memory.py moves weights) or another
    tag (another KV cache) makes a new one."""
    _, mhc, gate_w, bias, _, routed, shared = _site_case(1, "fp4", None, seed=7)
    owner = torch.nn.Module()
    made = []

    def make():
        made.append(H.step_ops.site_pack(mhc, gate_w, K, 1.5, bias, False, 10.0, 0, routed, shared))
        return made[-1]

    first = H.packed(owner, "site", make)
    assert H.packed(owner, "site", make) is first and len(made) == 1
    bias.set_(bias.clone())  # same tensor object, new storage
    again = H.packed(owner, "site", make)
    assert again is not first and len(made) == 2 and again.args.head[-1] == bias.data_ptr()
    tag = object()
    tagged = H.packed(owner, "site", make, tag)
    assert tagged is not again and H.packed(owner, "site", make, tag) is tagged and len(made) == 3
