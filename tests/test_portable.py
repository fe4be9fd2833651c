"""Portable model code (issue 21 item 5): the five patterns that upstream torch-mlir did not lower, or lowered with
other semantics, are spelled portably in the model/ops code, with the host results unchanged.

Each fix is checked two ways on the CPU, without torch-mlir: (1) the new spelling equals the old one's torch values
(the old formulation is kept here, in the test, as the definition it must match) and, where the old pattern's
StableHLO semantics can be imitated with torch, the old pattern is shown to go wrong under them; (2) the ATen graph
of the new code has none of the patterns (engine/backends/portable.py, which does flag the old code). Last, the
engine's decode graphs on the tiny model (layer mode, stored FP8/FP4 weights) are captured through AOTAutograd
with core-ATen decompositions and checked the same way, a negative remainder dividend included (at run time).
The stand-in lane (`pytest -m standin`, tests/test_standin_pipeline.py) lowers and runs the same code.
"""

from __future__ import annotations

import pytest
import torch

from engine.backends.portable import LintBackend
from engine.model.attention import _Group, floor_mod, global_topk
from nki_kernels import reference
from nki_kernels.reference import compress_pool, index_topk, order_key

g = torch.Generator().manual_seed(21)


def _problems(fn, *args) -> list[str]:
    lint = LintBackend()
    torch.compile(fn, backend=lint, dynamic=False, fullgraph=True)(*args)
    assert lint.graphs == 1
    return lint.problems


# -- (a) `%` on possibly negative ints: the window ring index ---------------------------------------------------------
def test_floor_mod_is_pythons_mod_for_negative_dividends():
    a = torch.arange(-50, 50)
    for m in (1, 3, 16, 64):
        got = floor_mod(a, m)
        assert got.tolist() == [x % m for x in a.tolist()]
        assert int(got.min()) >= 0 and int(got.max()) < m


def test_ring_index_reads_the_right_rows_and_stablehlo_remainder_would_not():
    """The decode ring index j = jmax - (jmax - i) mod wl must be the latest position <= jmax stored in ring row i
    (j = i mod wl, jmax - wl < j <= jmax; j < 0 marks an empty row). StableHLO's remainder (the sign of the
    dividend: torch.fmod) breaks this for jmax < wl - 1, i.e. every sequence's first wl - 1 decode steps."""
    wl = 16
    jmax = torch.arange(-1, 40)[:, None]
    i = torch.arange(wl)[None]
    j = jmax - floor_mod(jmax - i, wl)
    assert bool(((j <= jmax) & (j > jmax - wl) & (floor_mod(j, wl) == i)).all())
    j_stablehlo = jmax - torch.fmod(jmax - i, wl)  # the old `%` as upstream torch-mlir lowered it
    assert bool((j_stablehlo > jmax).any())  # rows "in the future": masked wrongly (golden 10/12 when emulated)


def test_ring_index_graph_has_no_negative_remainder():
    def new(jmax):
        return jmax[:, None] - floor_mod(jmax[:, None] - torch.arange(8)[None], 8)

    def old(jmax):
        return jmax[:, None] - (jmax[:, None] - torch.arange(8)[None]) % 8

    jmax = torch.tensor([0, 3, 20])
    assert _problems(new, jmax) == []
    assert any("negative" in p for p in _problems(old, jmax))


# -- (b) sort(stable=True): index_topk and global_topk --------------------------------------------------------------
def _ties(shape: tuple[int, ...]) -> torch.Tensor:
    """Scores with many exact ties, +-0.0 and -inf."""
    s = torch.randint(-3, 4, shape, generator=g).float() * 0.5
    s[s == 0] = torch.where(torch.rand(int((s == 0).sum()), generator=g) < 0.5, -0.0, 0.0)
    s[torch.rand(shape, generator=g) < 0.1] = float("-inf")
    return s


def test_order_key_orders_like_a_stable_descending_sort():
    for n in (1, 5, 37, 300):
        s = _ties((3, 4, n))
        key = order_key(s, torch.arange(n))
        want = torch.sort(s, dim=-1, descending=True, stable=True).indices
        assert torch.equal(torch.sort(key, dim=-1, descending=True).indices, want)  # any sort: the keys are distinct
        assert torch.equal(torch.topk(key, min(4, n), dim=-1).indices, want[..., :4])


