"""Everything that crosses the pipe between the server process and the engine process, as frozen dataclasses.

Both ends use these types (deepinfer_bench/server/engine_process.py); the in-process `EngineLoop` hands the same
`StepOutput`s to its sinks, so the server reads one output type whichever way the engine runs.

Server -> engine: `AddRequest`, `AbortRequest`, `Shutdown`.
Engine -> server: `Ready` (once, when the engine is built), `Added` / `Rejected` (one per `AddRequest`),
`StepOutputs` (one per engine step, with the loop's stats), `EngineDead` (last message when the engine fails).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from engine.llm import EngineStats, RequestOutput
from engine.scheduler import RequestRejected

if TYPE_CHECKING:
    from engine.sampler import SamplingParams, TokenLogprobs


# ---- server -> engine ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class Shutdown:
    pass


ToEngine = Union[AddRequest, AbortRequest, Shutdown]


# ---- engine -> server ---------------------------------------------------------------------------------------------
def empty_engine_stats() -> EngineStats:
    """All-zero `EngineStats` (before the engine reported any)."""
    return EngineStats(**{f.name: 0.0 if f.type == "float" else 0 for f in dataclasses.fields(EngineStats)
                          if f.default is dataclasses.MISSING})


@dataclass(frozen=True)
class LoopSnapshot:
    """The engine loop's stats after a step: the engine's own `EngineStats` and the loop's step timing."""

    engine: EngineStats
    num_steps: int = 0  # engine.step() calls
    last_step_s: float = 0.0
    step_s_total: float = 0.0  # time inside engine.step()
    gap_s_total: float = 0.0  # time between two steps while work was pending


@dataclass(frozen=True)
class Ready:
    vocab_size: int
    max_model_len: int
    stats: LoopSnapshot


@dataclass(frozen=True)
class Added:
    request_id: str


class RejectKind(str, enum.Enum):
    REJECTED = "rejected"  # RequestRejected: could never fit this engine
    INVALID = "invalid"  # another ValueError (bad token id, stop strings without a tokenizer, ...)
    ERROR = "error"  # anything else add_request raised


@dataclass(frozen=True)
class Rejected:
    request_id: str
    kind: RejectKind
    message: str

    @classmethod
    def of(cls, request_id: str, error: BaseException) -> Rejected:
        kind = (RejectKind.REJECTED if isinstance(error, RequestRejected) else
                RejectKind.INVALID if isinstance(error, ValueError) else RejectKind.ERROR)
        return cls(request_id, kind, str(error))

    def error(self) -> Exception:
        """The exception `add_request` raised, rebuilt on this side."""
        return {RejectKind.REJECTED: RequestRejected, RejectKind.INVALID: ValueError,
                RejectKind.ERROR: RuntimeError}[self.kind](self.message)


@dataclass(frozen=True)
class StepOutput:
    """What the server reads of one `RequestOutput` (the whole output so far is not shipped every step)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str  # text this output released (stop strings and stop tokens are never part of it)
    finished: bool
    finish_reason: str | None  # 'stop' | 'length' | 'abort' once finished
    stop_reason: str | int | None  # the stop string or stop token id that finished the request
    prompt_len: int
    logprobs: tuple[TokenLogprobs, ...] | None = None  # of new_token_ids, when the request asked for them
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None  # once, with the first token, when asked

    @classmethod
    def of(cls, out: RequestOutput) -> StepOutput:
        return cls(out.request_id, tuple(out.new_token_ids), out.text_delta, bool(out.finished), out.finish_reason,
                   out.stop_reason, int(out.prompt_len), None if out.logprobs is None else tuple(out.logprobs),
                   None if out.prompt_logprobs is None else tuple(out.prompt_logprobs))


@dataclass(frozen=True)
class StepOutputs:
    outputs: tuple[StepOutput, ...]
    stats: LoopSnapshot


@dataclass(frozen=True)
class EngineDead:
    message: str


FromEngine = Union[Ready, Added, Rejected, StepOutputs, EngineDead]
