"""Online serving sweep: concurrency x input length x output length against any OpenAI-compatible server.

The request function parses the stream exactly as `vllm bench serve --backend openai` does
(`vllm/benchmarks/lib/endpoint_request_func.py`) and the metrics are vLLM's (`calculate_metrics`): TTFT = first
token chunk - send; ITL = gaps between token chunks (pooled);
TPOT = (E2EL - TTFT) / (output_tokens - 1) per request with > 1 output token; E2EL = last token chunk - send.
`output_tokens` is `usage.completion_tokens` from the final usage chunk (the server's count).

Prompts are random token ids (exact `input_len`, no client tokenizer needed), `ignore_eos: true`, so every request
produces exactly `output_len` tokens. Library code: returns a DataFrame, never prints.

Chat traces (`turns` > 1 or `shared_prefix_len` > 0): every conversation opens with the same system prompt of
`shared_prefix_len` ids, and each turn sends the whole history plus `input_len` new ids; the history stands the
reply in as `output_len` fresh ids (a client without the tokenizer cannot turn the streamed text back into ids),
so the previous turn's prompt - not its reply - is the cacheable prefix of the next. At most `concurrency`
conversations in flight, each turn after the previous one's answer.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pandas as pd

from deepinfer_bench.bench import axes
from engine.profiling import quantiles

COLUMNS = [
    "concurrency", "input_len", "output_len", "num_prompts", "completed", "failed", "duration_s",
    "ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99",
    "tpot_ms_mean", "tpot_ms_p50", "tpot_ms_p90", "tpot_ms_p99",
    "itl_ms_p50", "itl_ms_p90", "itl_ms_p99", "e2el_ms_p50", "e2el_ms_p90",
    "request_throughput", "output_tok_s", "total_tok_s", "mean_prompt_tokens", "mean_output_tokens",
    "status", "skip_reason",
]


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # s
    latency: float = 0.0  # s, send -> last token chunk
    itl: list[float] = field(default_factory=list)  # s
    text: str = ""
    start: float = 0.0


async def send_completion(client: httpx.AsyncClient, url: str, payload: dict[str, Any],
                          headers: dict[str, str] | None = None, prompt_len: int = 0) -> RequestResult:
    """POST one streaming completion and time it the way vLLM's `async_request_openai_completions` does."""
    res = RequestResult(prompt_len=prompt_len)
    st = time.perf_counter()
    res.start = st
    most_recent = st
    got_first = False
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = resp.reason_phrase or f"HTTP {resp.status_code}"
                return res
            buf = ""
            async for piece in resp.aiter_text():
                buf += piece
                while "\n\n" in buf:
                    msg, buf = buf.split("\n\n", 1)
                    msg = msg.strip()
                    if not msg or msg.startswith(":"):
                        continue
                    chunk = msg.removeprefix("data: ")
                    if chunk == "[DONE]":
                        continue
                    data = json.loads(chunk)
                    if choices := data.get("choices"):
                        ts = time.perf_counter()
                        if not got_first:
                            got_first = True
                            res.ttft = ts - st
                        else:
                            res.itl.append(ts - most_recent)
                        most_recent = ts
                        res.text += choices[0].get("text") or ""
                    elif usage := data.get("usage"):
                        res.output_tokens = usage.get("completion_tokens") or 0
                        res.prompt_len = usage.get("prompt_tokens") or res.prompt_len
                    elif "error" in data:
                        res.error = str(data["error"].get("message", data["error"]))
        res.latency = most_recent - st
        res.success = got_first and not res.error
        if not got_first and not res.error:
            res.error = "Never received a valid chunk to calculate TTFT."
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, AttributeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        res.success = False
    return res


