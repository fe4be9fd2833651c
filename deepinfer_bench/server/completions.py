"""The generation endpoints of the server: `/v1/completions` and `/v1/chat/completions` over one engine loop.

Each prompt x sample (`n`, `best_of`) of a request is one engine request (a `Choice`); a `Run` adds them at one
step boundary and reads their `StepOutput`s as they arrive (both: deepinfer_bench/server/runs.py). The engine owns
the output text: each output carries the text it released (`text_delta`); a streamed reply sends one SSE chunk per
generated token with that text, a non-streamed one is the concatenation of the same deltas. Logprobs (`logprobs`,
`echo` with the prompt's) come from the engine, computed from the fp32 logits the sampler used (engine/llm.py);
their layouts are server/protocol.py's. Chat renders the messages with DeepSeek-V4's own encoding and parses the turn
back (server/chat.py); its first token's chunk carries `role` (no empty chunk before the first token, so a
client's TTFT is the first token's). Semantics follow vLLM's OpenAI server
(`vllm/entrypoints/openai/completion/serving.py` and the chat one).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deepinfer_bench.server import chat
from deepinfer_bench.server.protocol import (
    APIError,
    chat_logprobs,
    completion_logprobs,
    normalize_prompts,
    parse_chat_request,
    parse_completion_request,
    prompt_logprobs_layout,
)
from deepinfer_bench.server.runs import (
    Choice,
    Counters,
    Replies,
    Run,
    SSEResponse,
    collect,
    dumps,
    read_json,
    sse_event,
    token_usage,
)
from engine.chat_encoding import ChatTokenizerError, encode_chat

if TYPE_CHECKING:
    from deepinfer_bench.server.engine_client import EngineClient
    from deepinfer_bench.server.settings import ServerConfig, TextCodec


def context_error(max_len: int, prompt_len: int) -> APIError:
    return APIError(400, f"This model's maximum context length is {max_len} tokens. However, your prompt contains "
                         f"{prompt_len} input tokens, which exceeds this limit even without any output tokens. "
                         "Please reduce the length of the input prompt.", param="prompt",
                    code="context_length_exceeded")


def param_from_message(msg: str) -> str | None:
    for name in ("temperature", "top_p", "top_k", "seed", "min_tokens", "max_tokens", "stop_token_ids", "stop",
                 "ignore_eos"):
        if name in msg:
            return name
    return None


def token_id_str(tid: int) -> str:
    """vLLM's `return_tokens_as_token_ids` spelling of a token in logprobs."""
    return f"token_id:{tid}"


