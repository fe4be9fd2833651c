"""Torch references of every DeepSeek-V4 op: the single definition of each op.

The engine's host path calls these functions, and each NKI kernel in this package is checked against them, so
"the kernel matches the reference" and "the engine matches the golden" are statements about the same code.
Formulas: DeepSeek's `inference/model.py` (checked against HF transformers 5.24). Math runs in fp32; results are
cast back to the input dtype where the official code does so. Shapes use B batch, T tokens, H heads, D dims, N keys,
n hc streams. Only torch APIs that torch 2.9 has.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "rms_norm", "swiglu", "linear", "fp8_linear", "fp4_linear", "grouped_out_proj",
    "rope_inv_freq", "rope_cos_sin", "rope_apply",
    "hc_mixes", "hc_collapse", "hc_expand", "hc_head", "hc_attn_out",
    "compress_pool", "index_score", "index_topk",
    "sparse_attn", "sparse_attn_partial", "sparse_attn_merge",
    "gate_scores", "route",
]


# ---------------------------------------------------------------------------------------------------------------
# Norms, activations, projections


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32, cast back to x.dtype. `weight=None` is the unweighted form."""
    # F.rms_norm (torch >= 2.4) is x * rsqrt(mean(x^2) + eps) * weight in one call, bit-identical to the spelled-out
    # form in fp32 and cheaper on the host's hot decode path.
    w = weight.float() if weight is not None else None
    return F.rms_norm(x.float(), (x.shape[-1],), w, eps).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) in fp32. `limit <= 0` disables the clamps."""
    g, u = gate.float(), up.float()
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    return F.silu(g) * u


LINEAR_CHUNK = 1 << 21  # weight elements widened at a time when the weight is narrower than x (8 MiB in fp32)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T in x's dtype. x [..., K], weight [N, K] float. A narrower weight (a bf16 tensor kept as the
    checkpoint stores it, with fp32 activations) is widened exactly, a block of rows at a time, so no full-size copy
    exists at any point; the products are the same as with a weight widened at load."""
    if weight.dtype == x.dtype or weight.numel() <= LINEAR_CHUNK:
        return F.linear(x, weight.to(x.dtype))
    rows = max(1, LINEAR_CHUNK // weight.shape[1])
    return torch.cat([F.linear(x, weight[i: i + rows].to(x.dtype)) for i in range(0, weight.shape[0], rows)], -1)


# ---------------------------------------------------------------------------------------------------------------
# Projections by stored (FP8 block / FP4 expert) weights, written to trace on a torch-xla device
#
# Inputs are the checkpoint's raw bytes as uint8 (`formats.stored_fp8` / `formats.stored_fp4` make these views at
# load time). Inside: e4m3fn / e2m1 codes are decoded by a lookup table (an `index_select` gather into 256 / 16
# exact fp32 values), UE8M0 scales by exact power-of-two products (`ue8m0_decode`), scales are applied per block,
# the product accumulates in fp32 and is cast once to x.dtype. No float8 bitcasts of inputs, no host syncs, no
# data-dependent shapes: every loop runs over chunks fixed by the weight's shape.
#
# Memory: the weight is decoded `dequant_rows(K)` rows at a time (a multiple of 128, about DEQUANT_CHUNK_ELEMS = 2 Mi
# elements per chunk) and scaled in place. Peak temporary per chunk: int32 codes + fp32 values (8 B/element) while
# the table is gathered, then the fp32 chunk alone (FP4 adds the nibbles and unpacked codes, ~2 B/element), i.e.
# ~16-20 MiB whatever N is (V4-Flash wq_b [32768, 1024]: 16 chunks of 2048 rows; an expert w1 [2048, 4096]: 4
# chunks of 512 rows), plus x in fp32 when x is bf16 ([T, K] x 4 B), one fp32 [T, rows] chunk result, the [T, N]
# output and what the host BLAS packs. Measured peak RSS growth on the host (bf16 x): wq_b 16 MiB at T=1, 21 MiB
# at T=64; expert w1 20 MiB at T=1. A full fp32 copy of wq_b alone would be 128 MiB.

DEQUANT_CHUNK_ELEMS = 1 << 21


def _e4m3fn_value(code: int) -> float:
    """The exact value of one float8_e4m3fn byte (bias 7, no infinities, S.1111.111 is NaN)."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 0xF and m == 0x7:
        return float("nan")
    if e == 0:
        return sign * m * 2.0**-9
    return sign * (8 + m) * 2.0 ** (e - 10)


_E4M3FN_LUT = torch.tensor([_e4m3fn_value(b) for b in range(256)], dtype=torch.float32)
_E2M1_LUT = torch.tensor((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0),
                         dtype=torch.float32)


def dequant_rows(k: int) -> int:
    """Rows decoded per chunk for a weight with k input features: a multiple of 128 (the FP8 block), at least 128."""
    return max(128, DEQUANT_CHUNK_ELEMS // max(k, 1) // 128 * 128)


def ue8m0_decode(scale_u8: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes (uint8) -> float32 2**(b - 127) (b = 255 -> NaN), exactly and without a bitcast or exp2: the
    product of the powers 2**(+-2**i) selected by the bits of |b - 127| (every partial product is a power of two
    between the result and 1, so each multiply is exact; b = 0 gives the fp32 subnormal 2**-127).
    Portable spelling (it lowers through upstream torch-mlir to StableHLO as meant): bits tested with `&` (no `>>`
    on int tensors, which torch-mlir does not lower) and every compare on the int32 value, never on the uint8
    bytes (torch-mlir emits uint8 compares as signed)."""
    k = scale_u8.to(torch.int32) - 127
    neg = k < 0
    mag = k.abs()
    out = torch.ones(scale_u8.shape, dtype=torch.float32, device=scale_u8.device)
    for i in range(7):  # |k| <= 127 (128 only for b = 255, which is NaN below)
        up, down = 2.0 ** (1 << i), 2.0 ** -(1 << i)
        f = torch.where(neg, down, up)
        out = out * torch.where((mag & (1 << i)) != 0, f, torch.ones_like(f))
    return torch.where(k == 128, torch.full_like(out, float("nan")), out)  # b = 255


_LUT_ON_DEVICE: dict[tuple[int, torch.device], torch.Tensor] = {}


def luts_on(device: torch.device | str) -> None:
    """Make the decode tables' copies on `device` now, before any graph is traced: a graph traced before would
    capture the CPU table as an input and copy it to the device inside the graph."""
    device = torch.device(device)
    if device.type != "cpu":
        for table in (_E4M3FN_LUT, _E2M1_LUT):
            _LUT_ON_DEVICE.setdefault((id(table), device), table.to(device))


def _lut(table: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    idx = codes.to(torch.int32).reshape(-1)
    if codes.device != table.device:  # one copy per device, kept: not a host-to-device copy per call
        key = (id(table), codes.device)
        if key not in _LUT_ON_DEVICE:
            _LUT_ON_DEVICE[key] = table.to(codes.device)
        table = _LUT_ON_DEVICE[key]
    return torch.index_select(table, 0, idx).view(codes.shape)


def fp8_dequant_rows(w_u8: torch.Tensor, scale_u8: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) of an FP8 block weight from its bytes: w_u8 [N, K] (float8_e4m3fn bytes), scale_u8
    [ceil(N/128), ceil(K/128)] (UE8M0 bytes) -> float32 [r1 - r0, K], equal bit for bit to
    `formats.dequant_fp8_block`. r0 must be a multiple of 128 (a block boundary)."""
    if r0 % 128:
        raise ValueError(f"fp8_dequant_rows: r0={r0} is not a multiple of the 128-row block")
    k = w_u8.shape[1]
    vals = _lut(_E4M3FN_LUT, w_u8[r0:r1])  # [R, K]
    s = ue8m0_decode(scale_u8[r0 // 128: (r1 + 127) // 128])  # [ceil(R/128), nbk]
    s = s.repeat_interleave(128, dim=0)[: r1 - r0]  # [R, nbk] (small)
    kf = k // 128 * 128
    if kf == k:  # scale in place: the decoded chunk is the only full-size temporary
        return vals.view(r1 - r0, k // 128, 128).mul_(s[:, :, None]).view(r1 - r0, k)
    full = (vals[:, :kf].reshape(r1 - r0, kf // 128, 128) * s[:, : kf // 128, None]).reshape(r1 - r0, kf)
    return torch.cat([full, vals[:, kf:] * s[:, kf // 128:]], dim=1)  # the partial last column block


def fp4_dequant_rows(packed_u8: torch.Tensor, scale_u8: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) of an FP4 expert weight from its bytes: packed_u8 [N, K/2] (two e2m1 codes per byte, low
    nibble = even element), scale_u8 [N, K/32] (UE8M0 bytes) -> float32 [r1 - r0, K], equal bit for bit to
    `formats.dequant_fp4`."""
    b = packed_u8[r0:r1]
    rows, k = b.shape[0], b.shape[1] * 2
    # element 2j = low nibble of byte j; the high nibble by an (unsigned, exact) floor division: no `>>` in graphs
    codes = torch.stack((b & 0x0F, torch.div(b, 16, rounding_mode="floor")), dim=-1).reshape(rows, k)
    vals = _lut(_E2M1_LUT, codes)
    s = ue8m0_decode(scale_u8[r0:r1])  # [R, K/32]
    return vals.view(rows, k // 32, 32).mul_(s[:, :, None]).view(rows, k)


def _stored_linear(x: torch.Tensor, n: int, k: int, rows_of: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    if x.shape[-1] != k:
        raise ValueError(f"stored-weight linear: x {tuple(x.shape)} does not end in K={k}")
    xf = x.float()
    step = dequant_rows(k)
    if n <= step:
        return F.linear(xf, rows_of(0, n)).to(x.dtype)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        out[..., r0:r1] = F.linear(xf, rows_of(r0, r1)).to(x.dtype)
    return out


def fp8_linear(x: torch.Tensor, w_u8: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    """x [..., K] (fp32 or bf16) @ W^T with W the FP8 block weight stored as bytes: w_u8 [N, K] uint8 (float8_e4m3fn
    bits), scale_u8 [ceil(N/128), ceil(K/128)] uint8 (UE8M0 bits). fp32 accumulation, result in x.dtype; equals
    `linear(x, formats.dequant_fp8_block(...))` up to fp32 summation order."""
    n, k = w_u8.shape
    if tuple(scale_u8.shape) != (-(-n // 128), -(-k // 128)):
        raise ValueError(f"fp8_linear: scale {tuple(scale_u8.shape)} does not block w {tuple(w_u8.shape)} by 128")
    return _stored_linear(x, n, k, lambda r0, r1: fp8_dequant_rows(w_u8, scale_u8, r0, r1))


def fp4_linear(x: torch.Tensor, packed_u8: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    """x [..., K] (fp32 or bf16) @ W^T with W the FP4 expert weight stored as bytes: packed_u8 [N, K/2] uint8 (low
    nibble = even element), scale_u8 [N, K/32] uint8 (UE8M0 bits). fp32 accumulation, result in x.dtype; equals
    `linear(x, formats.dequant_fp4(...))` up to fp32 summation order."""
    n, k = packed_u8.shape[0], packed_u8.shape[1] * 2
    if k % 32 or tuple(scale_u8.shape) != (n, k // 32):
        raise ValueError(f"fp4_linear: K={k} must be a multiple of 32 and scale {tuple(scale_u8.shape)} [N, K/32]")
    return _stored_linear(x, n, k, lambda r0, r1: fp4_dequant_rows(packed_u8, scale_u8, r0, r1))


def grouped_out_proj(o: torch.Tensor, wo_a: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped low-rank output projection: o [T, H*D] split into `groups` contiguous head groups;
    wo_a [G*R, H*D/G] viewed [G, R, H*D/G]; returns [T, G*R] = concat_g(wo_a[g] @ o_g)."""
    t = o.shape[0]
    og = o.view(t, groups, o.shape[1] // groups)  # [T, G, H*D/G] (explicit: T = 0 is a valid, empty batch)
    w = wo_a.to(o.dtype).view(groups, -1, og.shape[-1])  # [G, R, H*D/G]
    return torch.einsum("tgd,grd->tgr", og, w).reshape(t, wo_a.shape[0])


# ---------------------------------------------------------------------------------------------------------------
# RoPE: interleaved pairs (2i, 2i+1) on the trailing rope dims; YaRN only for compressed layers


def rope_inv_freq(rope_dim: int, base: float, yarn: tuple[float, int, float, float] | None = None) -> torch.Tensor:
    """Inverse frequencies [rope_dim/2] (fp32). `yarn = (factor, original_seq_len, beta_fast, beta_slow)` blends
    the low frequencies down by `factor` with a linear ramp between the correction dims; no attention factor."""
    freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if yarn is None or yarn[1] <= 0:
        return freqs
    factor, orig, beta_fast, beta_slow = yarn

    def corr_dim(num_rot: float) -> float:
        return rope_dim * math.log(orig / (num_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    smooth = 1 - ramp
    return freqs / factor * (1 - smooth) + freqs * smooth


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [..., rope_dim/2] (fp32) for integer `positions` [...]."""
    ang = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # [..., rd/2]
    return ang.cos(), ang.sin()


def rope_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate interleaved pairs of x [..., rd] by angle (cos, sin) [..., rd/2] (broadcast over x's middle dims).
    `inverse=True` rotates by the negative angle (the conjugate). Returns a new tensor in x.dtype."""
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    s = -sin if inverse else sin
    out = torch.stack((a * cos - b * s, a * s + b * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rd: int, inverse: bool = False) -> torch.Tensor:
    """RoPE on the trailing `rd` dims of x [..., D] (V4 lays heads out as [nope | rope]); the rest is untouched.
    (A composite of `rope_apply`, not a kernel family of its own: not in `__all__`; the model calls it through its
    op table, `ops.rope_tail`, where the host table has a native one.)"""
    return torch.cat([x[..., :-rd], rope_apply(x[..., -rd:], cos, sin, inverse)], dim=-1)


# ---------------------------------------------------------------------------------------------------------------
# mHC


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_mult: int,
             iters: int, hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mixing weights of one mHC site for streams x [T, n, D] (any dtype; math in fp32).

    Returns pre [T, n], post [T, n] and comb [T, n, n] (comb[j, k]: from stream j to stream k, doubly stochastic
    after `iters` Sinkhorn steps: softmax rows + eps, a column normalisation, then (iters-1) x (rows, columns))."""
    n = hc_mult
    v = x.flatten(-2).float()  # [T, n*D]
    mix = F.linear(v, fn.float()) * torch.rsqrt(v.square().mean(-1, keepdim=True) + norm_eps)  # [T, (2+n)*n]
    pre = torch.sigmoid(scale[0] * mix[:, :n] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(scale[1] * mix[:, n:2 * n] + base[n:2 * n])
    comb = (scale[2] * mix[:, 2 * n:] + base[2 * n:]).view(-1, n, n)
    comb = comb.softmax(-1)
    comb = comb + hc_eps if comb.requires_grad else comb.add_(hc_eps)  # in place would break autograd (training)
    return pre, post, _sinkhorn_(comb, iters, hc_eps)


def _sinkhorn_(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn on comb [T, n, n] (rows already softmaxed + eps): a column normalisation, then (iters - 1) x (rows,
    columns), each dividing by (sum + eps). On a plain CPU tensor the ~6*iters tiny ops run in NumPy, in place on
    the same memory (same fp32 arithmetic, a third of torch's per-op dispatch cost on the decode hot path); on a
    device, under autograd or while torch.compile traces, they run as (out-of-place) torch ops."""
    if comb.device.type == "cpu" and not comb.requires_grad and not torch.compiler.is_compiling():
        a, e = comb.numpy(), np.float32(eps)
        a /= a.sum(-2, keepdims=True) + e
        for _ in range(iters - 1):
            a /= a.sum(-1, keepdims=True) + e
            a /= a.sum(-2, keepdims=True) + e
        return comb
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_j pre[j] * x[j]: x [T, n, D], pre [T, n] -> [T, D] in x.dtype (fp32 math)."""
    return (pre.unsqueeze(-1) * x.float()).sum(-2).to(x.dtype)


def hc_expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'[k] = post[k] * y + sum_j comb[j, k] * X[j] (note the transposed use of comb).
    y [T, D], residual [T, n, D], post [T, n], comb [T, n, n] -> [T, n, D] in y.dtype."""
    out = post.unsqueeze(-1) * y.float().unsqueeze(-2) + torch.einsum("tjk,tjd->tkd", comb, residual.float())
    return out.to(y.dtype)


def hc_attn_out(o: torch.Tensor, wo_b: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                comb: torch.Tensor) -> torch.Tensor:
    """Attention tail fused with the mHC expand: hc_expand(o @ wo_b^T, residual, post, comb).
    o [T, G*R] (after the grouped wo_a), wo_b [D, G*R] -> [T, n, D]."""
    return hc_expand(linear(o, wo_b), residual, post, comb)


def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_eps: float,
            norm_eps: float) -> torch.Tensor:
    """Final stream collapse: x [T, n, D] -> [T, D] in x.dtype."""
    v = x.flatten(-2).float()
    mix = F.linear(v, fn.float()) * torch.rsqrt(v.square().mean(-1, keepdim=True) + norm_eps)  # [T, n]
    pre = torch.sigmoid(mix * scale + base) + hc_eps
    return hc_collapse(x, pre)


# ---------------------------------------------------------------------------------------------------------------
# Compressor pooling and the lightning indexer


def compress_pool(kv: torch.Tensor, score: torch.Tensor, overlap: bool, prev_kv: torch.Tensor | None = None,
                  prev_score: torch.Tensor | None = None) -> torch.Tensor:
    """Per-channel softmax pooling of W consecutive blocks of m tokens (fp32), with optional leading batch dims.

    kv, score: [..., W, m, C] projections of the tokens of each block (score already includes `ape`).
    HCA (overlap=False): C = d; entry_w = sum_j softmax_j(score) * kv over the block's m tokens.
    CSA (overlap=True): C = 2d; entry_w pools 2m slots: the first-half channels of block w-1 and the second-half
    channels of block w. For w = 0 the previous block is `prev_kv`/`prev_score` [..., m, C] (first half used) when
    given, else absent (score -inf). Returns [..., W, d] fp32.
    """
    kv, score = kv.float(), score.float()
    if not overlap:
        return (kv * score.softmax(dim=-2)).sum(dim=-2)
    *lead, w, m, c = kv.shape
    d = c // 2
    # The 2m slots of every block are built by concatenation, not by slice assignment into a buffer: an open-ended
    # or empty (W = 1, a decode step) slice assignment does not lower through upstream torch-mlir. Same values.
    if prev_kv is not None:
        first_kv, first_sc = prev_kv[..., :d].float().unsqueeze(-3), prev_score[..., :d].float().unsqueeze(-3)
    else:
        first_kv = kv.new_zeros(*lead, 1, m, d)
        first_sc = kv.new_full((*lead, 1, m, d), float("-inf"))
    if w > 1:  # block w >= 1 pools the first-half channels of block w - 1
        first_kv = torch.cat([first_kv, kv[..., : w - 1, :, :d]], dim=-3)
        first_sc = torch.cat([first_sc, score[..., : w - 1, :, :d]], dim=-3)
    slots_kv = torch.cat([first_kv, kv[..., d:]], dim=-2)  # [..., W, 2m, d]
    slots_sc = torch.cat([first_sc, score[..., d:]], dim=-2)
    return (slots_kv * slots_sc.softmax(dim=-2)).sum(dim=-2)


def index_score(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Lightning-indexer scores I(t, w) = sum_h weights[t, h] * relu(q[t, h] . keys[w]) in fp32.
    q [B, T, Hi, Di], keys [B, N, Di], weights [B, T, Hi] (already scaled by Di^-0.5 * Hi^-0.5) -> [B, T, N]."""
    s = torch.einsum("bthd,bnd->bthn", q.float(), keys.float()).relu_()
    return torch.einsum("bthn,bth->btn", s, weights.float())


def index_topk(scores: torch.Tensor, num_visible: torch.Tensor, k: int,
               bitcast: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal top-k of indexer scores with deterministic tie-breaking (higher score first, then lower index).

    scores [B, T, N]; num_visible [B, T] (entries w < num_visible are causal for that query). Returns
    (idx [B, T, k'] int64, valid [B, T, k'] bool) with k' = min(k, N); picks beyond the visible entries are invalid.
    A stable sort keeps the choice identical however the entries are split across ranks and merged.
    """
    n = scores.shape[-1]
    kk = min(k, n)
    pos = torch.arange(n, device=scores.device)
    visible = pos < num_visible.unsqueeze(-1)  # [B, T, N]
    masked = scores.float().masked_fill(~visible, float("-inf"))
    order = desc_order(masked, None, kk, bitcast)  # [B, T, k'], (score desc, index asc)
    valid = order < num_visible.unsqueeze(-1)
    return order, valid


def desc_order(scores: torch.Tensor, tie: torch.Tensor | None, k: int, bitcast: bool = True) -> torch.Tensor:
    """Indices of the k largest `scores` along the last dim, ordered (score descending, then `tie` ascending; tie
    None = the position): the first k of a stable descending sort. Two spellings of the same order, the device
    picks (`Capabilities.bitcast`): a top-k of `order_key` (no `sort(stable=True)`, which upstream torch-mlir does
    not lower), or stable sorts (for graphs that cannot bitcast: torch-xla 2.9 runs `Tensor.view(dtype)` on the
    CPU, a fallback and two host copies per CSA layer per step)."""
    if bitcast:
        pos = torch.arange(scores.shape[-1], device=scores.device) if tie is None else tie
        return torch.topk(order_key(scores, pos), k, dim=-1).indices
    if tie is None:
        return torch.sort(scores.float(), dim=-1, descending=True, stable=True).indices[..., :k]
    by_tie = torch.sort(tie.expand_as(scores), dim=-1, stable=True).indices
    top = torch.sort(scores.float().gather(-1, by_tie), dim=-1, descending=True, stable=True).indices[..., :k]
    return by_tie.gather(-1, top)


def order_key(scores: torch.Tensor, tie: torch.Tensor) -> torch.Tensor:
    """int64 keys whose descending order is (score descending, then `tie` ascending): a top-k or sort of the keys
    orders like a stable descending sort of the scores, without `sort(stable=True)` (which upstream torch-mlir
    does not lower) and whatever the device's sort does with ties, because keys of distinct (score, tie) pairs
    differ. scores fp32 (finite or -inf; -0.0 counts as 0.0, as a float compare sees it), tie: int64 in
    [0, 2**32), broadcast against scores. The score's bits, read as an int32 and made monotonic (a negative float's
    bits count down as it grows), take the high 32 bits; 2**32 - 1 - tie the low 32."""
    s = scores.float()
    s = torch.where(s == 0, torch.zeros_like(s), s)  # -0.0 -> +0.0 (a where, not `+ 0.0`: no simplifier drops it)
    bits = s.view(torch.int32).to(torch.int64)
    mono = torch.where(bits < 0, -(2 ** 31) - 1 - bits, bits)
    return mono * 2 ** 32 + (2 ** 32 - 1 - tie)


# ---------------------------------------------------------------------------------------------------------------
# Sparse attention with a per-head sink: K = V (one shared head), keys given per query by a validity mask


def sparse_attn_partial(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Un-normalised attention over a share of the keys, for an exact merge across shares (context parallelism).

    q [B, T, H, D], kv [B, N, D], valid [B, T, N] -> (acc [B, T, H, D], m [B, T, H], l [B, T, H]) in fp32 with
    m = max valid logit (-inf if none), l = sum exp(logit - m), acc = sum exp(logit - m) * kv."""
    logits = torch.einsum("bthd,bnd->bthn", q.float(), kv.float()) * scale  # [B, T, H, N]
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    if logits.shape[-1] == 0:  # a rank may hold no key of a short sequence
        m = logits.new_full(logits.shape[:-1], float("-inf"))
        return q.new_zeros(q.shape, dtype=torch.float32), m, torch.zeros_like(m)
    m = logits.amax(-1)  # [B, T, H]
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(logits - m_safe.unsqueeze(-1))  # exp(-inf) = 0 for masked keys
    acc = torch.einsum("bthn,bnd->bthd", p, kv.float())
    return acc, m, p.sum(-1)


def sparse_attn_merge(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                      sink: torch.Tensor) -> torch.Tensor:
    """Merge partial results (per-head max / sum-exp) and count the sink logit `sink` [H] exactly once.
    Returns o [B, T, H, D] fp32 = sum_j exp(l_j) kv_j / (sum_j exp(l_j) + exp(sink))."""
    sink = sink.float()
    m_all = torch.stack([p[1] for p in parts], 0)  # [R, B, T, H]
    m = torch.maximum(m_all.amax(0), sink)  # sink is finite, so m is finite
    acc = torch.zeros_like(parts[0][0])
    den = torch.exp(sink - m)
    for a, mr, lr in parts:
        w = torch.where(torch.isinf(mr), torch.zeros_like(mr), torch.exp(mr - m))  # [B, T, H]
        acc = acc + a * w.unsqueeze(-1)
        den = den + lr * w
    return acc / den.unsqueeze(-1)


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                scale: float) -> torch.Tensor:
    """o_h = sum_j exp(l_j) kv_j / (sum_j exp(l_j) + exp(sink_h)), l_j = scale * q_h . kv_j over valid keys.
    q [B, T, H, D], kv [B, N, D], valid [B, T, N], sink [H] -> [B, T, H, D] in q.dtype."""
    return sparse_attn_merge([sparse_attn_partial(q, kv, valid, scale)], sink).to(q.dtype)


# ---------------------------------------------------------------------------------------------------------------
# MoE routing


def gate_scores(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """sqrt(softplus(x @ gate^T)) in fp32: x [T, D], gate [E, D] -> [T, E]."""
    return F.softplus(F.linear(x.float(), gate_weight.float())).sqrt()


def route(scores: torch.Tensor, topk: int, route_scale: float, bias: torch.Tensor | None = None,
          hash_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert choice and weights. scores [T, E] fp32; `bias` [E] shifts selection only; `hash_ids` [T, K] (from
    tid2eid) replaces selection in hash layers. Returns (weights [T, K] fp32, indices [T, K] int64); weights are
    the unbiased scores of the chosen experts, normalised to sum 1, times route_scale."""
    if hash_ids is not None:
        idx = hash_ids.long()
    else:
        sel = scores + bias.float() if bias is not None else scores
        idx = sel.topk(topk, dim=-1).indices
    w = scores.gather(1, idx)
    w = w / w.sum(-1, keepdim=True)
    return w * route_scale, idx


def gate(x: torch.Tensor, gate_weight: torch.Tensor, topk: int, route_scale: float, bias: torch.Tensor | None = None,
         hash_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The router: `route(gate_scores(x, gate_weight), ...)` -> (weights [T, K] fp32, indices [T, K] int64). (A
    composite, not a kernel family of its own: not in `__all__`; the model calls it through its op table,
    `ops.gate`, where the host table has a native one.)"""
    return route(gate_scores(x, gate_weight), topk, route_scale, bias=bias, hash_ids=hash_ids)
