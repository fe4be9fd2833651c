"""Run a function against an engine on 1 or cp ranks, the same way for every command (`--cp N` or torchrun).

With cp > 1, rank 0 owns the scheduler and a DistributedRunner; the other ranks execute what it broadcasts
(`worker_loop`). The function runs on rank 0 only and its return value comes back to the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.parallel import Parallel, init_from_env, launch, under_torchrun


def _engine_job(par: Parallel, config: Any, fn: Callable[..., Any], args: tuple) -> Any:
    from engine.llm import LLMEngine
    from engine.runner import DistributedRunner, build_runner, worker_loop

    runner = build_runner(config, par)
    if par.rank != 0:
        worker_loop(runner)
        return None
    driver = DistributedRunner(runner) if par.enabled else runner
    try:
        return fn(LLMEngine(config, runner=driver), *args)
    finally:
        if par.enabled:
            driver.shutdown()


def _apply_threads() -> None:
    """DEEPINFER_NUM_THREADS (if set) for work in this process; rank processes get their share in launch()."""
    import torch

    from engine.envs import get_envs

    if get_envs().DEEPINFER_NUM_THREADS:
        torch.set_num_threads(get_envs().DEEPINFER_NUM_THREADS)


def _torchrun(job: Callable[..., Any], args: tuple) -> Any:
    """Under torchrun this process is one rank: run the job; ranks > 0 then leave quietly (exit 0), so only rank 0
    goes on to print results."""
    import torch.distributed as dist

    par = init_from_env()
    out = job(par, *args)
    if par.rank != 0:
        dist.barrier()
        dist.destroy_process_group()
        raise SystemExit(0)
    dist.barrier()
    return out


def run_engine_job(config: Any, fn: Callable[..., Any], args: tuple = (), *, timeout_s: float | None = None) -> Any:
    """`fn(engine, *args)` on an LLMEngine built from `config` (which carries `cp`). `fn` must be a module-level
    function (it is pickled to the rank processes). `timeout_s` bounds a multi-rank job (None: launch's default;
    math.inf for a server, which runs until it is stopped)."""
    cp = int(getattr(config, "cp", 1))
    _apply_threads()
    if under_torchrun():
        return _torchrun(_engine_job, (config, fn, args))
    if cp <= 1:
        return _engine_job(Parallel(), config, fn, args)
    return launch(_engine_job, cp, (config, fn, args), timeout_s=timeout_s)


def effective_cp(cp: int) -> int:
    """The rank count a job will really have: torchrun's WORLD_SIZE when launched by torchrun, else `cp`."""
    if under_torchrun():
        from engine.envs import get_envs

        return int(dict(get_envs().recorded)["WORLD_SIZE"])
    return cp


def run_spmd(job: Callable[..., Any], cp: int, args: tuple = ()) -> Any:
    """`job(par, *args)` on every rank (SPMD); rank 0's result is returned. cp=1 runs in this process."""
    _apply_threads()
    if under_torchrun():
        return _torchrun(job, args)
    if cp <= 1:
        return job(Parallel(), *args)
    return launch(job, cp, args)
