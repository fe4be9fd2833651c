"""Reference functions of the low-precision steps of DeepSeek's official V4 inference (`inference/model.py` +
`kernel.py`, current revision): the single torch definition of each step, for the `--numerics official` engine
path, an FP8 KV cache, and the official golden (golden/make_official_golden.py).

What the official code does (spec deepseek_v4.md §4.2, §4.3), and the function here that does the same:

* KV FP8 simulation - `kv_fp8_qdq` (= `fp8_qdq` on the first `head_dim - rope_dim` dims, 64-wide blocks): window
  KV after norm + RoPE, and every compressed CSA/HCA entry. A stored FP8 cache keeps what `fp8_quant` returns (e4m3
  bytes + one UE8M0 byte per 64) and reads it back with `fp8_dequant`: bit-identical to `fp8_qdq`.
* Indexer query and key FP4 simulation - `indexer_fp4_qdq`: orthonormal Walsh-Hadamard rotation (`hadamard`,
  Sylvester order, scale n^-0.5, result rounded to the input dtype), then e2m1 quant-dequant in 32-wide blocks
  (`fp4_qdq`; stored form `fp4_quant` / `fp4_dequant`).
* Activation quantisation before every FP8 / FP4 GEMM - `fp8_quant(x, ACT_BLOCK)` (128-wide blocks along K), then
  `fp8_gemm` / `fp4_gemm`: per-K-block products of the unscaled codes (fp32), scaled by a_s * w_s, accumulated in
  fp32 block after block, rounded once to the output dtype (the official kernels write bf16). `act_linear` chains
  both.
* bf16 indexer scores - `indexer_weights_bf16`, `index_score_bf16` (`indexer_weights_rounded`,
  `index_score_rounded`: the same roundings to the input dtype, so also the fp32 staging form).
* The other rounding points of the official forward in the compute dtype (bf16 there): the per-head query RMS
  normalisation in that dtype's arithmetic (`head_rms`), attention probabilities rounded to the keys' dtype before
  P @ V (`sparse_attn_rounded`, `sparse_attn_partial_rounded`).
* Stored FP4 codes two per byte (`pack_nibbles` / `unpack_nibbles`, low nibble = even element, as the checkpoint
  packs them): the FP8 KV cache keeps the official indexer keys this way (engine/model/cache.py).

Rules shared by every quantiser (the official `act_quant` / `fp4_act_quant` kernels with `scale_fmt="ue8m0"`):
per block, ``a = max(amax, floor) * fp32(1 / max)`` (the kernel multiplies by the fp32 reciprocal), scale
``s = 2**ceil(log2(a))`` (UE8M0: a power of two), ``y = clamp(x / s, -max, max)`` rounded to the element format
with round-to-nearest-even, value ``y * s``. FP8 e4m3fn: max 448, amax floor 1e-4, normals 1.xxx * 2**e
(e >= -6), subnormals k * 2**-9. FP4 e2m1: max 6, amax floor 6 * 2**-126, values 0, 0.5, 1, 1.5, 2, 3, 4, 6.
x / s and y * s are exact (s is a power of two), so quant-dequant is exact in bf16 and fp32 alike.

Device-safe form: math in fp32 on the input's device; no float8 / float4 dtypes, no bitcasts, no `exp2` / `ldexp` /
`pow`, no host syncs, no data-dependent shapes. Exponents come from comparisons with exact powers of two, powers of
two and code values from small exact tables (gathers; built once from `reference.ue8m0_decode` and the format
definitions), rounding from `torch.round` (half to even). Codes and scales are uint8: e4m3fn
bytes (sign << 7 | exponent << 3 | mantissa), e2m1 codes 0..15 one per element (`formats.pack_fp4` packs them as
the checkpoint does), UE8M0 bytes (exponent + 127). Only torch APIs that torch 2.9 has.
"""

from __future__ import annotations

import torch

from nki_kernels.formats import FP4_AMAX_FLOOR, FP4_MAX, FP8_AMAX_FLOOR, FP8_MAX
from nki_kernels.reference import sparse_attn_merge, ue8m0_decode

