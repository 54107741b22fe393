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

With AVX512-BW a block is one F32V and these steps are lane operations (``_e4m3_block``); elsewhere they run
as loops over per-block arrays (``_fake_quant_block``). Both are tested on the same inputs.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from lowbit.errors import DeviceError, DtypeError, ShapeError
from lowbit.formats import mxfp8 as ref
from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu._runtime import (NJIT_OPTIONS, SerialOrParallel, as_numpy, bound_njit, copy_elements,
                                         int16_array_at, runs_serially)

BLOCK = ref.BLOCK  # = simd.LANES: one block is one F32V
_BLOCKS_PER_TASK = 256
ONE_THREAD_ELEMENTS = 1 << 16  # smaller inputs: the serial kernels, on the calling thread (no thread wake-up)
_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_E4M3_MAX_BITS = 0x43E00000  # 448.0, the largest E4M3 value
_E4M3_MIN_NORMAL_BITS = 0x3C800000  # 2^-6: below it E4M3 is subnormal, a multiple of 2^-9
_SUBNORMAL_ROUNDING = np.float32(2.0**14)  # (a + 2^14) - 2^14 rounds 0 <= a < 2^14 to a multiple of 2^-9 (RNE)
_FRACTION_DROPPED = 0xFFFFF  # float32 fraction bits below E4M3's 3
_BF16_NAN = np.int16(-1)  # 0xFFFF: the BF16 NaN of torch's vectorized float32 -> BF16 cast (the reference's)
# Blocks in registers (_fake_quantize_in_registers) where the CPU has AVX512-BW: a 256 x 4096 BF16 activation in
# 0.21-0.24 ms instead of 1.35-1.41 on an AMD EPYC Zen 5 (benchmarks/results_bench_model.md); per-block arrays
# otherwise (_fake_quantize).
HAS_AVX512BW = simd.HAS_AVX512BW


# ---- one block in registers (an F32V of 32 lanes) ---------------------------------------------------------------
_LANE_INTS = ir.VectorType(ir.IntType(32), simd.LANES)


def _ints(value: int) -> ir.Constant:
    return ir.Constant(_LANE_INTS, [value - (1 << 32) if value >= 1 << 31 else value] * simd.LANES)


@intrinsic
def _largest_magnitude_bits(typingctx, block):
    """The largest magnitude bits (float32, sign cleared; NaN / Inf compare above every finite value) of an
    F32V's lanes, as int32."""

    def codegen(context, builder, sig, args):
        magnitude = builder.and_(builder.bitcast(args[0], _LANE_INTS), _ints(0x7FFFFFFF))
        reduce = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), [_LANE_INTS]),
                                                f"llvm.vector.reduce.umax.v{simd.LANES}i32")
        return builder.call(reduce, [magnitude])

    return types.int32(block), codegen


@intrinsic
def _e4m3_block(typingctx, block, down, up):
    """An F32V of a finite block's fake-quantized values: per lane ``v = x * down``, its E4M3 value (below
    2^-6 by ``(|v| + 2^14) - 2^14``, else from v's bits: 3 fraction bits kept, ties to even, saturated at 448)
    with v's sign, times ``up`` (exact). The steps of ``_fake_quant_block`` on all lanes at once."""

    def codegen(context, builder, sig, args):
        floats = args[0].type
        v = builder.fmul(args[0], simd._splat(builder, args[1], floats))
        bits = builder.bitcast(v, _LANE_INTS)
        magnitude = builder.and_(bits, _ints(0x7FFFFFFF))
        rounding = ir.Constant(floats, [float(_SUBNORMAL_ROUNDING)] * simd.LANES)
        subnormal = builder.fsub(builder.fadd(builder.bitcast(magnitude, floats), rounding), rounding)
        odd = builder.and_(builder.lshr(magnitude, _ints(20)), _ints(1))
        normal = builder.and_(builder.add(builder.add(magnitude, _ints(_FRACTION_DROPPED >> 1)), odd),
                              _ints(~_FRACTION_DROPPED & 0xFFFFFFFF))
        normal = builder.select(builder.icmp_unsigned("<", normal, _ints(_E4M3_MAX_BITS)), normal,
                                _ints(_E4M3_MAX_BITS))
        rounded = builder.select(builder.icmp_unsigned("<", magnitude, _ints(_E4M3_MIN_NORMAL_BITS)),
                                 builder.bitcast(subnormal, _LANE_INTS), normal)
        signed = builder.or_(rounded, builder.and_(bits, _ints(0x80000000)))
        return builder.fmul(builder.bitcast(signed, floats), simd._splat(builder, args[2], floats))

    return simd.F32V(block, down, up), codegen


