"""HiFloat8 encode/decode in Triton: table look-ups, one element per lane.

Encode reads a 32768-entry table indexed by the input's magnitude bits, decode a 256-entry table indexed
by the code; both tables come from the reference (lowbit.formats.hifloat8), so the kernels are exact by
construction. CUDA tensors; CPU tensors work under TRITON_INTERPRET=1 (how the tests run them).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lowbit.backends import Kernel
from lowbit.formats import hifloat8

ELEMENTS_PER_PROGRAM = 4096


@functools.cache
def _encode_lut(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    magnitudes = torch.arange(32768, dtype=torch.int16).view(dtype)
    return hifloat8.encode(magnitudes).to(device)


@functools.cache
def _decode_lut(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return hifloat8.decode_table(dtype).view(torch.int16).to(device)


@triton.jit
def _encode_kernel(
    x_ptr,  # *int16: FP16/BF16 bit patterns, n elements
    lut_ptr,  # *uint8[32768]: unsigned code of each magnitude
    out_ptr,  # *uint8: n codes
    n,  # number of elements
    ELEMENTS: tl.constexpr,  # elements per program
):
    offs = tl.program_id(0).to(tl.int64) * ELEMENTS + tl.arange(0, ELEMENTS)
    mask = offs < n
    bits = tl.load(x_ptr + offs, mask=mask, other=0).to(tl.int32)
    code = tl.load(lut_ptr + (bits & 0x7FFF), mask=mask, other=0).to(tl.int32)
    sign = (bits >> 8) & 0x80
    code = code | tl.where((code & 0x7F) != 0, sign, 0)
    tl.store(out_ptr + offs, code.to(tl.uint8), mask=mask)


@triton.jit
def _decode_kernel(
    codes_ptr,  # *uint8: n codes
    lut_ptr,  # *int16[256]: output bit pattern of each code
    out_ptr,  # *int16: n FP16/BF16 bit patterns
    n,  # number of elements
    ELEMENTS: tl.constexpr,  # elements per program
):
    offs = tl.program_id(0).to(tl.int64) * ELEMENTS + tl.arange(0, ELEMENTS)
    mask = offs < n
    code = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    tl.store(out_ptr + offs, tl.load(lut_ptr + code, mask=mask, other=0), mask=mask)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, ELEMENTS_PER_PROGRAM),)


class Encode(Kernel):
    """encode_to_hifloat8 in Triton: contiguous FP16/BF16 ``x`` into contiguous uint8 ``out``."""

    def run(self, x: torch.Tensor, *, out: torch.Tensor) -> None:
        n = x.numel()
        lut = _encode_lut(x.dtype, x.device)
        _encode_kernel[_grid(n)](x.view(torch.int16), lut, out, n, ELEMENTS=ELEMENTS_PER_PROGRAM)


class Decode(Kernel):
    """decode_from_hifloat8 in Triton: contiguous uint8 ``codes`` into contiguous FP16/BF16 ``out``."""

    def run(self, codes: torch.Tensor, dtype: torch.dtype | None, *, out: torch.Tensor) -> None:
        n = codes.numel()
        lut = _decode_lut(out.dtype, codes.device)
        _decode_kernel[_grid(n)](codes, lut, out.view(torch.int16), n, ELEMENTS=ELEMENTS_PER_PROGRAM)


ENCODE = Encode()
DECODE = Decode()
