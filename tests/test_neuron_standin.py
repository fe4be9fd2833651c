"""`--backend neuron-standin`: the TorchNeuron backend with its compile step on the CPU stand-in (torch-mlir StableHLO
-> XLA CPU). Every test here is marked `standin`: it needs the `neuron-standin` extra (torch-mlir==20261001,
jax[cpu]==0.10.2) and is deselected by the marker in the default lane (pyproject addopts); run with
`python -m pytest -m standin tests/test_neuron_standin.py` in a venv that has the extra. Each golden run compiles ~18
XLA CPU graphs (3.5-5 min on 2 cores, longer on a shared box); the compile export lowers 18 graphs (~4 min). Its
results say: TorchNeuron pipeline on a CPU stand-in (torch-mlir + XLA CPU), not neuronx-cc, not trn2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli import run_main

pytestmark = pytest.mark.standin

LABEL = "TorchNeuron pipeline on a CPU stand-in (torch-mlir + XLA CPU), not neuronx-cc, not trn2"


def test_backend_is_the_torchneuron_class_with_the_compile_step_swapped() -> None:
    from engine.backends import get_backend
    from engine.backends.torchneuron import NeuronStandinBackend, TorchNeuronBackend
    from tests.fake_runner import fake_config

    be = get_backend(fake_config(backend="neuron-standin"))
    assert isinstance(be, NeuronStandinBackend) and isinstance(be, TorchNeuronBackend)
    assert str(be.device) == "cpu" and be.measured_on() == LABEL
    # the class's graph calls are TorchNeuron's; only the Dynamo backend differs
    assert NeuronStandinBackend.compile_fn is TorchNeuronBackend.compile_fn
    assert NeuronStandinBackend.compile_region is TorchNeuronBackend.compile_region
    f = be.compile_fn(lambda x: (x * 2).sum(-1), "f")
    import torch

    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(f(x), (x * 2).sum(-1))
    c = be.counters()
    assert (c.graph_compiles, c.executions, c.fallbacks) == (1, 1, 0) and c.compile_seconds > 0


def test_golden_through_the_standin_is_12_of_12(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """One batch bucket (16: every decode step padded to it): 6 graphs instead of the default ladder's 30 possible
    (each is ~10 CPU-s to lower here, most of CI lane 3); the bucket ladder itself is tested on the host's graphs."""
    code, _, err = run_main(["golden", "--backend", "neuron-standin", "--batch-buckets", "16", "--out", str(tmp_path)],
                            capsys)
    assert code == 0, err
    assert "12/12 prompts match" in err
    (meta_path,) = tmp_path.glob("golden-*/meta.json")
    meta = json.loads(meta_path.read_text())
    assert meta["engine_config"]["backend"] == "neuron-standin" and meta["graph_mode"] == "layer"
    assert meta["measured_on"] == LABEL
    b = meta["backend"]
    assert meta["engine_config"]["batch_buckets"] == [16]
    assert b["graph_compiles"] == 6 and b["executions"] > b["graph_compiles"] and b["compile_seconds"] > 0
    assert b["fallbacks"] == 0 and b["fallback_ops"] == {} and b["graph_compiles_after_warmup"] == 0