def test_index_topk_equals_the_stable_sort_definition():
    for n, k in ((1, 4), (7, 4), (64, 4), (300, 16)):
        s = _ties((2, 3, n))
        vis = torch.randint(0, n + 1, (2, 3), generator=g)
        order, valid = index_topk(s, vis, k)
        assert all(torch.equal(a, b) for a, b in zip(index_topk(s, vis, k, bitcast=False), (order, valid), strict=True))
        masked = s.masked_fill(~(torch.arange(n) < vis.unsqueeze(-1)), float("-inf"))
        want = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :min(k, n)]
        assert torch.equal(order, want)
        assert torch.equal(valid, want < vis.unsqueeze(-1))


def _global_topk_stable(cands: torch.Tensor, k: int) -> torch.Tensor:
    """global_topk as it was defined (two stable sorts): the definition the portable one must match."""
    sc, gid = cands[..., 0], cands[..., 1]
    by_id = torch.sort(gid.masked_fill(torch.isinf(sc), float(2 ** 24)), dim=-1, stable=True).indices
    sc, gid = sc.gather(-1, by_id), gid.gather(-1, by_id)
    top = torch.sort(sc, dim=-1, descending=True, stable=True).indices[..., :k]
    return gid.gather(-1, top).masked_fill(torch.isinf(sc.gather(-1, top)), -1).long()


@pytest.mark.parametrize("cp,k", [(2, 4), (4, 3), (8, 16)])
def test_global_topk_equals_the_stable_sort_definition(cp: int, k: int):
    for _ in range(5):
        rows = 6
        sc = _ties((rows, cp * k))
        ids = torch.stack([torch.randperm(cp * k * 3, generator=g)[: cp * k] for _ in range(rows)]).float()
        cands = torch.stack([sc, ids.masked_fill(torch.isinf(sc), float("-inf"))], -1)
        assert torch.equal(global_topk(cands, k), _global_topk_stable(cands, k))
        assert torch.equal(global_topk(cands, k, bitcast=False), _global_topk_stable(cands, k))


def test_topk_graphs_have_no_stable_sort():
    s, vis = _ties((2, 3, 20)), torch.tensor([[3, 20, 0], [9, 9, 1]])
    assert _problems(lambda s, v: index_topk(s, v, 4), s, vis) == []
    cands = torch.stack([_ties((4, 8)), torch.arange(32).view(4, 8).float()], -1)
    assert _problems(lambda c: global_topk(c, 4), cands) == []
    assert any("stable" in p for p in _problems(lambda c: _global_topk_stable(c, 4), cands))


# -- (c) open-ended / zero-size slice assignment: compress_pool and the indexer's selection --------------------------
def _compress_pool_slices(kv, score, overlap, prev_kv=None, prev_score=None):
    """compress_pool as it was defined (slice assignment into a buffer)."""
    kv, score = kv.float(), score.float()
    if not overlap:
        return (kv * score.softmax(dim=-2)).sum(dim=-2)
    *lead, w, m, c = kv.shape
    d = c // 2
    slots_kv = kv.new_zeros(*lead, w, 2 * m, d)
    slots_sc = kv.new_full((*lead, w, 2 * m, d), float("-inf"))
    slots_kv[..., m:, :] = kv[..., d:]
    slots_sc[..., m:, :] = score[..., d:]
    slots_kv[..., 1:, :m, :] = kv[..., :-1, :, :d]
    slots_sc[..., 1:, :m, :] = score[..., :-1, :, :d]
    if prev_kv is not None:
        slots_kv[..., 0, :m, :] = prev_kv[..., :d].float()
        slots_sc[..., 0, :m, :] = prev_score[..., :d].float()
    return (slots_kv * slots_sc.softmax(dim=-2)).sum(dim=-2)


@pytest.mark.parametrize("lead,w,prev", [((), 1, True), ((5,), 1, True), ((), 1, False), ((), 7, True),
                                         ((3,), 6, False), ((2, 2), 3, True)])
