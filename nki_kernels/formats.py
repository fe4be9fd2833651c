"""Exact FP8 / FP4 weight formats of the DeepSeek-V4 checkpoints.

Leaf module (torch + numpy only): the loader (`engine.loader`) and the NKI kernels share these formulas.

Formats
-------
* **UE8M0 scale** (`torch.float8_e8m0fnu`, safetensors `F8_E8M0`): one byte ``b``, value ``2**(b - 127)``;
  ``b = 255`` is NaN. Only powers of two in ``[2**-127, 2**127]`` are representable.
* **FP8 block** weights: ``w8`` `float8_e4m3fn` ``[out, in]`` with ``scale`` UE8M0
  ``[ceil(out/128), ceil(in/128)]``; ``W[i, j] = w8[i, j] * scale[i // 128, j // 128]``.
* **FP4 (e2m1) routed experts**: ``packed`` `int8` ``[out, in/2]``, two 4-bit codes per byte along the input dim,
  **low nibble = even element, high nibble = odd element**; code -> value table `FP4_VALUES`.
  ``scale`` UE8M0 ``[out, in/32]``: ``W[i, j] = FP4_VALUES[code[i, j]] * scale[i, j // 32]``.

Every dequantisation here is exact in float32 and bfloat16: an e4m3 / e2m1 value times a power of two needs at
most 4 significant bits, and the exponents stay inside the float32/bfloat16 range.

Quantisers (used to build test checkpoints; the released weights come quantised already):
* `quant_fp8_block`: per 128x128 block ``s = 2**ceil(log2(max(amax, 1e-4) / 448))`` (the rule of the official
  ``act_quant`` with ``scale_fmt="ue8m0"``; the 1e-4 floor keeps all-zero blocks finite), then
  ``w8 = e4m3(clamp(w / s, -448, 448))`` with round-to-nearest-even (torch's cast).
* `quant_fp4`: per 1x32 block ``s = 2**ceil(log2(max(amax, 6 * 2**-126) / 6))`` (the floor of the official
  ``fp4_act_quant``), then round-to-nearest-even on the e2m1 grid (ties go to the even code, i.e. the value with
  an even mantissa bit, as IEEE rounding and the hardware conversion do); ``|w / s| <= 6`` by construction.
"""

from __future__ import annotations

import math

import torch

FP8_BLOCK = 128
FP4_BLOCK = 32
FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_AMAX_FLOOR = 1e-4
FP4_AMAX_FLOOR = 6.0 * 2.0**-126
UE8M0_BIAS = 127

# e2m1 code -> value. Code bits: sign(3) exponent(2..1) mantissa(0).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_FP4_TABLE = torch.tensor(FP4_VALUES, dtype=torch.float32)
_FP4_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)


