"""The static NKI subset check runs over every kernel file in CI, and catches what it claims to catch."""

from __future__ import annotations

import textwrap

import pytest

from nki_kernels import static_check


def test_every_kernel_file_is_clean():
    problems = {f: [str(i) for i in issues] for f, issues in static_check.check_all().items() if issues}
    assert not problems, problems


def test_every_call_used_has_a_nki06_signature():
    used = static_check.used_calls()
    assert used, "no nl/nisa calls found"
    assert used <= set(static_check.SIGNATURES), used - set(static_check.SIGNATURES)


def test_stand_in_parameter_lists_match_the_table():
    assert static_check.stand_in_matches_table() == []


BAD = {
    "is": ("if x is None:\n        pass", "`is`"),
    "global numpy": ("y = np.zeros(4)", "global name `np`"),
    "lambda": ("f = lambda a: a", "lambda"),
    "while": ("while True:\n        pass", "while"),
    "unknown isa": ("nisa.nc_matmul_mx(x, x, x)", "NeuronCore-v4"),
    "unlisted isa": ("nisa.dropout(x, x, 0.5)", "no NKI 0.6 signature"),
    "bad keyword": ("nisa.tensor_copy(x, x, mode=1)", "unknown keyword `mode`"),
    "missing arg": ("nisa.tensor_tensor(x, x, x)", "missing ['op']"),
    "too many args": ("nisa.reciprocal(x, x, 'n', 1)", "positional arguments"),
    "arange": ("i = nl.arange(4)", "nl.arange"),
    "gen4 dtype": ("t = nl.ndarray((4, 4), dtype=nl.float8_e4m3fn)", "NeuronCore-v4"),
    "python call": ("print(x)", "call to `print`"),
    "comprehension": ("a = [i for i in range(4)]", "comprehension"),
    "dict keys": ("d = {1: 2}", "string literals"),
    "nested slicing": ("y = x[0:4][0:2]", "nested slicing"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_violations_are_reported(tmp_path, name):
    body, expected = BAD[name]
    src = textwrap.dedent("""
        from nki_kernels._nki import nisa, nki, nl

        @nki.jit
        def k(x):
            {body}
            return x
    """).replace("{body}", body)
    path = tmp_path / "bad_kernel.py"
    path.write_text(src)
    issues = [str(i) for i in static_check.check_file(path)]
    assert any(expected in i for i in issues), issues


def test_signature_rules_reach_keyword_only_and_list_defaults(tmp_path):
    path = tmp_path / "bad_sig.py"
    path.write_text("from nki_kernels._nki import nki\n\n@nki.jit\ndef k(x, *, y=[1]):\n    return x\n")
    issues = [str(i) for i in static_check.check_file(path)]
    assert any("keyword-only" in i for i in issues) and any("mutable default" in i for i in issues)


def test_subkernels_are_checked_too(tmp_path):
    path = tmp_path / "bad_sub.py"
    path.write_text("from nki_kernels._nki import nki, nisa\n\n\ndef helper(x):\n    if x is None:\n        return x\n"
                    "    return x\n\n\n@nki.jit\ndef k(x):\n    helper(x)\n    return x\n")
    issues = [str(i) for i in static_check.check_file(path)]
    assert any("helper" in i and "`is`" in i for i in issues), issues
