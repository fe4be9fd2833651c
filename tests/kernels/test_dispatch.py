"""Dispatch: which path ran is counted, the reference runs only when asked, unavailable executors refuse."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nki_kernels import _nki, dispatch, hc_collapse, reference, rmsnorm, swiglu


@pytest.fixture(autouse=True)
def _own_dispatcher():
    """Each test's kernel calls go to a dispatcher of its own (as an engine's forward does)."""
    with dispatch.Dispatcher().active() as d:
        yield d


def test_auto_is_the_stand_in_without_the_sdk():
    assert _nki.real_nki() is None  # CI has no Neuron SDK (the PyPI `nki` is a placeholder)
    assert dispatch.resolve_executor("auto") == "stand-in"
    assert dispatch.resolve_executor("auto", simulator=True) == "stand-in"


@pytest.mark.parametrize("ex", ["simulator", "neuron"])
def test_real_executors_refuse_without_the_sdk(ex):
    with pytest.raises(RuntimeError, match="real `nki`"):
        dispatch.resolve_executor(ex)


def test_unknown_executor():
    with pytest.raises(ValueError):
        dispatch.resolve_executor("gpu")


def test_kernel_path_is_counted_and_reference_is_not_used(monkeypatch):
    called = []
    monkeypatch.setattr(reference, "rms_norm", lambda *a: called.append(a) or a[0])
    x, w = torch.randn(5, 32), torch.ones(32)
    rmsnorm.rmsnorm(x, w, 1e-6)
    assert dispatch.counts("rmsnorm") == {("rmsnorm", "stand-in"): 1}
    assert called == []


def test_reference_runs_only_when_asked_and_is_the_shared_function(monkeypatch):
    sentinel = torch.full((5, 32), 7.0)
    monkeypatch.setattr(reference, "rms_norm", lambda x, w, eps: sentinel)
    out = rmsnorm.rmsnorm(torch.randn(5, 32), torch.ones(32), 1e-6, executor="reference")
    assert torch.equal(out, sentinel)
    assert dispatch.counts("rmsnorm") == {("rmsnorm", "reference"): 1}


def test_a_dispatchers_default_executor_and_counts_are_its_own():
    x = torch.randn(3, 2, 16)
    pre = torch.rand(3, 2)
    with dispatch.Dispatcher("reference").active() as ref:
        hc_collapse.hc_collapse(x, pre)
    assert ref.counts_of("hc_collapse") == {("hc_collapse", "reference"): 1}
    assert dispatch.counts("hc_collapse") == {}  # the outer dispatcher saw nothing
    hc_collapse.hc_collapse(x, pre)
    assert dispatch.counts("hc_collapse") == {("hc_collapse", "stand-in"): 1}
    assert ref.counts_of("hc_collapse") == {("hc_collapse", "reference"): 1}
    with pytest.raises(ValueError, match="lnc must be 1 or 2"):
        dispatch.Dispatcher(lnc=3)


def test_an_engines_runner_owns_its_dispatcher() -> None:
    """Kernel calls inside a runner's forward are counted by that runner's dispatcher (made with the process's LNC),
    not by a module global; two engines in one process count apart."""
    import engine
    from engine.config import EngineConfig
    from engine.stack import logical_nc_config
    tiny = Path(__file__).resolve().parents[2] / "golden" / "tiny"
    cfg = EngineConfig.from_model_dir(tiny, kernels="stand-in", max_num_seqs=1, max_num_batched_tokens=8,
                                      num_kv_blocks=4, max_model_len=32)
    a, b = engine.build(cfg), engine.build(cfg)
    assert a.runner.dispatcher is not b.runner.dispatcher and a.runner.dispatcher.lnc == logical_nc_config()
    a.add_request([1, 2, 3], None)
    a.step()
    assert a.runner.dispatcher.counts_of("rmsnorm") and not b.runner.dispatcher.counts_of()
    assert not dispatch.counts()  # the test's own dispatcher saw none of it


def test_wrappers_check_shapes_and_dtypes():
    with pytest.raises(ValueError):
        rmsnorm.rmsnorm(torch.randn(4, 8), torch.ones(9))
    with pytest.raises(TypeError):
        swiglu.swiglu(torch.ones(4, 8, dtype=torch.float16), torch.ones(4, 8, dtype=torch.float16), 10.0)
    with pytest.raises(ValueError):
        hc_collapse.hc_collapse(torch.randn(4, 2, 8), torch.rand(4, 3))
    assert dispatch.counts() == {}  # rejected before dispatch


def test_kernel_handle_cannot_be_called_directly():
    with pytest.raises(TypeError, match="wrapper"):
        rmsnorm.rmsnorm_kernel(None, None, 1e-6)


def test_stand_in_binding_replaces_nl_and_nisa():
    fn = rmsnorm.rmsnorm_kernel.bind("stand-in")
    from nki_kernels import stand_in

    assert fn.__globals__["nl"] is stand_in.language and fn.__globals__["nisa"] is stand_in.isa
    helper = fn.__globals__["load_bcast"]
    assert helper.__globals__["nisa"] is stand_in.isa
