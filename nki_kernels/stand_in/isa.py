"""Stand-in for `nki.isa`: the instructions the project's kernels use, `dst` first, with the trn2 rules enforced.

Written from the public API description, not from any SDK code. Each instruction computes in
fp32 (integer ops in int64 for bitwise work) and writes through `Tensor.write`, which rounds to the destination
dtype. Rules that raise `NkiRuleError`: partition dim <= 128; matmul operands in SBUF, contraction on the
partition dim, stationary free <= 128, moving free <= 512, dst fp32 in PSUM, no gen4 e4m3fn; no DMA touching
PSUM; `tensor_tensor` not both in PSUM; reductions on trailing free axes only; `tensor_scalar`/`activation`
operands `[P,1]` fp32; transposes keep the dtype; compute engines never touch HBM. Unknown instructions raise
`NotImplementedError`.
"""

from __future__ import annotations

import math
from enum import Enum

import numpy as np

from nki_kernels.stand_in import language as nl
from nki_kernels.stand_in.tensor import PMAX, PSUM_BANK_FP32, NkiRuleError, Tensor, is_float, is_int


class engine(Enum):  # noqa: N801 - mirrors nki.isa.engine
    tensor = "tensor"
    vector = "vector"
    scalar = "scalar"
    gpsimd = "gpsimd"
    dma = "dma"
    sync = "sync"
    unknown = "unknown"


class reduce_cmd(Enum):  # noqa: N801
    idle = "idle"
    reset = "reset"
    reduce = "reduce"
    reset_reduce = "reset_reduce"
    load_reduce = "load_reduce"


_REDUCE_CMD = reduce_cmd  # the enum, for code where a parameter shadows the name


class dge_mode(Enum):  # noqa: N801
    unknown = "unknown"
    swdge = "swdge"
    hwdge = "hwdge"
    none = "none"


class oob_mode(Enum):  # noqa: N801
    error = "error"
    skip = "skip"


class matmul_perf_mode(Enum):  # noqa: N801
    none = "none"
    double_row = "double_row"


