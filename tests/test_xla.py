"""The engine on a torch-xla device (PJRT CPU): the second CI lane runs these (`python -m pytest -m "xla and not
slow"` in a venv with torch 2.9.0 + torch-xla 2.9.0; `-m xla` adds the two marked slow). They need torch-xla; in the
host lane they are deselected by the marker.

What is shown here: the golden through the same LLMEngine path on `xla:0` (eager and layer graphs); decode graphs
shared across layers (their number does not grow with the layer count); after warm-up a decode step compiles
nothing, falls back to the CPU for nothing and copies to the host once; `deepinfer compile` writes one HLO module
per graph with no f8 type. What is not: neuronx-cc, the Neuron runtime, multi-process XLA collectives.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytestmark = pytest.mark.xla

TINY = Path(__file__).resolve().parents[1] / "golden" / "tiny"


@pytest.fixture(autouse=True)
def _pjrt_cpu(monkeypatch: pytest.MonkeyPatch):
    import engine.envs

    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    engine.envs.get_envs.cache_clear()
    yield
    engine.envs.get_envs.cache_clear()


# Both modes are opt-in (`-m "xla and slow"`): the layer-mode golden was ~85 % of CI lane 2 (docs/ci.md), and the
# PyTorch/XLA line is legacy on trn2 (unsupported for inference from SDK 2.34). Per landing lane 2 keeps the XLA
# graphs' compile counts, the HLO export, regions timing on xla and the kernel ops on the xla device.
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "layer"])
def test_golden_on_xla(mode: str) -> None:
    from deepinfer_bench.bench.golden import golden_config, run_golden

    run = run_golden(golden_config(backend="xla", graph_mode=mode))
    assert run.ok, run.table.to_string()
    dev = run.meta["backend"]
    assert dev["device"].startswith("xla") and dev["decode_steps"] > 30
    if mode == "layer":  # static decode: no CPU fallback, no compile once a shape was seen, one copy back per step
        assert run.meta["region_launches"] > 0 and dev["compiles_after_warmup"] == 0
        assert dev["fallbacks_per_decode_step"] == 0 and dev["transfers_to_host_per_decode_step"] == 1


_COUNTERS = """
import json, sys
import engine
from engine.config import EngineConfig, ModelConfig
from engine.sampler import SamplingParams
base = ModelConfig.from_json(sys.argv[1])
cfg = ModelConfig(**{**base.__dict__, **json.loads(sys.argv[2])})
config = EngineConfig.from_model_config(cfg, backend="xla", graph_mode="layer", load_format="dummy", max_num_seqs=4,
                                        num_kv_blocks=8, max_model_len=32)
eng = engine.build(config)
be = eng.runner.backend
# the last request finishes after 4 tokens: from the 4th decode step on the batch is 3, inside the same bucket (4)
for p, n in (([5, 6, 7], 7), ([9, 10, 11, 12], 7), ([13, 14], 7), ([15, 16, 17], 4)):
    eng.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
eng.step()  # prefill (chunk graphs)
steps = []
for _ in range(6):
    before = be.counters()
    outs = eng.step()
    delta = be.counters().minus(before)
    keys = ("graph_compiles", "compiles", "transfers_to_host", "transfers_to_device", "fallbacks")
    steps.append({**{k: delta[k] for k in keys}, "finished": sum(o.finished for o in outs)})
print(json.dumps({"graphs": len([k for k in eng.runner.regions.compiled if not k[0].startswith("chunk")]),
                  "steps": steps}))
