"""The prepared trn2 check runs on a CPU box (real-nki columns skipped), and its real-nki plumbing works
against a fake `nki` built from the stand-in (jit / kernel[lnc] / simulate)."""

from __future__ import annotations

import json
import types

import pytest

from nki_kernels import _nki, dispatch, stand_in, trn2_check


def test_cpu_run_writes_one_report(tmp_path):
    rc = trn2_check.main(["--out", str(tmp_path), "--kernel", "hc_collapse"])
    assert rc == 0
    data = json.loads((tmp_path / "trn2_check.json").read_text())
    assert data["meta"]["real_nki"] is None and data["rows"]
    assert all(r["simulator"].startswith("skipped") for r in data["rows"])
    assert (tmp_path / "trn2_check.csv").exists()


class _FakeJitted:
    def __init__(self, fn, lnc=1):
        self.fn, self.lnc = fn, lnc

    def __getitem__(self, lnc):
        return _FakeJitted(self.fn, lnc)

    def __call__(self, *args):
        return stand_in.run(self.fn, *args)


@pytest.fixture
def fake_real(monkeypatch):
    launched = []

    def simulate(k):
        launched.append(k.lnc)
        return k

    fake = types.SimpleNamespace(jit=lambda fn: _FakeJitted(fn), simulate=simulate)
    monkeypatch.setattr(_nki, "real_nki", lambda: (fake, stand_in.language, stand_in.isa))
    yield launched
    from nki_kernels import registry

    for name in registry.KERNELS:  # drop bindings made against the fake
        mod = registry.load(name)
        for obj in vars(mod).values():
            if isinstance(obj, _nki.Kernel):
                obj._bound.pop("real", None)
                obj._jitted.clear()


def test_simulator_path_and_diff_with_a_fake_real_nki(fake_real, tmp_path):
    assert dispatch.resolve_executor("auto", simulator=True) == "simulator"
    rows = trn2_check.check("rmsnorm", include_slow=False, lnc=2, device=False)
    assert rows and all(r["simulator"] == "ok" for r in rows)
    assert all(r["max_abs_standin_vs_sim"] == 0.0 for r in rows)  # same kernel source, same numbers
    assert fake_real and set(fake_real) == {2}  # launched as kernel[2]
