"""`--backend neuron` (TorchNeuron, engine/backends/torchneuron.py) against fakes: a fake native `torch_neuronx`
(nki_op / wrap_nki, no distribution metadata), a fake `torch.neuron`, a fake "neuron" Dynamo backend and a
monkeypatched /dev/neuron*. The Neuron SDK is not installable here; what these tests show is the backend's own
logic (detection, first-contact errors, per-rank process setup, graph compile calls, the process groups and the
functional collectives, the compile-only report), not anything of TorchNeuron itself. `--backend neuron-standin`'s
missing-extra error is here too (its runs are in tests/test_neuron_standin.py, marked `standin`)."""

from __future__ import annotations

import glob
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import engine.envs
from tests.cli import run_main
from tests.fake_runner import fake_config


@pytest.fixture
def envs(monkeypatch: pytest.MonkeyPatch):
    def set_env(**values: str) -> None:
        for k, v in values.items():
            monkeypatch.setenv(k, v)
        engine.envs.get_envs.cache_clear()

    for k in ("NEURON_LOGICAL_NC_CONFIG", "NEURON_RT_VISIBLE_CORES", "LOCAL_RANK", "WORLD_SIZE", "RANK",
              "TORCH_NEURONX_NEFF_CACHE_DIR", "TORCH_NEURONX_COMPILE_ONLY", "XDG_CACHE_HOME"):
        monkeypatch.delenv(k, raising=False)
    engine.envs.get_envs.cache_clear()
    yield set_env
    engine.envs.get_envs.cache_clear()


@pytest.fixture
def tnx(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """A native torch_neuronx (importable, nki_op / wrap_nki), torch.neuron.synchronize and a "neuron" Dynamo
    backend that records each graph it gets and runs it eagerly. No device until `seen.device(True)`."""
    seen = types.SimpleNamespace(graphs=[], syncs=0, fail=None)
    m = types.ModuleType("torch_neuronx")
    m.__version__ = "2.13.3"
    m.nki_op = m.wrap_nki = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "torch_neuronx", m)
    monkeypatch.setattr(torch, "neuron", types.SimpleNamespace(
        synchronize=lambda: setattr(seen, "syncs", seen.syncs + 1)), raising=False)
    real_lookup = torch._dynamo.lookup_backend

    def neuron_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        seen.graphs.append([tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)])
        if seen.fail is not None:
            raise RuntimeError(seen.fail)
        return gm.forward

    monkeypatch.setattr(torch._dynamo, "lookup_backend",
                        lambda name: neuron_backend if name == "neuron" else real_lookup(name))

    def device(on: bool) -> None:
        monkeypatch.setattr(glob, "glob", lambda pat: ["/dev/neuron0"] if on and pat == "/dev/neuron*" else [])

    seen.device = device
    device(False)
    return seen


def test_no_device_neuron_is_one_line_and_auto_is_host(tnx, envs, capsys: pytest.CaptureFixture,
                                                       tmp_path: Path) -> None:
    """TorchNeuron installed, no Neuron device: `golden --backend neuron` is one line, exit 2, naming what is missing
    and never advising torch-xla or torch 2.9; auto resolves to the host."""
    from engine.config import Backend, resolve_backend

    code, out, err = run_main(["golden", "--backend", "neuron", "--out", str(tmp_path)], capsys)
    assert code == 2 and out == ""
    line = err.strip()
    assert "\n" not in line and "no Neuron device is visible" in line and "torch-neuronx 2.13.3 (TorchNeuron)" in line
    for advice in ("torch-xla", "torch_xla", "2.9", "pip install torch"):
        assert advice not in line
    assert not list(tmp_path.iterdir())  # nothing was built or written
    assert resolve_backend("auto") is Backend.HOST


