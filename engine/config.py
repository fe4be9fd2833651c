"""Engine configuration: one frozen `EngineConfig`, built one way, read everywhere.

`EngineConfig` nests the parts of an engine (vLLM's shape):

* `model: ModelSpec` - the model's hyper-parameters (`ModelConfig`, parsed once from config.json), where its weights
  come from (model dir, load format), the compute dtype, whether the MTP block is kept;
* `cache: CacheConfig` - scheduler and KV-pool sizes (max_num_seqs, max_num_batched_tokens, num_kv_blocks,
  block_size, max_model_len);
* `parallel: ParallelConfig` - context/expert-parallel ranks;
* `graph: GraphConfig` - how steps are cut into graphs (mode, batch buckets, chunk buckets, host compiler, region
  timing, MoE capacity);
* `backend` (host | xla | neuron | neuron-standin; "auto" is resolved here, in `resolve_backend`, and nowhere else)
  and `kernels` (which implementation of the kernel ops runs inside the model; "auto", the default, is resolved here
  too, in `resolve_kernels`: the native host kernels where they build and run, else the reference;
  `kernels_requested` and `kernels_why` say what was asked and why, in `to_dict()`).

`EngineConfig.from_model_dir(dir, workload=..., **overrides)` is the constructor every command uses; overrides are
flat names (`max_num_seqs=3`, `graph_mode="layer"`, `cp=4`; None = not given). Defaults come from the `DEEPINFER_*`
flags (engine/envs.py `engine_defaults`; under torchrun, cp is its WORLD_SIZE), then from the model. The engine's
sizes are decided here and only here, once the rank count is known: the block size follows cp, and a command's
`Workload` (how many sequences of what lengths it will run at once) becomes max_num_seqs, max_model_len,
num_kv_blocks and max_num_batched_tokens for that block size, unless the user set them. `replace(**overrides)`
derives a new config with the same flat names. The choice lists are `str` Enums in engine/choices.py.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.choices import (
    Backend,
    DType,
    GraphMode,
    HostCompiler,
    Kernels,
    KVCacheDType,
    LoadFormat,
    MoeMode,
    Numerics,
    Speculative,
    Weights,
)
from engine.model_config import ConfigError, ModelConfig

__all__ = ["Backend", "CacheConfig", "ConfigError", "DType", "EngineConfig", "GraphConfig", "GraphMode",
           "HostCompiler", "KVCacheDType", "Kernels", "LayoutError", "LoadFormat", "ModelConfig", "ModelSpec",
           "MoeMode", "Numerics", "ParallelConfig", "SpecConfig", "Speculative", "Weights", "Workload", "check_layout",
           "check_numerics", "default_block_size", "resolve_backend", "resolve_graph_mode", "resolve_kernels"]


BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Multi-token entries (prefill chunks, speculative verify steps) run as graphs of C tokens per sequence, C one of
# these (capped by max_num_batched_tokens: GraphConfig.chunk_sizes); the scheduler cuts chunks to fit them.
CHUNK_BUCKETS = (8, 32, 128, 512)
# The first context bucket of TorchNeuron's graphs, in tokens (GraphConfig.min_context_bucket; vLLM Neuron's context
# buckets start high for the same reason: every bucket is a compile of every structure x batch bucket)
MIN_CONTEXT_BUCKET = 512


class LayoutError(ValueError):
    """A parallel layout that this model cannot use."""


def check_layout(cfg: ModelConfig, cp: int) -> None:
    """Reject invalid context/expert-parallel layouts up front, with the reason."""
    if cp < 1:
        raise LayoutError(f"cp={cp}: must be >= 1")
    if cp == 1:
        return
    problems = []
    if cfg.n_routed_experts % cp:
        problems.append(f"cp={cp} does not divide n_routed_experts={cfg.n_routed_experts} (experts are sharded)")
    if cfg.window_size % cp:
        problems.append(f"cp={cp} does not divide window_size={cfg.window_size} (the window KV is sharded)")
    if cp > cfg.window_size:
        problems.append(f"cp={cp} is larger than window_size={cfg.window_size}")
    if problems:
        raise LayoutError("invalid parallel layout: " + "; ".join(problems))


KV_FP8_BLOCK = 64  # FP8 KV (and the official KV simulation): one UE8M0 scale per 64 non-RoPE dims
ACT_BLOCK = 128  # official activation quantisation before FP8/FP4 GEMMs: one scale per 128 along K
INDEX_FP8_BLOCK = 128  # FP8 indexer keys under hf numerics (vLLM's layout): one scale per 128
INDEX_FP4_BLOCK = 32  # official indexer simulation: Hadamard + e2m1 with one scale per 32


def check_numerics(cfg: ModelConfig, numerics: Numerics | str, kv_cache_dtype: KVCacheDType | str,
                   weights: Weights | str = Weights.STORED) -> None:
    """One line naming what keeps this model / these options from `--numerics official` or `--kv-cache-dtype
    fp8` (the official code asserts the same shapes; an FP8 cache whose blocks do not fit would be a wrong
    cache). Nothing to check for hf numerics with an auto cache."""
    official = str(numerics) == Numerics.OFFICIAL.value
    fp8 = str(kv_cache_dtype) == KVCacheDType.FP8.value
    nope, di = cfg.head_dim - cfg.rope_head_dim, cfg.index_head_dim
    csa = any(ModelConfig.ratio_is_csa(m) for m in cfg.compress_ratios)
    problems = []
    if (fp8 or official) and nope % KV_FP8_BLOCK:
        problems.append(f"head_dim - rope_head_dim = {cfg.head_dim} - {cfg.rope_head_dim} = {nope} non-RoPE KV dims "
                        f"are not a multiple of the {KV_FP8_BLOCK}-wide FP8 blocks (one scale per {KV_FP8_BLOCK})")
    if csa and official and (di & (di - 1) or di % INDEX_FP4_BLOCK):
        problems.append(f"index_head_dim={di} is not a power of two divisible by {INDEX_FP4_BLOCK} (the indexer's "
                        f"Hadamard rotation + FP4 blocks)")
    elif csa and fp8 and not official and di % INDEX_FP8_BLOCK:
        problems.append(f"index_head_dim={di} is not a multiple of {INDEX_FP8_BLOCK} (FP8 indexer keys, one scale "
                        f"per {INDEX_FP8_BLOCK})")
    if official:
        widths = {"dim": cfg.dim, "q_lora_rank": cfg.q_lora_rank, "moe_inter_dim": cfg.moe_inter_dim,
                  "o_groups * o_lora_rank": cfg.o_groups * cfg.o_lora_rank}
        bad = [f"{k}={v}" for k, v in widths.items() if v % ACT_BLOCK]
        if bad:
            problems.append(f"GEMM input widths {', '.join(bad)} are not multiples of {ACT_BLOCK} (the per-token "
                            f"activation quantisation before FP8/FP4 GEMMs)")
        if str(weights) == Weights.DEQUANT.value:
            problems.append("it quantises the activations of exactly the GEMMs whose weights stay FP8/FP4 "
                            "(as the official linear() does), so it needs --weights stored")
    if problems:
        what = " and ".join(f"--{n}" for n, on in (("numerics official", official), ("kv-cache-dtype fp8", fp8))
                            if on)
        raise ValueError(f"{what}: " + "; ".join(problems))


def default_block_size(cfg: ModelConfig, cp: int = 1) -> int:
    """Smallest multiple of every compress ratio x cp that is at least 16 (128 x cp for the real models)."""
    size = 1
    for r in set(cfg.compress_ratios):
        if r:
            size = size * r // math.gcd(size, r)
    size *= cp
    return size * max(1, -(-16 // size))


@dataclass(frozen=True)
class Workload:
    """What a job will run, in tokens: the engine's sizes follow from it once the block size (hence cp) is known.

    `max_num_seqs` sequences at once, none longer than `max_model_len` (prompt + output); the KV pool must hold
    `pool_tokens` token positions and every group of `pool` at once (a group: the lengths of sequences that run
    together; each rounds up to whole blocks); one step should take `max_num_batched_tokens` tokens (0: one per
    sequence); no prompt is longer than `max_input_len` (0: max_model_len)."""

    max_num_seqs: int
    max_model_len: int
    pool: tuple[tuple[int, ...], ...] = ()
    pool_tokens: int = 0
    max_num_batched_tokens: int = 0
    max_input_len: int = 0

    def sizes(self, block_size: int, cfg: ModelConfig) -> dict[str, int]:
        """The flat engine sizes for `block_size` (max_model_len capped by the model's max_position_embeddings)."""
        def blocks(n: int) -> int:
            return -(-int(n) // block_size)

        need = max([blocks(self.pool_tokens), *(sum(blocks(n) for n in group) for group in self.pool)], default=0)
        max_len = min(int(self.max_model_len), cfg.max_position_embeddings)
        return {"max_num_seqs": int(self.max_num_seqs), "max_model_len": max_len,
                "num_kv_blocks": max(1, need, blocks(max_len)),
                "max_num_batched_tokens": max(int(self.max_num_batched_tokens), int(self.max_num_seqs)),
                "max_input_len": min(int(self.max_input_len), max_len)}


def resolve_graph_mode(requested: GraphMode | str, backend: Backend) -> GraphMode:
    """The one place graph mode "auto" is resolved: eager ops on the host (no compile time; `layer` is the faster
    compiled option there); `layer` graphs on a graph backend (xla, neuron, neuron-standin), where eager decode runs
    each op as its own device graph and its data-dependent routing (nonzero, bincount) syncs with the host."""
    mode = GraphMode.parse(requested, "graph mode")
    if mode is not GraphMode.AUTO:
        return mode
    return GraphMode.EAGER if backend is Backend.HOST else GraphMode.LAYER


def resolve_kernels(requested: Kernels | str, backend: Backend) -> tuple[Kernels, str]:
    """The one place `--kernels auto` is resolved, with the reason (results metadata): the native host kernels
    (engine/host_kernels: the fastest exact path there) on the host backend where a C compiler is there to build
    the best variant this CPU runs (`host_kernels.probe`: decided without compiling; the build happens at first
    use, and a failing one is an error there); the torch reference everywhere else. A kernel table that is given is
    kept as it is (the backend checks it: engine/backends `get_backend`)."""
    want = Kernels.parse(requested, "kernels")
    if want is not Kernels.AUTO:
        return want, "given"
    if backend is not Backend.HOST:
        return Kernels.REFERENCE, f"auto: the {backend} backend runs the reference (the native kernels are CPU-only)"
    from engine import host_kernels

    try:
        variant = host_kernels.probe()
    except host_kernels.HostKernelError as e:
        return Kernels.REFERENCE, f"auto: the native host kernels are unavailable here ({e})"
    # decided from the CPU's flags; the library's own cpuid check, at load, may step down past a build the flags
    # promise (an emulator or a VM that hides AVX-512): what ran is the results' stack.host_kernels.loaded
    return Kernels.HOST, (f"auto: native host kernels, {variant} build: {host_kernels.build_info()['why']} by its "
                          "flags (a build its own cpuid check refuses at load steps down: stack.host_kernels.loaded)")


def resolve_backend(requested: Backend | str) -> Backend:
    """The one place "auto" is resolved (engine/stack.py `neuron_stack` tells the stacks apart): a Neuron device with
    TorchNeuron (native torch-neuronx >= 2.13) -> neuron; a Neuron device with the legacy PyTorch/XLA torch-neuronx
    -> xla (on the Neuron PJRT device); anything else -> host, including TorchNeuron installed without a device.
    neuron-standin and xla on PJRT CPU are verification paths, never chosen automatically."""
    want = Backend.parse(requested, "backend")
    if want is not Backend.AUTO:
        return want
    from engine.stack import neuron_stack

    stack = neuron_stack()
    if not stack.device:
        return Backend.HOST
    return {"torchneuron": Backend.NEURON, "xla": Backend.XLA}.get(stack.kind, Backend.HOST)


def _positive_ints(obj: Any, names: tuple[str, ...]) -> None:
    for name in names:
        v = getattr(obj, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


@dataclass(frozen=True)
class ModelSpec:
    config: ModelConfig
    model_dir: str | None = None  # None: weights are handed to engine.build() (tests, benchmarks sharing weights)
    load_format: LoadFormat = LoadFormat.SAFETENSORS
    dtype: DType = DType.FLOAT32  # compute dtype of activations and non-fp32-kept weights
    with_mtp: bool = False  # load and keep the MTP block (mtp.*) and its cache
    weights: Weights = Weights.STORED  # FP8/FP4 weights as stored (bytes), or dequantised at load
    numerics: Numerics = Numerics.HF  # hf: HF's exact math; official: DeepSeek's steps (engine/model/numerics.py)

    def __post_init__(self) -> None:
        if not isinstance(self.config, ModelConfig):
            raise ValueError(f"model config must be a ModelConfig, got {type(self.config).__name__}")
        object.__setattr__(self, "load_format", LoadFormat.parse(self.load_format, "load_format"))
        object.__setattr__(self, "dtype", DType.parse(self.dtype, "dtype"))
        object.__setattr__(self, "weights", Weights.parse(self.weights, "weights"))
        object.__setattr__(self, "numerics", Numerics.parse(self.numerics, "numerics"))
        if self.model_dir is not None:
            object.__setattr__(self, "model_dir", str(self.model_dir))  # accept a Path, store a str


@dataclass(frozen=True)
class CacheConfig:
    """Scheduler limits and the fixed KV pool (vLLM's names)."""

    max_num_seqs: int = 8  # fixed KV slots = largest running batch
    max_num_batched_tokens: int = 512  # per-step token budget (chunked prefill)
    num_kv_blocks: int = 64  # fixed KV pool size
    block_size: int = 128  # token positions per block; a multiple of every compress ratio x cp
    max_model_len: int = 4096  # longest prompt + output
    # longest prompt (0: max_model_len): a longer request is rejected on arrival, and the prefill chunk graphs
    # compiled are those a prompt up to this long reaches (engine/regions.py `chunk_shapes`)
    max_input_len: int = 0
    kv_cache_dtype: KVCacheDType = KVCacheDType.AUTO  # window ring + compressed pool: compute dtype, or FP8 + scales
    # reuse the KV blocks and slot state of cached prompt prefixes (engine/kv_cache.py); None: EngineConfig turns
    # it on where it is exact (one rank, no DSpark head), a bare CacheConfig (scheduler tests) leaves it off
    enable_prefix_caching: bool | None = None
    # slot-state snapshots of cached prefixes, one per block boundary kept (0: one per 32 pool blocks, at least two
    # per slot); each is about one slot's fixed state (window rings, CSA compressor states: ~10 pool blocks on V4)
    num_prefix_snapshots: int = 0

    def __post_init__(self) -> None:
        _positive_ints(self, ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "block_size",
                              "max_model_len"))
        object.__setattr__(self, "kv_cache_dtype", KVCacheDType.parse(self.kv_cache_dtype, "kv_cache_dtype"))
        m = self.max_input_len
        if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m <= self.max_model_len:
            raise ValueError(f"max_input_len must be an int in [0, max_model_len={self.max_model_len}] (0: "
                             f"max_model_len), got {m!r}")
        if not isinstance(self.num_prefix_snapshots, int) or self.num_prefix_snapshots < 0:
            raise ValueError(f"num_prefix_snapshots must be an int >= 0, got {self.num_prefix_snapshots!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_num_seqs="
                             f"{self.max_num_seqs} (every running sequence decodes one token per step)")

    @property
    def input_limit(self) -> int:
        """The longest prompt a request may have: max_input_len, else max_model_len."""
        return self.max_input_len or self.max_model_len

    @property
    def pool_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def prefix_snapshots(self) -> int:
        """Slot-state snapshots the prefix cache keeps (0 when it is off)."""
        if not self.enable_prefix_caching:
            return 0
        return self.num_prefix_snapshots or max(2 * self.max_num_seqs, self.num_kv_blocks // 32)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


@dataclass(frozen=True)
class ParallelConfig:
    cp: int = 1  # context-parallel ranks (attention KV sharded by position; routed experts sharded the same way)

    def __post_init__(self) -> None:
        _positive_ints(self, ("cp",))


@dataclass(frozen=True)
class GraphConfig:
    mode: GraphMode = GraphMode.EAGER
    batch_buckets: tuple[int, ...] = BATCH_BUCKETS  # decode batches are padded to one of these
    host_compiler: HostCompiler = HostCompiler.INDUCTOR  # torch.compile backend of region graphs on the host
    region_timing: bool = False  # run regions stage by stage with a sync and a clock read at every split()
    moe_capacity: float = 0.0  # capacity factor of the grouped expert path for prefill chunks (0 = off)
    moe: MoeMode = MoeMode.AUTO  # routed experts in decode regions (eager/prefill always run only the chosen ones)
    batch_decode: bool = True  # vectorised decode path (False: every sequence through the chunk path; tests)
    chunk_buckets: tuple[int, ...] = CHUNK_BUCKETS  # tokens per sequence of a multi-token graph (see chunk_sizes)
    # multi-token entries (prefill chunks, verify steps) as chunk-region graphs; None (auto) is resolved with the
    # backend (EngineConfig): on in the graph modes of a device backend, off on the host (eager prefill there)
    chunk_graphs: bool | None = None
    # tokens of context the first block bucket covers (the block buckets are powers of two from there): below it a
    # smaller bucket saves little (decode at short context reads weights, not KV) and costs a graph per structure x
    # batch bucket; None (auto) is resolved with the backend (EngineConfig): MIN_CONTEXT_BUCKET on TorchNeuron, one
    # block elsewhere
    min_context_bucket: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", GraphMode.parse(self.mode, "graph mode"))
        object.__setattr__(self, "host_compiler", HostCompiler.parse(self.host_compiler, "host compiler"))
        object.__setattr__(self, "moe", MoeMode.parse(self.moe, "moe"))
        for name in ("batch_buckets", "chunk_buckets"):
            raw = getattr(self, name)
            items = raw.split(",") if isinstance(raw, str) else raw  # "8,32,128" from the CLI / environment
            try:
                buckets = tuple(int(b) for b in items)
            except (TypeError, ValueError):
                raise ValueError(f"{name} must be increasing positive ints, got {raw!r}") from None
            if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
                raise ValueError(f"{name} must be increasing positive ints, got {raw!r}")
            object.__setattr__(self, name, buckets)
        if not isinstance(self.moe_capacity, (int, float)) or self.moe_capacity < 0:
            raise ValueError(f"moe_capacity must be a number >= 0, got {self.moe_capacity!r}")
        object.__setattr__(self, "moe_capacity", float(self.moe_capacity))
        m = self.min_context_bucket
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 0):
            raise ValueError(f"min_context_bucket must be an int >= 0 (tokens), got {m!r}")

    def min_blocks(self, block_size: int) -> int:
        """The first block bucket, in blocks (at least one)."""
        return max(1, -(-(self.min_context_bucket or 0) // block_size))

    def chunk_sizes(self, max_num_batched_tokens: int) -> tuple[int, ...]:
        """The chunk buckets a step can use: those below max_num_batched_tokens, then the budget itself as the top
        bucket when it is below the largest (e.g. (8, 32, 128, 512) and 24 tokens -> (8, 24)): a full-budget chunk
        needs no padding, and no graph is made for a length no step can have."""
        top = min(self.chunk_buckets[-1], max_num_batched_tokens)
        return tuple(b for b in self.chunk_buckets if b < top) + (top,)

    def scheduler_buckets(self, max_num_batched_tokens: int) -> tuple[int, ...]:
        """The chunk sizes the scheduler cuts prefill chunks to fit (engine/scheduler.py): `chunk_sizes` when chunks
        run as graphs, else none (any length runs eagerly as it is)."""
        return self.chunk_sizes(max_num_batched_tokens) if self.chunk_graphs else ()


MAX_SPECULATIVE_TOKENS = 8
SPEC_POLICIES = ("auto", "always")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding (vLLM's names): `method` none | mtp | dspark; `num_speculative_tokens` k drafts per
    sequence and step (MTP: 1..4, the one block applied k times; DSpark: its checkpoint's block size unless
    given). The slot state then holds k spare positions (engine/model/cache.py), so rejected drafts need no rollback
    of it."""

    method: Speculative = Speculative.NONE
    num_speculative_tokens: int = 0  # 0: the method's default (MTP 1, DSpark the checkpoint's block size)
    # always: every decode step; auto: a step speculates only where the measured costs and acceptance say it pays
    # (engine/speculative.py SpecPolicy; timing-based, so which steps verify varies run to run: opt-in)
    policy: str = "always"

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", Speculative.parse(self.method, "speculative"))
        if self.policy not in SPEC_POLICIES:
            raise ValueError(f"speculative_policy={self.policy!r} is not one of {', '.join(SPEC_POLICIES)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an int in [0, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.method is Speculative.MTP and k > 4:
            raise ValueError(f"num_speculative_tokens={k}: MTP drafts 1..4 tokens (one block applied recursively)")
        if self.method is Speculative.NONE and k:
            raise ValueError(f"num_speculative_tokens={k} without --speculative mtp | dspark")

    @property
    def enabled(self) -> bool:
        return self.method is not Speculative.NONE


# Flat override name -> (part, field). The CLI options, the DEEPINFER_* defaults and `replace()` all use these.
_FLAT: dict[str, tuple[str, str]] = {
    "load_format": ("model", "load_format"), "dtype": ("model", "dtype"), "with_mtp": ("model", "with_mtp"),
    "weights": ("model", "weights"), "numerics": ("model", "numerics"),
    **{f.name: ("cache", f.name) for f in dataclasses.fields(CacheConfig)},
    "cp": ("parallel", "cp"),
    "graph_mode": ("graph", "mode"), "batch_buckets": ("graph", "batch_buckets"),
    "chunk_buckets": ("graph", "chunk_buckets"), "chunk_graphs": ("graph", "chunk_graphs"),
    "min_context_bucket": ("graph", "min_context_bucket"),
    "host_compiler": ("graph", "host_compiler"), "region_timing": ("graph", "region_timing"),
    "moe_capacity": ("graph", "moe_capacity"), "batch_decode": ("graph", "batch_decode"), "moe": ("graph", "moe"),
    "speculative": ("spec", "method"), "num_speculative_tokens": ("spec", "num_speculative_tokens"),
    "speculative_policy": ("spec", "policy"),
    "backend": ("", "backend"), "kernels": ("", "kernels"), "seed": ("", "seed"),
}
OVERRIDES = tuple(_FLAT)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelSpec
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    graph: GraphConfig = field(default_factory=GraphConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    backend: Backend = Backend.HOST
    kernels: Kernels = Kernels.AUTO  # "auto" is resolved in __post_init__ (`resolve_kernels`)
    seed: int = 0  # seeds unseeded requests' generators (and dummy weights)
    # what --kernels asked for (auto, or the table itself) and why `kernels` is what it is (for results metadata)
    kernels_requested: Kernels = field(default=Kernels.AUTO, init=False, compare=False)
    kernels_why: str = field(default="", init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", resolve_backend(self.backend))
        if self.graph.mode is GraphMode.AUTO:
            mode = resolve_graph_mode(self.graph.mode, self.backend)
            object.__setattr__(self, "graph", dataclasses.replace(self.graph, mode=mode))
        if self.graph.chunk_graphs is None:
            # device backends (xla, neuron); not the host, and not yet neuron-standin: each stand-in compile costs
            # ~40 s on a 2-core CPU, so its 32 chunk graphs would add ~20+ min to its golden (opt in: chunk_graphs=True)
            chunks = self.graph.mode is not GraphMode.EAGER and self.backend in (Backend.XLA, Backend.NEURON)
            object.__setattr__(self, "graph", dataclasses.replace(self.graph, chunk_graphs=chunks))
        elif self.graph.chunk_graphs and self.graph.mode is GraphMode.EAGER:
            raise ValueError("chunk_graphs needs graph mode regions or layer (eager mode makes no graphs)")
        if self.graph.min_context_bucket is None:
            first = MIN_CONTEXT_BUCKET if self.backend in (Backend.NEURON, Backend.NEURON_STANDIN) else 0
            object.__setattr__(self, "graph", dataclasses.replace(self.graph, min_context_bucket=first))
        requested = Kernels.parse(self.kernels, "kernels")
        kernels, why = resolve_kernels(requested, self.backend)
        for name, value in (("kernels", kernels), ("kernels_requested", requested), ("kernels_why", why)):
            object.__setattr__(self, name, value)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        cfg, cp, bs = self.model.config, self.parallel.cp, self.cache.block_size
        check_layout(cfg, cp)
        bad = sorted({m for m in cfg.compress_ratios if m and bs % (m * cp)})
        if bad:
            raise ValueError(f"block_size={bs} must be a multiple of every compress ratio x cp={cp} (not of "
                             f"{', '.join(str(m * cp) for m in bad)}); the default for this model is "
                             f"{default_block_size(cfg, cp)}")
        check_numerics(cfg, self.model.numerics, self.cache.kv_cache_dtype, self.model.weights)
        self._resolve_prefix_caching()
        if self.cache.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={self.cache.max_model_len} exceeds the model's "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        self._resolve_spec()

    def _resolve_prefix_caching(self) -> None:
        """--enable-prefix-caching given where it is not exact (`prefix_caching_blocker`): one error line."""
        why = self.prefix_caching_blocker
        if self.cache.enable_prefix_caching and why:
            raise ValueError(f"--enable-prefix-caching is not exact with {why}; use --no-enable-prefix-caching")

    @property
    def prefix_caching_blocker(self) -> str:
        """Why prefix caching would not be exact here ("" where it is): it is where the whole decode state of a
        prefix is this process's pool blocks and slot (engine/kv_cache.py), so not under cp > 1 (the other ranks'
        shares) nor with a DSpark head (its draft context is not in the slot state)."""
        if self.parallel.cp > 1:
            return "cp > 1 (each rank holds a share of the state)"
        if self.spec.method is Speculative.DSPARK:
            return "--speculative dspark (its draft context is not in the slot state)"
        return ""

    @property
    def prefix_caching(self) -> bool:
        """Whether the engine caches prefixes: as given, else (auto) wherever it is exact, like vLLM's default - on
        the host backend only: the state snapshots are eager copies of the slot's tensors, which on a graph backend
        (xla, neuron) would run as new device graphs between the compiled steps."""
        want = self.cache.enable_prefix_caching
        if want is not None:
            return bool(want)
        return self.backend == Backend.HOST and not self.prefix_caching_blocker

    @property
    def scheduler_cache(self) -> CacheConfig:
        """The cache config the scheduler runs with: prefix caching resolved to on or off."""
        return dataclasses.replace(self.cache, enable_prefix_caching=self.prefix_caching)

    def _resolve_spec(self) -> None:
        """Speculation needs the checkpoint's draft head (its `mtp.*` weights loaded) and a number of drafts: the
        method's default when not given (MTP 1, DSpark its block size)."""
        spec, cfg = self.spec, self.model.config
        if not spec.enabled:
            return
        if spec.method is Speculative.MTP and (cfg.n_mtp_layers < 1 or getattr(cfg, "has_dspark", False)):
            raise ValueError("--speculative mtp needs a checkpoint with an MTP block (num_nextn_predict_layers >= 1"
                             + ("; this one carries a DSpark head: use --speculative dspark)" if
                                getattr(cfg, "has_dspark", False) else ")"))
        if spec.method is Speculative.DSPARK and not getattr(cfg, "has_dspark", False):
            raise ValueError("--speculative dspark needs a checkpoint with a DSpark head under mtp.* (its config "
                             "names the DSpark fields); this one has none")
        k = spec.num_speculative_tokens or (1 if spec.method is Speculative.MTP else int(cfg.dspark_block_size))
        object.__setattr__(self, "spec", dataclasses.replace(spec, num_speculative_tokens=k))
        if not self.model.with_mtp:
            object.__setattr__(self, "model", dataclasses.replace(self.model, with_mtp=True))

    @property
    def spare_positions(self) -> int:
        """Draft positions past the last accepted token the slot state must hold (0 without speculation)."""
        return self.spec.num_speculative_tokens if self.spec.enabled else 0

    # ---- constructors -----------------------------------------------------------------------------------------
    @classmethod
    def from_model_dir(cls, model_dir: str | Path, *, workload: Workload | None = None, **overrides: Any,
                       ) -> EngineConfig:
        """The engine config of the model in `model_dir` (config.json parsed once, here). `overrides` are flat
        names (see OVERRIDES); None values are ignored; the DEEPINFER_* flags fill what is not given; `workload`
        sizes the engine (see the module docstring)."""
        return cls.from_model_config(ModelConfig.from_json(Path(model_dir)), model_dir=str(model_dir),
                                     workload=workload, **overrides)

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, *, model_dir: str | None = None, workload: Workload | None = None,
                          **overrides: Any) -> EngineConfig:
        """As `from_model_dir`, for a ModelConfig at hand (weights then come from `engine.build(weights=...)`
        unless `model_dir` is given or load_format is dummy)."""
        from engine.envs import engine_defaults, get_envs

        given = _check_names({k: v for k, v in overrides.items() if v is not None})
        defaults = engine_defaults(get_envs())
        world = defaults.pop("world_size", None)
        if world is not None and "cp" in given and int(given["cp"]) != world:
            raise ValueError(f"cp={given['cp']} under torchrun with WORLD_SIZE={world}: the ranks are torchrun's "
                             f"(drop --cp or give --cp {world})")
        flat = {**defaults, **({"cp": world} if world is not None else {}), **given}
        cp = int(flat.get("cp", 1))
        flat.setdefault("block_size", default_block_size(cfg, cp))  # the block size follows the rank count
        if workload is not None:
            for name, value in workload.sizes(int(flat["block_size"]), cfg).items():
                flat.setdefault(name, value)
        flat.setdefault("max_model_len", min(CacheConfig.max_model_len, cfg.max_position_embeddings))
        if "max_input_len" not in given:  # a workload's longest prompt, within a max_model_len the user lowered
            flat["max_input_len"] = min(int(flat.get("max_input_len") or 0), int(flat["max_model_len"]))
        return _assemble(ModelSpec(config=cfg, model_dir=model_dir), flat)

    def replace(self, **overrides: Any) -> EngineConfig:
        """A new config with `overrides` (flat names; None values ignored) applied to this one."""
        given = _check_names({k: v for k, v in overrides.items() if v is not None})
        flat = self.flat()
        if self.kernels_requested is Kernels.AUTO:
            flat["kernels"] = Kernels.AUTO  # resolved again for the new settings (e.g. another backend)
        cfg = self.model.config
        if "cp" in given and "block_size" not in given and flat["block_size"] == default_block_size(cfg, self.cp):
            given["block_size"] = default_block_size(cfg, int(given["cp"]))  # a defaulted block size follows cp
        return _assemble(self.model, {**flat, **given})

    # ---- views ------------------------------------------------------------------------------------------------
    def flat(self) -> dict[str, Any]:
        """Every setting under its flat name."""
        return {name: getattr(getattr(self, part) if part else self, attr) for name, (part, attr) in _FLAT.items()}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready record for results metadata (the model config as its hash plus the directory)."""
        d = {k: (v.value if isinstance(v, enum.Enum) else list(v) if isinstance(v, tuple) else v)
             for k, v in self.flat().items()}
        d.update(kernels_requested=self.kernels_requested.value, kernels_why=self.kernels_why,
                 model_dir=self.model.model_dir, model_config_hash=self.model.config.config_hash(),
                 config_hash=self.config_hash())
        return d

    def config_hash(self) -> str:
        blob = json.dumps({**{k: str(v) for k, v in self.flat().items()},
                           "model": self.model.config.config_hash()}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @property
    def model_config(self) -> ModelConfig:
        return self.model.config

    @property
    def cp(self) -> int:
        return self.parallel.cp


def _check_names(overrides: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(overrides) - set(_FLAT))
    if unknown:
        raise TypeError(f"unknown engine setting(s) {', '.join(unknown)}; known: {', '.join(_FLAT)}")
    return overrides


def _assemble(model: ModelSpec, flat: dict[str, Any]) -> EngineConfig:
    parts: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "parallel": {}, "graph": {}, "spec": {}, "": {}}
    for name, value in flat.items():
        part, attr = _FLAT[name]
        parts[part][attr] = value
    return EngineConfig(model=dataclasses.replace(model, **parts["model"]), cache=CacheConfig(**parts["cache"]),
                        parallel=ParallelConfig(**parts["parallel"]), graph=GraphConfig(**parts["graph"]),
                        spec=SpecConfig(**parts["spec"]), **parts[""])
