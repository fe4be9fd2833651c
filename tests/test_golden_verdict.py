"""The three-way verdict (deepinfer_bench/bench/verdict.py), the reference cache (refcache.py) and `--per-layer`: known
bugs seeded into the engine by test-only patches are named at the right layer, module and positions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import engine.model.attention as A
from deepinfer_bench.bench import verdict as V
from deepinfer_bench.bench.golden import GOLDEN_DIR, golden_config, load_golden, run_golden
from deepinfer_bench.bench.refcache import ReferenceMissing, Sequence, get_reference
from engine.config import ModelConfig
from engine.model.layers import rope_inv_freq

PROMPT = "ids_64"  # 64 prompt positions (one prefill step) + 31 decode positions 64..94


def _noise(seed: int, shape: tuple[int, ...], scale: float) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_error_stats_pass_within_the_expected_noise_and_fail_beyond_it() -> None:
    base = _noise(0, (4, 1000), 3.0)
    expected = base + _noise(1, (4, 1000), 0.1)
    same = base + _noise(2, (4, 1000), 0.1)  # another run exactly as noisy: inside the band
    worse = base + _noise(3, (4, 1000), 0.3)  # three times the expected noise: outside
    s = V.error_stats(same, expected, base)
    assert s["passed"].all() and (s["bhattacharyya"] > 0.99).all()
    w = V.error_stats(worse, expected, base)
    assert not w["passed"].any()
    assert torch.allclose(w["sigma_ratio"], torch.full((4,), 3.0, dtype=torch.float64), rtol=0.1)
    exact = V.error_stats(same, base, base)  # expected = baseline (an fp32 run): no band at all
    assert torch.isinf(exact["sigma_ratio"]).all() and not exact["passed"].any()


def test_topk_fallback_and_token_table() -> None:
    expected = _noise(4, (3, 2000), 3.0)
    assert V.topk_ok(expected.clone(), expected).all()
    off = expected.clone()
    off[1, expected[1].argmax()] += 1.0  # the top token moves by ~10 %
    assert V.topk_ok(off, expected).tolist() == [True, False, True]
    rows = V.token_table(off, expected, expected)
    assert [r["passed"] for r in rows] == [True, False, True]
    assert rows[1]["kld"] > 0 and rows[0]["kld"] == 0
    s = V.prompt_summary(rows)
    assert (s["first_failing_step"], s["tokens_passed"], s["worst_step"]) == (1, 2, 1)
    assert s["kld_ratio"] == float("inf") and s["sigma_ratio_pooled"] == float("inf")
    # expected = baseline: no noise band, so any error fails the run and the prompt
    band = V.run_verdict([s])
    assert not band["passed"] and not band["run_passed"] and s["verdict"] == "mismatch"


def test_prompt_summary_pools_over_the_prompt() -> None:
    """Pooled over the prompt: an isolated token where the expected run sits unusually close to fp32 fails the
    per-token rule, not the pooled numbers; a target twice as noisy at every token doubles the pooled sigma-ratio."""
    n, vocab = 40, 2000
    base = _noise(5, (n, vocab), 1.0)  # logits spread small enough that the static top-k map fails too
    scale = torch.full((n, 1), 0.1)
    scale[7] = 0.005  # the one step where the expected run happens to be 20x closer to fp32
    expected = base + _noise(6, (n, vocab), 1.0) * scale
    same = base + _noise(7, (n, vocab), 0.1)
    s = V.prompt_summary(V.token_table(same, expected, base))
    assert (s["first_failing_step"], s["worst_step"], s["tokens_passed"]) == (7, 7, n - 1)
    assert s["sigma_ratio_max"] > 10
    assert 0.9 < s["sigma_ratio_pooled"] < 1.1 and 0.8 < s["kld_ratio"] < 1.2 and s["bhattacharyya_pooled"] > 0.999
    worse = base + _noise(8, (n, vocab), 0.2)
    w = V.prompt_summary(V.token_table(worse, expected, base))
    assert 1.8 < w["sigma_ratio_pooled"] < 2.2 and w["kld_ratio"] > 3 and w["bhattacharyya_pooled"] < 0.99


def _summaries(target: torch.Tensor, draws: torch.Tensor) -> list[dict]:
    """Per-prompt summaries as run_verdict reads them: mean KLDs of the target [P] and of the draws [P, D]."""
    return [{"tokens_total": 32, "kld_mean": float(t), "kld_draws": d.tolist(), "kld_draws_max": float(d.max())}
            for t, d in zip(target, draws, strict=True)]


def test_run_verdict_band_is_the_spread_of_the_draws() -> None:
    """12 prompts whose KLD varies 30x between prompts and ~1.5x between six draws: one more draw passes; a prompt
    100x above its draws is the outlier named; a target 3x noisier at every prompt fails the run-level test."""
    g = torch.Generator().manual_seed(9)
    level = torch.exp(torch.randn(12, 1, generator=g) * 1.2) * 1e-2  # prompts differ a lot
    draws = level * torch.exp(torch.randn(12, 6, generator=g) * 0.4)
    one_more = level[:, 0] * torch.exp(torch.randn(12, generator=g) * 0.4)
    band = V.run_verdict(rows := _summaries(one_more, draws))
    assert band["passed"] and band["prompts_passed"] == 12, (band, [r["outlier_z"] for r in rows])
    assert min(band["kld_run_draws"]) <= band["kld_run_limit"] and max(band["kld_run_draws"]) <= band["kld_run_limit"]
    spike = one_more.clone()
    spike[4] *= 100  # one prompt far outside: a bug at positions only that prompt reaches
    band = V.run_verdict(rows := _summaries(spike, draws))
    assert not band["passed"] and [r["verdict"] for r in rows].count("mismatch") == 1
    assert rows[4]["verdict"] == "mismatch" and rows[4]["outlier_z"] > V.PROMPT_OUTLIER_Z
    band = V.run_verdict(rows := _summaries(one_more * 3, draws))
    assert not band["run_passed"] and not band["passed"] and band["kld_run"] > band["kld_run_limit"]


def test_layer_table_names_the_residues_of_the_positions_outside() -> None:
    rows = [{"layer": layer, "module": m, "position": p, "sigma_ratio": 1.0, "bhattacharyya": 1.0,
             "max_abs_err": 0.0, "cosine": 1.0, "outside": layer == 1 and m == "ffn" and p % 4 == 3}
            for layer in range(2) for m in V.MODULES for p in range(40)]
    table = V.layer_table(rows, [0, 4])
    hit = [r for r in table if r["outside"]]
    assert [(r["layer"], r["module"], r["outside"], r["outside_mod4"]) for r in hit] == [(1, "ffn", 10, "3")]
    assert V.first_divergence(rows) == {"layer": 1, "module": "ffn", "positions": list(range(3, 40, 4))}


@pytest.fixture(scope="module")
def one_prompt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(golden dir holding only PROMPT of the committed golden, a reference cache dir shared by this module)."""
    from safetensors.torch import load_file, save_file

    where = tmp_path_factory.mktemp("golden1")
    meta = json.loads((GOLDEN_DIR / "golden.json").read_text())
    meta["prompts"] = [p for p in meta["prompts"] if p["name"] == PROMPT]
    (where / "golden.json").write_text(json.dumps(meta))
    tensors = load_file(str(GOLDEN_DIR / "golden.safetensors"))
    save_file({k: v for k, v in tensors.items() if k.startswith(PROMPT + ".")}, str(where / "golden.safetensors"))
    return where, tmp_path_factory.mktemp("refcache")


