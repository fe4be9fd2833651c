"""Offline TTFT/TPOT matrix (`deepinfer bench matrix`): batch size x input length x output length through the engine.

A matrix is a TOML file in `matrices/` (axes, warmup, repeats, optional engine sizing). One engine serves every
cell; per cell: `warmup` runs (decode capped at `warmup_output_len`), then `repeats` timed runs of a batch of
`batch_size` random token-id prompts of `input_len` tokens, greedy, `ignore_eos`, `max_tokens = output_len`.

Metrics follow sglang `bench_one_batch` / vLLM:
- TTFT: from queueing the batch until EVERY request of it has its first token (prefill + first sample; with a
  token budget below batch x input the prefill spans several steps, all counted);
- TPOT: the duration of each later engine step (one token for every request; with speculative decoding divided by
  the run's tokens per step), pooled over repeats;
- e2e: queueing to the last token; prefill_tok_s = B*I / TTFT p50; decode_tok_s = B / TPOT p50;
- kv_blocks_used: the pool's high-water mark during the timed runs.
Cells that cannot run on this engine (too many sequences, context or blocks) get `status="skipped"` and a reason;
a cell whose run raises a RuntimeError/MemoryError (device OOM, compile failure) gets `status="error"` and the
message, and the matrix goes on.
The library returns a DataFrame and prints nothing; the command renders it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from deepinfer_bench.bench import axes
from deepinfer_bench.bench.axes import MATRICES_DIR
from deepinfer_bench.bench.batch_run import random_prompts, run_batch
from engine.config import EngineConfig, Workload
from engine.llm import LLMEngine, RequestRejected
from engine.profiling import quantiles

__all__ = ["COLUMNS", "MATRICES_DIR", "MatrixSpec", "Row", "engine_sizing", "pivot", "resolve_matrix", "run_cell",
           "run_matrix", "save_plot", "skip_reason"]

COLUMNS = [
    "batch_size", "input_len", "output_len", "ttft_ms_p50", "ttft_ms_p90", "tpot_ms_p50", "tpot_ms_p90",
    "e2e_ms_p50", "e2e_ms_p90", "prefill_tok_s", "decode_tok_s", "kv_blocks_used", "num_preemptions", "repeats",
    "tokens_per_step", "acceptance_rate", "status", "skip_reason",
]

Progress = Callable[[int, int, str], None]  # (cells done, cells total, label of the cell starting or "")


@dataclass(frozen=True)
class MatrixSpec:
    name: str
    batch_size: tuple[int, ...]
    input_len: tuple[int, ...]
    output_len: tuple[int, ...]
    description: str = ""
    warmup: int = 1
    repeats: int = 3
    warmup_output_len: int = 8  # a shorter decode is enough to warm up (sglang caps it the same way)
    seed: int = 0
    # Engine sizing; None = derived from the axes so that every cell fits (see `engine_config`).
    dtype: str = "float32"
    max_num_batched_tokens: int | None = None
    num_kv_blocks: int | None = None
    block_size: int | None = None
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        axes.check_axes(self, ("batch_size", "input_len", "output_len"))
        if self.warmup < 0 or self.repeats < 1 or self.warmup_output_len < 1:
            raise ValueError(f"matrix {self.name!r}: need warmup >= 0, repeats >= 1, warmup_output_len >= 1 "
                             f"(got {self.warmup}, {self.repeats}, {self.warmup_output_len})")
        for name in ("max_num_batched_tokens", "num_kv_blocks", "block_size", "max_model_len"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"matrix {self.name!r}: {name} must be a positive int, got {v!r}")

    @property
    def cells(self) -> list[tuple[int, int, int]]:
        """(batch_size, input_len, output_len), output slowest, then input, then batch."""
        return axes.cells(self.batch_size, self.input_len, self.output_len)

    @classmethod
    def from_toml(cls, path: str | Path) -> MatrixSpec:
        return axes.load(cls, Path(path), required=("batch_size", "input_len", "output_len"))


def resolve_matrix(name_or_path: str | Path) -> Path:
    """A TOML path, or the name of a file in `matrices/` (`quick` -> matrices/quick.toml)."""
    return axes.resolve(name_or_path)


def engine_sizing(spec: MatrixSpec) -> tuple[Workload, dict[str, Any]]:
    """What the matrix runs - slots for the largest batch, context for the longest cell, a pool for the biggest cell,
    a prefill budget of the largest batch x input - and the settings the matrix file fixes (dtype, seed, and any
    engine size it sets). The command's --max-num-seqs etc. override both; the block size follows cp."""
    cells = spec.cells
    longest = max(i + o for _, i, o in cells)
    work = Workload(max_num_seqs=max(spec.batch_size), max_model_len=spec.max_model_len or longest,
                    pool=tuple((i + o,) * b for b, i, o in cells),
                    max_num_batched_tokens=spec.max_num_batched_tokens or max(b * i for b, i, _ in cells))
    fixed = {"dtype": spec.dtype, "seed": spec.seed, "block_size": spec.block_size, "num_kv_blocks": spec.num_kv_blocks,
             "max_model_len": spec.max_model_len, "max_num_batched_tokens": spec.max_num_batched_tokens}
    return work, {k: v for k, v in fixed.items() if v is not None}


