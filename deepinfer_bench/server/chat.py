"""`/v1/chat/completions` on DeepSeek-V4's own chat encoding (engine/chat_encoding.py): a request's messages -> the
prompt, and a generated assistant turn -> `reasoning_content` / `content` / `tool_calls`, whole or as it streams.

Thinking mode is chosen by `chat_template_kwargs` (`{"thinking": true}`, or `{"thinking_mode": "thinking"}`, the
spelling of DeepSeek's encoder), as vLLM's DeepSeek recipes send it; `drop_thinking` there too; `reasoning_effort`
goes to the encoder (only "max" changes the prompt, in thinking mode). Tool calls are parsed when the request has
`tools` and `tool_choice` is not "none".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer_bench.server.protocol import APIError, ChatCompletionRequest
from engine.chat_encoding import (
    THINK_END,
    THINK_START,
    TOOL_CALLS_OPEN,
    ParsedCompletion,
    encode_messages,
    parse_completion,
)


@dataclass(frozen=True)
class ChatPrompt:
    text: str  # the rendered prompt
    thinking: bool  # the generated turn starts inside <think> (thinking mode, and no quick-instruction task)
    tools: bool  # parse DSML tool calls out of the generated turn


def _template_kwargs(req: ChatCompletionRequest) -> tuple[str, bool]:
    kw = req.chat_template_kwargs or {}
    mode = kw.get("thinking_mode")
    if "thinking" in kw:
        if not isinstance(kw["thinking"], bool):
            raise APIError(400, "chat_template_kwargs.thinking must be true or false.", param="chat_template_kwargs")
        if mode is not None and mode != ("thinking" if kw["thinking"] else "chat"):
            raise APIError(400, "chat_template_kwargs.thinking and .thinking_mode disagree.",
                           param="chat_template_kwargs")
        mode = "thinking" if kw["thinking"] else "chat"
    drop = kw.get("drop_thinking", True)
    if not isinstance(drop, bool):
        raise APIError(400, "chat_template_kwargs.drop_thinking must be true or false.", param="chat_template_kwargs")
    return mode or "chat", drop


def render(req: ChatCompletionRequest) -> ChatPrompt:
    """The prompt of a chat request; a malformed message list (wrong shape, unknown role, ...) is a 400."""
    mode, drop = _template_kwargs(req)
    try:
        text = encode_messages(req.messages, thinking_mode=mode, drop_thinking=drop,
                               reasoning_effort=req.reasoning_effort, tools=req.tools)
    except ValueError as e:
        msg = str(e)
        param = next((p for p in ("thinking_mode", "reasoning_effort", "tools") if msg.startswith(p)), "messages")
        raise APIError(400, msg, param="chat_template_kwargs" if param == "thinking_mode" else param) from None
    return ChatPrompt(text, text.endswith(THINK_START), bool(req.tools) and req.tool_choice != "none")


def parse(prompt: ChatPrompt, text: str) -> ParsedCompletion:
    return parse_completion(text, thinking_mode="thinking" if prompt.thinking else "chat", tools=prompt.tools)


def message(parsed: ParsedCompletion) -> dict[str, Any]:
    """The response `message` of a parsed assistant turn."""
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.content,
                           "reasoning_content": parsed.reasoning_content}
    if parsed.tool_calls:
        msg["tool_calls"] = parsed.tool_calls
        msg["content"] = parsed.content or None
    return msg


def _held(text: str, *markers: str) -> int:
    """Length of the longest end of `text` that could still grow into one of `markers`."""
    for n in range(min(len(text), max(map(len, markers))), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


class ChatStream:
    """One choice's generated text, as it streams, split into `reasoning_content` and `content` deltas.

    Text that could still become `</think>` or the start of a tool-calls block is held back; a tool-calls block is
    held to the end, where `finish()` parses the whole turn (the same `parse` as a non-streamed reply) and releases
    what is left, so the deltas always add up to the non-streamed message."""

    def __init__(self, prompt: ChatPrompt) -> None:
        self.prompt = prompt
        self.text = ""  # everything generated
        self.sent = {"reasoning_content": "", "content": ""}
        self._in_reasoning = prompt.thinking

    def _release(self, field: str, upto: str) -> dict[str, str]:
        new = upto[len(self.sent[field]):]
        if not new:
            return {}
        self.sent[field] = upto
        return {field: new}

    def push(self, delta: str) -> dict[str, str]:
        """The deltas this text releases ({} while held back)."""
        self.text += delta
        out: dict[str, str] = {}
        text = self.text
        if self._in_reasoning:
            body = "" if THINK_START.startswith(text) else text.removeprefix(THINK_START)
            if THINK_END not in body:
                return self._release("reasoning_content", body[:len(body) - _held(body, THINK_END)])
            reasoning, _, text = body.partition(THINK_END)
            out.update(self._release("reasoning_content", reasoning))
            self._in_reasoning = False
        else:
            text = text.partition(THINK_END)[2] if self.prompt.thinking else text
        if self.prompt.tools:
            start = text.find(TOOL_CALLS_OPEN)
            if start >= 0:
                text = text[:start].removesuffix("\n\n")
            else:
                text = text[:len(text) - _held(text, "\n\n" + TOOL_CALLS_OPEN, TOOL_CALLS_OPEN)]
        out.update(self._release("content", text))
        return out

    def finish(self) -> tuple[dict[str, str], list[dict]]:
        """The last deltas and the tool calls, from the parse of the whole turn."""
        parsed = parse(self.prompt, self.text)
        out: dict[str, str] = {}
        for field, value in (("reasoning_content", parsed.reasoning_content or ""), ("content", parsed.content)):
            if not value.startswith(self.sent[field]):  # cannot happen; say so rather than send wrong text
                raise RuntimeError(f"streamed {field} {self.sent[field]!r} is not a prefix of {value!r}")
            out.update(self._release(field, value))
        return out, parsed.tool_calls
