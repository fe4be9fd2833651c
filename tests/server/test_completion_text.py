"""Incremental detokenization and stop strings: streaming token by token gives exactly the full-decode answer."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_bench.completion_text import IncrementalDetokenizer, SeqState
from tests.server.fakes import OFFSET, ByteTokenizer

TOK = ByteTokenizer()
# Bytes of ASCII, two- and three-byte characters and stray continuation/invalid bytes.
pieces = st.lists(st.sampled_from(["a", "b", " ", "é", "€", "ab", "\x80", "\xff"]), max_size=30)


def ids_of(parts: list[str]) -> list[int]:
    out = []
    for p in parts:
        raw = p.encode("latin-1") if p in ("\x80", "\xff") else p.encode()
        out += [b + OFFSET for b in raw]
    return out


@settings(max_examples=300, deadline=None)
@given(prompt=pieces, gen=pieces, stops=st.lists(st.sampled_from(["b", "ab", "é", "a a", "€b", "zz"]), max_size=3))
def test_stream_equals_full_decode(prompt: list[str], gen: list[str], stops: list[str]) -> None:
    ids = ids_of(gen)
    if not ids:
        return
    seq = SeqState(0, "r", 1, IncrementalDetokenizer(TOK.decode, ids_of(prompt)), stops)
    events = []
    for k, t in enumerate(ids):
        last = k == len(ids) - 1
        events += seq.feed([t], last, "length" if last else None)
        if seq.finish_reason is not None:
            break
    full = TOK.decode(ids)
    cuts = [full.find(s) for s in stops if s in full]
    text = "".join(t for t, _ in events)
    assert events[-1][1] == ("stop" if cuts else "length")
    assert all(r is None for _, r in events[:-1])
    assert text == (full[: min(cuts)] if cuts else full) == seq.text
    assert seq.num_tokens == len(events)


def test_holds_back_partial_character_then_releases() -> None:
    d = IncrementalDetokenizer(TOK.decode, [])
    e = "é".encode()
    assert d.push(e[0] + OFFSET) == ""
    assert d.push(e[1] + OFFSET) == "é"
    assert d.push(ord("x") + OFFSET) == "x"
