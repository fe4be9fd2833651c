"""Per-prompt text state of a completion: incremental detokenization and stop strings, one event per token.

Used by the server for both streaming and non-streaming replies, so both produce the same text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


class IncrementalDetokenizer:
    """Text for one generated token at a time, never splitting a multi-byte character.

    Decodes a short window of ids (starting a few tokens back, prompt included) and emits the text that the newest
    token added; while the window ends in U+FFFD (an incomplete UTF-8 sequence) it emits nothing and waits.
    """

    CONTEXT = 4

    def __init__(self, decode: Callable[[list[int]], str], prompt_ids: list[int]) -> None:
        self._decode = decode
        self._ids = list(prompt_ids[-self.CONTEXT:])
        self._start = 0  # window start
        self._done = len(self._ids)  # ids[:_done] already turned into text

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        before = self._decode(self._ids[self._start:self._done])
        after = self._decode(self._ids[self._start:])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._start = max(self._start, self._done - self.CONTEXT)
        self._done = len(self._ids)
        return after[len(before):]


@dataclass
class SeqState:
    """One prompt of a completion request: its engine request and the text produced so far."""

    index: int
    request_id: str
    prompt_len: int
    detok: IncrementalDetokenizer | None
    stop: list[str]
    text: str = ""  # emitted
    held: str = ""  # decoded but held back (could be the start of a stop string)
    num_tokens: int = 0
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)

    def feed(self, new_ids: list[int], engine_finished: bool, engine_reason: str | None,
             ) -> list[tuple[str, str | None]]:
        """Turn new token ids into (text, finish_reason) events, one per token; applies stop strings."""
        events: list[tuple[str, str | None]] = []
        for k, tok in enumerate(new_ids):
            self.num_tokens += 1
            self.token_ids.append(tok)
            last = engine_finished and k == len(new_ids) - 1
            self.held += self.detok.push(tok) if self.detok else ""
            if last and self.detok:
                self.held += self.detok.flush()
            delta, hit = self._release(final=last)
            if hit:
                self.finish_reason = "stop"
                events.append((delta, "stop"))
                return events
            if last:
                self.finish_reason = engine_reason or "stop"
            events.append((delta, self.finish_reason))
        if engine_finished and not new_ids:
            self.finish_reason = engine_reason or "stop"
            events.append((self.held, self.finish_reason))
            self.text += self.held
            self.held = ""
        return events

    def _release(self, final: bool) -> tuple[str, bool]:
        if not self.stop:
            delta, self.held = self.held, ""
            self.text += delta
            return delta, False
        cut = min((i for i in (self.held.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            delta, self.held = self.held[:cut], ""
            self.text += delta
            return delta, True
        keep = 0 if final else max((n for s in self.stop for n in range(1, len(s)) if self.held.endswith(s[:n])),
                                   default=0)
        delta = self.held[:len(self.held) - keep]
        self.held = self.held[len(self.held) - keep:]
        self.text += delta
        return delta, False
