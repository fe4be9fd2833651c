"""CPU implementations of the functions DeepSeek's official `inference/model.py` imports from its `kernel.py`
(tilelang GPU kernels, which do not run on a CPU), written from their documented semantics in plain torch. Used only
by golden/make_official_golden.py, which installs this module as `kernel` (and `fast_hadamard_transform`) before
importing the official model.py. The low-precision steps themselves are `nki_kernels.quant` (one definition).

Semantics (official `kernel.py`, current revision; this module's choices where a CPU cannot be bit-identical):
* `act_quant(x, block, scale_fmt, scale_dtype, inplace)`: per-row blocks of `block` along the last dim, UE8M0
  power-of-two scales when `scale_fmt` is set (what the model always passes), e4m3 round-to-nearest-even after a
  clamp to +-448. `inplace=True` writes the quant-dequant back into x (the KV simulation); else returns
  (float8_e4m3fn codes, scales as float8_e8m0fnu) for `fp8_gemm` / `fp4_gemm`.
* `fp4_act_quant(x, block, inplace)`: the same with e2m1 (max 6, floor 6 * 2**-126); the model only uses in-place.
* `fp8_gemm` / `fp4_gemm`: per-K-block fp32 products scaled by a_s * w_s, fp32 accumulation block after block, one
  rounding to the default dtype (bf16 in the official run; the tilelang kernels always write bf16). Inside a block
  the CPU sums in BLAS order in fp32; the GPU's tensor cores keep fewer accumulator bits for FP8 (not simulated).
* `sparse_attn(q, kv, attn_sink, topk_idxs, scale)`: the kernel's online softmax over blocks of 64 gathered keys
  (index -1 = no key): scores q.k in fp32, times scale, running max, exp in fp32, probabilities rounded to kv's
  dtype (bf16) before the P @ V product (fp32 accumulation), the denominator from the unrounded fp32 exps plus
  exp(sink - max); output in q's dtype.
* `hc_split_sinkhorn`: fp32, pre = sigmoid(m * s0 + b) + eps, post = 2 sigmoid(m * s1 + b), comb = row softmax + eps,
  a column normalisation, then (iters - 1) x (row, column) normalisations, each dividing by (sum + eps).
* `hadamard_transform(x, scale)` (fast_hadamard_transform, and the mirror's fallback in kernel.py): fp32
  Walsh-Hadamard, result in x's dtype.

`SIM` switches each simulation step off for the cross-checks (off: activations go to the GEMMs unquantised, the
in-place quantisers leave their input unchanged); the golden runs with all of them on.
"""

from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass

import torch

from nki_kernels import formats, quant, reference
from nki_kernels.formats import pack_fp4


@dataclass
class Simulation:
    act: bool = True  # per-token FP8 activation quantisation before FP8/FP4 GEMMs
    kv_fp8: bool = True  # in-place FP8 quant-dequant of the non-RoPE KV dims (window KV + compressed entries)
    indexer_fp4: bool = True  # in-place FP4 quant-dequant of the indexer's (rotated) queries and keys
    fp64_accum: bool = False  # cross-check only: GEMMs and attention accumulate in fp64 (same roundings otherwise)

    def label(self) -> str:
        on = [n for n in ("act", "kv_fp8", "indexer_fp4", "fp64_accum") if getattr(self, n)]
        return "+".join(on) if on else "none"


SIM = Simulation()


def _check_pow2_scales(scale_fmt: str | None, what: str) -> None:
    if scale_fmt is None:
        raise NotImplementedError(f"{what}: only power-of-two (UE8M0) scales are implemented; the official model "
                                  f"passes scale_fmt='ue8m0' whenever scale_dtype is 'fp8' (its default)")


