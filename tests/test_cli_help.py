"""`deepinfer --help` reads: at 100 columns each command is one line, its short help one sentence of at most 90
characters; the details stand in the command's own `--help`."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import typer
from typer.core import TyperGroup

from deepinfer_bench.cli import app

MAX_SHORT_HELP = 90


def _groups() -> list[tuple[list[str], TyperGroup]]:
    """(argv to the group, the group) for the top level and every command group below it."""
    found: list[tuple[list[str], TyperGroup]] = []

    def walk(argv: list[str], group: TyperGroup) -> None:
        found.append((argv, group))
        for name, cmd in group.commands.items():
            if isinstance(cmd, TyperGroup):
                walk([*argv, name], cmd)

    walk([], typer.main.get_command(app))  # type: ignore[arg-type]
    return found


def _short_help(cmd: typer.core.TyperCommand | TyperGroup) -> str:
    """What the command list shows: `short_help`, else the help's first paragraph."""
    return cmd.short_help or (cmd.help or "").strip().split("\n\n")[0].strip()


def _commands_panel(text: str) -> list[str]:
    """The rows inside the `Commands` box of rich's help."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("╭") and " Commands " in ln)
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("╰"))
    return lines[start + 1:end]


def test_every_short_help_is_one_sentence_of_at_most_90_characters() -> None:
    seen = 0
    for argv, group in _groups():
        for name, cmd in group.commands.items():
            text = _short_help(cmd)
            where = " ".join(["deepinfer", *argv, name])
            assert text and "\n" not in text, f"{where}: short help is not one line: {text!r}"
            assert len(text) <= MAX_SHORT_HELP, f"{where}: short help of {len(text)} characters: {text!r}"
            assert text.endswith(".") and not re.search(r"[.;!?] [A-Z]", text), f"{where}: not one sentence: {text!r}"
            seen += 1
    assert seen >= 12  # every command and group, the bench ones included


@pytest.mark.parametrize("argv", [argv for argv, _ in _groups()], ids=lambda a: " ".join(["deepinfer", *a]))
def test_help_at_100_columns_shows_one_line_per_command(argv: list[str]) -> None:
    group = dict((tuple(a), g) for a, g in _groups())[tuple(argv)]
    r = subprocess.run([sys.executable, "-m", "deepinfer_bench.cli", *argv, "--help"], capture_output=True,
                       text=True, env={**os.environ, "COLUMNS": "100"}, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = _commands_panel(r.stdout)
    assert all(len(row) <= 100 for row in rows), r.stdout
    names = [row[1:].split()[0] for row in rows]
    assert sorted(names) == sorted(group.commands), f"one line per command expected:\n{r.stdout}"
    for row, name in zip(rows, names, strict=True):  # the whole short help on the command's own line
        assert " ".join(_short_help(group.commands[name]).split()) in " ".join(row.split()), row