__all__ = [
    "KV_BLOCK", "ACT_BLOCK", "FP4_ACT_BLOCK",
    "scale_exponent", "round_e4m3", "round_e2m1",
    "fp8_quant", "fp8_dequant", "fp8_qdq", "kv_fp8_qdq",
    "fp4_quant", "fp4_dequant", "fp4_qdq", "hadamard", "indexer_fp4_qdq",
    "e4m3_decode", "ue8m0_value", "fp8_gemm", "fp4_gemm", "act_linear",
    "indexer_weights_bf16", "index_score_bf16", "indexer_weights_rounded", "index_score_rounded",
    "head_rms", "sparse_attn_partial_rounded", "sparse_attn_rounded", "sparse_attn_partial_exact",
    "sparse_attn_exact", "act_linear_exact", "index_score_exact", "linear_exact", "grouped_out_proj_exact",
    "pack_nibbles", "unpack_nibbles",
]

KV_BLOCK = 64  # FP8 KV simulation: one scale per 64 non-RoPE dims
ACT_BLOCK = 128  # activation quantisation before FP8/FP4 GEMMs: one scale per 128 along K
FP4_ACT_BLOCK = 32  # indexer q / k FP4 simulation: one scale per 32 dims

# The fp32 reciprocals the official kernels multiply amax by (python floats holding the exact fp32 values).
_INV_FP8_MAX = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))
_INV_FP4_MAX = float(torch.tensor(1.0 / FP4_MAX, dtype=torch.float32))


# ---- exponents and powers of two, exactly and without bitcasts -------------------------------------------------
_UE8M0 = ue8m0_decode(torch.arange(256, dtype=torch.int32).to(torch.uint8))  # 2**(b - 127) (exact), b = 255: NaN


