"""OpenAI-compatible HTTP server over the engine: what `vllm bench serve --backend openai` drives.

`create_app(engine, tokenizer, config)` returns a FastAPI app. One `EngineLoop` thread (or a `ProcessEngineLoop`)
batches every in-flight request (continuous batching); each HTTP request gets an asyncio queue fed with the engine's
`StepOutput`s. The engine owns the output text: it detokenizes, applies stop strings and stop tokens, and each
output carries the text it released (`text_delta`); the server sends one SSE chunk per generated token with that
text, and a non-streamed reply is the concatenation of the same deltas. Wire format, error shapes and limits follow
vLLM's OpenAI server (`vllm/entrypoints/openai`) and what `vllm bench serve` parses.

Endpoints: POST /v1/completions, GET /v1/models, GET /health, POST /tokenize, POST /detokenize, GET /metrics.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer_bench.engine_loop import EngineDeadError, EngineLoop, Sink
from deepinfer_bench.engine_messages import StepOutput
from deepinfer_bench.openai_protocol import APIError, normalize_prompts, parse_completion_request
from engine.profiling import quantiles

if TYPE_CHECKING:
    from deepinfer_bench.engine_process import ProcessEngineLoop
    from engine.llm import LLMEngine


class TextCodec(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    model_root: str  # absolute path of the tokenizer directory clients load (`root` in /v1/models)
    max_model_len: int
    model_aliases: tuple[str, ...] = ()  # other names accepted as `model` (e.g. the model directory path)
    vocab_size: int | None = None
    api_key: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    max_prompts_per_request: int = 256
    default_max_tokens: int = 16

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")


@dataclass
class Counters:
    """Server-side totals for /metrics (the engine's own gauges come from `EngineLoop.stats`)."""

    requests: dict[str, int] = field(default_factory=dict)  # finish_reason -> count
    prompt_tokens: int = 0
    generation_tokens: int = 0
    rejected: int = 0
    admitted: int = 0
    ttft_s_sum: float = 0.0  # server side: request received -> first token handed to the response
    ttft_count: int = 0


@dataclass
class _Choice:
    """One prompt of a completion request: its engine request and what the engine sent for it so far."""

    index: int
    request_id: str
    prompt_len: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def feed(self, out: StepOutput) -> None:
        self.text += out.text_delta
        self.token_ids += out.new_token_ids
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason or "stop", out.stop_reason


def _context_error(max_len: int, prompt_len: int) -> APIError:
    return APIError(400, f"This model's maximum context length is {max_len} tokens. However, your prompt contains "
                         f"{prompt_len} input tokens, which exceeds this limit even without any output tokens. "
                         "Please reduce the length of the input prompt.", param="prompt",
                    code="context_length_exceeded")


def _param_from_message(msg: str) -> str | None:
    for name in ("temperature", "top_p", "top_k", "seed", "min_tokens", "max_tokens", "stop_token_ids", "stop",
                 "ignore_eos"):
        if name in msg:
            return name
    return None


async def _read_json(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"Request body too large: {declared} bytes (limit {limit}).", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"Request body too large (limit {limit} bytes).", code="request_too_large")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"The request body is not valid JSON: {e}") from None


