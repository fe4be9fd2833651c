"""The CPU stand-in of TorchNeuron's compile pipeline (engine/backends/standin_pipeline.py): Dynamo -> AOTAutograd ->
torch-mlir StableHLO -> XLA CPU. Tests marked `standin` need the `neuron-standin` extra (torch-mlir==20261001,
jax[cpu]==0.10.2; run with `python -m pytest -m standin` in a venv that has it); in the default lane they are
deselected by the marker. The unmarked ones need torch only.

What is shown: graphs with KV-cache writes lower and run with the writes applied to the real tensors; static shapes
only; a lowering failure raises by default and falls back (counted) only when asked; modules carry no f8 type and
no torch op; the portable spellings of the five patterns (tests/test_portable.py) lower and compute torch's values,
while the old spellings fail or compute StableHLO's; the tiny golden model's decode graphs give the eager engine's
tokens. Label: TorchNeuron pipeline on a CPU stand-in (torch-mlir + XLA CPU), not neuronx-cc, not trn2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine.backends.standin_pipeline import StandinError, module_problems

standin = pytest.mark.standin
g = torch.Generator().manual_seed(5)


# -- torch only ------------------------------------------------------------------------------------------------------
def test_module_checks_find_f8_types_and_torch_ops():
    clean = "func.func @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {\n %0 = stablehlo.add %arg0, %arg0 : tensor<4xf32>"
    assert module_problems(clean) == []
    f8 = clean + "\n %1 = stablehlo.convert %0 : (tensor<4xf32>) -> tensor<4xf8E4M3FN>"
    assert any("f8E4M3FN" in p for p in module_problems(f8))
    left = clean + ('\n %2 = torch.aten.sort.stable %0 : !torch.vtensor<[4],f32>'
                    '\n %3 = "torch.constant.int"() {value = 5}')
    (msg,) = module_problems(left)
    assert "torch.aten" in msg and "torch.constant" in msg


def test_without_the_extra_the_pipeline_is_one_clear_error(monkeypatch: pytest.MonkeyPatch):
    from engine.backends.standin_pipeline import StandinPipeline

    monkeypatch.setitem(sys.modules, "torch_mlir", None)  # an import of it fails, installed or not
    with pytest.raises(ValueError, match=r"torch-mlir and jax.*neuron-standin"):
        StandinPipeline()


# -- the pipeline ----------------------------------------------------------------------------------------------------
@pytest.fixture()
def pipe(tmp_path: Path):
    from engine.backends.standin_pipeline import StandinPipeline

    return StandinPipeline(dump_dir=tmp_path)


def _cache_step(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    cache[slots, rows] = kv  # a KV-cache write: an input mutation
    return cache[slots].sum(1) * 2


@standin
def test_graph_with_cache_writes_runs_and_writes_back(pipe, tmp_path: Path):
    f = pipe.compile_fn(_cache_step, "cache_step")
    cache, ref = torch.zeros(4, 8, 16), torch.zeros(4, 8, 16)
    for step in range(3):
        slots, rows, kv = torch.tensor([2, 0]), torch.tensor([step, 7 - step]), torch.randn(2, 16, generator=g)
        with torch.inference_mode():
            got = f(cache, slots, rows, kv)
        want = _cache_step(ref, slots, rows, kv)
        assert torch.equal(cache, ref)  # the write reached the caller's tensor
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    s = pipe.stats
    assert (s.graphs_compiled, s.executions, s.fallbacks) == (1, 3, 0)  # one shape: one compile
    (rec,) = s.graphs
    assert rec.mutated_inputs == 1 and rec.compile_s > 0 and s.compile_s == pytest.approx(rec.compile_s)
    text = (tmp_path / "cache_step.mlir").read_text()
    assert "stablehlo.scatter" in text and module_problems(text) == []
    (row,) = s.manifest()
    assert row["mlir"] == str(tmp_path / "cache_step.mlir") and row["inputs"][0] == [[4, 8, 16], "float32"]
    assert s.as_dict()["graphs_compiled"] == 1 and "not trn2" in s.as_dict()["label"]


def _kernel_step(ops, cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                 norm: torch.Tensor) -> torch.Tensor:
    h = ops.rms_norm(x * 2, norm, 1e-6)  # a kernel op between pure torch ops
    y = ops.linear(torch.tanh(h), w)
    cache[slots] = y  # a cache write after the last kernel op: written back by the last piece
    return ops.swiglu(y, y + 1, 1.0).sum(-1)


@standin
def test_a_graph_with_kernel_ops_is_cut_at_them(pipe, tmp_path: Path):
    """`--kernels stand-in` on the stand-in: one Dynamo graph (fullgraph) holding the kernels' torch ops is cut at
    them; each pure piece is lowered (checked, .mlir written) and XLA-compiled, each op runs its NumPy stand-in
    between them, counted; the results and the cache write equal the eager kernel ops'."""
    from nki_kernels import dispatch, kernel_ops

    kops = kernel_ops.KernelOps("stand-in")
    w, norm = torch.randn(16, 16, generator=g) * 0.1, torch.rand(16, generator=g) + 0.5
    kops.prepare("T", w, dt=torch.float32)
    f = pipe.compile_fn(lambda *a: _kernel_step(kops, *a), "kernel_step")
    cache, ref = torch.zeros(4, 16), torch.zeros(4, 16)
    d = dispatch.Dispatcher("stand-in")
    with d.active():
        for step in range(2):
            slots, x = torch.tensor([step, 3]), torch.randn(2, 16, generator=g)
            with torch.inference_mode():
                got = f(cache, slots, x, w, norm)
            want = _kernel_step(kops, ref, slots, x, w, norm)
            assert cache[slots].abs().sum() > 0  # the write reached the caller's tensor ...
            torch.testing.assert_close(cache, ref, rtol=0, atol=1e-5)  # ... (XLA's tanh: not bit-equal to torch's)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    s = pipe.stats
    assert (s.graphs_compiled, s.graphs_split, s.executions, s.fallbacks) == (1, 1, 2, 0)
    assert dict(s.custom_op_calls) == {"rmsnorm": 2, "grouped_out_proj": 2, "swiglu": 2}
    # 2 eager + 2 graph runs of each kernel, all on the stand-in
    assert d.counts == {("rmsnorm", "stand-in"): 4, ("blockquant.dense", "stand-in"): 4, ("swiglu", "stand-in"): 4}
    parent = next(r for r in s.graphs if r.name == "kernel_step")
    assert parent.custom_ops == 3 and parent.pieces == s.pieces_compiled >= 3 and parent.mutated_inputs == 1
    pieces = sorted(tmp_path.glob("kernel_step.p*.mlir"))
    assert len(pieces) == s.pieces_compiled
    for piece in pieces:
        text = piece.read_text()
        assert module_problems(text) == [] and "deepinfer" not in text


