"""Block-quantised GEMMs of DeepSeek-V4 on trn2: FP8 block-scaled linear, FP4 routed-expert linear, grouped `wo_a`.

Three kernels, one family:

`fp8_gemm_kernel(x, w8T, sT)`: y = x @ W^T with W = w8 * scale per 128x128 block.
    x    [T, K]        HBM bf16 (or fp32): tokens on partitions; moved to K-on-partitions by PE transposes
    w8T  [K, N]        HBM uint8: **trn2 `float8_e4m3` bit codes (max 240)**, K-major; reinterpreted in SBUF with
                       `.view(nl.float8_e4m3)` (raw bytes travel as uint8, so no DMA type conversion happens)
    sT   [K/128, N/128] HBM fp32 power-of-two block scales, K-block major (ceil for partial blocks)
    out  [T, N]        shared HBM, dtype of x
    The checkpoint's OCP `float8_e4m3fn` (max 448) bytes are re-blocked at load by `to_trn2_fp8`: blocks whose
    |w8| exceeds 240 are halved and their scale doubled (exact except e4m3 subnormals below 2^-9 * scale, which
    round); trn2 never sees e4m3fn (one e4m3 variant per graph, NCC_EOCP001). In the kernel each [128, <=512]
    weight tile is dequantised to x.dtype on the Vector Engine (exact: 4 significant bits times a power of two)
    and fed to the PE array; PSUM accumulates fp32 over K; one rounding to x.dtype.
`fp4_gemm_kernel(x, packed, s32)`: the routed experts, W[n, k] = e2m1(code[n, k]) * scale[n, k // 32].
    packed [N, K/2]    HBM uint8: two e2m1 codes per byte, low nibble = even k (the checkpoint's int8 bytes)
    s32    [N, K/32]   HBM fp32 (UE8M0 scales widened at load, exact)
    trn2 has no FP4 compute: the kernel unpacks in SBUF with integer ops, placing each 4-bit code s|ee|m into
    the e4m3 bit pattern s|0ee0|m00 (= the e2m1 value * 2^-6, exact for normals and subnormals), reinterprets as
    `float8_e4m3`, multiplies by scale * 64 into x.dtype, PE-transposes to K-major and runs the GEMM.
`grouped_out_proj_kernel(o, woaT, groups)`: u[t, g] = wo_a[g] @ o[t, g] (the low-rank output projection).
    o [T, G*Kg] HBM; woaT [G*Kg, R] HBM (wo_a [G, R, Kg] stored K-major per group, bf16 after the official
    convert.py dequantisation); out [T, G*R] shared HBM, dtype of o.
Constraints
    Any T, N (partial tiles); FP8: any K; FP4: K % 32 == 0. Matmul tiles: stationary x^T [<=128, tp<=128], moving
    weight [<=128, <=512] (FP4: <=128 output rows per unpacked tile). fp32 x pairs with fp32 weights only.
Tunables
    `N_CHUNK` = 512 (one PSUM bank), K chunk = 128 (= FP8 block = partitions), FP4 unpack tile 128 x 128.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import torch

from nki_kernels import _convert, dispatch, formats
from nki_kernels._nki import nisa, nki, nl
from nki_kernels._tiles import load_bcast, load_xT, matmul_rows
from nki_kernels.cases import Case, CaseRun, case, gen_for, randn, timed

NAME = "blockquant"
N_CHUNK = 512
TRN2_FP8_MAX = 240.0


@nki.jit
def fp8_gemm_kernel(x, w8T, sT):
    num_t = x.shape[0]
    num_k = x.shape[1]
    num_n = w8T.shape[1]
    nbk = sT.shape[0]
    nbn = sT.shape[1]
    out = nl.ndarray((num_t, num_n), dtype=x.dtype, buffer=nl.shared_hbm)
    ones = nl.ndarray((1, 128), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(ones, 1.0)
    s_flat = nl.ndarray((128, nbk * nbn), dtype=nl.float32, buffer=nl.sbuf)  # block scales on every partition
    load_bcast(s_flat, sT.reshape((1, nbk * nbn)), ones)
    s_b = s_flat.reshape((128, nbk, nbn))
    for t0 in range(0, num_t, 128):
        tp = min(128, num_t - t0)
        xT = nl.ndarray((128, nbk, tp), dtype=x.dtype, buffer=nl.sbuf)
        load_xT(xT, x, t0, tp, 0, num_k, 0, x.dtype)
        for n0 in range(0, num_n, 512):
            nw = min(512, num_n - n0)
            ps = nl.ndarray((tp, nw), dtype=nl.float32, buffer=nl.psum)
            for kb in range(nbk):
                k0 = kb * 128
                kw = min(128, num_k - k0)
                w8 = nl.ndarray((kw, nw), dtype=nl.uint8, buffer=nl.sbuf)
                nisa.dma_copy(w8, w8T[k0:k0 + kw, n0:n0 + nw])
                w8f = w8.view(nl.float8_e4m3)
                wd = nl.ndarray((kw, nw), dtype=x.dtype, buffer=nl.sbuf)
                for c0 in range(0, nw, 128):
                    cw = min(128, nw - c0)
                    nb = (n0 + c0) // 128
                    nisa.tensor_scalar(wd[0:kw, c0:c0 + cw], w8f[0:kw, c0:c0 + cw], nl.multiply,
                                       s_b[0:kw, kb, nb:nb + 1])
                nisa.nc_matmul(ps, xT[0:kw, kb, 0:tp], wd)
            yo = nl.ndarray((tp, nw), dtype=x.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(yo, ps)
            nisa.dma_copy(out[t0:t0 + tp, n0:n0 + nw], yo)
    return out


@nki.jit
def fp4_gemm_kernel(x, packed, s32):
    num_t = x.shape[0]
    num_k = x.shape[1]
    num_n = packed.shape[0]
    nkc = (num_k + 127) // 128
    out = nl.ndarray((num_t, num_n), dtype=x.dtype, buffer=nl.shared_hbm)
    for t0 in range(0, num_t, 128):
        tp = min(128, num_t - t0)
        xT = nl.ndarray((128, nkc, tp), dtype=x.dtype, buffer=nl.sbuf)
        load_xT(xT, x, t0, tp, 0, num_k, 0, x.dtype)
        for n0 in range(0, num_n, 512):
            nw = min(512, num_n - n0)
            ps = nl.ndarray((tp, nw), dtype=nl.float32, buffer=nl.psum)
            for kc in range(nkc):
                k0 = kc * 128
                kw = min(128, num_k - k0)
                kh = kw // 2
                wT = nl.ndarray((kw, nw), dtype=x.dtype, buffer=nl.sbuf)
                for r0 in range(0, nw, 128):
                    rw = min(128, nw - r0)
                    codes = nl.ndarray((rw, kh), dtype=nl.uint8, buffer=nl.sbuf)
                    nisa.dma_copy(codes, packed[n0 + r0:n0 + r0 + rw, k0 // 2:k0 // 2 + kh])
                    bits = nl.ndarray((rw, kh, 2), dtype=nl.uint8, buffer=nl.sbuf)
                    hi_a = nl.ndarray((rw, kh), dtype=nl.uint8, buffer=nl.sbuf)
                    hi_b = nl.ndarray((rw, kh), dtype=nl.uint8, buffer=nl.sbuf)
                    # low nibble (even k): s|ee|m -> e4m3 bits s<<7 | ee<<4 | m<<2 == (c&8)<<4 | (c&7)<<2
                    nisa.tensor_scalar(hi_a, codes, nl.bitwise_and, 8, op1=nl.left_shift, operand1=4)
                    nisa.tensor_scalar(hi_b, codes, nl.bitwise_and, 7, op1=nl.left_shift, operand1=2)
                    nisa.tensor_tensor(bits[0:rw, 0:kh, 0], hi_a, hi_b, nl.bitwise_or)
                    # high nibble (odd k): (c & 0x80) | (c & 0x70) >> 2
                    nisa.tensor_scalar(hi_a, codes, nl.bitwise_and, 128)
                    nisa.tensor_scalar(hi_b, codes, nl.bitwise_and, 112, op1=nl.right_shift, operand1=2)
                    nisa.tensor_tensor(bits[0:rw, 0:kh, 1], hi_a, hi_b, nl.bitwise_or)
                    w8f = bits.reshape((rw, kw)).view(nl.float8_e4m3)  # e2m1 value * 2^-6
                    sc = nl.ndarray((rw, kw // 32), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.dma_copy(sc, s32[n0 + r0:n0 + r0 + rw, k0 // 32:k0 // 32 + kw // 32])
                    wnk = nl.ndarray((rw, kw), dtype=x.dtype, buffer=nl.sbuf)
                    for gi in range(kw // 32):
                        nisa.tensor_scalar(wnk[0:rw, gi * 32:gi * 32 + 32], w8f[0:rw, gi * 32:gi * 32 + 32],
                                           nl.multiply, sc[0:rw, gi:gi + 1], op1=nl.multiply, operand1=64.0)
                    pt = nl.ndarray((kw, rw), dtype=x.dtype, buffer=nl.psum)
                    nisa.nc_transpose(pt, wnk)
                    nisa.tensor_copy(wT[0:kw, r0:r0 + rw], pt)
                nisa.nc_matmul(ps, xT[0:kw, kc, 0:tp], wT)
            yo = nl.ndarray((tp, nw), dtype=x.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(yo, ps)
            nisa.dma_copy(out[t0:t0 + tp, n0:n0 + nw], yo)
    return out


@nki.jit
def grouped_out_proj_kernel(o, woaT, groups):
    num_t = o.shape[0]
    kg = o.shape[1] // groups
    num_r = woaT.shape[1]
    out = nl.ndarray((num_t, groups * num_r), dtype=o.dtype, buffer=nl.shared_hbm)
    for t0 in range(0, num_t, 128):
        tp = min(128, num_t - t0)
        for g in range(groups):
            xT = nl.ndarray((128, (kg + 127) // 128, tp), dtype=o.dtype, buffer=nl.sbuf)
            load_xT(xT, o, t0, tp, g * kg, kg, 0, o.dtype)
            for r0 in range(0, num_r, 512):
                rw = min(512, num_r - r0)
                ps = nl.ndarray((tp, rw), dtype=nl.float32, buffer=nl.psum)
                matmul_rows(ps, xT, woaT, g * kg, kg, r0, rw)
                yo = nl.ndarray((tp, rw), dtype=o.dtype, buffer=nl.sbuf)
                nisa.tensor_copy(yo, ps)
                nisa.dma_copy(out[t0:t0 + tp, g * num_r + r0:g * num_r + r0 + rw], yo)
    return out


# ---- layout adapters (load time) ----------------------------------------------------------------
def to_trn2_fp8(w8: torch.Tensor, scale: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Checkpoint FP8 block weight (`float8_e4m3fn` [N, K] + UE8M0 [N/128, K/128]) -> trn2 kernel operands:
    (uint8 `float8_e4m3` codes [K, N] K-major, fp32 scales [K/128, N/128]). Blocks with |w8| > 240 are halved
    and their scale doubled, so every value is finite in trn2's e4m3 (max 240)."""
    n, k = w8.shape
    s = formats.ue8m0_to_float(scale)  # [nbn, nbk]
    w = w8.to(torch.float32)
    nbn, nbk = s.shape
    pad = w.new_zeros(nbn * 128, nbk * 128)
    pad[:n, :k] = w.abs()
    amax = pad.view(nbn, 128, nbk, 128).amax(dim=(1, 3))
    halve = amax > TRN2_FP8_MAX
    s = torch.where(halve, s * 2, s)
    div = torch.where(halve, 2.0, 1.0).repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    codes = (w / div).numpy().astype(ml_dtypes.float8_e4m3)
    if not np.isfinite(codes.astype(np.float32)).all():
        raise ValueError("to_trn2_fp8: a value overflowed trn2 e4m3 after re-blocking")
    return np.ascontiguousarray(codes.view(np.uint8).T), s.t().contiguous().numpy()


