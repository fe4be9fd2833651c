"""What the OpenAI-compatible server is told when it is built: `ServerConfig`, and `TextCodec`, what it needs of a
tokenizer. A leaf: the app (api.py) and the generation endpoints (completions.py) both read these."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from deepinfer_bench.server.protocol import RequestLimits


class TextCodec(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    model_root: str  # absolute path of the tokenizer directory clients load (`root` in /v1/models)
    max_model_len: int
    model_aliases: tuple[str, ...] = ()  # other names accepted as `model` (e.g. the model directory path)
    vocab_size: int | None = None
    api_key: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    limits: RequestLimits = field(default_factory=RequestLimits)  # every list field's maximum (protocol.py)
    default_max_tokens: int = 16

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
