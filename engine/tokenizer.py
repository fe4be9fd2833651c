"""Tokenizer: `tokenizer.json` from the model directory through the `tokenizers` library (no transformers needed).

Without a `tokenizer.json` the engine takes token-id prompts only, and text prompts fail with a clear error.
"""

from __future__ import annotations

import json
from pathlib import Path


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        self.path = Path(path)
        self._tok = _HFTokenizer.from_file(str(self.path))
        self.eos_token_id: int | None = None
        self.bos_token_id: int | None = None
        cfg_path = self.path.with_name("tokenizer_config.json")
        if cfg_path.exists():
            cfg = json.loads(cfg_path.read_text())
            self.eos_token_id = self._special_id(cfg.get("eos_token"))
            self.bos_token_id = self._special_id(cfg.get("bos_token"))

    def _special_id(self, tok: object) -> int | None:
        if isinstance(tok, dict):
            tok = tok.get("content")
        return self._tok.token_to_id(tok) if isinstance(tok, str) else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of `token` when it is one token of the vocabulary (added tokens included), else None."""
        return self._tok.token_to_id(token)


def load_tokenizer(model_dir: str | Path | None) -> Tokenizer | None:
    """The model directory's tokenizer, or None when it has no `tokenizer.json`."""
    if model_dir is None:
        return None
    path = Path(model_dir) / "tokenizer.json"
    return Tokenizer(path) if path.exists() else None