def _check_x(x: torch.Tensor, k: int, what: str) -> None:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{what}: x {tuple(x.shape)} must be [T, {k}]")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"{what}: activations must be bf16 (or fp32), got {x.dtype}")


def fp8_linear(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, *, executor: str | None = None) -> torch.Tensor:
    """x [T, K] @ dequant(w8 [N, K] e4m3fn, scale UE8M0 [N/128, K/128])^T -> [T, N] in x.dtype."""
    from nki_kernels import reference

    _check_x(x, w8.shape[1], "fp8_linear")
    if tuple(scale.shape) != (math.ceil(w8.shape[0] / 128), math.ceil(w8.shape[1] / 128)):
        raise ValueError(f"fp8_linear: scale {tuple(scale.shape)} does not block w8 {tuple(w8.shape)} by 128")

    def ref():
        return reference.linear(x, formats.dequant_fp8_block(w8, scale, x.dtype))

    if executor == "reference":
        return dispatch.dispatch("blockquant.fp8", fp8_gemm_kernel, (), executor, reference=ref)[1]
    codes, sT = to_trn2_fp8(w8, scale)
    ex, out = dispatch.dispatch("blockquant.fp8", fp8_gemm_kernel, (_convert.to_np(x), codes, sT), executor, ref)
    return out if ex == "reference" else _convert.from_np(out)