# ---- UE8M0 ---------------------------------------------------------------------------------------------------
def ue8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales (`float8_e8m0fnu`, or their raw `uint8` bytes) -> float32 ``2**(byte - 127)``."""
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e8m0fnu)
    if scale.dtype != torch.float8_e8m0fnu:
        raise TypeError(f"expected float8_e8m0fnu or uint8 scales, got {scale.dtype}")
    return scale.to(torch.float32)


def ue8m0_from_exponent(exp: torch.Tensor) -> torch.Tensor:
    """Integer exponents e in [-127, 127] -> `float8_e8m0fnu` tensor holding 2**e (byte e + 127)."""
    exp = exp.to(torch.int32)
    if exp.numel() and (int(exp.min()) < -UE8M0_BIAS or int(exp.max()) > UE8M0_BIAS):
        raise ValueError(f"UE8M0 exponent out of range [-127, 127]: [{int(exp.min())}, {int(exp.max())}]")
    return (exp + UE8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)


def ue8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """The raw bytes (uint8) of a `float8_e8m0fnu` tensor."""
    return scale.view(torch.uint8)


def pow2_ceil_exponent(x: torch.Tensor) -> torch.Tensor:
    """Exact ``ceil(log2(x))`` for positive finite float32 ``x`` (int32), computed with frexp, not log2."""
    mantissa, exponent = torch.frexp(x.to(torch.float32))  # x = m * 2**e, m in [0.5, 1)
    return (exponent - (mantissa == 0.5).to(exponent.dtype)).to(torch.int32)


# ---- raw bytes of stored weights (load time, outside graphs) ----------------------------------------------------
_BYTE_DTYPES = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8, torch.uint8)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A checkpoint's float8_e4m3fn / float8_e8m0fnu / int8 (or uint8) tensor -> its bytes as uint8, zero-copy
    (`.view(torch.uint8)`: same storage, no conversion). For load time, outside graphs."""
    if t.dtype not in _BYTE_DTYPES:
        raise TypeError(f"as_bytes: expected one of {[str(d) for d in _BYTE_DTYPES]}, got {t.dtype}")
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def stored_fp8(w8: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 block weight as stored (float8_e4m3fn [N, K] + UE8M0 [ceil(N/128), ceil(K/128)]) -> (w_u8, scale_u8),
    the operands of `reference.fp8_linear` (zero-copy views; shapes checked)."""
    if w8.dtype not in (torch.float8_e4m3fn, torch.uint8) or w8.dim() != 2:
        raise TypeError(f"stored_fp8: expected a 2-D float8_e4m3fn (or uint8) weight, got {w8.dtype} {tuple(w8.shape)}")
    want = (math.ceil(w8.shape[0] / FP8_BLOCK), math.ceil(w8.shape[1] / FP8_BLOCK))
    if tuple(scale.shape) != want or scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise ValueError(f"stored_fp8: weight {tuple(w8.shape)} needs a UE8M0 scale of shape {want}, "
                         f"got {scale.dtype} {tuple(scale.shape)}")
    return as_bytes(w8), as_bytes(scale)


def stored_fp4(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 expert weight as stored (int8 [N, K/2] + UE8M0 [N, K/32]) -> (packed_u8, scale_u8), the operands of
    `reference.fp4_linear` (zero-copy views; shapes checked)."""
    if packed.dtype not in (torch.int8, torch.uint8) or packed.dim() != 2:
        raise TypeError(f"stored_fp4: expected a 2-D int8 (or uint8) packed weight, got {packed.dtype} "
                        f"{tuple(packed.shape)}")
    n, k = packed.shape[0], packed.shape[1] * 2
    if k % FP4_BLOCK or tuple(scale.shape) != (n, k // FP4_BLOCK) or scale.dtype not in (torch.float8_e8m0fnu,
                                                                                          torch.uint8):
        raise ValueError(f"stored_fp4: packed {tuple(packed.shape)} needs a UE8M0 scale of shape "
                         f"({n}, {k // FP4_BLOCK}), got {scale.dtype} {tuple(scale.shape)}")
    return as_bytes(packed), as_bytes(scale)


# ---- FP8 e4m3, 128x128 blocks --------------------------------------------------------------------------------
def _expand_blocks(scale: torch.Tensor, rows: int, cols: int, block_r: int, block_c: int) -> torch.Tensor:
    return scale.repeat_interleave(block_r, dim=0)[:rows].repeat_interleave(block_c, dim=1)[:, :cols]


def dequant_fp8_block(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                      block: int = FP8_BLOCK) -> torch.Tensor:
    """FP8 block weight -> dense ``[out, in]`` tensor of ``dtype`` (exact).

    ``w8``: float8_e4m3fn ``[out, in]``; ``scale``: float8_e8m0fnu ``[ceil(out/block), ceil(in/block)]``.
    """
    if w8.dtype != torch.float8_e4m3fn:
        raise TypeError(f"expected a float8_e4m3fn weight, got {w8.dtype}")
    if w8.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w8.shape)}")
    out_f, in_f = w8.shape
    want = (math.ceil(out_f / block), math.ceil(in_f / block))
    if tuple(scale.shape) != want:
        raise ValueError(f"FP8 weight {tuple(w8.shape)} needs a scale of shape {want}, got {tuple(scale.shape)}")
    s = _expand_blocks(ue8m0_to_float(scale), out_f, in_f, block, block)
    return (w8.to(torch.float32) * s).to(dtype)


