"""SVDQuant in Triton: MXFP4 activation quantization, torch BF16 low-rank matmuls, a fused MX matmul.

    xq, sx = Triton MXFP4 quantize of x (floor scale, TA)       lowbit.kernels.triton.mxfp4
    L      = (x @ d) @ u                                        torch BF16 matmuls (cuBLAS on CUDA)
    out    = bf16(L + bf16(sum_k deq(xq)[m, k] * deq(w)[n, k]))  _mx_matmul_kernel, FP32 accumulation

The MX matmul tile loop reads TILE_BYTES code bytes (2 * TILE_BYTES elements) of a row block of xq and
of w per step, decodes each nibble to its exact value times its block's scale, and accumulates
two FP32 dots (TF32 on tensor cores: exact, the decoded values have two significant bits), one over
even elements and one over odd elements, so the nibbles never need interleaving:

    acc += dot(a_even, w_even^T) + dot(a_odd, w_odd^T)    a_*: (TILE_M, TILE_BYTES), w_*: (TILE_N, TILE_BYTES)

Shapes as lowbit.ops.svd_quant: x (B..., S, K) BF16, w (N, K/2) uint8, s (N, ceil(K/64), 2) uint8,
d (K, R), u (R, N) BF16 -> (B..., S, N) BF16. CUDA tensors; CPU tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.backends import Kernel
from lowbit.formats.svd_quant import BLOCK
from lowbit.kernels.triton import mxfp4

TILE_M, TILE_N, TILE_BYTES = 32, 32, 32  # output tile (rows, columns), code bytes along K per step


@triton.jit
def _decode(code_bytes, scale_bytes, HIGH: tl.constexpr):
    """Exact value (FP32) of the low or high nibble of ``code_bytes`` times 2^(scale byte - 127)."""
    nibble = (code_bytes >> 4) if HIGH else (code_bytes & 0xF)
    e = (nibble >> 1) & 3
    m = (nibble & 1).to(tl.float32)
    power = tl.where(e == 3, 4.0, tl.where(e == 2, 2.0, 1.0))
    magnitude = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * power)
    value = tl.where((nibble & 8) != 0, -magnitude, magnitude)
    # 2^(b - 127) from bits: b << 23 for b >= 1, the subnormal 2^-127 (0x00400000) for b == 0, NaN for 0xFF
    scale_bits = tl.where(scale_bytes == 0, 0x00400000, scale_bytes << 23)
    scale = tl.where(scale_bytes == 0xFF, float("nan"), scale_bits.to(tl.float32, bitcast=True))
    return value * scale


@triton.jit
def _bf16_bits(v):
    """BF16 bit patterns (int32, low 16 bits) of FP32 ``v``, rounded to nearest even, NaN kept quiet.

    Written out because the interpreter's FP32 -> BF16 cast does not round to nearest even.
    """
    bits = v.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(is_nan, (bits >> 16) | 0x40, rounded)


@triton.jit
def _mx_matmul_kernel(
    xq_ptr,  # *uint8 (M, K/2): activation codes
    sx_ptr,  # *uint8 (M, K/32): activation scales
    w_ptr,  # *uint8 (N, K/2): weight codes
    sw_ptr,  # *uint8 (N, sw_stride): weight scales, block g of row n at n * sw_stride + g
    low_ptr,  # *bf16 (M, N): the low-rank product L
    out_ptr,  # *int16 (M, N): BF16 bits of bf16(L + bf16(P))
    M, N, K_BYTES,  # sizes; K_BYTES = K / 2
    sw_stride,  # 2 * ceil(K / 64)
    TILE_M: tl.constexpr, TILE_N: tl.constexpr, TILE_BYTES: tl.constexpr,  # tile (TILE_BYTES code bytes a step)
    BLOCK_BYTES: tl.constexpr,  # code bytes of one MX block (16: blocks of 32 elements)
):
    rows = tl.program_id(0) * TILE_M + tl.arange(0, TILE_M)
    cols = tl.program_id(1) * TILE_N + tl.arange(0, TILE_N)
    row_in = rows < M
    col_in = cols < N
    acc = tl.zeros((TILE_M, TILE_N), dtype=tl.float32)
    for k0 in range(0, K_BYTES, TILE_BYTES):
        kb = k0 + tl.arange(0, TILE_BYTES)
        k_in = kb < K_BYTES
        a_mask = row_in[:, None] & k_in[None, :]
        w_mask = col_in[:, None] & k_in[None, :]
        row_offs = rows[:, None].to(tl.int64)
        col_offs = cols[:, None].to(tl.int64)
        block = kb[None, :] // BLOCK_BYTES
        a = tl.load(xq_ptr + row_offs * K_BYTES + kb[None, :], mask=a_mask, other=0).to(tl.int32)
        sa = tl.load(sx_ptr + row_offs * (K_BYTES // BLOCK_BYTES) + block, mask=a_mask, other=127).to(tl.int32)
        b = tl.load(w_ptr + col_offs * K_BYTES + kb[None, :], mask=w_mask, other=0).to(tl.int32)
        sb = tl.load(sw_ptr + col_offs * sw_stride + block, mask=w_mask, other=127).to(tl.int32)
        a_even = _decode(a, sa, False)
        a_odd = _decode(a, sa, True)
        b_even = _decode(b, sb, False)
        b_odd = _decode(b, sb, True)
        acc += tl.dot(a_even, tl.trans(b_even))
        acc += tl.dot(a_odd, tl.trans(b_odd))
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    mask = row_in[:, None] & col_in[None, :]
    low = tl.load(low_ptr + offs, mask=mask, other=0).to(tl.float32)
    product = (_bf16_bits(acc) << 16).to(tl.float32, bitcast=True)  # bf16(P), then bf16(L + bf16(P))
    tl.store(out_ptr + offs, _bf16_bits(low + product).to(tl.int16), mask=mask)


class SvdQuant(Kernel):
    """svd_quant in Triton: contiguous x (B..., S, K) BF16 and the other inputs into contiguous BF16 ``out``."""

    def run(self, x, w, s, d, u, *, out) -> None:
        k, n = x.shape[-1], u.shape[1]
        x2d = x.view(-1, k)
        m = x2d.shape[0]
        x_codes = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
        x_scales = torch.empty((m, k // BLOCK), dtype=torch.uint8, device=x.device)
        mxfp4.QUANTIZE.run(x2d, BLOCK, "floor", "ta", -1, out=(x_codes, x_scales))
        low = ((x2d @ d) @ u).contiguous()
        if m and n:
            grid = (triton.cdiv(m, TILE_M), triton.cdiv(n, TILE_N))
            _mx_matmul_kernel[grid](
                x_codes, x_scales, w, s, low, out.view(torch.int16),
                m, n, k // 2, s.shape[1] * 2,
                TILE_M=TILE_M, TILE_N=TILE_N, TILE_BYTES=TILE_BYTES, BLOCK_BYTES=BLOCK // 2,
            )


SVD_QUANT = SvdQuant()