@standin
def test_dynamic_shapes_are_refused(pipe):
    f = torch.compile(lambda x: x * 2, backend=pipe, dynamic=True)
    with pytest.raises(Exception, match="static shapes only"):
        f(torch.ones(5))


def _old_sort(x: torch.Tensor) -> torch.Tensor:
    return torch.sort(x, dim=-1, descending=True, stable=True).indices


@standin
def test_a_graph_that_does_not_lower_raises_by_default(pipe):
    with pytest.raises(Exception, match=r"sort\(stable=True\)") as err:
        pipe.compile_fn(_old_sort, "old_sort")(torch.randn(3, 8, generator=g))
    assert isinstance(err.value, StandinError) or "StandinError" in str(err.value)
    assert pipe.stats.graphs_compiled == 0


@standin
def test_fallback_only_when_asked_and_counted(tmp_path: Path):
    from engine.backends.standin_pipeline import StandinPipeline

    pipe = StandinPipeline(fallback=True)

    def f(cache, x):
        cache[1:3] = x
        return _old_sort(cache)

    cache, x = torch.zeros(5), torch.tensor([2.0, 1.0])
    out = pipe.compile_fn(f, "sort_and_write")(cache, x)
    assert out.tolist() == [1, 2, 0, 3, 4] and cache.tolist() == [0, 2, 1, 0, 0]  # eager: right values, write kept
    assert pipe.stats.fallbacks == 1 and pipe.stats.graphs_compiled == 0
    assert "sort(stable=True)" in pipe.stats.graphs[0].fallback


# -- the five patterns: portable spellings lower to torch's values, old ones do not ---------------------------------
@standin
def test_floor_mod_lowers_to_pythons_mod_and_percent_does_not(pipe):
    from engine.model.attention import floor_mod

    a = torch.arange(-20, 20)
    assert pipe.compile_fn(lambda a: floor_mod(a, 16), "floor_mod")(a).tolist() == [x % 16 for x in a.tolist()]
    old = pipe.compile_fn(lambda a: a % 16, "percent")(a)  # StableHLO remainder: the dividend's sign
    assert old.tolist() != [x % 16 for x in a.tolist()] and int(old.min()) < 0


@standin
def test_topk_by_order_key_lowers_and_matches_the_stable_sort(pipe):
    from engine.model.attention import global_topk
    from nki_kernels.reference import index_topk

    s = torch.randint(-2, 3, (2, 3, 40), generator=g).float()  # many ties
    vis = torch.tensor([[40, 7, 0], [13, 40, 1]])
    got = pipe.compile_fn(lambda s, v: index_topk(s, v, 8), "index_topk")(s, vis)
    want = index_topk(s, vis, 8)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    cands = torch.stack([s[0], torch.arange(120).view(3, 40).float()], -1)
    assert torch.equal(pipe.compile_fn(lambda c: global_topk(c, 8), "global_topk")(cands), global_topk(cands, 8))


