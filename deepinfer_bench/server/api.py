"""OpenAI-compatible HTTP server over the engine: what `vllm bench serve --backend openai` drives.

`create_app(engine, tokenizer, config)` returns a FastAPI app: its state, its error handlers (every error in OpenAI's
shape) and the engine client's lifespan. One `EngineClient` (an `EngineLoop` thread or a `ProcessEngineLoop`)
batches every in-flight request (continuous batching). The endpoints are routes.py's; generation is completions.py's.
Wire format, error shapes and limits follow vLLM's OpenAI server (`vllm/entrypoints/openai`) and what `vllm bench
serve` parses. Running it (port, drain at shutdown): serve.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer_bench.server.completions import Generation
from deepinfer_bench.server.engine_client import EngineClient
from deepinfer_bench.server.engine_thread import EngineLoop
from deepinfer_bench.server.protocol import APIError
from deepinfer_bench.server.routes import router
from deepinfer_bench.server.runs import ClientGone, Counters
from deepinfer_bench.server.settings import ServerConfig, TextCodec

if TYPE_CHECKING:
    from engine.llm import LLMEngine


log = logging.getLogger("uvicorn.error")
# At shutdown the engine gets this long to finish its step and exit; then its process (and its rank processes) are
# killed, so a server exits within its drain time + ~2 s even when a step is long.
ENGINE_STOP_S = 1.5


def create_app(engine: LLMEngine | None, tokenizer: TextCodec | None, config: ServerConfig, *,
               make_sampling_params: Callable[..., Any], engine_loop: EngineClient | None = None) -> FastAPI:
    """The FastAPI app. `make_sampling_params(**fields)` builds the engine's SamplingParams (raises ValueError).

    The engine runs on an `EngineLoop` thread, or pass `engine_loop` (e.g. a `ProcessEngineLoop`) and engine=None.
    It starts and stops with the app (lifespan). `app.state.replies`: the open replies (a shutdown drains them).
    """
    client = engine_loop if engine_loop is not None else EngineLoop(engine)
    app = FastAPI(title="deepinfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    gen = Generation(config, tokenizer, client, Counters(), make_sampling_params)
    app.state.engine_loop = client
    app.state.generation = gen
    app.state.counters = gen.counters
    app.state.config = config
    app.state.replies = gen.replies  # the open replies; shutdown drains them (deepinfer_bench/server/serve.py)
    for exc, handler in ERROR_HANDLERS.items():
        app.add_exception_handler(exc, handler)
    app.include_router(router)
    return app


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The engine client runs while the app does; at shutdown the engine gets ENGINE_STOP_S to end its step."""
    client: EngineClient = app.state.engine_loop
    client.start(asyncio.get_running_loop())
    try:
        yield
    finally:
        t0 = time.perf_counter()
        if await asyncio.to_thread(client.stop, ENGINE_STOP_S):
            log.info("Engine stopped in %.2f s", time.perf_counter() - t0)
        else:
            log.warning("Engine still in a step after %g s: ended it (its process and rank processes are "
                        "killed; a thread ends with this process)", ENGINE_STOP_S)


async def api_error(_req: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def client_gone(_req: Request, _exc: ClientGone) -> JSONResponse:
    return JSONResponse({}, status_code=499)


async def http_error(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)


async def validation_error(_req: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(APIError(400, str(exc.errors()[:1])).body(), status_code=400)


# Every error answers in OpenAI's shape (`{"error": {...}}`), Starlette's own 404 / 405 and FastAPI's 422 included.
ERROR_HANDLERS: dict[type[Exception], Callable[..., Any]] = {
    APIError: api_error, ClientGone: client_gone, StarletteHTTPException: http_error,
    RequestValidationError: validation_error,
}
