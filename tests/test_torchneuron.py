"""`--backend neuron` (TorchNeuron, engine/backends/torchneuron.py) against a fake TorchNeuron that enforces the SDK's
own rules (tests/fake_torchneuron.py: process group, device ids, named graphs and their metrics, the artifact folder,
compile-only on meta). The Neuron SDK is not installable here; what these tests show is that the backend calls
TorchNeuron the way its sources require (detection, first-contact errors, per-rank environments, graph compile calls,
the process groups and the functional collectives, the compile-only report, the kernels' LNC), not anything of
TorchNeuron itself. `--backend neuron-standin`'s
missing-extra error is here too (its runs are in tests/test_neuron_standin.py, marked `standin`)."""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import engine.envs
from tests import fake_torchneuron
from tests.cli import run_main
from tests.fake_runner import fake_config


@pytest.fixture
def envs(monkeypatch: pytest.MonkeyPatch):
    def set_env(**values: str) -> None:
        for k, v in values.items():
            monkeypatch.setenv(k, v)
        engine.envs.get_envs.cache_clear()

    for k in ("NEURON_LOGICAL_NC_CONFIG", "NEURON_RT_VISIBLE_CORES", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
              "RANK", "TORCH_NEURONX_NEFF_CACHE_DIR", "TORCH_NEURONX_HLO_CACHE_DIR", "TORCH_NEURONX_COMPILE_ONLY",
              "TORCH_NEURONX_HLO_COMPILE_CACHE", "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR",
              "TORCH_NEURONX_DEBUG_DIR", "NEURON_CC_FLAGS", "NEURON_PLATFORM_TARGET_OVERRIDE",
              "TORCH_NEURONX_PRESERVE_COMPILATION_ARTIFACTS", "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION",
              "XDG_CACHE_HOME"):
        monkeypatch.delenv(k, raising=False)
    engine.envs.get_envs.cache_clear()
    yield set_env
    engine.envs.get_envs.cache_clear()


@pytest.fixture
def sdk(monkeypatch: pytest.MonkeyPatch) -> fake_torchneuron.FakeSDK:
    """The fake TorchNeuron that enforces the SDK's rules (tests/fake_torchneuron.py), with a Neuron device."""
    return fake_torchneuron.install(monkeypatch, device=True)


@pytest.fixture
def sdk_no_device(monkeypatch: pytest.MonkeyPatch) -> fake_torchneuron.FakeSDK:
    return fake_torchneuron.install(monkeypatch, device=False)


def test_no_device_neuron_is_one_line_and_auto_is_host(sdk_no_device, envs, capsys: pytest.CaptureFixture,
                                                       tmp_path: Path) -> None:
    """TorchNeuron installed, no Neuron device: `golden --backend neuron` is one line, exit 2, naming what is missing
    and never advising torch-xla or torch 2.9; auto resolves to the host."""
    from engine.config import Backend, resolve_backend

    code, out, err = run_main(["golden", "--backend", "neuron", "--out", str(tmp_path)], capsys)
    assert code == 2 and out == ""
    line = err.strip()
    assert "\n" not in line and "no Neuron device is visible" in line and "torch-neuronx 2.13.3.1 (TorchNeuron)" in line
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


def test_each_rank_env_is_made_by_the_parent_one_core_of_its_own(envs, tmp_path: Path) -> None:
    """What a spawned rank has in its environment before it imports torch: LOCAL_RANK / LOCAL_WORLD_SIZE, exactly
    one visible core (its local rank, or its own of a range the user gave), first-contact LNC 1 and -O1, per-rank
    NEFF and HLO caches (the HLO cache reads its variables at import), no eager fallback."""
    from engine.backends.torchneuron import TorchNeuronBackend

    envs(XDG_CACHE_HOME=str(tmp_path))
    env = TorchNeuronBackend.rank_env(1, 2)
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["NEURON_RT_VISIBLE_CORES"]) == ("1", "2", "1")
    assert env["NEURON_LOGICAL_NC_CONFIG"] == "1" and env["NEURON_CC_FLAGS"] == "-O1"
    assert env["TORCH_NEURONX_NEFF_CACHE_DIR"] == str(tmp_path / "deepinfer" / "neff" / "rank1")
    assert env["TORCH_NEURONX_HLO_CACHE_DIR"] == str(tmp_path / "deepinfer" / "hlo" / "rank1")
    assert env["TORCH_NEURONX_HLO_COMPILE_CACHE"] == "1"
    assert env["TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR"] == str(tmp_path / "deepinfer" / "neff_local" / "rank1")
    assert env["TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"] == "1" and "TORCH_NEURONX_COMPILE_ONLY" not in env
    envs(NEURON_RT_VISIBLE_CORES="4-7", NEURON_LOGICAL_NC_CONFIG="2", NEURON_CC_FLAGS="-O2")
    env = TorchNeuronBackend.rank_env(1, 4)
    assert [env[k] for k in ("NEURON_RT_VISIBLE_CORES", "NEURON_LOGICAL_NC_CONFIG", "NEURON_CC_FLAGS")] == [
        "5", "2", "-O2"]
    envs(NEURON_RT_VISIBLE_CORES="0-1")
    with pytest.raises(ValueError, match="lists 2 cores, rank 2 needs one of its own"):
        TorchNeuronBackend.rank_env(2, 4)