def test_compress_pool_is_bit_identical_to_the_slice_assignment_form(lead, w, prev):
    m, d = 4, 16
    kv = torch.randn(*lead, w, m, 2 * d, generator=g)
    sc = torch.randn(*lead, w, m, 2 * d, generator=g) * 3
    pk = torch.randn(*lead, m, 2 * d, generator=g) if prev else None
    ps = torch.randn(*lead, m, 2 * d, generator=g) * 3 if prev else None
    assert torch.equal(compress_pool(kv, sc, True, pk, ps), _compress_pool_slices(kv, sc, True, pk, ps))


def test_compress_pool_decode_graph_has_no_empty_or_open_slice_assignment():
    kv, sc = torch.randn(3, 1, 4, 32, generator=g), torch.randn(3, 1, 4, 32, generator=g)
    pk, ps = torch.randn(3, 4, 32, generator=g), torch.randn(3, 4, 32, generator=g)
    assert _problems(lambda *a: compress_pool(*a[:2], True, *a[2:]), kv, sc, pk, ps) == []
    old = _problems(lambda *a: _compress_pool_slices(*a[:2], True, *a[2:]), kv, sc, pk, ps)
    assert any("zero-size" in p for p in old) and any("open end" in p for p in old)


def test_keep_entries_equals_the_in_place_form_and_lowers():
    valid = torch.rand(2, 3, 10, generator=g) < 0.7
    keep = torch.rand(2, 3, 6, generator=g) < 0.5
    want = valid.clone()
    want[..., 4:] &= keep
    grp = _Group(rows=slice(None), q=torch.empty(0), keys=torch.empty(0), valid=valid, n_win=4)
    grp.keep_entries(keep)
    assert torch.equal(grp.valid, want)

    def new(v, k):
        gr = _Group(rows=slice(None), q=v, keys=v, valid=v, n_win=4)
        gr.keep_entries(k)
        return gr.valid

    def old(v, k):
        v = v.clone()
        v[..., 4:] &= k
        return v

    assert _problems(new, valid, keep) == []
    assert any("open end" in p for p in _problems(old, valid, keep))


# -- (d) `>>` on int tensors and (e) compares on uint8: UE8M0 / FP4 decode ------------------------------------------
def test_decodes_have_no_shift_and_no_uint8_compare():
    b = torch.arange(256, dtype=torch.uint8)
    assert _problems(reference.ue8m0_decode, b) == []
    packed, scale = torch.randint(0, 256, (4, 16), dtype=torch.uint8, generator=g), b[120:124].view(4, 1)
    assert _problems(lambda p, s: reference.fp4_dequant_rows(p, s, 0, 4), packed, scale) == []

    def old_ue8m0(scale_u8):  # the former spelling: `(mag >> i) & 1` and `scale_u8 == 255`
        k = scale_u8.to(torch.int32) - 127
        mag, out = k.abs(), torch.ones(scale_u8.shape)
        for i in range(7):
            out = out * torch.where(((mag >> i) & 1) == 1, 2.0 ** (1 << i), 1.0)
        return torch.where(scale_u8 == 255, float("nan"), out)

    old = _problems(old_ue8m0, b)
    assert any("shift" in p for p in old) and any("uint8" in p for p in old)


def test_fp4_high_nibble_by_division_is_the_shift():
    b = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(torch.div(b, 16, rounding_mode="floor"), b >> 4)
    # what a signed reading of the byte (pattern e) would give instead: wrong for every byte >= 128
    assert not torch.equal(torch.div(b.view(torch.int8).int(), 16, rounding_mode="floor"), (b >> 4).int())


