"""The NKI kernels as torch custom ops (nki_kernels/torch_ops.py) on the NumPy stand-in: for one tiny case of every
kernel (its operands recorded from the family's own case run), `torch.ops.deepinfer.<op>` returns the kernel's
outputs exactly, its fake implementation states the same shapes and dtypes (torch.library.opcheck's fake-tensor and
schema checks), and a call traces into a `fullgraph=True` graph as one node. The TorchNeuron registration (`nki_op`)
and the device launch (`wrap_nki(kernel)[lnc]`) are written, not run: no Neuron SDK here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nki_kernels import _convert, dispatch, registry, torch_ops


def _recorded_calls() -> list[tuple[str, object, tuple]]:
    """(dispatch key, kernel, NumPy operands) of the first non-slow case of each kernel family, one per kernel."""
    seen, out = set(), []
    for fam in registry.KERNELS:
        mod = registry.load(fam)
        for case in (c for c in mod.CASES if not c.slow):
            with dispatch.record() as calls:
                mod.run_case(case, "stand-in")
            for name, kernel, args in calls:
                if kernel.__name__ not in seen:
                    seen.add(kernel.__name__)
                    out.append((name, kernel, args))
    return out


CALLS = _recorded_calls()


def test_every_kernel_has_an_op() -> None:
    assert {torch_ops.op_of(k) for _, k, _ in CALLS} == set(torch_ops.KERNELS)
    assert torch_ops.registered() == "torch.library"  # no TorchNeuron here


@pytest.mark.parametrize("call", CALLS, ids=lambda c: torch_ops.op_of(c[1]))
def test_op_runs_the_kernel_and_its_fake_matches(call) -> None:
    name, kernel, args = call
    torch_ops.registered()
    op = getattr(torch.ops.deepinfer, torch_ops.op_of(kernel))
    targs = tuple(_convert.from_np(a) if isinstance(a, np.ndarray) else a for a in args)
    direct = dispatch.dispatch(name, kernel, args, "stand-in")[1]
    got = op(name, "stand-in", *targs)
    direct, got = (direct, got) if isinstance(direct, tuple) else ((direct,), (got,))
    for d, o in zip(direct, got, strict=True):
        assert torch.equal(o, _convert.from_np(d))
    torch.library.opcheck(op, (name, "stand-in", *targs), test_utils=("test_schema", "test_faketensor"))
    counted = dispatch.current().counts_of().get((name, "stand-in"), 0)
    torch._dynamo.reset()  # one lambda's code object per op: a fresh cache each time, not recompiles
    graph = torch.compile(lambda *a: op(name, "stand-in", *a), backend="aot_eager", fullgraph=True)
    again = graph(*targs)
    again = again if isinstance(again, tuple) else (again,)
    assert all(torch.equal(a, o) for a, o in zip(again, got, strict=True))
    assert dispatch.current().counts_of()[(name, "stand-in")] > counted  # counted per execution, also in a graph
