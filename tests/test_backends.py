"""Backend selection and the device-path environment logic, with fake torch_xla / torch_neuronx modules (the real
ones are not installable on the host lane; tests marked `xla` run the real torch-xla in the second CI lane)."""

from __future__ import annotations

import sys
import types

import pytest
import torch.distributed as dist

import engine.envs
from engine.config import Backend, resolve_backend
from tests.fake_runner import fake_config


@pytest.fixture
def envs(monkeypatch: pytest.MonkeyPatch):
    """Set environment variables for engine.envs (its cache cleared before and after)."""

    def set_env(**values: str) -> None:
        for k, v in values.items():
            monkeypatch.setenv(k, v)
        engine.envs.get_envs.cache_clear()

    for k in ("PJRT_DEVICE", "NEURON_LOGICAL_NC_CONFIG", "XLA_FLAGS", "XLA_COMPILATION_CACHE_SIZE", "WORLD_SIZE",
              "RANK"):
        monkeypatch.delenv(k, raising=False)
    engine.envs.get_envs.cache_clear()
    yield set_env
    engine.envs.get_envs.cache_clear()


@pytest.fixture
def fake_xla(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """Minimal torch_xla / torch_neuronx module trees; records what the engine asks of them."""
    seen = types.SimpleNamespace(eager=[], synced=0)

    def mod(name: str, **attrs) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
        return m

    txla = mod("torch_xla", device=lambda: "xla:0", sync=lambda: setattr(seen, "synced", seen.synced + 1),
               compile=lambda f, name=None: f)
    mod("torch_xla.core")
    mod("torch_xla.core.xla_model", wait_device_ops=lambda: None)
    mod("torch_xla.debug")
    mod("torch_xla.debug.metrics", counter_value=lambda n: 0, metric_data=lambda n: None, counter_names=lambda: [])
    mod("torch_xla.experimental", eager_mode=seen.eager.append)
    mod("torch_xla.distributed")
    mod("torch_xla.distributed.xla_backend")
    mod("torch_xla.runtime", device_type=lambda: "CPU")
    mod("torch_neuronx")
    txla.core, txla.debug = sys.modules["torch_xla.core"], sys.modules["torch_xla.debug"]
    return seen


def _fake_neuronx(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    """A torch_neuronx module without distribution metadata: native TorchNeuron (nki_op / wrap_nki) or legacy."""
    m = types.ModuleType("torch_neuronx")
    m.__version__ = "2.13.3" if native else "2.9.0"
    if native:
        m.nki_op = m.wrap_nki = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "torch_neuronx", m)


def test_auto_resolves_in_one_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: TorchNeuron + a device -> neuron; the legacy PyTorch/XLA torch-neuronx + a device -> xla (on the Neuron
    PJRT device); TorchNeuron without a device, or nothing Neuron -> host."""
    assert resolve_backend("auto") is Backend.HOST  # no /dev/neuron* here
    assert resolve_backend("xla") is Backend.XLA and resolve_backend(Backend.NEURON) is Backend.NEURON
    assert resolve_backend("neuron-standin") is Backend.NEURON_STANDIN
    import glob

    _fake_neuronx(monkeypatch, native=True)
    assert resolve_backend("auto") is Backend.HOST  # TorchNeuron installed, no device
    monkeypatch.setattr(glob, "glob", lambda pat: ["/dev/neuron0"] if pat == "/dev/neuron*" else [])
    assert resolve_backend("auto") is Backend.NEURON
    assert fake_config(backend="auto").backend is Backend.NEURON  # a built config never holds "auto"
    _fake_neuronx(monkeypatch, native=False)
    assert resolve_backend("auto") is Backend.XLA
    with pytest.raises(ValueError, match="backend 'tpu': expected one of auto, host, xla, neuron, neuron-standin"):
        resolve_backend("tpu")


def test_stack_kind_from_the_distribution_version(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    from engine import stack

    for version, kind in (("2.13.3.1", "torchneuron"), ("2.14.3", "torchneuron"), ("2.9.0.2.10", "xla"),
                          ("1.0", "placeholder")):
        monkeypatch.setattr(metadata, "version", lambda name, v=version: v)
        assert stack.neuron_stack().kind == kind, version


def test_xla_without_torch_xla_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.backends import check_available, get_backend

    monkeypatch.setitem(sys.modules, "torch_xla", None)  # import fails
    with pytest.raises(ValueError, match=r"backend xla needs torch-xla.*pip install torch==2.9.0 torch-xla==2.9.0"):
        get_backend(fake_config(backend="xla"))
    _fake_neuronx(monkeypatch, native=True)  # inside a TorchNeuron venv: never advise torch-xla / torch 2.9
    with pytest.raises(ValueError, match="TorchNeuron environment") as e:
        get_backend(fake_config(backend="xla"))
    assert "pip" not in str(e.value) and "2.9" not in str(e.value)
    monkeypatch.setitem(sys.modules, "torch_neuronx", None)
    with pytest.raises(ValueError, match=r"--backend neuron runs on TorchNeuron \(torch-neuronx >= 2.13") as e:
        check_available("neuron")
    assert "torch-xla" not in str(e.value) and "2.9" not in str(e.value)


def test_xla_backend_sets_pjrt_cpu_and_refuses_ranks_there(fake_xla, envs, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import run_job
    from engine.backends import get_backend

    applied: dict[str, str] = {}

    def apply_env(updates: dict[str, str]) -> None:
        applied.update(updates)
        envs(**updates)

    monkeypatch.setattr(engine.envs, "apply_env", apply_env)
    be = get_backend(fake_config(backend="xla"))
    assert be.name == "xla" and not be.capabilities.data_dependent_shapes and be.counters().compiles == 0
    be.setup_process(threads=None)
    assert applied["PJRT_DEVICE"] == "CPU" and "optimization_level=0" in applied["XLA_FLAGS"]
    assert int(applied["XLA_COMPILATION_CACHE_SIZE"]) >= 65536  # eager per-op graphs must not evict the regions'
    # `import torch_xla` sets XLA_FLAGS itself (--xla_cpu_enable_fast_math=false): -O0 is added to it, not skipped
    envs(XLA_FLAGS="--xla_cpu_enable_fast_math=false", PJRT_DEVICE="CPU")
    be.setup_process(threads=None)
    assert applied["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false --xla_backend_optimization_level=0"
    applied.clear()
    envs(XLA_FLAGS="--xla_backend_optimization_level=2")  # the user's own level stands
    be.setup_process(threads=None)
    assert "XLA_FLAGS" not in applied
    assert be.device == "xla:0" and fake_xla.eager == [True]  # torch-xla's eager mode; regions via torch_xla.compile
    with pytest.raises(ValueError, match=r"cp=2 on --backend xla with PJRT_DEVICE=CPU.*#5005"):
        be.check_parallel(2)
    be.check_parallel(1)
    with pytest.raises(ValueError, match="XLA collectives do not run across processes"):  # before any rank starts
        run_job(fake_config(backend="xla", cp=2), lambda eng: None)


def test_legacy_neuron_pjrt_rank_environment(fake_xla, envs, monkeypatch: pytest.MonkeyPatch) -> None:
    """The PyTorch/XLA lane on the Neuron PJRT device (the legacy stack, PJRT_DEVICE=NEURON) sets each rank's Neuron
    runtime variables before the runtime starts."""
    from engine.backends import get_backend

    applied: list[dict[str, str]] = []
    monkeypatch.setattr(engine.envs, "apply_env", applied.append)
    envs(NEURON_LOGICAL_NC_CONFIG="1", PJRT_DEVICE="NEURON")
    be = get_backend(fake_config(backend="xla"))
    be.check_parallel(4)  # Neuron ranks are fine
    be.setup_process(threads=None, rank=1, world=2, master_port=29511)
    env = applied[-2]
    assert applied[-1] == {"XLA_COMPILATION_CACHE_SIZE": "65536"}
    assert env["PJRT_DEVICE"] == "NEURON" and env["NEURON_RT_VISIBLE_CORES"] == "1"
    assert env["NEURON_LOGICAL_NC_CONFIG"] == "1"  # LNC read once, from the environment
    assert (env["NEURON_PJRT_PROCESS_INDEX"], env["NEURON_PJRT_WORLD_SIZE"]) == ("1", "2")
    # the variables torchrun sets, so torch-xla's plugin and xla:// rendezvous take their torchrun path
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("1", "1", "2", "29511")
    assert "TORCHELASTIC_RUN_ID" in env
    applied.clear()
    be.setup_process(threads=None, rank=0, world=2, master_port=None)  # under torchrun: its variables stand
    assert "RANK" not in applied[-2] and applied[-2]["NEURON_PJRT_PROCESS_INDEX"] == "0"
    assert "PyTorch/XLA lane" in be.measured_on()


def test_xla_process_group_joins_over_xla_and_checks_world(fake_xla, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.backends import get_backend

    calls: list[tuple] = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "new_group", lambda **k: "control")
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    be = get_backend(fake_config(backend="xla"))
    par = be.join_group(1, 2, 1234, 30.0)
    assert calls[0][0] == ("xla",) and calls[0][1]["init_method"] == "xla://" and "rank" not in calls[0][1]
    assert (par.rank, par.cp, par.control_group, par.backend) == (1, 2, "control", be)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)  # what PJRT CPU reports for every process
    with pytest.raises(RuntimeError, match="world size 1, the job has 2 ranks"):
        be.join_group(1, 2, 1234, 30.0)


def test_host_process_group_joins_over_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.backends import get_backend

    calls: list[tuple] = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "new_group", lambda **k: "control")
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    be = get_backend(fake_config())
    par = be.join_group(1, 2, 1234, 30.0)
    assert calls[0][0] == ("gloo",) and calls[0][1]["init_method"] == "tcp://127.0.0.1:1234"
    assert (calls[0][1]["rank"], calls[0][1]["world_size"]) == (1, 2) and par.backend is be
    be.join_group(1, 2, None, 30.0)  # torchrun's rendezvous
    assert calls[1][1]["init_method"] == "env://" and "rank" not in calls[1][1]


def test_kernel_tables_are_the_backends_and_refused_before_loading(fake_xla) -> None:
    """Which --kernels a backend runs is the backend's to say; the config itself does not know (engine/backends)."""
    from engine.backends import get_backend

    for backend, kernels, hint in (("host", "nki", "--backend neuron"), ("xla", "stand-in", "--backend host"),
                                   ("xla", "host", "--backend host")):
        cfg = fake_config(backend=backend, kernels=kernels)  # a config may name it ...
        with pytest.raises(ValueError, match=f"--kernels {kernels} does not run on --backend {backend}.*{hint}"):
            get_backend(cfg)  # ... the engine refuses it when it builds the backend, before any weight loads
    assert get_backend(fake_config(kernels="host")).name == "host"


def test_stack_probe_and_nki_version(envs) -> None:
    from engine import stack

    p = stack.probe()
    assert p["versions"]["torch"] and p["logical_nc_config"] == 2 and p["nki_ok"]
    envs(NEURON_LOGICAL_NC_CONFIG="3")
    with pytest.raises(ValueError, match="expected 1 or 2"):
        stack.logical_nc_config()
    stack.check_nki_version(None)
    for v in ("0.6.1", "0.7.0", "0.8.0"):  # SDK 2.32, and TorchNeuron's 2.33 / 2.34 (nki_kernels/_nki.py notes)
        stack.check_nki_version(v)
    with pytest.raises(ValueError, match="nki 0.5.0 is installed.*written and checked for nki 0.6 / 0.7 / 0.8"):
        stack.check_nki_version("0.5.0")
    with pytest.raises(ValueError, match="nki 0.9.0 is installed"):
        stack.check_nki_version("0.9.0")


def test_torchrun_ranks_meet_on_the_gloo_control_group(fake_xla, envs, monkeypatch: pytest.MonkeyPatch) -> None:
    """The "xla" process group's barrier is a no-op: a rank's closing barrier must run on the gloo control group.
    Under torchrun the config's cp is torchrun's WORLD_SIZE."""
    from engine import launch
    from engine.backends.xla import XlaBackend
    from engine.parallel import Parallel

    monkeypatch.setattr(engine.envs, "apply_env", lambda updates: None)
    barriers: list[dict] = []
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: barriers.append(k))
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: None)
    monkeypatch.setattr(launch, "_engine_job", lambda par, config, fn, args: "out")
    for rank in (1, 0):
        envs(WORLD_SIZE="2", RANK=str(rank), PJRT_DEVICE="NEURON")
        monkeypatch.setattr(XlaBackend, "join_group", lambda self, r0, world, port, timeout, r=rank: Parallel(
            rank=r, cp=world, group="xla-world", control_group="gloo-control", backend=self))
        config = fake_config(backend="xla", block_size=16)
        assert config.cp == 2
        if rank:
            with pytest.raises(SystemExit) as exit_info:
                launch._torchrun(config, lambda eng: None, (), None)
            assert exit_info.value.code == 0
        else:
            assert launch._torchrun(config, lambda eng: None, (), None) == "out"
    assert barriers == [{"group": "gloo-control"}] * 2


def test_cp_under_torchrun_is_its_world_size(envs) -> None:
    envs(WORLD_SIZE="2", RANK="0")
    assert fake_config(block_size=16).cp == 2
    with pytest.raises(ValueError, match="cp=4 under torchrun with WORLD_SIZE=2"):
        fake_config(block_size=16, cp=4)
