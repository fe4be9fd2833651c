"""engine/detokenizer.py: incremental detokenization and stop strings, alone and through the real LLMEngine.

Streaming token by token must give exactly the full-decode answer (cut before the first stop string), never release
half a character or the start of a possible stop string, and release what it held when the request ends.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer, TextState
from engine.sampler import SamplingParams
from tests.fake_runner import BOS, EOS, OFFSET, ByteTokenizer, byte_engine, byte_greedy

TOK = ByteTokenizer()
# Bytes of ASCII, two- and three-byte characters and stray continuation/invalid bytes.
pieces = st.lists(st.sampled_from(["a", "b", " ", "é", "€", "ab", "\x80", "\xff"]), max_size=30)


def ids_of(parts: list[str] | str) -> list[int]:
    out = []
    for p in [parts] if isinstance(parts, str) else parts:
        raw = p.encode("latin-1") if p in ("\x80", "\xff") else p.encode()
        out += [b + OFFSET for b in raw]
    return out


def state(stop: tuple[str, ...] = (), prompt: str = "") -> TextState:
    return TextState(TOK.decode, [BOS, *ids_of(prompt)], stop)


@settings(max_examples=300, deadline=None)
@given(prompt=pieces, gen=pieces, stops=st.lists(st.sampled_from(["b", "ab", "é", "a a", "€b", "zz"]), max_size=3))
def test_stream_equals_full_decode(prompt: list[str], gen: list[str], stops: list[str]) -> None:
    ids = ids_of(gen)
    if not ids:
        return
    ts = TextState(TOK.decode, ids_of(prompt), stops)
    deltas = []
    for k, t in enumerate(ids):
        deltas.append(ts.push(t, final=k == len(ids) - 1))
        if ts.stop_hit is not None:
            break
    full = TOK.decode(ids)
    cuts = [(full.find(s), s) for s in stops if s in full]
    assert "".join(deltas) == ts.text == (full[: min(cuts)[0]] if cuts else full)
    assert ts.stop_hit == (min(cuts)[1] if cuts else None)
    assert all("\ufffd" not in d for d in deltas[:-1]) or "\ufffd" in full  # only a real U+FFFD is released early


def test_multibyte_characters_split_across_tokens() -> None:
    d = IncrementalDetokenizer(TOK.decode, [BOS])
    e, euro = "é".encode(), "€".encode()
    assert d.push(e[0] + OFFSET) == ""
    assert d.push(e[1] + OFFSET) == "é"
    assert [d.push(b + OFFSET) for b in euro] == ["", "", "€"]
    assert d.push(ord("x") + OFFSET) == "x"
    ts = state()
    assert [ts.push(t) for t in ids_of("a€b")] == ["a", "", "", "€", "b"] and ts.text == "a€b"


def test_stop_string_spanning_tokens_is_cut_and_never_released() -> None:
    ts = state(("lo w",))
    deltas = [ts.push(t) for t in ids_of("hello world")[:7]]  # h e l l o ' ' w
    # "l" and "lo" and "lo " could start the stop string: held back, then cut when "lo w" is complete
    assert deltas == ["h", "e", "", "l", "", "", ""]
    assert ts.stop_hit == "lo w" and ts.text == "hel"
    assert ts.push(ord("x") + OFFSET) == "" and ts.finish() == ""  # nothing after a stop


def test_held_back_text_is_released_at_the_end() -> None:
    ts = state(("xyz",))
    assert [ts.push(t) for t in ids_of("axy")] == ["a", "", ""]
    assert ts.finish() == "xy" and ts.text == "axy" and ts.stop_hit is None
    ts = state(("xyz",))
    assert ts.push(ids_of("x")[0]) == ""
    assert ts.push(ids_of("y")[0], final=True) == "xy"  # the request's last token: nothing is held
    ts = state(("é!",))
    assert [ts.push(t) for t in ids_of("aé")] == ["a", "", ""]  # half a character, then a possible stop start
    assert ts.finish() == "é"


def test_stop_string_before_min_tokens_is_ignored() -> None:
    ts = state(("b",))
    assert ts.push(ids_of("b")[0], check_stop=False) == "b" and ts.stop_hit is None
    assert ts.push(ids_of("a")[0]) == "a"
    assert ts.push(ids_of("b")[0]) == "" and ts.stop_hit == "b" and ts.text == "ba"


# ---- through the engine (LLMEngine over the byte model, with the byte tokenizer) ---------------------------------
def run(eng, prompt: list[int], params: SamplingParams) -> tuple[list, str]:
    rid = eng.add_request(prompt, params)
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == rid]
    return outs, "".join(o.text_delta for o in outs)


def ascii_case(n: int = 30) -> tuple[list[int], list[int], str]:
    for k in range(200):
        prompt = TOK.encode(f"p{k}")
        out = byte_greedy(prompt, n, ignore_eos=True)
        text = TOK.decode(out)
        if len(text) == n and len(set(text)) < n // 2:  # one char per token, with repeats
            return prompt, out, text
    raise AssertionError("no ASCII case found")


def test_engine_text_deltas_and_stop_string_with_min_tokens() -> None:
    eng = byte_engine()
    prompt, out, full = ascii_case()
    outs, text = run(eng, prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert text == full == outs[-1].text and [o.new_token_ids for o in outs] == [[t] for t in out]
    assert outs[-1].finish_reason == "length" and outs[-1].stop_reason is None
    c = next(ch for ch in full if full.count(ch) >= 2 and full.index(ch) > 0)
    first = full.index(c)
    outs, text = run(eng, prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=c))
    assert text == full[:first] and len(outs) == first + 1  # the token holding the stop string is counted
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == c
    later = full.index(c, first + 1)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=c, min_tokens=first + 2)
    outs, text = run(eng, prompt, params)
    assert text == full[:later] and outs[-1].stop_reason == c and len(outs) == later + 1


def test_engine_stop_tokens_are_not_text() -> None:
    eng = byte_engine()
    prompt, out, full = ascii_case()
    outs, text = run(eng, prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                 stop_token_ids=[out[4]]))
    k = out.index(out[4])
    assert text == full[:k] and outs[-1].stop_reason == out[4] and outs[-1].output_token_ids == out[:k + 1]
    for i in range(300):  # EOS: finishes with "stop", no stop_reason, and is not part of the text
        prompt = TOK.encode(f"q{i}")
        if EOS in byte_greedy(prompt, 30, ignore_eos=True)[:-1]:
            break
    want = byte_greedy(prompt, 30)
    outs, text = run(eng, prompt, SamplingParams(temperature=0, max_tokens=30))
    assert outs[-1].output_token_ids == want and want[-1] == EOS
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason is None and text == TOK.decode(want[:-1])
