"""golden/tiny-spec (golden/make_spec_model.py): tiny's architecture with trained main weights, its HF golden in
golden/spec/, its trained MTP block; and the synthetic language it was trained on."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
SPEC, SPEC_GOLDEN = GOLDEN / "tiny-spec", GOLDEN / "spec"


@pytest.fixture(scope="module")
def lang():
    from golden.make_spec_model import Language

    return Language()


def test_language_follows_its_rules(lang) -> None:
    """Documents are reproducible from the seed; chain segments follow the topic's successor map from the token
    before them, repeat segments copy the token p back, recall segments copy an earlier span."""
    from golden.make_spec_model import Language

    docs = [lang.document(random.Random(5), 352) for _ in range(2)]
    assert docs[0] == docs[1]
    assert Language().succ == lang.succ and lang.succ[0] != lang.succ[1]
    rng = random.Random(11)
    seen = set()
    for _ in range(12):
        ids, kinds, topic = lang.document(rng, 352)
        assert len(ids) == len(kinds) == 352 and all(2 <= t < 1024 or t == 0 for t in ids)
        for t in range(1, len(ids)):
            seen.add(kinds[t])
            if kinds[t] == "chain":
                assert ids[t] == lang.succ[topic][ids[t - 1]]
                assert ids[t] % 2 == topic  # chains stay in the topic's parity class
    assert {"noise", "text", "chain", "repeat", "recall"} <= seen
    for c in (0, 1):  # the successor map is one cycle over the class: every member reached from any member
        x, members = lang.classes[c][0], set(lang.classes[c])
        orbit = {x}
        for _ in range(len(members)):
            x = lang.succ[c][x]
            orbit.add(x)
        assert orbit == members


def test_tiny_spec_is_tiny_with_trained_weights() -> None:
    from safetensors.torch import load_file

    assert ModelConfig.from_json(SPEC) == ModelConfig.from_json(GOLDEN / "tiny")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (SPEC / name).read_bytes() == (GOLDEN / "tiny" / name).read_bytes()
    a, b = load_file(str(GOLDEN / "tiny" / "model.safetensors")), load_file(str(SPEC / "model.safetensors"))
    assert {k: (v.dtype, v.shape) for k, v in a.items()} == {k: (v.dtype, v.shape) for k, v in b.items()}
    changed = [k for k in a if not a[k].view(torch.uint8).equal(b[k].view(torch.uint8))]
    assert "embed.weight" in changed and "head.weight" in changed and "layers.0.attn.wkv.weight" in changed
    assert (SPEC / "model.safetensors").stat().st_size < 4 * 2**20


def test_spec_golden_is_for_the_committed_tiny_spec() -> None:
    meta = json.loads((SPEC_GOLDEN / "golden.json").read_text())
    cfg = ModelConfig.from_json(SPEC)
    assert meta["config_hash"] == cfg.config_hash() and meta["model_dir"] == "golden/tiny-spec"
    digest = hashlib.sha256((SPEC / "model.safetensors").read_bytes()).hexdigest()
    assert meta["model_sha256"] == digest, "regenerate: python golden/make_golden.py --tiny golden/tiny-spec " \
                                           "--out golden/spec"
    tiny = json.loads((GOLDEN / "golden.json").read_text())
    assert [p["prompt_ids"] for p in meta["prompts"]] == [p["prompt_ids"] for p in tiny["prompts"]]
    # the trained model continues the prompts differently from the random one
    assert [p["output_ids"] for p in meta["prompts"]] != [p["output_ids"] for p in tiny["prompts"]]


def test_tiny_spec_dspark_shares_the_main_tensors() -> None:
    from safetensors.torch import load_file

    cfg = ModelConfig.from_json(GOLDEN / "tiny-spec-dspark")
    assert cfg.has_dspark and cfg.dspark_block_size == 5
    a, b = load_file(str(SPEC / "model.safetensors")), load_file(str(GOLDEN / "tiny-spec-dspark" / "model.safetensors"))
    main = [k for k in a if not k.startswith("mtp.")]
    assert main and all(a[k].view(torch.uint8).equal(b[k].view(torch.uint8)) for k in main)


def test_trained_mtp_block_accepts_and_keeps_greedy_exact() -> None:
    """Greedy MTP (k = 2) through the engine loop on a held-out 40-token prompt: the plain tokens, and most drafts
    accepted (golden/spec_acceptance.py measures ~0.9 over 24 prompts; 0.5 is the issue's target)."""
    from golden.spec_acceptance import run_setting
    from golden.train_draft_heads import eval_prompts

    prompt = [eval_prompts(20271)[8]]
    assert len(prompt[0]) == 40
    plain = run_setting(SPEC, prompt, 24)
    spec = run_setting(SPEC, prompt, 24, "mtp", 2)
    assert spec["outputs"] == plain["outputs"] and len(plain["outputs"][0]) == 24
    assert spec["row"]["num_draft_tokens"] > 0 and spec["row"]["acceptance_rate"] >= 0.5
    assert spec["row"]["steps"] < plain["row"]["steps"]
