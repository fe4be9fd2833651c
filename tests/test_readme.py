"""README.md as a product page: every `deepinfer ...` command it shows parses against the real CLI (the command and
sub-command exist, every option exists on it and its value is accepted), its relative links resolve, and it stays
short. The same check as bringup's steps (tests/test_bringup.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 300

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
SEPARATORS = {"&&", "||", "|", ";"}
ORDINALS = ("first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth thirteenth fourteenth "
            "fifteenth sixteenth seventeenth eighteenth nineteenth twentieth")
SESSION_WORDS = "|".join([*ORDINALS.split(), "this", "that", "previous", "next", "same", "every", r"\d+(st|nd|rd|th)"])
DIARY = re.compile(rf"\b({SESSION_WORDS}) stops?\b", re.I)


def _code_lines(text: str) -> list[str]:
    """Shell lines of the fenced code blocks (backslash continuations joined) and the inline `deepinfer ...` spans."""
    lines: list[str] = []
    for block in FENCE.findall(text):
        lines.extend(block.replace("\\\n", " ").splitlines())
    body = FENCE.sub("", text)
    lines.extend(" ".join(m.replace("\\|", "|").split()) for m in INLINE.findall(body))
    return lines


def deepinfer_commands(text: str) -> list[list[str]]:
    """The argv after each `deepinfer` word of a shell line: `a && deepinfer golden --cp 2  # note` -> [golden,
    --cp, 2]. Comments, pipes and command lists end a command."""
    commands: list[list[str]] = []
    for line in _code_lines(text):
        if "deepinfer" not in line:
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        words, current = list(lexer), None
        for word in [*words, ";"]:
            if word in SEPARATORS:
                if current is not None:
                    commands.append(current)
                current = None
            elif current is not None:
                current.append(word)
            elif word == "deepinfer":
                current = []
    return commands


def _readme_text() -> str:
    return README.read_text(encoding="utf-8")


def test_readme_is_a_page_not_a_diary() -> None:
    text = _readme_text()
    num_lines = len(text.splitlines())
    assert num_lines <= MAX_LINES, f"README.md is {num_lines} lines (at most {MAX_LINES}): detail belongs in docs/"
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        diary = DIARY.search(page.read_text(encoding="utf-8"))
        assert diary is None, f"{page.name} says {diary.group(0)!r} (a work session): not a user's word"


def test_readme_opens_with_the_two_setup_commands() -> None:
    """The first lines are the install + main job and the install + tests; the test command is the one CI runs."""
    text = _readme_text()
    assert text.startswith("# deepinfer\n\n```bash\n"), "README.md must open with the set-up commands"
    job, tests = (line.split("#", 1)[0].strip() for line in FENCE.search(text).group(1).splitlines())
    assert job.startswith("pip install") and job.endswith("&& deepinfer golden"), job
    assert tests.startswith("pip install") and tests.endswith("&& python -m pytest"), tests
    assert "python -m pytest -q\n" in (ROOT / ".ci" / "run").read_text(encoding="utf-8"), "CI runs another command"


def test_readme_commands_are_found() -> None:
    """The parser sees the commands the README shows (a parser that found none would pass anything)."""
    commands = deepinfer_commands(_readme_text())
    assert ["golden"] in commands
    assert {c[0] for c in commands if c} >= {"golden", "kernels", "regions", "bench", "serve", "bringup", "compile",
                                             "generate"}
    assert any(c[:2] == ["bench", "matrix"] for c in commands)
    assert any(c[:2] == ["bench", "engine-vs-hf"] for c in commands)


def test_diary_wording_is_caught() -> None:
    assert DIARY.search("measured at the fourteenth stop") and DIARY.search("What changed this stop: x")
    assert not DIARY.search("stop strings and stop token ids; the server stops accepting, with stop, and stop")


def test_parser_splits_shell_lines() -> None:
    text = "```bash\npip install -e . && deepinfer golden --cp 2   # note\n"
    text += "X=1 deepinfer bench matrix \\\n  --matrix quick\n```\n"
    text += "and `deepinfer kernels --kernel rmsnorm` inline\n"
    assert deepinfer_commands(text) == [["golden", "--cp", "2"], ["bench", "matrix", "--matrix", "quick"],
                                        ["kernels", "--kernel", "rmsnorm"]]


def _documented_commands() -> list[tuple[str, list[str]]]:
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    return [(page.relative_to(ROOT).as_posix(), argv) for page in pages
            for argv in deepinfer_commands(page.read_text(encoding="utf-8"))]


def _case_id(value: str | list[str]) -> str:
    return value if isinstance(value, str) else " ".join(value)


@pytest.mark.parametrize(("page", "argv"), _documented_commands(), ids=_case_id)
def test_every_documented_command_parses_against_the_cli(page: str, argv: list[str]) -> None:
    """Each command in README.md and docs/ names a real (sub-)command and every option it passes exists there with a
    value it accepts."""
    import typer.main

    from deepinfer_bench.cli import app

    cmd, args, where = typer.main.get_command(app), list(argv), f"{page}: deepinfer {' '.join(argv)}"
    while hasattr(cmd, "commands"):  # a group (Typer vendors its own click: no isinstance check)
        assert args, f"{where}: names a command group, not a command"
        name, args = args[0], args[1:]
        if name == "--help":
            return
        sub = cmd.commands.get(name)
        assert sub is not None, f"{where}: no command {name!r} (have: {sorted(cmd.commands)})"
        cmd = sub
    if "--help" in args:  # click would print the help and exit: the command exists, which is all it names
        return
    cmd.make_context(argv[0], args)  # raises a usage error on an unknown option or a bad value


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


# Pages another change of the same issue set writes (issue 42: benchmark history moved out of the host-kernel code);
# linked from here so that the merge needs no edit. Remove an entry once its page is in this checkout.
WRITTEN_ELSEWHERE: set[str] = set()  # pages a branch links before another branch writes them


def _broken_links(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", FENCE.sub("", text), re.M)}
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        if not path:
            if anchor not in anchors:
                broken.append(target)
            continue
        resolved = (page.parent / path).resolve()
        if not resolved.exists() and resolved.relative_to(ROOT).as_posix() not in WRITTEN_ELSEWHERE:
            broken.append(target)
    return broken


def test_readme_links_resolve() -> None:
    """README.md's relative links (into docs/, golden/) point at files of this checkout, its anchors at headings."""
    assert not _broken_links(README), f"README.md: links that do not resolve: {_broken_links(README)}"


def test_docs_links_resolve() -> None:
    """The docs/ pages' links resolve too."""
    broken = {page.name: b for page in sorted((ROOT / "docs").glob("*.md")) if (b := _broken_links(page))}
    assert not broken, f"docs/: links that do not resolve: {broken}"
    assert (ROOT / "docs" / "architecture.md").exists()
