"""OpenAI-compatible HTTP server over the engine: what `vllm bench serve --backend openai` drives.

`create_app(engine, tokenizer, config)` returns a FastAPI app. One `EngineLoop` thread (or a `ProcessEngineLoop`)
batches every in-flight request (continuous batching). The generation endpoints (`/v1/completions`,
`/v1/chat/completions`: logprobs, echo, n, best_of, DeepSeek-V4's chat encoding) are deepinfer_bench/
server_generate.py; this module is the app, its errors, auth, and the model / tokenizer / health / metrics
endpoints. Wire format, error shapes and limits follow vLLM's OpenAI server (`vllm/entrypoints/openai`) and what
`vllm bench serve` parses. Running it (port, drain at shutdown): deepinfer_bench/serving.py.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, POST /tokenize,
POST /detokenize, GET /metrics.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer_bench.engine_loop import EngineLoop
from deepinfer_bench.openai_protocol import APIError, too_many
from deepinfer_bench.server_config import ServerConfig, TextCodec
from deepinfer_bench.server_generate import Generation
from deepinfer_bench.server_run import ClientGone, Counters, read_json
from engine.profiling import quantiles

if TYPE_CHECKING:
    from deepinfer_bench.engine_process import ProcessEngineLoop
    from engine.llm import LLMEngine


log = logging.getLogger("uvicorn.error")
# At shutdown the engine gets this long to finish its step and exit; then its process (and its rank processes) are
# killed, so a server exits within its drain time + ~2 s even when a step is long.
ENGINE_STOP_S = 1.5


def create_app(engine: LLMEngine | None, tokenizer: TextCodec | None, config: ServerConfig, *,
               make_sampling_params: Callable[..., Any],
               engine_loop: EngineLoop | ProcessEngineLoop | None = None) -> FastAPI:
    """The FastAPI app. `make_sampling_params(**fields)` builds the engine's SamplingParams (raises ValueError).

    The engine runs on an `EngineLoop` thread, or pass `engine_loop` (e.g. a `ProcessEngineLoop`) and engine=None.
    It starts and stops with the app (lifespan). `app.state.replies`: the open replies (a shutdown drains them).
    """
    loop_runner = engine_loop if engine_loop is not None else EngineLoop(engine)
    counters = Counters()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        loop_runner.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            t0 = time.perf_counter()
            if await asyncio.to_thread(loop_runner.stop, ENGINE_STOP_S):
                log.info("Engine stopped in %.2f s", time.perf_counter() - t0)
            else:
                log.warning("Engine still in a step after %g s: ended it (its process and rank processes are "
                            "killed; a thread ends with this process)", ENGINE_STOP_S)

    app = FastAPI(title="deepinfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine_loop = loop_runner
    app.state.counters = counters
    app.state.config = config
    gen = Generation(config, tokenizer, loop_runner, counters, make_sampling_params)
    app.state.replies = gen.replies  # the open replies; shutdown drains them (deepinfer_bench/serving.py)

    @app.exception_handler(APIError)
    async def _api_error(_req: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(ClientGone)
    async def _client_gone(_req: Request, _exc: ClientGone) -> JSONResponse:
        return JSONResponse({}, status_code=499)

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

    # -- endpoints -----------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        gen.require_alive()
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
        body = await read_json(request, config.max_body_bytes)
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
            raise APIError(400, "`prompt` (a string) is required.", param="prompt")
        gen.check_model(body.get("model"))
        ids = await asyncio.to_thread(gen.encode, body["prompt"], bool(body.get("add_special_tokens", True)))
        return {"tokens": ids, "count": len(ids), "max_model_len": config.max_model_len}

    @app.post("/detokenize", dependencies=[Depends(check_auth)])
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await read_json(request, config.max_body_bytes)
        toks = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise APIError(400, "`tokens` (a list of token ids) is required.", param="tokens")
        gen.check_model(body.get("model"))
        if len(toks) > config.max_model_len:  # longer than any sequence this server accepts or produces
            raise too_many("tokens", config.max_model_len, len(toks))
        gen.check_ids(toks, "tokens")
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
        metric("requests_total", "counter", "Engine requests admitted (one per prompt and sample).",
               [(label, counters.admitted)])
        metric("time_to_first_token_seconds", "summary", "Server-side TTFT: request received -> first token.",
               [(f"_sum{label}", counters.ttft_s_sum), (f"_count{label}", counters.ttft_count)])
        metric("requests_rejected_total", "counter", "Requests refused with an error.", [(label, counters.rejected)])

        def spec(name: str, doc: str, samples: list[tuple[str, float]]) -> None:
            """Counters under vLLM's metric names (its dashboards work unchanged): speculative decoding, prefix
            caching."""
            lines.extend([f"# HELP vllm:{name} {doc}", f"# TYPE vllm:{name} counter"])
            lines.extend(f"vllm:{name}_total{labels} {value:g}" for labels, value in samples)

        spec("spec_decode_num_drafts", "Verify steps that carried drafts.", [(label, es.spec_num_drafts)])
        spec("spec_decode_num_draft_tokens", "Drafted tokens.", [(label, es.spec_num_draft_tokens)])
        spec("spec_decode_num_accepted_tokens", "Drafted tokens the target accepted.",
             [(label, es.spec_num_accepted_tokens)])
        spec("spec_decode_num_accepted_tokens_per_pos", "Accepted drafts per draft position.",
             [(f'{{model_name="{model}",position="{i}"}}', n) for i, n in enumerate(es.spec_accepted_per_pos)])
        spec("prefix_cache_queries", "Prefix cache queries, in prompt tokens looked up at admission.",
             [(label, es.prefix_cache_queries)])
        spec("prefix_cache_hits", "Prefix cache hits, in prompt tokens found cached.", [(label, es.prefix_cache_hits)])
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    def counted(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError:
                counters.rejected += 1
                raise

        return endpoint

    app.add_api_route("/v1/completions", counted(gen.completions), methods=["POST"], dependencies=[Depends(check_auth)])
    app.add_api_route("/v1/chat/completions", counted(gen.chat), methods=["POST"],
                      dependencies=[Depends(check_auth)])
    return app