class _SSEResponse(StreamingResponse):
    """A streaming response that always runs `on_close` (abort what is unfinished), even when the client left."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _sse(obj: Any) -> str:
    return f"data: {_dumps(obj)}\n\n"


def create_app(engine: LLMEngine | None, tokenizer: TextCodec | None, config: ServerConfig, *,
               make_sampling_params: Callable[..., Any],
               engine_loop: EngineLoop | ProcessEngineLoop | None = None) -> FastAPI:
    """The FastAPI app. `make_sampling_params(**fields)` builds the engine's SamplingParams (raises ValueError).

    The engine runs on an `EngineLoop` thread, or pass `engine_loop` (e.g. a `ProcessEngineLoop`) and engine=None.
    """
    loop_runner = engine_loop if engine_loop is not None else EngineLoop(engine)
    counters = Counters()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        loop_runner.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(loop_runner.stop)

    app = FastAPI(title="deepinfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine_loop = loop_runner
    app.state.counters = counters
    app.state.config = config

    @app.exception_handler(APIError)
    async def _api_error(_req: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(APIError(400, str(exc.errors()[:1])).body(), status_code=400)

    def check_auth(request: Request) -> None:
        if config.api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "Invalid or missing API key.", code="invalid_api_key")

    def check_model(name: str | None) -> None:
        if name is not None and name not in (config.served_model_name, config.model_root, *config.model_aliases):
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def require_alive() -> None:
        if not loop_runner.alive:
            raise APIError(503, f"The engine is not running ({loop_runner.error!r}).", code="engine_dead")

    def encode(text: str, add_special_tokens: bool) -> list[int]:
        if tokenizer is None:
            raise APIError(400, "This model has no tokenizer: send the prompt as token ids.", param="prompt")
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_ids(ids: list[int], param: str) -> None:
        hi = config.vocab_size
        bad = [t for t in ids if t < 0 or (hi is not None and t >= hi)]
        if bad:
            raise APIError(400, f"Token id {bad[0]} is out of range [0, {hi}).", param=param)

    # -- endpoints -----------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        require_alive()
        return Response(status_code=200)

    @app.get("/v1/models", dependencies=[Depends(check_auth)])
    async def models() -> dict[str, Any]:
        card = {"id": config.served_model_name, "object": "model", "created": int(time.time()),
                "owned_by": "deepinfer", "root": config.model_root, "parent": None,
                "max_model_len": config.max_model_len, "permission": []}
        if config.vocab_size is not None:
            card["vocab_size"] = config.vocab_size  # not in OpenAI's card; `deepinfer bench serve` uses it
        return {"object": "list", "data": [card]}

    @app.post("/tokenize", dependencies=[Depends(check_auth)])
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await _read_json(request, config.max_body_bytes)
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
            raise APIError(400, "`prompt` (a string) is required.", param="prompt")
        check_model(body.get("model"))
        ids = await asyncio.to_thread(encode, body["prompt"], bool(body.get("add_special_tokens", True)))
        return {"tokens": ids, "count": len(ids), "max_model_len": config.max_model_len}

    @app.post("/detokenize", dependencies=[Depends(check_auth)])
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await _read_json(request, config.max_body_bytes)
        toks = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise APIError(400, "`tokens` (a list of token ids) is required.", param="tokens")
        check_model(body.get("model"))
        check_ids(toks, "tokens")
        if tokenizer is None:
            raise APIError(400, "This model has no tokenizer.", param="tokens")
        return {"prompt": tokenizer.decode(toks)}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        st = loop_runner.stats
        es = st.engine
        lines: list[str] = []

        def metric(name: str, kind: str, doc: str, samples: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP deepinfer:{name} {doc}", f"# TYPE deepinfer:{name} {kind}"])
            lines.extend(f"deepinfer:{name}{labels} {value:g}" for labels, value in samples)

        model = config.served_model_name.replace("\\", "\\\\").replace('"', '\\"')
        label = f'{{model_name="{model}"}}'
        metric("num_requests_running", "gauge", "Requests in the running batch.", [(label, es.num_running)])
        metric("num_requests_waiting", "gauge", "Requests waiting for KV blocks or a batch slot.",
               [(label, es.num_waiting)])
        metric("kv_cache_usage_perc", "gauge", "Fraction of the KV block pool in use (0-1).", [(label, es.kv_usage)])
        metric("kv_blocks_used", "gauge", "KV blocks in use.", [(label, es.num_used_blocks)])
        metric("kv_blocks_total", "gauge", "KV blocks in the pool.", [(label, es.num_kv_blocks)])
        metric("engine_alive", "gauge", "1 while the engine loop runs.", [(label, float(loop_runner.alive))])
        metric("engine_steps_total", "counter", "Engine steps run.", [(label, st.num_steps)])
        recent = list(st.recent_step_s)
        qs = [(f'{{model_name="{model}",quantile="{q / 100}"}}', v)
              for q, v in zip((50, 90), quantiles(recent, 50, 90), strict=True)] if recent else []
        metric("engine_step_seconds", "summary", "Engine step time (quantiles over the last 512 steps).",
               [*qs, (f"_sum{label}", st.step_s_total), (f"_count{label}", st.num_steps)])
        metric("engine_gap_seconds_total", "counter", "Seconds between consecutive busy steps (server overhead).",
               [(label, st.gap_s_total)])
        metric("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.",
               [(label, counters.prompt_tokens)])
        metric("generation_tokens_total", "counter", "Tokens generated and sent to clients.",
               [(label, counters.generation_tokens)])
        metric("engine_generated_tokens_total", "counter", "Tokens the engine generated (aborted ones too).",
               [(label, es.num_generated_tokens)])
        metric("num_preemptions_total", "counter", "Sequences preempted for KV blocks.", [(label, es.num_preemptions)])
        reasons = [(f'{{model_name="{model}",finished_reason="{r}"}}', n)
                   for r, n in sorted(counters.requests.items())]
        metric("request_success_total", "counter", "Finished requests by finish reason.", reasons)
        metric("requests_total", "counter", "Completion requests admitted (one per prompt).",
               [(label, counters.admitted)])
        metric("time_to_first_token_seconds", "summary", "Server-side TTFT: request received -> first token.",
               [(f"_sum{label}", counters.ttft_s_sum), (f"_count{label}", counters.ttft_count)])
        metric("requests_rejected_total", "counter", "Requests refused with an error.", [(label, counters.rejected)])
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions", dependencies=[Depends(check_auth)])
    async def completions(request: Request) -> Response:
        try:
            return await _completions(request)
        except APIError:
            counters.rejected += 1
            raise

    async def _completions(request: Request) -> Response:
        t_arrival = time.perf_counter()
        req = parse_completion_request(await _read_json(request, config.max_body_bytes))
        check_model(req.model)
        require_alive()
        prompts = normalize_prompts(req.prompt)
        if len(prompts) > config.max_prompts_per_request:
            raise APIError(413, f"Too many prompts in one request: {len(prompts)} (limit "
                                f"{config.max_prompts_per_request}).", param="prompt")
        if req.max_tokens is not None and req.max_tokens > config.max_model_len:
            raise APIError(400, f"This model's maximum context length is {config.max_model_len} tokens; "
                                f"max_tokens={req.max_tokens} exceeds it.", param="max_tokens",
                           code="context_length_exceeded")
        ids_list: list[list[int]] = []
        for p in prompts:
            ids = await asyncio.to_thread(encode, p, req.add_special_tokens) if isinstance(p, str) else p
            check_ids(ids, "prompt")
            if len(ids) >= config.max_model_len:
                raise _context_error(config.max_model_len, len(ids))
            ids_list.append(ids)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(s == "" for s in stop):
            raise APIError(400, "Stop strings must not be empty.", param="stop")
        if stop and tokenizer is None:
            raise APIError(400, "Stop strings need a tokenizer and this model has none: use stop_token_ids.",
                           param="stop")
        base_id = f"cmpl-{uuid.uuid4().hex}"
        queue: asyncio.Queue[tuple[int, StepOutput | EngineDeadError]] = asyncio.Queue()
        choices: list[_Choice] = []

        def make_sink(i: int) -> Sink:
            return lambda item: queue.put_nowait((i, item))  # runs on the event loop

        def abort_unfinished() -> None:
            for ch in choices:
                if ch.finish_reason is None:
                    ch.finish_reason = "abort"
                    counters.requests["abort"] = counters.requests.get("abort", 0) + 1
                    loop_runner.abort(ch.request_id)

        pending: list[tuple[_Choice, list[int], Any]] = []
        for i, ids in enumerate(ids_list):
            wanted = req.max_tokens if req.max_tokens is not None else config.default_max_tokens
            max_tokens = min(wanted, config.max_model_len - len(ids))
            fields: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": req.ignore_eos, "stop": tuple(stop)}
            if req.min_tokens:
                if req.min_tokens > wanted:
                    raise APIError(400, f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({wanted}).",
                                   param="min_tokens")
                fields["min_tokens"] = min(req.min_tokens, max_tokens)  # max_tokens may be clamped to the context
            for name in ("temperature", "top_p", "seed", "stop_token_ids"):
                if getattr(req, name) is not None:
                    fields[name] = getattr(req, name)
            if req.top_k not in (None, 0, -1):  # -1 / 0 mean "disabled" for OpenAI-style clients
                fields["top_k"] = req.top_k
            try:
                params = make_sampling_params(**fields)
            except (ValueError, TypeError) as e:
                raise APIError(400, str(e), param=_param_from_message(str(e))) from None
            pending.append((_Choice(i, f"{base_id}-{i}", len(ids)), ids, params))
        # All prompts go to the engine thread at once (one step boundary, not one per prompt).
        try:
            added = await asyncio.gather(*(loop_runner.add(ids, params, ch.request_id, make_sink(ch.index))
                                           for ch, ids, params in pending), return_exceptions=True)
        except BaseException:  # cancelled: whatever was added must not run on
            for ch, _, _ in pending:
                loop_runner.abort(ch.request_id)
            raise
        errors = [r for r in added if isinstance(r, BaseException)]
        if errors:
            for (ch, _, _), res in zip(pending, added, strict=True):
                if not isinstance(res, BaseException):
                    loop_runner.abort(ch.request_id)
            e = errors[0]
            if isinstance(e, EngineDeadError):
                raise APIError(503, str(e), code="engine_dead")
            if isinstance(e, ValueError):  # RequestRejected and friends
                code = "context_length_exceeded" if "maximum context length" in str(e) else None
                raise APIError(400, str(e), param="prompt", code=code)
            raise e
        choices.extend(ch for ch, _, _ in pending)
        counters.prompt_tokens += sum(len(ids) for _, ids, _ in pending)
        counters.admitted += len(pending)

        created = int(time.time())
        head = {"id": base_id, "object": "text_completion", "created": created, "model": config.served_model_name}

        async def events() -> AsyncIterator[tuple[_Choice, StepOutput]]:
            """(choice, engine output) per generated token, until every prompt has finished. The engine owns the
            text: each output carries the text it released (`text_delta`) and, at the end, why it stopped."""
            live = len(choices)
            while live:
                i, item = await queue.get()
                ch = choices[i]
                if ch.finish_reason is not None:
                    continue  # aborted meanwhile
                if isinstance(item, BaseException):
                    raise APIError(503, str(item), code="engine_dead")
                if ch.num_tokens == 0 and item.new_token_ids:
                    counters.ttft_s_sum += time.perf_counter() - t_arrival
                    counters.ttft_count += 1
                ch.feed(item)
                counters.generation_tokens += len(item.new_token_ids)
                if item.finished:
                    live -= 1
                    counters.requests[ch.finish_reason] = counters.requests.get(ch.finish_reason, 0) + 1
                if item.new_token_ids or (item.finished and ch.num_tokens):
                    yield ch, item

        def usage() -> dict[str, int]:
            p = sum(ch.prompt_len for ch in choices)
            c = sum(ch.num_tokens for ch in choices)
            return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

        if not req.stream:
            return await _collect(request, events(), abort_unfinished, head, choices, usage, req.return_token_ids)

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # vLLM: running totals in every token chunk (guidellm asks for it); vLLM's own client ignores them there.
        continuous_usage = include_usage and bool(req.stream_options and req.stream_options.continuous_usage_stats)

        # The constant head of every chunk is serialised once: `data: {"id":..,"model":..,"choices":[` + choice.
        prefix = _sse({**head, "choices": []}).removesuffix("[]}\n\n") + "["

        async def sse() -> AsyncIterator[str]:
            try:
                async for ch, out in events():  # one chunk per generated token
                    choice = {"index": ch.index, "text": out.text_delta, "logprobs": None,
                              "finish_reason": out.finish_reason if out.finished else None,
                              "stop_reason": out.stop_reason if out.finished else None}
                    if req.return_token_ids:
                        choice["token_ids"] = list(out.new_token_ids)
                    tail = f',"usage":{_dumps(usage())}' if continuous_usage else ""
                    yield f"{prefix}{_dumps(choice)}]{tail}}}\n\n"
                if include_usage:
                    yield _sse({**head, "choices": [], "usage": usage()})
            except APIError as e:
                yield _sse(e.body())
            yield "data: [DONE]\n\n"

        return _SSEResponse(sse(), on_close=abort_unfinished)

    return app


async def _collect(request: Request, events: AsyncIterator[Any], abort_unfinished: Callable[[], None],
                   head: dict[str, Any], choices: list[_Choice], usage: Callable[[], dict[str, int]],
                   return_token_ids: bool) -> JSONResponse:
    """Non-streaming reply; aborts the engine requests if the client disconnects while waiting."""

    async def drain() -> None:
        async for _ in events:
            pass

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(drain())
    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (work, watch):
            t.cancel()
        abort_unfinished()
    if work not in done:
        return JSONResponse({}, status_code=499)
    work.result()  # re-raise APIError from the engine
    body = [{"index": ch.index, "text": ch.text, "logprobs": None, "finish_reason": ch.finish_reason,
             "stop_reason": ch.stop_reason, **({"token_ids": ch.token_ids} if return_token_ids else {})}
            for ch in choices]
    return JSONResponse({**head, "choices": body, "usage": usage()})
