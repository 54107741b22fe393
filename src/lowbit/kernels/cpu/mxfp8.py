"""MXFP8 fake quantization on the CPU (numba): ``dequantize(*quantize(x), x.dtype)`` of
:mod:`lowbit.formats.mxfp8` in one pass, bit for bit (the activation quantizer of the W8A8 MXFP8 layers).

Per block of 32 elements along the last axis (docs/quantize.md, "MXFP8"), the reference's steps:

* amax from the magnitude bits; a NaN/Inf in the block makes the whole block NaN (the NaN scale);
* ``shared = floor(log2 amax) - 8`` from the exponent bits, clamped to [-127, 127] (-127 for a zero block);
* ``v = x * 2^-shared`` in float32 (a multiply: it may round a subnormal result, as the reference does);
* the E4M3 value of v, round to nearest even, saturating to +-448, from v's bits (below 2^-6, E4M3's
  subnormals, by a float32 addition that rounds to a multiple of 2^-9);
* that value times ``2^shared`` (exact in float32), rounded once to x's dtype (a NaN block as torch's
  vectorized cast writes it: 0xFFFF for BF16, 0x7E00 for FP16, 0x7FC00000 for FP32).
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from lowbit.errors import DeviceError, DtypeError, ShapeError
from lowbit.formats import mxfp8 as ref
from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu._runtime import NJIT_OPTIONS, PARALLEL_NJIT_OPTIONS, as_numpy, kernel_threads

BLOCK = ref.BLOCK  # = simd.LANES: one block is one F32V
_BLOCKS_PER_TASK = 256
_ONE_THREAD_ELEMENTS = 1 << 16  # smaller inputs run on one thread (waking threads costs more)
_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_E4M3_MAX_BITS = 0x43E00000  # 448.0, the largest E4M3 value
_E4M3_MIN_NORMAL_BITS = 0x3C800000  # 2^-6: below it E4M3 is subnormal, a multiple of 2^-9
_SUBNORMAL_ROUNDING = np.float32(2.0**14)  # (a + 2^14) - 2^14 rounds 0 <= a < 2^14 to a multiple of 2^-9 (RNE)
_FRACTION_DROPPED = 0xFFFFF  # float32 fraction bits below E4M3's 3
_BF16_NAN = np.int16(-1)  # 0xFFFF: the BF16 NaN of torch's vectorized float32 -> BF16 cast (the reference's)


@numba.njit(**{**NJIT_OPTIONS, "inline": "always"})
def _fake_quant_block(values, bits, subnormal):
    """values (32,) float32 in place: the block's fake-quantized values as float32 (exact); False for a
    block holding NaN/Inf (values then undefined: the caller writes NaN). ``bits`` is ``values`` viewed as
    int32, ``subnormal`` a (32,) float32 scratch."""
    largest = 0
    for i in range(BLOCK):
        largest = max(largest, bits[i] & 0x7FFFFFFF)
    if largest >= 0x7F800000:
        return False
    shared = -127
    if largest >= 0x800000:  # a normal amax: floor(log2 amax) from its exponent field
        shared = min(127, max(-127, (largest >> 23) - 127 - 8))
    elif largest:
        _, exponent = math.frexp(_magnitude(largest))  # floor(log2 amax) = exponent - 1
        shared = max(-127, exponent - 1 - 8)
    down, up = _power_of_two(-shared), _power_of_two(shared)
    for i in range(BLOCK):  # the scaled value, and its rounding on the subnormal grid
        values[i] = values[i] * down
        subnormal[i] = (abs(values[i]) + _SUBNORMAL_ROUNDING) - _SUBNORMAL_ROUNDING
    subnormal_bits = subnormal.view(np.int32)
    for i in range(BLOCK):  # E4M3 by its bits: 3 fraction bits kept, ties to even, saturated at 448
        magnitude = bits[i] & 0x7FFFFFFF
        normal = (magnitude + (_FRACTION_DROPPED >> 1) + ((magnitude >> 20) & 1)) & ~_FRACTION_DROPPED
        rounded = subnormal_bits[i] if magnitude < _E4M3_MIN_NORMAL_BITS else min(normal, _E4M3_MAX_BITS)
        bits[i] = rounded | (bits[i] & np.int32(-0x80000000))
    for i in range(BLOCK):
        values[i] = values[i] * up  # exact: an E4M3 value times 2^shared >= 2^-136
    return True


@numba.njit(**NJIT_OPTIONS)
def _power_of_two(k):
    """2^k as float32 for -127 <= k <= 127 (2^-127 is subnormal), from its bits: no libm call per block."""
    field = (k + 127) << 23 if k > -127 else 0x400000
    return np.int32(field).view(np.float32)


@numba.njit(**NJIT_OPTIONS)
def _magnitude(magnitude_bits):
    """The float64 value of a non-negative finite float32 given by its bits."""
    exponent, fraction = magnitude_bits >> 23, magnitude_bits & 0x7FFFFF
    if exponent == 0:
        return math.ldexp(fraction, -149)
    return math.ldexp(fraction + (1 << 23), exponent - 150)


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _fake_quantize(x_bits, kind, out_bits):
    """out_bits <- fake-quantized x_bits (flat arrays of the same length, a multiple of 32): int16 BF16
    (``kind`` 0) or FP16 (1) bit patterns, or int32 float32 bit patterns (2)."""
    n_blocks = x_bits.size // BLOCK
    for task in numba.prange((n_blocks + _BLOCKS_PER_TASK - 1) // _BLOCKS_PER_TASK):
        values = np.empty(BLOCK, dtype=np.float32)
        subnormal = np.empty(BLOCK, dtype=np.float32)
        bits = values.view(np.int32)
        for block in range(task * _BLOCKS_PER_TASK, min(n_blocks, (task + 1) * _BLOCKS_PER_TASK)):
            at = block * BLOCK
            if kind == 0:
                simd.f32v_store(values, 0, simd.bf16v_load(x_bits, at))
            elif kind == 1:
                simd.f32v_store(values, 0, simd.f16v_load(x_bits, at))
            else:
                bits[:] = x_bits[at : at + BLOCK]
            finite = _fake_quant_block(values, bits, subnormal)
            if not finite:
                values[:] = np.nan
            if kind == 0:
                if finite:
                    simd.f32v_store_as_bf16(out_bits, at, simd.f32v_load(values, 0))
                else:
                    out_bits[at : at + BLOCK] = _BF16_NAN
            elif kind == 1:
                simd.f32v_store_as_f16(out_bits, at, simd.f32v_load(values, 0))
            else:
                out_bits[at : at + BLOCK] = bits


def _bits(t: torch.Tensor) -> np.ndarray:
    """Flat int16 / int32 bit patterns of a contiguous FP16/BF16 / FP32 tensor."""
    return as_numpy(t.view(torch.int32) if t.dtype == torch.float32 else t).reshape(-1)


def fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """``mxfp8.dequantize(*mxfp8.quantize(x), x.dtype)`` for a CPU FP16/BF16/FP32 tensor whose last dimension
    is a multiple of 32 (any strides: a contiguous copy is read); a new contiguous tensor of x's shape and
    dtype. DtypeError / ShapeError / DeviceError otherwise."""
    if x.dtype not in _KIND:
        raise DtypeError(f"mxfp8 fake_quantize expects float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % BLOCK:
        raise ShapeError(f"mxfp8 fake_quantize needs a last dimension divisible by {BLOCK}, got shape "
                         f"{tuple(x.shape)}")
    if x.device.type != "cpu":
        raise DeviceError(f"mxfp8 fake_quantize needs a CPU tensor, got {x.device}")
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel():
        with kernel_threads(x.numel(), _ONE_THREAD_ELEMENTS):
            _fake_quantize(_bits(x), _KIND[x.dtype], _bits(out))
    return out
