"""`--kernels auto` (the default): the native host kernels on the host backend where they build and load, else the
reference, with the reason recorded (engine/config.py `resolve_kernels`, `EngineConfig.to_dict`)."""

from __future__ import annotations

import pytest

from deepinfer_bench.bench.golden import GOLDEN_DIR
from engine import host_kernels
from engine.config import Backend, EngineConfig, Kernels, ModelConfig, resolve_kernels

TINY = ModelConfig.from_json(GOLDEN_DIR / "tiny")


def _config(**kw) -> EngineConfig:
    return EngineConfig.from_model_config(TINY, **kw)


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host-kernel library that 'loads' (the avx2 build), whatever this machine's compiler and CPU are."""
    monkeypatch.setattr(host_kernels, "probe", lambda: "avx2")


@pytest.fixture
def fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail():
        raise host_kernels.HostKernelError("--kernels host: compiling gemv.c with nocc failed: not found")

    monkeypatch.setattr(host_kernels, "probe", fail)


def test_auto_is_the_default_and_picks_the_host_kernels_where_they_load(builds) -> None:
    config = _config()
    assert config.kernels is Kernels.HOST and config.kernels_requested is Kernels.AUTO
    assert config.kernels_why.startswith("auto: native host kernels, avx2 build")
    d = config.to_dict()
    assert (d["kernels"], d["kernels_requested"]) == ("host", "auto") and d["kernels_why"] == config.kernels_why


def test_building_the_config_compiles_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolving `--kernels auto` decides the build without compiling or loading it (that is the engine's first
    use of the kernels), here with the real probe of this machine."""
    def no_build(*_):
        raise AssertionError("the config built or loaded the host kernels")

    for name in ("ensure_loaded", "library", "load", "build_variant"):
        monkeypatch.setattr(host_kernels, name, no_build)
    monkeypatch.setattr(host_kernels.build, "build", no_build)
    config = _config()
    assert config.kernels in (Kernels.HOST, Kernels.REFERENCE) and config.kernels_why.startswith("auto: ")


def test_auto_falls_back_to_the_reference_with_the_reason(fails) -> None:
    config = _config()
    assert config.kernels is Kernels.REFERENCE
    assert "unavailable here" in config.kernels_why and "nocc failed" in config.kernels_why


def test_every_command_warns_when_auto_falls_back_to_the_reference(fails, capsys: pytest.CaptureFixture) -> None:
    """EngineArgs.config, which every engine command builds its config with, says so on stderr, with the reason."""
    from deepinfer_bench.cli.options import EngineArgs

    assert EngineArgs().config().kernels is Kernels.REFERENCE
    err = capsys.readouterr().err
    assert "warning: --kernels auto runs the torch reference" in err and "nocc failed: not found" in err
    assert EngineArgs(kernels=Kernels.REFERENCE).config().kernels is Kernels.REFERENCE  # asked for: no warning
    assert "warning" not in capsys.readouterr().err


def test_no_warning_where_the_host_kernels_load(builds, capsys: pytest.CaptureFixture) -> None:
    from deepinfer_bench.cli.options import EngineArgs

    assert EngineArgs().config().kernels is Kernels.HOST
    assert "warning" not in capsys.readouterr().err


def test_auto_on_a_device_backend_is_the_reference_without_building(fails) -> None:
    kernels, why = resolve_kernels("auto", Backend.XLA)
    assert kernels is Kernels.REFERENCE and "xla backend" in why  # `fails` would have raised if it tried to build


def test_a_given_table_is_kept(fails) -> None:
    for name in ("reference", "host", "stand-in"):
        config = _config(kernels=name)
        assert str(config.kernels) == name and config.kernels_why == "given"
        assert config.to_dict()["kernels_requested"] == name


def test_replace_resolves_auto_again_and_keeps_a_given_table(builds) -> None:
    auto = _config()
    assert auto.replace(backend="xla").kernels is Kernels.REFERENCE  # auto, resolved for the new backend
    assert auto.replace(kernels="reference").kernels is Kernels.REFERENCE
    assert auto.replace(graph_mode="layer").kernels is Kernels.HOST
    given = _config(kernels="reference")
    assert given.replace(graph_mode="layer").kernels is Kernels.REFERENCE
