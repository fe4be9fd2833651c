"""Every case of every kernel family passes on the stand-in against the shared torch reference."""

from __future__ import annotations

import pytest

from nki_kernels import cases, dispatch, registry

ALL = [c for name in registry.KERNELS for c in registry.load(name).CASES]


def _param(c):
    return pytest.param(c, id=f"{c.kernel}-{c.dtype}-{c.name}", marks=[pytest.mark.slow] if c.slow else [])


def test_case_matrix_size():
    default = [c for c in ALL if not c.slow]
    assert len(default) >= 100
    assert {c.kernel for c in default} == set(registry.KERNELS)
    assert {c.dtype for c in default} == {"float32", "bfloat16"}


@pytest.mark.parametrize("c", [_param(c) for c in ALL])
def test_case(c):
    mod = registry.load(c.kernel)
    before = dispatch.counts()
    run = mod.run_case(c, "stand-in")
    moved = {k for k, n in dispatch.counts().items() if n != before.get(k, 0)}
    assert moved and all(ex == "stand-in" for _, ex in moved), moved  # the kernel ran, not the reference
    v = cases.compare(run, *c.tol)
    assert v.ok, f"{c.kernel}/{c.name}/{c.dtype}: max_abs={v.max_abs_err:.3e} max_rel={v.max_rel_err:.3e} {v.note}"
