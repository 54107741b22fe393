"""Weight-only linear layers in Triton, bit-exact with the reference for every M.

One program computes ``ROWS_PER_PROGRAM`` outputs of one row of x: it keeps the reference's 64 summation
lanes as a (rows, 64) float32 tile, decodes 64 weights per row and step from the packed bytes (table
look-ups and exact float32 arithmetic, as lowbit.formats.weight_only defines the weight), adds the products
(launched with ``enable_fp_fusion=False``: a multiply and an add, never an FMA), then folds the lanes
pairwise in the reference's order (docs/weight_only.md, 'Summation order'). No tensor cores: the order is
the reference's, so prefill is not fast here. CUDA tensors; CPU tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lowbit.backends import Kernel
from lowbit.formats import hifloat8, mxfp4, mxfp8
from lowbit.formats import weight_only as reference

LANES = reference.LANES
ROWS_PER_PROGRAM = 16
_MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension (programs over N)
HIFLOAT8, MXFP4, HIFLOAT4, FLOAT8_E4M3FN, MXFP8 = 0, 1, 2, 3, 4  # the FORMAT of the kernel


@functools.cache
def _table(fmt: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """float32 look-up table: HiFloat8: the 256 codes decoded to x's ``dtype``; FP8 E4M3: the 256 code values
    (MXFP8: then the 256 E8M0 scales);
    MXFP4: the 16 E2M1 values, then the 256 E8M0 scales; HiFloat4: the 16 signed quarters c/4, then the 256
    E6M2 scales (0xFF: NaN)."""
    if fmt == HIFLOAT8:
        return hifloat8.decode_table(dtype).to(torch.float32).to(device)
    if fmt == FLOAT8_E4M3FN:
        return mxfp8.e4m3_values(torch.arange(256, dtype=torch.uint8)).to(device)
    if fmt == MXFP8:
        return torch.cat([mxfp8.e4m3_values(torch.arange(256, dtype=torch.uint8)), reference.e8m0_scales()]).to(device)
    if fmt == MXFP4:
        return torch.cat([mxfp4.e2m1_values(torch.float32), reference.e8m0_scales()]).to(device)
    return torch.cat([reference.hifloat4_quarters(), reference.e6m2_scales()]).to(device)


@triton.jit
def _nibble(packed_ptr, rows, cols, mask, K):
    """4-bit code of element (row, col) of a (N, K/2) byte array (element 2i in the low nibble)."""
    byte = tl.load(packed_ptr + rows[:, None] * (K // 2) + cols[None, :] // 2, mask=mask, other=0).to(tl.int32)
    return tl.where(cols[None, :] % 2 == 1, byte >> 4, byte & 15)


@triton.jit
def _round_to(w, X_DTYPE: tl.constexpr):
    """float32 ``w`` rounded to the nearest X_DTYPE value (ties to even), as float32. BF16 by integer
    arithmetic on the bits (NaN kept): the same on a GPU and in the interpreter, whose float32 -> BF16
    cast does not round to nearest even."""
    if X_DTYPE == tl.bfloat16:
        bits = w.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(w == w, rounded.to(tl.float32, bitcast=True), w)
    return w.to(tl.float16).to(tl.float32)


@triton.jit
def _weights(a_ptr, b_ptr, table_ptr, rows, cols, K, FORMAT: tl.constexpr, X_DTYPE: tl.constexpr):
    """float32 weights (rows, 64) of columns ``cols``; columns >= K are +0.0."""
    mask = (cols < K)[None, :]
    if FORMAT == 0 or FORMAT == 3:  # HiFloat8 (scale b rounded to x's dtype) or FP8: a = codes (N, K), b (N,)
        codes = tl.load(a_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0).to(tl.int32)
        w = _round_to(tl.load(table_ptr + codes) * tl.load(b_ptr + rows)[:, None], X_DTYPE)
    elif FORMAT == 4:  # MXFP8: a = codes (N, K), b = scales (N, K/32); product rounded to x's dtype
        codes = tl.load(a_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0).to(tl.int32)
        scale_byte = tl.load(b_ptr + rows[:, None] * (K // 32) + cols[None, :] // 32, mask=mask, other=127)
        w = _round_to(tl.load(table_ptr + codes) * tl.load(table_ptr + 256 + scale_byte.to(tl.int32)), X_DTYPE)
    elif FORMAT == 1:  # MXFP4: a = codes (N, K/2), b = scales (N, K/32)
        value = tl.load(table_ptr + _nibble(a_ptr, rows, cols, mask, K))
        scale_byte = tl.load(b_ptr + rows[:, None] * (K // 32) + cols[None, :] // 32, mask=mask, other=127)
        w = value * tl.load(table_ptr + 16 + scale_byte.to(tl.int32))
    else:  # HiFloat4: a = scale (N, K/64, 4), b = value (N, K/2)
        quarter = tl.load(table_ptr + _nibble(b_ptr, rows, cols, mask, K))
        word = (rows[:, None] * (K // 64) + cols[None, :] // 64) * 4
        scale = tl.load(table_ptr + 16 + tl.load(a_ptr + word, mask=mask, other=0).to(tl.int32))
        e2 = tl.load(a_ptr + word + 1, mask=mask, other=0).to(tl.int32)
        e3 = tl.load(a_ptr + word + 2 + (cols[None, :] % 64) // 32, mask=mask, other=0).to(tl.int32)
        level = ((e2 >> (7 - (cols[None, :] % 64) // 8)) & 1) + ((e3 >> (7 - (cols[None, :] % 32) // 4)) & 1)
        w = (quarter * scale) * ((level + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(mask, w, 0.0)


@triton.jit
def _fold(acc, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """(ROWS, WIDTH) -> (ROWS, WIDTH / 2): lane i plus lane i + WIDTH / 2."""
    pairs = tl.permute(tl.reshape(acc, (ROWS, 2, WIDTH // 2)), (0, 2, 1))
    low, high = tl.split(pairs)
    return low + high


@triton.jit
def _linear_kernel(
    x_ptr,  # *float32 (M, KP): x, zero-padded to KP = K rounded up to 64
    a_ptr,  # the format's first weight tensor (see _weights)
    b_ptr,  # its second
    table_ptr,  # *float32: the format's table (_table)
    y_ptr,  # *float32 (M, N): the sums
    N, K, KP,
    FORMAT: tl.constexpr,
    X_DTYPE: tl.constexpr,  # x's dtype (HiFloat8 weights are rounded to it)
    ROWS: tl.constexpr,  # outputs per program
    LANES: tl.constexpr,  # 64
):
    m = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    valid = rows < N
    rows = tl.where(valid, rows, 0).to(tl.int64)
    acc = tl.zeros((ROWS, LANES), dtype=tl.float32)
    for k0 in range(0, KP, LANES):
        cols = k0 + tl.arange(0, LANES)
        x = tl.load(x_ptr + m * KP + cols)
        acc = acc + x[None, :] * _weights(a_ptr, b_ptr, table_ptr, rows, cols, K, FORMAT, X_DTYPE)
    acc = _fold(acc, ROWS, 64)
    acc = _fold(acc, ROWS, 32)
    acc = _fold(acc, ROWS, 16)
    acc = _fold(acc, ROWS, 8)
    acc = _fold(acc, ROWS, 4)
    acc = _fold(acc, ROWS, 2)
    tl.store(y_ptr + m * N + rows, tl.reshape(acc, (ROWS,)), mask=valid)


class TritonLinear(Kernel):
    """One format's kernel: ``run(x, a, b, bias, out=)`` with x (..., K) FP16/BF16, the format's two weight
    tensors (see _weights), bias (N,) or None, out (..., N) in x's dtype."""

    def __init__(self, fmt: int):
        self.format = fmt

    def supports(self, x, a, b, bias):
        programs = triton.cdiv(a.shape[0], ROWS_PER_PROGRAM)
        if programs > _MAX_GRID_Y:
            return f"N = {a.shape[0]}: this kernel takes at most {_MAX_GRID_Y * ROWS_PER_PROGRAM} output features"
        return None

    def run(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias, *, out: torch.Tensor) -> None:
        k, n = x.shape[-1], out.shape[-1]
        m = out.numel() // n
        kp = -(-k // LANES) * LANES
        x32 = torch.zeros(m, kp, dtype=torch.float32, device=x.device)
        x32[:, :k] = x.reshape(m, k)
        y32 = torch.empty(m, n, dtype=torch.float32, device=x.device)
        if self.format == HIFLOAT8:
            b = b.to(x.dtype).to(torch.float32)  # the row scale in x's dtype
        grid = (m, triton.cdiv(n, ROWS_PER_PROGRAM))
        x_dtype = tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16
        _linear_kernel[grid](x32, a, b, _table(self.format, x.device, x.dtype), y32, n, k, kp, FORMAT=self.format,
                             X_DTYPE=x_dtype, ROWS=ROWS_PER_PROGRAM, LANES=LANES, enable_fp_fusion=False)
        out.view(m, n).copy_(reference.finish(y32, bias, out.dtype))


HIFLOAT8_LINEAR = TritonLinear(HIFLOAT8)
FLOAT8_E4M3FN_LINEAR = TritonLinear(FLOAT8_E4M3FN)
MXFP8_LINEAR = TritonLinear(MXFP8)
MXFP4_LINEAR = TritonLinear(MXFP4)
HIFLOAT4_LINEAR = TritonLinear(HIFLOAT4)