@pytest.mark.slow  # opt-in (`pytest -m standin`): the kernel ops' cut is proven per landing by test_standin_pipeline's
# test_a_graph_with_kernel_ops_is_cut_at_them; this whole-golden run is ~a quarter of CI lane 3 (docs/ci.md)
def test_golden_with_the_kernel_ops_inside_the_graphs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--kernels stand-in: every NKI kernel family runs as a custom op inside the stand-in's graphs (each graph cut
    at its kernel calls, engine/backends/standin_split.py), 12/12, no eager fallback (~3.5 min here)."""
    from nki_kernels import torch_ops

    code, _, err = run_main(["golden", "--backend", "neuron-standin", "--kernels", "stand-in", "--out", str(tmp_path)],
                            capsys)
    assert code == 0, err
    assert "12/12 prompts match" in err
    (meta_path,) = tmp_path.glob("golden-*/meta.json")
    meta = json.loads(meta_path.read_text())
    b = meta["backend"]
    assert b["fallbacks"] == 0 and b["fallback_ops"] == {} and b["graph_compiles_after_warmup"] == 0
    assert set(b["custom_op_calls"]) == set(torch_ops.KERNELS)  # all 12 kernel ops ran inside graphs
    assert b["graph_pieces"] > b["graph_compiles"] > 0
    kernels = (meta_path.parent / "golden_kernels.csv").read_text().splitlines()[1:]
    assert kernels and all(row.split(",")[2] == "stand-in" for row in kernels)  # no reference fallback, in or out


def test_compile_writes_checked_stablehlo(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The prefill graphs and the embeddings / heads (`--graphs`): the decode layer graphs lower every landing in
    test_golden_through_the_standin_is_12_of_12 (at its batch bucket), ~22 CPU-s of CI lane 3 not spent twice."""
    out = tmp_path / "graphs"
    code, _, err = run_main(["compile", "--backend", "neuron-standin", "--max-num-seqs", "1", "--max-model-len", "16",
                             "--max-num-batched-tokens", "8", "--chunk-graphs", "--graphs", "chunk_*,embed_*,head_*",
                             "--out", str(out)], capsys)
    assert code == 0, err
    assert "graphs:" in err.split("compiling the graphs")[0]  # the count, printed before anything compiles
    files = sorted(out.glob("*.mlir"))
    assert len(files) >= 4
    for f in files:
        text = f.read_text()
        assert "stablehlo." in text and "f8E" not in text and "torch." not in text, f.name
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["measured_on"] == LABEL
    rows = manifest["graphs"]
    assert {Path(r["mlir"]).name for r in rows} == {f.name for f in files}
    assert all(r["status"] == "pass" and not r["has_fp8"] for r in rows)
    assert {r["region"] for r in rows} == {"chunk.layer", "chunk.embed", "chunk.head", "embed", "head"}
    # every chunk structure at the one chunk bucket (the 8-token budget; each chunk graph is ~14 CPU-s to lower, the
    # ladder itself is tested on the host), + embed / head at the decode and the chunk shapes
    chunk = [r for r in rows if r["region"] == "chunk.layer"]
    assert {r["chunk_bucket"] for r in chunk} == {8}
    budget = manifest["budget"]
    assert len(chunk) == budget["structures"] and manifest["selected"] == ["chunk_*", "embed_*", "head_*"]
    assert len(rows) == budget["total"] - budget["decode_graphs"]  # all but the decode layer graphs


@pytest.mark.slow  # opt-in (`pytest -m standin`), as the kernel-op golden above (docs/ci.md)
def test_compile_with_the_kernel_table_writes_each_graphs_pieces(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`--kernels stand-in`: every decode and prefill graph traces with its kernel ops (fullgraph) and is written as
    its pure pieces (`<graph>.p<k>.mlir`), each checked (~2 min here)."""
    out = tmp_path / "graphs"
    code, _, err = run_main(["compile", "--backend", "neuron-standin", "--kernels", "stand-in", "--max-num-seqs", "1",
                             "--max-model-len", "16", "--max-num-batched-tokens", "16", "--chunk-graphs", "--out",
                             str(out)], capsys)
    assert code == 0, err
    rows = json.loads((out / "manifest.json").read_text())["graphs"]
    assert rows and all(r["status"] == "pass" and not r["has_fp8"] and not r["problems"] for r in rows)
    layers = [r for r in rows if r["region"] in ("layer", "chunk.layer")]
    assert {r["region"] for r in layers} == {"layer", "chunk.layer"}
    assert all(r["custom_ops"] > 0 and 0 < len(r["mlir"]) <= r["pieces"] for r in layers)
    for r in layers:
        for f in r["mlir"]:
            text = Path(f).read_text()
            assert "stablehlo." in text and "f8E" not in text and "torch." not in text, f
