"""Context and expert parallelism on torch.distributed: the layout, counted collectives, and rank launch.

Layout (cp ranks, the same `--cp N` for both):
* Dense per-token work (embedding, mHC, norms, projections, compressor pooling, the head) is replicated: every rank
  sees every token of a step, so the residual streams stay identical on all ranks.
* KV is sharded by position: rank r holds window positions p with p % cp == r (ring rows (p // cp) % (win / cp)),
  and compressed entries / indexer keys w with w % cp == r (local index w // cp). Each rank attends with every query
  over its share and the shares are merged exactly (per-head max / sum-exp, sink counted once): one all-gather.
* CSA's indexer top-k is global: local top-k over the rank's keys, one all-gather of (score, entry id), then a global
  top-k ordered by (score desc, entry id asc), which is exactly the cp=1 order.
* Routed experts are sharded (rank r holds experts [r*E/cp, (r+1)*E/cp)). Static MoE exchange: each rank routes its
  1/cp share of the tokens, packs (x, routing weights, expert ids) into ONE fp32 tensor, one all-gather, computes its
  experts for every token, and one all-reduce combines (the shared expert is added by the token's owner).

Collectives are c10d's in-place ones (`dist.all_gather` / `dist.all_reduce`), or - when the backend that joined the
group says so (`Parallel.functional`, set by its `join_group`: TorchNeuron) - the functional collectives of
`torch.distributed._functional_collectives` (`all_gather_tensor`, `all_reduce`: the graph ops
`_c10d_functional.all_gather_into_tensor` / `all_reduce`), which return new tensors and
may sit inside a compiled graph (`torch.compile(fullgraph=True)` traces them as graph ops). The model calls the same
two methods either way; it never tests a device type.

Rank launch: `launch(job, cp, ...)` spawns cp processes on this host (gloo) and supervises them: a rank that raises
or dies ends the whole job within a bounded time, naming the rank and the error; no orphans. Under `torchrun`
(WORLD_SIZE set) the current process is one rank and its backend's `join_group` joins torchrun's group.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from engine.config import LayoutError, check_layout

__all__ = ["LayoutError", "Parallel", "RankFailed", "barrier", "check_layout", "join_group", "launch", "under_torchrun"]


class RankFailed(RuntimeError):
    """A rank raised, died or timed out; the message names the rank and the error."""


@dataclass
class Parallel:
    """This process's place in the layout plus counted collectives. cp=1 needs no process group."""

    rank: int = 0
    cp: int = 1
    group: Any = None
    # Rank 0 -> workers step messages (engine/runner.py DistributedRunner): gloo on the host, with no practical
    # timeout, since a server may sit idle for hours between requests while the workers wait for the next step.
    control_group: Any = None
    counts: Counter = field(default_factory=Counter)
    kill_at: int | None = None  # fault injection for tests: SIGKILL this rank at its n-th collective
    backend: Any = None  # the engine backend that joined this group (engine/backends), for the rank's job
    # functional collectives (graph-legal; the backend's choice, see the module doc). Their calls are counted when
    # they run outside a compiled graph; inside one they are graph ops, traced once, so not counted per execution.
    functional: bool = False

    @property
    def enabled(self) -> bool:
        return self.cp > 1

    def local_experts(self, n_experts: int) -> range:
        per = n_experts // self.cp
        return range(self.rank * per, (self.rank + 1) * per)

    def _tick(self, key: str) -> None:
        self.counts[key] += 1
        if self.kill_at is not None and sum(self.counts.values()) >= self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def all_gather(self, t: torch.Tensor, key: str) -> list[torch.Tensor]:
        """All ranks' `t` (same shape on every rank), in rank order."""
        if self.functional:
            from torch.distributed import _functional_collectives as funcol

            if not torch.compiler.is_compiling():
                self._tick(f"{key}:all_gather")
            gathered = funcol.all_gather_tensor(t.contiguous(), 0, self.group)  # [cp * t.shape[0], ...]
            return list(gathered.chunk(self.cp, 0))
        self._tick(f"{key}:all_gather")
        out = [torch.empty_like(t) for _ in range(self.cp)]
        dist.all_gather(out, t.contiguous(), group=self.group)
        return out

    def all_reduce(self, t: torch.Tensor, key: str) -> torch.Tensor:
        """The sum over ranks of `t` (in place for c10d's collective; a new tensor for the functional one: use the
        returned tensor)."""
        if self.functional:
            from torch.distributed import _functional_collectives as funcol

            if not torch.compiler.is_compiling():
                self._tick(f"{key}:all_reduce")
            return funcol.all_reduce(t, "sum", self.group)
        self._tick(f"{key}:all_reduce")
        dist.all_reduce(t, group=self.group)
        return t

    def report(self) -> dict[str, int]:
        """Collective calls so far, keyed `L<layer>.<site>:<op>` (e.g. `L3.moe.exchange:all_gather`)."""
        return dict(sorted(self.counts.items()))

    def reset_counts(self) -> None:
        self.counts.clear()


