"""Output text of a request, one generated token at a time: incremental detokenization and stop strings.

The engine owns both (engine/llm.py keeps one `TextState` per request when the model has a tokenizer), so the
offline `LLM.generate`, `deepinfer generate` and the server produce the same text and stop at the same place:

* `IncrementalDetokenizer` decodes a short window of ids (a few tokens back, prompt included) and yields the text
  the newest token added, never splitting a multi-byte character (while the window ends in U+FFFD it waits);
* `TextState.push(token)` returns the text that may be released now. With stop strings, text that could be the
  start of a stop string is held back until it is known not to be one (vLLM's stop buffer); when a stop string
  appears, the text is cut before it and the request finishes with reason "stop" (`stop_reason` = that string).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class IncrementalDetokenizer:
    CONTEXT = 4

    def __init__(self, decode: Callable[[list[int]], str], prompt_ids: Sequence[int]) -> None:
        self._decode = decode
        self._ids = list(prompt_ids[-self.CONTEXT:])
        self._start = 0  # window start
        self._done = len(self._ids)  # ids[:_done] already turned into text

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
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


class TextState:
    """Released text of one request and the stop-string check over it."""

    def __init__(self, decode: Callable[[list[int]], str], prompt_ids: Sequence[int],
                 stop: Sequence[str] = ()) -> None:
        self.detok = IncrementalDetokenizer(decode, prompt_ids)
        self.stop = tuple(stop)
        self.text = ""  # released so far
        self.held = ""  # decoded, not yet released (could be the start of a stop string)
        self.stop_hit: str | None = None

    def push(self, token_id: int, final: bool = False, check_stop: bool = True) -> str:
        """Text released by one new token (`final`: the request ends with it, so nothing is held back;
        `check_stop` False: stop strings do not count yet, e.g. before `min_tokens`)."""
        self.held += self.detok.push(token_id)
        if final:
            self.held += self.detok.flush()
        return self._release(final, check_stop)

    def finish(self) -> str:
        """The request ended (length, EOS, abort): release whatever is held."""
        self.held += self.detok.flush()
        return self._release(final=True)

    def _release(self, final: bool, check_stop: bool = True) -> str:
        if self.stop_hit is not None:
            return ""
        if self.stop and check_stop:
            hits = [(i, s) for s in self.stop if (i := self.held.find(s)) >= 0]
            if hits:
                cut, self.stop_hit = min(hits)
                delta, self.held = self.held[:cut], ""
                self.text += delta
                return delta
        keep = 0 if final or not self.stop else max(
            (n for s in self.stop for n in range(1, len(s)) if self.held.endswith(s[:n])), default=0)
        delta = self.held[:len(self.held) - keep]
        self.held = self.held[len(self.held) - keep:]
        self.text += delta
        return delta