def test_reference_cache_is_made_once_and_read_back(one_prompt: tuple[Path, Path], monkeypatch) -> None:
    golden, cache = one_prompt
    cfg = ModelConfig.from_json(GOLDEN_DIR / "tiny")
    _, (p,) = load_golden(golden, cfg)
    seqs = [Sequence(p.name, p.prompt_ids, p.output_ids)]
    ref = get_reference(GOLDEN_DIR / "tiny", cfg, seqs, cache_dir=cache)
    # the fp32 reference, teacher-forced in one forward, is the HF golden's greedy run (cached decode) to 1e-4
    assert (ref.logits["float32"][p.name] - p.logits).abs().max() < 1e-4
    assert 0.1 < (ref.logits["bfloat16"][p.name] - p.logits).abs().max() < 10  # bf16 is another run
    import deepinfer_bench.bench.refcache as R

    monkeypatch.setattr(R, "_make", lambda *a: pytest.fail("the cached reference was made again"))
    monkeypatch.setitem(sys.modules, "transformers", None)  # a trn2 host: no transformers, the cache suffices
    again = get_reference(GOLDEN_DIR / "tiny", cfg, seqs, cache_dir=cache)
    assert again.key == ref.key and torch.equal(again.logits["bfloat16"][p.name], ref.logits["bfloat16"][p.name])
    with pytest.raises(ReferenceMissing, match="transformers is not installed"):
        get_reference(GOLDEN_DIR / "tiny", cfg, [Sequence(p.name, p.prompt_ids, p.output_ids[:-1])],
                      cache_dir=cache)


# The seeded bugs: test-only patches of the engine, each undone by monkeypatch.
def _rope_base_in_layer_2(monkeypatch: pytest.MonkeyPatch) -> None:
    init = A.Attention.__init__

    def patched(self, cfg, layer_id, par=None):
        init(self, cfg, layer_id, par)
        if layer_id == 2:
            r = self.rope
            r.key = (r.key[0], r.key[1] * 4, r.key[2])  # another key: layer 2 gets its own (wrong) table
            r.inv_freq = rope_inv_freq(*r.key)

    monkeypatch.setattr(A.Attention, "__init__", patched)