@dataclass(frozen=True)
class ServeMatrix:
    name: str
    concurrency: tuple[int, ...]
    input_len: tuple[int, ...]
    output_len: tuple[int, ...]
    prompts_per_concurrency: int = 4  # num_prompts = max(min_prompts, prompts_per_concurrency * concurrency)
    min_prompts: int = 4
    warmup: int = 1  # requests per cell before timing (not measured)
    # False: all requests dispatched at t=0, at most `concurrency` in flight (vLLM --max-concurrency).
    # True: waves of `concurrency` requests, each wave after the previous one finished: the online twin of the
    # offline matrix's batch (same batch from prefill to last token), so online/offline shows serving overhead.
    waves: bool = False
    seed: int = 0
    token_id_low: int = 10  # random prompt ids in [low, high); high defaults to the model's vocab (capped)
    token_id_high: int | None = None
    timeout_s: float = 600.0
    shared_prefix_len: int = 0  # chat trace: the system prompt every conversation shares (module docstring)
    turns: int = 1  # chat trace: turns per conversation (num_prompts conversations per cell)

    def __post_init__(self) -> None:
        axes.check_axes(self, ("concurrency", "input_len", "output_len"))
        if self.shared_prefix_len < 0 or self.turns < 1:
            raise ValueError(f"matrix {self.name!r}: shared_prefix_len must be >= 0 and turns >= 1")
        if self.prompts_per_concurrency < 1 or self.min_prompts < 1 or self.warmup < 0:
            raise ValueError(f"matrix {self.name!r}: prompts_per_concurrency/min_prompts must be >= 1, warmup >= 0")

    def num_prompts(self, concurrency: int) -> int:
        return max(self.min_prompts, self.prompts_per_concurrency * concurrency)

    @property
    def cells(self) -> list[tuple[int, int, int]]:
        """(concurrency, input_len, output_len), output slowest (the offline matrix's order)."""
        return axes.cells(self.concurrency, self.input_len, self.output_len)


def load_serve_matrix(name_or_path: str) -> ServeMatrix:
    """`matrices/<name>.toml` or a path. Keys: concurrency, input_len, output_len, plus ServeMatrix's optional ones
    (a `[serve]` table is accepted too)."""
    path = axes.resolve(name_or_path, kind="serve matrix", prefix="serve")
    return axes.load(ServeMatrix, path, section="serve", required=("concurrency", "input_len", "output_len"))


@dataclass(frozen=True)
class ServerInfo:
    model: str
    root: str | None
    max_model_len: int | None
    vocab_size: int | None


