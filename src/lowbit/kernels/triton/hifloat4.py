"""HiFloat4 fake-quant in Triton, bit for bit equal to :mod:`lowbit.formats.hifloat4`.

One program quantizes one tile: BLOCKS_PER_TILE quantization blocks x 64 elements. The tensor is seen as (outer, L, inner)
around the quant dim; block n covers the 64 elements at ``(n // inner) * 64 * inner + n % inner + i * inner``,
so any qdim is read in place. All arithmetic is fp32 in the reference's order; bf16 round-to-nearest-even
is integer arithmetic on the bits; there is no division: ``bf16(1 / sf)`` is ``2^-E * bf16(1 / (1 + m/4))``
(exact, the scaling commutes with the rounding), from the four-entry table ``RECIPROCAL_MANTISSA`` of
lowbit.formats.hifloat4 (docs/hifloat4.md, sections 'Format' and 'Quantization'). The one multiply-add,
``4 v + 0.5``, gives the same result fused or not because ``4 v`` is exact. Outputs are written as bit
patterns so poisoned blocks get the reference's NaN exactly; BF16 inputs are widened from their bits
(the interpreter's BF16 conversion flushes subnormals). CUDA tensors; CPU tensors work under
TRITON_INTERPRET=1 (how the tests run them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.backends import Kernel
from lowbit.dtypes import SAME_WIDTH_INT
from lowbit.formats import hifloat4 as ref

BLOCKS_PER_TILE = 32  # quantization blocks per program

# Constants of the reference, as compile-time constants of the kernel.
_C7 = tl.constexpr(ref.C7)
_SCALE_MIN = tl.constexpr(ref.SCALE_MIN)
_SCALE_MAX = tl.constexpr(ref.SCALE_MAX)
_R0, _R1, _R2, _R3 = (tl.constexpr(r) for r in ref.RECIPROCAL_MANTISSA)


@triton.jit
def _bf16(v):
    """Round finite fp32 values to bfloat16 (nearest, ties to even), kept in fp32."""
    u = v.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _repeat(v, ROWS: tl.constexpr, GROUPS: tl.constexpr, TIMES: tl.constexpr):
    """(ROWS, GROUPS) -> (ROWS, GROUPS * TIMES), each value repeated TIMES times in place."""
    return tl.reshape(tl.broadcast_to(v[:, :, None], (ROWS, GROUPS, TIMES)), (ROWS, GROUPS * TIMES))


@triton.jit
def _fake_quant_kernel(
    x_ptr,  # *fp16/fp32 input or *int16 bf16 bit patterns, contiguous
    out_ptr,  # *int16/int32 output bit patterns, contiguous
    n_blocks,  # number of 64-element blocks
    inner,  # product of the dims after the quant dim
    nan_bits,  # output bits of a poisoned element
    OUT_DTYPE: tl.constexpr,  # tl.float16 / tl.bfloat16 / tl.float32
    OUT_BITS: tl.constexpr,  # tl.int16 / tl.int32
    WIDEN_BF16_BITS: tl.constexpr,  # x_ptr holds bf16 bit patterns
    TILE: tl.constexpr,  # quantization blocks per program (BLOCKS_PER_TILE)
):
    block = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    base = (block // inner) * 64 * inner + block % inner
    offs = base[:, None] + tl.arange(0, 64).to(tl.int64)[None, :] * inner  # (TILE, 64)
    mask = (block < n_blocks)[:, None]
    if WIDEN_BF16_BITS:  # bf16 -> fp32 by shifting the bits: exact for subnormals on every target
        x = (tl.load(x_ptr + offs, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)

    # Classify on the bits (no dependence on flush-to-zero): non-finite, and negative = x < 0.
    bits = x.to(tl.int32, bitcast=True)
    magnitude_bits = bits & 0x7FFFFFFF
    finite = magnitude_bits < 0x7F800000
    negative = (bits < 0) & (magnitude_bits != 0) & finite
    poisoned = tl.max(tl.where(finite, 0, 1), axis=1) > 0
    a = tl.where(finite, magnitude_bits, 0).to(tl.float32, bitcast=True)
    m4 = tl.max(tl.reshape(a, (TILE, 16, 4)), axis=2)
    m8 = tl.max(tl.reshape(a, (TILE, 8, 8)), axis=2)
    block_max = tl.max(m4, axis=1)

    # Level 1: sf1 = clamp(bf16(M * c7)); E6M2 byte = RNE(y / 32), y = bf16 bits - (127 - 48) * 128.
    sf1 = tl.minimum(tl.maximum(_bf16(block_max * _C7), _SCALE_MIN), _SCALE_MAX)
    y = (sf1.to(tl.int32, bitcast=True) >> 16) - 79 * 128
    byte = (y + 15 + ((y >> 5) & 1)) >> 5
    mantissa = byte & 3
    exponent = (byte >> 2) - 48
    sf = (((exponent + 127) << 23) | (mantissa << 21)).to(tl.float32, bitcast=True)
    # r = bf16(1 / sf) = 2^-E * bf16(1 / (1 + m / 4)).
    reciprocal = tl.where(mantissa == 0, _R0, tl.where(mantissa == 1, _R1, tl.where(mantissa == 2, _R2, _R3)))
    r = reciprocal * ((127 - exponent) << 23).to(tl.float32, bitcast=True)

    e2 = _repeat((m8 * r[:, None] >= 4.0).to(tl.int32), TILE, 8, 2)  # per 4-group
    e3 = ((m4 * r[:, None]) * tl.where(e2 > 0, 0.5, 1.0) >= 2.0).to(tl.int32)
    level = _repeat(e2 + e3, TILE, 16, 4)  # (TILE, 64), e2 + e3 in 0..2

    v = _bf16((a * r[:, None]) * tl.where(level == 0, 1.0, tl.where(level == 1, 0.5, 0.25)))
    code = tl.minimum(tl.floor(4.0 * v + 0.5), 7.0)
    magnitude = code * tl.where(level == 0, 1.0, tl.where(level == 1, 2.0, 4.0)) * (sf * 0.25)[:, None]
    value = tl.where(negative, -magnitude, magnitude).to(OUT_DTYPE)
    bits = tl.where(poisoned[:, None], nan_bits.to(OUT_BITS), value.to(OUT_BITS, bitcast=True))
    tl.store(out_ptr + offs, bits, mask=mask)


_TL_DTYPES = {
    torch.float32: (tl.float32, tl.int32),
    torch.bfloat16: (tl.bfloat16, tl.int16),
    torch.float16: (tl.float16, tl.int16),
}


class FakeQuant(Kernel):
    """hifloat4_fake_quant in Triton: contiguous FP16/BF16/FP32 ``x`` along ``qdim`` into contiguous ``out``
    of the same shape, dtype and device (the operator validated them); equals the reference bit for bit."""

    def run(self, x: torch.Tensor, qdim: int, *, out: torch.Tensor) -> None:
        qdim %= x.dim()
        inner = 1
        for size in x.shape[qdim + 1:]:
            inner *= size
        n_blocks = x.numel() // ref.BLOCK
        out_dtype, out_bits = _TL_DTYPES[x.dtype]
        grid = (triton.cdiv(n_blocks, BLOCKS_PER_TILE),)
        bf16 = x.dtype == torch.bfloat16
        _fake_quant_kernel[grid](
            x.view(torch.int16) if bf16 else x, out.view(SAME_WIDTH_INT[x.dtype]), n_blocks, inner,
            ref.NAN_BITS[x.dtype], OUT_DTYPE=out_dtype, OUT_BITS=out_bits, WIDEN_BF16_BITS=bf16,
            TILE=BLOCKS_PER_TILE,
        )


FAKE_QUANT = FakeQuant()