def _table(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """table[idx] as a gather (index_select) on idx's device."""
    return torch.index_select(table.to(idx.device), 0, idx.reshape(-1).to(torch.int32)).view(idx.shape)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2**e as fp32 for integer e in [-127, 127] (exact; a table lookup)."""
    return _table(_UE8M0, e.to(torch.int32) + 127)


def ue8m0_value(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 scale bytes (uint8) -> fp32 2**(b - 127) (a table lookup; `reference.ue8m0_decode` computes it)."""
    return _table(_UE8M0, scale.to(torch.int32))


def _floor_log2_clamped(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """clamp(floor(log2(x)), lo, hi) for x >= 0 (int32; lo for x = 0) by comparisons with exact powers of two.
    For the element formats' few binades only (one comparison per binade)."""
    e = torch.full(x.shape, lo, dtype=torch.int32, device=x.device)
    for k in range(lo + 1, hi + 1):
        e = e + (x >= 2.0**k).to(torch.int32)
    return e


def scale_exponent(amax: torch.Tensor, fmt_max: float, floor: float) -> torch.Tensor:
    """UE8M0 scale exponent of blocks with absolute maximum `amax` (fp32): ceil(log2(max(amax, floor) * fp32(1 /
    fmt_max))) as int32, the official kernels' `fast_round_scale`. Binary search with exact power-of-two steps:
    m ends in [1, 2), e = floor(log2(a)), +1 unless a was a power of two."""
    inv = _INV_FP8_MAX if fmt_max == FP8_MAX else _INV_FP4_MAX if fmt_max == FP4_MAX else 1.0 / fmt_max
    m = amax.float().clamp(min=floor) * inv
    e = torch.zeros(m.shape, dtype=torch.int32, device=m.device)
    for i in reversed(range(7)):  # a in [2**-126, 2**127]: steps of 64, 32, ..., 1 binades, each exact
        step = 1 << i
        down = m >= 2.0**step
        m = torch.where(down, m * 2.0**-step, m)
        e = e + down.to(torch.int32) * step
        up = m < 2.0 ** (1 - step)
        m = torch.where(up, m * 2.0**step, m)
        e = e - up.to(torch.int32) * step
    return e + (m > 1.0).to(torch.int32)


def round_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Round fp32 y (|y| <= 448) to the nearest float8_e4m3fn value, ties to even; result fp32 (sign of zero kept)."""
    q = _pow2(_floor_log2_clamped(y.abs(), -6, 8) - 3)  # spacing: 2**(e-3) for normals, 2**-9 for subnormals
    return torch.round(y / q) * q


def round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Round fp32 y (|y| <= 6) to the nearest e2m1 value, ties to even; result fp32."""
    q = _pow2(_floor_log2_clamped(y.abs(), 0, 2) - 1)  # spacing 0.5 below 2, then 1, then 2
    return torch.round(y / q) * q


def _block_scale(x: torch.Tensor, block: int, fmt_max: float, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x as fp32 blocks [..., N/block, block], scale exponents int32 [..., N/block])."""
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"last dim {n} is not a multiple of the quantisation block {block}")
    xb = x.float().unflatten(-1, (n // block, block))
    return xb, scale_exponent(xb.abs().amax(-1), fmt_max, floor)


# ---- FP8 e4m3fn, power-of-two scales per block -----------------------------------------------------------------
def _e4m3_code(v: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn byte (int32) of fp32 values v already on the e4m3 grid."""
    mag = v.abs()
    e = _floor_log2_clamped(mag, -7, 8)  # -7 marks a subnormal (or zero)
    normal = e >= -6
    mant = torch.where(normal, mag * _pow2(-e.clamp(min=-6)) * 8.0 - 8.0, mag * 512.0)  # exact integers 0..7
    field = torch.where(normal, e + 7, torch.zeros_like(e))
    sign = torch.signbit(v).to(torch.int32)
    return sign * 128 + field * 8 + mant.to(torch.int32)


def _e4m3_values(c: torch.Tensor) -> torch.Tensor:
    """The value of each float8_e4m3fn byte c (int32): sign, 4 exponent bits (bias 7), 3 mantissa bits; subnormals
    m * 2**-9; 0x7f / 0xff are NaN."""
    field, mant = (c >> 3) & 15, (c & 7).float()
    mag = torch.where(field == 0, mant, mant + 8.0) * _pow2(field.clamp(min=1) - 10)
    val = torch.where(c >= 128, -mag, mag)
    return torch.where((c & 127) == 127, torch.full_like(val, float("nan")), val)


_E4M3_VALUES = _e4m3_values(torch.arange(256, dtype=torch.int32))


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn bytes (uint8 or int) -> fp32 values (exact; a 256-entry table lookup)."""
    return _table(_E4M3_VALUES, codes.to(torch.int32))


def fp8_quant(x: torch.Tensor, block: int = KV_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., N] -> (e4m3fn bytes uint8 [..., N], UE8M0 scale bytes uint8 [..., N/block]): the official
    `act_quant(x, block, "ue8m0")` (with `inplace=False` its outputs; the in-place form is `fp8_qdq`)."""
    xb, e = _block_scale(x, block, FP8_MAX, FP8_AMAX_FLOOR)
    v = round_e4m3((xb * _pow2(-e).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX))
    return _e4m3_code(v).flatten(-2).to(torch.uint8), (e + 127).to(torch.uint8)


def fp8_dequant(codes: torch.Tensor, scale: torch.Tensor, block: int = KV_BLOCK,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`fp8_quant`'s bytes back to values of `dtype` (exact): codes [..., N], scale [..., N/block]."""
    v = e4m3_decode(codes).unflatten(-1, (-1, block)) * ue8m0_value(scale).unsqueeze(-1)
    return v.flatten(-2).to(dtype)


def fp8_qdq(x: torch.Tensor, block: int = KV_BLOCK) -> torch.Tensor:
    """FP8 quant-dequant of x [..., N] in `block`-wide blocks, in x.dtype: the official in-place
    `act_quant(x, block, "ue8m0", inplace=True)`. Equals `fp8_dequant(*fp8_quant(x, block), block, x.dtype)`."""
    xb, e = _block_scale(x, block, FP8_MAX, FP8_AMAX_FLOOR)
    v = round_e4m3((xb * _pow2(-e).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX))
    return (v * _pow2(e).unsqueeze(-1)).flatten(-2).to(x.dtype)


def kv_fp8_qdq(kv: torch.Tensor, rope_dim: int, block: int = KV_BLOCK) -> torch.Tensor:
    """The official KV simulation: FP8 quant-dequant of the first `head_dim - rope_dim` dims (64-wide blocks); the
    trailing RoPE dims unchanged. kv [..., head_dim] -> new tensor in kv.dtype."""
    nope = kv.shape[-1] - rope_dim
    return torch.cat([fp8_qdq(kv[..., :nope], block), kv[..., nope:]], dim=-1)


# ---- FP4 e2m1, power-of-two scales per 32 ----------------------------------------------------------------------
def _e2m1_code(v: torch.Tensor) -> torch.Tensor:
    """e2m1 code (int32, 0..15) of fp32 values v already on the e2m1 grid."""
    mag = v.abs()
    code = torch.where(mag < 2, mag * 2, torch.where(mag < 4, mag + 2, mag * 0.5 + 4))  # 0,.5,1,1.5,2,3,4,6 -> 0..7
    return torch.signbit(v).to(torch.int32) * 8 + code.to(torch.int32)


def fp4_quant(x: torch.Tensor, block: int = FP4_ACT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., N] -> (e2m1 codes uint8 [..., N], one per element; UE8M0 scale bytes uint8 [..., N/block]): the
    official `fp4_act_quant(x, block)` outputs."""
    xb, e = _block_scale(x, block, FP4_MAX, FP4_AMAX_FLOOR)
    v = round_e2m1((xb * _pow2(-e).unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX))
    return _e2m1_code(v).flatten(-2).to(torch.uint8), (e + 127).to(torch.uint8)


def _e2m1_values(c: torch.Tensor) -> torch.Tensor:
    """The value of each e2m1 code c (int32, 0..15): the inverse of `_e2m1_code`."""
    m = (c & 7).float()
    mag = torch.where(m < 4, m * 0.5, torch.where(m < 6, m - 2, m * 2 - 8))
    return torch.where(c >= 8, -mag, mag)


_E2M1_VALUES = _e2m1_values(torch.arange(16, dtype=torch.int32))


def _e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    return _table(_E2M1_VALUES, codes.to(torch.int32))


def fp4_dequant(codes: torch.Tensor, scale: torch.Tensor, block: int = FP4_ACT_BLOCK,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`fp4_quant`'s codes back to values of `dtype` (exact)."""
    v = _e2m1_decode(codes).unflatten(-1, (-1, block)) * ue8m0_value(scale).unsqueeze(-1)
    return v.flatten(-2).to(dtype)


def fp4_qdq(x: torch.Tensor, block: int = FP4_ACT_BLOCK) -> torch.Tensor:
    """FP4 quant-dequant in x.dtype: the official in-place `fp4_act_quant(x, block, inplace=True)`."""
    xb, e = _block_scale(x, block, FP4_MAX, FP4_AMAX_FLOOR)
    v = round_e2m1((xb * _pow2(-e).unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX))
    return (v * _pow2(e).unsqueeze(-1)).flatten(-2).to(x.dtype)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform over the last dim (a power of two n): H_n x * n**-0.5 with H_n in
    Sylvester order (H_2 = [[1, 1], [1, -1]]; what `fast_hadamard_transform.hadamard_transform(x, n**-0.5)`
    computes). fp32 butterflies, result in x.dtype."""
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size {n} is not a power of two")
    y = x.float()
    h = 1
    while h < n:
        y = y.unflatten(-1, (n // (2 * h), 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return (y * n**-0.5).to(x.dtype)


def indexer_fp4_qdq(x: torch.Tensor, block: int = FP4_ACT_BLOCK) -> torch.Tensor:
    """The official indexer simulation of queries / keys x [..., index_head_dim] (after RoPE): Hadamard rotation
    (rounded to x.dtype, as `rotate_activation` returns it), then FP4 quant-dequant in 32-wide blocks."""
    return fp4_qdq(hadamard(x), block)


# ---- GEMMs with quantised activations ------------------------------------------------------------------------
def _check_k(k: int, block: int, what: str) -> None:
    if k % block:
        raise ValueError(f"{what}: K={k} is not a multiple of {block}")


def fp8_gemm(a_codes: torch.Tensor, a_scale: torch.Tensor, w_u8: torch.Tensor, w_scale_u8: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The official `fp8_gemm`: C = A @ W^T with A = `fp8_quant(x, 128)` (codes [..., K] + scales [..., K/128]) and
    W the checkpoint's FP8 block weight (e4m3 bytes [N, K] + UE8M0 bytes [ceil(N/128), K/128]). For each 128-wide
    K block: the product of the unscaled codes in fp32, times a_s * w_s, added to an fp32 accumulator; the result is
    rounded once to `out_dtype` (bf16 in the official kernel)."""
    k = a_codes.shape[-1]
    n = w_u8.shape[0]
    _check_k(k, ACT_BLOCK, "fp8_gemm")
    a = e4m3_decode(a_codes).reshape(-1, k)
    sa = ue8m0_value(a_scale).reshape(-1, k // ACT_BLOCK)
    sw = ue8m0_value(w_scale_u8).repeat_interleave(ACT_BLOCK, dim=0)[:n]  # [N, K/128]
    acc = torch.zeros(a.shape[0], n, dtype=torch.float32, device=a.device)
    for kb in range(k // ACT_BLOCK):
        blk = slice(kb * ACT_BLOCK, (kb + 1) * ACT_BLOCK)
        part = a[:, blk] @ e4m3_decode(w_u8[:, blk]).t()
        acc = acc + part * (sa[:, kb: kb + 1] * sw[:, kb])
    return acc.to(out_dtype).reshape(*a_codes.shape[:-1], n)


def fp4_gemm(a_codes: torch.Tensor, a_scale: torch.Tensor, packed_u8: torch.Tensor, w_scale_u8: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The official `fp4_gemm`: C = A @ W^T with A as in `fp8_gemm` and W the checkpoint's FP4 expert weight
    (packed e2m1 [N, K/2], low nibble = even element, + UE8M0 [N, K/32]). For each 32-wide K block: the product of
    the unscaled codes (e2m1 values are exact in e4m3) in fp32, times a_s[k // 128] * w_s[k // 32], added to an fp32
    accumulator; rounded once to `out_dtype`."""
    k = a_codes.shape[-1]
    n = packed_u8.shape[0]
    _check_k(k, ACT_BLOCK, "fp4_gemm")
    a = e4m3_decode(a_codes).reshape(-1, k)
    sa = ue8m0_value(a_scale).reshape(-1, k // ACT_BLOCK)
    b = packed_u8.to(torch.uint8)
    w = _e2m1_decode(torch.stack((b & 15, b >> 4), dim=-1).reshape(n, k))
    sw = ue8m0_value(w_scale_u8)  # [N, K/32]
    acc = torch.zeros(a.shape[0], n, dtype=torch.float32, device=a.device)
    for kb in range(k // FP4_ACT_BLOCK):
        blk = slice(kb * FP4_ACT_BLOCK, (kb + 1) * FP4_ACT_BLOCK)
        part = a[:, blk] @ w[:, blk].t()
        acc = acc + part * sa[:, kb // 4: kb // 4 + 1] * sw[:, kb]
    return acc.to(out_dtype).reshape(*a_codes.shape[:-1], n)


def act_linear(x: torch.Tensor, w_u8: torch.Tensor, w_scale_u8: torch.Tensor, fmt: str,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The official `linear()` for an FP8 ("fp8") or FP4 ("fp4") weight: per-token activation quantisation in
    128-wide blocks, then `fp8_gemm` / `fp4_gemm`."""
    a, s = fp8_quant(x, ACT_BLOCK)
    return (fp8_gemm if fmt == "fp8" else fp4_gemm)(a, s, w_u8, w_scale_u8, out_dtype)


# ---- the indexer's bf16 scores -------------------------------------------------------------------------------
def indexer_weights_bf16(w: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Per-head score weights as the official indexer computes them: `weights_proj(x)` (a bf16 linear: fp32
    accumulation, bf16 out) times head_dim**-0.5 * n_heads**-0.5 in bf16 (fp32 product of the bf16 value and the
    fp32 constant, rounded to bf16). w: the bf16 projection [..., H]."""
    c = float(torch.tensor(head_dim**-0.5 * n_heads**-0.5, dtype=torch.float32))
    return (w.to(torch.bfloat16).float() * c).to(torch.bfloat16)


def index_score_bf16(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Official indexer scores (bf16 einsum + bf16 elementwise + bf16 sum): I[b, t, n] =
    bf16(sum_h bf16(relu(bf16(q[b,t,h] . keys[b,n])) * weights[b,t,h])), each dot product and the head sum
    accumulated in fp32. q [B, T, H, D], keys [B, N, D], weights [B, T, H] (bf16 values) -> bf16 [B, T, N]."""
    s = torch.einsum("bthd,bnd->bthn", q.float(), keys.float()).to(torch.bfloat16).relu()
    p = (s.float() * weights.float().unsqueeze(-1)).to(torch.bfloat16)
    return p.float().sum(dim=2).to(torch.bfloat16)


def indexer_weights_rounded(w: torch.Tensor, scale: float) -> torch.Tensor:
    """`indexer_weights_bf16` in w's own dtype, for the constant `scale` (head_dim**-0.5 * n_heads**-0.5): the
    product of w and fp32(scale), rounded to w.dtype (the official `weights_proj(x) * const` with the default dtype
    w.dtype; fp32: one fp32 product)."""
    c = float(torch.tensor(scale, dtype=torch.float32))
    return (w.float() * c).to(w.dtype)


def index_score_rounded(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
                        acc_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`index_score_bf16` with every rounding to q.dtype instead of bf16 (the official scores with default dtype
    q.dtype): bf16 q gives exactly `index_score_bf16`; fp32 q the fp32 scores in the official order (relu, times
    the weights, head sum). `acc_dtype` float64: the dot products and the head sum exact before each rounding.
    -> [B, T, N] in q.dtype."""
    dt = q.dtype
    s = torch.einsum("bthd,bnd->bthn", q.to(acc_dtype), keys.to(acc_dtype)).to(dt).relu()
    p = (s.float() * weights.float().unsqueeze(-1)).to(dt)
    return p.to(acc_dtype).sum(dim=2).to(dt)


def index_score_exact(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`index_score_rounded` with exact (float64) sums."""
    return index_score_rounded(q, keys, weights, torch.float64)


def linear_exact(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T summed exactly (float64; products of bf16 values are exact) and rounded once to x.dtype: the
    official bf16 `F.linear` (fp32 accumulation, one rounding) without its summation order."""
    return torch.nn.functional.linear(x.double(), weight.double()).to(x.dtype)


def grouped_out_proj_exact(o: torch.Tensor, wo_a: torch.Tensor, groups: int) -> torch.Tensor:
    """`reference.grouped_out_proj` (the official bf16 `wo_a` einsum) summed exactly, rounded once to o.dtype."""
    from nki_kernels.reference import grouped_out_proj

    return grouped_out_proj(o.double(), wo_a.double(), groups).to(o.dtype)


# ---- rounding points of the official forward in the compute dtype ------------------------------------------------
def head_rms(q: torch.Tensor, eps: float) -> torch.Tensor:
    """The official per-head query normalisation `q *= rsqrt(q.square().mean(-1) + eps)` in q's own dtype: with bf16
    q every op (square, mean, + eps, rsqrt, product) rounds to bf16, the mean's sum taken exactly (float64) before
    its one rounding, and the rsqrt rounded once from float64 (as a GPU's bf16 rsqrt rounds its fp32 result once).
    torch's CPU bf16 rsqrt is not this: it rounds each 32-element vectorised chunk once but computes the remaining
    (N mod 32) elements as bf16(1 / bf16(sqrt(x))), double rounding that differs in ~25 % of them, so its result
    depends on how many rows the tensor has (the official golden, made on a CPU, carries that: golden/README.md);
    a flipped bf16 rounding here moves the tiny model's logits by up to ~0.6. fp32 q: the plain fp32 expression."""
    if q.dtype == torch.float32:
        return q * torch.rsqrt(q.square().mean(-1, keepdim=True) + eps)
    ms = (q.square().double().sum(-1, keepdim=True) / q.shape[-1]).to(q.dtype)
    return q * torch.rsqrt((ms + eps).double()).to(q.dtype)


def sparse_attn_partial_rounded(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, scale: float,
                                acc_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """`reference.sparse_attn_partial` with the probabilities rounded to kv.dtype before the P @ V product, as the
    official `sparse_attn` kernel does (the max and the sum of exps stay in `acc_dtype`). One softmax block: the
    kernel's online softmax over 64-key blocks rounds each block's exps relative to the running max of the keys so
    far, which only differs where the keys exceed one block (golden/README.md "item 6", step 9). `acc_dtype`
    float64: scores, exps and P @ V accumulated exactly (products of bf16 values are exact), so the result does not
    depend on the summation order, i.e. on how many padded keys a batch carries (`exact_accumulation`).
    q [B, T, H, D], kv [B, N, D], valid [B, T, N] -> (acc, m, l) in acc_dtype."""
    logits = torch.einsum("bthd,bnd->bthn", q.to(acc_dtype), kv.to(acc_dtype)) * scale
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    if logits.shape[-1] == 0:
        m = logits.new_full(logits.shape[:-1], float("-inf"))
        return q.new_zeros(q.shape, dtype=acc_dtype), m, torch.zeros_like(m)
    m = logits.amax(-1)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(logits - m_safe.unsqueeze(-1))
    acc = torch.einsum("bthn,bnd->bthd", p.to(kv.dtype).to(acc_dtype), kv.to(acc_dtype))
    return acc, m, p.sum(-1)


def sparse_attn_rounded(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                        scale: float, acc_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`reference.sparse_attn` with `sparse_attn_partial_rounded`'s probabilities: [B, T, H, D] in q.dtype."""
    return sparse_attn_merge([sparse_attn_partial_rounded(q, kv, valid, scale, acc_dtype)], sink).to(q.dtype)


def sparse_attn_partial_exact(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor,
                              scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sparse_attn_partial_rounded` accumulated exactly (float64), returned as fp32 (the partials' contract)."""
    return tuple(t.float() for t in sparse_attn_partial_rounded(q, kv, valid, scale, torch.float64))


def sparse_attn_exact(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """`sparse_attn_rounded` accumulated exactly (float64), rounded once to q.dtype."""
    return sparse_attn_rounded(q, kv, valid, sink, scale, torch.float64)


def act_linear_exact(x: torch.Tensor, w_u8: torch.Tensor, scale_u8: torch.Tensor, fmt: str) -> torch.Tensor:
    """The official `linear()` of an FP8 ("fp8") or FP4 ("fp4") weight with exact accumulation: the per-token FP8
    activation (`fp8_qdq(x, 128)`) times the dequantised weight, summed in float64 and rounded once to x.dtype.
    Every product of an e4m3 activation value and an e4m3 / e2m1 weight value is exact in float64 and so are the
    sums at these widths, so this is `fp8_gemm` / `fp4_gemm` without their fp32 summation order: the same number
    for any batch size or K blocking (what the cross-check's "fp64 accumulation" row measured, golden/README.md).
    Weight rows are decoded `reference.dequant_rows(K)` at a time. x [..., K] -> [..., N] in x.dtype."""
    from nki_kernels.reference import dequant_rows, fp4_dequant_rows, fp8_dequant_rows

    if fmt == "fp8":
        n, k = w_u8.shape
        rows_of = fp8_dequant_rows
    else:
        n, k = w_u8.shape[0], w_u8.shape[1] * 2
        rows_of = fp4_dequant_rows
    a = fp8_qdq(x, ACT_BLOCK).double()
    step = dequant_rows(k)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        out[..., r0:r1] = torch.nn.functional.linear(a, rows_of(w_u8, scale_u8, r0, r1).double()).to(x.dtype)
    return out


# ---- FP4 codes two per byte ----------------------------------------------------------------------------------
def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes uint8 [..., N] (0..15, N even) -> uint8 [..., N/2], element 2i in the low nibble, 2i + 1 in the
    high one (int32 arithmetic, no shifts)."""
    c = codes.to(torch.int32).unflatten(-1, (-1, 2))
    return (c[..., 0] + c[..., 1] * 16).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_nibbles`: uint8 [..., N/2] -> codes uint8 [..., N] (`&` and a floor division on int32:
    no `>>`, no uint8 compares)."""
    b = packed.to(torch.int32)
    lo = b & 15
    hi = torch.div(b - lo, 16, rounding_mode="floor")
    return torch.stack((lo, hi), dim=-1).flatten(-2).to(torch.uint8)
