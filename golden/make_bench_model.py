"""Write a reproducible random DeepSeek-V4 checkpoint at realistic widths (official format, streamed to disk).

    python golden/make_bench_model.py --preset mid                   # golden/bench/mid/        (~0.8 GB)
    python golden/make_bench_model.py --preset flash --layers 2      # golden/bench/flash-2l/   (~9 GB)
    python golden/make_bench_model.py --preset mid --vocab 8192      # golden/bench/mid-v8192/  (~0.2 GB)
    python golden/make_bench_model.py --preset mid --dspark          # golden/bench/mid-dspark/ (a DSpark head)
    python golden/make_bench_model.py --list                         # the presets, their configs and sizes

Each output directory holds `config.json` (official `inference/config.json` spelling), one safetensors shard per
layer plus one for the globals (and one per MTP layer) with `model.safetensors.index.json`, and the tokenizer of
`golden/tiny` (1024 tokens) so text prompts work; ids >= 1024 decode to no text.

Streaming: every tensor is drawn chunk by chunk straight into its stored format and written at its offset, so the
generator never holds more than one chunk (~16 MB) of any weight, whatever the model size:

* FP8 e4m3 linears: codes ~ N(0, FP8_CODE_STD) cast to e4m3 (the rounding is the cast), 128x128 UE8M0 scale bytes
  drawn per block from two neighbouring exponents, mixed so the dequantised weight has std 1/sqrt(fan_in).
* FP4 e2m1 routed experts: 4-bit codes drawn from the code histogram that the official 1x32 quantiser gives a
  Gaussian weight (`FP4_CODE_COUNTS`), two per byte; 1x32 UE8M0 scales drawn the same way as for FP8.
* BF16 / F32 / I64 tensors: `make_tiny_model._init` (the tiny model's init: every parameter random, including those
  HF zero-initialises; norms ~1, mHC fn small, tid2eid distinct random experts per token), row chunk by row chunk.

Deterministic: every stored tensor has its own generator, seeded from (seed, tensor name), so the same seed gives
byte-identical files (in one environment: torch and numpy generators), and a tensor does not depend on which other
tensors the preset has (layer 0 of `flash --layers 1` is layer 0 of `flash --layers 4`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import resource
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

GOLDEN = Path(__file__).resolve().parent
ROOT = GOLDEN.parent
for p in (ROOT, GOLDEN):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from make_tiny_model import _init  # noqa: E402
from train_draft_heads import DSPARK  # noqa: E402

from engine.config import ModelConfig  # noqa: E402
from engine.loader import INDEX_FILE, expected_tensors, expert_of, official_format, split_name  # noqa: E402
from nki_kernels.formats import FP4_BLOCK, FP4_VALUES, FP8_BLOCK, FP8_MAX, UE8M0_BIAS  # noqa: E402

SEED = 20269
OUT_ROOT = GOLDEN / "bench"
TINY = GOLDEN / "tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MIN_VOCAB = 1024  # the tokenizer's ids (golden/tiny's)
CHUNK_ELEMS = 1 << 22  # elements per generated chunk (16 MB as fp32)

# FP8 codes ~ N(0, 80): the RMS of e4m3 codes the official 128x128 quantiser gives a Gaussian weight (~82; block
# amax ~4.3 sigma lands in (224, 448]). Clipped at +-448 (a 5.6 sigma tail).
FP8_CODE_STD = 80.0
# FP4: how many of 256 codes are each of the positive e2m1 codes 0..7 (values 0, .5, 1, 1.5, 2, 3, 4, 6); the
# negative codes 8..15 the same. Measured on `quant_fp4` of 4096x4096 Gaussian weights (sigma 1.0-1.9).
FP4_CODE_COUNTS = (14, 27, 24, 19, 20, 15, 8, 1)

ST_DTYPE = {"fp8": "F8_E4M3", "fp4": "I8", "scale": "F8_E8M0", "bf16": "BF16", "fp32": "F32", "i64": "I64"}
ST_ITEMSIZE = {"F8_E4M3": 1, "I8": 1, "F8_E8M0": 1, "BF16": 2, "F32": 4, "I64": 8}


# ---- presets ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Preset:
    """A model family: `fields` (ModelConfig kwargs, official names) without the layer list, plus the compress
    ratio of each main layer it can have (`--layers N` takes the first N)."""

    doc: str
    fields: dict[str, Any] = field(hash=False)
    pattern: tuple[int, ...]  # compress ratio of main layer i (0 sliding, 4 CSA, else HCA)
    layers: int  # default number of main layers
    mtp: int  # default number of MTP layers (sliding)
    hash_layers: int  # default n_hash_layers (clamped to the layer count)

    def config(self, layers: int | None = None, mtp: int | None = None,
               hash_layers: int | None = None, vocab: int | None = None, dspark: bool = False) -> ModelConfig:
        n = self.layers if layers is None else int(layers)
        if not 1 <= n <= len(self.pattern):
            raise ValueError(f"layers={n}: this preset has 1 to {len(self.pattern)} layers ({list(self.pattern)})")
        m = self.mtp if mtp is None else int(mtp)
        h = min(self.hash_layers, n) if hash_layers is None else int(hash_layers)
        if not 0 <= h <= n:
            raise ValueError(f"hash_layers={h} outside [0, layers={n}]")
        fields = dict(self.fields)
        if vocab is not None:
            if int(vocab) < MIN_VOCAB:
                raise ValueError(f"vocab={vocab}: at least {MIN_VOCAB} (the tokenizer's ids)")
            fields["vocab_size"] = int(vocab)
        if dspark:  # `DSPARK`'s head (2 stages, blocks of 5) over the streams entering the last three main layers
            if n < 3:
                raise ValueError(f"layers={n}: a DSpark head reads three main layers")
            m = DSPARK["n_mtp_layers"]
            fields.update({k: v for k, v in DSPARK.items() if k != "n_mtp_layers"},
                          dspark_target_layer_ids=(n - 3, n - 2, n - 1))
        return ModelConfig(**fields, n_layers=n, n_mtp_layers=m, n_hash_layers=h,
                           compress_ratios=self.pattern[:n] + (0,) * m)


_V4 = dict(  # what every preset shares with the released V4 checkpoints
    n_shared_experts=1, score_func="sqrtsoftplus", route_scale=1.5, swiglu_limit=10.0, rope_head_dim=64,
    norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0, rope_factor=16.0, original_seq_len=65536,
    beta_fast=32.0, beta_slow=1.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, bos_token_id=0, eos_token_id=1,
    dtype="fp8", scale_fmt="ue8m0", expert_dtype="fp4",
)

PRESETS: dict[str, Preset] = {
    "mid": Preset(
        doc="realistic-width V4 for host decode benchmarks: D 1024, 16x128 heads, 32 FP4 experts top-4",
        fields=dict(_V4, vocab_size=129280, dim=1024, moe_inter_dim=512, n_heads=16, head_dim=128, q_lora_rank=512,
                    o_groups=4, o_lora_rank=256, window_size=128, n_routed_experts=32, n_activated_experts=4,
                    index_n_heads=32, index_head_dim=128, index_topk=256, max_position_embeddings=65536),
        pattern=(0, 4, 128, 4, 128, 0), layers=6, mtp=1, hash_layers=2),
    "flash": Preset(
        doc="DeepSeek-V4-Flash layer shapes exactly (CSA / HCA alternating, as its layers 2..41), few layers",
        fields=dict(_V4, vocab_size=129280, dim=4096, moe_inter_dim=2048, n_heads=64, head_dim=512, q_lora_rank=1024,
                    o_groups=8, o_lora_rank=1024, window_size=128, n_routed_experts=256, n_activated_experts=6,
                    index_n_heads=64, index_head_dim=128, index_topk=512, max_position_embeddings=1048576),
        pattern=(4, 128, 4, 128), layers=2, mtp=0, hash_layers=1),
    "test": Preset(  # for the tests: every feature and format at FP8-block-sized widths, generates in ~1 s
        doc="small (tests): D 256, 4x128 heads, 8 FP4 experts top-2, vocab 1024",
        fields=dict(_V4, vocab_size=1024, dim=256, moe_inter_dim=128, n_heads=4, head_dim=128, q_lora_rank=128,
                    o_groups=2, o_lora_rank=128, window_size=32, n_routed_experts=8, n_activated_experts=2,
                    index_n_heads=4, index_head_dim=64, index_topk=8, max_position_embeddings=4096),
        pattern=(0, 4, 16), layers=3, mtp=1, hash_layers=1),
}


def default_out(preset: str, cfg: ModelConfig) -> Path:
    """golden/bench/<preset> for a preset's full default model, else <preset>-<N>l[-mtp<M>][-v<vocab>] (flash-2l,
    mid-2l, mid-v8192)."""
    base = PRESETS[preset]
    full = cfg.n_layers == base.layers == len(base.pattern)
    name = preset if full else f"{preset}-{cfg.n_layers}l"
    if cfg.dspark_block_size:
        name += "-dspark"
    elif cfg.n_mtp_layers != base.mtp:
        name += f"-mtp{cfg.n_mtp_layers}"
    if cfg.vocab_size != base.fields["vocab_size"]:
        name += f"-v{cfg.vocab_size}"
    return OUT_ROOT / name


# ---- parameter counts ------------------------------------------------------------------------------------------
def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Logical (dequantised) parameter counts. `total` excludes the `tid2eid` lookup tables (int64 expert ids, not
    weights), counted apart; `active` is what one token touches (embedding row excluded, top-k + shared experts)."""
    c = dict.fromkeys(("total", "embed_head", "routed", "mtp", "main_body", "active", "tid2eid"), 0)
    for name, shape in expected_tensors(cfg).items():
        n = math.prod(shape)
        if name.endswith("tid2eid"):
            c["tid2eid"] += n
            continue
        block = split_name(name)[0]
        c["total"] += n
        routed = expert_of(name) is not None
        if name in ("embed.weight", "head.weight"):
            c["embed_head"] += n
        elif block == "mtp":
            c["mtp"] += n
        elif block == "layers":
            c["main_body"] += n
        c["routed"] += n if routed else 0
        if block != "mtp" and name != "embed.weight":
            c["active"] += n * cfg.n_activated_experts // cfg.n_routed_experts if routed else n
    return c