# ---- helpers ------------------------------------------------------------------------------------
def _t(x, what: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise NkiRuleError(f"{what}: expected a tensor, got {type(x).__name__}")
    return x


def _onchip(x: Tensor, what: str) -> None:
    if not x.onchip:
        raise NkiRuleError(f"{what}: {x!r} is in {x.buffer}; compute engines only read/write SBUF or PSUM")


def _same_layout(a: Tensor, b: Tensor, what: str) -> None:
    if a.shape[0] != b.shape[0] or a.free_size != b.free_size:
        raise NkiRuleError(f"{what}: {a!r} and {b!r} must have the same partition count and elements per partition")


def _scalar_operand(op, data: Tensor, what: str, allow_int: bool, any_float: bool = False):
    """A compile-time scalar or a [P,1] fp32 tile (any float dtype if `any_float`) broadcast along the free dims."""
    if isinstance(op, Tensor):
        _onchip(op, what)
        if op.shape[0] != data.shape[0] or op.free_size != 1:
            raise NkiRuleError(f"{what}: tile operand {op!r} must be [P,1] with P = {data.shape[0]}")
        if op.dtype != nl.float32 and not (allow_int and is_int(op.dtype)) and not (any_float and is_float(op.dtype)):
            raise NkiRuleError(f"{what}: tile operand {op!r} must be float32")
        v = op.arr.reshape(op.shape[0], *([1] * (data.ndim - 1)))
        return v.astype(np.int64) if allow_int and is_int(op.dtype) else v.astype(np.float32)
    if isinstance(op, (bool, np.bool_)) or not isinstance(op, (int, float, np.integer, np.floating)):
        raise NkiRuleError(f"{what}: operand must be a number or a [P,1] tile, got {op!r}")
    return op


def _apply(op, a, b, data_is_int: bool):
    if not isinstance(op, nl.Op):
        raise NkiRuleError(f"unknown op {op!r}")
    if op.kind == "bitwise":
        if not data_is_int:
            raise NkiRuleError(f"{op!r} needs integer operands")
        return nl.BITWISE[op.name](np.asarray(a).astype(np.int64), np.asarray(b).astype(np.int64))
    if op.kind == "compare":
        return nl.COMPARE[op.name](a, b).astype(np.float32)
    if op.kind == "binary":
        if op.name == "divide":
            raise NkiRuleError("nl.divide is not supported by the engines; multiply by nisa.reciprocal instead")
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return nl.BINARY[op.name](a, b)
    raise NkiRuleError(f"{op!r} is not a binary op")


def _check_not_gen4_fp8(x: Tensor, what: str) -> None:
    if x.dtype == nl.float8_e4m3fn:
        raise NkiRuleError(f"{what}: float8_e4m3fn (OCP) compute is NeuronCore-v4 only; trn2 uses float8_e4m3")


# ---- data movement ------------------------------------------------------------------------------
def dma_copy(dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, engine=engine.unknown,
             name=None):
    dst, src = _t(dst, "dma_copy dst"), _t(src, "dma_copy src")
    if src.buffer == "psum" or dst.buffer == "psum":
        raise NkiRuleError("dma_copy cannot read or write PSUM (since NKI 0.3); use nisa.tensor_copy to SBUF first")
    if math.prod(src.shape) != math.prod(dst.shape):
        raise NkiRuleError(f"dma_copy: element counts differ: {src!r} -> {dst!r}")
    if dge_mode == dge_mode.hwdge and src.dtype != dst.dtype:
        raise NkiRuleError("dma_copy with hwdge needs identical dtypes; reinterpret with .view()")
    if src.dtype == dst.dtype:
        dst.arr[...] = src.arr.reshape(dst.shape)
    else:  # converted through fp32
        dst.write(src.read_f32().reshape(dst.shape))


def tensor_copy(dst, src, engine=engine.unknown, name=None):
    dst, src = _t(dst, "tensor_copy dst"), _t(src, "tensor_copy src")
    _onchip(dst, "tensor_copy dst")
    _onchip(src, "tensor_copy src")
    _same_layout(dst, src, "tensor_copy")
    if engine == engine.gpsimd and "psum" in (dst.buffer, src.buffer):
        raise NkiRuleError("tensor_copy: GpSimd cannot access PSUM")
    if src.dtype == dst.dtype:  # bit-accurate
        dst.arr[...] = src.arr.reshape(dst.shape)
        if dst._mm is not None:
            dst._mm[...] = False
    elif is_int(src.dtype) and is_int(dst.dtype):
        dst.write(src.arr.astype(np.int64).reshape(dst.shape))
    else:
        dst.write(src.read_f32().reshape(dst.shape))


def memset(dst, value, engine=engine.unknown, name=None):
    dst = _t(dst, "memset dst")
    _onchip(dst, "memset dst")
    if is_int(dst.dtype) and not float(value).is_integer():
        raise NkiRuleError(f"memset: value {value!r} does not match integer dtype {dst.dtype.name}")
    dst.write(np.full(dst.shape, value, dtype=np.float64 if is_float(dst.dtype) else np.int64))


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    dst = _t(dst, "iota dst")
    if dst.buffer != "sbuf":
        raise NkiRuleError("iota writes SBUF only (GpSimd)")
    pats = [tuple(int(v) for v in p) for p in pattern]
    if not 1 <= len(pats) <= 4 or any(len(p) != 2 for p in pats):
        raise NkiRuleError(f"iota: pattern must be 1..4 [step, num] pairs, got {pattern!r}")
    nums = [n for _, n in pats]
    if int(np.prod(nums)) != dst.free_size:
        raise NkiRuleError(f"iota: pattern covers {int(np.prod(nums))} elements, dst has {dst.free_size} per partition")
    val = np.zeros(nums, dtype=np.int64) + int(offset)
    for d, (step, n) in enumerate(pats):
        shape = [1] * len(pats)
        shape[d] = n
        val = val + step * np.arange(n, dtype=np.int64).reshape(shape)
    p = np.arange(dst.shape[0], dtype=np.int64).reshape(-1, *([1] * len(pats))) * int(channel_multiplier)
    val = (val[None] + p).astype(np.int32)  # int32 math
    dst.write(val.reshape(dst.shape) if is_int(dst.dtype) else val.astype(np.float32).reshape(dst.shape))


# ---- Tensor Engine --------------------------------------------------------------------------------
_MATMUL_TYPES = ("float32", "bfloat16", "float16", "float8_e4m3", "float8_e5m2")


def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
              accumulate=None, tile_position=(), tile_size=(), perf_mode=matmul_perf_mode.none, name=None):
    dst, st, mv = _t(dst, "nc_matmul dst"), _t(stationary, "stationary"), _t(moving, "moving")
    if is_transpose or tile_position or tile_size or perf_mode != matmul_perf_mode.none:
        raise NotImplementedError("nc_matmul: is_transpose/tile_position/tile_size/perf_mode not in the subset")
    for x, w in ((st, "stationary"), (mv, "moving")):
        if x.buffer != "sbuf":
            raise NkiRuleError(f"nc_matmul: {w} {x!r} must be in SBUF")
        _check_not_gen4_fp8(x, f"nc_matmul {w}")
        if x.dtype.name not in _MATMUL_TYPES:
            raise NkiRuleError(f"nc_matmul: {w} dtype {x.dtype.name} is not a matmul input type")
    if (st.dtype == nl.float32) != (mv.dtype == nl.float32):
        raise NkiRuleError(f"nc_matmul: fp32 only multiplies fp32 ({st.dtype.name} x {mv.dtype.name})")
    if dst.buffer != "psum":
        raise NkiRuleError(f"nc_matmul: dst {dst!r} must be in PSUM")
    if dst.dtype != nl.float32:
        raise NkiRuleError(f"nc_matmul: dst must be float32 on trn2 (bf16 PSUM is gen4 only), got {dst.dtype.name}")
    k, m, n = st.shape[0], st.free_size, mv.free_size
    if mv.shape[0] != k:
        raise NkiRuleError(f"nc_matmul: contraction (partition) dims differ: {st!r} vs {mv!r}")
    if k > PMAX:
        raise NkiRuleError(f"nc_matmul: contraction {k} > {PMAX}")
    if m > 128:
        raise NkiRuleError(f"nc_matmul: stationary free size {m} > 128")
    if n > 512:
        raise NkiRuleError(f"nc_matmul: moving free size {n} > 512")
    if dst.shape[0] != m or dst.free_size != n:
        raise NkiRuleError(f"nc_matmul: dst {dst!r} must be [{m}, {n}]")
    if n > PSUM_BANK_FP32:
        raise NkiRuleError("nc_matmul: result exceeds one PSUM bank")
    # fp32 products and accumulation; einsum, not BLAS: a threaded BLAS on a busy 2-core box is 100x slower
    res = np.einsum("km,kn->mn", st.read_f32().reshape(k, m), mv.read_f32().reshape(k, n))
    res = res.reshape(dst.shape)
    cur = dst.arr.astype(np.float32)
    flags = dst._mm
    if accumulate is None:  # first matmul write to a location overwrites, later ones add
        out = np.where(flags, cur + res, res)
    elif accumulate:
        if not flags.all():
            raise NkiRuleError("nc_matmul(accumulate=True) onto PSUM not written by a matmul is undefined on trn2")
        out = cur + res
    else:
        out = res
    dst.write(out, from_matmul=True)


