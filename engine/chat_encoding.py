"""DeepSeek-V4 chat encoding: OpenAI-style messages -> prompt string, and a generated assistant turn -> message.

DeepSeek-V4 ships no Jinja chat template. This module implements its prompt format from the rules, checked
byte-exact against the golden cases in `tests/data/dsv4_chat_cases/` (see its README for their origin).

Layout (no newline between parts unless written here):
* `BOS`, then (thinking mode, `reasoning_effort="max"`) the fixed `REASONING_EFFORT_MAX` paragraph, then the
  messages in order:
  - `system`: its text as is (no role token), plus the tools block when it has `tools`;
  - `latest_reminder`: `<｜latest_reminder｜>{text}`;
  - `user` / `developer`: `<｜User｜>{text}` (+ the tools block for `developer` with `tools`);
  - `tool`: a run of tool messages after an assistant turn with `tool_calls` opens one user turn
    `<｜User｜><tool_result>{content}</tool_result>...`, results ordered as the calls were (by `tool_call_id` when
    every result has one); a `user`/`developer` message right after the run joins that same user turn;
  - `assistant`: `<｜Assistant｜>` + `<think>{reasoning_content}</think>` (thinking mode) or `</think>` (chat mode,
    or a turn whose reasoning is dropped), then `{content}`, then for `tool_calls` `\\n\\n` + a DSML block (below),
    then `EOS`.
* Tools block (`tools` on a system/developer message): `\\n\\n` (omitted when the text is empty) + `TOOLS_HEADER` +
  one `json.dumps(function)` line per tool + `TOOLS_FOOTER`.
* DSML block: `<｜DSML｜tool_calls>\\n`, per call `<｜DSML｜invoke name="NAME">\\n`, per argument
  `<｜DSML｜parameter name="K" string="true">V</｜DSML｜parameter>\\n` (string values as is; anything else as JSON
  with `string="false"`), `</｜DSML｜invoke>\\n`, and `</｜DSML｜tool_calls>`.
* `drop_thinking` (thinking mode): assistant turns before the last user/developer message lose their reasoning
  (rendered `</think>{content}`), unless any system/developer message defines tools (then all reasoning is kept).
* Quick instructions: a user/developer message with `task` (one of `TASKS`) makes the assistant turn answering it
  start `<｜Assistant｜></think><｜{task}｜>`; these turns never think, in either mode.
* Generation prompt (when the last message is not an assistant turn): `<｜Assistant｜><think>` (thinking) or
  `<｜Assistant｜></think>` (chat), or the quick-instruction prefix. After an assistant turn nothing is added.

Rules decided here (not fixed by the golden cases): request-level `tools` go to the first system message; without
one, an empty system message is inserted first (the rules put tools only on system/developer messages, and a
system message adds no role token, so this adds exactly the tools block after BOS). `reasoning_effort` other than
"max" ("low", "medium", "high" or None) adds nothing, and "max" adds nothing in chat mode (the paragraph is
thinking-mode only). Chat mode never renders `reasoning_content`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
TASKS = ("action", "title", "query", "authority", "domain", "extracted_url", "read_url")
SPECIAL_TOKENS: list[str] = [BOS, EOS, USER, ASSISTANT, LATEST_REMINDER, THINK_START, THINK_END, DSML,
                             *(f"<｜{t}｜>" for t in TASKS)]
ROLES = ("system", "user", "assistant", "tool", "latest_reminder", "developer")
THINKING_MODES = ("chat", "thinking")
REASONING_EFFORTS = (None, "low", "medium", "high", "max")

REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
TOOLS_HEADER = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    f'"<{DSML}tool_calls>" block like the following:\n\n'
    f"<{DSML}tool_calls>\n"
    f'<{DSML}invoke name="$TOOL_NAME">\n'
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>\n'
    f"...\n</{DSML}invoke>\n"
    f'<{DSML}invoke name="$TOOL_NAME2">\n'
    f"...\n</{DSML}invoke>\n"
    f"</{DSML}tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, '
    'arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
TOOLS_FOOTER = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
TOOL_CALLS_OPEN, TOOL_CALLS_CLOSE = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"


# ---- validation ------------------------------------------------------------------------------------------------
def _text(value: object, where: str, *, optional: bool = False) -> str:
    """A message's text: a string or a list of OpenAI text parts (joined)."""
    if value is None and optional:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError(f"{where}[{j}]: only text content parts ({{'type': 'text', 'text': ...}}) are "
                                 "supported")
            parts.append(part["text"])
        return "".join(parts)
    what = "missing" if value is None else f"a {type(value).__name__}"
    raise ValueError(f"{where} must be a string or a list of text parts, got {what}")


