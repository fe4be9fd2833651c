"""engine/chat_encoding.py against DeepSeek's golden chat-encoding cases (tests/data/dsv4_chat_cases/), plus the
rules the cases do not pin down, every bad-input error, parsing, and the tiny tokenizer's chat tokens."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from engine.chat_encoding import (
    ASSISTANT,
    BOS,
    DSML,
    EOS,
    SPECIAL_TOKENS,
    TOOLS_HEADER,
    USER,
    encode_messages,
    missing_special_tokens,
    parse_completion,
)

CASES = Path(__file__).resolve().parent / "data" / "dsv4_chat_cases"
TINY = Path(__file__).resolve().parent.parent / "golden" / "tiny"
MODES = {1: "thinking", 2: "thinking", 3: "thinking", 4: "chat"}


def _read(name: str) -> str:
    return (CASES / name).read_bytes().decode("utf-8")


def case(n: int) -> tuple[list[dict], str]:
    """(messages, expected prompt) of golden case n; case 1's tools go on its system message (cases README)."""
    data = json.loads(_read(f"input_{n}.json"))
    if n == 1:
        data["messages"][0]["tools"] = data["tools"]
        data = data["messages"]
    return data, _read(f"output_{n}.txt")


def case1_request_tools() -> tuple[list[dict], list[dict]]:
    data = json.loads(_read("input_1.json"))
    return data["messages"], data["tools"]


WEATHER_CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


# ---- golden cases ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_golden_case_byte_exact(n):
    messages, expected = case(n)
    before = copy.deepcopy(messages)
    got = encode_messages(messages, thinking_mode=MODES[n])
    assert got.encode("utf-8") == expected.encode("utf-8")
    assert messages == before  # the caller's list is not modified


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_golden_assistant_turns_round_trip(n):
    """Each assistant turn = full prompt minus the generation prompt before it; parsing gives the message back."""
    messages, _ = case(n)
    full = encode_messages(messages, thinking_mode=MODES[n], drop_thinking=False)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert turns
    for i in turns:
        prefix = encode_messages(messages[:i], thinking_mode=MODES[n], drop_thinking=False)
        assert full.startswith(prefix)
        completion = full[len(prefix):].split(EOS, 1)[0] + EOS
        parsed = parse_completion(completion, thinking_mode=MODES[n])
        msg = messages[i]
        assert parsed.content == (msg.get("content") or "")
        assert parsed.reasoning_content == (msg.get("reasoning_content") if MODES[n] == "thinking" else None)
        want = msg.get("tool_calls") or []
        assert [c["function"]["name"] for c in parsed.tool_calls] == [c["function"]["name"] for c in want]
        for got_call, want_call in zip(parsed.tool_calls, want, strict=True):
            assert got_call["type"] == "function" and got_call["id"].startswith("call_")
            assert got_call["function"]["arguments"] == want_call["function"]["arguments"]  # same JSON spelling


def test_request_level_tools_attach_to_the_system_message():
    messages, tools = case1_request_tools()
    assert encode_messages(messages, thinking_mode="thinking", tools=tools) == case(1)[1]


def test_request_level_tools_without_a_system_message_add_only_the_tools_block():
    messages, tools = case1_request_tools()
    got = encode_messages(messages[1:], thinking_mode="thinking", tools=tools)
    with_system = case(1)[1]
    block = with_system[len(BOS + "You are a helpful assistant.\n\n"):with_system.index(USER)]
    assert block.startswith(TOOLS_HEADER)
    assert got == BOS + block + with_system[with_system.index(USER):]


def test_tools_on_the_request_and_a_message_is_an_error():
    messages, expected = case(1)
    with pytest.raises(ValueError, match=r"both on the request and on messages\[0\]"):
        encode_messages(messages, thinking_mode="thinking", tools=messages[0]["tools"])
    assert encode_messages(messages, thinking_mode="thinking", tools=[]) == expected  # empty list: no tools


# ---- drop_thinking, reasoning effort, modes --------------------------------------------------------------------
def test_drop_thinking_strips_reasoning_before_the_last_user_message_only():
    messages, expected = case(2)
    kept = encode_messages(messages, thinking_mode="thinking", drop_thinking=False)
    old = f"{ASSISTANT}</think>Hi there! How can I help you?"
    assert old in expected and old not in kept
    assert f"{ASSISTANT}<think>The user said hello, I should greet back.</think>Hi there!" in kept
    assert kept.replace("<think>The user said hello, I should greet back.</think>", "</think>") == expected
    # the last turn (after the last user message) keeps its reasoning either way
    assert "<think>The user asks about the capital of France. It is Paris.</think>" in expected