async def discover(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> ServerInfo:
    """Served model name from `/v1/models` (first entry), like vLLM. The vocabulary size (to draw prompt ids) from
    the card's `vocab_size` (deepinfer adds it), else `root`'s config.json or tokenizer.json when `root` is local."""
    r = await client.get(f"{base_url}/v1/models", headers=headers)
    r.raise_for_status()
    card = r.json()["data"][0]
    root = card.get("root")
    vocab = card.get("vocab_size")
    if vocab is None and isinstance(root, str) and Path(root).is_dir():
        if (Path(root) / "config.json").is_file():
            vocab = json.loads((Path(root) / "config.json").read_text()).get("vocab_size")
        elif (Path(root) / "tokenizer.json").is_file():
            tok = json.loads((Path(root) / "tokenizer.json").read_text())
            vocab = len(tok.get("model", {}).get("vocab", {})) or None
    return ServerInfo(card["id"], root, card.get("max_model_len"), vocab)


def _pct(xs: list[float], q: float) -> float:
    """Percentile of seconds, in ms (NaN when empty)."""
    return quantiles(xs, q)[0] * 1e3


def summarize(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    """vLLM's `calculate_metrics` over one cell (failed requests excluded from latency stats)."""
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    e2els = [r.latency for r in ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_len for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration_s,
        "ttft_ms_mean": float(np.mean(ttfts)) * 1e3 if ttfts else float("nan"),
        "ttft_ms_p50": _pct(ttfts, 50), "ttft_ms_p90": _pct(ttfts, 90), "ttft_ms_p99": _pct(ttfts, 99),
        "tpot_ms_mean": float(np.mean(tpots)) * 1e3 if tpots else float("nan"),
        "tpot_ms_p50": _pct(tpots, 50), "tpot_ms_p90": _pct(tpots, 90), "tpot_ms_p99": _pct(tpots, 99),
        "itl_ms_p50": _pct(itls, 50), "itl_ms_p90": _pct(itls, 90), "itl_ms_p99": _pct(itls, 99),
        "e2el_ms_p50": _pct(e2els, 50), "e2el_ms_p90": _pct(e2els, 90),
        "request_throughput": len(ok) / duration_s if duration_s > 0 else float("nan"),
        "output_tok_s": out_tok / duration_s if duration_s > 0 else float("nan"),
        "total_tok_s": (in_tok + out_tok) / duration_s if duration_s > 0 else float("nan"),
        "mean_prompt_tokens": in_tok / len(ok) if ok else float("nan"),
        "mean_output_tokens": out_tok / len(ok) if ok else float("nan"),
    }


async def run_cell(client: httpx.AsyncClient, base_url: str, info: ServerInfo, m: ServeMatrix, concurrency: int,
                   input_len: int, output_len: int, headers: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
    """One cell: warmup, then `num_prompts` requests, at most `concurrency` in flight (see ServeMatrix.waves)."""
    row: dict[str, Any] = {"concurrency": concurrency, "input_len": input_len, "output_len": output_len,
                           "num_prompts": m.num_prompts(concurrency), "status": "ok", "skip_reason": ""}
    if info.max_model_len is not None and input_len + output_len > info.max_model_len:
        row.update(status="skipped", skip_reason=f"input_len + output_len > max_model_len={info.max_model_len}")
        return row, []
    hi = m.token_id_high or min(info.vocab_size or 1000, 32000)  # unknown vocab: stay low, every tokenizer has 1000
    rng = random.Random(f"{m.seed}-{concurrency}-{input_len}-{output_len}")
    url = f"{base_url}/v1/completions"

    def ids(n: int) -> list[int]:
        return [rng.randrange(m.token_id_low, hi) for _ in range(n)]

    def payload(prompt: list[int] | None = None) -> dict[str, Any]:
        return {"model": info.model, "prompt": ids(input_len) if prompt is None else prompt,
                "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True, "repetition_penalty": 1.0,
                "logprobs": None, "stream": True, "stream_options": {"include_usage": True}}

    if m.turns > 1 or m.shared_prefix_len:
        longest = m.shared_prefix_len + m.turns * input_len + (m.turns - 1) * output_len
        if info.max_model_len is not None and longest + output_len > info.max_model_len:
            row.update(status="skipped", skip_reason=f"the last turn ({longest} + {output_len} tokens) > "
                                                     f"max_model_len={info.max_model_len}")
            return row, []
        return await _chat_cell(client, url, m, concurrency, input_len, output_len, headers, ids, payload, row)

    for _ in range(m.warmup):
        await send_completion(client, url, payload(), headers, input_len)
    sem = asyncio.Semaphore(concurrency)

    async def one(p: dict[str, Any]) -> RequestResult:
        async with sem:
            return await send_completion(client, url, p, headers, input_len)

    payloads = [payload() for _ in range(row["num_prompts"])]
    t0 = time.perf_counter()
    if m.waves:
        results = []
        for k in range(0, len(payloads), concurrency):
            results += await asyncio.gather(*(one(p) for p in payloads[k:k + concurrency]))
    else:
        results = await asyncio.gather(*(one(p) for p in payloads))
    row.update(summarize(list(results), time.perf_counter() - t0))
    errors = sorted({r.error for r in results if not r.success})
    if row["failed"]:
        row.update(status="failed" if not row["completed"] else "partial", skip_reason="; ".join(errors)[:200])
    return row, errors


async def _chat_cell(client: httpx.AsyncClient, url: str, m: ServeMatrix, concurrency: int, input_len: int,
                     output_len: int, headers: dict[str, str], ids: Callable[[int], list[int]],
                     payload: Callable[[list[int]], dict[str, Any]], row: dict[str, Any],
                     ) -> tuple[dict[str, Any], list[str]]:
    """A chat-trace cell (module docstring): `num_prompts` conversations of `turns` turns; one row over all turns."""
    system = ids(m.shared_prefix_len)
    for _ in range(m.warmup):
        await send_completion(client, url, payload(ids(m.shared_prefix_len + input_len)), headers,
                              m.shared_prefix_len + input_len)
    convs = [[ids(input_len) for _ in range(m.turns)] for _ in range(row["num_prompts"])]
    sem = asyncio.Semaphore(concurrency)

    async def conversation(turns: list[list[int]]) -> list[RequestResult]:
        async with sem:
            history, out = list(system), []
            for k, user in enumerate(turns):
                history += user
                out.append(await send_completion(client, url, payload(list(history)), headers, len(history)))
                if k + 1 < len(turns):
                    history += ids(output_len)
            return out

    t0 = time.perf_counter()
    results = [r for rs in await asyncio.gather(*(conversation(c) for c in convs)) for r in rs]
    row.update(summarize(results, time.perf_counter() - t0), num_prompts=len(results))
    errors = sorted({r.error for r in results if not r.success})
    if row["failed"]:
        row.update(status="failed" if not row["completed"] else "partial", skip_reason="; ".join(errors)[:200])
    return row, errors


async def run_serve_matrix_async(base_url: str, matrix: ServeMatrix, *, api_key: str | None = None,
                                 progress: Callable[[int, int, dict[str, Any]], None] | None = None,
                                 ) -> tuple[pd.DataFrame, ServerInfo]:
    base_url = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    top = max(matrix.concurrency)
    limits = httpx.Limits(max_connections=top + 1, max_keepalive_connections=top + 1)
    timeout = httpx.Timeout(matrix.timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        info = await discover(client, base_url, headers)
        rows = []
        cells = matrix.cells
        for k, (c, i, o) in enumerate(cells):
            row, _ = await run_cell(client, base_url, info, matrix, c, i, o, headers)
            rows.append(row)
            if progress:
                progress(k + 1, len(cells), row)
    return pd.DataFrame(rows, columns=COLUMNS), info


def run_serve_matrix(base_url: str, matrix: ServeMatrix, *, api_key: str | None = None,
                     progress: Callable[[int, int, dict[str, Any]], None] | None = None,
                     ) -> tuple[pd.DataFrame, ServerInfo]:
    """Sweep every cell of `matrix` against the server at `base_url`; one row per cell (columns: COLUMNS)."""
    return asyncio.run(run_serve_matrix_async(base_url, matrix, api_key=api_key, progress=progress))


def pivot_tables(df: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(title, table) per p50 metric, output length (and variant, when the sweep has several): rows concurrency,
    columns input length."""
    out = []
    keys = (["variant"] if "variant" in df else []) + ["output_len"]
    for metric in ("ttft_ms_p50", "tpot_ms_p50"):
        for key, part in df[df.status != "skipped"].groupby(keys):
            *v, o = key
            pivot = part.pivot(index="concurrency", columns="input_len", values=metric)
            pivot.columns = [f"in={c}" for c in pivot.columns]
            pivot.index = pivot.index.astype(str)  # keep ints ints through a row-wise formatter
            out.append((" ".join([*map(str, v), f"{metric} (output_len={o}; rows concurrency, columns input_len)"]),
                        pivot.reset_index()))
    return out


def compare_offline(online: pd.DataFrame, offline: pd.DataFrame) -> pd.DataFrame:
    """Join on (concurrency = batch_size, input_len, output_len): online/offline ratios of TTFT and TPOT p50."""
    off = offline.rename(columns={"batch_size": "concurrency"})
    keep = ["concurrency", "input_len", "output_len", "ttft_ms_p50", "tpot_ms_p50"]
    merged = online[keep].merge(off[keep], on=keep[:3], suffixes=("_online", "_offline"))
    merged["ttft_online_offline"] = merged["ttft_ms_p50_online"] / merged["ttft_ms_p50_offline"]
    merged["tpot_online_offline"] = merged["tpot_ms_p50_online"] / merged["tpot_ms_p50_offline"]
    return merged