@standin
def test_compress_pool_at_one_block_lowers(pipe):
    from nki_kernels.reference import compress_pool

    kv, sc = torch.randn(3, 1, 4, 32, generator=g), torch.randn(3, 1, 4, 32, generator=g)
    pk, ps = torch.randn(3, 4, 32, generator=g), torch.randn(3, 4, 32, generator=g)
    got = pipe.compile_fn(lambda *a: compress_pool(a[0], a[1], True, a[2], a[3]), "compress_pool")(kv, sc, pk, ps)
    torch.testing.assert_close(got, compress_pool(kv, sc, True, pk, ps), rtol=1e-6, atol=1e-6)  # XLA's exp/sum order


@standin
def test_stored_weight_decodes_lower_bit_exact(pipe):
    from nki_kernels import formats, reference

    b = torch.arange(256, dtype=torch.uint8)
    got = pipe.compile_fn(reference.ue8m0_decode, "ue8m0")(b)
    want = reference.ue8m0_decode(b)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[1:255].view(torch.int32), want[1:255].view(torch.int32))
    # byte 0 is 2**-127, an fp32 subnormal: XLA's CPU runtime flushes subnormals to zero (a property of the stand-in's
    # back half, not of the lowering; the quantisers' scale floors never produce this byte)
    assert got[0].item() in (0.0, 2.0 ** -127)
    w8, s8 = formats.stored_fp8(*formats.quant_fp8_block(torch.randn(256, 200, generator=g)))
    fp8 = pipe.compile_fn(lambda w, s: reference.fp8_dequant_rows(w, s, 0, 256), "fp8_rows")(w8, s8)
    assert torch.equal(fp8, reference.fp8_dequant_rows(w8, s8, 0, 256))
    p4, s4 = formats.stored_fp4(*formats.quant_fp4(torch.randn(64, 128, generator=g)))
    fp4 = pipe.compile_fn(lambda p, s: reference.fp4_dequant_rows(p, s, 0, 64), "fp4_rows")(p4, s4)
    assert torch.equal(fp4, reference.fp4_dequant_rows(p4, s4, 0, 64))  # bytes >= 128 decode as unsigned


@standin
def test_old_shift_and_uint8_compare_do_not_lower(pipe):
    b = torch.arange(256, dtype=torch.uint8)
    with pytest.raises(Exception, match="bit shift"):
        pipe.compile_fn(lambda b: b >> 4, "shift")(b)
    with pytest.raises(Exception, match="uint8"):
        pipe.compile_fn(lambda b: b == 255, "u8_compare")(b)


# -- the engine ------------------------------------------------------------------------------------------------------
@standin
# opt-in (`pytest -m standin`): the golden through the stand-in (test_neuron_standin.py) runs the same layer graphs per
# landing, against HF; this one's tighter 1e-4 against the eager engine is kept for a full run
@pytest.mark.slow
def test_tiny_model_decode_graphs_through_the_standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Three golden prompts (the window of 16 and the CSA/HCA ratios crossed) on the tiny golden model in layer mode:
    the 4 layer graphs and embed + head through the stand-in, the eager engine's tokens, logits within 1e-4 (XLA
    reorders fp32 sums), no fallback, every module clean, and no compile after the first decode step."""
    import engine
    from deepinfer_bench.bench.golden import GOLDEN_DIR, golden_config, load_golden
    from engine.backends.host import HostBackend
    from engine.backends.standin_pipeline import StandinPipeline
    from engine.llm import greedy_with_logits

    cfg = golden_config(graph_mode="eager", kernels="reference")
    _, prompts = load_golden(GOLDEN_DIR, cfg.model.config)
    chosen = [p.prompt_ids for p in prompts if p.name in ("text_hi", "ids_17", "ids_21_nobos")]
    want, want_logits = greedy_with_logits(engine.build(cfg), chosen, 8)
    pipe = StandinPipeline(dump_dir=tmp_path)
    monkeypatch.setattr(HostBackend, "compile_region", lambda self, region: pipe.compile_region(region))
    monkeypatch.setattr(HostBackend, "compile_fn", lambda self, fn, name: pipe.compile_fn(fn, name))
    eng = engine.build(golden_config(graph_mode="layer", host_compiler="aot_eager", kernels="reference"))
    got, logits = greedy_with_logits(eng, chosen, 8)
    assert got == want
    assert max(float((a - b).abs().max()) for a, b in zip(logits, want_logits, strict=True)) < 1e-4
    s = pipe.stats
    assert s.fallbacks == 0 and s.graphs_compiled == 6  # 4 layer structures + embed + head, one bucket
    assert s.executions == 7 * 6  # 7 decode steps (the first token comes from the prefill), 6 graphs each
    mlir = sorted(tmp_path.glob("*.mlir"))
    assert len(mlir) == 6 and all(module_problems(p.read_text()) == [] for p in mlir)
