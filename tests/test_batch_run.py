"""The timing driver: `run_batch` and `run_lockstep` over engines that log their steps."""

from __future__ import annotations

from types import SimpleNamespace

from deepinfer_bench.bench.batch_run import run_batch, run_lockstep


class _Engine:
    """A request per prompt; every step gives each unfinished request one token (`max_tokens` each)."""

    def __init__(self, name: str, log: list[str], extra: int = 0) -> None:
        self.name, self.log, self.left, self.extra = name, log, {}, extra

    def add_request(self, prompt: list[int], params) -> str:
        rid = f"{self.name}{len(self.left)}"
        self.left[rid] = params.max_tokens + self.extra
        return rid

    def step(self) -> list[SimpleNamespace]:
        self.log.append(self.name)
        outs = [SimpleNamespace(request_id=r, new_token_ids=[1]) for r, n in self.left.items() if n]
        for o in outs:
            self.left[o.request_id] -= 1
        return outs

    def has_unfinished(self) -> bool:
        return any(self.left.values())


def test_run_batch_times_every_step_and_finds_the_first_decode_step():
    log: list[str] = []
    run = run_batch(_Engine("a", log), [[5, 6], [7]], 4)
    assert log == ["a"] * 4
    assert len(run.step_s) == len(run.step_cpu_s) == 4
    assert run.first_decode_step == 1 and len(run.decode_steps_s) == len(run.decode_cpu_s) == 3
    assert all(c >= 0 for c in run.step_cpu_s) and run.e2e_s >= sum(run.step_s)


def test_run_lockstep_steps_the_engines_in_turn_from_the_next_each_round():
    log: list[str] = []
    engines = [_Engine(n, log) for n in "abc"]
    runs = run_lockstep(engines, [[1, 2, 3]] * 2, 3, first=1)
    # round r starts from engine (first + r) % 3
    assert log == ["b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert [len(r.step_s) for r in runs] == [3, 3, 3]
    assert all(r.first_decode_step == 1 and len(r.decode_cpu_s) == 2 for r in runs)


def test_run_lockstep_drops_an_engine_that_finished():
    log: list[str] = []
    runs = run_lockstep([_Engine("s", log), _Engine("l", log, extra=2)], [[1]], 2)
    assert log == ["s", "l", "l", "s", "l", "l"]  # the long one runs on alone
    assert [len(r.step_s) for r in runs] == [2, 4]
