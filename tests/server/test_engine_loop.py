"""EngineLoop on its own: batching of arrivals, aborts, death and shutdown."""

from __future__ import annotations

import asyncio
import functools

import pytest

from deepinfer_bench.server.engine_client import EngineDeadError
from deepinfer_bench.server.engine_thread import EngineLoop
from engine.sampler import SamplingParams
from engine.scheduler import RequestRejected
from tests.server.fakes import BOS, make_engine


def params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def run_loop(engine, body):
    async def main():
        loop = EngineLoop(engine)
        loop.start(asyncio.get_running_loop())
        try:
            return await body(loop)
        finally:
            await asyncio.to_thread(loop.stop)
    return asyncio.run(main())


def test_burst_of_arrivals_shares_the_first_step() -> None:
    eng = make_engine()

    async def body(loop: EngineLoop):
        q: asyncio.Queue = asyncio.Queue()
        adds = [loop.add([BOS, 5 + i], params(3), f"r{i}", q.put_nowait) for i in range(5)]
        await asyncio.gather(*adds)
        done = 0
        while done < 5:
            done += (await asyncio.wait_for(q.get(), 5)).finished

    run_loop(eng, body)
    assert eng.runner.batch_sizes[0] == 5 and sum(eng.runner.batch_sizes) == 15


def test_rejection_abort_and_stats() -> None:
    eng = make_engine(step_delay_s=0.01, max_model_len=64)

    async def body(loop: EngineLoop):
        with pytest.raises(RequestRejected, match="maximum context length"):
            await loop.add([BOS] * 60, params(10), "too-long", lambda _: None)
        got: list = []
        await loop.add([BOS, 7], params(50), "a", got.append)
        while len(got) < 3:
            await asyncio.sleep(0.005)
        loop.abort("a")
        await asyncio.sleep(0.1)
        n = len(got)
        await asyncio.sleep(0.05)
        return n, len(got), loop.stats

    n1, n2, stats = run_loop(eng, body)
    assert n1 == n2 < 50  # nothing delivered after the abort
    assert not eng.has_unfinished() and stats.engine.num_running == 0 and stats.engine.num_used_blocks == 0
    assert stats.engine.num_kv_blocks == eng.config.cache.num_kv_blocks and stats.num_steps >= 3


def test_death_reaches_every_request_and_refuses_new_ones() -> None:
    eng = make_engine(fail_at_step=2)

    async def body(loop: EngineLoop):
        q: asyncio.Queue = asyncio.Queue()
        await loop.add([BOS, 1], params(10), "x", q.put_nowait)
        items = [await asyncio.wait_for(q.get(), 5) for _ in range(2)]
        assert not loop.alive and "injected" in repr(loop.error)
        with pytest.raises(EngineDeadError):
            await loop.add([BOS, 1], params(1), "y", q.put_nowait)
        return items

    first, second = run_loop(eng, body)
    assert first.new_token_ids and isinstance(second, EngineDeadError)


def test_process_loop_rejection_outputs_and_death() -> None:
    from deepinfer_bench.server.engine_process import ProcessEngineLoop

    loop = ProcessEngineLoop(functools.partial(make_engine, fail_at_step=4, max_model_len=64))
    assert loop.launch(timeout_s=60).max_model_len == 64

    async def body():
        loop.start(asyncio.get_running_loop())
        try:
            with pytest.raises(ValueError, match="maximum context length"):
                await loop.add([BOS] * 60, params(10), "too-long", lambda _: None)
            q: asyncio.Queue = asyncio.Queue()
            await loop.add([BOS, 3], params(10), "a", q.put_nowait)
            items = [await asyncio.wait_for(q.get(), 10) for _ in range(4)]
            assert [len(i.new_token_ids) for i in items[:3]] == [1, 1, 1]
            assert isinstance(items[3], EngineDeadError) and "injected" in str(items[3])
            assert not loop.alive
            with pytest.raises(EngineDeadError):
                await loop.add([BOS, 1], params(1), "b", q.put_nowait)
        finally:
            await asyncio.to_thread(loop.stop)

    asyncio.run(body())


@pytest.mark.slow
def test_process_loop_on_two_ranks_matches_one() -> None:
    """ProcessEngineLoop(job_runner=run_job) serves from rank 0 of cp=2 (what `deepinfer serve --cp 2` does)
    and gives cp=1's tokens."""
    from deepinfer_bench.server.engine_process import ProcessEngineLoop
    from engine.config import EngineConfig
    from engine.launch import run_job
    from engine.offline import LLM
    from tests.server.test_real_engine import TINY

    kw = {"max_num_seqs": 4, "num_kv_blocks": 16, "max_model_len": 256, "backend": "host"}
    loop = ProcessEngineLoop(None, (EngineConfig.from_model_dir(TINY, cp=2, **kw),), job_runner=run_job)
    assert loop.launch(timeout_s=120).vocab_size == 1024

    async def body() -> list[int]:
        loop.start(asyncio.get_running_loop())
        try:
            q: asyncio.Queue = asyncio.Queue()
            await loop.add([0, 5, 6, 7], params(6), "a", q.put_nowait)
            out: list[int] = []
            while True:
                o = await asyncio.wait_for(q.get(), 60)
                out += o.new_token_ids
                if o.finished:
                    return out
        finally:
            await asyncio.to_thread(loop.stop)

    want = LLM(EngineConfig.from_model_dir(TINY, **kw)).generate([[0, 5, 6, 7]], params(6))[0].output_token_ids
    assert asyncio.run(body()) == list(want)