@numba.njit(**NJIT_OPTIONS)
def _shared_exponent(largest):
    """The block's shared exponent from its largest finite magnitude bits (docs/quantize.md, "MXFP8")."""
    if largest >= 0x800000:  # a normal amax: floor(log2 amax) from its exponent field
        return min(127, max(-127, (largest >> 23) - 127 - 8))
    if largest:
        _, exponent = math.frexp(_magnitude(largest))  # floor(log2 amax) = exponent - 1
        return max(-127, exponent - 1 - 8)
    return -127


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
    shared = _shared_exponent(largest)
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


@SerialOrParallel
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
            else:  # (element copies: a slice assignment costs seconds of numba's compiling, _runtime.copy_elements)
                copy_elements(bits, 0, x_bits, at, BLOCK)
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
                copy_elements(out_bits, at, bits, 0, BLOCK)


@SerialOrParallel
def _fake_quantize_in_registers(x_bits, kind, out_bits):
    """_fake_quantize with each block in one F32V (AVX512-BW: _e4m3_block), no per-block arrays."""
    n_blocks = x_bits.size // BLOCK
    for task in numba.prange((n_blocks + _BLOCKS_PER_TASK - 1) // _BLOCKS_PER_TASK):
        for block in range(task * _BLOCKS_PER_TASK, min(n_blocks, (task + 1) * _BLOCKS_PER_TASK)):
            at = block * BLOCK
            if kind == 0:
                values = simd.bf16v_load(x_bits, at)
            elif kind == 1:
                values = simd.f16v_load(x_bits, at)
            else:
                values = simd.f32v_load(x_bits, at)
            largest = _largest_magnitude_bits(values)
            if largest >= 0x7F800000:  # NaN / Inf: the NaN scale
                nan = _BF16_NAN if kind == 0 else (np.int16(0x7E00) if kind == 1 else np.int32(0x7FC00000))
                out_bits[at : at + BLOCK] = nan
                continue
            shared = _shared_exponent(largest)
            values = _e4m3_block(values, _power_of_two(-shared), _power_of_two(shared))
            if kind == 0:
                simd.f32v_store_as_bf16(out_bits, at, values)
            elif kind == 1:
                simd.f32v_store_as_f16(out_bits, at, values)
            else:
                simd.f32v_store(out_bits, at, values)


def _bits(t: torch.Tensor) -> np.ndarray:
    """Flat int16 / int32 bit patterns of a contiguous FP16/BF16 / FP32 tensor."""
    return as_numpy(t.view(torch.int32) if t.dtype == torch.float32 else t).reshape(-1)


def _fake_quantize_at(x_address, out_address, count, kind):
    """The template of fake_quantize_small's call: ``_FAKE_QUANTIZE`` (a serial kernel above) on the ``count``
    FP16 / BF16 bit patterns at ``x_address`` into ``out_address`` (int16_array_at)."""
    x_bits = int16_array_at(x_address, 1, count).reshape(-1)
    _FAKE_QUANTIZE(x_bits, kind, int16_array_at(out_address, 1, count).reshape(-1))  # noqa: F821 (bound)


_FAKE_QUANTIZE = _fake_quantize_in_registers if HAS_AVX512BW else _fake_quantize  # this CPU's kernel
_fake_quantize_16_at = bound_njit(_fake_quantize_at, "_mxfp8_fake_quantize_at", _FAKE_QUANTIZE=_FAKE_QUANTIZE.serial)


def fake_quantize_small(x: torch.Tensor) -> torch.Tensor:
    """:func:`fake_quantize` of x in one numba call given the tensors' addresses, on the calling thread (its
    checks and views cost tens of microseconds after other work, more than a decode step's activation). Not
    checked: the caller's x is a C-contiguous, aligned FP16 / BF16 CPU tensor of at most ONE_THREAD_ELEMENTS
    elements, a multiple of 32 in its last axis."""
    out = torch.empty_like(x)
    _fake_quantize_16_at(x.data_ptr(), out.data_ptr(), x.numel(), _KIND[x.dtype])
    return out


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
        _FAKE_QUANTIZE(_bits(x), _KIND[x.dtype], _bits(out), serial=runs_serially(x.numel(), ONE_THREAD_ELEMENTS))
    return out
