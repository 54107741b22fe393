"""MXFP4 quantize / dequantize in Triton, bit-exact with :mod:`lowbit.formats.mxfp4`.

Same integer method as the CPU kernels (lowbit.kernels.cpu.mxfp4): each element is widened exactly to
its FP32 bit pattern; a block's amax is the largest ``bits & 0x7FFFFFFF`` (>= 0x7F800000: NaN/Inf block,
scale 0xFF, codes 0); the scale byte comes from the amax's exponent and fraction fields; an element's
code counts the midpoint thresholds (FP32 bits, one table row per scale byte) its magnitude reaches.
No floating-point arithmetic touches a value, so flush-to-zero modes cannot change a result.

One program quantizes BLOCKS_PER_PROGRAM MX blocks; even and odd elements are loaded as two
(BLOCKS_PER_PROGRAM, block_size/2) tiles, so the packed byte ``lo | hi << 4`` needs no interleaving.
CUDA tensors; CPU tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lowbit.kernels import mxfp4_tables as tables
from lowbit.kernels.mxfp4_last_axis import LastAxisDequantize, LastAxisQuantize

BLOCKS_PER_PROGRAM = 64  # MX blocks per program (the tile is BLOCKS_PER_PROGRAM x block_size / 2 pairs)
MAX_TILE_ELEMENTS = 1 << 20  # Triton's limit on the elements of one tensor in a program
MAX_BLOCK_SIZE = 2 * MAX_TILE_ELEMENTS // BLOCKS_PER_PROGRAM


@functools.cache
def _fp32_thresholds(rounding: str, device: torch.device) -> torch.Tensor:
    """(256, 7) int32: FP32 bits of the smallest magnitude rounding past each midpoint, per scale byte."""
    return tables.thresholds(torch.float32, rounding).to(torch.int32).to(device)


@functools.cache
def _pair_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Flat (256 * 256) [scale byte, code byte] -> two decoded elements as one int32/int64 word."""
    return tables.dequant_pairs(dtype).to(device)


@triton.jit
def _scale_byte(amax_bits, RULE: tl.constexpr):
    """E8M0 byte from the FP32 bits of a finite amax (docs/mxfp4.md, section 'Scale rules')."""
    exponent = amax_bits >> 23
    fraction = amax_bits & 0x7FFFFF
    if RULE == 0:  # floor
        bump = tl.zeros_like(exponent)
    elif RULE == 1:  # nearest: significand >= sqrt(2)
        sig = (fraction + 0x800000).to(tl.int64)
        bump = (sig * sig >= (1 << 47)).to(tl.int32)
    elif RULE == 2:  # even: significand > 1.75
        bump = (fraction > 0x600000).to(tl.int32)
    elif RULE == 3:  # ceil: significand > 1
        bump = (fraction > 0).to(tl.int32)
    else:  # rceil: significand > 1.5
        bump = (fraction > 0x400000).to(tl.int32)
    top = 254 if RULE == 4 else 252
    byte = tl.minimum(tl.maximum(exponent - 2 + bump, 0), top)
    return tl.where(exponent == 0, 0, byte)


@triton.jit
def _codes(mag, thr_ptr, byte):
    """E2M1 magnitude codes: how many of the 7 thresholds of row ``byte`` each ``mag`` (FP32 bits) reaches."""
    code = tl.zeros_like(mag)
    for j in tl.static_range(7):
        code += (mag >= tl.load(thr_ptr + byte * 7 + j)[:, None]).to(tl.int32)
    return code


@triton.jit
def _fp32_bits(x_ptr, offs, mask, BF16_BITS: tl.constexpr):
    """FP32 bit patterns (int32) of the elements at ``offs``, widened exactly.

    BF16 arrives as int16 bit patterns and is shifted (the interpreter flushes BF16 subnormals in a float
    conversion); FP16 is converted as a float (exact); FP32 arrives as int32 bits.
    """
    raw = tl.load(x_ptr + offs, mask=mask, other=0)
    if BF16_BITS:
        return raw.to(tl.int32) << 16
    return raw.to(tl.float32).to(tl.int32, bitcast=True)


