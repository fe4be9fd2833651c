"""`deepinfer slice`: a self-consistent slice of a sharded official-format checkpoint generated here (not
committed): config rewritten, layers renumbered, experts cut with the router kept consistent, streamed."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from deepinfer_bench.bench.report import REPO_ROOT
from deepinfer_bench.cli import app
from engine.config import ModelConfig
from engine.loader import INDEX_FILE, expected_tensors, load_checkpoint

sys.path.insert(0, str(REPO_ROOT))
from golden.make_bench_model import PRESETS, write_model  # noqa: E402


def _check_slice(full: Path, sliced: Path, first: int, experts: int) -> None:
    src, cfg = ModelConfig.from_json(full), ModelConfig.from_json(sliced)
    assert cfg.n_routed_experts == experts and cfg.vocab_size == src.vocab_size and cfg.dim == src.dim
    assert list(cfg.compress_ratios) == list(src.compress_ratios[first:first + cfg.n_layers]) + \
        list(src.compress_ratios[src.n_layers:])
    a = load_checkpoint(full, src, dtype=torch.float32, layers=range(first, first + cfg.n_layers))
    b = load_checkpoint(sliced, cfg, dtype=torch.float32)  # every tensor the sliced config expects, shapes checked
    assert set(b) == set(expected_tensors(cfg))
    for name, t in b.items():
        block, _, rest = name.partition(".")
        if block == "layers":
            idx, _, suffix = rest.partition(".")
            old = f"layers.{int(idx) + first}.{suffix}"
        else:
            old = name
        if name.endswith("ffn.gate.weight") or name.endswith("ffn.gate.bias"):
            assert torch.equal(t, a[old][:experts])
        elif name.endswith("ffn.gate.tid2eid"):
            kept = a[old] < experts
            assert int(t.max()) < experts and torch.equal(t[kept], a[old][kept])  # kept experts stay put
            assert (t.sort(-1).values.diff(dim=-1) != 0).all()  # k distinct experts per token
        elif old in a:
            assert torch.equal(t, a[old]), name


def _slice(full: Path, out: Path, layers: str, experts: int) -> None:
    """`deepinfer slice` of `full` into `out`, which must succeed."""
    res = CliRunner().invoke(app, ["slice", "--model-dir", str(full), "--layers", layers, "--experts", str(experts),
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output


def test_slice_of_a_sharded_official_checkpoint(tmp_path: Path) -> None:
    cfg = PRESETS["test"].config(layers=3, mtp=1, hash_layers=2)
    full = tmp_path / "full"
    write_model(full, cfg, seed=7)
    out = tmp_path / "slice"
    _slice(full, out, "1-2", 4)
    raw = json.loads((out / "config.json").read_text())
    assert (raw["n_layers"], raw["n_hash_layers"], raw["n_mtp_layers"]) == (2, 1, 1)
    assert len(set(json.loads((out / INDEX_FILE).read_text())["weight_map"].values())) == 4  # globals, layers 1, 2, mtp
    _check_slice(full, out, first=1, experts=4)
    bad = CliRunner().invoke(app, ["slice", "--model-dir", str(full), "--layers", "2-5", "--out", str(out)])
    assert bad.exit_code == 2 and "the model has layers 0-2" in bad.output


def _one_prompt_golden(where: Path, name: str) -> Path:
    """A golden dir holding one prompt of the committed golden (its token sequence is what gets scored)."""
    from safetensors.torch import load_file, save_file

    from deepinfer_bench.bench.golden import GOLDEN_DIR

    where.mkdir(parents=True)
    meta = json.loads((GOLDEN_DIR / "golden.json").read_text())
    meta["prompts"] = [p for p in meta["prompts"] if p["name"] == name]
    (where / "golden.json").write_text(json.dumps(meta))
    tensors = load_file(str(GOLDEN_DIR / "golden.safetensors"))
    save_file({k: v for k, v in tensors.items() if k.startswith(name + ".")}, str(where / "golden.safetensors"))
    return where


def test_golden_on_a_slice_with_a_reference_made_by_deepinfer_reference(tmp_path: Path) -> None:
    """slice -> `deepinfer reference` -> `deepinfer golden --model-dir SLICE --reference DIR` (fp32: teacher-forced
    against the reference's fp32 logits, top-1 and 1e-3), the way a trn2 host uses a slice."""
    full, out, refs = tmp_path / "full", tmp_path / "slice", tmp_path / "refs"
    write_model(full, PRESETS["test"].config(layers=3, mtp=0, hash_layers=1), seed=5)
    cli = CliRunner()
    _slice(full, out, "1-2", 4)
    golden = _one_prompt_golden(tmp_path / "golden1", "text_fox")
    res = cli.invoke(app, ["reference", "--model-dir", str(out), "--golden-dir", str(golden), "--out", str(refs)])
    assert res.exit_code == 0, res.output
    res = cli.invoke(app, ["golden", "--model-dir", str(out), "--golden-dir", str(golden), "--reference", str(refs),
                           "--out", str(tmp_path / "runs")])
    assert res.exit_code == 0, res.output
    assert "1/1 prompts match" in res.output


@pytest.mark.slow
def test_slice_of_a_flash_width_checkpoint(tmp_path: Path) -> None:
    """Real V4-Flash layer widths (D 4096, 64 x 512 heads, FP8 / FP4 as stored), 2 layers + MTP, 8 experts and a
    1024-token vocabulary to keep it ~0.6 GB: the slice keeps layer 1 and 6 experts (Flash routes 6)."""
    cfg = dataclasses.replace(PRESETS["flash"].config(layers=2, mtp=1, vocab=1024), n_routed_experts=8)
    full = tmp_path / "flash"
    write_model(full, cfg, seed=3)
    out = tmp_path / "slice"
    _slice(full, out, "1-1", 6)
    _check_slice(full, out, first=1, experts=6)
