"""Building an engine, and running a function against it on 1 or cp ranks, the one way every command does.

* `build(config)` -> `LLMEngine`, the one way to build an engine in a process: the config's backend is made once
  (which checks the kernel table) and sets the process up (threads, reproducible math, runtime variables), the
  weights are loaded (memory-mapped, only this rank's experts under expert parallelism) or handed in, the model and
  its KV cache are built on the backend's device, and the engine (scheduler, sampler, tokenizer) wraps them.
* `run_job(config, fn, args)` -> `fn(engine, *args)` on rank 0: with cp = 1 in this process; with cp > 1 on cp rank
  processes (or under torchrun, where this process is one rank), rank 0 owning the scheduler and a
  `DistributedRunner` whose steps the other ranks execute (`worker_loop`). Its return value comes back to the
  caller. `fn` must be a module-level function (it is pickled to the rank processes).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine.parallel import Parallel, barrier, launch, under_torchrun

if TYPE_CHECKING:
    import torch

    from engine.backends import Backend
    from engine.config import EngineConfig
    from engine.llm import LLMEngine
    from engine.runner import ModelRunner


def stored_formats(config: EngineConfig) -> dict[str, str]:
    """{weight name: "fp8" | "fp4"} the model holds as stored bytes: the checkpoint's quantised weights under
    `weights=stored`; nothing for `weights=dequant` or dummy weights (random floats)."""
    spec = config.model
    if str(spec.weights) != "stored" or str(spec.load_format) == "dummy" or spec.model_dir is None:
        return {}
    from engine.loader import stored_formats as read_formats

    return read_formats(spec.model_dir, spec.config, include_mtp=spec.with_mtp)


def load_weights(config: EngineConfig, par: Parallel | None = None, stored: bool | None = None,
                 ) -> dict[str, torch.Tensor]:
    """Official-named tensors for `config`: random (load_format dummy) or read from `config.model.model_dir`, FP8 /
    FP4 weights as stored bytes under `weights=stored` (`stored=False` forces dequantised ones)."""
    import torch

    spec, par = config.model, par or Parallel()
    if str(spec.load_format) == "dummy":
        from engine.model.dummy import random_weights

        return random_weights(spec.config, seed=config.seed, with_mtp=spec.with_mtp)
    if spec.model_dir is None:
        raise ValueError("the engine config names no model directory and no weights were given")
    from engine.loader import load_checkpoint

    experts = par.local_experts(spec.config.n_routed_experts) if par.enabled else None
    keep = str(spec.weights) == "stored" if stored is None else stored
    return load_checkpoint(spec.model_dir, spec.config, dtype=torch.float32, include_mtp=spec.with_mtp,
                           experts=experts, stored=keep)


def build_runner(config: EngineConfig, par: Parallel | None = None,
                 weights: dict[str, torch.Tensor] | None = None, backend: Backend | None = None) -> ModelRunner:
    """The model runner of `config` on this rank, on `backend` (default: the one that joined `par`'s group, else a
    new one) (`weights`: official-named tensors to use instead of loading; stored FP8/FP4 bytes among them are held
    as stored). The process must be set up already (`build` / `run_job` do it)."""
    from engine.backends import get_backend
    from engine.model.model import Transformer, use_formats, use_ops
    from engine.model.ops import ops_for
    from engine.runner import ModelRunner, parse_dtype
    from engine.stack import logical_nc_config
    from nki_kernels.dispatch import Dispatcher

    par = par or Parallel()
    backend = backend or par.backend or get_backend(config)
    dispatcher = Dispatcher(lnc=logical_nc_config())  # this runner's kernel launches: the process's LNC
    ops = ops_for(config.kernels, config.model.numerics, config.cache.kv_cache_dtype)
    state = weights if weights is not None else load_weights(config, par)
    stored = str(config.model.weights) == "stored"
    model = Transformer(config.model.config, par, with_mtp=config.model.with_mtp)
    wanted = model.state_dict(keep_vars=True).keys()
    formats = stored_formats(config) if weights is None else _formats_in(state, wanted)
    use_formats(model, {k: v for k, v in formats.items() if k in wanted})
    use_ops(model, ops, backend.capabilities)
    wanted = model.state_dict(keep_vars=True).keys()
    model.load_weights({k: v for k, v in state.items() if k in wanted}, parse_dtype(config.model.dtype),
                       keep_narrow=stored)
    if weights is None:
        state.clear()  # the model holds what it needs; the rest goes now (peak memory = the weights once)
    with backend.grad_context():
        model.to(backend.device)  # weights and RoPE tables on the engine's device (a no-op on the host)
    from nki_kernels.reference import luts_on

    luts_on(backend.device)  # the FP8 / FP4 decode tables too, before any graph captures them
    return ModelRunner(config, model, par, backend, dispatcher)


def _formats_in(state: dict[str, torch.Tensor], names: Any) -> dict[str, str]:
    """Stored formats of handed-in tensors: a uint8 weight with a `.scale` beside it is FP8 ([out, in] codes, scale
    blocked by 128) or FP4 (packed [out, in/2], one scale per 32)."""
    import torch

    out = {}
    for name in names:
        w, s = state.get(name), state.get(name[: -len(".weight")] + ".scale") if name.endswith(".weight") else None
        if w is not None and s is not None and w.dtype == torch.uint8:
            out[name] = "fp4" if s.shape[0] == w.shape[0] and s.shape[1] * 16 == w.shape[1] else "fp8"
    return out


def build(config: EngineConfig, *, weights: dict[str, torch.Tensor] | None = None,
          threads: int | None = None) -> LLMEngine:
    """An `LLMEngine` for `config` in this process (one rank: use `run_job` for cp > 1): its backend is built once,
    sets the process up, and runs the model. `threads`: torch intra-op threads (default DEEPINFER_NUM_THREADS, else
    torch's)."""
    from engine.backends import get_backend
    from engine.llm import LLMEngine

    if config.cp > 1:
        raise ValueError(f"engine.build makes a one-rank engine; cp={config.cp} runs through engine.run_job")
    backend = get_backend(config)
    backend.setup_process(_threads(threads))
    return LLMEngine(config, build_runner(config, Parallel(), weights, backend))


def _threads(threads: int | None) -> int | None:
    if threads:
        return threads
    from engine.envs import get_envs

    return get_envs().DEEPINFER_NUM_THREADS or None


def _setup_rank(config: EngineConfig, rank: int, cp: int, port: int, threads: int, timeout_s: float) -> Parallel:
    """In rank process `rank`: its backend, built once, sets the process up and joins the job's group."""
    from engine.backends import get_backend

    backend = get_backend(config)
    backend.setup_process(threads, rank, world=cp, master_port=port)
    return backend.join_group(rank, cp, port, timeout_s)


def _engine_job(par: Parallel, config: EngineConfig, fn: Callable[..., Any], args: tuple) -> Any:
    from engine.llm import LLMEngine
    from engine.runner import DistributedRunner, worker_loop

    runner = build_runner(config, par)
    if par.rank != 0:
        worker_loop(runner)
        return None
    driver = DistributedRunner(runner) if par.enabled else runner
    try:
        return fn(LLMEngine(config, driver), *args)
    finally:
        if par.enabled:
            driver.shutdown()


def _torchrun(config: EngineConfig, fn: Callable[..., Any], args: tuple, threads: int | None) -> Any:
    """Under torchrun this process is one rank (the config's cp is torchrun's WORLD_SIZE): run the job; ranks > 0
    then leave quietly (exit 0), so only rank 0 goes on to print results."""
    import torch.distributed as dist

    from engine.backends import get_backend
    from engine.envs import get_envs

    backend = get_backend(config)
    backend.check_parallel(config.cp)
    backend.setup_process(_threads(threads), int(dict(get_envs().recorded).get("RANK", "0")), world=config.cp)
    par = backend.join_group(0, config.cp, None, get_envs().DEEPINFER_DIST_TIMEOUT_S)
    out = _engine_job(par, config, fn, args)
    barrier(par)  # on the gloo control group (a device group's barrier may do nothing)
    if par.rank != 0:
        dist.destroy_process_group()
        raise SystemExit(0)
    return out


def run_job(config: EngineConfig, fn: Callable[..., Any], args: tuple = (), *, timeout_s: float | None = None,
            threads: int | None = None, kill_at: tuple[int, int] | None = None) -> Any:
    """`fn(engine, *args)` on an LLMEngine built from `config` (on `config.parallel.cp` ranks). `timeout_s` bounds a
    multi-rank job (None: launch's default; math.inf for a server, which runs until it is stopped). `threads`:
    torch threads of this process (cp = 1) or split between the ranks (default DEEPINFER_NUM_THREADS).
    `kill_at=(rank, n)`: fault injection for tests (that rank SIGKILLs itself at its n-th collective)."""
    if under_torchrun():
        return _torchrun(config, fn, args, threads)
    if config.parallel.cp <= 1:
        return fn(build(config, threads=threads), *args)
    from engine.backends import backend_class

    cls = backend_class(config.backend)
    cls.check_parallel(config.parallel.cp)  # refuse up front what ranks could not run
    import torch

    total = _threads(threads) or torch.get_num_threads()
    return launch(_engine_job, config.parallel.cp, (config, fn, args), timeout_s=timeout_s, kill_at=kill_at,
                  setup=functools.partial(_setup_rank, config), threads=max(1, total // config.parallel.cp),
                  rank_env=getattr(cls, "rank_env", None))
