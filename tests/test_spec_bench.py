"""scripts/spec_bench.py's verdict on issue 44's targets, and one real lockstep run of it on the tiny draft model."""

from __future__ import annotations

from pathlib import Path

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parent.parent
sb = load_script("scripts/spec_bench.py")


def _row(model: str, batch: int, method: str, policy: str, ratio: float, acceptance: float | None = None) -> dict:
    row = {"model": model, "batch": batch, "method": method, "policy": policy, "cpu_speedup_vs_plain": ratio,
           "cpu_speedup_median": ratio}
    return row | {"acceptance_all": acceptance}


def test_targets_pick_each_rows_bar_and_say_whether_it_is_met():
    rows = [_row("m/tiny-spec", 1, "none", "-", 1.0), _row("m/tiny-spec", 1, "mtp", "auto", 1.79, 0.8),
            _row("m/tiny-spec", 1, "mtp", "always", 1.9, 0.8), _row("m/tiny-spec", 8, "mtp", "auto", 0.951, 0.8),
            _row("m/dspark", 1, "dspark", "auto", 1.5, 0.4), _row("m/dspark", 8, "dspark", "auto", 0.949, 0.4),
            _row("m/mid", 1, "mtp", "auto", 0.84, 0.0), _row("m/mid", 1, "mtp", "always", 0.4, 0.01)]
    checks = sb.targets(rows, {"model_dir": "m/mid", "median_ratio": 0.21})
    got = {(c["model"], c["batch"], c["policy"]): (c["target"], c["met"]) for c in checks}
    assert got[("tiny-spec", 1, "auto")] == (">= 1.8x plain", False)  # only the auto rows are checked
    assert got[("tiny-spec", 8, "auto")] == (">= 0.95x plain", True)
    assert got[("dspark", 1, "auto")] == (">= 1.5x plain", True)
    assert got[("dspark", 8, "auto")] == (">= 0.95x plain", False)
    assert got[("mid", 1, "auto")] == ("a never-accepted draft costs <= 1.2x plain", True)  # 0.84 >= 1 / 1.2
    assert got[("mid", 1, "-")] == ("prefix hit TTFT <= 0.2x the first's", False)
    assert len(checks) == 6
    assert len(sb.targets(rows, None)) == 5


def test_a_lockstep_run_reports_every_setting_against_plain():
    rows = sb.bench_model(ROOT / "golden" / "tiny-spec", [2], [1], input_len=12, new=4, repeats=2, threads=1,
                          seed=3, policy="auto,off", warmup=2, aa=True)
    assert [(r["method"], r["policy"]) for r in rows] == [("none", "-"), ("none", "A/A"), ("mtp", "auto"),
                                                          ("mtp", "off")]
    assert all(r["repeats"] == 2 and r["cpu_ms_per_token"] > 0 for r in rows)
    assert rows[0]["cpu_speedup_vs_plain"] == 1.0
    off = rows[3]
    assert off["tokens_per_step"] == 1.0 and "acceptance_rate" not in off  # off: nothing drafted
    assert off["acceptance_all"] is None and rows[2]["acceptance_all"] is not None  # auto drafts at first
