"""`deepinfer generate`: token-id prompts checked like the server does (one line, exit 2, before any engine is
built), and `--chat` through the same DeepSeek-V4 encoder as /v1/chat/completions (the engine job stubbed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deepinfer_bench.bench import generate as gen
from deepinfer_bench.cli import app
from engine.chat_encoding import encode_chat, encode_messages
from engine.tokenizer import load_tokenizer

TINY = Path(__file__).resolve().parents[1] / "golden" / "tiny"
runner = CliRunner()


@pytest.fixture
def fake_generate(monkeypatch: pytest.MonkeyPatch) -> dict:
    """Stub the engine job: record the prompt it got, answer `seen["reply"]`."""
    seen: dict = {"reply": "Hello!"}

    def fake(config, prompt, params):
        seen["prompt"] = prompt
        return {"prompt_ids": prompt, "output_ids": [5, 6], "text": seen["reply"], "finish_reason": "stop"}

    monkeypatch.setattr(gen, "generate", fake)
    return seen


@pytest.mark.parametrize("ids", ["1,2,99999", "1,-3"])
def test_out_of_vocab_prompt_ids_one_line_exit_2(fake_generate: dict, ids: str) -> None:
    r = runner.invoke(app, ["generate", "--prompt-ids", ids, "--max-tokens", "2"])
    assert r.exit_code == 2, r.output
    bad = ids.split(",")[-1]
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"token id {bad} is out of range [0, 1024)" in lines[0]
    assert "Traceback" not in r.output and "prompt" not in fake_generate  # no engine was started


def test_chat_uses_the_deepseek_v4_encoder(fake_generate: dict) -> None:
    tok = load_tokenizer(TINY)
    msgs = [{"role": "user", "content": "Who are you?"}]
    r = runner.invoke(app, ["generate", "--chat", "--prompt", "Who are you?", "--json"])
    assert r.exit_code == 0, r.output
    assert fake_generate["prompt"] == encode_chat(tok, encode_messages(msgs, thinking_mode="chat"))
    assert json.loads(r.stdout)["message"] == {"role": "assistant", "reasoning_content": None, "content": "Hello!"}
    fake_generate["reply"] = "Let me think.</think>I am a model."
    r = runner.invoke(app, ["generate", "--thinking", "--prompt", "Who are you?"])
    assert r.exit_code == 0, r.output
    assert fake_generate["prompt"] == encode_chat(tok, encode_messages(msgs, thinking_mode="thinking"))
    assert r.stdout.strip() == "I am a model."


def test_chat_without_chat_tokens_one_line_exit_2(fake_generate: dict, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    shutil.copy(TINY / "config.json", tmp_path / "config.json")
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    r = runner.invoke(app, ["generate", "--chat", "--prompt", "hi", "--model-dir", str(tmp_path)])
    assert r.exit_code == 2, r.output
    assert "lacks DeepSeek-V4's chat special tokens" in r.output and "Traceback" not in r.output
    assert "prompt" not in fake_generate
    r = runner.invoke(app, ["generate", "--chat", "--prompt-ids", "1,2"])
    assert r.exit_code == 2 and "--prompt" in r.output
