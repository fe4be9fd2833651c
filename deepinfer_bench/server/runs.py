"""One HTTP request's engine requests, from the first add to the last output: `Run` (its `Choice`s), and what the
replies share: the open replies and the shutdown's state (`Replies`), the counters /metrics reads, reading a JSON
body, waiting for a non-streamed reply (`collect`), the SSE response that always aborts what is unfinished.

Shutdown: `Replies.stop_admitting()` makes the endpoints refuse new requests (503); `Replies.end_open(reason)`, when
the drain time is over, ends every open run: its stream sends an error event and [DONE], a non-streamed request
gets a 503 (deepinfer_bench/server/serve.py drives both).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from deepinfer_bench.server.engine_client import EngineClient, EngineDeadError
from deepinfer_bench.server.engine_messages import StepOutput
from deepinfer_bench.server.protocol import APIError

if TYPE_CHECKING:
    from engine.sampler import TokenLogprobs


@dataclass
class Counters:
    """Server-side totals for /metrics (the engine's own gauges come from the engine loop's `stats`)."""

    requests: dict[str, int] = field(default_factory=dict)  # finish_reason -> count
    prompt_tokens: int = 0
    generation_tokens: int = 0
    rejected: int = 0
    admitted: int = 0
    ttft_s_sum: float = 0.0  # server side: request received -> first token handed to the response
    ttft_count: int = 0


class Replies:
    """The replies still open (their `Run`s) and whether new requests are taken."""

    def __init__(self) -> None:
        self.open: set[Run] = set()
        self.admitting = True
        self.ending: APIError | None = None  # set when the drain is over: every open reply ends with it

    def check_admitting(self) -> None:
        if not self.admitting:
            raise APIError(503, "The server is shutting down.", code="server_shutting_down")

    def stop_admitting(self) -> int:
        """Refuse new requests (503, and /health 503); the open ones go on. Returns how many are open."""
        self.admitting = False
        return len(self.open)

    def end_open(self, reason: str) -> int:
        """End every open reply (a stream: an error event and [DONE]; a non-streamed request: a 503) and any that
        opens later. Returns how many were open."""
        self.admitting = False
        self.ending = APIError(503, f"The server is shutting down: {reason}", code="server_shutting_down")
        runs = list(self.open)
        for run in runs:
            run.end(self.ending)
        return len(runs)


async def read_json(request: Request, limit: int) -> Any:
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


class SSEResponse(StreamingResponse):
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


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse_event(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


@dataclass
class Choice:
    """One engine request of an HTTP request (a prompt, or one of its n samples) and what it has received so far."""

    index: int
    request_id: str
    prompt_ids: list[int]
    prompt_text: str = ""  # for echo
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # of token_ids, when asked
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text_offset: int = 0  # streaming: where the next chunk's logprob text offsets start

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def feed(self, out: StepOutput) -> None:
        self.text += out.text_delta
        self.token_ids += out.new_token_ids
        self.logprobs += out.logprobs or ()
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = list(out.prompt_logprobs)
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason or "stop", out.stop_reason

    def mean_logprob(self) -> float:
        """best_of's rank: the mean logprob of the generated tokens (OpenAI: "highest log probability per token")."""
        return sum(e.logprob for e in self.logprobs) / len(self.logprobs) if self.logprobs else float("-inf")


class Run:
    """The engine requests of one HTTP request: added at one step boundary, their outputs read as they arrive,
    the unfinished ones aborted together (client gone, error, shutdown). Open from `start` to `close`, listed in
    `Generation.runs` meanwhile (so a shutdown can end it)."""

    def __init__(self, client: EngineClient, counters: Counters, replies: Replies, t_arrival: float) -> None:
        self.client, self.counters, self.replies, self.t_arrival = client, counters, replies, t_arrival
        # (choice index, output) from the engine loop; (-1, APIError) when the server ends the reply
        self.queue: asyncio.Queue[tuple[int, StepOutput | BaseException]] = asyncio.Queue()
        self.choices: list[Choice] = []

    async def start(self, pending: list[tuple[Choice, Any]]) -> None:
        """Add every (choice, SamplingParams) to the engine, or none (then the APIError of the first failure)."""
        lr = self.client

        def sink(k: int) -> Callable[[StepOutput | EngineDeadError], None]:
            return lambda item: self.queue.put_nowait((k, item))  # runs on the event loop

        try:
            added = await asyncio.gather(*(lr.add(ch.prompt_ids, params, ch.request_id, sink(k))
                                           for k, (ch, params) in enumerate(pending)), return_exceptions=True)
        except BaseException:  # cancelled: whatever was added must not run on
            for ch, _ in pending:
                lr.abort(ch.request_id)
            raise
        errors = [r for r in added if isinstance(r, BaseException)]
        if errors:
            for (ch, _), res in zip(pending, added, strict=True):
                if not isinstance(res, BaseException):
                    lr.abort(ch.request_id)
            e = errors[0]
            if isinstance(e, EngineDeadError):
                raise APIError(503, str(e), code="engine_dead")
            if isinstance(e, ValueError):  # RequestRejected and friends
                code = "context_length_exceeded" if "maximum context length" in str(e) else None
                raise APIError(400, str(e), param="prompt", code=code)
            raise e
        self.choices = [ch for ch, _ in pending]
        self.counters.prompt_tokens += sum(ch.prompt_len for ch in self.choices)
        self.counters.admitted += len(self.choices)
        self.replies.open.add(self)
        if self.replies.ending is not None:  # the drain ended while these were being added
            self.end(self.replies.ending)

    def end(self, error: APIError) -> None:
        """End the reply with `error` (streamed: an error event, then [DONE]; else that error's status)."""
        self.queue.put_nowait((-1, error))

    def close(self) -> None:
        """The reply is over (sent, failed, or the client left): abort what is unfinished."""
        self.abort_unfinished()
        self.replies.open.discard(self)

    async def events(self) -> AsyncIterator[tuple[Choice, StepOutput]]:
        """(choice, engine output) per generated token, until every choice has finished. The engine owns the text:
        each output carries the text it released (`text_delta`) and, at the end, why it stopped."""
        c = self.counters
        live = len(self.choices)
        while live:
            k, item = await self.queue.get()
            if k < 0:
                raise item  # the server ends this reply (shutdown)
            ch = self.choices[k]
            if ch.finish_reason is not None:
                continue  # aborted meanwhile
            if isinstance(item, BaseException):
                raise APIError(503, str(item), code="engine_dead")
            if ch.num_tokens == 0 and item.new_token_ids:
                c.ttft_s_sum += time.perf_counter() - self.t_arrival
                c.ttft_count += 1
            ch.feed(item)
            c.generation_tokens += len(item.new_token_ids)
            if item.finished:
                live -= 1
                c.requests[ch.finish_reason] = c.requests.get(ch.finish_reason, 0) + 1
            if item.new_token_ids or (item.finished and ch.num_tokens):
                yield ch, item

    def abort_unfinished(self) -> None:
        for ch in self.choices:
            if ch.finish_reason is None:
                ch.finish_reason = "abort"
                self.counters.requests["abort"] = self.counters.requests.get("abort", 0) + 1
                self.client.abort(ch.request_id)


def token_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def collect(request: Request, run: Run) -> None:
    """Wait until every choice of `run` finished (raises the engine's APIError); aborts the engine requests and
    answers 499 if the client disconnects while waiting."""

    async def drain() -> None:
        async for _ in run.events():
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
        run.close()
    if work not in done:
        raise ClientGone()
    work.result()  # re-raise APIError from the engine


class ClientGone(Exception):
    """The client disconnected before a non-streamed reply was ready."""
