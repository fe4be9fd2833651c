"""Sub-kernels shared by the kernels (plain functions, inlined by the NKI compiler; no `@nki.jit`).

`nl`/`nisa` here are rebound together with the calling kernel (see `_nki.SUBKERNEL_MODULES`).
All tiles are passed in by the caller; helpers only issue instructions. NKI >= 0.2 has no nested slicing, so a
helper that slices a tensor takes the *whole* tensor plus offsets, never a slice of it.
"""

from __future__ import annotations

from nki_kernels._nki import nisa, nl


def bcast_row(dst, row, ones):
    """dst[P, F] (whole SBUF fp32 tile) = row[1, F] (whole SBUF fp32 tile) on every partition, via a ones-matmul.

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
    """dst[P, F] (whole SBUF fp32 tile) = whole HBM tensor `src_row` [1, F] broadcast to every partition."""
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


def load_xT(xT, x, r0, tp, c0, num_k, col0, dtype):
    """xT[0:kw, kc, col0:col0+tp] = (x[r0:r0+tp, c0 + kc*128 : c0 + kc*128 + kw])^T for every 128-chunk kc of K.

    `x` is a whole 2-D HBM tensor (offsets are passed in: NKI has no nested slicing); `xT` a whole SBUF tile
    [128, >= ceil(num_k/128), >= col0+tp] of `dtype`: the contraction dim on partitions, ready to be the
    stationary (or moving) operand of `nc_matmul`. tp <= 128."""
    for kc in range((num_k + 127) // 128):
        k0 = kc * 128
        kw = min(128, num_k - k0)
        tmp = nl.ndarray((tp, kw), dtype=dtype, buffer=nl.sbuf)
        nisa.dma_copy(tmp, x[r0:r0 + tp, c0 + k0:c0 + k0 + kw])
        ps = nl.ndarray((kw, tp), dtype=dtype, buffer=nl.psum)
        nisa.nc_transpose(ps, tmp)
        nisa.tensor_copy(xT[0:kw, kc, col0:col0 + tp], ps)


def matmul_rows(ps, xT, w, k_base, num_k, n0, nw):
    """ps[tp, nw] (fresh PSUM fp32) = x @ w[k_base:k_base+num_k, n0:n0+nw], accumulating over 128-chunks of K.

    `xT` from `load_xT` (whole tile); `w` a whole 2-D HBM weight [K_total, N], K-major, same dtype class as x."""
    tp = ps.shape[0]
    for kc in range((num_k + 127) // 128):
        k0 = kc * 128
        kw = min(128, num_k - k0)
        wt = nl.ndarray((kw, nw), dtype=w.dtype, buffer=nl.sbuf)
        nisa.dma_copy(wt, w[k_base + k0:k_base + k0 + kw, n0:n0 + nw])
        nisa.nc_matmul(ps, xT[0:kw, kc, 0:tp], wt)


def expand_tile(out, t0, d0, yt, xs, post_t, comb_t):
    """mHC expand of one [tp, dw] chunk: out[t0+p, k, d0+f] = post[p,k]*yt[p,f] + sum_j comb[p, j*n+k]*xs[p,j,f].

    yt [tp, dw] (SBUF, any float dtype), xs [tp, n, dw] fp32, post_t [tp, n], comb_t [tp, n*n] fp32."""
    tp = xs.shape[0]
    num_s = xs.shape[1]
    dw = xs.shape[2]
    for k in range(num_s):
        acc = nl.ndarray((tp, dw), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(acc, yt, nl.multiply, post_t[0:tp, k:k + 1])
        for j in range(num_s):
            tmp = nl.ndarray((tp, dw), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(tmp, xs[0:tp, j, 0:dw], nl.multiply, comb_t[0:tp, j * num_s + k:j * num_s + k + 1])
            nisa.tensor_tensor(acc, acc, tmp, nl.add)
        o = nl.ndarray((tp, dw), dtype=out.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(o, acc)
        nisa.dma_copy(out[t0:t0 + tp, k:k + 1, d0:d0 + dw], o)
