"""The throughput/interactivity trade-off of a sweep as InferenceX plots it: tokens/s per user (1000 / TPOT) against
total tokens/s, one curve per engine variant (speculation, prefix caching on or off) over the concurrency or batch
axis, its Pareto frontier, and MLPerf Inference's Interactive thresholds (p99 TTFT <= 1.5 s, TPOT <= 15 ms) marked.
Used by `deepinfer bench serve` and `bench matrix` (a PNG beside their CSV)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

MLPERF_TTFT_P99_MS = 1500.0  # MLPerf Inference Interactive scenario (the thresholds for DeepSeek)
MLPERF_TPOT_MS = 15.0


@dataclass(frozen=True)
class Axes:
    """Which columns of a sweep's DataFrame hold what the plot needs."""

    load: str  # the swept load: concurrency (serve) or batch_size (matrix)
    total_tok_s: str  # generated tokens/s over all users
    tpot_ms: str  # per-user time per output token (tokens/s per user = 1000 / this)
    tpot_p99_ms: str | None = None  # for the MLPerf mark (None: tpot_ms)
    ttft_p99_ms: str | None = None  # for the MLPerf mark (None: TTFT not judged)


SERVE = Axes(load="concurrency", total_tok_s="output_tok_s", tpot_ms="tpot_ms_p50", tpot_p99_ms="tpot_ms_p99",
             ttft_p99_ms="ttft_ms_p99")
MATRIX = Axes(load="batch_size", total_tok_s="decode_tok_s", tpot_ms="tpot_ms_p50", tpot_p99_ms="tpot_ms_p90",
              ttft_p99_ms="ttft_ms_p90")  # the offline matrix keeps p50/p90 only: the marks use p90 there


def points(df: pd.DataFrame, ax: Axes, variant: str = "variant") -> pd.DataFrame:
    """One row per ok cell: variant, load, per_user (tok/s), total (tok/s), meets_mlperf (bool)."""
    ok = df[df["status"] == "ok"] if "status" in df else df
    tpot = ok[ax.tpot_ms]
    tpot99 = ok[ax.tpot_p99_ms or ax.tpot_ms]
    meets = tpot99 <= MLPERF_TPOT_MS
    if ax.ttft_p99_ms is not None:
        meets &= ok[ax.ttft_p99_ms] <= MLPERF_TTFT_P99_MS
    out = pd.DataFrame({"variant": ok[variant] if variant in ok else "engine", "load": ok[ax.load],
                        "per_user": 1000.0 / tpot, "total": ok[ax.total_tok_s], "meets_mlperf": meets})
    return out.dropna(subset=["per_user", "total"]).reset_index(drop=True)


def frontier(pts: pd.DataFrame) -> pd.DataFrame:
    """The Pareto-optimal points (no other point has both more total and more per-user tokens/s), by total."""
    best, keep = -1.0, []
    for i, r in pts.sort_values(["total", "per_user"], ascending=False).iterrows():
        if r["per_user"] > best:
            keep.append(i)
            best = r["per_user"]
    return pts.loc[keep].sort_values("total")


def save_pareto(df: pd.DataFrame, path: str | Path, ax: Axes, title: str = "") -> Path:
    """PNG at `path`: each variant's points joined in load order (labelled with the load), filled where they meet
    the MLPerf Interactive thresholds, the frontier over all variants dashed, the TPOT threshold as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = points(df, ax)
    fig, axis = plt.subplots(figsize=(8, 5.5))
    for name, part in pts.groupby("variant", sort=True):
        part = part.sort_values("load")
        line, = axis.plot(part["total"], part["per_user"], marker="o", markerfacecolor="none", label=str(name))
        hit = part[part["meets_mlperf"]]
        axis.plot(hit["total"], hit["per_user"], "o", color=line.get_color())
        for _, r in part.iterrows():
            axis.annotate(str(int(r["load"])), (r["total"], r["per_user"]), textcoords="offset points",
                          xytext=(4, 4), fontsize=7)
    if len(pts):
        f = frontier(pts)
        axis.plot(f["total"], f["per_user"], "k--", linewidth=1, alpha=0.6, marker="s", markersize=10,
                  markerfacecolor="none", label="Pareto frontier")
    axis.axhline(1000.0 / MLPERF_TPOT_MS, color="red", linestyle=":", linewidth=1,
                 label=f"MLPerf Interactive: TPOT <= {MLPERF_TPOT_MS:g} ms"
                       + (f", p99 TTFT <= {MLPERF_TTFT_P99_MS / 1000:g} s (filled: both met)"
                          if ax.ttft_p99_ms else ""))
    axis.set_xlabel(f"total tokens/s ({ax.total_tok_s})")
    axis.set_ylabel(f"tokens/s per user (1000 / {ax.tpot_ms})")
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)
    axis.set_title(title or f"throughput vs interactivity (points labelled with {ax.load})", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
