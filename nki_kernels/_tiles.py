"""Sub-kernels shared by the kernels (plain functions, inlined by the NKI compiler; no `@nki.jit`).

`nl`/`nisa` here are rebound together with the calling kernel (see `_nki.SUBKERNEL_MODULES`).
All tiles are passed in by the caller; helpers only issue instructions.
"""

from __future__ import annotations

from nki_kernels._nki import nisa, nl


def bcast_row(dst, row, ones):
    """dst[P, F] (SBUF fp32) = row[1, F] (SBUF fp32) repeated on every partition, via a ones-matmul.

    `ones` is an SBUF fp32 tile [1, P] holding 1.0. The PE array multiplies exactly by 1.0, so this is a copy.
    """
    num_p = dst.shape[0]
    num_f = dst.shape[1]
    for f0 in range(0, num_f, 512):
        fw = min(512, num_f - f0)
        ps = nl.ndarray((num_p, fw), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(ps, ones[0:1, 0:num_p], row[0:1, f0:f0 + fw])
        nisa.tensor_copy(dst[0:num_p, f0:f0 + fw], ps)


def load_bcast(dst, src_row, ones):
    """dst[P, F] (SBUF fp32) = HBM vector `src_row` ([1, F] view) broadcast to every partition."""
    num_f = dst.shape[1]
    row = nl.ndarray((1, num_f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(row, src_row)
    bcast_row(dst, row, ones)


def transpose_to(dst, src):
    """dst[F, P] (SBUF) = src[P, F]^T (SBUF), P, F <= 128, via the PE array into PSUM (same dtype)."""
    num_p = src.shape[0]
    num_f = src.shape[1]
    ps = nl.ndarray((num_f, num_p), dtype=src.dtype, buffer=nl.psum)
    nisa.nc_transpose(ps, src)
    nisa.tensor_copy(dst, ps)


def load_transposed(dst, src, dtype):
    """dst[K, M] (SBUF) = HBM block src[M, K]^T (M, K <= 128): contiguous DMA, then a PE transpose."""
    num_m = src.shape[0]
    num_k = src.shape[1]
    tmp = nl.ndarray((num_m, num_k), dtype=dtype, buffer=nl.sbuf)
    nisa.dma_copy(tmp, src)
    transpose_to(dst, tmp)