"""


def _decode_counters(**over) -> tuple[int, list[dict]]:
    """Counters of 6 decode steps of a fresh engine in a fresh process (XLA's compile cache is per process, and
    graphs an earlier engine compiled would be cache hits here)."""
    import os
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", _COUNTERS, str(TINY), json.dumps(over)], capture_output=True,
                         text=True, timeout=900, env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    return out["graphs"], out["steps"]


def test_decode_graphs_do_not_grow_with_layers() -> None:
    g4, steps4 = _decode_counters()
    g8, steps8 = _decode_counters(n_layers=8, compress_ratios=EIGHT_LAYERS)
    assert g4 == g8 == 4  # decode layer graphs: (sliding, hash), (CSA, hash), (HCA), (CSA) x one bucket
    # twice the layers, the same compiled graphs (per-layer graphs would compile 4 more per new shape)
    assert sum(s["graph_compiles"] for s in steps8) == sum(s["graph_compiles"] for s in steps4) > 0
    # after warm-up (also once the batch shrank inside its bucket): nothing compiles, nothing falls back, one copy to
    # the host, one to the device (the step's packed inputs; plus the slot index of each sequence that finished)
    for s in steps4[1:] + steps8[1:]:
        assert (s["compiles"], s["transfers_to_host"], s["fallbacks"]) == (0, 1, 0), (steps4, steps8)
        assert s["transfers_to_device"] == 1 + s["finished"], (steps4, steps8)


EIGHT_LAYERS = [0, 4, 16, 4, 16, 4, 16, 4, 0]  # 8 layers (+ the MTP block's entry): the tiny model's 4 structures

_PREFILL = """
import json, sys, torch
import engine
from deepinfer_bench.bench.golden import GOLDEN_DIR, golden_config, load_golden, workload
from engine.config import EngineConfig, ModelConfig
from engine.llm import greedy_with_logits
base = golden_config(graph_mode="eager")
_, golden = load_golden(GOLDEN_DIR, base.model.config)
cfg = ModelConfig(**{**base.model.config.__dict__, **json.loads(sys.argv[1])})
config = EngineConfig.from_model_config(cfg, backend="xla", graph_mode="layer", load_format="dummy",
                                        workload=workload(golden))
eng = engine.build(config)
be, runner = eng.runner.backend, eng.runner
keys = ("compiles", "graph_compiles", "fallbacks", "transfers_to_host")
acc = dict.fromkeys(keys + ("steps",), 0)
forward = runner.forward
def counted(steps, *args, **kw):  # the counters of every step with a multi-token entry (a prefill chunk)
    before = be.counters()
    out = forward(steps, *args, **kw)
    if any(s.n > 1 for s in steps):
        delta = be.counters().minus(before)
        for k in keys:
            acc[k] += delta[k]
        acc["steps"] += 1
    return out
runner.forward = counted
def run(prompts):
    acc.update(dict.fromkeys(acc, 0))
    greedy_with_logits(eng, prompts, 3)
    return dict(acc)