def nc_transpose(dst, data, engine=engine.unknown, name=None):
    dst, data = _t(dst, "nc_transpose dst"), _t(data, "nc_transpose data")
    _onchip(dst, "nc_transpose dst")
    _onchip(data, "nc_transpose data")
    if dst.dtype != data.dtype:
        raise NkiRuleError(f"nc_transpose: dst dtype {dst.dtype.name} must equal data dtype {data.dtype.name}")
    p, f = data.shape[0], data.free_size
    eng = engine
    if eng == engine.unknown:
        eng = engine.tensor if (data.buffer == "sbuf" and dst.buffer == "psum") else engine.vector
    if eng == engine.tensor:
        if data.buffer != "sbuf" or dst.buffer != "psum":
            raise NkiRuleError("nc_transpose on the Tensor Engine reads SBUF and writes PSUM")
        if p > 128 or f > 128:
            raise NkiRuleError(f"nc_transpose (Tensor Engine): input {data.shape} exceeds [128, 128]")
    elif eng == engine.vector:
        if p > 32 or f > 32:
            raise NkiRuleError(f"nc_transpose (Vector Engine): input {data.shape} exceeds [32, 32]")
    else:
        raise NkiRuleError(f"nc_transpose: engine {eng} not allowed")
    if dst.shape[0] != f or dst.free_size != p:
        raise NkiRuleError(f"nc_transpose: dst {dst!r} must be [{f}, {p}]")
    dst.arr[...] = data.arr.reshape(p, f).T.reshape(dst.shape)  # bit-accurate
    if dst._mm is not None:
        dst._mm[...] = False