def test_legacy_or_absent_stacks_name_what_neuron_needs(envs, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.backends.torchneuron import require_torchneuron
    from engine.stack import NeuronStack

    for kind, want in (("absent", "not installed here"), ("placeholder", "PyPI placeholder"),
                       ("xla", "PyTorch/XLA stack, not TorchNeuron.*--backend xla")):
        with pytest.raises(ValueError, match=want) as e:
            require_torchneuron(NeuronStack(kind, "2.9.0" if kind == "xla" else None, True))
        assert "pip install torch" not in str(e.value)
    require_torchneuron(NeuronStack("torchneuron", "2.13.3", False), compile_only=True)  # compile-only: no device


def test_neuron_rank_process_setup(tnx, envs, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Per rank, before the runtime starts: its logical core, the LNC, a NEFF cache of its own, no silent eager
    fallback; the device is neuron:0 on the rank's own core, neuron:<LOCAL_RANK> when the user shares a range."""
    from engine.backends import get_backend

    tnx.device(True)
    applied: list[dict[str, str]] = []

    def apply_env(updates: dict[str, str]) -> None:
        applied.append(dict(updates))
        envs(**updates)

    monkeypatch.setattr(engine.envs, "apply_env", apply_env)
    envs(NEURON_LOGICAL_NC_CONFIG="1", XDG_CACHE_HOME=str(tmp_path))
    be = get_backend(fake_config(backend="neuron"))
    assert be.name == "neuron" and not be.capabilities.data_dependent_shapes
    be.check_parallel(4)
    be.setup_process(threads=None, rank=1, world=2, master_port=29511)
    env = applied[0]
    assert env["NEURON_RT_VISIBLE_CORES"] == "1" and env["NEURON_LOGICAL_NC_CONFIG"] == "1"
    assert env["TORCH_NEURONX_NEFF_CACHE_DIR"] == str(tmp_path / "deepinfer" / "neff" / "rank1")
    assert env["TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"] == "1"
    assert "TORCH_NEURONX_COMPILE_ONLY" not in env
    assert be.device_name == "neuron:0"
    # torchrun style: the user gave the ranks one range of cores and a cache root; LOCAL_RANK picks the device
    applied.clear()
    envs(NEURON_RT_VISIBLE_CORES="0-3", LOCAL_RANK="2", TORCH_NEURONX_NEFF_CACHE_DIR=str(tmp_path / "mine"))
    be2 = get_backend(fake_config(backend="neuron"))
    be2.setup_process(threads=None, rank=2, world=4, master_port=None)
    env = applied[0]
    assert "NEURON_RT_VISIBLE_CORES" not in env and env["TORCH_NEURONX_NEFF_CACHE_DIR"] == str(tmp_path / "mine/rank2")
    assert be2.device_name == "neuron:2"
    assert "neuronx-cc" in be.measured_on()


def test_graphs_are_static_fullgraph_compiles_of_the_neuron_backend(tnx, envs, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.backends import get_backend

    tnx.device(True)
    calls: list[dict] = []
    real_compile = torch.compile

    def spy(fn, **kw):
        calls.append(kw)
        return real_compile(fn, **kw)

    monkeypatch.setattr(torch, "compile", spy)
    be = get_backend(fake_config(backend="neuron"))
    f = be.compile_fn(lambda x, y: (x * y).sum(-1), "f")
    x, y = torch.arange(6.0).reshape(2, 3), torch.ones(2, 3)
    assert torch.equal(f(x, y), (x * y).sum(-1))
    f(x + 1, y)
    assert calls == [{"dynamic": False, "fullgraph": True, "backend": calls[0]["backend"]}]
    c = be.counters()
    assert (c.graph_compiles, c.executions, c.fallbacks) == (1, 2, 0)
    f(torch.ones(4, 3), torch.zeros(4, 3))  # a new static shape is a new graph (bucketed by the engine)
    assert be.counters().graph_compiles == 2 and tnx.graphs[-1] == [(4, 3), (4, 3)]
    be.synchronize()
    assert tnx.syncs == 1
    tnx.fail = "neuronx-cc failed: NCC_EVRF051 f8 operand"  # a compile failure raises: no eager fallback
    g = be.compile_fn(lambda x: x + 1, "g")
    with pytest.raises(Exception, match="NCC_EVRF051"):
        g(x)


def test_neuron_process_group_and_functional_collectives(tnx, envs, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks join init_process_group("neuron") with a gloo control group; the model's exchanges are functional
    collectives (graph-legal), counted when they run eagerly."""
    from torch.distributed import _functional_collectives as funcol

    from engine.backends import get_backend

    tnx.device(True)
    calls: list[tuple] = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "new_group", lambda **k: ("control", k["backend"]))
    be = get_backend(fake_config(backend="neuron"))
    par = be.join_group(1, 2, 1234, 30.0)
    assert calls[0][0] == ("neuron",) and calls[0][1]["init_method"] == "tcp://127.0.0.1:1234"
    assert (calls[0][1]["rank"], calls[0][1]["world_size"]) == (1, 2)
    assert par.control_group == ("control", "gloo") and par.functional and par.backend is be
    be.join_group(1, 2, None, 30.0)
    assert calls[1][1]["init_method"] == "env://" and "rank" not in calls[1][1]

    got: list[str] = []
    monkeypatch.setattr(funcol, "all_gather_tensor",
                        lambda t, dim, group: got.append("ag") or torch.cat([t, t + 10], dim))
    monkeypatch.setattr(funcol, "all_reduce", lambda t, op, group: got.append(op) or t * 2)
    t = torch.ones(2, 3)
    parts = par.all_gather(t, "l0.moe")
    assert len(parts) == 2 and torch.equal(parts[1], t + 10)
    r = par.all_reduce(t, "l0.moe")
    assert torch.equal(r, t * 2) and torch.equal(t, torch.ones(2, 3))  # a new tensor: the caller uses the result
    assert got == ["ag", "sum"] and par.report() == {"l0.moe:all_gather": 1, "l0.moe:all_reduce": 1}


def test_compile_only_reports_pass_fail_seconds_and_ncc_codes(tnx, envs, tmp_path: Path) -> None:
    """`deepinfer compile --backend neuron`: compile-only mode set before the engine is built; each graph compiled
    on its own, a failure is a row (its NCC code from the error, else from the artifact logs) and the rest go on."""
    import time

    from engine.backends import check_available
    from engine.backends.graph_export import GraphSpec, compile_each, ncc_code_in
    from engine.backends.torchneuron import TorchNeuronBackend

    env = TorchNeuronBackend.compile_only_env()
    assert env["TORCH_NEURONX_COMPILE_ONLY"] == "1" and env["NEURON_PLATFORM_TARGET_OVERRIDE"] == "trn2"
    with pytest.raises(ValueError, match="no Neuron device"):
        check_available("neuron")
    check_available("neuron", compile_only=True)  # no device needed to compile
    envs(**env)
    be = TorchNeuronBackend(fake_config(backend="host"))
    assert be.compile_only

    def backend(name: str):
        def compile_graph(gm, example_inputs):
            if name == "bad":
                raise RuntimeError("Compilation failed\nneuronx-cc: [NCC_EVRF051] f8 operand not supported")
            if name == "quiet":
                (tmp_path / "log-neuron-cc.txt").write_text("ERROR [NCC_IXTP002] out of SBUF")
                raise RuntimeError("neuronx-cc returned 70")
            return gm.forward
        return compile_graph

    x = torch.ones(2, 2)
    specs = [GraphSpec(n, lambda x: x * 2, (x,), {"region": "r"}, {"x": x}) for n in ("ok", "bad", "quiet")]

    def after(spec, row):
        if row["status"] == "fail" and row["ncc_error"] is None:
            row["ncc_error"] = ncc_code_in(tmp_path, since=row["_t0"])

    t0 = time.perf_counter()
    rows = compile_each(be, specs, backend, after)
    assert [(r["graph"], r["status"], r["ncc_error"]) for r in rows] == [
        ("ok", "pass", None), ("bad", "fail", "NCC_EVRF051"), ("quiet", "fail", "NCC_IXTP002")]
    assert all(0 <= r["seconds"] <= time.perf_counter() - t0 for r in rows)
    assert rows[1]["error"].startswith("RuntimeError: Compilation failed")
    assert rows[0]["inputs"] == [{"name": "x", "shape": [2, 2], "dtype": "float32"}]


def test_standin_without_its_extra_is_one_line(envs, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                               tmp_path: Path) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n in ("torch_mlir", "jax") else real(n, *a))
    code, out, err = run_main(["golden", "--backend", "neuron-standin", "--out", str(tmp_path)], capsys)
    line = err.strip()
    assert code == 2 and "\n" not in line
    assert "neuron-standin needs torch_mlir and jax" in line and "pip install -e '.[neuron-standin]'" in line
    code, out, err = run_main(["compile", "--backend", "neuron-standin", "--out", str(tmp_path / "g")], capsys)
    assert code == 2 and "[neuron-standin]" in err and not (tmp_path / "g").exists()
