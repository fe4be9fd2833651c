"""The OpenAI `/v1/completions` request surface this server accepts, and OpenAI-style errors.

What is accepted follows vLLM's `CompletionRequest`: unknown or legacy fields (`best_of`, `user`,
`repetition_penalty=1.0`, ...) are accepted and ignored, because benchmark clients send them; values that would
change the result but are not implemented (`n>1`, `echo`, `logprobs`, penalties, `logit_bias`, ...) are a 400.
"""

from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False


class CompletionRequest(BaseModel):
    """Fields we read; everything else is allowed and ignored (`extra="allow"`, like vLLM)."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    prompt: Prompt
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
    echo: StrictBool | None = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    suffix: StrictStr | None = None
    add_special_tokens: StrictBool = True
    return_token_ids: StrictBool = False  # vLLM extension: generated token ids in each choice
    request_id: StrictStr | None = Field(default=None)


# field -> (neutral values, why it is refused otherwise)
_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "n": ((None, 1), "only n=1 is supported"),
    "best_of": ((None, 1), "only best_of=1 is supported"),
    "echo": ((None, False), "echo is not supported"),
    "logprobs": ((None,), "logprobs are not supported"),
    "repetition_penalty": ((None, 1.0), "only repetition_penalty=1.0 is supported"),
    "presence_penalty": ((None, 0.0), "only presence_penalty=0 is supported"),
    "frequency_penalty": ((None, 0.0), "only frequency_penalty=0 is supported"),
    "min_p": ((None, 0.0), "only min_p=0 is supported"),
    "suffix": ((None, ""), "suffix is not supported"),
}


def _loc(err: dict[str, Any]) -> str:
    return ".".join(str(p) for p in err.get("loc", ()) if not str(p).startswith(("list[", "str", "int")))


def parse_completion_request(payload: Any) -> CompletionRequest:
    """Validate a decoded JSON body; every problem becomes an `APIError(400)` naming the field."""
    if not isinstance(payload, dict):
        raise APIError(400, "The request body must be a JSON object.")
    try:
        req = CompletionRequest.model_validate(payload)
    except ValidationError as e:
        first = e.errors()[0]
        param = _loc(first) or None
        raise APIError(400, f"Invalid value for '{param}': {first.get('msg')}", param=param) from None
    for name, (ok, why) in _NEUTRAL.items():
        if getattr(req, name) not in ok:
            raise APIError(400, f"{why} (got {name}={getattr(req, name)!r}).", param=name)
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported.", param="logit_bias")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "Stream options can only be defined when `stream=True`.", param="stream_options")
    if req.max_tokens is not None and req.max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {req.max_tokens}.", param="max_tokens")
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