def _entries_visible_one_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps of the ratio-16 layer (layer 2) see compressed entry w at position 16 w + 14, one position
    before its block closes (the community port's off-by-one, there at ratio 4)."""
    visible = A.Attention._visible

    def patched(self, pos):
        if self.ratio != 16:
            return visible(self, pos)
        v = ((pos + 2) // self.ratio)[:, None]
        return v, self._entry_ids(v)

    monkeypatch.setattr(A.Attention, "_visible", patched)


def _ring_drops_last_row(monkeypatch: pytest.MonkeyPatch) -> None:
    write = A.write_ring

    def patched(win_kv, slots, rows, kv):
        keep = rows != win_kv.shape[1] - 1
        if isinstance(slots, torch.Tensor) and slots.shape == rows.shape:
            slots = slots[keep]
        write(win_kv, slots, rows[keep], kv[keep])

    monkeypatch.setattr(A, "write_ring", patched)


def _per_layer(one_prompt: tuple[Path, Path], dtype: str = "float32"):
    golden, cache = one_prompt
    run = run_golden(golden_config(golden_dir=golden, dtype=dtype, kernels="reference"), golden, reference_dir=cache,
                     per_layer=[PROMPT])
    return run, run.per_layer[0]


@pytest.mark.slow
def test_per_layer_clean_engine_stays_inside_everywhere(one_prompt: tuple[Path, Path]) -> None:
    run, pl = _per_layer(one_prompt)
    assert run.ok and pl.first is None, pl.table.to_string()
    assert len(pl.positions) == 4 * 2 * 95 and (pl.table["outside"] == 0).all()
    # the KV state: every layer's window, and the compressed entries / indexer keys of its compressors, all there
    assert set(pl.kv["kind"]) == set(V.KV_KINDS) and (pl.kv["outside"] == 0).all(), pl.kv.to_string()
    assert (pl.kv["rows"] == pl.kv["engine_rows"]).all() and (pl.kv["cosine_min"] > 0.9999).all()


@pytest.mark.slow
@pytest.mark.parametrize("bug, layer, positions", [
    (_rope_base_in_layer_2, 2, list(range(1, 95))),  # every position but 0, where every rotation is the identity
    (_entries_visible_one_early, 2, [78, 94]),  # the decode positions = 14 mod 16
    (_ring_drops_last_row, 0, list(range(64, 95))),  # every decode step reads a ring missing a row of its window
])
def test_per_layer_names_the_seeded_bug(one_prompt: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, bug,
                                        layer: int, positions: list[int]) -> None:
    bug(monkeypatch)
    run, pl = _per_layer(one_prompt)
    assert not run.ok
    assert pl.first == {"layer": layer, "module": "attn", "positions": positions}, pl.table.to_string()
    if bug is _rope_base_in_layer_2:  # the KV state: layer 2's window keys and entries are rotated wrong, not before
        kv = pl.kv.set_index(["layer", "kind"])["outside"]
        assert kv[(2, "kv_window")] > 0 and kv[(2, "kv_entries")] > 0 and (kv.loc[[0, 1]] == 0).all(), pl.kv.to_string()
    earlier = pl.table[(pl.table["layer"] < layer) | ((pl.table["layer"] == layer) & (pl.table["module"] != "attn")
                                                      & (pl.table["outside"] == 0))]
    assert (earlier["outside"] == 0).all()


@pytest.mark.slow
def test_bf16_band_passes_the_clean_engine_and_fails_a_seeded_bug(tmp_path_factory: pytest.TempPathFactory,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole tiny golden in bf16, three-way: the clean engine is inside the band of the six reference draws;
    a wrong RoPE base in layer 2 is outside it (its run KLD ~5x the clean engine's, ~1.7x the band's limit)."""
    cache = tmp_path_factory.mktemp("refcache-bf16")
    clean = run_golden(golden_config(dtype="bfloat16"), GOLDEN_DIR, reference_dir=cache)
    band = clean.meta["band"]
    assert clean.ok and band["run_passed"] and len(band["kld_run_draws"]) == 6, clean.table.to_string()
    _rope_base_in_layer_2(monkeypatch)
    bad = run_golden(golden_config(dtype="bfloat16"), GOLDEN_DIR, reference_dir=cache)
    assert not bad.ok and not bad.meta["band"]["run_passed"], bad.meta["band"]
    assert bad.meta["band"]["kld_run"] > bad.meta["band"]["kld_run_limit"] > band["kld_run"]