# ---------------------------------------------------------------------------------------------------------------
# Process groups


def join_group(dist_backend: str, init_method: str, world: int, timeout_s: float, rank: int | None = None,
               backend: Any = None, functional: bool = False) -> Parallel:
    """Join the job's process group (`dist_backend` over `init_method`; `rank` None: the rendezvous assigns it, as
    torchrun's env:// and torch-xla's xla:// do) and make the gloo control group that rank 0's step messages travel
    on. A group whose world size is not the job's (a runtime not configured for several processes reports 1, and
    collectives would then silently reduce over one rank) is refused. The engine's backends call this from their
    `join_group` (engine/backends); `backend` is kept on the returned Parallel for the rank's job, `functional` picks
    the functional collectives (see the module doc)."""
    timeout = _dt.timedelta(seconds=timeout_s)
    ranks = {} if rank is None else {"rank": rank, "world_size": world}
    dist.init_process_group(dist_backend, init_method=init_method, timeout=timeout, **ranks)
    if dist.get_world_size() != world:
        raise RuntimeError(f"the {dist_backend} process group has world size {dist.get_world_size()}, the job has "
                           f"{world} ranks: the runtime is not configured for multiple processes")
    return Parallel(rank=dist.get_rank(), cp=world, group=dist.group.WORLD, control_group=_control_group(),
                    backend=backend, functional=functional)


def _control_group() -> Any:
    return dist.new_group(backend="gloo", timeout=_dt.timedelta(days=365))


def barrier(par: Parallel) -> None:
    """Wait for every rank, on the gloo control group (a device group's barrier may do nothing: torch-xla's)."""
    dist.barrier(group=par.control_group)


def under_torchrun() -> bool:
    from engine.envs import torchrun_world_size

    return torchrun_world_size() > 1


# ---------------------------------------------------------------------------------------------------------------
# Launch and supervision


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, cp: int, port: int, job: Callable[..., Any], args: tuple, results: Any,
               timeout_s: float, kill_at: tuple[int, int] | None, threads: int,
               setup: Callable[[int, int, int, int, float], Parallel] | None) -> None:
    try:
        # threads, reproducible math, per-rank runtime variables (before any runtime starts), then the group
        par = (setup or _default_setup)(rank, cp, port, threads, timeout_s)
        if kill_at is not None and kill_at[0] == rank:
            par.kill_at = kill_at[1]
        out = job(par, *args)
        # plain pickle: tensors travel by value (the queue's own pickler would pass shared-memory handles that die
        # with this process)
        results.put(("ok", rank, pickle.dumps(out) if rank == 0 else None))
        with contextlib.suppress(Exception):
            barrier(par)
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - report every failure to the supervisor, then exit non-zero
        results.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}"))
        results.close()
        results.join_thread()  # flush the message before the hard exit
        os._exit(1)


def _default_setup(rank: int, cp: int, port: int, threads: int, timeout_s: float) -> Parallel:
    """Plain host ranks: reproducible math, `threads` torch threads, a gloo group over tcp:// on this host."""
    from engine.envs import pin_reproducible_math

    pin_reproducible_math()
    torch.set_num_threads(threads)
    return join_group("gloo", f"tcp://127.0.0.1:{port}", cp, timeout_s, rank=rank)


