"""Every rule the NumPy stand-in enforces has a test that shows it raising."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from nki_kernels import stand_in
from nki_kernels.stand_in import NkiRuleError
from nki_kernels.stand_in import isa as nisa
from nki_kernels.stand_in import language as nl


def sb(shape, dtype=nl.float32):
    return nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)


def ps(shape, dtype=nl.float32):
    return nl.ndarray(shape, dtype=dtype, buffer=nl.psum)


def filled(shape, value=1.0, dtype=nl.float32, buffer=nl.sbuf):
    t = nl.ndarray(shape, dtype=dtype, buffer=buffer)
    t.write(np.full(shape, value, np.float32))
    return t


# ---- tile shapes and memory ---------------------------------------------------------------------
def test_oversized_partition_dim_rejected():
    with pytest.raises(NkiRuleError, match="partition dim 129"):
        sb((129, 4))
    with pytest.raises(NkiRuleError, match="partition"):
        ps((200, 8))


def test_psum_and_sbuf_capacity_per_partition():
    with pytest.raises(NkiRuleError, match="exceeds 16384"):
        ps((128, 4097))  # 16 KiB + 4 B of fp32 per partition
    with pytest.raises(NkiRuleError, match="exceeds"):
        sb((128, 64 * 1024))  # 256 KiB per partition


def test_shape_must_be_tuple_and_address_unsupported():
    with pytest.raises(NkiRuleError, match="tuple"):
        nl.ndarray([4, 4], dtype=nl.float32)
    with pytest.raises(NotImplementedError):
        nl.ndarray((4, 4), dtype=nl.float32, address=(0, 0))


def test_fresh_tiles_are_garbage():
    assert np.isnan(sb((4, 4)).arr).all()
    assert np.isnan(sb((4, 4), nl.bfloat16).arr.astype(np.float32)).all()
    assert (sb((4, 4), nl.int32).arr == 4).all()


def test_integer_index_on_partition_dim_rejected():
    t = sb((8, 8))
    with pytest.raises(NkiRuleError, match="partition dim"):
        t[0]
    with pytest.raises(NkiRuleError, match="unit-step"):
        t[0:8:2, 0:8]
    with pytest.raises(NkiRuleError, match="out of bounds"):
        t[0:9, 0:8]


# ---- storage rounding ---------------------------------------------------------------------------
def test_storage_rounds_through_ml_dtypes():
    t = sb((1, 3), nl.bfloat16)
    t.write(np.array([[1.0 + 2**-9, 3.14159, 1e-3]], np.float32))
    want = np.array([[1.0 + 2**-9, 3.14159, 1e-3]], np.float32).astype(ml_dtypes.bfloat16)
    assert (t.arr == want).all() and t.arr[0, 0] == 1.0  # RNE to bf16


def test_trn2_fp8_is_e4m3_max_240():
    t = sb((1, 3), nl.float8_e4m3)
    t.write(np.array([[240.0, 300.0, -1000.0]], np.float32))
    v = t.arr.astype(np.float32)
    assert v[0, 0] == 240.0 and np.isinf(v[0, 1]) and np.isinf(v[0, 2])


def test_int_casts_round_and_saturate():
    t = sb((1, 3), nl.uint8)
    t.write(np.array([[2.5, 300.0, -7.0]], np.float32))
    assert t.arr.tolist() == [[2, 255, 0]]


# ---- matmul -------------------------------------------------------------------------------------
def test_matmul_limits():
    with pytest.raises(NkiRuleError, match="stationary free size"):
        nisa.nc_matmul(ps((128, 8)), filled((16, 129)), filled((16, 8)))
    with pytest.raises(NkiRuleError, match="moving free size"):
        nisa.nc_matmul(ps((8, 513)), filled((16, 8)), filled((16, 513)))
    with pytest.raises(NkiRuleError, match="contraction"):
        nisa.nc_matmul(ps((8, 8)), filled((16, 8)), filled((32, 8)))


def test_matmul_operands_in_sbuf_and_result_fp32_psum():
    with pytest.raises(NkiRuleError, match="must be in SBUF"):
        nisa.nc_matmul(ps((8, 8)), filled((16, 8), buffer=nl.psum), filled((16, 8)))
    with pytest.raises(NkiRuleError, match="must be in PSUM"):
        nisa.nc_matmul(sb((8, 8)), filled((16, 8)), filled((16, 8)))
    with pytest.raises(NkiRuleError, match="float32"):  # a bf16 matmul result is gen4 only
        nisa.nc_matmul(ps((8, 8), nl.bfloat16), filled((16, 8), dtype=nl.bfloat16), filled((16, 8), dtype=nl.bfloat16))


def test_matmul_dtype_rules():
    with pytest.raises(NkiRuleError, match="fp32 only multiplies fp32"):
        nisa.nc_matmul(ps((8, 8)), filled((16, 8)), filled((16, 8), dtype=nl.bfloat16))
    with pytest.raises(NkiRuleError, match="NeuronCore-v4"):
        nisa.nc_matmul(ps((8, 8)), filled((16, 8), dtype=nl.float8_e4m3fn), filled((16, 8), dtype=nl.bfloat16))
    with pytest.raises(NkiRuleError, match="not a matmul input"):
        nisa.nc_matmul(ps((8, 8)), filled((16, 8), dtype=nl.int32), filled((16, 8), dtype=nl.int32))


def test_matmul_accumulate_semantics():
    a, b = filled((4, 2), 1.0), filled((4, 3), 2.0)  # a.T @ b = 8 everywhere
    out = ps((2, 3))
    nisa.nc_matmul(out, a, b)  # first write overwrites the NaN garbage
    nisa.nc_matmul(out, a, b)  # accumulate=None: later writes add
    assert (out.arr == 16.0).all()
    nisa.nc_matmul(out, a, b, accumulate=False)
    assert (out.arr == 8.0).all()
    nisa.nc_matmul(out, a, b, accumulate=True)
    assert (out.arr == 16.0).all()
    fresh = ps((2, 3))
    nisa.memset(fresh, 0.0)
    with pytest.raises(NkiRuleError, match="undefined"):  # accumulating onto a memset PSUM is UB on trn2
        nisa.nc_matmul(fresh, a, b, accumulate=True)
    nisa.nc_matmul(fresh, a, b)  # None after a non-matmul write: overwrite, not add
    assert (fresh.arr == 8.0).all()


# ---- data movement ------------------------------------------------------------------------------
def test_no_dma_from_or_to_psum():
    with pytest.raises(NkiRuleError, match="PSUM"):
        nisa.dma_copy(sb((4, 4)), filled((4, 4), buffer=nl.psum))
    with pytest.raises(NkiRuleError, match="PSUM"):
        nisa.dma_copy(ps((4, 4)), filled((4, 4)))


def test_dma_counts_and_hwdge_types():
    with pytest.raises(NkiRuleError, match="element counts"):
        nisa.dma_copy(sb((4, 4)), filled((4, 5)))
    with pytest.raises(NkiRuleError, match="hwdge"):
        nisa.dma_copy(sb((4, 4), nl.bfloat16), filled((4, 4)), dge_mode=nisa.dge_mode.hwdge)


def test_compute_engines_never_touch_hbm():
    hbm = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    with pytest.raises(NkiRuleError, match="SBUF or PSUM"):
        nisa.tensor_copy(sb((4, 4)), hbm)
    with pytest.raises(NkiRuleError, match="SBUF or PSUM"):
        nisa.activation(hbm, nl.exp, filled((4, 4)))


def test_transpose_rules():
    with pytest.raises(NkiRuleError, match="must equal"):
        nisa.nc_transpose(ps((4, 4), nl.bfloat16), filled((4, 4)))
    with pytest.raises(NkiRuleError, match="exceeds"):
        nisa.nc_transpose(ps((129, 4)), filled((4, 129)))
    with pytest.raises(NkiRuleError, match="Vector Engine"):
        nisa.nc_transpose(sb((64, 4)), filled((4, 64)))
    t = ps((3, 2))
    nisa.nc_transpose(t, filled((2, 3)))
    assert t.shape == (3, 2)


# ---- vector / scalar engine ---------------------------------------------------------------------
def test_tensor_tensor_not_both_psum():
    with pytest.raises(NkiRuleError, match="both be in PSUM"):
        nisa.tensor_tensor(sb((4, 4)), filled((4, 4), buffer=nl.psum), filled((4, 4), buffer=nl.psum), nl.add)


def test_reductions_on_trailing_free_axes_only():
    x = filled((4, 3, 5))
    with pytest.raises(NkiRuleError, match="trailing free axes"):
        nisa.tensor_reduce(sb((3, 5)), nl.add, x, axis=(0,))
    with pytest.raises(NkiRuleError, match="trailing free axes"):
        nisa.tensor_reduce(sb((4, 5)), nl.add, x, axis=(1,))
    out = sb((4, 3))
    nisa.tensor_reduce(out, nl.add, x, axis=(2,))
    assert (out.arr == 5.0).all()


def test_scalar_operands_are_p1_fp32():
    x = filled((4, 8))
    with pytest.raises(NkiRuleError, match=r"\[P,1\]"):
        nisa.tensor_scalar(sb((4, 8)), x, nl.multiply, filled((4, 2)))
    with pytest.raises(NkiRuleError, match="float32"):
        nisa.tensor_scalar(sb((4, 8)), x, nl.multiply, filled((4, 1), dtype=nl.bfloat16))
    with pytest.raises(NkiRuleError, match=r"\[P,1\]"):
        nisa.activation(sb((4, 8)), nl.exp, x, bias=filled((3, 1)))
    out = sb((4, 8))
    nisa.tensor_scalar(out, x, nl.multiply, filled((4, 1), 3.0), op1=nl.add, operand1=1.0)
    assert (out.arr == 4.0).all()


def test_divide_and_activation_kinds():
    with pytest.raises(NkiRuleError, match="divide"):
        nisa.tensor_tensor(sb((2, 2)), filled((2, 2)), filled((2, 2)), nl.divide)
    with pytest.raises(NkiRuleError, match="activation function"):
        nisa.activation(sb((2, 2)), nl.add, filled((2, 2)))
    with pytest.raises(NkiRuleError, match="integer data"):
        nisa.tensor_scalar(sb((2, 2)), filled((2, 2)), nl.bitwise_and, 3)  # float data


def test_activation_reduce_only_with_reset():
    out, rr = sb((2, 4)), sb((2, 1))
    nisa.activation(out, nl.exp, filled((2, 4), 0.0), reduce_op=nl.add, reduce_res=rr,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    assert (rr.arr == 4.0).all()
    with pytest.raises(NotImplementedError):
        nisa.activation(out, nl.exp, filled((2, 4)), reduce_op=nl.add, reduce_res=rr, reduce_cmd=nisa.reduce_cmd.reduce)
    with pytest.raises(NkiRuleError, match="stale"):  # idle leaves the registers alone: reduce_res reads garbage
        nisa.activation(out, nl.exp, filled((2, 4)), reduce_op=nl.add, reduce_res=rr)


def test_tensor_scalar_operator_classes():
    u8 = filled((2, 4), 7.0, dtype=nl.uint8)
    with pytest.raises(NkiRuleError, match="bitvec or both arithmetic"):
        nisa.tensor_scalar(sb((2, 4), nl.uint8), u8, nl.bitwise_and, 3, op1=nl.add, operand1=1)
    with pytest.raises(NkiRuleError, match="integer data and dst"):
        nisa.tensor_scalar(sb((2, 4)), u8, nl.bitwise_and, 3)
    with pytest.raises(NkiRuleError, match="operand1 must be None"):
        nisa.tensor_scalar(sb((2, 4)), filled((2, 4)), nl.add, 1.0, operand1=2.0)
    out = sb((2, 4), nl.uint8)
    nisa.tensor_scalar(out, u8, nl.bitwise_and, 3, op1=nl.left_shift, operand1=4)
    assert (out.arr == 48).all()


def test_memset_value_must_match_dtype():
    with pytest.raises(NkiRuleError, match="integer dtype"):
        nisa.memset(sb((2, 2), nl.int32), 1.5)


# ---- views alias storage ------------------------------------------------------------------------
def test_views_alias_storage():
    base = sb((4, 6))
    nisa.memset(base, 0.0)
    v = base.reshape((4, 2, 3))
    nisa.memset(v[0:4, 1, 0:3], 7.0)
    assert (base.arr[:, 3:] == 7.0).all() and (base.arr[:, :3] == 0.0).all()
    u8 = sb((2, 2), nl.uint8)
    nisa.memset(u8, 0x38)
    assert (u8.view(nl.float8_e4m3).arr.astype(np.float32) == 1.0).all()  # bit view, no conversion


def test_no_nested_slicing_and_reshape_of_whole_tensors_only():
    t = sb((4, 6))
    with pytest.raises(NkiRuleError, match="nested slicing"):
        t[0:4, 0:4][0:2, 0:2]
    with pytest.raises(NkiRuleError, match="nested slicing"):
        nl.ndarray((8, 6), dtype=nl.float32, buffer=nl.shared_hbm)[0:8, 0:4][0:4, 0:4]
    with pytest.raises(NkiRuleError, match="whole tensor"):
        t[0:4, 1:5].reshape((4, 2, 2))
    with pytest.raises(NkiRuleError, match="not expressible"):
        t.reshape((4, 5))
    with pytest.raises(NkiRuleError, match="partition dim"):
        t.reshape((8, 3))
    assert t.reshape((4, 2, 3))[0:4, 1, 0:3].shape == (4, 3)  # slicing a reshaped whole tensor is one level


# ---- unknown ops and kernel boundary ------------------------------------------------------------
def test_unknown_ops_raise_not_implemented():
    with pytest.raises(NotImplementedError):
        nl.softmax  # noqa: B018
    with pytest.raises(NotImplementedError):
        nisa.nc_matmul_mx  # noqa: B018
    with pytest.raises(NotImplementedError):
        nl.exp(filled((2, 2)))


def _kernel_private_output(x):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.hbm)
    nisa.dma_copy(out, x)
    return out


def _kernel_ok(x):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(t, x)
    nisa.dma_copy(out, t)
    return out


def test_outputs_must_be_shared_hbm_and_lists_rejected():
    x = np.ones((4, 4), np.float32)
    with pytest.raises(NkiRuleError, match="shared_hbm"):
        stand_in.run(_kernel_private_output, x)
    assert (stand_in.run(_kernel_ok, x) == 1.0).all()
    with pytest.raises(NkiRuleError, match="tuples"):
        stand_in.run(_kernel_ok, [1, 2])
    with pytest.raises(NkiRuleError, match="platform_target"):
        stand_in.jit(platform_target="trn2")


def test_topk_helpers_follow_the_documented_semantics():
    data = filled((1, 10), 0.0)
    data.write(np.array([[5, 1, 5, 3, 9, 0, 7, 2, 8, 4]], np.float32))
    vals = sb((1, 8))
    nisa.max8(vals, data)
    assert vals.arr.tolist() == [[9, 8, 7, 5, 5, 4, 3, 2]]
    idx = sb((1, 8), nl.uint32)
    nisa.nc_find_index8(idx, data, vals)
    assert idx.arr.tolist() == [[4, 8, 6, 0, 0, 9, 3, 7]]  # first occurrence, repeated value -> same index
    out = sb((1, 10))
    nisa.nc_match_replace8(out, data, vals, -1.0, dst_idx=idx)
    assert idx.arr.tolist() == [[4, 8, 6, 0, 2, 9, 3, 7]]  # replaced one by one: the second 5 is found next
    assert sorted(out.arr[0].tolist()) == [-1.0] * 8 + [0.0, 1.0]
