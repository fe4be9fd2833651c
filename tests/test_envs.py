"""Environment flags: one typed reader, nothing else touches os.environ."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from engine.envs import Envs, read_envs

ROOT = Path(__file__).resolve().parents[1]


def test_only_envs_module_reads_the_environment() -> None:
    offenders = []
    for pkg in ("engine", "deepinfer_bench", "nki_kernels"):
        for path in (ROOT / pkg).rglob("*.py"):
            if path == ROOT / "engine" / "envs.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv") \
                        and isinstance(node.value, ast.Name) and node.value.id == "os":
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"os.environ/getenv outside engine/envs.py: {offenders}"


def test_read_envs_parses_types_and_defaults() -> None:
    e = read_envs({"DEEPINFER_NEURON_GRAPH_MODE": "layer", "DEEPINFER_NEURON_REGION_TIMING": "1",
                   "NEURON_RT_VISIBLE_CORES": "0-3", "PATH": "/bin"})
    assert e.DEEPINFER_NEURON_GRAPH_MODE == "layer"
    assert e.DEEPINFER_NEURON_REGION_TIMING is True
    assert dict(e.recorded) == {"NEURON_RT_VISIBLE_CORES": "0-3"}
    assert read_envs({}) == Envs()


@pytest.mark.parametrize("env,match", [
    ({"DEEPINFER_NEURON_GRAPH_MODE": "graphs"}, "expected one of auto, eager, regions, layer"),
    ({"DEEPINFER_NEURON_REGION_TIMING": "maybe"}, "expected 0/1"),
    ({"DEEPINFER_GRAPH_MODE": "eager"}, "unknown environment flag DEEPINFER_GRAPH_MODE"),
])
def test_bad_flags_are_clear_errors(env: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        read_envs(env)


def test_graph_hash_tracks_only_graph_flags() -> None:
    base = read_envs({})
    assert read_envs({"DEEPINFER_NEURON_REGION_TIMING": "1"}).graph_hash() == base.graph_hash()
    assert read_envs({"DEEPINFER_NEURON_GRAPH_MODE": "layer"}).graph_hash() != base.graph_hash()


@pytest.mark.parametrize("value", ["bogus", ""])
def test_a_malformed_flag_is_one_line_at_the_cli(value: str, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    """A bad DEEPINFER_* value (empty too) stops a command with exit 2 and one line naming the flag, not a
    traceback: the error handler itself reads the flags (DEEPINFER_TRACEBACK) and once raised again there.
    The flags are read once a process (`get_envs` caches them): the cache is cleared around the call."""
    from engine.envs import get_envs
    from tests.cli import run_main

    monkeypatch.setenv("DEEPINFER_HOST_SIMD", value)
    get_envs.cache_clear()
    try:
        code, _, err = run_main(["golden", "--out", str(tmp_path)], capsys)
    finally:
        monkeypatch.delenv("DEEPINFER_HOST_SIMD")
        get_envs.cache_clear()
    assert code == 2
    assert f"DEEPINFER_HOST_SIMD={value!r}: expected one of" in err and "Traceback" not in err