@dataclass
class Row:
    batch_size: int
    input_len: int
    output_len: int
    ttft_ms_p50: float = math.nan
    ttft_ms_p90: float = math.nan
    tpot_ms_p50: float = math.nan
    tpot_ms_p90: float = math.nan
    e2e_ms_p50: float = math.nan
    e2e_ms_p90: float = math.nan
    prefill_tok_s: float = math.nan
    decode_tok_s: float = math.nan
    kv_blocks_used: int = 0
    num_preemptions: int = 0
    repeats: int = 0
    tokens_per_step: float = math.nan  # tokens each sequence gets per decode step (> 1 with speculative decoding)
    acceptance_rate: float = math.nan  # accepted / drafted tokens (speculative decoding only)
    status: str = "ok"
    skip_reason: str = ""


def skip_reason(config: EngineConfig, batch_size: int, input_len: int, output_len: int) -> str:
    """Why this cell cannot run on an engine with `config` ("" if it can)."""
    c = config.cache
    if batch_size > c.max_num_seqs:
        return f"batch_size {batch_size} > max_num_seqs {c.max_num_seqs}"
    if input_len + output_len > c.max_model_len:
        return f"input_len + output_len = {input_len + output_len} exceeds max_model_len {c.max_model_len}"
    need = batch_size * -(-(input_len + output_len) // c.block_size)
    if need > c.num_kv_blocks:
        return f"needs {need} KV blocks of {c.block_size} tokens, the pool has {c.num_kv_blocks}"
    return ""


def run_cell(engine: LLMEngine, spec: MatrixSpec, batch_size: int, input_len: int, output_len: int) -> Row:
    row = Row(batch_size, input_len, output_len)
    reason = skip_reason(engine.config, batch_size, input_len, output_len)
    if reason:
        row.status, row.skip_reason = "skipped", reason
        return row

    def prompts(run: int) -> list[list[int]]:
        return random_prompts(engine.vocab_size, batch_size, input_len,
                              f"{spec.seed}-{batch_size}-{input_len}-{output_len}-{run}")

    try:
        for w in range(spec.warmup):
            run_batch(engine, prompts(-1 - w), min(output_len, spec.warmup_output_len))
        engine.reset_peak_usage()
        before = engine.stats()
        preempt0 = before.num_preemptions
        runs = [run_batch(engine, prompts(r), output_len) for r in range(spec.repeats)]
    except RequestRejected as e:
        row.status, row.skip_reason = "skipped", str(e)
        return row
    except (RuntimeError, MemoryError) as e:  # e.g. device OOM or a compile failure: record it, go on
        for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
            engine.abort(seq.seq_id)
        engine.step()  # drain the abort outputs
        row.status, row.skip_reason = "error", f"{type(e).__name__}: {e}"[:300]
        return row
    ttft = [r.ttft_s * 1e3 for r in runs]
    e2e = [r.e2e_s * 1e3 for r in runs]
    # TPOT per output token: each decode step's time over the tokens a sequence gets per step in that run (1 without
    # speculative decoding; the run's mean accepted length + 1 with it)
    tpot = [s * 1e3 * len(r.decode_steps_s) / (output_len - 1) for r in runs for s in r.decode_steps_s]
    row.ttft_ms_p50, row.ttft_ms_p90 = quantiles(ttft, 50, 90)
    row.tpot_ms_p50, row.tpot_ms_p90 = quantiles(tpot, 50, 90)
    row.e2e_ms_p50, row.e2e_ms_p90 = quantiles(e2e, 50, 90)
    row.prefill_tok_s = batch_size * input_len / (row.ttft_ms_p50 / 1e3)
    row.decode_tok_s = batch_size / (row.tpot_ms_p50 / 1e3) if tpot else math.nan
    stats = engine.stats()
    steps = sum(len(r.decode_steps_s) for r in runs)
    row.tokens_per_step = len(runs) * (output_len - 1) / steps if steps else math.nan
    drafted = stats.spec_num_draft_tokens - before.spec_num_draft_tokens
    if drafted:
        row.acceptance_rate = (stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens) / drafted
    row.kv_blocks_used = stats.peak_used_blocks
    row.num_preemptions = stats.num_preemptions - preempt0
    row.repeats = len(runs)
    return row


def _matrix_job(engine: LLMEngine, spec: MatrixSpec, progress: Progress | None) -> pd.DataFrame:
    cells = spec.cells
    rows = []
    for k, (b, i, o) in enumerate(cells):
        if progress:
            progress(k, len(cells), f"batch={b} in={i} out={o}")
        rows.append(run_cell(engine, spec, b, i, o))
    if progress:
        progress(len(cells), len(cells), "")
    df = pd.DataFrame([asdict(r) for r in rows], columns=COLUMNS)
    backend = getattr(engine.runner, "backend", None)  # the backend's counters of the whole run
    df.attrs["backend"] = backend.counters().to_dict() if backend is not None else {}
    cache = getattr(engine.runner, "cache", None)  # the KV layout's bytes per token of context (--kv-cache-dtype)
    df.attrs["kv_cache_bytes_per_token"] = cache.bytes_per_token if cache is not None else None
    return df


def run_matrix(spec: MatrixSpec, config: EngineConfig, *, runner: Any = None,
               progress: Progress | None = None) -> pd.DataFrame:
    """Run every cell of `spec` on one engine built from `config` (or over `runner`); one row per cell.
    With config.cp > 1 the engine runs on cp ranks (rank 0 schedules; no per-cell progress across processes)."""
    if runner is None:
        from engine import run_job

        return run_job(config, _matrix_job, (spec, progress if config.cp <= 1 else None))
    engine = LLMEngine(config, runner)
    return _matrix_job(engine, spec, progress)


def pivot(df: pd.DataFrame, metric: str) -> dict[int, pd.DataFrame]:
    """One table per output_len: rows batch_size, columns `in=<input_len>`, values `metric` (skipped cells NaN)."""
    out = {}
    for o, part in df.groupby("output_len", sort=True):
        t = part.pivot_table(index="batch_size", columns="input_len", values=metric, aggfunc="first", dropna=False)
        t = t.reindex(index=sorted(part["batch_size"].unique()), columns=sorted(part["input_len"].unique()))
        t.columns = [f"in={c}" for c in t.columns]
        out[int(o)] = t.reset_index()
    return out


def save_plot(df: pd.DataFrame, path: str | Path, title: str = "") -> Path:
    """PNG: TTFT p50 and TPOT p50 against batch size, one line per (input_len, output_len)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = df[df["status"] == "ok"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, label in ((axes[0], "ttft_ms_p50", "TTFT p50 (ms)"), (axes[1], "tpot_ms_p50", "TPOT p50 (ms)")):
        keys = (["variant"] if "variant" in ok else []) + ["input_len", "output_len"]
        for key, part in ok.groupby(keys, sort=True):
            part = part.sort_values("batch_size")
            *v, i, o = key
            ax.plot(part["batch_size"], part[metric], marker="o", label=" ".join([*map(str, v), f"in={i} out={o}"]))
        ax.set_xlabel("batch size")
        ax.set_ylabel(label)
        sizes = sorted(int(b) for b in ok["batch_size"].unique())
        if len(sizes) > 1:
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [str(b) for b in sizes])
            ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