def test_tools_defined_keep_all_reasoning():
    messages, _ = case(2)
    tools = case1_request_tools()[1]
    got = encode_messages(messages, thinking_mode="thinking", tools=tools)
    assert "<think>The user said hello, I should greet back.</think>" in got
    assert got == encode_messages(messages, thinking_mode="thinking", tools=tools, drop_thinking=False)


def test_reasoning_effort_max_prepends_the_paragraph_in_thinking_mode():
    paragraph = _read("reasoning_effort_max.txt")
    assert paragraph.count("\n") == 4 and paragraph.endswith(".\n\n")
    for n in (1, 2, 3):
        messages, expected = case(n)
        got = encode_messages(messages, thinking_mode="thinking", reasoning_effort="max")
        assert got == BOS + paragraph + expected[len(BOS):]
        assert encode_messages(messages, thinking_mode="thinking", reasoning_effort="high") == expected


def test_reasoning_effort_max_does_nothing_in_chat_mode():
    messages, expected = case(4)
    assert encode_messages(messages, thinking_mode="chat", reasoning_effort="max") == expected


def test_chat_mode_never_renders_reasoning():
    messages, _ = case(2)
    got = encode_messages(messages, thinking_mode="chat", drop_thinking=False)
    assert "<think>" not in got and "The user" not in got
    assert got.endswith(f"{ASSISTANT}</think>The capital of France is Paris.{EOS}")


def test_generation_prompts():
    user = [{"role": "user", "content": "hi"}]
    assert encode_messages(user, thinking_mode="chat") == f"{BOS}{USER}hi{ASSISTANT}</think>"
    assert encode_messages(user, thinking_mode="thinking") == f"{BOS}{USER}hi{ASSISTANT}<think>"
    assert encode_messages(user, add_generation_prompt=False) == f"{BOS}{USER}hi"
    # after a complete assistant turn nothing is added (the golden cases end at EOS)
    messages, expected = case(2)
    assert encode_messages(messages, thinking_mode="thinking", add_generation_prompt=True) == expected


@pytest.mark.parametrize("mode", ["chat", "thinking"])
def test_quick_instruction_generation_prompt(mode):
    messages, expected = case(4)
    prompt = encode_messages(messages[:-1], thinking_mode=mode)
    assert prompt.endswith(f"{USER}世界著名温泉有哪些{ASSISTANT}</think><｜action｜>")
    assert prompt + "Search" + EOS == expected  # quick-instruction turns never think, in either mode


def test_tool_results_ordered_as_the_calls_and_merged_with_the_next_user_message():
    calls = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1, "s": "1"}'}},
             {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "Calling.", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "b", "content": "B"},
                {"role": "tool", "tool_call_id": "a", "content": "A"},
                {"role": "user", "content": "and now?"}]
    got = encode_messages(messages, thinking_mode="chat")
    assert got == (f"{BOS}{USER}go{ASSISTANT}</think>Calling.\n\n<{DSML}tool_calls>\n"
                   f'<{DSML}invoke name="f">\n'
                   f'<{DSML}parameter name="x" string="false">1</{DSML}parameter>\n'
                   f'<{DSML}parameter name="s" string="true">1</{DSML}parameter>\n'
                   f"</{DSML}invoke>\n"
                   f'<{DSML}invoke name="g">\n'
                   f"</{DSML}invoke>\n"
                   f"</{DSML}tool_calls>{EOS}"
                   f"{USER}<tool_result>A</tool_result><tool_result>B</tool_result>and now?{ASSISTANT}</think>")