# ---- Scalar / Vector Engine ---------------------------------------------------------------------
def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=reduce_cmd.idle,
               name=None):
    dst, data = _t(dst, "activation dst"), _t(data, "activation data")
    _onchip(dst, "activation dst")
    _onchip(data, "activation data")
    _same_layout(dst, data, "activation")
    if not isinstance(op, nl.Op) or op.kind != "unary":
        raise NkiRuleError(f"activation: {op!r} is not an activation function")
    x = data.read_f32()
    s = _scalar_operand(scale, data, "activation scale", allow_int=False)
    x = x * s
    if bias is not None:
        x = x + _scalar_operand(bias, data, "activation bias", allow_int=False, any_float=True)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        y = nl.UNARY[op.name](x).astype(np.float32)
    dst.write(y.reshape(dst.shape))
    if reduce_op is not None or reduce_res is not None:
        if reduce_op is not nl.add or reduce_res is None:
            raise NotImplementedError("activation: only reduce_op=nl.add with reduce_res is in the subset")
        if reduce_cmd == _REDUCE_CMD.idle:
            raise NkiRuleError("activation: reduce_res with reduce_cmd=idle reads the stale reduce registers; "
                               "use reduce_cmd=nisa.reduce_cmd.reset_reduce")
        if reduce_cmd != _REDUCE_CMD.reset_reduce:
            # accumulating across instructions (reduce / load_reduce) needs register state the stand-in lacks
            raise NotImplementedError(f"activation: reduce_cmd={reduce_cmd} is not modelled (use reset_reduce)")
        rr = _t(reduce_res, "activation reduce_res")
        _onchip(rr, "reduce_res")
        if rr.shape[0] != data.shape[0] or rr.free_size != 1:
            raise NkiRuleError(f"activation: reduce_res {rr!r} must be [P,1]")
        rr.write(y.reshape(y.shape[0], -1).sum(axis=1, dtype=np.float32).reshape(rr.shape))


def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    dst, a, b = _t(dst, "tensor_tensor dst"), _t(data1, "data1"), _t(data2, "data2")
    for x in (dst, a, b):
        _onchip(x, "tensor_tensor")
    _same_layout(a, b, "tensor_tensor")
    _same_layout(dst, a, "tensor_tensor dst")
    if a.buffer == "psum" and b.buffer == "psum":
        raise NkiRuleError("tensor_tensor: data1 and data2 cannot both be in PSUM")
    ints = is_int(a.dtype) and is_int(b.dtype)
    if getattr(op, "kind", None) == "bitwise" and not (ints and is_int(dst.dtype)):
        raise NkiRuleError("tensor_tensor: bitvec operators need integer inputs and dst")
    va = a.arr.astype(np.int64) if ints else a.read_f32()
    vb = (b.arr.astype(np.int64) if ints else b.read_f32()).reshape(va.shape)
    dst.write(_apply(op, va, vb, ints).reshape(dst.shape))


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=engine.unknown, name=None):
    dst, data = _t(dst, "tensor_scalar dst"), _t(data, "tensor_scalar data")
    _onchip(dst, "tensor_scalar dst")
    _onchip(data, "tensor_scalar data")
    _same_layout(dst, data, "tensor_scalar")
    ints = is_int(data.dtype)
    kinds = {getattr(op, "kind", None) == "bitwise" for op in (op0, op1) if op is not None}
    if len(kinds) > 1:
        raise NkiRuleError("tensor_scalar: op0 and op1 must both be bitvec or both arithmetic operators")
    if kinds == {True} and not (ints and is_int(dst.dtype)):
        raise NkiRuleError("tensor_scalar: bitvec operators need integer data and dst (bit patterns, no casts)")
    if op1 is None and operand1 is not None:
        raise NkiRuleError("tensor_scalar: operand1 must be None when op1 is unused")
    x = data.arr.astype(np.int64) if ints else data.read_f32()
    for op, operand, rev in ((op0, operand0, reverse0), (op1, operand1, reverse1)):
        if op is None:
            continue
        if isinstance(op, nl.Op) and op.kind == "unary":
            raise NkiRuleError("tensor_scalar: use nisa.activation for unary functions")
        v = _scalar_operand(operand, data, "tensor_scalar operand", allow_int=ints)
        if ints and isinstance(v, float) and not float(v).is_integer():
            raise NkiRuleError("tensor_scalar: integer data needs integer operands")
        x = _apply(op, v, x, ints) if rev else _apply(op, x, v, ints)
        if isinstance(op, nl.Op) and op.kind == "compare" and ints:
            x = x.astype(np.int64)
    dst.write(np.asarray(x).reshape(dst.shape))


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    dst, data = _t(dst, "tensor_reduce dst"), _t(data, "tensor_reduce data")
    _onchip(dst, "tensor_reduce dst")
    _onchip(data, "tensor_reduce data")
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    nd = data.ndim
    if not axes or 0 in axes or sorted(axes) != list(range(nd - len(axes), nd)):
        raise NkiRuleError(f"tensor_reduce: axis {axis} must be the trailing free axes of a {nd}-D tile (not 0)")
    funcs = {"add": np.sum, "maximum": np.max, "minimum": np.min, "multiply": np.prod}
    if not isinstance(op, nl.Op) or op.name not in funcs:
        raise NkiRuleError(f"tensor_reduce: op {op!r} not supported")
    r = funcs[op.name](data.read_f32(), axis=axes, keepdims=keepdims)
    if negate:
        r = -r
    if math.prod(r.shape) != math.prod(dst.shape) or dst.shape[0] != data.shape[0]:
        raise NkiRuleError(f"tensor_reduce: dst {dst!r} does not match the reduced shape {r.shape}")
    dst.write(r.reshape(dst.shape))