def quant_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``[out, in]`` -> (``w8`` float8_e4m3fn ``[out, in]``, ``scale`` float8_e8m0fnu
    ``[ceil(out/block), ceil(in/block)]``) with power-of-two scales ``2**ceil(log2(max(amax, 1e-4)/448))``."""
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    w = w.to(torch.float32)
    out_f, in_f = w.shape
    nb_r, nb_c = math.ceil(out_f / block), math.ceil(in_f / block)
    padded = w.new_zeros(nb_r * block, nb_c * block)
    padded[:out_f, :in_f] = w.abs()
    amax = padded.view(nb_r, block, nb_c, block).amax(dim=(1, 3)).clamp(min=FP8_AMAX_FLOOR)  # [nb_r, nb_c]
    exp = pow2_ceil_exponent(amax / FP8_MAX)
    s = torch.ldexp(torch.ones_like(amax), exp)
    w8 = (w / _expand_blocks(s, out_f, in_f, block, block)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return w8, ue8m0_from_exponent(exp)


# ---- FP4 e2m1, 1x32 blocks, two codes per byte -----------------------------------------------------------------
def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8 in [0, 15]) ``[out, in]`` -> int8 ``[out, in/2]``; low nibble = even element."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even input dim, got {codes.shape[-1]}")
    codes = codes.to(torch.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8 (or uint8) ``[out, in/2]`` -> codes uint8 ``[out, in]`` (element 2k = low nibble of byte k)."""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"expected int8/uint8 packed FP4, got {packed.dtype}")
    b = packed.view(torch.uint8)
    return torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)


def fp4_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    return _FP4_TABLE[codes.long()]


def float_to_fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values (already divided by their scale) to the nearest e2m1 code, ties to even; saturates at
    +-6. Returns uint8 codes in [0, 15] (negative values, including those rounding to zero, get the sign bit)."""
    x = x.to(torch.float32)
    mag = x.abs().clamp(max=FP4_MAX).contiguous()
    lo = torch.searchsorted(_FP4_MIDPOINTS, mag, right=False)  # exact midpoint -> lower code
    hi = torch.searchsorted(_FP4_MIDPOINTS, mag, right=True)  # exact midpoint -> upper code
    code = torch.where(lo % 2 == 0, lo, hi)  # lo != hi only on a tie: keep the even code
    return (code | (torch.signbit(x).to(code.dtype) << 3)).to(torch.uint8)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                block: int = FP4_BLOCK) -> torch.Tensor:
    """FP4 expert weight -> dense ``[out, in]`` tensor of ``dtype`` (exact).

    ``packed``: int8 ``[out, in/2]``; ``scale``: float8_e8m0fnu ``[out, in/block]``.
    """
    if packed.dim() != 2:
        raise ValueError(f"expected 2-D packed FP4, got shape {tuple(packed.shape)}")
    out_f, in_f = packed.shape[0], packed.shape[1] * 2
    if in_f % block or tuple(scale.shape) != (out_f, in_f // block):
        raise ValueError(f"FP4 weight [{out_f}, {in_f}] needs a scale of shape ({out_f}, {in_f // block}), "
                         f"got {tuple(scale.shape)}")
    vals = fp4_codes_to_float(unpack_fp4(packed))  # [out, in]
    s = ue8m0_to_float(scale).repeat_interleave(block, dim=1)
    return (vals * s).to(dtype)


def quant_fp4(w: torch.Tensor, block: int = FP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``[out, in]`` -> (``packed`` int8 ``[out, in/2]``, ``scale`` float8_e8m0fnu ``[out, in/block]``)
    with power-of-two scales ``2**ceil(log2(max(amax, 6*2**-126)/6))`` and e2m1 round-to-nearest-even."""
    if w.dim() != 2 or w.shape[1] % block:
        raise ValueError(f"FP4 needs a 2-D weight with in_features divisible by {block}, got {tuple(w.shape)}")
    w = w.to(torch.float32)
    out_f, in_f = w.shape
    blocks = w.view(out_f, in_f // block, block)
    amax = blocks.abs().amax(dim=-1).clamp(min=FP4_AMAX_FLOOR)  # [out, in/block]
    exp = pow2_ceil_exponent(amax / FP4_MAX)
    s = torch.ldexp(torch.ones_like(amax), exp)
    codes = float_to_fp4_codes((blocks / s[..., None]).view(out_f, in_f))
    return pack_fp4(codes), ue8m0_from_exponent(exp)