# ---- bad input -------------------------------------------------------------------------------------------------
def _asst_call(arguments):
    call = {"type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"role": "assistant", "tool_calls": [call]}


U = {"role": "user", "content": "q"}
BAD = [
    ("hi", "messages must be a list"),
    ({"role": "user", "content": "hi"}, "messages must be a list"),
    ([], "messages is empty"),
    (["hi"], r"messages\[0\] must be an object"),
    ([{"content": "hi"}], r"messages\[0\]\.role None is not one of"),
    ([{"role": "robot", "content": "hi"}], r"messages\[0\]\.role 'robot' is not one of"),
    ([{"role": "user"}], r"messages\[0\]\.content must be a string .* got missing"),
    ([U, {"role": "system", "content": 3}], r"messages\[1\]\.content must be a string .* got a int"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], r"content\[0\]: only text content"),
    ([U, {"role": "assistant", "content": {"a": 1}}], r"messages\[1\]\.content must be a string"),
    ([U, {"role": "assistant", "content": "x", "reasoning_content": 5}], r"reasoning_content must be a string"),
    ([U, {"role": "assistant", "content": "x", "tool_calls": {}}], r"messages\[1\]\.tool_calls must be a list"),
    ([{"role": "tool", "content": "r"}], r"messages\[0\] is a tool message without a preceding assistant"),
    ([U, {"role": "assistant", "content": "x"}, {"role": "tool", "content": "r"}], r"messages\[2\] is a tool message"),
    ([U, _asst_call("{}"), {"role": "tool", "content": "r"}, {"role": "tool", "content": "s"}],
     r"2 tool results for 1 tool calls"),
    ([U, {"role": "assistant", "tool_calls": [WEATHER_CALL]}, {"role": "tool", "tool_call_id": "zz", "content": "r"}],
     r"tool_call_id 'zz' matches no call of messages\[1\]"),
    ([U, {"role": "assistant", "tool_calls": [WEATHER_CALL, WEATHER_CALL]},
      {"role": "tool", "tool_call_id": "c1", "content": "r"}, {"role": "tool", "tool_call_id": "c1", "content": "s"}],
     r"more than one result for that call"),
    ([U, _asst_call("{not json")], r"tool_calls\[0\]\.function\.arguments is not valid JSON"),
    ([U, _asst_call("[1, 2]")], r"arguments must be a JSON object"),
    ([U, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}],
     r"tool_calls\[0\] must be"),
    ([{"role": "user", "content": "q", "tools": []}], r"only system and developer messages can carry tools"),
    ([{"role": "system", "content": "s", "tools": {"f": 1}}], r"messages\[0\]\.tools must be a list"),
    ([{"role": "system", "content": "s", "tools": [{"type": "function", "function": {}}]}],
     r"messages\[0\]\.tools\[0\] must be a function tool with a name"),
    ([{"role": "user", "content": "q", "task": "dance"}], r"task 'dance'"),
    ([{"role": "assistant", "content": "q", "task": "action"}], r"task 'action'"),
]


@pytest.mark.parametrize(("messages", "match"), BAD)
def test_bad_messages_raise_a_named_value_error(messages, match):
    with pytest.raises(ValueError, match=match):
        encode_messages(messages, thinking_mode="thinking")


def test_bad_options_raise():
    with pytest.raises(ValueError, match="thinking_mode 'think'"):
        encode_messages([U], thinking_mode="think")
    with pytest.raises(ValueError, match="reasoning_effort 'extreme'"):
        encode_messages([U], thinking_mode="thinking", reasoning_effort="extreme")
    with pytest.raises(ValueError, match=r"^tools must be a list"):
        encode_messages([U], tools={"type": "function"})
    with pytest.raises(ValueError, match="thinking_mode 'x'"):
        parse_completion("hi", thinking_mode="x")


def test_text_parts_are_joined():
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    assert encode_messages([{"role": "user", "content": parts}]) == f"{BOS}{USER}Hello{ASSISTANT}</think>"


# ---- parsing ---------------------------------------------------------------------------------------------------
def test_parse_thinking_without_end_is_all_reasoning():
    p = parse_completion("still thinking about", thinking_mode="thinking")
    assert (p.reasoning_content, p.content, p.tool_calls) == ("still thinking about", "", [])


def test_parse_strips_eos_and_what_follows():
    p = parse_completion(f"Hello.{EOS}junk", thinking_mode="chat")
    assert (p.reasoning_content, p.content, p.tool_calls) == (None, "Hello.", [])
    p = parse_completion(f"<think>r</think>c{EOS}", thinking_mode="thinking")
    assert (p.reasoning_content, p.content) == ("r", "c")


def test_parse_json_and_string_parameters():
    args = {"n": 3, "s": "3", "flag": True, "xs": [1, "a"], "obj": {"k": None}, "text": "line1\nline2"}
    call = {"type": "function", "function": {"name": "f", "arguments": json.dumps(args)}}
    turn = encode_messages([U, {"role": "assistant", "content": "Let me check.", "tool_calls": [call, call]}],
                           thinking_mode="chat")
    completion = turn[turn.rindex("</think>") + len("</think>"):]
    p = parse_completion(completion, thinking_mode="chat")
    assert p.content == "Let me check."
    assert len(p.tool_calls) == 2 and p.tool_calls[0]["id"] != p.tool_calls[1]["id"]
    assert json.loads(p.tool_calls[0]["function"]["arguments"]) == args
    assert 'string="false">3<' in completion and 'string="true">3<' in completion