def reciprocal(dst, data, name=None):
    dst, data = _t(dst, "reciprocal dst"), _t(data, "reciprocal data")
    _onchip(dst, "reciprocal dst")
    _onchip(data, "reciprocal data")
    _same_layout(dst, data, "reciprocal")
    with np.errstate(divide="ignore"):
        dst.write((1.0 / data.read_f32()).reshape(dst.shape))


# ---- top-k helpers (Vector Engine) ---------------------------------------------------------------
def _rows(x: Tensor) -> np.ndarray:
    return x.read_f32().reshape(x.shape[0], -1)


def max8(dst, src, name=None):
    dst, src = _t(dst, "max8 dst"), _t(src, "max8 src")
    _onchip(dst, "max8 dst")
    _onchip(src, "max8 src")
    if dst.shape[0] != src.shape[0] or dst.free_size != 8:
        raise NkiRuleError(f"max8: dst {dst!r} must be [P, 8]")
    if src.free_size < 8 or src.free_size > 16384:
        raise NkiRuleError(f"max8: src free size {src.free_size} must be in [8, 16384]")
    v = -np.sort(-_rows(src), axis=1, kind="stable")[:, :8]
    dst.write(v.reshape(dst.shape))


def _first_index(data: np.ndarray, vals: np.ndarray, claim: bool = True) -> np.ndarray:
    """Per partition, the index of the first occurrence of each of the 8 values. With `claim` (match_replace8,
    whose documented NumPy equivalent replaces each match before looking up the next value) a repeated value
    finds the next occurrence; without it (find_index8) repeated values give the same index."""
    out = np.zeros(vals.shape, dtype=np.int64)
    claimed = np.zeros(data.shape, dtype=bool)
    rows = np.arange(data.shape[0])
    for i in range(vals.shape[1]):
        hit = (data == vals[:, i:i + 1]) & ~claimed
        first = hit.argmax(axis=1)
        found = hit[rows, first]
        out[:, i] = np.where(found, first, 0)
        if claim:
            claimed[rows[found], first[found]] = True
    return out


def nc_find_index8(dst, data, vals, name=None):
    dst, data, vals = _t(dst, "nc_find_index8 dst"), _t(data, "data"), _t(vals, "vals")
    for x in (dst, data, vals):
        _onchip(x, "nc_find_index8")
    if not is_int(dst.dtype) or dst.free_size != 8 or vals.free_size != 8:
        raise NkiRuleError("nc_find_index8: dst must be an integer [P, 8] tile and vals [P, 8]")
    dst.write(_first_index(_rows(data), _rows(vals), claim=False).reshape(dst.shape))


def nc_match_replace8(dst, data, vals, imm, dst_idx=None, name=None):
    dst, data, vals = _t(dst, "nc_match_replace8 dst"), _t(data, "data"), _t(vals, "vals")
    for x in (dst, data, vals):
        _onchip(x, "nc_match_replace8")
    _same_layout(dst, data, "nc_match_replace8")
    d, v = _rows(data).copy(), _rows(vals)
    idx = _first_index(d, v)
    for p in range(d.shape[0]):
        for i in range(8):
            if d[p, idx[p, i]] == v[p, i]:
                d[p, idx[p, i]] = imm
    dst.write(d.reshape(dst.shape))
    if dst_idx is not None:
        _t(dst_idx, "dst_idx").write(idx.reshape(dst_idx.shape))


def __getattr__(name: str):
    raise NotImplementedError(f"nki.isa.{name} is not implemented by the NumPy stand-in (outside the subset)")