class Generation:
    """The generation endpoints' state: the server's config, tokenizer, engine client and counters, the replies still
    open; the request checks the other endpoints share (`check_model`, `require_alive`, `encode`, `check_ids`).

    `replies`: the open replies and whether new requests are taken (shutdown: runs.Replies)."""

    def __init__(self, config: ServerConfig, tokenizer: TextCodec | None, client: EngineClient, counters: Counters,
                 make_sampling_params: Callable[..., Any]) -> None:
        self.config, self.tokenizer, self.client = config, tokenizer, client
        self.counters, self.make_sampling_params = counters, make_sampling_params
        self.token_text: dict[int, str] = {}  # token id -> its text in logprobs
        self.replies = Replies()

    def check_model(self, name: str | None) -> None:
        cfg = self.config
        if name is not None and name not in (cfg.served_model_name, cfg.model_root, *cfg.model_aliases):
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def require_alive(self) -> None:
        self.replies.check_admitting()
        if not self.client.alive:
            raise APIError(503, f"The engine is not running ({self.client.error!r}).", code="engine_dead")

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, "This model has no tokenizer: send the prompt as token ids.", param="prompt")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_ids(self, ids: list[int], param: str) -> None:
        hi = self.config.vocab_size
        bad = [t for t in ids if t < 0 or (hi is not None and t >= hi)]
        if bad:
            raise APIError(400, f"Token id {bad[0]} is out of range [0, {hi}).", param=param)

    def token_str(self, tid: int) -> str:
        """A token's text in logprobs (vLLM: the token decoded alone); "token_id:ID" without a tokenizer."""
        if self.tokenizer is None:
            return token_id_str(tid)
        text = self.token_text.get(tid)
        if text is None:
            text = self.token_text[tid] = self.tokenizer.decode([tid], skip_special_tokens=False)
        return text

    def check_prompt(self, ids: list[int]) -> None:
        self.check_ids(ids, "prompt")
        if len(ids) >= self.config.max_model_len:
            raise context_error(self.config.max_model_len, len(ids))

    def sampling_fields(self, req: Any, prompt_len: int, max_tokens: int | None = None) -> dict[str, Any]:
        """SamplingParams fields of one prompt (`max_tokens`: instead of the request's)."""
        wanted = max_tokens or (req.max_tokens if req.max_tokens is not None else self.config.default_max_tokens)
        clamped = min(wanted, self.config.max_model_len - prompt_len)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(s == "" for s in stop):
            raise APIError(400, "Stop strings must not be empty.", param="stop")
        if stop and self.tokenizer is None:
            raise APIError(400, "Stop strings need a tokenizer and this model has none: use stop_token_ids.",
                           param="stop")
        fields: dict[str, Any] = {"max_tokens": clamped, "ignore_eos": req.ignore_eos, "stop": tuple(stop)}
        if req.min_tokens:
            if req.min_tokens > wanted:
                raise APIError(400, f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({wanted}).",
                               param="min_tokens")
            fields["min_tokens"] = min(req.min_tokens, clamped)  # max_tokens may be clamped to the context
        for name in ("temperature", "top_p", "seed", "stop_token_ids"):
            if getattr(req, name) is not None:
                fields[name] = getattr(req, name)
        if req.top_k not in (None, 0, -1):  # -1 / 0 mean "disabled" for OpenAI-style clients
            fields["top_k"] = req.top_k
        return fields

    def make_params(self, fields: dict[str, Any], sample: int) -> Any:
        """The SamplingParams of sample `sample` of a prompt: a given seed becomes seed + sample (vLLM's n)."""
        if sample and fields.get("seed") is not None:
            fields = {**fields, "seed": fields["seed"] + sample}
        try:
            return self.make_sampling_params(**fields)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param=param_from_message(str(e))) from None

    def check_max_tokens(self, max_tokens: int | None) -> None:
        if max_tokens is not None and max_tokens > self.config.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.config.max_model_len} tokens; "
                                f"max_tokens={max_tokens} exceeds it.", param="max_tokens",
                           code="context_length_exceeded")

    async def completions(self, request: Request) -> Response:
        t_arrival = time.perf_counter()
        req = parse_completion_request(await read_json(request, self.config.max_body_bytes), self.config.limits)
        self.check_model(req.model)
        self.require_alive()
        prompts = normalize_prompts(req.prompt)
        n = req.n or 1
        samples = max(n, req.best_of or 1)
        self.check_max_tokens(req.max_tokens)
        echo_only = bool(req.echo) and req.max_tokens == 0  # the prompt (and its logprobs) only, as vLLM
        fields: dict[str, Any] = {}
        if req.logprobs is not None or samples > n:  # best_of ranks by the sampled tokens' logprobs
            fields["logprobs"] = req.logprobs or 0
        if req.prompt_logprobs is not None or (req.echo and req.logprobs is not None):
            fields["prompt_logprobs"] = max(req.prompt_logprobs or 0, req.logprobs or 0)
        base_id = f"cmpl-{uuid.uuid4().hex}"
        pending: list[tuple[Choice, Any]] = []
        for p in prompts:
            ids = await asyncio.to_thread(self.encode, p, req.add_special_tokens) if isinstance(p, str) else list(p)
            self.check_prompt(ids)
            text = p if isinstance(p, str) else (self.tokenizer.decode(ids, skip_special_tokens=False)
                                                 if req.echo and self.tokenizer is not None else "")
            base = {**self.sampling_fields(req, len(ids), 1 if echo_only else None), **fields}
            for j in range(samples):
                k = len(pending)
                pending.append((Choice(k, f"{base_id}-{k}", ids, text), self.make_params(base, j)))
        run = Run(self.client, self.counters, self.replies, t_arrival)
        await run.start(pending)
        head = {"id": base_id, "object": "text_completion", "created": int(time.time()),
                "model": self.config.served_model_name}
        k_lp = req.logprobs
        tstr = token_id_str if req.return_tokens_as_token_ids else self.token_str

        def piece(ch: Choice, text: str, ids: list[int], entries: list[Any]) -> tuple[str, list[int], list[Any]]:
            """Echo: the prompt (text, ids, prompt logprobs) before what was generated; echo_only: the prompt alone."""
            if echo_only:
                text, ids, entries = "", [], []
            if req.echo:
                return ch.prompt_text + text, [*ch.prompt_ids, *ids], [*(ch.prompt_logprobs or ()), *entries]
            return text, ids, entries

        def finish(ch: Choice) -> tuple[str | None, str | int | None]:
            return ("length", None) if echo_only and ch.finish_reason != "abort" else (ch.finish_reason,
                                                                                       ch.stop_reason)

        def num_generated(chs: list[Choice]) -> int:
            return 0 if echo_only else sum(ch.num_tokens for ch in chs)

        if not req.stream:
            await collect(request, run)
            choices: list[dict[str, Any]] = []
            counted_choices: list[Choice] = []  # the ones returned (best_of: n of them)
            for i in range(len(prompts)):
                group = run.choices[i * samples:(i + 1) * samples]
                if samples > n:
                    group = sorted(group, key=Choice.mean_logprob, reverse=True)[:n]
                for ch in group:
                    text, ids, entries = piece(ch, ch.text, ch.token_ids, ch.logprobs)
                    reason, stop_reason = finish(ch)
                    c: dict[str, Any] = {"index": len(choices), "text": text, "logprobs": None,
                                         "finish_reason": reason, "stop_reason": stop_reason}
                    if k_lp is not None:
                        c["logprobs"] = completion_logprobs(ids, entries, k_lp, tstr)
                    if req.prompt_logprobs is not None:
                        c["prompt_logprobs"] = prompt_logprobs_layout(ch.prompt_logprobs or [None],
                                                                      req.prompt_logprobs, tstr)
                    if req.return_token_ids:
                        c["token_ids"] = [] if echo_only else ch.token_ids
                        c["prompt_token_ids"] = ch.prompt_ids
                    choices.append(c)
                    counted_choices.append(ch)
            prompt_tokens = sum(ch.prompt_len for ch in run.choices[::samples])  # once per prompt, as vLLM
            return JSONResponse({**head, "choices": choices,
                                 "usage": token_usage(prompt_tokens, num_generated(counted_choices))})

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # vLLM: running totals in every token chunk (guidellm asks for it); vLLM's own client ignores them there.
        continuous_usage = include_usage and bool(req.stream_options and req.stream_options.continuous_usage_stats)
        # The constant head of every chunk is serialised once: `data: {"id":..,"model":..,"choices":[` + choice.
        prefix = sse_event({**head, "choices": []}).removesuffix("[]}\n\n") + "["
        prompt_tokens = sum(ch.prompt_len for ch in run.choices[::samples])  # once per prompt, as vLLM
        echoed: set[int] = set()

        def usage() -> dict[str, int]:
            return token_usage(prompt_tokens, num_generated(run.choices))

        async def sse() -> AsyncIterator[str]:
            try:
                async for ch, out in run.events():  # one chunk per generated token
                    text, ids, entries = out.text_delta, list(out.new_token_ids), list(out.logprobs or ())
                    if req.echo and ch.index not in echoed:  # the first chunk of a choice carries the prompt
                        echoed.add(ch.index)
                        text, ids, entries = piece(ch, text, ids, entries)
                    reason, stop_reason = finish(ch) if out.finished else (None, None)
                    choice = {"index": ch.index, "text": text, "logprobs": None, "finish_reason": reason,
                              "stop_reason": stop_reason}
                    if k_lp is not None:  # offsets run on over the chunks, so they add up to the non-streamed
                        lp = choice["logprobs"] = completion_logprobs(ids, entries, k_lp, tstr, ch.text_offset)
                        ch.text_offset += sum(len(t) for t in lp["tokens"])
                    if req.return_token_ids:
                        choice["token_ids"] = [] if echo_only else list(out.new_token_ids)
                    tail = f',"usage":{dumps(usage())}' if continuous_usage else ""
                    yield f"{prefix}{dumps(choice)}]{tail}}}\n\n"
                if include_usage:
                    yield sse_event({**head, "choices": [], "usage": usage()})
            except APIError as e:
                yield sse_event(e.body())
            yield "data: [DONE]\n\n"

        return SSEResponse(sse(), on_close=run.close)

    async def chat(self, request: Request) -> Response:
        t_arrival = time.perf_counter()
        req = parse_chat_request(await read_json(request, self.config.max_body_bytes), self.config.limits)
        self.check_model(req.model)
        self.require_alive()
        n = req.n or 1
        self.check_max_tokens(req.max_tokens)
        prompt = chat.render(req)
        if self.tokenizer is None:
            raise APIError(400, "This model has no tokenizer: chat prompts cannot be encoded.", param="messages")
        try:
            ids = await asyncio.to_thread(encode_chat, self.tokenizer, prompt.text)
        except ChatTokenizerError as e:
            raise APIError(400, str(e), param="messages", code="chat_encoding_unavailable") from None
        self.check_prompt(ids)
        # no max_tokens: up to the end of the context (vLLM's chat default)
        base = self.sampling_fields(req, len(ids), req.max_tokens or self.config.max_model_len - len(ids))
        k_lp = (req.top_logprobs or 0) if req.logprobs else None
        if k_lp is not None:
            base["logprobs"] = k_lp
        tstr = token_id_str if req.return_tokens_as_token_ids else self.token_str
        base_id = f"chatcmpl-{uuid.uuid4().hex}"
        run = Run(self.client, self.counters, self.replies, t_arrival)
        await run.start([(Choice(j, f"{base_id}-{j}", ids), self.make_params(base, j)) for j in range(n)])
        head = {"id": base_id, "object": "chat.completion", "created": int(time.time()),
                "model": self.config.served_model_name}

        def usage() -> dict[str, int]:
            return token_usage(len(ids), sum(ch.num_tokens for ch in run.choices))

        if not req.stream:
            await collect(request, run)
            choices = []
            for ch in run.choices:
                parsed = chat.parse(prompt, ch.text)
                choices.append({"index": ch.index, "message": chat.message(parsed),
                                "logprobs": None if k_lp is None else chat_logprobs(ch.logprobs, k_lp, tstr),
                                "finish_reason": "tool_calls" if parsed.tool_calls else ch.finish_reason,
                                "stop_reason": ch.stop_reason})
            return JSONResponse({**head, "choices": choices, "usage": usage()})

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous_usage = include_usage and bool(req.stream_options and req.stream_options.continuous_usage_stats)
        head["object"] = "chat.completion.chunk"
        streams = [chat.ChatStream(prompt) for _ in run.choices]

        async def sse() -> AsyncIterator[str]:
            try:
                async for ch, out in run.events():  # one chunk per generated token
                    st = streams[ch.index]
                    delta: dict[str, Any] = {"role": "assistant"} if ch.num_tokens == len(out.new_token_ids) else {}
                    parts = st.push(out.text_delta)
                    calls: list[dict] = []
                    if out.finished:
                        rest, calls = st.finish()
                        parts = {f: parts.get(f, "") + rest.get(f, "") for f in {*parts, *rest}}
                    delta.update(parts)
                    if "content" not in delta and "reasoning_content" not in delta:
                        delta["content"] = ""
                    if calls:
                        delta["tool_calls"] = [{"index": j, **c} for j, c in enumerate(calls)]
                    reason = ("tool_calls" if calls else ch.finish_reason) if out.finished else None
                    choice = {"index": ch.index, "delta": delta, "logprobs": None, "finish_reason": reason,
                              "stop_reason": ch.stop_reason if out.finished else None}
                    if k_lp is not None:
                        choice["logprobs"] = chat_logprobs(list(out.logprobs or ()), k_lp, tstr)
                    chunk = {**head, "choices": [choice]}
                    if continuous_usage:
                        chunk["usage"] = usage()
                    yield sse_event(chunk)
                if include_usage:
                    yield sse_event({**head, "choices": [], "usage": usage()})
            except APIError as e:
                yield sse_event(e.body())
            yield "data: [DONE]\n\n"

        return SSEResponse(sse(), on_close=run.close)