# -- the engine's decode graphs --------------------------------------------------------------------------------------
def _graphs_via(lint: LintBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode regions and embed / head of HostBackend compiled through `lint` (until the backend protocol gives a
    compile step to swap)."""
    from engine.backends.host import HostBackend

    def region(self, reg):
        template = reg.template()
        graph = torch.compile(lambda params, *args: torch.func.functional_call(template, params, args),
                              backend=lint, dynamic=False, fullgraph=True)
        return lambda r, *args: graph(r.params(), *args)

    monkeypatch.setattr(HostBackend, "compile_region", region)
    monkeypatch.setattr(HostBackend, "compile_fn", lambda self, fn, name: torch.compile(
        fn, backend=lint, dynamic=False, fullgraph=True))


def test_csa_layer_decode_graph_is_portable(monkeypatch: pytest.MonkeyPatch):
    """One CSA layer (window ring, compressor, indexer top-k, sparse attention, MoE) in layer mode: its decode graph
    and the embed / head graphs have none of the five patterns, including at run time (no remainder of a negative
    int: the first decode steps sit below the window), and the tokens are the eager engine's."""
    from engine.config import ModelConfig
    from engine.model.dummy import random_weights
    from tests.engines import build, greedy

    cfg = ModelConfig(vocab_size=512, dim=64, n_layers=1, n_mtp_layers=0, compress_ratios=(4,), n_hash_layers=0,
                      n_heads=2, head_dim=64, rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16,
                      window_size=8, n_routed_experts=4, n_activated_experts=2, moe_inter_dim=32, index_n_heads=4,
                      index_head_dim=32, index_topk=2, swiglu_limit=1.0, max_position_embeddings=256)
    weights = random_weights(cfg, 0, with_mtp=False)
    prompts = [[5, 9, 2], list(range(3, 14))]  # decode from inside the window and across it (8), past topk entries
    # the reference table: the ops device graphs run (the native host kernels are opaque custom ops in a graph)
    want, _ = greedy(build(cfg, weights, max_model_len=64, graph_mode="eager", kernels="reference"), prompts, 6)
    lint = LintBackend()
    _graphs_via(lint, monkeypatch)
    got, _ = greedy(build(cfg, weights, max_model_len=64, graph_mode="layer", host_compiler="aot_eager",
                          kernels="reference"), prompts, 6)
    assert got == want
    assert lint.graphs == 3  # the layer + embed + head, one batch/block bucket
    assert lint.problems == []


def test_split_by_sizes_off_dim_0_is_flagged():
    """split([sizes], dim != 0) returned wrong data on Neuron's lowering (the community V4 port); int sizes, chunk
    and dim 0 were fine, and so is slicing."""
    x = torch.randn(4, 6)
    for dim in (1, -1):
        found = _problems(lambda x, d=dim: [t * 2 for t in x.split([2, 4], dim=d)], x)
        assert len(found) == 1 and "split([sizes], dim=1)" in found[0]
    assert _problems(lambda x: [t * 2 for t in x.split([1, 3], dim=0)], x) == []
    assert _problems(lambda x: [t * 2 for t in x.split(3, dim=1)], x) == []
    assert _problems(lambda x: [t * 2 for t in x.chunk(2, dim=1)], x) == []
    assert _problems(lambda x: (x[:, :2] * 2, x[:, 2:] * 2), x) == []


@pytest.mark.slow
def test_golden_model_decode_graphs_are_portable(monkeypatch: pytest.MonkeyPatch):
    """The tiny golden model (CSA + HCA + window-only layers, hash routing, stored FP8/FP4 weights: UE8M0 / e4m3 /
    e2m1 decodes inside the graphs) in layer mode, as above (~2 min on an idle 2-core box, 7 on a busy one)."""
    import engine
    from deepinfer_bench.bench.golden import GOLDEN_DIR, golden_config, load_golden
    from engine.llm import greedy_with_logits

    cfg = golden_config(graph_mode="eager", kernels="reference")  # the ops device graphs run
    _, prompts = load_golden(GOLDEN_DIR, cfg.model.config)
    chosen = [p.prompt_ids for p in prompts if p.name in ("text_hi", "ids_17", "ids_21_nobos")]  # window 16 crossed
    want, _ = greedy_with_logits(engine.build(cfg), chosen, 6)
    lint = LintBackend()
    _graphs_via(lint, monkeypatch)
    got, _ = greedy_with_logits(engine.build(golden_config(graph_mode="layer", host_compiler="aot_eager",
                                                           kernels="reference")), chosen, 6)
    assert got == want
    assert lint.graphs == 6  # 4 layer structures + embed + head, one batch/block bucket
    assert lint.problems == []
