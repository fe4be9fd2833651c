"""The committed golden files are consistent with the committed tiny model (no engine involved).

The golden tests proper (engine vs these files) live with the engine; this checks the files themselves.
Regenerate with `python golden/make_golden.py` (see golden/README.md).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
REGEN = "regenerate with `python golden/make_golden.py` (golden/README.md)"


@pytest.fixture(scope="module")
def meta() -> dict:
    return json.loads((GOLDEN / "golden.json").read_text())


@pytest.fixture(scope="module")
def golden() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(GOLDEN / "golden.safetensors"))


def test_meta_matches_tiny_model(meta):
    assert meta["magic"] == "deepinfer-golden" and meta["format_version"] == 1
    cfg = ModelConfig.from_json(GOLDEN / "tiny" / "config.json")
    assert meta["config_hash"] == cfg.config_hash(), f"golden/tiny config changed: {REGEN}"
    digest = hashlib.sha256((GOLDEN / "tiny" / "model.safetensors").read_bytes()).hexdigest()
    assert meta["model_sha256"] == digest, f"golden/tiny weights changed: {REGEN}"


def test_prompts_cover_the_thresholds(meta):
    cfg = ModelConfig.from_json(GOLDEN / "tiny" / "config.json")
    prompts = meta["prompts"]
    lens = [p["prompt_len"] for p in prompts]
    assert len(prompts) >= 10 and min(lens) <= 5 and max(lens) >= 320
    assert {"text", "ids"} <= {p["kind"] for p in prompts}
    assert all(p["max_new_tokens"] >= 32 for p in prompts)
    topk_threshold = 4 * (cfg.index_topk + 1)
    for threshold in (cfg.window_size, topk_threshold, max(cfg.compress_ratios)):
        assert any(n < threshold for n in lens) and any(n > threshold for n in lens)


def test_tensors_match_meta(meta, golden):
    cfg = ModelConfig.from_json(GOLDEN / "tiny" / "config.json")
    for p in meta["prompts"]:
        name = p["name"]
        assert golden[f"{name}.prompt_ids"].tolist() == p["prompt_ids"]
        out = golden[f"{name}.output_ids"].tolist()
        logits = golden[f"{name}.logits"]
        assert out == p["output_ids"] and len(out) == p["max_new_tokens"]
        assert logits.dtype == torch.float32 and logits.shape == (p["max_new_tokens"], cfg.vocab_size)
        assert out == logits.argmax(dim=-1).tolist()
        top2 = logits.topk(2, dim=-1).values
        assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-3, f"{name}: near tie in the golden logits"


def test_text_prompts_tokenise_to_stored_ids(meta):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(GOLDEN / "tiny" / "tokenizer.json"))
    cfg = ModelConfig.from_json(GOLDEN / "tiny" / "config.json")
    assert tok.get_vocab_size() == cfg.vocab_size
    assert tok.id_to_token(cfg.bos_token_id) == "<｜begin▁of▁sentence｜>"
    assert tok.id_to_token(cfg.eos_token_id) == "<｜end▁of▁sentence｜>"
    texts = [p for p in meta["prompts"] if p["kind"] == "text"]
    assert texts
    for p in texts:
        assert tok.encode(p["text"]).ids == p["prompt_ids"], p["name"]
        assert tok.decode(p["prompt_ids"]) == p["text"]
