"""The engine options every engine command shares, declared once (Typer `Annotated`), vLLM's spellings.

`@engine_options` appends them to a command's signature and hands the command one `EngineArgs` (the values given
on the command line; None = not given). `EngineArgs.config(**suggested)` builds the `EngineConfig`: the command's
own suggestions for its workload (e.g. golden: one slot per prompt), then what the user gave, which wins; the
DEEPINFER_* flags and the model fill the rest (engine/config.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from deepinfer_bench.bench.report import DEFAULT_MODEL_DIR
from engine.config import (
    Backend,
    DType,
    GraphMode,
    HostCompiler,
    Kernels,
    KVCacheDType,
    MoeMode,
    Numerics,
    Speculative,
    Weights,
)

PANEL = "Engine options"


def _opt(*names: str, help: str, **kw: Any) -> Any:
    return typer.Option(*names, help=help, rich_help_panel=PANEL, **kw)


@dataclasses.dataclass(frozen=True)
class EngineArgs:
    model_dir: Path = DEFAULT_MODEL_DIR
    dtype: DType | None = None
    cp: int | None = None
    graph_mode: GraphMode | None = None
    backend: Backend | None = None
    kernels: Kernels | None = None
    weights: Weights | None = None
    numerics: Numerics | None = None
    kv_cache_dtype: KVCacheDType | None = None
    moe: MoeMode | None = None
    host_compiler: HostCompiler | None = None
    chunk_graphs: bool | None = None
    batch_buckets: str | None = None
    chunk_buckets: str | None = None
    min_context_bucket: int | None = None
    speculative: Speculative | None = None
    num_speculative_tokens: int | None = None
    speculative_policy: str | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    num_kv_blocks: int | None = None
    block_size: int | None = None
    max_model_len: int | None = None
    max_input_len: int | None = None
    enable_prefix_caching: bool | None = None

    def overrides(self) -> dict[str, Any]:
        """What the user set, under EngineConfig's flat names."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "model_dir" and getattr(self, f.name) is not None}

    def model_config(self) -> Any:
        """The model's ModelConfig (config.json parsed; pass it back to `config()` to parse it once)."""
        from engine.config import ModelConfig

        return ModelConfig.from_json(self.model_dir)

    def config(self, model_config: Any = None, *, workload: Any = None, compile_only: bool = False,
               check: bool = True, **suggested: Any) -> Any:
        """The EngineConfig of this command: `suggested` settings, overridden by what the user gave; the engine
        sized for `workload` (engine.config.Workload) where neither set a size (EngineConfig.from_model_config:
        after cp is known, torchrun's WORLD_SIZE under torchrun). Its backend's stack is checked here, so a missing
        one is a single line before the command prints anything (`compile_only`: no device needed). Where `--kernels
        auto` on the host could not use the native kernels (no compiler, no build that compiles), a warning line says
        so and why: the reference it runs instead decodes several times slower. `check=False`: no stack check (a
        command that only counts, e.g. `compile --dry-run`)."""
        from engine.backends import check_available
        from engine.config import Backend, EngineConfig, Kernels

        cfg = model_config if model_config is not None else self.model_config()
        config = EngineConfig.from_model_config(cfg, model_dir=str(self.model_dir), workload=workload,
                                                **{**suggested, **self.overrides()})
        if check:
            check_available(config.backend, compile_only=compile_only)
        if (config.kernels_requested is Kernels.AUTO and config.backend is Backend.HOST
                and config.kernels is Kernels.REFERENCE):
            from rich.markup import escape

            from deepinfer_bench.bench.report import err_console

            why = config.kernels_why.removeprefix("auto: ")
            err_console.print(f"[yellow]warning:[/yellow] --kernels auto runs the torch reference (several times "
                              f"slower at decode): {escape(why)}", highlight=False)
        return config