def fp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, *,
               executor: str | None = None) -> torch.Tensor:
    """x [T, K] @ dequant_fp4(packed int8 [N, K/2], scale UE8M0 [N, K/32])^T -> [T, N] in x.dtype."""
    from nki_kernels import reference

    n, k = packed.shape[0], packed.shape[1] * 2
    _check_x(x, k, "fp4_linear")
    if k % 32 or tuple(scale.shape) != (n, k // 32):
        raise ValueError(f"fp4_linear: K={k} must be a multiple of 32 and scale {tuple(scale.shape)} [N, K/32]")

    def ref():
        return reference.linear(x, formats.dequant_fp4(packed, scale, x.dtype))

    args = (_convert.to_np(x), packed.view(torch.uint8).contiguous().numpy(),
            formats.ue8m0_to_float(scale).contiguous().numpy())
    ex, out = dispatch.dispatch("blockquant.fp4", fp4_gemm_kernel, args, executor, ref)
    return out if ex == "reference" else _convert.from_np(out)


def grouped_out_proj(o: torch.Tensor, wo_a: torch.Tensor, groups: int, *, executor: str | None = None) -> torch.Tensor:
    """o [T, H*D], wo_a [G*R, H*D/G] -> [T, G*R] in o.dtype (as `reference.grouped_out_proj`)."""
    from nki_kernels import reference

    t, hd = o.shape
    if hd % groups or wo_a.shape[1] != hd // groups or wo_a.shape[0] % groups:
        raise ValueError(f"grouped_out_proj: o {tuple(o.shape)}, wo_a {tuple(wo_a.shape)}, groups {groups} disagree")
    _check_x(o, hd, "grouped_out_proj")
    kg, r = hd // groups, wo_a.shape[0] // groups
    woaT = wo_a.to(o.dtype).view(groups, r, kg).transpose(1, 2).reshape(groups * kg, r).contiguous()
    ex, out = dispatch.dispatch("blockquant.wo_a", grouped_out_proj_kernel,
                                (_convert.to_np(o), _convert.to_np(woaT), int(groups)), executor,
                                reference=lambda: reference.grouped_out_proj(o, wo_a, groups))
    return out if ex == "reference" else _convert.from_np(out)


# ---- cases --------------------------------------------------------------------------------------
CASES: list[Case] = []
for _dt in ("float32", "bfloat16"):
    CASES += [
        case(NAME, "fp8 tiny-model T=8 K=128 N=128", _dt, op="fp8", t=8, k=128, n=128),
        case(NAME, "fp8 tile edge T=130 K=200 N=300", _dt, op="fp8", t=130, k=200, n=300),
        case(NAME, "fp8 V4 wq_a slice T=16 K=4096 N=512", _dt, op="fp8", t=16, k=4096, n=512),
        case(NAME, "fp8 V4 wq_a T=16 K=4096 N=1024", _dt, slow=True, op="fp8", t=16, k=4096, n=1024),
        case(NAME, "fp4 tiny-model T=8 K=64 N=64", _dt, op="fp4", t=8, k=64, n=64),
        case(NAME, "fp4 tile edge T=129 K=160 N=200", _dt, op="fp4", t=129, k=160, n=200),
        case(NAME, "fp4 V4 expert w1 slice T=32 K=4096 N=256", _dt, op="fp4", t=32, k=4096, n=256),
        case(NAME, "fp4 V4 expert w2 T=32 K=1024 N=512", _dt, op="fp4", t=32, k=1024, n=512),
        case(NAME, "fp4 V4 expert w1 T=32 K=4096 N=1024", _dt, slow=True, op="fp4", t=32, k=4096, n=1024),
        case(NAME, "wo_a tiny-model T=4 G=2 Kg=128 R=32", _dt, op="wo_a", t=4, g=2, kg=128, r=32),
        case(NAME, "wo_a tile edge T=130 G=3 Kg=200 R=96", _dt, op="wo_a", t=130, g=3, kg=200, r=96),
        case(NAME, "wo_a V4 T=8 G=8 Kg=4096 R=1024 (1 group)", _dt, op="wo_a", t=8, g=1, kg=4096, r=1024),
        case(NAME, "wo_a V4 T=8 G=8 Kg=4096 R=1024", _dt, slow=True, op="wo_a", t=8, g=8, kg=4096, r=1024),
    ]


def run_case(c: Case, executor: str) -> CaseRun:
    from nki_kernels import reference

    p, g, dt = c.p, gen_for(c), c.torch_dtype
    ex = dispatch.resolve_executor(executor)
    if p["op"] == "fp8":
        x = randn((p["t"], p["k"]), g, dt)
        w8, s = formats.quant_fp8_block(randn((p["n"], p["k"]), g, scale=0.05))
        y, ms = timed(lambda: fp8_linear(x, w8, s, executor=executor))
        want = reference.linear(x.float(), formats.dequant_fp8_block(w8, s, torch.float32))
        return CaseRun(f"x[{p['t']},{p['k']}] w8[{p['n']},{p['k']}] e4m3", [y], [want], ex, ms)
    if p["op"] == "fp4":
        x = randn((p["t"], p["k"]), g, dt)
        packed, s = formats.quant_fp4(randn((p["n"], p["k"]), g, scale=0.05))
        y, ms = timed(lambda: fp4_linear(x, packed, s, executor=executor))
        want = reference.linear(x.float(), formats.dequant_fp4(packed, s, torch.float32))
        return CaseRun(f"x[{p['t']},{p['k']}] w4[{p['n']},{p['k']}//2] e2m1", [y], [want], ex, ms)
    t, grp, kg, r = p["t"], p["g"], p["kg"], p["r"]
    o = randn((t, grp * kg), g, dt)
    wo_a = randn((grp * r, kg), g, dt, scale=kg ** -0.5)
    y, ms = timed(lambda: grouped_out_proj(o, wo_a, grp, executor=executor))
    want = reference.grouped_out_proj(o.float(), wo_a.float(), grp)
    return CaseRun(f"o[{t},{grp}*{kg}] wo_a[{grp}*{r},{kg}]", [y], [want], ex, ms)
