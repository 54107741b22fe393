"""SVDQuant on the CPU: the numba MXFP4 activation quantizer, the fused MXFP4 weight-only kernel, and
torch's BF16 matmuls (oneDNN) for the low-rank branch.

The quantized activation is exact in BF16 (an E2M1 value times a power of two), so the MX product
``P = deq(xq) @ deq(w)^T`` is the weight-only linear of that activation with the MXFP4 weight
(lowbit.kernels.cpu.weight_only: it reads the packed codes and scales directly, never a dense weight;
float32 sums rounded once to BF16), and L is added in BF16: ``out = bf16(L + bf16(P))`` (docs/svd_quant.md,
section 'The final add'). At decode (up to GEMV_MAX_M rows) that reads 4.25 bits per weight instead of
a BF16 copy of the whole weight per call, and the low-rank branch and the final add run in numba too
(float32 sums, each matmul's result rounded to BF16 as BF16 matmuls do; two tiny torch matmuls cost about
0.25 ms there); with more rows the weight is dequantized to BF16 once per call and multiplied by torch's
BF16 GEMM (faster there than the fused kernel's tiles), and the low-rank branch by torch.

Memory: the activation's (M, K) BF16 dequantized copy, the (N, K/32) per-block scales, and with more than
GEMV_MAX_M rows a temporary (N, K) BF16 weight; nothing is cached between calls.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from lowbit.backends import Kernel
from lowbit.formats.svd_quant import BLOCK, weight_scales
from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu import mxfp4
from lowbit.kernels.cpu._runtime import NJIT_OPTIONS, as_numpy
from lowbit.kernels.cpu.weight_only import GEMV_MAX_M, MXFP4_LINEAR

LANES = simd.LANES


@numba.njit(**NJIT_OPTIONS)
def _padded(size):
    return -(-size // LANES) * LANES


@numba.njit(**NJIT_OPTIONS)
def _widen(bits, count, out):
    """out[:count] (float32) <- the BF16 values bits[:count] (a 1-D int16 array of at least ``count``), in
    LANES-wide steps (``out`` has room for ``count`` rounded up to LANES)."""
    full = count - count % LANES
    for j in range(0, full, LANES):
        simd.f32v_store(out, j, simd.bf16v_load(bits, j))
    if full < count:
        chunk = np.zeros(LANES, dtype=np.int16)
        chunk[: count - full] = bits[full:count]
        simd.f32v_store(out, full, simd.bf16v_load(chunk, 0))


@numba.njit(**NJIT_OPTIONS)
def _store_bf16(values, count, out_bits):
    """out_bits[:count] (int16) <- float32 ``values`` rounded to BF16 (ties to even), LANES-wide steps."""
    chunk = np.zeros(LANES, dtype=np.int16)
    for j in range(0, count, LANES):
        simd.f32v_store_as_bf16(chunk, 0, simd.f32v_load(values, j))
        n = min(LANES, count - j)
        out_bits[j : j + n] = chunk[:n]


@numba.njit(**NJIT_OPTIONS)
def _add_low_rank(x, d, u, out):
    """out (M, N) BF16 bits holding P <- bf16(L + P), L = bf16(bf16(x @ d) @ u): x (M, K), d (K, R), u (R, N),
    all BF16 bits (int16); float32 sums (over k, then r, ascending), each matmul rounded to BF16 as a BF16
    matmul rounds its result."""
    m_rows, k = x.shape
    r, n = u.shape
    d32, u32 = np.zeros(_padded(k * r), np.float32), np.zeros(_padded(r * n), np.float32)
    _widen(d.reshape(-1), k * r, d32)
    _widen(u.reshape(-1), r * n, u32)
    x32, t = np.zeros(_padded(k), np.float32), np.zeros(_padded(r), np.float32)
    low, p = np.zeros(_padded(n), np.float32), np.zeros(_padded(n), np.float32)
    t_bits, low_bits = np.zeros(_padded(r), np.int16), np.zeros(_padded(n), np.int16)
    for m in range(m_rows):
        _widen(x[m], k, x32)
        t[:] = 0
        for i in range(k):
            for j in range(r):
                t[j] += x32[i] * d32[i * r + j]
        _store_bf16(t, r, t_bits)
        _widen(t_bits, r, t)
        low[:] = 0
        for i in range(r):
            for c in range(n):
                low[c] += t[i] * u32[i * n + c]
        _store_bf16(low, n, low_bits)
        _widen(low_bits, n, low)  # L
        _widen(out[m], n, p)  # P
        for c in range(n):
            p[c] += low[c]
        _store_bf16(p, n, out[m])


class SvdQuant(Kernel):
    """svd_quant on the CPU: contiguous x (B..., S, K) BF16 and the other inputs into contiguous BF16 ``out``."""

    def run(self, x, w, s, d, u, *, out) -> None:
        k, n = x.shape[-1], u.shape[1]
        x2d, out2d = x.view(-1, k), out.view(-1, n)
        x_deq = torch.empty_like(x2d)
        mxfp4.fake_quantize(x2d, BLOCK, "floor", "ta", out=x_deq)
        scales = weight_scales(s, k).contiguous()
        if x2d.shape[0] <= GEMV_MAX_M:
            MXFP4_LINEAR.run(x_deq, w, scales, None, out=out2d)
            _add_low_rank(as_numpy(x2d), as_numpy(d), as_numpy(u), as_numpy(out2d))
        else:
            w_deq = torch.empty((n, k), dtype=torch.bfloat16)
            mxfp4.DEQUANTIZE.run(w, scales, torch.bfloat16, -1, out=w_deq)
            torch.mm(x_deq, w_deq.T, out=out2d)
            out2d.add_((x2d @ d) @ u)


SVD_QUANT = SvdQuant()