_OPTIONS: dict[str, Any] = {
    "model_dir": Annotated[Path, _opt("--model-dir", help="DeepSeek-V4 directory: config.json (HF or official "
                                      "spelling) + safetensors (official or HF names). Default: the tiny model.")],
    "dtype": Annotated[DType | None, _opt("--dtype", help="Compute dtype (float32: exact checks; bfloat16).")],
    "cp": Annotated[int | None, _opt("--cp", min=1, help="Context/expert-parallel ranks (processes here).")],
    "graph_mode": Annotated[GraphMode | None, _opt("--graph-mode", help="Decode as eager ops, region graphs (two "
                                                   "per layer) or layer graphs; auto: eager on the host, "
                                                   "layer on xla/neuron (default: DEEPINFER_NEURON_GRAPH_MODE)")],
    "backend": Annotated[Backend | None, _opt("--backend", help="host (CPU torch), xla (the PyTorch/XLA lane), "
                                              "neuron (TorchNeuron), neuron-standin (TorchNeuron's compile pipeline "
                                              "on a CPU stand-in) or auto (default: DEEPINFER_BACKEND)")],
    "kernels": Annotated[Kernels | None, _opt("--kernels", help="Op implementation inside the model: torch "
                                              "reference, NKI kernels on the NumPy stand-in, NKI on Neuron, host "
                                              "(native CPU kernels for the decode GEMMs and per-token ops), or auto "
                                              "(default: host on the host backend where they build, else "
                                              "reference; meta.json says which and why).")],
    "weights": Annotated[Weights | None, _opt("--weights", help="FP8/FP4 weights as stored (the GEMMs read the "
                                              "checkpoint's bytes; default) or dequantised at load.")],
    "numerics": Annotated[Numerics | None, _opt("--numerics", help="hf (default): HF transformers' exact math; "
                                                "official: DeepSeek's inference/model.py numerics (FP8 KV and "
                                                "activation quantisation, Hadamard + FP4 indexer, bf16 rounding "
                                                "points).")],
    "kv_cache_dtype": Annotated[KVCacheDType | None, _opt("--kv-cache-dtype", help="auto (the compute dtype) or "
                                                          "fp8: non-RoPE KV dims as e4m3 + one scale per 64, RoPE "
                                                          "dims in the compute dtype, indexer keys quantised "
                                                          "(vLLM's flag).")],
    "moe": Annotated[MoeMode | None, _opt("--moe", help="Routed experts in decode graphs: grouped (each chosen "
                                          "expert once on its tokens, between graphs: host), gather the chosen ones "
                                          "(cost K per token), dense (every local expert), or auto (gather while "
                                          "T*K < local experts, else grouped on the host, dense on a device).")],
    "host_compiler": Annotated[HostCompiler | None, _opt("--host-compiler", help="torch.compile backend of region "
                                                         "graphs on the host (default: DEEPINFER_HOST_COMPILER)")],
    "chunk_graphs": Annotated[bool | None, _opt("--chunk-graphs/--no-chunk-graphs", help="Prefill chunks and verify "
                                                "steps as compiled chunk graphs, one per structure x chunk bucket "
                                                "(default: on for xla and neuron, off on the host and "
                                                "neuron-standin).", show_default=False)],
    "batch_buckets": Annotated[str | None, _opt("--batch-buckets", help="Batch buckets of the decode graphs, "
                                                "increasing comma-separated ints (default 1,2,4,...,256; a batch "
                                                "above the largest pads to a multiple of it).")],
    "chunk_buckets": Annotated[str | None, _opt("--chunk-buckets", help="Chunk-length buckets of the chunk graphs, "
                                                "increasing comma-separated ints (default 8,32,128,512; the "
                                                "budget --max-num-batched-tokens caps the top one).")],
    "min_context_bucket": Annotated[int | None, _opt("--min-context-bucket", min=0, help="Tokens of context the "
                                                     "first block bucket of the graphs covers (powers of two from "
                                                     "there; default 512 on neuron / neuron-standin, one block "
                                                     "elsewhere).")],
    "speculative": Annotated[Speculative | None, _opt("--speculative", help="Speculative decoding with the "
                                                      "checkpoint's own draft head: mtp (the MTP block, preview "
                                                      "checkpoints) or dspark (the DSpark head, 0731 / 0813 "
                                                      "releases); none (default).")],
    "num_speculative_tokens": Annotated[int | None, _opt("--num-speculative-tokens", min=1, max=8,
                                                         help="Drafts per sequence and step (MTP 1..4, default 1; "
                                                         "DSpark: its block size by default).")],
    "speculative_policy": Annotated[str | None, _opt("--speculative-policy", help="always (default): every decode "
                                                     "step speculates; auto: only where the measured step costs and "
                                                     "the running acceptance say it pays (docs/speculative.md).")],
    "max_num_seqs": Annotated[int | None, _opt("--max-num-seqs", min=1, help="Largest running batch (KV slots).")],
    "max_num_batched_tokens": Annotated[int | None, _opt("--max-num-batched-tokens", min=1,
                                                         help="Token budget per engine step (chunked prefill).")],
    "num_kv_blocks": Annotated[int | None, _opt("--num-kv-blocks", min=1, help="KV pool size in blocks.")],
    "block_size": Annotated[int | None, _opt("--block-size", min=1, help="Token positions per KV block (a multiple "
                                             "of every compress ratio x cp).")],
    "max_model_len": Annotated[int | None, _opt("--max-model-len", min=1, help="Longest prompt + output.")],
    "max_input_len": Annotated[int | None, _opt("--max-input-len", min=1, help="Longest prompt (default: "
                                                "max-model-len): longer requests are rejected, and only the prefill "
                                                "chunk graphs such prompts reach are compiled.")],
    "enable_prefix_caching": Annotated[bool | None, _opt("--enable-prefix-caching/--no-enable-prefix-caching",
                                                         help="Reuse the KV blocks and slot state of cached prompt "
                                                         "prefixes (vLLM's flag; default: on where exact, i.e. one "
                                                         "rank and no DSpark head).", show_default=False)],
}
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineArgs)}


USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, TypeError)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """User-facing errors (a malformed config, a bad checkpoint, an invalid layout, a failed rank, bad golden
    data...) print one clear line and exit 2; DEEPINFER_TRACEBACK=1 shows the traceback instead."""
    from deepinfer_bench.errors import UserError
    from engine.envs import get_envs
    from engine.parallel import RankFailed

    try:
        yield
    except (*USER_ERRORS, UserError, RankFailed) as e:
        try:
            traceback = get_envs().DEEPINFER_TRACEBACK
        except ValueError:  # a malformed DEEPINFER_* flag (most likely the very error reported here)
            traceback = False
        if traceback:
            raise
        from rich.markup import escape

        from deepinfer_bench.bench.report import err_console

        err_console.print(f"[red]error:[/red] {type(e).__name__}: {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


def engine_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Give command `fn(..., engine: EngineArgs)` the shared engine options (after its own)."""
    sig = inspect.signature(fn, eval_str=True)
    own = [p for p in sig.parameters.values() if p.name != "engine"]
    taken = {p.name for p in own} & set(_OPTIONS)
    if taken:
        raise TypeError(f"{fn.__name__}: parameters {sorted(taken)} clash with the shared engine options")
    shared = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=ann, default=_DEFAULTS[name])
              for name, ann in _OPTIONS.items()]

    @functools.wraps(fn)
    def command(**kwargs: Any) -> Any:
        args = EngineArgs(**{name: kwargs.pop(name) for name in _OPTIONS})
        with user_errors():
            return fn(engine=args, **kwargs)

    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + shared
    command.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command