@triton.jit
def _quantize_kernel(
    x_ptr,  # *fp16 / *int16 (BF16 bits) / *fp32: n_blocks * 2 * HALF elements, blocks contiguous
    thr_ptr,  # *int32[256, 7]: threshold table for the rounding mode
    codes_ptr,  # *uint8: n_blocks * HALF packed codes (element 2i in the low nibble)
    scales_ptr,  # *uint8: n_blocks E8M0 bytes
    n_blocks,  # number of blocks
    HALF: tl.constexpr,  # block_size // 2
    HALF_POW2: tl.constexpr,  # HALF rounded up to a power of two (tile width)
    BLOCKS_PER_PROGRAM: tl.constexpr,  # MX blocks per program
    RULE: tl.constexpr,  # scale rule id (floor, nearest, even, ceil, rceil)
    BF16_BITS: tl.constexpr,  # x_ptr holds BF16 bit patterns
):
    blk = tl.program_id(0).to(tl.int64) * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)
    pair = tl.arange(0, HALF_POW2)
    inside = (blk < n_blocks)[:, None] & (pair < HALF)[None, :]
    offs = blk[:, None] * (2 * HALF) + 2 * pair[None, :]
    lo = _fp32_bits(x_ptr, offs, inside, BF16_BITS)
    hi = _fp32_bits(x_ptr, offs + 1, inside, BF16_BITS)
    mag_lo = lo & 0x7FFFFFFF
    mag_hi = hi & 0x7FFFFFFF
    amax = tl.max(tl.maximum(mag_lo, mag_hi), axis=1)
    finite = amax < 0x7F800000
    byte = tl.where(finite, _scale_byte(amax, RULE), 0)
    code_lo = _codes(mag_lo, thr_ptr, byte) | ((lo >> 28) & 8)
    code_hi = _codes(mag_hi, thr_ptr, byte) | ((hi >> 28) & 8)
    packed = tl.where(finite[:, None], code_lo | (code_hi << 4), 0)
    tl.store(codes_ptr + blk[:, None] * HALF + pair[None, :], packed.to(tl.uint8), mask=inside)
    tl.store(scales_ptr + blk, tl.where(finite, byte, 0xFF).to(tl.uint8), mask=blk < n_blocks)


@triton.jit
def _dequantize_kernel(
    codes_ptr,  # *uint8: n_blocks * HALF code bytes
    scales_ptr,  # *uint8: n_blocks E8M0 bytes
    table_ptr,  # *int32/int64[256 * 256]: two decoded elements per (scale byte, code byte)
    out_ptr,  # *int32/int64: n_blocks * HALF words of two output elements
    n_blocks,  # number of blocks
    HALF: tl.constexpr,  # block_size // 2
    HALF_POW2: tl.constexpr,  # HALF rounded up to a power of two (tile width)
    BLOCKS_PER_PROGRAM: tl.constexpr,  # MX blocks per program
):
    blk = tl.program_id(0).to(tl.int64) * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)
    pair = tl.arange(0, HALF_POW2)
    inside = (blk < n_blocks)[:, None] & (pair < HALF)[None, :]
    offs = blk[:, None] * HALF + pair[None, :]
    code = tl.load(codes_ptr + offs, mask=inside, other=0).to(tl.int32)
    scale = tl.load(scales_ptr + blk, mask=blk < n_blocks, other=0).to(tl.int32)
    tl.store(out_ptr + offs, tl.load(table_ptr + scale[:, None] * 256 + code, mask=inside), mask=inside)


def _tile_reason(block_size: int) -> str | None:
    """Why a program's tile of BLOCKS_PER_PROGRAM blocks cannot hold blocks of ``block_size`` (None: it can)."""
    if BLOCKS_PER_PROGRAM * triton.next_power_of_2(block_size // 2) > MAX_TILE_ELEMENTS:
        return f"block_size {block_size}: this kernel takes blocks of at most {MAX_BLOCK_SIZE} elements"
    return None


class Quantize(LastAxisQuantize):
    """mxfp4_quantize in Triton: contiguous FP16/BF16/FP32 ``x`` into contiguous uint8 codes and scales."""

    def supports(self, x, block_size, scale_rule, rounding, axis) -> str | None:
        return _tile_reason(block_size)

    def quantize_last_axis(self, x, block_size, scale_rule, rounding, codes, scales) -> None:
        n_blocks = scales.numel()
        if not n_blocks:
            return
        _quantize_kernel[(triton.cdiv(n_blocks, BLOCKS_PER_PROGRAM),)](
            x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
            _fp32_thresholds(rounding, x.device),
            codes,
            scales,
            n_blocks,
            HALF=block_size // 2,
            HALF_POW2=triton.next_power_of_2(block_size // 2),
            BLOCKS_PER_PROGRAM=BLOCKS_PER_PROGRAM,
            RULE=tables.RULE_ID[scale_rule],
            BF16_BITS=x.dtype == torch.bfloat16,
        )


class Dequantize(LastAxisDequantize):
    """mxfp4_dequantize in Triton: contiguous uint8 codes and scales into contiguous FP16/BF16/FP32."""

    def supports(self, codes, scales, dtype, axis) -> str | None:
        dtype = torch.bfloat16 if dtype is None else dtype
        if dtype not in tables.PAIR_WORD:
            return f"output dtype {dtype}: this kernel writes float16, bfloat16 or float32"
        n_blocks = scales.shape[axis]
        return _tile_reason(2 * codes.shape[axis] // n_blocks) if n_blocks else None

    def dequantize_last_axis(self, codes, scales, out) -> None:
        n_blocks = scales.numel()
        if not out.numel():
            return
        half = codes.numel() // n_blocks
        _dequantize_kernel[(triton.cdiv(n_blocks, BLOCKS_PER_PROGRAM),)](
            codes,
            scales,
            _pair_table(out.dtype, codes.device),
            out.view(tables.PAIR_WORD[out.dtype][0]),
            n_blocks,
            HALF=half,
            HALF_POW2=triton.next_power_of_2(half),
            BLOCKS_PER_PROGRAM=BLOCKS_PER_PROGRAM,
        )


QUANTIZE = Quantize()
DEQUANTIZE = Dequantize()