first = run([p.prompt_ids for p in golden])
chunk = sorted([k[0], list(k[1]), *k[2:]] for k in runner.regions.compiled if k[0].startswith("chunk"))
g = torch.Generator().manual_seed(7)
second = run([torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in json.loads(sys.argv[2])])
print(json.dumps({"first": first, "second": second, "chunk_graphs": chunk}))
"""

# Prompt lengths other than the golden's (2, 6, 15, 22, 23, 26, 44, 63, 163, 250, 330 are none of them) whose
# bucket-fitted chunks fall in the (batch, chunk, block) buckets the golden prompts used: steps of
# (C 8 x 4, C 32 x 5, C 128 x 2, C 512 x 1), then (C 8 x 3, C 32 x 2, C 128 x 1), then C 8 x 2.
OTHER_LENGTHS = [2, 6, 15, 16, 22, 23, 26, 44, 63, 163, 250, 330]


def _prefill_counters(over: dict) -> dict:
    import os
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", _PREFILL, json.dumps(over), json.dumps(OTHER_LENGTHS)],
                         capture_output=True, text=True, timeout=1800, env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # opt-in (`-m "xla and slow"`): ~525 s there (two engines' chunk graphs); the golden in layer mode
# runs prefill through chunk graphs in the lane
def test_prefill_graphs_per_bucket_not_per_layer_or_prompt() -> None:
    """Prefill chunks run as chunk-region graphs, one per (structure, batch bucket, chunk bucket, block bucket):
    the golden prompts compile the same graphs with 4 layers and with 8, nothing falls back to the CPU, and a
    second set of prompts of other lengths compiles nothing at all in its prefill steps."""
    r4 = _prefill_counters({})
    r8 = _prefill_counters({"n_layers": 8, "compress_ratios": EIGHT_LAYERS})
    structures = 4  # (sliding, hash), (CSA, hash), (CSA), (HCA)
    shapes = {tuple(k[2:]) for k in r4["chunk_graphs"]}  # (batch bucket, chunk bucket, block bucket)
    assert r4["chunk_graphs"] == r8["chunk_graphs"] and len(r4["chunk_graphs"]) == structures * len(shapes)
    # the same compiles in the prefill steps with twice the layers (chunk, decode, embed and head graphs; eager
    # one-op graphs included): nothing is compiled per layer
    assert r4["first"]["graph_compiles"] == r8["first"]["graph_compiles"] >= len(r4["chunk_graphs"])
    assert r4["first"]["compiles"] == r8["first"]["compiles"], (r4, r8)
    for r in (r4, r8):
        assert r["first"]["fallbacks"] == r["second"]["fallbacks"] == 0
        assert r["second"]["steps"] >= 3 and r["second"]["compiles"] == 0, r


def test_compile_writes_hlo_per_graph(tmp_path: Path) -> None:
    from deepinfer_bench.cli import app

    res = CliRunner().invoke(app, ["compile", "--backend", "xla", "--graph-mode", "regions", "--max-num-seqs", "2",
                                   "--max-model-len", "32", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    graphs = manifest["graphs"]
    # regions mode: attn per ratio (0, 4, 16) + moe per routing (hash, not) = 5 structures x (2 x 2) buckets,
    # plus embed and head per batch bucket
    assert len(graphs) == 5 * 4 + 2 * 2
    for g in graphs:
        assert (tmp_path / f"{g['graph']}.hlo.pb").stat().st_size == g["hlo_bytes"] > 0
        assert "ENTRY" in (tmp_path / f"{g['graph']}.hlo.txt").read_text()
        assert not g["has_fp8"] and g["inputs"]
    assert manifest["stack"]["versions"]["torch-xla"]
    # --graphs: only the heads, the same names, into a fresh folder
    sel = tmp_path / "heads"
    res = CliRunner().invoke(app, ["compile", "--backend", "xla", "--graph-mode", "regions", "--max-num-seqs", "2",
                                   "--max-model-len", "32", "--graphs", "head_*", "--out", str(sel)])
    assert res.exit_code == 0, res.output
    rows = json.loads((sel / "manifest.json").read_text())["graphs"]
    assert [g["graph"] for g in rows] == [g["graph"] for g in graphs if g["graph"].startswith("head_")] and rows
    assert sorted(p.name for p in sel.glob("*.hlo.pb")) == sorted(f"{g['graph']}.hlo.pb" for g in rows)


@pytest.mark.slow  # opt-in (`-m "xla and slow"`): ~34 CPU-s, the largest of CI lane 2's; the legacy line's compile and
# transfer counts per step are proven every landing by test_decode_graphs_do_not_grow_with_layers, `regions --timing`
# itself on the host's layer graphs (tests/test_regions_cli.py)
def test_regions_timing_on_xla(tmp_path: Path) -> None:
    import pandas as pd

    from deepinfer_bench.cli import app

    res = CliRunner().invoke(app, ["regions", "--timing", "--backend", "xla", "--graph-mode", "layer", "--batch", "2",
                                   "--context", "9", "--steps", "4", "--warmup", "3", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    s = pd.read_csv(next(tmp_path.iterdir()) / "regions_summary.csv").iloc[0]
    assert 0.9 <= s["stage_sum_over_step"] <= 1.1
    assert s["xla_compiles_per_step"] == 0 and s["fallbacks_per_step"] == 0 and s["d2h_per_step"] == 1
    assert s["h2d_per_step"] == 1  # the step's packed inputs, nothing else (no per-call copy of a constant table)


def test_runtime_started_before_the_engine_is_named() -> None:
    """A process that touched xla:0 before the engine's backend set the runtime's cache size gets a warning naming the
    setting (the runtime reads it once; its 2048-graph default let eager per-op graphs evict the decode graphs)."""
    import os
    import subprocess
    import sys

    code = ("import warnings, torch, torch_xla\n"
            "torch.ones(2, device=torch_xla.device()).sum().item()\n"
            "from engine.backends.xla import apply_runtime_env\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always'); apply_runtime_env()\n"
            "print('|'.join(str(x.message) for x in w))\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_COMPILATION_CACHE_SIZE"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**env, "PJRT_DEVICE": "CPU"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "XLA_COMPILATION_CACHE_SIZE=65536" in res.stdout and "before" in res.stdout