def test_the_launcher_gives_each_rank_its_env_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """engine/parallel.py: a rank's variables are in the process environment when the rank starts (spawn copies
    it), and the parent's environment is as it was afterwards."""
    from engine import parallel

    seen: list[dict] = []
    monkeypatch.setenv("LOCAL_RANK", "9")
    monkeypatch.delenv("ZZ_NEW", raising=False)
    proc = types.SimpleNamespace(start=lambda: seen.append({k: os.environ.get(k) for k in ("LOCAL_RANK", "ZZ_NEW")}))
    parallel._start_with_env(proc, {"LOCAL_RANK": "1", "ZZ_NEW": "x"})
    assert seen == [{"LOCAL_RANK": "1", "ZZ_NEW": "x"}]
    assert os.environ["LOCAL_RANK"] == "9" and "ZZ_NEW" not in os.environ


def test_a_rank_joins_the_group_then_sets_its_device_to_its_local_rank(sdk, envs, tmp_path: Path) -> None:
    """Under the SDK's process-group rules (fake: tests/fake_torchneuron.py): nothing touches the device before
    init_process_group, one visible core, `torch.neuron.set_device(local_rank)` after joining and the device
    `neuron:<local_rank>`."""
    from engine.backends import get_backend
    from engine.backends.torchneuron import TorchNeuronBackend

    envs(XDG_CACHE_HOME=str(tmp_path))
    envs(**TorchNeuronBackend.rank_env(1, 2))  # what the parent gave rank 1
    be = get_backend(fake_config(backend="neuron"))
    assert be.name == "neuron" and not be.capabilities.data_dependent_shapes
    be.check_parallel(4)
    be.setup_process(threads=None, rank=1, world=2, master_port=29511)
    assert sdk.touched == []  # the runtime is not started before the group
    par = be.join_group(1, 2, 29511, 30.0)
    assert sdk.group["init_method"] == "tcp://127.0.0.1:29511" and sdk.group["cores"] == "1"
    assert (sdk.group["rank"], sdk.group["world_size"]) == (1, 2)
    assert sdk.set_device == [1] and be.device_name == "neuron:1" and par.functional and par.backend is be
    assert par.control_group == ("control", "gloo")


def test_torchrun_ranks_sharing_a_range_get_one_core_each(sdk, envs, tmp_path: Path) -> None:
    """torchrun style: the user gave every rank the range "0-3" and a cache root; LOCAL_RANK picks the core, the
    device and the cache."""
    from engine.backends import get_backend

    envs(XDG_CACHE_HOME=str(tmp_path), NEURON_RT_VISIBLE_CORES="0-3", LOCAL_RANK="2", LOCAL_WORLD_SIZE="4",
         WORLD_SIZE="4", TORCH_NEURONX_NEFF_CACHE_DIR=str(tmp_path / "mine"))
    be = get_backend(fake_config(backend="neuron"))
    be.setup_process(threads=None, rank=2, world=4, master_port=None)
    be.join_group(0, 4, None, 30.0)
    assert sdk.group["cores"] == "2" and sdk.group["init_method"] == "env://" and "rank" not in sdk.group
    assert sdk.set_device == [2] and be.device_name == "neuron:2"
    assert os.environ["TORCH_NEURONX_NEFF_CACHE_DIR"] == str(tmp_path / "mine" / "rank2")