def launch(job: Callable[..., Any], cp: int, args: tuple = (), *, timeout_s: float | None = None,
           kill_at: tuple[int, int] | None = None,
           setup: Callable[[int, int, int, int, float], Parallel] | None = None, threads: int | None = None,
           rank_env: Callable[[int, int], dict[str, str]] | None = None) -> Any:
    """Run `job(par, *args)` on cp ranks (processes) and return rank 0's result.

    `setup(rank, cp, port, threads, collective_timeout_s) -> Parallel` runs first in every rank process: it sets the
    process up and joins the job's group (the engine passes its backend's `setup_process` + `join_group`); the
    default sets the host threads and joins over gloo. `threads`: torch threads per rank (default:
    DEEPINFER_NUM_THREADS or torch's, split between the ranks). `rank_env(rank, cp)`: variables rank `rank` must
    have before it imports anything (a runtime that reads them at import), given to its process at start.

    Any rank that raises, dies (e.g. SIGKILL) or outlives `timeout_s` ends the job: the others are terminated
    (SIGTERM, then SIGKILL after 5 s) and RankFailed names the rank and its error. `kill_at=(rank, n)` makes that
    rank SIGKILL itself at its n-th collective (failure tests).
    """
    from engine.envs import get_envs

    envs = get_envs()
    coll_timeout = envs.DEEPINFER_DIST_TIMEOUT_S
    timeout_s = timeout_s or max(600.0, coll_timeout * 4)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    threads = threads or max(1, (envs.DEEPINFER_NUM_THREADS or torch.get_num_threads()) // cp)
    procs = [ctx.Process(target=_rank_main, name=f"deepinfer-rank{r}", daemon=True,
                         args=(r, cp, port, job, args, results, coll_timeout, kill_at, threads, setup))
             for r in range(cp)]
    for r, p in enumerate(procs):
        _start_with_env(p, rank_env(r, cp) if rank_env is not None else {})
    deadline = time.monotonic() + timeout_s
    done: set[int] = set()
    result: Any = None
    failures: dict[int, str] = {}  # rank -> what happened
    grace_end: float | None = None  # after a first failure, look a little longer for its root cause
    try:
        while len(done) + len(failures) < cp:
            now = time.monotonic()
            if grace_end is not None and now > grace_end:
                break
            try:
                kind, rank, payload = results.get(timeout=0.2)
                if kind == "ok":
                    done.add(rank)
                    if rank == 0:
                        result = pickle.loads(payload)
                else:
                    failures.setdefault(rank, f"rank {rank} failed: {payload}")
            except queue.Empty:
                pass
            for r, p in enumerate(procs):
                if r not in done and r not in failures and not p.is_alive() and p.exitcode not in (0, None):
                    sig = -p.exitcode if p.exitcode < 0 else None
                    how = f"killed by signal {signal.Signals(sig).name}" if sig else f"exit code {p.exitcode}"
                    failures[r] = f"rank {r} died ({how}) before finishing"
            if failures and grace_end is None:
                grace_end = time.monotonic() + 3.0
            if not failures and time.monotonic() > deadline:
                failures[-1] = f"timed out after {timeout_s:.0f}s waiting for ranks {sorted(set(range(cp)) - done)}"
    finally:
        _reap(procs, graceful=not failures)
    if failures:
        # root cause first: a rank that died, then one that raised on its own, then peers that lost a connection
        def rank_of(item: tuple[int, str]) -> tuple[int, int]:
            r, msg = item
            return (0 if "died" in msg else 2 if "Connection closed by peer" in msg else 1, r)

        ordered = [msg for _, msg in sorted(failures.items(), key=rank_of)]
        extra = f" (then: {'; '.join(m.splitlines()[0] for m in ordered[1:])})" if len(ordered) > 1 else ""
        raise RankFailed(ordered[0] + extra)
    return result


def _start_with_env(proc: Any, env: dict[str, str]) -> None:
    """Start `proc` with `env` added to its environment (a spawned child copies the parent's at start)."""
    from engine.envs import environ

    env_now = environ()
    saved = {k: env_now.get(k) for k in env}
    env_now.update(env)
    try:
        proc.start()
    finally:
        for k, v in saved.items():
            if v is None:
                env_now.pop(k, None)
            else:
                env_now[k] = v


def _reap(procs: list[Any], graceful: bool) -> None:
    if graceful:
        for p in procs:
            p.join(timeout=30)
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + 5
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
