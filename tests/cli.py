"""Run the `deepinfer` entry point (deepinfer_bench.cli.main: the one-line user errors) in this process."""

from __future__ import annotations

import sys

import pytest


def run_main(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `deepinfer *argv`."""
    from deepinfer_bench.cli import main

    old, sys.argv = sys.argv, ["deepinfer", *argv]
    try:
        with pytest.raises(SystemExit) as ex:
            main()
    finally:
        sys.argv = old
    out = capsys.readouterr()
    return int(ex.value.code or 0), out.out, out.err