@pytest.mark.parametrize("block", [
    f'<{DSML}tool_calls>\n<{DSML}invoke name="f">\n',  # cut off
    f'<{DSML}tool_calls>\n<{DSML}invoke name="f">\n<{DSML}parameter name="x" string="false">{{bad</{DSML}parameter>\n'
    f"</{DSML}invoke>\n</{DSML}tool_calls>",  # not JSON
    f"<{DSML}tool_calls>\nfree text\n</{DSML}tool_calls>",  # no invoke
    f'<{DSML}tool_calls>\n<{DSML}invoke name="f">\nstray\n</{DSML}invoke>\n</{DSML}tool_calls>',  # not a parameter
])
def test_malformed_tool_calls_stay_in_content(block):
    p = parse_completion("Answer.\n\n" + block + EOS, thinking_mode="chat")
    assert p.tool_calls == [] and p.content == "Answer.\n\n" + block


# ---- special tokens and the tiny tokenizer ---------------------------------------------------------------------
def test_special_token_spellings():
    assert len(SPECIAL_TOKENS) == len(set(SPECIAL_TOKENS)) == 15
    assert BOS == "<\uff5cbegin\u2581of\u2581sentence\uff5c>" and EOS == "<\uff5cend\u2581of\u2581sentence\uff5c>"
    assert {"<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>", "<\uff5clatest_reminder\uff5c>", "<think>", "</think>",
            "\uff5cDSML\uff5c", "<\uff5caction\uff5c>", "<\uff5cread_url\uff5c>"} <= set(SPECIAL_TOKENS)


def test_missing_special_tokens():
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS) if t not in ("<think>", EOS)}
    assert missing_special_tokens(vocab.get) == [EOS, "<think>"]
    assert missing_special_tokens({t: 0 for t in SPECIAL_TOKENS}.get) == []


def test_tiny_tokenizer_has_every_chat_token_as_one_id():
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(TINY / "tokenizer.json")
    assert tok.vocab_size == 1024 and tok.bos_token_id == 0 and tok.eos_token_id == 1
    assert missing_special_tokens(tok.token_to_id) == []
    for n in (1, 3, 4):
        messages, prompt = case(n)
        ids = tok.encode(prompt, add_special_tokens=False)  # the prompt carries its own BOS
        assert ids[0] == 0 and ids.count(0) == 1
        assert tok.decode(ids, skip_special_tokens=False) == prompt
        for t in SPECIAL_TOKENS:
            assert ids.count(tok.token_to_id(t)) == len(prompt.split(t)) - 1, t
    # default decode (what returned text uses) drops the turn tokens but keeps <think>, </think> and DSML markers
    text = f"<think>r</think>x\n\n<{DSML}tool_calls>\n"
    assert tok.decode(tok.encode(text + EOS, add_special_tokens=False)) == text
    assert tok.decode(tok.encode(f"{USER}hi{ASSISTANT}", add_special_tokens=False)) == "hi"


def test_encode_chat_adds_no_second_bos_and_refuses_a_tokenizer_without_chat_tokens():
    from engine.chat_encoding import ChatTokenizerError, encode_chat
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(TINY / "tokenizer.json")
    _, prompt = case(4)
    ids = encode_chat(tok, prompt)
    assert ids == tok.encode(prompt, add_special_tokens=False) and ids.count(tok.bos_token_id) == 1

    class NoChatTokens:
        def token_to_id(self, t: str) -> int | None:
            return None if t in (USER, ASSISTANT) else 5

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            raise AssertionError("must not be called")

    with pytest.raises(ChatTokenizerError, match="lacks DeepSeek-V4's chat special tokens"):
        encode_chat(NoChatTokens(), prompt)
    with pytest.raises(ChatTokenizerError):
        encode_chat(object(), prompt)  # no token_to_id at all


def test_parse_completion_without_tools_keeps_a_dsml_block_as_text():
    block = (f"<{DSML}tool_calls>\n<{DSML}invoke name=\"f\">\n<{DSML}parameter name=\"x\" string=\"true\">1"
             f"</{DSML}parameter>\n</{DSML}invoke>\n</{DSML}tool_calls>")
    assert parse_completion("Hi.\n\n" + block, thinking_mode="chat").tool_calls
    p = parse_completion("Hi.\n\n" + block + EOS, thinking_mode="chat", tools=False)
    assert p.tool_calls == [] and p.content == "Hi.\n\n" + block
