"""The server's endpoints, one module-level handler each on one `APIRouter`; each reads what it needs from
`request.app.state` (set by api.py's `create_app`): `generation` (the `Generation` of completions.py, which holds
the config, tokenizer, engine client and counters) and `config`."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse, Response

from deepinfer_bench.server.completions import Generation
from deepinfer_bench.server.metrics import prometheus_text
from deepinfer_bench.server.protocol import APIError, too_many
from deepinfer_bench.server.runs import read_json
from deepinfer_bench.server.settings import ServerConfig


def generation(request: Request) -> Generation:
    return request.app.state.generation


def server_config(request: Request) -> ServerConfig:
    return request.app.state.config


Gen = Annotated[Generation, Depends(generation)]
Config = Annotated[ServerConfig, Depends(server_config)]


def check_auth(request: Request, config: Config) -> None:
    """With an API key configured, every endpoint but /health wants `Authorization: Bearer KEY`."""
    if config.api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), config.api_key.encode()):
        raise APIError(401, "Invalid or missing API key.", code="invalid_api_key")


router = APIRouter()
authed = APIRouter(dependencies=[Depends(check_auth)])


@router.get("/health")
async def health(gen: Gen) -> Response:
    gen.require_alive()
    return Response(status_code=200)


@authed.get("/v1/models")
async def models(config: Config) -> dict[str, Any]:
    card = {"id": config.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "deepinfer", "root": config.model_root, "parent": None,
            "max_model_len": config.max_model_len, "permission": []}
    if config.vocab_size is not None:
        card["vocab_size"] = config.vocab_size  # not in OpenAI's card; `deepinfer bench serve` uses it
    return {"object": "list", "data": [card]}


@authed.post("/tokenize")
async def tokenize(request: Request, gen: Gen, config: Config) -> dict[str, Any]:
    body = await read_json(request, config.max_body_bytes)
    if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
        raise APIError(400, "`prompt` (a string) is required.", param="prompt")
    gen.check_model(body.get("model"))
    ids = await asyncio.to_thread(gen.encode, body["prompt"], bool(body.get("add_special_tokens", True)))
    return {"tokens": ids, "count": len(ids), "max_model_len": config.max_model_len}


@authed.post("/detokenize")
async def detokenize(request: Request, gen: Gen, config: Config) -> dict[str, Any]:
    body = await read_json(request, config.max_body_bytes)
    toks = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
        raise APIError(400, "`tokens` (a list of token ids) is required.", param="tokens")
    gen.check_model(body.get("model"))
    if len(toks) > config.max_model_len:  # longer than any sequence this server accepts or produces
        raise too_many("tokens", config.max_model_len, len(toks))
    gen.check_ids(toks, "tokens")
    if gen.tokenizer is None:
        raise APIError(400, "This model has no tokenizer.", param="tokens")
    return {"prompt": gen.tokenizer.decode(toks)}


@router.get("/metrics")
async def metrics(gen: Gen, config: Config) -> PlainTextResponse:
    client = gen.client
    text = prometheus_text(client.stats, gen.counters, client.alive, config.served_model_name)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


@authed.post("/v1/completions")
async def completions(request: Request, gen: Gen) -> Response:
    return await counted(gen, gen.completions(request))


@authed.post("/v1/chat/completions")
async def chat_completions(request: Request, gen: Gen) -> Response:
    return await counted(gen, gen.chat(request))


async def counted(gen: Generation, reply: Awaitable[Response]) -> Response:
    """A generation reply; a refused request counts in `requests_rejected_total`."""
    try:
        return await reply
    except APIError:
        gen.counters.rejected += 1
        raise


router.include_router(authed)