def test_the_fake_process_group_enforces_the_sdks_rules(sdk, envs) -> None:
    """The fake itself: a range of cores, a device id that is not the local rank, a device touched before
    init_process_group are each refused (so the tests above catch them)."""
    from tests.fake_torchneuron import RuleBroken

    envs(LOCAL_RANK="1", NEURON_RT_VISIBLE_CORES="0-3")
    with pytest.raises(RuleBroken, match="exactly one visible core"):
        dist.init_process_group("neuron", init_method="env://")
    envs(NEURON_RT_VISIBLE_CORES="1")
    dist.init_process_group("neuron", init_method="env://")
    with pytest.raises(RuleBroken, match="must be the local rank 1"):
        torch.neuron.set_device(0)
    sdk.group, sdk.touched = None, []
    torch.neuron.set_device(1)
    with pytest.raises(RuleBroken, match="touched before init_process_group"):
        dist.init_process_group("neuron", init_method="env://")


def test_one_rank_sets_its_device_at_setup(sdk, envs, tmp_path: Path) -> None:
    from engine.backends import get_backend

    envs(XDG_CACHE_HOME=str(tmp_path))
    be = get_backend(fake_config(backend="neuron"))
    be.setup_process(threads=None)
    assert sdk.set_device == [0] and be.device_name == "neuron:0"


