"""`--kernels nki` calls the real `nki.jit` the documented torch way: every kernel launch on executor "neuron" gets
torch tensors only (the PyTorch integration of `nki.jit`; NumPy arguments would mean a standalone run with every
operand copied off the device), on the activation's device, with weight layouts converted once and reused; the
results equal the stand-in path's bit for bit.

The real `nki` is absent here, so a fake stands in for it: `real_nki()` returns a `jit` whose launches record what
they receive and then compute with the stand-in (converting on the fake "device" side only), and a Neuron device
is pretended. While the ops run, `_convert.to_np` / `from_np` raise, so the adapters provably do no host round
trip. The xla-marked test repeats the check with every operand on `xla:0` (the second CI lane).
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from nki_kernels import _convert, _nki, dispatch, kernel_ops, registry, stand_in
from tests.kernels.test_kernel_ops import CASES, DIM, DTYPES, _gen, rnd

_TO_NP, _FROM_NP = _convert.to_np, _convert.from_np  # the fake device's own conversions (the ops' are patched)


class _FakeJit:
    """What the real `nki.jit(fn)` returns, faked: `[lnc]` launches, calls recorded, computed on the stand-in."""

    def __init__(self, fn, log: list, lnc: int = 1, returns_numpy: bool = False):
        self.fn, self.log, self.lnc, self.returns_numpy = fn, log, lnc, returns_numpy

    def __getitem__(self, lnc: int) -> _FakeJit:
        return _FakeJit(self.fn, self.log, lnc, self.returns_numpy)

    def __call__(self, *args):
        self.log.append((self.fn.__name__, self.lnc, args))
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        out = stand_in.run(self.fn, *(_TO_NP(a) if isinstance(a, torch.Tensor) else a for a in args))
        if self.returns_numpy:
            return out
        back = lambda o: _FROM_NP(o).to(device)  # noqa: E731
        return tuple(map(back, out)) if isinstance(out, tuple) else back(out)


def _drop_fake_bindings() -> None:
    for name in registry.KERNELS:
        for obj in vars(registry.load(name)).values():
            if isinstance(obj, _nki.Kernel):
                obj._bound.pop("real", None)
                obj._jitted.clear()


@pytest.fixture
def fake_device(monkeypatch):
    """A fake real `nki` and a pretended Neuron device; yields the launch log and a `numpy` switch."""
    log: list = []
    state = types.SimpleNamespace(log=log, returns_numpy=False)
    fake = types.SimpleNamespace(jit=lambda fn: _FakeJit(fn, log, returns_numpy=state.returns_numpy))
    _drop_fake_bindings()
    monkeypatch.setattr(_nki, "real_nki", lambda: (fake, stand_in.language, stand_in.isa))
    monkeypatch.setattr(_nki, "has_neuron_device", lambda: True)
    dispatch.reset_counts()
    yield state
    _drop_fake_bindings()
    dispatch.reset_counts()


def _no_host_round_trip(m: pytest.MonkeyPatch) -> None:
    def refuse(*a, **k):
        raise AssertionError("a torch <-> NumPy conversion on the neuron route")

    m.setattr(_convert, "to_np", refuse)
    m.setattr(_convert, "from_np", refuse)


def _cached_tensors(ops: kernel_ops.KernelOps) -> dict[int, torch.Tensor]:
    out = {}
    for slot in ops.cache._store.values():
        for _, value in slot.values():
            for t in value if isinstance(value, tuple) else (value,):
                out[id(t)] = t
    return out


def _check_route(op, args, device, fake_device, monkeypatch):
    """Run `op` twice on "neuron" (fake) and once on the stand-in; the launch contract and bit-equal results."""
    want = getattr(kernel_ops.KernelOps("stand-in"), op)(*[a.cpu() if isinstance(a, torch.Tensor) else a
                                                            for a in args])
    dispatch.reset_counts()
    fake_device.log.clear()
    ops = kernel_ops.KernelOps("neuron")
    with monkeypatch.context() as m:
        _no_host_round_trip(m)
        got1 = getattr(ops, op)(*args)
        launches = len(fake_device.log)
        conversions = dict(ops.cache.conversions)
        got2 = getattr(ops, op)(*args)
    assert launches >= 1 and len(fake_device.log) == 2 * launches
    assert dict(ops.cache.conversions) == conversions  # the second call hit the cache for every weight layout
    cached = _cached_tensors(ops)
    for i, (_, lnc, kargs) in enumerate(fake_device.log):
        assert lnc == dispatch.current().lnc
        assert not any(isinstance(a, np.ndarray) for a in kargs), [type(a).__name__ for a in kargs]
        tensors = [a for a in kargs if isinstance(a, torch.Tensor)]
        assert tensors and all(t.device == device for t in tensors), [str(t.device) for t in tensors]
        assert all(isinstance(a, (torch.Tensor, int, float, bool)) for a in kargs), [type(a) for a in kargs]
        if i >= launches:  # the second call launched with the very same cached weight tensors as the first
            first = fake_device.log[i - launches][2]
            for a, b in zip(first, kargs, strict=True):
                if isinstance(a, torch.Tensor) and id(a) in cached:
                    assert b is a
    assert dispatch.counts() and all(ex == "neuron" and not k.endswith(".fallback") for k, ex in dispatch.counts())
    for got in (got1, got2):
        g, w = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for a, b in zip(g, w, strict=True):
            assert isinstance(a, torch.Tensor) and a.device == device
            assert a.shape == b.shape and a.dtype == b.dtype
            torch.testing.assert_close(a.cpu(), b, rtol=0, atol=0, equal_nan=True)
    return ops


WEIGHT_OPS = {"linear", "fp8_linear", "fp4_linear", "grouped_out_proj", "hc_mixes", "hc_attn_out", "sparse_attn"}


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("op,label,key,build,t", CASES, ids=[f"{c[0]}-{c[1]}-T{c[4]}" for c in CASES])
def test_neuron_route_passes_torch_tensors(op, label, key, build, t, dt, fake_device, monkeypatch):
    args = build(getattr(torch, dt), t, _gen(op, label, t, dt))
    ops = _check_route(op, args, torch.device("cpu"), fake_device, monkeypatch)
    assert dispatch.counts().get((key, "neuron"), 0) >= 2
    if op in WEIGHT_OPS or (op == "rms_norm" and args[1] is not None and args[1].dtype != torch.float32):
        assert sum(ops.cache.conversions.values()) >= 1  # a weight layout was made (once, checked above)
    elif op == "rms_norm" and args[1] is not None:  # an fp32 norm weight is the kernel's layout already
        assert not ops.cache.conversions


def test_neuron_route_refuses_operands_on_two_devices(fake_device):
    g = _gen("two devices")
    ops = kernel_ops.KernelOps("neuron")
    with pytest.raises(ValueError, match="device"):
        ops.linear(rnd(g, 2, DIM), torch.empty(8, DIM, device="meta"))
    assert fake_device.log == []  # refused before any launch: nothing is moved between devices


def test_neuron_route_refuses_a_numpy_result(fake_device):
    fake_device.returns_numpy = True
    g = _gen("numpy result")
    with pytest.raises(TypeError, match="torch.Tensor"):
        kernel_ops.KernelOps("neuron").rms_norm(rnd(g, 2, DIM), None, 1e-6)


# one case per (op, label) at its smallest T: the same contract with every operand on xla:0
XLA_CASES = list({(c[0], c[1]): c for c in sorted(CASES, key=lambda c: -c[4])}.values())


@pytest.mark.xla
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("op,label,key,build,t", XLA_CASES, ids=[f"{c[0]}-{c[1]}-T{c[4]}" for c in XLA_CASES])
def test_neuron_route_keeps_operands_on_the_xla_device(op, label, key, build, t, dt, fake_device, monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    torch_xla = pytest.importorskip("torch_xla")
    dev = torch_xla.device()
    args = build(getattr(torch, dt), t, _gen(op, label, t, dt))
    args = tuple(a.to(dev) if isinstance(a, torch.Tensor) else a for a in args)
    _check_route(op, args, args[0].device, fake_device, monkeypatch)
