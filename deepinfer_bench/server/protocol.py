"""The OpenAI request surface this server accepts (`/v1/completions`, `/v1/chat/completions`), OpenAI-style errors,
and the logprobs layouts of both endpoints.

What is accepted follows vLLM's `CompletionRequest` / `ChatCompletionRequest`: unknown or legacy fields (`user`,
`repetition_penalty=1.0`, ...) are accepted and ignored, because benchmark clients send them; values that would
change the result but are not implemented (penalties, `logit_bias`, `suffix`, `allowed_token_ids`, `bad_words`, ...)
are a 400. Every list or map a request carries has a maximum (`RequestLimits`); one more is a 400 naming the field
and the limit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

if TYPE_CHECKING:
    from engine.sampler import TokenLogprobs

Prompt = Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]


class APIError(Exception):
    """An error reply `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "BadRequestError",
             500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "Error"), "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """The most each list / map field of a request may hold (one over: a 400 naming the field and the limit).

    What others allow, and why these numbers (OpenAI: the API reference, its Python SDK's field docs; vLLM: its
    OpenAI server's request models and `VLLM_MAX_*` settings, 2026 main):

    | field | here | OpenAI | vLLM |
    |---|---|---|---|
    | `stop` strings | 16 | 4 | 4 (`VLLM_MAX_STOP_STRINGS`; unbounded before 2026) |
    | characters of one stop string | 128 | not documented | unbounded |
    | `stop_token_ids` | 256 | (no such field) | unbounded |
    | `prompt` as a list of prompts | 256 | not documented | 1024 (`VLLM_MAX_COMPLETION_PROMPTS`) |
    | sequences: prompts x max(`n`, `best_of`) | 256 | not documented | `n` <= 16384 (`VLLM_MAX_N_SEQUENCES`) |
    | `messages` | 2048 | not documented in the SDK | unbounded |
    | `tools` (and a message's `tools`) | 128 | 128 functions (API reference) | unbounded |
    | `tool_calls` of one message | 128 | not documented | unbounded |
    | `logprobs` / `top_logprobs` / `prompt_logprobs` | 20 | 5 / 20 / - | 20 (`max_logprobs`) |
    | `logit_bias` entries | 0 (not supported) | values in [-100, 100] | ids checked against the vocabulary |
    | `allowed_token_ids`, `bad_words` | 0 (not supported) | (no such fields) | bad_words <= 128 |
    | `/detokenize` `tokens` | max_model_len | - | unbounded |

    Why: 16 stop strings (not 4) because lm-eval's `local-completions` sends a task's whole `until` list (its OpenAI
    chat backend cuts it to 4). Stop strings are checked on the engine thread after every generated token, at a cost
    that grows with their total length (engine/detokenizer.py holds back text that could start one; measured on a
    shared 2-core EPYC: 16 x 128 characters cost ~0.4 ms per generated token of that request, one 10,000-character
    string 6.5 ms). Stop token ids are scanned per token too; a longer list is a logits mask's job. 256 sequences =
    8x the serving batch (32 slots): more only queue, each holding its prompt in memory. 2048 messages / 128 tools /
    128 tool calls bound the chat rendering (matching a tool result to its call is quadratic in the number of calls).
    The whole body is bounded too (`ServerConfig.max_body_bytes`, 16 MiB: 413).
    """

    stop: int = 16
    stop_chars: int = 128
    stop_token_ids: int = 256
    prompts: int = 256
    sequences: int = 256
    messages: int = 2048
    tools: int = 128
    tool_calls: int = 128
    logprobs: int = 20

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"RequestLimits.{f.name} must be >= 1, got {getattr(self, f.name)}")


def too_many(param: str, limit: int, got: int) -> APIError:
    """A list over its maximum length, worded as OpenAI words it."""
    return APIError(400, f"Invalid '{param}': array too long. Expected an array with maximum length {limit}, but got "
                         f"an array with length {got} instead.", param=param, code="array_above_max_length")


def check_length(value: Any, param: str, limit: int) -> None:
    if isinstance(value, (list, dict)) and len(value) > limit:
        raise too_many(param, limit, len(value))


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False


class _Request(BaseModel):
    """Fields both endpoints read; everything else is allowed and ignored (`extra="allow"`, like vLLM)."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    min_tokens: StrictInt | None = None  # stop token ids / EOS / stop strings count only after this many tokens
    ignore_eos: StrictBool = False
    n: StrictInt | None = 1
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    # Accepted only at their neutral values.
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[StrictInt] | None = None  # vLLM extensions, not implemented: refused unless empty
    bad_words: list[StrictStr] | None = None
    return_token_ids: StrictBool = False  # vLLM extension: generated token ids in each choice
    return_tokens_as_token_ids: StrictBool = False  # vLLM extension: logprob tokens as "token_id:ID"
    request_id: StrictStr | None = Field(default=None)


class CompletionRequest(_Request):
    prompt: Prompt
    echo: StrictBool | None = False
    logprobs: StrictInt | None = None  # top-k logprobs of each token (vLLM: the chosen token's + k more)
    prompt_logprobs: StrictInt | None = None  # vLLM extension: vLLM's own layout, in each choice
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None
    add_special_tokens: StrictBool = True


class ChatCompletionRequest(_Request):
    messages: list[dict[str, Any]]
    max_completion_tokens: StrictInt | None = None  # OpenAI's newer name of max_tokens
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    # DeepSeek-V4's encoding options: {"thinking": bool} (or "thinking_mode": "chat" | "thinking"), "drop_thinking"
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: StrictStr | None = None


# field -> (neutral values, why it is refused otherwise)
_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "repetition_penalty": ((None, 1.0), "only repetition_penalty=1.0 is supported"),
    "presence_penalty": ((None, 0.0), "only presence_penalty=0 is supported"),
    "frequency_penalty": ((None, 0.0), "only frequency_penalty=0 is supported"),
    "min_p": ((None, 0.0), "only min_p=0 is supported"),
    "suffix": ((None, ""), "suffix is not supported"),
}


def _loc(err: dict[str, Any]) -> str:
    return ".".join(str(p) for p in err.get("loc", ()) if not str(p).startswith(("list[", "str", "int", "dict[")))


def _validate(cls: type[_Request], payload: Any, limits: RequestLimits) -> Any:
    if not isinstance(payload, dict):
        raise APIError(400, "The request body must be a JSON object.")
    for name, limit in (("stop", limits.stop), ("stop_token_ids", limits.stop_token_ids),
                        ("messages", limits.messages), ("tools", limits.tools)):
        check_length(payload.get(name), name, limit)  # before parsing: a long list is refused before it is read
    try:
        req = cls.model_validate(payload)
    except ValidationError as e:
        first = e.errors()[0]
        param = _loc(first) or None
        raise APIError(400, f"Invalid value for '{param}': {first.get('msg')}", param=param) from None
    for name, (ok, why) in _NEUTRAL.items():
        if getattr(req, name, None) not in ok:
            raise APIError(400, f"{why} (got {name}={getattr(req, name)!r}).", param=name)
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported (only {} or null).", param="logit_bias")
    for name in ("allowed_token_ids", "bad_words"):
        if getattr(req, name):
            raise APIError(400, f"{name} is not supported (only [] or null).", param=name)
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    for i, stop in enumerate(stops):
        if len(stop) > limits.stop_chars:
            raise APIError(400, f"Invalid 'stop[{i}]': string too long. Expected a string with maximum length "
                                f"{limits.stop_chars}, but got a string with length {len(stop)} instead.",
                           param="stop", code="string_above_max_length")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "Stream options can only be defined when `stream=True`.", param="stream_options")
    if req.n is not None and req.n < 1:
        raise APIError(400, f"n must be at least 1, got {req.n}.", param="n")
    return req


def _check_logprobs(value: int | None, name: str, max_logprobs: int) -> None:
    if value is not None and not 0 <= value <= max_logprobs:
        raise APIError(400, f"{name} must be in [0, {max_logprobs}] (the server's max_logprobs), got {value}.",
                       param=name)


def _check_sequences(num_prompts: int, n: int, best_of: int | None, limits: RequestLimits) -> None:
    samples = max(n, best_of or 1)
    if num_prompts * samples > limits.sequences:
        param = "best_of" if samples > n else "n"
        raise APIError(400, f"Too many sequences in one request: {num_prompts} prompt(s) x {samples} sample(s) "
                            f"(maximum {limits.sequences}).", param=param, code="too_many_sequences")


def parse_completion_request(payload: Any, limits: RequestLimits = RequestLimits()) -> CompletionRequest:
    """Validate a decoded JSON body; every problem becomes an `APIError(400)` naming the field."""
    prompt = payload.get("prompt") if isinstance(payload, dict) else None
    if isinstance(prompt, list) and not all(isinstance(p, int) for p in prompt):  # a list of prompts
        check_length(prompt, "prompt", limits.prompts)
    req: CompletionRequest = _validate(CompletionRequest, payload, limits)
    _check_logprobs(req.logprobs, "logprobs", limits.logprobs)
    _check_logprobs(req.prompt_logprobs, "prompt_logprobs", limits.logprobs)
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(400, "`prompt_logprobs` are not available when `stream=True` (use echo with logprobs).",
                       param="prompt_logprobs")
    n = req.n or 1
    if req.best_of is not None and req.best_of < n:
        raise APIError(400, f"best_of must be >= n, got best_of={req.best_of} and n={n}.", param="best_of")
    if req.best_of is not None and req.best_of > n and req.stream:
        raise APIError(400, "best_of > n cannot be streamed (only the best n of the best_of sequences are returned).",
                       param="best_of")
    if req.max_tokens is not None and req.max_tokens < (0 if req.echo else 1):
        raise APIError(400, f"max_tokens must be at least 1 (0 only with echo=true), got {req.max_tokens}.",
                       param="max_tokens")
    _check_sequences(len(normalize_prompts(req.prompt)), n, req.best_of, limits)
    return req


def parse_chat_request(payload: Any, limits: RequestLimits = RequestLimits()) -> ChatCompletionRequest:
    """Validate a decoded chat JSON body (the messages' contents are checked when they are encoded)."""
    req: ChatCompletionRequest = _validate(ChatCompletionRequest, payload, limits)
    for i, m in enumerate(req.messages):
        check_length(m.get("tools"), f"messages[{i}].tools", limits.tools)
        check_length(m.get("tool_calls"), f"messages[{i}].tool_calls", limits.tool_calls)
    _check_sequences(1, req.n or 1, None, limits)
    _check_logprobs(req.top_logprobs, "top_logprobs", limits.logprobs)
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true.", param="top_logprobs")
    if req.max_completion_tokens is not None:
        if req.max_tokens is not None and req.max_tokens != req.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens disagree.", param="max_completion_tokens")
        req.max_tokens = req.max_completion_tokens
    if req.max_tokens is not None and req.max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {req.max_tokens}.", param="max_tokens")
    if req.tool_choice not in (None, "auto", "none"):
        raise APIError(400, f"tool_choice {req.tool_choice!r} is not supported (only 'auto' and 'none').",
                       param="tool_choice")
    return req


def normalize_prompts(prompt: Any) -> list[str | list[int]]:
    """str | list[int] | list[str] | list[list[int]] -> a non-empty list of single prompts (each non-empty)."""
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError(400, "The prompt must not be empty.", param="prompt")
    for p in prompts:
        if len(p) == 0:
            raise APIError(400, "The prompt must not be empty.", param="prompt")
    return prompts


# ---- logprobs layouts ---------------------------------------------------------------------------------------------
def _floor(lp: float) -> float:
    return max(lp, -9999.0)  # -inf is not JSON; OpenAI and vLLM send -9999.0


def _alternatives(e: TokenLogprobs) -> list[tuple[int, float]]:
    """vLLM's order: the position's own token, then the top-k (without it again)."""
    return [(e.token_id, e.logprob), *((t, lp) for t, lp in e.top if t != e.token_id)]


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None], k: int,
                        token_str: Callable[[int], str], initial_offset: int = 0) -> dict[str, Any]:
    """The legacy completions layout (vLLM `_create_completion_logprobs`): per token its text, its logprob (None
    for the first prompt token), a {text: logprob} dict of it and the k most likely tokens, and the token's offset
    (running sum of the token texts' lengths)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = initial_offset
    for tid, e in zip(token_ids, entries, strict=True):
        text = token_str(tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if e is None:
            token_logprobs.append(None)
            top.append(None)
        else:
            token_logprobs.append(_floor(e.logprob))
            top.append({token_str(t): _floor(lp) for t, lp in _alternatives(e)[:k + 1]})
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top}


def prompt_logprobs_layout(entries: Sequence[TokenLogprobs | None], k: int,
                           token_str: Callable[[int], str]) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` field: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} for the token and the top k."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        ranks = {e.token_id: e.rank, **{t: r for r, (t, _) in enumerate(e.top, 1)}}
        out.append({str(t): {"logprob": _floor(lp), "rank": ranks.get(t, e.rank), "decoded_token": token_str(t)}
                    for t, lp in _alternatives(e)[:k + 1]})
    return out


def chat_logprobs(entries: Sequence[TokenLogprobs], k: int, token_str: Callable[[int], str]) -> dict[str, Any]:
    """The chat layout: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}] * k}]}."""

    def item(t: int, lp: float) -> dict[str, Any]:
        text = token_str(t)
        return {"token": text, "logprob": _floor(lp), "bytes": list(text.encode())}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top[:k]]}
                        for e in entries]}