def test_functional_collectives(sdk, envs, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The model's exchanges are functional collectives (graph-legal), counted when they run eagerly."""
    from torch.distributed import _functional_collectives as funcol

    from engine.backends import get_backend
    from engine.backends.torchneuron import TorchNeuronBackend

    envs(XDG_CACHE_HOME=str(tmp_path), WORLD_SIZE="2")
    envs(**TorchNeuronBackend.rank_env(1, 2))
    be = get_backend(fake_config(backend="neuron"))
    be.setup_process(threads=None, rank=1, world=2, master_port=1234)
    par = be.join_group(1, 2, 1234, 30.0)
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


def test_graphs_are_named_fullgraph_compiles_counted_by_the_sdks_metrics(sdk, envs,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.backends import get_backend

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
    assert [c["name"] for c in sdk.compiled] == ["f"]  # options={"model_name": "f"} reached the neuron backend
    c = be.counters()
    assert (c.graph_compiles, c.executions, c.fallbacks) == (1, 2, 0)
    assert c.compile_seconds == pytest.approx(0.006)  # the SDK's fx passes + lowering + neuronx-cc, not our clock
    f(torch.ones(4, 3), torch.zeros(4, 3))  # a new static shape is a new graph (bucketed by the engine)
    assert be.counters().graph_compiles == 2 and sdk.compiled[-1]["shapes"] == [(4, 3), (4, 3)]
    be.synchronize()
    assert sdk.touched[-1] == "synchronize"
    sdk.fail = "NCC_EVRF051 f8 operand"  # a compile failure raises: no eager fallback
    g = be.compile_fn(lambda x: x + 1, "g")
    with pytest.raises(Exception, match="NCC_EVRF051"):
        g(x)


def test_compile_only_without_a_device_traces_on_meta(sdk_no_device, envs, tmp_path: Path) -> None:
    """No device: real neuron tensors cannot exist, so the engine's tensors are meta ones (the fake compiler refuses
    anything else in compile-only mode, as the community port's CPU compile keeps the batch on meta); the artifact
    folder is the one set before the first compile."""
    from engine.backends.torchneuron import TorchNeuronBackend

    sdk = sdk_no_device
    envs(**TorchNeuronBackend.compile_only_env(tmp_path))
    be = TorchNeuronBackend(fake_config(backend="host"))
    assert be.compile_only and be.device == torch.device("meta")
    be.setup_process(threads=None)
    assert sdk.set_device == []
    f = be.compile_fn(lambda x: x * 2, "double")
    assert f(torch.ones(2, 2, device="meta")).device.type == "meta"
    g = be.compile_fn(lambda x: x * 3, "triple")
    with pytest.raises(Exception, match="non-meta inputs"):
        g(torch.ones(2, 2))
    assert sdk.artifact_dir == tmp_path / "artifacts" and (tmp_path / "artifacts" / "double").is_dir()


def test_a_kernel_run_on_the_device_executor_exports_its_lnc(sdk, envs, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    """`deepinfer kernels --executor neuron` under a fake real NKI: NEURON_LOGICAL_NC_CONFIG is in the environment
    when each kernel launches (NKI 0.7 reads the LNC from it), and the launch matches it."""
    from nki_kernels import _nki, stand_in
    from nki_kernels.rmsnorm import rmsnorm_kernel

    seen: list[tuple] = []

    class Jitted:
        def __init__(self, fn, grid=None) -> None:
            self.fn, self.grid = fn, grid

        def __getitem__(self, grid):
            return Jitted(self.fn, grid)

        def __call__(self, *args):
            seen.append((os.environ.get("NEURON_LOGICAL_NC_CONFIG"), self.grid))
            return stand_in.run(self.fn, *args)

    monkeypatch.setattr(_nki, "real_nki", lambda: (types.SimpleNamespace(jit=Jitted), stand_in.language,
                                                   stand_in.isa))
    monkeypatch.setattr(rmsnorm_kernel, "_jitted", {})
    monkeypatch.setattr(rmsnorm_kernel, "_bound", {})
    code, out, err = run_main(["kernels", "--executor", "neuron", "--kernel", "rmsnorm", "--out", str(tmp_path)],
                              capsys)
    assert code == 0, err
    assert seen and all(s == ("1", None) for s in seen)  # LNC 1 exported; a bare launch at LNC 1


def test_compile_only_reports_pass_fail_seconds_and_ncc_codes(sdk_no_device, envs, tmp_path: Path) -> None:
    """`deepinfer compile --backend neuron`: compile-only mode set before the engine is built; each graph compiled
    on its own, a failure is a row (its NCC code from the error, else from the artifact logs) and the rest go on."""
    import time

    from engine.backends import check_available
    from engine.backends.graph_export import GraphSpec, compile_each, ncc_code_in
    from engine.backends.torchneuron import TorchNeuronBackend

    env = TorchNeuronBackend.compile_only_env(tmp_path)
    assert env["TORCH_NEURONX_COMPILE_ONLY"] == "1" and env["NEURON_PLATFORM_TARGET_OVERRIDE"] == "trn2"
    assert env["TORCH_NEURONX_DEBUG_DIR"] == str(tmp_path / "artifacts")
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


def test_measured_on_states_what_the_probe_found(envs, monkeypatch: pytest.MonkeyPatch) -> None:
    """bringup's "Measured on" line: without TorchNeuron it says so; with it, the version and whether a device is
    visible (no longer "on a Neuron device" regardless)."""
    from engine.backends.torchneuron import TorchNeuronBackend

    monkeypatch.setitem(__import__("sys").modules, "torch_neuronx", None)
    assert TorchNeuronBackend.measured_on().startswith("nothing of TorchNeuron")
    fake_torchneuron.install(monkeypatch, device=False)
    assert TorchNeuronBackend.measured_on().endswith("compile only, no Neuron device visible")
    assert "torch-neuronx 2.13.3.1" in TorchNeuronBackend.measured_on()
    fake_torchneuron.install(monkeypatch, device=True)
    assert TorchNeuronBackend.measured_on().endswith("on a Neuron device (/dev/neuron*)")


@pytest.mark.heavy  # graph compiles / ranks: CI runs `-m heavy` beside the default run (docs/ci.md)
def test_compile_neuron_names_every_graph_and_reads_their_artifacts(sdk_no_device, envs, capsys: pytest.CaptureFixture,
                                                                    tmp_path: Path) -> None:
    """`deepinfer compile --backend neuron` under the fake, no device: the debug folder is set before the first
    compile, every graph reaches the neuron backend named and on meta tensors (the fake refuses anything else), the
    graph count printed first is what compiled, and a failure's NCC code is read from that graph's own artifacts."""
    import json

    sdk = sdk_no_device
    out = tmp_path / "graphs"
    sdk.fail_on["layer_4_hash_b1_nb1"] = "NCC_IXTP002"
    # --graphs: two decode layer graphs, a chunk one and the chunk head of the 12 (each ~5 CPU-s of Dynamo tracing)
    code, _, err = run_main(["compile", "--backend", "neuron", "--max-num-seqs", "1", "--max-model-len", "16",
                             "--max-num-batched-tokens", "8", "--graphs", "layer_4_*,chunk_layer_4_hash_*,chunk_head_*",
                             "--out", str(out)], capsys)
    assert code == 1, err
    manifest = json.loads((out / "manifest.json").read_text())
    rows = manifest["graphs"]
    assert [c["name"] for c in sdk.compiled] == [r["graph"] for r in rows]
    assert [r["graph"] for r in rows] == ["layer_4_hash_b1_nb1", "layer_4_nohash_b1_nb1",
                                          "chunk_layer_4_hash_b1_c8_nb1", "chunk_head_b1_c8"]
    assert manifest["budget"]["total"] == 12 and manifest["selected"] == ["layer_4_*", "chunk_layer_4_hash_*",
                                                                          "chunk_head_*"]
    assert all(c["devices"] == ["meta"] and c["compile_only"] for c in sdk.compiled)
    assert sdk.artifact_dir == out / "artifacts" and manifest["compile_env"]["TORCH_NEURONX_DEBUG_DIR"] == str(
        out / "artifacts")
    failed = [(r["graph"], r["ncc_error"]) for r in rows if r["status"] == "fail"]
    assert failed == [("layer_4_hash_b1_nb1", "NCC_IXTP002")]
    assert "12 graphs:" in err.split("compiling the graphs")[0]  # the count printed first: every graph


def test_compile_graphs_that_match_nothing_is_one_clear_error(sdk_no_device, envs, capsys: pytest.CaptureFixture,
                                                              tmp_path: Path) -> None:
    """A --graphs pattern naming no graph stops before anything compiles, naming the pattern and the graphs."""
    code, _, err = run_main(["compile", "--backend", "neuron", "--max-num-seqs", "1", "--max-model-len", "16",
                             "--max-num-batched-tokens", "8", "--graphs", "layer_4_*,lm_head_*",
                             "--out", str(tmp_path / "graphs")], capsys)
    assert code == 2 and "lm_head_*" in err and "matches none" in err and "layer_4_hash_b1_nb1" in err, err
    assert "layer_4_*" not in err.split("matches none")[0].split("--graphs")[-1]  # only the pattern that matched none
    assert sdk_no_device.compiled == []


def test_nki_kernels_at_lnc_2_are_refused_in_one_line(sdk, envs, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels do not split work by program id: at NEURON_LOGICAL_NC_CONFIG=2 both physical cores would write
    every output, so `--kernels nki` needs LNC 1 (the first-contact default). Without the real `nki` the device ops
    cannot be registered: one line. With it they are registered when the backend is made, before any graph traces
    one (found by tests/test_torchneuron_ranks.py: registering inside a Dynamo trace is not traceable)."""
    from engine.backends.torchneuron import TorchNeuronBackend
    from nki_kernels import _nki, stand_in, torch_ops

    if not torch_ops.device_registered.cache_info().currsize:
        monkeypatch.setattr(_nki, "real_nki", lambda: None)
        with pytest.raises(ValueError, match="--kernels nki: the NKI device ops need TorchNeuron"):
            TorchNeuronBackend(fake_config(backend="neuron", kernels="nki"))
    monkeypatch.setattr(_nki, "real_nki", lambda: (types.SimpleNamespace(jit=fake_torchneuron.nki_kernel),
                                                   stand_in.language, stand_in.isa))
    TorchNeuronBackend(fake_config(backend="neuron", kernels="nki"))  # LNC unset: 1
    assert torch_ops.device_registered() == "torchneuron" and hasattr(torch.ops.deepinfer_nki, "rmsnorm")
    envs(NEURON_LOGICAL_NC_CONFIG="2")
    with pytest.raises(ValueError, match="--kernels nki at NEURON_LOGICAL_NC_CONFIG=2"):
        TorchNeuronBackend(fake_config(backend="neuron", kernels="nki"))
    TorchNeuronBackend(fake_config(backend="neuron", kernels="reference"))


def test_device_peak_is_the_sdks_peak_or_says_why(sdk, envs, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Device peak memory as TorchNeuron exposes it (`torch.neuron.max_memory_allocated(index)`,
    torch_neuronx/memory.py) on a device; "not measured: no Neuron device" on meta (compile-only) and on the stand-in
    (never 0). golden puts it in its results meta (`device_peak_bytes`, `device_peak`)."""
    from deepinfer_bench.bench.golden import device_peak, device_peak_meta
    from engine.backends.torchneuron import NOT_MEASURED, NeuronStandinBackend, TorchNeuronBackend

    envs(XDG_CACHE_HOME=str(tmp_path))
    be = TorchNeuronBackend(fake_config(backend="neuron"))
    be.setup_process(threads=None)
    sdk.peak_bytes[0] = 7 * 2**20
    assert device_peak(be) == 7 * 2**20
    assert device_peak_meta(device_peak(be)) == {"device_peak_bytes": 7 * 2**20, "device_peak": 7 * 2**20}
    fake_torchneuron.install(monkeypatch, device=False)
    envs(**TorchNeuronBackend.compile_only_env(tmp_path))
    meta_be = TorchNeuronBackend(fake_config(backend="neuron"))
    assert meta_be.device.type == "meta" and device_peak(meta_be) == NOT_MEASURED == "not measured: no Neuron device"
    assert device_peak_meta(NOT_MEASURED) == {"device_peak_bytes": None, "device_peak": NOT_MEASURED}
    assert device_peak(types.SimpleNamespace()) == NOT_MEASURED  # a backend with no device memory (host, xla)
    assert NeuronStandinBackend.device_peak(None) == NOT_MEASURED  # the stand-in runs on the CPU
