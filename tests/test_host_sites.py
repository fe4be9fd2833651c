"""The host table's one-call decode sites inside the model, and the whole layer in one call (`decode_layer`,
engine/host_kernels/layer_ops.py, attn.c `dk_decode_layer`): `attn_front` (engine/host_kernels/attn_ops.py, attn.c
`dk_attn_front`: the attention half's hc_pre, q / kv and compressor projections), `attn_decode` (attn.c
`dk_attn_decode`: a decode step's keys, attention, inverse RoPE, wo_a, wo_b and mHC expand) and `ffn_site`
(step_ops.py, moe.c `dk_ffn_site`: the MoE half of a block). Each is the same kernels in the same order as the host
table's ops one by one, so the model's logits are the op-by-op path's bit for bit; `attn_decode` also against that
composition on its own, with sequences in shuffled slots and entries spread over several pool blocks."""

from __future__ import annotations

import ctypes

import pytest
import torch

import engine
from deepinfer_bench.bench.golden import GOLDEN_DIR
from engine import host_kernels as H
from engine.config import EngineConfig
from engine.host_kernels import attn_ops as A
from engine.llm import greedy_with_logits
from engine.model.layers import Linear
from engine.model.ops import ops_for
from nki_kernels import dispatch
from tests.test_host_kernels import cache_dir, lib  # noqa: F401  (fixtures)

SITES = ("attn_front", "attn_decode_takes", "ffn_site_pack", "decode_layer")


PROMPTS = [[5, 9, 13], [300, 2, 2, 41, 7, 8, 9, 10, 11, 12, 13], list(range(40, 66))]


def _run(monkeypatch: pytest.MonkeyPatch, without: tuple[str, ...], prompts: list[list[int]] = PROMPTS,
         tokens: int = 14, limits: dict[str, int] | None = None) -> tuple[list, list, dict]:
    """Greedy decode of `prompts` on the tiny model (stored FP8 / FP4 weights), host kernels, with the table's
    `without` ops removed and the build's row `limits` (MAX_M) changed."""
    with monkeypatch.context() as m:
        for name in without:
            m.delitem(H.NATIVE_OPS, name)
        for key, value in (limits or {}).items():
            m.setitem(H.MAX_M[H._native().variant], key, value)
        eng = engine.build(EngineConfig.from_model_dir(GOLDEN_DIR / "tiny", kernels="host", max_num_seqs=4))
        out, logits = greedy_with_logits(eng, prompts, tokens)
    return out, logits, dict(eng.runner.dispatcher.counts)


SITE_KEYS = {(f"host.{k}", "host") for k in ("decode_layer", "attn_front", "attn_decode", "attn_decode.select",
                                            "attn_decode.close", "ffn_site")}


def _sites_take_three_rows() -> bool:
    """Whether this build's row limits (MAX_M) let the decode sites take the tests' three sequences: not on the
    portable build (sparse_attn 0, the GEMMs 1), where every site declines and the ops run one by one."""
    return all(H.max_m(k) >= 3 for k in ("mhc", "sparse_attn", "linear", "fp8", "fp4"))