def act_quant(x: torch.Tensor, block_size: int = 128, scale_fmt: str | None = None,
              scale_dtype: torch.dtype = torch.float32, inplace: bool = False):
    if x.size(-1) % block_size:
        raise ValueError(f"act_quant: last dim {x.size(-1)} is not a multiple of {block_size}")
    if inplace:
        if SIM.kv_fp8:
            _check_pow2_scales(scale_fmt, "act_quant")
            x.copy_(quant.fp8_qdq(x, block_size))
        return x
    if not SIM.act:
        return x, torch.ones(*x.shape[:-1], x.size(-1) // block_size, dtype=torch.float32)
    _check_pow2_scales(scale_fmt, "act_quant")
    codes, scale = quant.fp8_quant(x, block_size)
    s = scale.view(torch.float8_e8m0fnu) if scale_dtype == torch.float8_e8m0fnu else reference.ue8m0_decode(scale)
    return codes.view(torch.float8_e4m3fn), s


def fp4_act_quant(x: torch.Tensor, block_size: int = 32, inplace: bool = False):
    if x.size(-1) % block_size:
        raise ValueError(f"fp4_act_quant: last dim {x.size(-1)} is not a multiple of {block_size}")
    if inplace:
        if SIM.indexer_fp4:
            x.copy_(quant.fp4_qdq(x, block_size))
        return x
    codes, scale = quant.fp4_quant(x, block_size)
    return pack_fp4(codes).view(torch.float4_e2m1fn_x2), scale.view(torch.float8_e8m0fnu)


def _scale_bytes(s: torch.Tensor) -> torch.Tensor:
    if s.dtype != torch.float8_e8m0fnu:
        raise NotImplementedError(f"GEMM scales must be UE8M0 (float8_e8m0fnu), got {s.dtype}")
    return s.view(torch.uint8)


def fp8_gemm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
             scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    out = torch.get_default_dtype()
    if a.dtype != torch.float8_e4m3fn:  # SIM.act off: an unquantised activation
        return reference.fp8_linear(a.float(), b.view(torch.uint8), _scale_bytes(b_s)).to(out)
    if SIM.fp64_accum:
        w = formats.dequant_fp8_block(b, b_s, torch.float64)
        return (quant.fp8_dequant(a.view(torch.uint8), a_s.view(torch.uint8), 128, torch.float64) @ w.T).to(out)
    return quant.fp8_gemm(a.view(torch.uint8), _scale_bytes(a_s), b.view(torch.uint8), _scale_bytes(b_s), out)


def fp4_gemm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
             scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    out = torch.get_default_dtype()
    if a.dtype != torch.float8_e4m3fn:
        return reference.fp4_linear(a.float(), b.view(torch.uint8), _scale_bytes(b_s)).to(out)
    if SIM.fp64_accum:
        w = formats.dequant_fp4(b.view(torch.int8), b_s, torch.float64)
        return (quant.fp8_dequant(a.view(torch.uint8), a_s.view(torch.uint8), 128, torch.float64) @ w.T).to(out)
    return quant.fp4_gemm(a.view(torch.uint8), _scale_bytes(a_s), b.view(torch.uint8), _scale_bytes(b_s), out)


SPARSE_ATTN_BLOCK = 64  # keys per online-softmax step of the official kernel


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, topk_idxs: torch.Tensor,
                softmax_scale: float) -> torch.Tensor:
    """q [b, m, h, d], kv [b, n, d], attn_sink [h] fp32, topk_idxs [b, m, k] (-1 = none) -> o [b, m, h, d]."""
    b, m, h, d = q.shape
    acc_t = torch.float64 if SIM.fp64_accum else torch.float32
    qf = q.to(acc_t)
    acc = torch.zeros(b, m, h, d, dtype=acc_t)
    denom = torch.zeros(b, m, h, dtype=acc_t)
    run_max = torch.full((b, m, h), float("-inf"), dtype=acc_t)
    batch = torch.arange(b).view(b, 1, 1)
    for t0 in range(0, topk_idxs.size(-1), SPARSE_ATTN_BLOCK):
        idx = topk_idxs[..., t0:t0 + SPARSE_ATTN_BLOCK].long()  # [b, m, B]
        valid = idx != -1
        keys = kv[batch, idx.clamp(min=0)] * valid.unsqueeze(-1).to(kv.dtype)  # [b, m, B, d], zero rows if invalid
        s = torch.einsum("bmhd,bmjd->bmhj", qf, keys.to(acc_t))
        s = torch.where(valid.unsqueeze(2), s, torch.full_like(s, float("-inf"))) * softmax_scale
        prev = run_max
        run_max = torch.maximum(prev, s.amax(-1))
        rescale = torch.exp(prev - run_max)
        p = torch.exp(s - run_max.unsqueeze(-1))
        denom = denom * rescale + p.sum(-1)
        acc = acc * rescale.unsqueeze(-1) + torch.einsum("bmhj,bmjd->bmhd", p.to(kv.dtype).to(acc_t), keys.to(acc_t))
    denom = denom + torch.exp(attn_sink.to(acc_t) - run_max)
    return (acc / denom.unsqueeze(-1)).to(q.dtype)


def hc_split_sinkhorn(mixes: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor, hc_mult: int = 4,
                      sinkhorn_iters: int = 20, eps: float = 1e-6):
    """mixes [b, s, (2+n)*n] fp32 -> pre [b, s, n], post [b, s, n], comb [b, s, n, n] (comb[j, k]: j = source)."""
    n = hc_mult
    mx = mixes.float()
    pre = torch.sigmoid(mx[..., :n] * hc_scale[0] + hc_base[:n]) + eps
    post = 2 * torch.sigmoid(mx[..., n:2 * n] * hc_scale[1] + hc_base[n:2 * n])
    comb = (mx[..., 2 * n:] * hc_scale[2] + hc_base[2 * n:]).unflatten(-1, (n, n))
    comb = torch.exp(comb - comb.amax(-1, keepdim=True))
    comb = comb / comb.sum(-1, keepdim=True) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def hadamard_transform(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    n = x.size(-1)
    if not math.isclose(scale, n**-0.5, rel_tol=1e-12):
        raise NotImplementedError(f"hadamard_transform: only the orthonormal scale n**-0.5 is used, got {scale}")
    return quant.hadamard(x)


def install() -> types.ModuleType:
    """Make `import kernel` and `from fast_hadamard_transform import hadamard_transform` resolve to this module
    (before importing the official model.py)."""
    me = sys.modules[__name__]
    sys.modules["kernel"] = me
    fht = types.ModuleType("fast_hadamard_transform")
    fht.hadamard_transform = hadamard_transform
    sys.modules["fast_hadamard_transform"] = fht
    return me