def _tool_schemas(tools: object, where: str) -> list[dict]:
    """The function schemas of an OpenAI `tools` list ({"type": "function", "function": {...}} or bare functions)."""
    if not isinstance(tools, list):
        raise ValueError(f"{where} must be a list of tools, got a {type(tools).__name__}")
    out = []
    for j, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]):
            raise ValueError(f"{where}[{j}] must be a function tool with a name")
        out.append(fn)
    return out


def _arguments(call: object, where: str) -> tuple[str, dict]:
    """(name, arguments dict) of one OpenAI tool call; `arguments` is a JSON object string (or already a dict)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]):
        raise ValueError(f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}.function.arguments is not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON object")
    return fn["name"], args


def _check(messages: object) -> list[dict]:
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list, got a {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object, got a {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role {role!r} is not one of {', '.join(ROLES)}")
        if m.get("tools") is not None and role not in ("system", "developer"):
            raise ValueError(f"messages[{i}]: only system and developer messages can carry tools, not {role}")
        task = m.get("task")
        if task is not None and (role not in ("user", "developer") or task not in TASKS):
            raise ValueError(f"messages[{i}].task {task!r}: a user/developer task must be one of {', '.join(TASKS)}")
        if role == "assistant":
            _text(m.get("content"), f"messages[{i}].content", optional=True)
            if not isinstance(m.get("reasoning_content", ""), (str, type(None))):
                raise ValueError(f"messages[{i}].reasoning_content must be a string")
            if not isinstance(m.get("tool_calls", []), (list, type(None))):
                raise ValueError(f"messages[{i}].tool_calls must be a list")
        else:
            _text(m.get("content"), f"messages[{i}].content")
    return messages


def _with_request_tools(messages: list[dict], tools: object) -> list[dict]:
    _tool_schemas(tools, "tools")
    if not tools:
        return messages
    for i, m in enumerate(messages):
        if m.get("tools"):
            raise ValueError(f"tools given both on the request and on messages[{i}]")
    i = next((i for i, m in enumerate(messages) if m["role"] == "system"), None)
    if i is None:
        return [{"role": "system", "content": "", "tools": tools}, *messages]
    return [*messages[:i], {**messages[i], "tools": tools}, *messages[i + 1:]]


# ---- encoding --------------------------------------------------------------------------------------------------
def _tools_block(text: str, tools: object, where: str) -> str:
    if not tools:
        return text
    schemas = "\n".join(json.dumps(fn, ensure_ascii=False) for fn in _tool_schemas(tools, where))
    return text + ("\n\n" if text else "") + TOOLS_HEADER + schemas + TOOLS_FOOTER


def _dsml_block(calls: list, where: str) -> str:
    lines = [TOOL_CALLS_OPEN]
    for j, call in enumerate(calls):
        name, args = _arguments(call, f"{where}[{j}]")
        lines.append(f'<{DSML}invoke name="{name}">')
        for key, value in args.items():
            is_str = isinstance(value, str)
            shown = value if is_str else json.dumps(value, ensure_ascii=False)
            lines.append(f'<{DSML}parameter name="{key}" string="{"true" if is_str else "false"}">{shown}'
                         f"</{DSML}parameter>")
        lines.append(f"</{DSML}invoke>")
    return "\n".join(lines) + "\n" + TOOL_CALLS_CLOSE


def _ordered_results(messages: list[dict], start: int) -> tuple[list[str], int]:
    """The contents of the tool messages from `start` on, in the order of the preceding assistant's calls."""
    end = start
    while end < len(messages) and messages[end]["role"] == "tool":
        end += 1
    prev = messages[start - 1] if start > 0 else None
    calls = (prev.get("tool_calls") or []) if prev and prev["role"] == "assistant" else []
    if not calls:
        raise ValueError(f"messages[{start}] is a tool message without a preceding assistant message with tool_calls")
    if end - start > len(calls):
        raise ValueError(f"messages[{start}:{end}]: {end - start} tool results for {len(calls)} tool calls")
    call_ids = [c.get("id") if isinstance(c, dict) else None for c in calls]
    results = messages[start:end]
    ids = [m.get("tool_call_id") for m in results]
    for k, tid in enumerate(ids):
        if tid is not None and tid not in call_ids:
            raise ValueError(f"messages[{start + k}].tool_call_id {tid!r} matches no call of messages[{start - 1}]")
        if tid is not None and ids.count(tid) > 1:
            raise ValueError(f"messages[{start + k}].tool_call_id {tid!r}: more than one result for that call")
    if all(tid is not None for tid in ids):
        results = sorted(results, key=lambda m: call_ids.index(m["tool_call_id"]))
    return [_text(m["content"], "tool content") for m in results], end