def test_the_layer_in_one_call_gives_the_three_sites_logits_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    out, logits, counts = _run(monkeypatch, ())
    ref_out, ref_logits, ref_counts = _run(monkeypatch, ("decode_layer",))
    if _sites_take_three_rows():
        assert counts[("host.decode_layer", "host")] > 0 and ("host.decode_layer", "host") not in ref_counts
        assert ref_counts[("host.ffn_site", "host")] == counts[("host.ffn_site", "host")]  # the same sites ran
    else:
        assert not SITE_KEYS & (set(counts) | set(ref_counts))
    assert out == ref_out
    for a, b in zip(logits, ref_logits, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("limits", [None, {"index": 1, "pool": 0, "close": 0}])
def test_the_decode_sites_give_the_op_by_op_logits_bit_for_bit(monkeypatch: pytest.MonkeyPatch,
                                                               limits: dict[str, int] | None) -> None:
    """Three sequences past the window (16) and through compressed blocks closing at ratios 4 and 16; the CSA
    layers' indexer starts selecting at position 19 (top-k 4 of ratio-4 entries), where those layers run the
    halves, the attention's `attn_decode` over the indexer's picks, for the rest of the run. `limits`: more rows
    than the table's index_score and compress_pool take (as on an AVX2 or portable build): the picks made in torch
    and the closing blocks pooled op by op, in both runs alike."""
    out, logits, counts = _run(monkeypatch, (), limits=limits)
    ref_out, ref_logits, ref_counts = _run(monkeypatch, SITES, limits=limits)
    if _sites_take_three_rows():
        for key in ("host.decode_layer", "host.attn_front", "host.attn_decode", "host.attn_decode.select",
                    *(("host.attn_decode.close",) if limits is None else ()), "host.ffn_site"):
            assert counts[(key, "host")] > 0 and (key, "host") not in ref_counts, key
        if limits is not None:
            assert ("host.attn_decode.close", "host") not in counts and ("host.compress_pool", "host") not in counts
        # the indexer's steps run the three sites; blocks that close pool inside attn_decode (also in decode_layer)
        assert counts[("host.attn_front", "host")] > counts[("host.decode_layer", "host")]
        assert counts[("host.attn_decode", "host")] > counts[("host.attn_decode.select", "host")]
    else:
        assert not SITE_KEYS & (set(counts) | set(ref_counts))
    assert out == ref_out
    for a, b in zip(logits, ref_logits, strict=True):
        assert torch.equal(a, b)


def test_blocks_closing_in_the_layer_call_give_the_op_by_op_logits_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Contexts short of the indexer's selection (positions < 19): every decode step runs each layer in one call,
    the blocks that close pooled inside it (attn.c close_block) as Compressor.decode pools them op by op, CSA
    (ratio 4, overlapping) and HCA (ratio 16); the first two sequences close their ratio-4 blocks in the same
    steps (two rows pooled in one call, each at its own position), the third in others."""
    prompts = [[5, 9, 13], [300, 2, 2, 41, 7, 8, 9], [7, 7, 1, 2, 3, 4]]
    out, logits, counts = _run(monkeypatch, (), prompts, 11)
    ref_out, ref_logits, ref_counts = _run(monkeypatch, SITES, prompts, 11)
    if _sites_take_three_rows():
        assert counts[("host.attn_decode.close", "host")] > 0 and ("host.attn_decode.select", "host") not in counts
        assert counts[("host.decode_layer", "host")] == counts[("host.attn_decode", "host")]  # each layer one call
        assert ("host.attn_decode.close", "host") not in ref_counts
    else:
        assert not SITE_KEYS & (set(counts) | set(ref_counts))
    assert out == ref_out
    for a, b in zip(logits, ref_logits, strict=True):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("lib")  # every build this CPU runs
@pytest.mark.parametrize("select", [False, True])
@pytest.mark.parametrize("nloc", [0, 7, 21])
@pytest.mark.parametrize("fmt_b", [None, "fp8"])
def test_attn_decode_is_its_ops_in_a_row(nloc: int, fmt_b: str | None, select: bool) -> None:
    """`select`: over the indexer's picks (`keep`), as Attention._select masks the entries."""
    host = ops_for("host")
    g = torch.Generator().manual_seed(nloc + len(str(fmt_b)))
    b, h, d, wl, epb, n_hc, dim, groups, r, rd = 3, 4, 64, 8, 4, 4, 96, 2, 16, 32
    q = torch.randn(b, h, d, generator=g)
    ring = torch.randn(5, wl, d, generator=g)
    pool = torch.randn(12, epb, d, generator=g)
    slots = torch.tensor([3, 0, 4])
    tables = torch.stack([torch.randperm(12, generator=g)[:6] for _ in range(b)])
    ring_valid = torch.rand(b, 1, wl, generator=g) < 0.7
    visible = torch.tensor([[nloc], [max(0, nloc - 3)], [nloc // 2]])
    sink = torch.randn(h, generator=g)
    ang = torch.rand(b, rd // 2, generator=g) * 50
    cos, sin = ang.cos(), ang.sin()
    wo_a = (torch.randn(groups * r, h * d // groups, generator=g) / 8).bfloat16()
    wo_b = Linear(groups * r, dim, fmt_b)
    wo_b.ops = host
    if fmt_b is None:
        wo_b.weight = torch.nn.Parameter((torch.randn(dim, groups * r, generator=g) / 6).bfloat16(),
                                         requires_grad=False)
    else:
        wo_b.weight = torch.nn.Parameter(torch.randint(0, 126, (dim, groups * r), generator=g, dtype=torch.uint8),
                                         requires_grad=False)
        wo_b.scale = torch.nn.Parameter(torch.full((1, 1), 120, dtype=torch.uint8), requires_grad=False)
    x = torch.randn(b, n_hc, dim, generator=g)
    post, comb = torch.rand(b, n_hc, generator=g), torch.rand(b, n_hc, n_hc, generator=g)
    keys = ring[slots]
    valid = ring_valid
    keep = torch.rand(b, nloc, generator=g) < 0.5 if select else None
    if nloc:
        entries = pool[tables].flatten(1, 2)[:, :nloc]
        keys = torch.cat([keys, entries], 1)
        seen = torch.arange(nloc).view(1, 1, -1) < visible.unsqueeze(-1)
        valid = torch.cat([valid, seen if keep is None else seen & keep[:, None]], 2)
    o = host.sparse_attn(q[:, None], keys, valid, sink, 0.125)[:, 0]
    y = host.grouped_out_proj(host.rope_tail(o, cos[:, None], sin[:, None], rd, True).reshape(b, -1), wo_a, groups)
    want = host.hc_expand(wo_b(y), x, post, comb)
    pack = A.decode_pack(sink, 0.125, rd, wo_a, groups, wo_b, ring, pool, ())
    assert A.attn_decode_takes(pack, b, x, cos, sin)
    dispatch.reset_counts()
    got = A.attn_decode(pack, q, slots, ring_valid, tables, nloc, visible if nloc else None, cos, sin, x, post, comb,
                        keep=keep)
    assert dispatch.counts()[("host.attn_decode", "host")] == 1
    assert dispatch.counts().get(("host.attn_decode.select", "host"), 0) == int(select)
    assert got.dtype is torch.float32 and torch.equal(got, want)


@pytest.mark.usefixtures("lib")  # every build this CPU runs
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("topk", [3, 8, 64])
def test_attn_decode_picks_as_the_indexer_ops_do(topk: int, ties: bool) -> None:
    """`attn_decode` with `index` (the indexer's queries and weights): it scores the indexer pool's entries with the
    host table's `index_score` routine and keeps the top-k as `index_topk` orders them (score, then lower entry
    first; -0.0 as 0.0), then attends over them: the op-by-op composition's output bit for bit. Entries with equal
    keys (tied scores) and all-zero keys (scores of +-0), sequences with fewer visible entries than k; `ties`:
    every score one of 0, 1, 2 (one head reading one key element), so the k-th pick falls among equal scores."""
    from engine.model.attention import _picked
    from nki_kernels.reference import index_topk

    host = ops_for("host")
    g = torch.Generator().manual_seed(topk)
    b, h, d, wl, epb, n_hc, dim, groups, r, rd, hi, di, nloc = 3, 4, 64, 8, 4, 4, 96, 2, 16, 32, 6, 24, 21
    q, x = torch.randn(b, h, d, generator=g), torch.randn(b, n_hc, dim, generator=g)
    ring, pool = torch.randn(5, wl, d, generator=g), torch.randn(12, epb, d, generator=g)
    ipool = torch.randn(12, epb, di, generator=g)
    ipool[3, 1] = ipool[5, 2] = ipool[7, 0]  # tied scores
    ipool[2, :2] = 0  # scores of +-0
    slots, tables = torch.tensor([3, 0, 4]), torch.stack([torch.randperm(12, generator=g)[:6] for _ in range(b)])
    ring_valid = torch.rand(b, 1, wl, generator=g) < 0.7
    visible = torch.tensor([[nloc], [nloc - 3], [2]])
    sink, (cos, sin) = torch.randn(h, generator=g), (lambda a: (a.cos(), a.sin()))(torch.rand(b, rd // 2) * 50)
    wo_a = (torch.randn(groups * r, h * d // groups, generator=g) / 8).bfloat16()
    wo_b = Linear(groups * r, dim)
    wo_b.ops = host
    wo_b.weight = torch.nn.Parameter((torch.randn(dim, groups * r, generator=g) / 6).bfloat16(), requires_grad=False)
    post, comb = torch.rand(b, n_hc, generator=g), torch.rand(b, n_hc, n_hc, generator=g)
    iq, iw = torch.randn(b, hi, di, generator=g), torch.randn(b, hi, generator=g)
    if ties:
        iq, iw = torch.zeros(b, hi, di), torch.zeros(b, hi)
        iq[:, 0, 0], iw[:, 0] = 1.0, 1.0
        ipool[..., 0] = torch.randint(0, 3, (12, epb), generator=g).float()
    states = tuple((torch.zeros(5, 8, 2 * w), torch.zeros(5, 8, 2 * w), torch.zeros(4, 2 * w), torch.ones(w), pl, 4,
                    1e-6) for w, pl in ((d, pool), (di, ipool)))

    scores = H.index_score_native(iq[:, None], ipool[tables].flatten(1, 2)[:, :nloc], iw[:, None])  # [B, 1, E]
    keep = _picked(scores, index_topk(scores, visible, topk))
    entries = pool[tables].flatten(1, 2)[:, :nloc]
    seen = torch.arange(nloc).view(1, 1, -1) < visible.unsqueeze(-1)
    valid = torch.cat([ring_valid, seen & keep], 2)
    o = host.sparse_attn(q[:, None], torch.cat([ring[slots], entries], 1), valid, sink, 0.125)[:, 0]
    y = host.grouped_out_proj(host.rope_tail(o, cos[:, None], sin[:, None], rd, True).reshape(b, -1), wo_a, groups)
    want = host.hc_expand(wo_b(y), x, post, comb)
    pack = A.decode_pack(sink, 0.125, rd, wo_a, groups, wo_b, ring, pool, states)
    assert A.attn_decode_takes(pack, b, x, cos, sin)
    dispatch.reset_counts()
    got = A.attn_decode(pack, q, slots, ring_valid, tables, nloc, visible, cos, sin, x, post, comb,
                        index=(iq, iw, topk))
    assert dispatch.counts()[("host.attn_decode.select", "host")] == 1
    assert torch.equal(got, want)
    assert bool((keep.sum(-1) == visible.clamp(max=topk)).all())  # k picks, or every visible entry


def test_attn_decode_takes_only_what_its_kernels_take() -> None:
    g = torch.Generator().manual_seed(1)
    x, sink, ring, pool = torch.randn(2, 4, 96), torch.randn(4), torch.randn(3, 8, 64), torch.randn(4, 4, 64)
    wo_a = torch.randn(32, 128, generator=g).bfloat16()
    wo_b = Linear(32, 96)
    wo_b.weight = torch.nn.Parameter(torch.randn(96, 32).bfloat16(), requires_grad=False)

    def takes(b=2, x=x, ring=ring, pool=pool, wo_a=wo_a, wo_b=wo_b, cos=torch.ones(2, 16)):
        return A.attn_decode_takes(A.decode_pack(sink, 0.125, 32, wo_a, 2, wo_b, ring, pool, ()), b, x, cos, cos)

    two_rows = min(H.max_m(k) for k in ("mhc", "sparse_attn", "linear")) >= 2  # (not on the portable build)
    assert takes() == two_rows
    assert takes(pool=None) == two_rows  # a sliding-only layer
    assert not takes(x=x.bfloat16())
    assert not takes(ring=ring.bfloat16())
    assert not takes(wo_a=wo_a.float())
    assert not takes(cos=torch.ones(2, 16).bfloat16())  # RoPE tables in another dtype (a bf16 default dtype)
    assert not takes(b=H.max_m("mhc") + 1, x=torch.randn(H.max_m("mhc") + 1, 4, 96))
    fp32 = Linear(32, 96)
    fp32.weight = torch.nn.Parameter(torch.randn(96, 32), requires_grad=False)  # BLAS, not the native GEMV
    assert not takes(wo_b=fp32)


@pytest.mark.usefixtures("lib")  # every build this CPU runs
@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("n_proj", [0, 2, 4])
def test_attn_front_is_its_ops_in_a_row(t: int, n_proj: int) -> None:
    from tests.test_host_attn_ops import _linear

    host = ops_for("host")
    g = torch.Generator().manual_seed(t * 10 + n_proj)
    n_hc, dim, ql, heads, hd, rd = 4, 256, 128, 4, 64, 32
    x = torch.randn(t, n_hc, dim, generator=g)
    site = (torch.randn((2 + n_hc) * n_hc, n_hc * dim, generator=g) / (n_hc * dim) ** 0.5,
            torch.rand(3, generator=g) + 0.5, torch.randn((2 + n_hc) * n_hc, generator=g) * 0.1,
            torch.rand(dim, generator=g) + 0.5, n_hc, 2, 1e-6, 1e-6)
    wq_a, wq_b, wkv = _linear("fp8", ql, dim, host, g), _linear("fp4", heads * hd, ql, host, g), \
        _linear(None, hd, dim, host, g)
    projs = tuple(_linear(("fp8", None, "fp4", None)[i], (2 * hd, 2 * hd, 96, 96)[i], dim, host, g)
                  for i in range(n_proj))
    qn, kn = torch.rand(ql, generator=g) + 0.5, torch.rand(hd, generator=g) + 0.5
    ang = torch.rand(t, rd // 2, generator=g) * 100
    h, post, comb = host.hc_pre(x, *site)
    want = (post, comb, *host.attn_qkv(h, wq_a, qn, wq_b, wkv, kn, ang.cos(), ang.sin(), heads, rd, 1e-6),
            *(p(h) for p in projs))
    dispatch.reset_counts()
    got = A.attn_front(A.front_pack(site, wq_a, qn, wq_b, wkv, kn, heads, rd, 1e-6, projs), x, ang.cos(), ang.sin())
    assert got is not None and dispatch.counts()[("host.attn_front", "host")] == 1
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == torch.float32 and torch.equal(a, b)


def test_attn_front_declines_what_its_parts_would_not_take() -> None:
    """None and nothing counted: bf16 streams, an fp32 projection weight (BLAS: not a native GEMV), more rows than
    max_m("mhc")."""
    from tests.test_host_attn_ops import _linear

    host = ops_for("host")
    g = torch.Generator().manual_seed(2)
    n_hc, dim, ql, heads, hd, rd = 4, 128, 64, 2, 64, 32
    site = (torch.randn((2 + n_hc) * n_hc, n_hc * dim, generator=g) / 30, torch.rand(3, generator=g) + 0.5,
            torch.randn((2 + n_hc) * n_hc, generator=g) * 0.1, torch.ones(dim), n_hc, 2, 1e-6, 1e-6)
    wq_a, wq_b, wkv = _linear("fp8", ql, dim, host, g), _linear("fp8", heads * hd, ql, host, g), \
        _linear("fp8", hd, dim, host, g)
    fp32 = _linear(None, hd, dim, host, g)
    fp32.weight = torch.nn.Parameter(fp32.weight.float(), requires_grad=False)

    def call(x, projs=()):
        ang = torch.rand(x.shape[0], rd // 2, generator=g)
        pack = A.front_pack(site, wq_a, torch.ones(ql), wq_b, wkv, torch.ones(hd), heads, rd, 1e-6, projs)
        return A.attn_front(pack, x, ang.cos(), ang.sin())

    dispatch.reset_counts()
    assert call(torch.randn(2, n_hc, dim).bfloat16()) is None
    assert call(torch.randn(2, n_hc, dim), (fp32,)) is None
    assert call(torch.randn(H.max_m("mhc") + 1, n_hc, dim)) is None
    assert dispatch.counts() == {}
    # two rows: native where the build's row limits take them (not on the portable build: FP8 GEMMs of one row)
    assert (call(torch.randn(2, n_hc, dim)) is not None) == (min(H.max_m("mhc"), H.max_m("fp8")) >= 2)


@pytest.mark.usefixtures("lib")  # every build this CPU runs
def test_the_layer_struct_mirror_is_checked_against_the_library() -> None:
    """The library's dk_layer and layer_ops.DkLayer agree field for field (every load checks it); a mirror with one
    field of another size, or one field short, is told apart."""
    from engine.host_kernels import layer_ops as L

    native = H._native().lib
    assert L.layout_mismatch(native) is None
    fields = list(L.DkLayer._fields_)
    i = [n for n, _ in fields].index("route_scale")

    class Wrong(ctypes.Structure):
        _fields_ = [*fields[:i], ("route_scale", ctypes.c_double), *fields[i + 1:]]  # noqa: RUF012

    class Short(ctypes.Structure):
        _fields_ = fields[:-1]  # noqa: RUF012

    assert "offset" in L.layout_mismatch(native, Wrong) or "sizeof" in L.layout_mismatch(native, Wrong)
    assert "fields" in L.layout_mismatch(native, Short)


def test_the_draft_heads_input_and_the_lm_head_in_one_call_each_are_their_ops_bit_for_bit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`mtp_input` and `lm_head` (step_ops.py; attn.c `dk_mtp_input`, `dk_lm_head`) against the same ops one by one:
    MTP speculation on the tiny-spec model (the head's input every drafted token, the LM head every step and draft)
    gives the same tokens and logits bit for bit, and both sites ran."""
    def run(without: tuple[str, ...]) -> tuple[list, list, dict]:
        with monkeypatch.context() as m:
            for name in without:
                m.delitem(H.NATIVE_OPS, name)
            eng = engine.build(EngineConfig.from_model_dir(GOLDEN_DIR / "tiny-spec", kernels="host",
                                                           max_num_seqs=4, speculative="mtp",
                                                           num_speculative_tokens=2, speculative_policy="always"))
            out, logits = greedy_with_logits(eng, PROMPTS[:2], 6)
        return out, logits, dict(eng.runner.dispatcher.counts)

    out, logits, counts = run(())
    ref_out, ref_logits, ref_counts = run(("mtp_input", "lm_head"))
    assert out == ref_out
    assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits, strict=True))
    taken = {k for k in ("host.mtp_input", "host.lm_head") if counts.get((k, "host"), 0) > 0}
    assert taken == ({"host.mtp_input", "host.lm_head"} if _sites_take_three_rows() else set())
    assert not any(ref_counts.get((k, "host"), 0) for k in ("host.mtp_input", "host.lm_head"))


@pytest.mark.parametrize("rope_rows", [None, 8])
def test_mtp_drafting_in_one_call_is_its_passes_one_by_one_bit_for_bit(monkeypatch: pytest.MonkeyPatch,
                                                                        rope_rows: int | None) -> None:
    """`mtp_draft` (layer_ops.py; attn.c `dk_mtp_draft`: the catch-up and the k - 1 recursion passes in one call)
    against each pass as its own `mtp_pass` call (the table without `mtp_draft`): MTP k = 3 speculation on the
    tiny-spec model, three sequences - the same drafts and draft logits bit for bit at every drafting step, and the
    one call ran (where the build's row limits take three rows). `rope_rows` 8: its RoPE rows past a table of 8
    positions (the prompts are longer) come from the positions' own call, not the kept table."""
    from engine.host_kernels import block_decoder
    from engine.model import mtp_proposer as MP

    if rope_rows is not None:
        monkeypatch.setattr(block_decoder, "ROPE_ROWS", rope_rows)

    def run(without: tuple[str, ...]) -> tuple[list, list, dict]:
        proposals = []
        propose = MP.propose_mtp

        def record(*a, **kw):
            proposals.append(propose(*a, **kw))
            return proposals[-1]

        with monkeypatch.context() as m:
            for name in without:
                m.delitem(H.NATIVE_OPS, name)
            m.setattr(MP, "propose_mtp", record)
            eng = engine.build(EngineConfig.from_model_dir(GOLDEN_DIR / "tiny-spec", kernels="host",
                                                           max_num_seqs=4, speculative="mtp",
                                                           num_speculative_tokens=3, speculative_policy="always"))
            out, _ = greedy_with_logits(eng, PROMPTS, 10)
        return out, proposals, dict(eng.runner.dispatcher.counts)

    out, proposals, counts = run(())
    ref_out, ref_proposals, ref_counts = run(("mtp_draft",))
    assert out == ref_out and len(proposals) == len(ref_proposals) > 2
    for p, q in zip(proposals, ref_proposals, strict=True):
        assert torch.equal(p.tokens, q.tokens) and torch.equal(p.logits, q.logits)
    assert max(p.tokens.shape[1] for p in proposals) == 3  # the recursion ran (fewer drafts near max_tokens)
    one_call = counts.pop(("host.mtp_draft", "host"), 0)
    assert (one_call > 0) == _sites_take_three_rows() and ("host.mtp_draft", "host") not in ref_counts
    assert counts == ref_counts  # besides its own count, one call counts as its k passes


def test_the_draft_heads_input_declines_past_its_ops_row_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """`mtp_input` takes T x n stream rows within every one of its ops' limits (the norm of the streams runs on all of
    them) and nothing past that: there the ops run one by one, the reference's past their own limits."""
    from engine.host_kernels import step_ops

    eng = engine.build(EngineConfig.from_model_dir(GOLDEN_DIR / "tiny-spec", kernels="host", speculative="mtp",
                                                   num_speculative_tokens=1))
    m, cfg = eng.runner.model, eng.runner.cfg
    blk = m.mtp[0]
    pack = step_ops.mtp_input_pack(m.embed.weight, blk.enorm.weight, blk.hnorm.weight, blk.e_proj, blk.h_proj,
                                   cfg.norm_eps)
    assert pack.args is not None  # stored FP8 projections, a bf16 embedding: what dk_mtp_input takes
    rows = min(H.max_m(k) for k in pack.args.limit_keys) // cfg.hc_mult
    g = torch.Generator().manual_seed(0)
    for t in sorted({1, rows, rows + 1} - {0}):
        x = torch.randn(t, cfg.hc_mult, cfg.dim, generator=g)
        ids = torch.randint(0, cfg.vocab_size, (t,), generator=g)
        got = step_ops.mtp_input(pack, x, ids)
        assert (got is not None) == (t <= rows)
        if got is not None:
            with monkeypatch.context() as mp:
                mp.setattr(m.ops, "block_decoder", ops_for("reference").block_decoder)
                assert torch.equal(got, m.mtp_input(x, ids))
    if rows >= 1:
        with pytest.raises(IndexError, match="token id outside"):
            step_ops.mtp_input(pack, torch.randn(1, cfg.hc_mult, cfg.dim), torch.tensor([cfg.vocab_size]))
