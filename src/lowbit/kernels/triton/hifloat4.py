"""HiFloat4 fake-quant in Triton, bit for bit equal to :mod:`lowbit.formats.hifloat4`.

One program quantizes a tile of BLOCKS blocks x 64 elements. The tensor is seen as (outer, L, inner)
around the quant dim; block n covers the 64 elements at ``(n // inner) * 64 * inner + n % inner + i * inner``,
so any qdim is read in place. All arithmetic is fp32 in the reference's order; bf16 round-to-nearest-even
is integer arithmetic on the bits; there is no division: ``bf16(1 / sf)`` is ``2^-E * bf16(1 / (1 + m/4))``
(exact, the scaling commutes with the rounding), from a four-entry table. The one multiply-add,
``4 v + 0.5``, gives the same result fused or not because ``4 v`` is exact. Outputs are written as bit
patterns so poisoned blocks get the reference's NaN exactly; BF16 inputs are widened from their bits
(the interpreter's BF16 conversion flushes subnormals). CUDA tensors; CPU tensors work under
TRITON_INTERPRET=1 (how the tests run them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.formats import hifloat4 as ref

BLOCKS_PER_PROGRAM = 32
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@triton.jit
def _bf16(v):
    """Round finite fp32 values to bfloat16 (nearest, ties to even), kept in fp32."""
    u = v.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _repeat(v, BLOCKS: tl.constexpr, GROUPS: tl.constexpr, TIMES: tl.constexpr):
    """(BLOCKS, GROUPS) -> (BLOCKS, GROUPS * TIMES), each value repeated TIMES times in place."""
    return tl.reshape(tl.broadcast_to(v[:, :, None], (BLOCKS, GROUPS, TIMES)), (BLOCKS, GROUPS * TIMES))


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
    BLOCKS: tl.constexpr,  # blocks per program
):
    block = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    base = (block // inner) * 64 * inner + block % inner
    offs = base[:, None] + tl.arange(0, 64).to(tl.int64)[None, :] * inner  # (BLOCKS, 64)
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
    m4 = tl.max(tl.reshape(a, (BLOCKS, 16, 4)), axis=2)
    m8 = tl.max(tl.reshape(a, (BLOCKS, 8, 8)), axis=2)
    block_max = tl.max(m4, axis=1)

    # Level 1: sf1 = clamp(bf16(M * c7)); E6M2 byte = RNE(y / 32), y = bf16 bits - (127 - 48) * 128.
    sf1 = tl.minimum(tl.maximum(_bf16(block_max * 0.142578125), 2.0**-48), 49152.0)
    y = (sf1.to(tl.int32, bitcast=True) >> 16) - 79 * 128
    byte = (y + 15 + ((y >> 5) & 1)) >> 5
    mantissa = byte & 3
    exponent = (byte >> 2) - 48
    sf = (((exponent + 127) << 23) | (mantissa << 21)).to(tl.float32, bitcast=True)
    # r = bf16(1 / sf) = 2^-E * bf16(1 / (1 + m / 4)): 1, 0.80078125, 0.66796875, 0.5703125.
    reciprocal = tl.where(mantissa == 0, 1.0, tl.where(mantissa == 1, 0.80078125,
                                                       tl.where(mantissa == 2, 0.66796875, 0.5703125)))
    r = reciprocal * ((127 - exponent) << 23).to(tl.float32, bitcast=True)

    e2 = _repeat((m8 * r[:, None] >= 4.0).to(tl.int32), BLOCKS, 8, 2)  # per 4-group
    e3 = ((m4 * r[:, None]) * tl.where(e2 > 0, 0.5, 1.0) >= 2.0).to(tl.int32)
    level = _repeat(e2 + e3, BLOCKS, 16, 4)  # (BLOCKS, 64), e2 + e3 in 0..2

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


def fake_quant_into(x: torch.Tensor, qdim: int, out: torch.Tensor) -> None:
    """HiF4 fake-quant of contiguous ``x`` along ``qdim`` into contiguous ``out`` (same shape, dtype and
    device); equals :func:`lowbit.formats.hifloat4.fake_quant`. Errors as the reference's check_qdim."""
    qdim = ref.check_qdim(x, qdim)
    if x.numel() == 0:
        return
    inner = 1
    for size in x.shape[qdim + 1:]:
        inner *= size
    n_blocks = x.numel() // ref.BLOCK
    out_dtype, out_bits = _TL_DTYPES[x.dtype]
    grid = (triton.cdiv(n_blocks, BLOCKS_PER_PROGRAM),)
    bf16 = x.dtype == torch.bfloat16
    _fake_quant_kernel[grid](
        x.view(torch.int16) if bf16 else x, out.view(_INT_VIEW[x.dtype]), n_blocks, inner,
        ref.NAN_BITS[x.dtype], OUT_DTYPE=out_dtype, OUT_BITS=out_bits, WIDEN_BF16_BITS=bf16,
        BLOCKS=BLOCKS_PER_PROGRAM,
    )