def encode_messages(messages: list[dict], *, thinking_mode: str = "chat", drop_thinking: bool = True,
                    reasoning_effort: str | None = None, add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
    """The DeepSeek-V4 prompt string of an OpenAI-style message list (layout in the module docstring).

    Raises ValueError naming the problem for ill-shaped input (a server answers those with HTTP 400)."""
    if thinking_mode not in THINKING_MODES:
        raise ValueError(f"thinking_mode {thinking_mode!r} is not one of {', '.join(THINKING_MODES)}")
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort {reasoning_effort!r} is not one of {REASONING_EFFORTS}")
    messages = _check(messages)
    if tools is not None:
        messages = _with_request_tools(messages, tools)
    thinking = thinking_mode == "thinking"
    keep_all = not drop_thinking or any(m.get("tools") for m in messages)
    last_user = max((i for i, m in enumerate(messages) if m["role"] in ("user", "developer")), default=-1)

    out = [BOS, REASONING_EFFORT_MAX if thinking and reasoning_effort == "max" else ""]
    task = None  # quick-instruction task of the user turn the next assistant turn answers
    i = 0
    while i < len(messages):
        m, role, where = messages[i], messages[i]["role"], f"messages[{i}]"
        if role == "system":
            out.append(_tools_block(_text(m["content"], where), m.get("tools"), f"{where}.tools"))
        elif role == "latest_reminder":
            out.append(LATEST_REMINDER + _text(m["content"], where))
        elif role in ("user", "developer", "tool"):
            out.append(USER)
            if role == "tool":
                results, i = _ordered_results(messages, i)
                out.extend(f"<tool_result>{r}</tool_result>" for r in results)
                if i == len(messages) or messages[i]["role"] not in ("user", "developer"):
                    task = None
                    continue
                m, where = messages[i], f"messages[{i}]"
            out.append(_tools_block(_text(m["content"], where), m.get("tools"), f"{where}.tools"))
            task = m.get("task")
        else:  # assistant
            reasoning = m.get("reasoning_content") or ""
            if task is not None:
                out.append(f"{ASSISTANT}{THINK_END}<｜{task}｜>")
            elif thinking and (keep_all or i > last_user):
                out.append(f"{ASSISTANT}{THINK_START}{reasoning}{THINK_END}")
            else:
                out.append(ASSISTANT + THINK_END)
            out.append(_text(m.get("content"), f"{where}.content", optional=True))
            if m.get("tool_calls"):
                out.append("\n\n" + _dsml_block(m["tool_calls"], f"{where}.tool_calls"))
            out.append(EOS)
            task = None
        i += 1
    if add_generation_prompt and messages[-1]["role"] != "assistant":
        if task is not None:
            out.append(f"{ASSISTANT}{THINK_END}<｜{task}｜>")
        else:
            out.append(ASSISTANT + (THINK_START if thinking else THINK_END))
    return "".join(out)


# ---- parsing ---------------------------------------------------------------------------------------------------
@dataclass
class ParsedCompletion:
    reasoning_content: str | None
    content: str
    tool_calls: list[dict] = field(default_factory=list)


_INVOKE = re.compile(rf'\s*<{DSML}invoke name="([^"]*)">(.*?)</{DSML}invoke>', re.S)
_PARAM = re.compile(rf'\s*<{DSML}parameter name="([^"]*)" string="(true|false)">(.*?)</{DSML}parameter>', re.S)


def _parse_block(block: str) -> list[dict] | None:
    """The tool calls of the inside of a `tool_calls` block, or None when it is malformed."""
    calls, pos = [], 0
    while (inv := _INVOKE.match(block, pos)) is not None:
        args, body, ppos = {}, inv.group(2), 0
        while (par := _PARAM.match(body, ppos)) is not None:
            key, is_str, value = par.groups()
            try:
                args[key] = value if is_str == "true" else json.loads(value)
            except json.JSONDecodeError:
                return None
            ppos = par.end()
        if body[ppos:].strip():
            return None
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": inv.group(1), "arguments": json.dumps(args, ensure_ascii=False)}})
        pos = inv.end()
    return calls if calls and not block[pos:].strip() else None


def parse_completion(text: str, *, thinking_mode: str, tools: bool = True) -> ParsedCompletion:
    """A generated assistant turn (the text after the generation prompt) as reasoning, content and tool calls.

    Thinking mode: text up to `</think>` is the reasoning (all of it when `</think>` never came, e.g. a length
    cut). Text from the first EOS on is dropped. A well-formed DSML `tool_calls` block at the end becomes
    `tool_calls` (new ids); a malformed one is left in `content`, as text (as is any block with `tools=False`)."""
    if thinking_mode not in THINKING_MODES:
        raise ValueError(f"thinking_mode {thinking_mode!r} is not one of {', '.join(THINKING_MODES)}")
    text = text.split(EOS, 1)[0]
    reasoning = None
    if thinking_mode == "thinking":
        text = text.removeprefix(THINK_START)
        reasoning, closed, text = text.partition(THINK_END)
        if not closed:
            return ParsedCompletion(reasoning, "")
    start = text.find(TOOL_CALLS_OPEN) if tools else -1
    end = text.rfind(TOOL_CALLS_CLOSE)
    if start >= 0 and end > start and not text[end + len(TOOL_CALLS_CLOSE):].strip():
        calls = _parse_block(text[start + len(TOOL_CALLS_OPEN):end])
        if calls is not None:
            return ParsedCompletion(reasoning, text[:start].removesuffix("\n\n"), calls)
    return ParsedCompletion(reasoning, text)


def missing_special_tokens(token_to_id: Callable[[str], int | None]) -> list[str]:
    """The entries of `SPECIAL_TOKENS` a tokenizer has no single id for (e.g. `tokenizers.Tokenizer.token_to_id`)."""
    return [t for t in SPECIAL_TOKENS if token_to_id(t) is None]


class ChatTokenizerError(ValueError):
    """The model's tokenizer cannot encode DeepSeek-V4 chat prompts (it has no single id for some special token)."""


def encode_chat(tokenizer: object, prompt: str) -> list[int]:
    """Token ids of a prompt string from `encode_messages` (it starts with BOS already: no special tokens added).

    `tokenizer`: `encode(text, add_special_tokens=...)` and `token_to_id(token)` (engine.tokenizer.Tokenizer).
    Raises ChatTokenizerError when a special token of the format is not one token of this vocabulary (the text
    would be encoded as ordinary characters the model was never trained to read as structure)."""
    token_to_id = getattr(tokenizer, "token_to_id", None)
    missing = SPECIAL_TOKENS if token_to_id is None else missing_special_tokens(token_to_id)
    if missing:
        raise ChatTokenizerError(f"this model's tokenizer lacks DeepSeek-V4's chat special tokens "
                                 f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}): chat prompts "
                                 "cannot be encoded; send raw prompts (/v1/completions, --prompt) instead")
    return tokenizer.encode(prompt, add_special_tokens=False)  # type: ignore[attr-defined]