# ---- what is stored, shard by shard ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Stored:
    """One tensor of the checkpoint as stored: `kind` fp8 / fp4 (codes), scale, bf16 / fp32 / i64."""

    key: str  # stored name
    kind: str
    shape: tuple[int, ...]  # stored shape
    logical: str  # the official tensor this is (or is the scale of)
    logical_shape: tuple[int, ...]

    @property
    def dtype(self) -> str:
        return ST_DTYPE[self.kind]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ST_ITEMSIZE[self.dtype]


def _stored(name: str, shape: tuple[int, ...], cfg: ModelConfig) -> list[Stored]:
    fmt = official_format(name, cfg)
    if fmt not in ("fp8", "fp4"):
        return [Stored(name, fmt, shape, name, shape)]
    out_f, in_f = shape
    scale = name[: -len(".weight")] + ".scale"
    if fmt == "fp8":
        return [Stored(name, "fp8", shape, name, shape),
                Stored(scale, "scale", (math.ceil(out_f / FP8_BLOCK), math.ceil(in_f / FP8_BLOCK)), name, shape)]
    return [Stored(name, "fp4", (out_f, in_f // 2), name, shape),
            Stored(scale, "scale", (out_f, in_f // FP4_BLOCK), name, shape)]


def plan(cfg: ModelConfig) -> list[tuple[str, list[Stored]]]:
    """The shards (file name, tensors in data order): globals, one per main layer, one per MTP layer. Within a
    shard, tensors go by item size (8, 4, 2, 1 bytes; checkpoint order otherwise) so every one is aligned."""
    groups: dict[str, list[Stored]] = {}
    for name, shape in expected_tensors(cfg).items():
        block, idx, _ = split_name(name)
        groups.setdefault("global" if block == "global" else f"{block}.{idx}", []).extend(_stored(name, shape, cfg))
    order = ["global"] + [f"layers.{i}" for i in range(cfg.n_layers)] + [f"mtp.{i}" for i in range(cfg.n_mtp_layers)]
    n = len(order)
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors",
             sorted(groups[g], key=lambda s: -ST_ITEMSIZE[s.dtype]))  # stable sort keeps checkpoint order
            for i, g in enumerate(order)]


# ---- drawing the values ----------------------------------------------------------------------------------------
def _tensor_seed(seed: int, key: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "little") & (2**63 - 1)


def _fp4_tables() -> tuple[np.ndarray, float]:
    counts = FP4_CODE_COUNTS + FP4_CODE_COUNTS
    lut8 = np.repeat(np.arange(16, dtype=np.uint8), counts)  # uniform byte -> code
    assert lut8.size == 256
    r = np.arange(65536, dtype=np.uint32)
    lut16 = (lut8[r & 0xFF] | (lut8[r >> 8] << 4)).astype(np.uint8)  # uniform u16 -> packed byte (two codes)
    rms = math.sqrt(sum(c * v * v for c, v in zip(counts, FP4_VALUES, strict=True)) / 256)
    return lut16, rms


FP4_LUT16, FP4_CODE_RMS = _fp4_tables()


def _linear_std(st: Stored) -> float:
    """The std the dequantised FP8 / FP4 weight should have: 1/sqrt(fan_in), as `make_tiny_model._init` gives every
    linear that is not the router or a compressor gate (both are BF16, never quantised)."""
    _, _, suffix = split_name(st.logical)
    assert suffix != "ffn.gate.weight" and not suffix.endswith("wgate.weight"), st.logical
    return 1.0 / math.sqrt(st.logical_shape[1])


def _scale_exponents(target: float, code_rms: float) -> tuple[int, float]:
    """(e, p): blocks get scale 2**e, or 2**(e+1) with probability p, so that E[(code_rms * scale)**2] = target**2."""
    e = math.floor(math.log2(target / code_rms))
    ratio = (target / (code_rms * 2.0**e)) ** 2  # in [1, 4)
    return e, (ratio - 1.0) / 3.0


def _rows_per_chunk(st: Stored, cfg: ModelConfig) -> int:
    # tid2eid rows are drawn as a [rows, n_routed_experts] argsort (distinct experts per token)
    width = cfg.n_routed_experts if st.key.endswith("tid2eid") else math.prod(st.shape[1:])
    return max(1, CHUNK_ELEMS // max(1, width))


def _chunks(st: Stored, cfg: ModelConfig, seed: int) -> Iterator[np.ndarray]:
    """The stored bytes of `st`, row chunk by row chunk, as numpy arrays."""
    s = _tensor_seed(seed, st.key)
    g = torch.Generator().manual_seed(s)
    rows = st.shape[0]
    step = _rows_per_chunk(st, cfg)
    if st.kind == "fp4":
        rng = np.random.Generator(np.random.PCG64(s))
        for r0 in range(0, rows, step):
            n = min(step, rows - r0) * st.shape[1]
            yield FP4_LUT16[rng.integers(0, 65536, n, dtype=np.uint16)]
        return
    if st.kind == "fp8":
        for r0 in range(0, rows, step):
            codes = torch.randn((min(step, rows - r0), *st.shape[1:]), generator=g).mul_(FP8_CODE_STD)
            yield codes.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return
    if st.kind == "scale":
        code_rms = FP8_CODE_STD if official_format(st.logical, cfg) == "fp8" else FP4_CODE_RMS
        e, p = _scale_exponents(_linear_std(st), code_rms)
        if not (-UE8M0_BIAS <= e and e + 1 <= UE8M0_BIAS):
            raise ValueError(f"{st.key}: scale exponent {e} outside UE8M0")
        for r0 in range(0, rows, step):
            up = torch.rand((min(step, rows - r0), *st.shape[1:]), generator=g) < p
            yield (up.to(torch.uint8) + (UE8M0_BIAS + e)).numpy()
        return
    # bf16 / fp32 / i64: the tiny model's init, drawn in row chunks (it depends on the columns only)
    if len(st.shape) == 1:
        chunks = [_init(st.key, st.shape, cfg, g)]
    else:
        chunks = (_init(st.key, (min(step, rows - r0), *st.shape[1:]), cfg, g) for r0 in range(0, rows, step))
    for t in chunks:
        if st.kind == "bf16":
            yield t.to(torch.bfloat16).view(torch.int16).numpy()
        elif st.kind == "fp32":
            yield t.to(torch.float32).numpy()
        else:
            yield t.to(torch.int64).numpy()


# ---- writing ---------------------------------------------------------------------------------------------------
def _header(tensors: list[Stored]) -> bytes:
    head: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for st in tensors:
        head[st.key] = {"dtype": st.dtype, "shape": list(st.shape), "data_offsets": [off, off + st.nbytes]}
        off += st.nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return len(raw).to_bytes(8, "little") + raw


def write_shard(path: Path, tensors: list[Stored], cfg: ModelConfig, seed: int, layout_only: bool = False) -> int:
    """Write one safetensors file, tensor by tensor, chunk by chunk. `layout_only`: the header and a sparse all-zero
    data area (the layout at no cost, for checks). Returns the data bytes."""
    head = _header(tensors)
    size = sum(st.nbytes for st in tensors)
    with path.open("wb") as f:
        f.write(head)
        if layout_only:
            f.truncate(len(head) + size)
            return size
        for st in tensors:
            n = 0
            for chunk in _chunks(st, cfg, seed):
                buf = memoryview(np.ascontiguousarray(chunk)).cast("B")
                f.write(buf)
                n += buf.nbytes
            if n != st.nbytes:
                raise AssertionError(f"{st.key}: wrote {n} bytes, header says {st.nbytes}")
    return size


def write_model(out: Path, cfg: ModelConfig, seed: int = SEED, *, layout_only: bool = False,
                log: Any = None) -> dict[str, Any]:
    """Write the checkpoint of `cfg` to `out` (config.json, shards + index, tokenizer). Returns a summary."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    (out / "config.json").write_text(json.dumps(cfg.to_official_json(), indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(TINY / name, out / name)
    weight_map: dict[str, str] = {}
    total = 0
    t0 = time.perf_counter()
    shards = plan(cfg)
    for fname, tensors in shards:
        t = time.perf_counter()
        total += write_shard(out / fname, tensors, cfg, seed, layout_only)
        weight_map.update(dict.fromkeys((st.key for st in tensors), fname))
        if log:
            log(f"  {fname}: {len(tensors)} tensors, {sum(s.nbytes for s in tensors) / 2**20:.1f} MiB, "
                f"{time.perf_counter() - t:.1f} s")
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                              "weight_map": dict(sorted(weight_map.items()))}, indent=1) + "\n")
    return {"seconds": time.perf_counter() - t0, "data_bytes": total, "shards": len(shards),
            "disk_bytes": sum(f.stat().st_size for f in out.iterdir()), "tensors": len(weight_map)}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _describe(name: str, cfg: ModelConfig) -> str:
    c = param_counts(cfg)
    data = sum(st.nbytes for _, ts in plan(cfg) for st in ts)
    keys = ("vocab_size", "dim", "n_layers", "n_mtp_layers", "compress_ratios", "n_hash_layers", "n_heads",
            "head_dim", "rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "window_size", "n_routed_experts",
            "n_activated_experts", "moe_inter_dim", "index_n_heads", "index_head_dim", "index_topk",
            "max_position_embeddings", "swiglu_limit")
    d = dataclasses.asdict(cfg)
    return (f"{name}: {PRESETS[name].doc}\n  " + ", ".join(f"{k}={d[k]}" for k in keys) + "\n"
            f"  params {c['total']:,} ({c['total'] / 1e6:.1f} M) = embed+head {c['embed_head'] / 1e6:.1f} M + main "
            f"layers {c['main_body'] / 1e6:.1f} M + MTP {c['mtp'] / 1e6:.1f} M; routed experts (all layers) "
            f"{c['routed'] / 1e6:.1f} M; active/token {c['active'] / 1e6:.1f} M; + tid2eid {c['tid2eid']:,} ids\n"
            f"  data {data / 2**30:.2f} GiB in {len(plan(cfg))} shards, config_hash {cfg.config_hash()}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="mid")
    p.add_argument("--layers", type=int, default=None, help="main layers (a prefix of the preset's layer pattern; "
                   "flash: 1-4, default 2 = CSA + HCA)")
    p.add_argument("--mtp", type=int, default=None, help="MTP layers (sliding; default: mid 1, flash 0)")
    p.add_argument("--dspark", action="store_true", help="a DSpark draft head (golden/train_draft_heads.py's "
                   "shape, random like every tensor: never accepted) in place of the MTP layers")
    p.add_argument("--hash-layers", type=int, default=None, help="the first N layers route by token hash "
                   "(default: mid 2, flash 1; at most --layers)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (embedding and head rows; default: the "
                   "preset's, mid / flash 129280 as V4; issue 24's host-speed model is mid with --vocab 8192)")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--out", type=Path, default=None, help="default golden/bench/<preset>[-<N>l]")
    p.add_argument("--layout-only", action="store_true",
                   help="headers, index and config with sparse all-zero data (checks the layout in no time)")
    p.add_argument("--list", action="store_true", help="print every preset (default layers) and exit")
    args = p.parse_args(argv)
    if args.list:
        for name, pre in PRESETS.items():
            print(_describe(name, pre.config()))
        return
    cfg = PRESETS[args.preset].config(args.layers, args.mtp, args.hash_layers, args.vocab, args.dspark)
    out = args.out or default_out(args.preset, cfg)
    print(_describe(args.preset, cfg))
    print(f"writing {out} (seed {args.seed}{', layout only' if args.layout_only else ''})")
    s = write_model(out, cfg, args.seed, layout_only=args.layout_only, log=print)
    print(f"wrote {out}: {s['tensors']} tensors in {s['shards']} shards, {s['disk_bytes'] / 2**30:.3f} GiB "
          f"({s['disk_bytes']:,} bytes), {s['seconds']:.1f} s, peak RSS {peak_rss_mib():.0f} MiB")


if __name__ == "__main__":
    main()
