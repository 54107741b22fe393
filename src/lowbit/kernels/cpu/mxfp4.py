"""numba MXFP4 quantize / dequantize, bit-exact with :mod:`lowbit.formats.mxfp4`.

Quantize works on the integer bit patterns of the input, never on rounded floats:

* block amax = max of ``bits & abs_mask`` (magnitudes of one float type order like their bit patterns);
  ``amax >= nonfinite_bits`` means the block holds a NaN or Inf -> scale 0xFF, codes 0;
* the amax is widened to FP32 bits (a 32K-entry table for FP16/BF16) and the scale byte is
  ``E - 2 + bump(M)`` from its exponent field E and fraction M (0 when E == 0), clamped (module rules);
* each element's code is the number of E2M1 midpoints it passes: ``sum_j |bits| >= thr[byte, j]`` where
  ``thr[byte, j]`` is the smallest magnitude (as bits of the input type) that rounds past midpoint j at
  that scale (lowbit.kernels.mxfp4_tables, exact per input dtype and rounding mode), plus the sign.

FP16 / BF16 in blocks of 32 (MX's block size) take a vector path (_quantize_range16): one block is one
32-lane vector of bit patterns, its scale byte a table entry indexed by its amax bits
(tables.scale_bytes), each element's threshold count a binary search with vpermw on AVX512-BW CPUs (else
seven vector compares), and lane pairs packed into code bytes. Otherwise the input is read as words of
two elements (element 2i in the low half), which is exactly one output code byte. Work is split into
tasks of _BLOCKS_PER_TASK blocks, each running a few passes over L1/L2-resident scratch (see
quantize_task). Dequantize gathers both elements of a code byte at once from
a (scale byte, code byte) table built by the reference; :func:`fake_quantize` does both in one pass, for
FP16 / BF16 blocks of 32 on AVX512-BW CPUs in registers (:func:`fake_quantize_into`: each element's value
looked up by its threshold count in the scale's row of values, no codes written).
Scale rules and element rounding: docs/mxfp4.md, sections 'Scale rules' and 'Element rounding'.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from lowbit.errors import DeviceError, DtypeError, ShapeError
from lowbit.formats import mxfp4 as ref
from lowbit.kernels import mxfp4_tables as tables
from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu._runtime import (NJIT_OPTIONS, PARALLEL_NJIT_OPTIONS, as_numpy, bound_njit, int16_array_at,
                                         run_tasks, runs_serially)
from lowbit.kernels.mxfp4_last_axis import LastAxisDequantize, LastAxisQuantize

_ABS_MASK = {torch.bfloat16: 0x7FFF, torch.float16: 0x7FFF, torch.float32: 0x7FFFFFFF}
_NONFINITE_BITS = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.float32: 0x7F800000}
_PAIRS = tables.PAIR_WORD  # input dtype -> (torch dtype of two elements, bits per element)
_UNSIGNED = {torch.int32: np.uint32, torch.int64: np.uint64}
_ELEMENT_UNSIGNED = {16: np.uint16, 32: np.uint32}
_BLOCKS_PER_TASK = 256


@functools.cache
def _amax_to_fp32_bits(dtype: torch.dtype) -> np.ndarray:
    """FP32 bit pattern of every non-negative 16-bit pattern of ``dtype``; empty for FP32 (identity)."""
    if dtype == torch.float32:
        return np.zeros(0, dtype=np.int32)
    patterns = torch.arange(0x8000, dtype=torch.int32).to(torch.int16).view(dtype)
    return patterns.float().view(torch.int32).numpy().copy()


@functools.cache
def _thresholds(dtype: torch.dtype, rounding: str) -> np.ndarray:
    """tables.thresholds as unsigned words of the element width (uint16 for FP16/BF16, uint32 for FP32)."""
    return tables.thresholds(dtype, rounding).numpy().astype(_ELEMENT_UNSIGNED[_PAIRS[dtype][1]])


@functools.cache
def _padded_thresholds(dtype: torch.dtype, rounding: str) -> np.ndarray:
    """(256, 8) uint16: _thresholds of an FP16 / BF16 dtype and a last column 0xFFFF, which no magnitude
    (at most 0x7FFF) reaches: rows of eight words, one vector load each."""
    return np.pad(_thresholds(dtype, rounding), ((0, 0), (0, 1)), constant_values=0xFFFF)


@functools.cache
def _scale_bytes(dtype: torch.dtype, scale_rule: str) -> np.ndarray:
    """tables.scale_bytes as a numpy array."""
    return tables.scale_bytes(dtype, scale_rule).numpy()


@functools.cache
def _dequant_pair_table(dtype: torch.dtype) -> np.ndarray:
    """tables.dequant_pairs as unsigned words."""
    return tables.dequant_pairs(dtype).numpy().view(_UNSIGNED[_PAIRS[dtype][0]])


@numba.njit(**NJIT_OPTIONS)
def _scale_byte(amax_fp32_bits, rule):
    """E8M0 byte of a finite block from the FP32 bits of its amax (docs/mxfp4.md, section 'Scale rules')."""
    exponent = amax_fp32_bits >> 23
    fraction = amax_fp32_bits & 0x7FFFFF
    if exponent == 0:  # zero or FP32-subnormal amax: shared exponent below -127
        return 0
    bump = 0
    if rule == 1:  # nearest: significand >= sqrt(2)
        bump = 1 if (0x800000 + fraction) ** 2 >= (1 << 47) else 0
    elif rule == 2:  # even: significand > 1.75
        bump = 1 if fraction > 0x600000 else 0
    elif rule == 3:  # ceil: significand > 1
        bump = 1 if fraction > 0 else 0
    elif rule == 4:  # rceil: significand > 1.5
        bump = 1 if fraction > 0x400000 else 0
    return min(max(exponent - 2 + bump, 0), 254 if rule == 4 else 252)


@numba.njit(**NJIT_OPTIONS)
def quantize_task(
    pairs, width, abs_mask, element_abs_mask, nonfinite_bits, to_fp32, rule, thr, ppb, codes, scales,
    lo, hi, mag,
):
    """Quantize one run of whole blocks of ``2 * ppb`` elements (``ppb`` pairs per block).

    pairs: (ppb * nb,) uint32 (two FP16/BF16 patterns) or uint64 (two FP32 patterns), element 2i in the
    low half; abs_mask: magnitude mask in the pair type, element_abs_mask: (1,) the same in the element
    type; codes: (ppb * nb,) uint8; scales: (nb,) uint8; lo, hi, mag: (ppb * nb,) scratch of the element
    type (uint16 / uint32). Every pass is a loop over contiguous arrays that LLVM vectorizes:
    1. split each pair into its elements lo[i], hi[i] and the larger magnitude mag[i];
    2. reduce mag to one amax per block (halving the list when ppb is a power of two);
    3. scale bytes from the amaxes;
    4. per block, count the thresholds each element's magnitude reaches, add the sign, pack two codes
       (thresholds from the block's row of the table: exact for every scale byte and input dtype).
    """
    nb = scales.size
    n = pairs.size
    for i in range(n):
        w = pairs[i]
        lo[i] = w
        hi[i] = w >> width
        mag[i] = max(w & abs_mask, (w >> width) & abs_mask)
    if ppb & (ppb - 1) == 0:
        while n > nb:
            n //= 2
            for i in range(n):
                mag[i] = max(mag[2 * i], mag[2 * i + 1])
    else:
        for b in range(nb):
            amax = mag[b * ppb]
            for i in range(b * ppb + 1, (b + 1) * ppb):
                amax = max(amax, mag[i])
            mag[b] = amax
    for b in range(nb):
        amax = mag[b]
        if amax >= nonfinite_bits:
            scales[b] = 0xFF
        else:
            scales[b] = _scale_byte(np.int64(to_fp32[amax]) if to_fp32.size else np.int64(amax), rule)
    mask = element_abs_mask[0]
    for b in range(nb):
        byte = scales[b]
        if ppb != 16 or byte == 0xFF:
            _encode_block(lo, hi, codes, b * ppb, (b + 1) * ppb, thr, byte, mask)
            continue
        # MX blocks of 32, written out here: a literal trip count and no call (which would add array
        # reference counting per block) let LLVM turn this into straight 16-lane vector code.
        t0, t1, t2, t3 = thr[byte, 0], thr[byte, 1], thr[byte, 2], thr[byte, 3]
        t4, t5, t6 = thr[byte, 4], thr[byte, 5], thr[byte, 6]
        start = np.uint64(b) * np.uint64(16)  # unsigned indices: no wrap-around checks
        for i in range(start, start + np.uint64(16)):
            e = lo[i]
            a = e & mask
            c_lo = (
                (a >= t0) + np.uint8(a >= t1) + np.uint8(a >= t2) + np.uint8(a >= t3)
                + np.uint8(a >= t4) + np.uint8(a >= t5) + np.uint8(a >= t6)
            )
            s_lo = np.uint8(e > mask) * np.uint8(8)  # above the magnitude mask: sign bit set
            e = hi[i]
            a = e & mask
            c_hi = (
                (a >= t0) + np.uint8(a >= t1) + np.uint8(a >= t2) + np.uint8(a >= t3)
                + np.uint8(a >= t4) + np.uint8(a >= t5) + np.uint8(a >= t6)
            )
            s_hi = np.uint8(e > mask) * np.uint8(8)
            codes[i] = np.uint8(c_lo) | s_lo | ((np.uint8(c_hi) | s_hi) << np.uint8(4))


@numba.njit(**NJIT_OPTIONS)
def _encode_block(lo, hi, codes, start, stop, thr, byte, mask):
    """codes[i] for i in [start, stop) from the threshold row of ``byte`` (0xFF: NaN/Inf block, codes 0).

    The general path (any block size); blocks of 32 (FP32 input here) take the unrolled loop in quantize_task.
    """
    if byte == 0xFF:
        for i in range(start, stop):
            codes[i] = 0
        return
    for i in range(start, stop):
        c_lo = 8 if lo[i] > mask else 0
        c_hi = 8 if hi[i] > mask else 0
        for j in range(7):
            c_lo += (lo[i] & mask) >= thr[byte, j]
            c_hi += (hi[i] & mask) >= thr[byte, j]
        codes[i] = c_lo | (c_hi << 4)


@numba.njit(**NJIT_OPTIONS)
def _quantize_range(
    pairs, width, abs_mask, element_abs_mask, nonfinite_bits, to_fp32, rule, thr, ppb, codes, scales,
    table, first_block, end_block, out_pairs,
):
    """Quantize blocks first_block .. end_block - 1 (``ppb`` pairs each), _BLOCKS_PER_TASK at a time.

    With a non-empty ``table`` (see _dequantize_task) each task also decodes its blocks into
    ``out_pairs``: quantize-dequantize in one pass over memory.
    """
    for first in range(first_block, end_block, _BLOCKS_PER_TASK):
        stop = min(end_block, first + _BLOCKS_PER_TASK)
        size = ppb * (stop - first)
        lo = np.empty(size, dtype=thr.dtype)
        hi = np.empty(size, dtype=thr.dtype)
        mag = np.empty(size, dtype=thr.dtype)
        task_codes = codes[ppb * first : ppb * stop]
        quantize_task(
            pairs[ppb * first : ppb * stop], width, abs_mask, element_abs_mask, nonfinite_bits, to_fp32,
            rule, thr, ppb, task_codes, scales[first:stop], lo, hi, mag,
        )
        if table.size:
            _dequantize_task(task_codes, scales[first:stop], table, ppb, out_pairs[ppb * first : ppb * stop])


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _quantize_blocks(
    pairs, width, abs_mask, element_abs_mask, nonfinite_bits, to_fp32, rule, thr, ppb, codes, scales,
    table, out_pairs,
):
    """Every block, as _quantize_range, in parallel tasks of _BLOCKS_PER_TASK blocks."""
    n_blocks = scales.size
    for task in numba.prange((n_blocks + _BLOCKS_PER_TASK - 1) // _BLOCKS_PER_TASK):
        _quantize_range(pairs, width, abs_mask, element_abs_mask, nonfinite_bits, to_fp32, rule, thr, ppb, codes,
                        scales, table, task * _BLOCKS_PER_TASK, min(n_blocks, (task + 1) * _BLOCKS_PER_TASK),
                        out_pairs)


# ---- FP16 / BF16 in blocks of 32 (MX's block size): one 32-lane vector per block ----------------------------
_BLOCK32 = 32
_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_V32xI16 = ir.VectorType(_I16, _BLOCK32)
_V16xI32 = ir.VectorType(_I32, _BLOCK32 // 2)


def _is_c_array(value, dtype, ndim: int) -> bool:
    return isinstance(value, types.Array) and value.dtype == dtype and value.ndim == ndim and value.layout == "C"


def _load_block16(context, builder, sig, args):
    """(the 32 elements at ``elems[index]``, their magnitudes ``& mask``) as <32 x i16>; args (elems, index,
    mask, ...)."""
    index = context.cast(builder, args[1], sig.args[1], types.intp)
    elements = builder.load(simd._element_ptr(context, builder, sig.args[0], args[0], index, _V32xI16), align=2)
    return elements, builder.and_(elements, simd._splat(builder, args[2], _V32xI16))


@intrinsic
def _block_amax16(typingctx, elems, index, mask):
    """max over i < 32 of ``elems[index + i] & mask`` (uint16; ``elems`` 1-D C-contiguous uint16, no bounds
    check): the block's largest magnitude as bits."""
    if not (_is_c_array(elems, types.uint16, 1) and isinstance(index, types.Integer) and mask == types.uint16):
        return None

    def codegen(context, builder, sig, args):
        _, v = _load_block16(context, builder, sig, args)
        width = _BLOCK32
        while width > 1:  # halves compared lane by lane, down to one lane
            width //= 2
            half = ir.VectorType(_I16, width)
            lanes = ir.VectorType(_I32, width)
            low = builder.shuffle_vector(v, v, ir.Constant(lanes, list(range(width))))
            high = builder.shuffle_vector(v, v, ir.Constant(lanes, list(range(width, 2 * width))))
            umax = builder.module.declare_intrinsic(f"llvm.umax.v{width}i16", fnty=ir.FunctionType(half, [half, half]))
            v = builder.call(umax, [low, high])
        return builder.extract_element(v, ir.Constant(_I32, 0))

    return types.uint16(elems, index, mask), codegen


_ROW = 8  # words per row of _padded_thresholds: the seven thresholds and a sentinel no magnitude reaches


def _count_by_compares(builder, magnitudes, row_words):
    """Per lane, the number of the seven thresholds (``row_words``, <8 x i16>) that ``magnitudes`` reach:
    seven compares and adds (any CPU)."""
    count = ir.Constant(_V32xI16, [0] * _BLOCK32)
    for j in range(len(ref.E2M1_MIDPOINTS)):
        threshold = builder.shuffle_vector(row_words, row_words, ir.Constant(ir.VectorType(_I32, _BLOCK32), [j] * _BLOCK32))
        count = builder.add(count, builder.zext(builder.icmp_unsigned(">=", magnitudes, threshold), _V32xI16))
    return count


def _count_by_search(builder, magnitudes, row_words):
    """The same count as _count_by_compares by a binary search over the sorted thresholds: per lane, steps of
    4, 2 and 1 compare against the threshold that vpermw picks for the lane (AVX512-BW)."""
    vpermw = simd.vpermw(builder)
    lanes = ir.VectorType(_I32, _BLOCK32)
    thresholds = builder.shuffle_vector(row_words, row_words, ir.Constant(lanes, [i % _ROW for i in range(_BLOCK32)]))
    zero = ir.Constant(_V32xI16, [0] * _BLOCK32)

    def splat(value):
        return ir.Constant(_V32xI16, [value] * _BLOCK32)

    third = builder.shuffle_vector(row_words, row_words, ir.Constant(lanes, [3] * _BLOCK32))
    count = builder.select(builder.icmp_unsigned(">=", magnitudes, third), splat(4), zero)
    for step in (2, 1):  # compare with threshold count + step - 1: passed means at least count + step passed
        threshold = builder.call(vpermw, [thresholds, builder.add(count, splat(step - 1))])
        count = builder.add(count, builder.select(builder.icmp_unsigned(">=", magnitudes, threshold), splat(step), zero))
    return count


def _make_store_block_codes16(count_reached):
    """An intrinsic ``(elems, index, mask, thr, byte, codes, code_index)`` that stores the 16 code bytes of the
    finite block ``elems[index : index + 32]`` under scale byte ``byte`` at ``codes[code_index]`` (no bounds
    checks): per element the number of thresholds ``thr[byte, :7]`` (_padded_thresholds: (256, 8) uint16,
    C-contiguous) its magnitude reaches, counted by ``count_reached``, plus 8 for a set sign bit; element 2i
    in the low nibble."""

    @intrinsic
    def store_block_codes16(typingctx, elems, index, mask, thr, byte, codes, code_index):
        if not (_is_c_array(elems, types.uint16, 1) and mask == types.uint16 and _is_c_array(thr, types.uint16, 2)
                and isinstance(byte, types.Integer) and _is_c_array(codes, types.uint8, 1)):
            return None

        def codegen(context, builder, sig, args):
            elements, magnitudes = _load_block16(context, builder, sig, args)
            table = context.make_array(sig.args[3])(context, builder, args[3]).data
            byte = context.cast(builder, args[4], sig.args[4], types.intp)
            row = builder.mul(byte, ir.Constant(ir.IntType(64), _ROW))
            row_type = ir.VectorType(_I16, _ROW)
            row_words = builder.load(builder.bitcast(builder.gep(table, [row]), row_type.as_pointer()), align=2)
            count = count_reached(builder, magnitudes, row_words)
            sign = builder.shl(builder.lshr(elements, ir.Constant(_V32xI16, [15] * _BLOCK32)),
                               ir.Constant(_V32xI16, [3] * _BLOCK32))
            pairs = builder.bitcast(builder.or_(count, sign), _V16xI32)  # element 2i in the low half
            packed = builder.or_(builder.and_(pairs, ir.Constant(_V16xI32, [0xF] * 16)),
                                 builder.shl(builder.lshr(pairs, ir.Constant(_V16xI32, [16] * 16)),
                                             ir.Constant(_V16xI32, [4] * 16)))
            byte_vector = ir.VectorType(_I8, 16)
            at = simd._element_ptr(context, builder, sig.args[5], args[5],
                                   context.cast(builder, args[6], sig.args[6], types.intp), byte_vector)
            builder.store(builder.trunc(packed, byte_vector), at, align=1)
            return context.get_dummy_value()

        return types.void(elems, index, mask, thr, byte, codes, code_index), codegen

    return store_block_codes16


_store_block_codes16_compares = _make_store_block_codes16(_count_by_compares)
_store_block_codes16_search = _make_store_block_codes16(_count_by_search)
_store_block_codes16 = _store_block_codes16_search if simd.HAS_AVX512BW else _store_block_codes16_compares


@functools.cache
def _block_values(dtype: torch.dtype) -> np.ndarray:
    """(256, 8) uint16: [scale byte, code 0..7] -> the bits of that E2M1 magnitude times the scale in ``dtype``
    (FP16 / BF16), as the reference dequantizes it (row 0xFF: its NaN); a negative code's value is the same
    with the sign bit set (checked here)."""
    pairs = _dequant_pair_table(dtype).reshape(256, 256)
    values = (pairs[:, :16] & 0xFFFF).astype(np.uint16)
    finite = np.arange(256) != 0xFF
    assert (values[finite, 8:] == (values[finite, :8] | 0x8000)).all()
    assert (values[0xFF] == values[0xFF, 0]).all()  # a NaN block: one NaN, whatever the count
    return np.ascontiguousarray(values[:, :8])


def _make_store_block_values16(count_reached):
    """An intrinsic ``(elems, index, mask, thr, byte, values, out, out_index)`` that stores the 32 dequantized
    elements of the block ``elems[index : index + 32]`` under scale byte ``byte`` at ``out[out_index]`` (no
    bounds checks): per element the number of thresholds ``thr[byte, :7]`` its magnitude reaches, counted by
    ``count_reached``, looked up in the row ``values[byte]`` (_block_values) by vpermw, and its sign bit but
    under byte 0xFF (a NaN block: the row's one NaN): the bits of quantize then dequantize in one register
    (AVX512-BW)."""

    @intrinsic
    def store_block_values16(typingctx, elems, index, mask, thr, byte, values, out, out_index):
        if not (_is_c_array(elems, types.uint16, 1) and mask == types.uint16 and _is_c_array(thr, types.uint16, 2)
                and isinstance(byte, types.Integer) and _is_c_array(values, types.uint16, 2)
                and _is_c_array(out, types.uint16, 1)):
            return None

        def codegen(context, builder, sig, args):
            elements, magnitudes = _load_block16(context, builder, sig, args)
            byte = context.cast(builder, args[4], sig.args[4], types.intp)
            row = builder.mul(byte, ir.Constant(ir.IntType(64), _ROW))
            row_type = ir.VectorType(_I16, _ROW)

            def row_of(table_index):
                table = context.make_array(sig.args[table_index])(context, builder, args[table_index]).data
                return builder.load(builder.bitcast(builder.gep(table, [row]), row_type.as_pointer()), align=2)

            count = count_reached(builder, magnitudes, row_of(3))
            lanes = ir.VectorType(_I32, _BLOCK32)
            value_row = row_of(5)
            repeated = ir.Constant(lanes, [i % _ROW for i in range(_BLOCK32)])
            table = builder.shuffle_vector(value_row, value_row, repeated)
            picked = builder.call(simd.vpermw(builder), [table, count])
            nan_block = builder.icmp_signed("==", byte, ir.Constant(byte.type, 0xFF))
            sign_bit = builder.select(nan_block, ir.Constant(_I16, 0), ir.Constant(_I16, -0x8000))
            signed = builder.or_(picked, builder.and_(elements, simd._splat(builder, sign_bit, _V32xI16)))
            at = simd._element_ptr(context, builder, sig.args[6], args[6],
                                   context.cast(builder, args[7], sig.args[7], types.intp), _V32xI16)
            builder.store(signed, at, align=2)
            return context.get_dummy_value()

        return types.void(elems, index, mask, thr, byte, values, out, out_index), codegen

    return store_block_values16


_store_block_values16 = _make_store_block_values16(_count_by_search)


# A block prefetches the input 16 blocks on (1 KiB of FP16 / BF16): on an Intel Xeon the 64M quantize took
# 16.8-18.6 ms without, 7.7-8.0 ms with (benchmarks/results_mxfp4.md, 'Intel Xeon').
_PREFETCH_ELEMENTS = 16 * _BLOCK32


@numba.njit(**NJIT_OPTIONS)
def _quantize_range16(elems, mask, scale_of, thr, codes, scales, table, first_block, end_block, out_pairs):
    """Quantize blocks first_block .. end_block - 1 of 32 FP16 / BF16 elements: ``elems`` (32 * blocks,)
    uint16 bit patterns, ``mask`` their magnitude mask (uint16), ``scale_of`` tables.scale_bytes, ``thr``
    _padded_thresholds; codes (16 * blocks,) and scales (blocks,) uint8; with a non-empty ``table`` also their
    decoded pairs into ``out_pairs`` (see _quantize_range). The bits of quantize_task, a block per vector."""
    for b in range(np.uint64(first_block), np.uint64(end_block)):  # unsigned: no negative-index wrapping
        start = np.uint64(_BLOCK32) * b
        simd.prefetch_span(elems, start + np.uint64(_PREFETCH_ELEMENTS), _BLOCK32)
        byte = scale_of[_block_amax16(elems, start, mask)]
        scales[b] = byte
        if byte == 0xFF:  # a NaN or Inf in the block
            for i in range(start // np.uint64(2), start // np.uint64(2) + np.uint64(16)):
                codes[i] = 0
        else:
            _store_block_codes16(elems, start, mask, thr, byte, codes, start // np.uint64(2))
    if table.size:
        # np.int64: a literal 16 would compile a specialization of _dequantize_range of its own
        _dequantize_range(codes, scales, table, np.int64(_BLOCK32 // 2), first_block, end_block, out_pairs)


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _quantize_blocks16(elems, mask, scale_of, thr, codes, scales, table, out_pairs):
    """Every block, as _quantize_range16, in parallel tasks of _BLOCKS_PER_TASK blocks."""
    n_blocks = scales.size
    for task in numba.prange((n_blocks + _BLOCKS_PER_TASK - 1) // _BLOCKS_PER_TASK):
        _quantize_range16(elems, mask, scale_of, thr, codes, scales, table, task * _BLOCKS_PER_TASK,
                          min(n_blocks, (task + 1) * _BLOCKS_PER_TASK), out_pairs)


@numba.njit(**NJIT_OPTIONS)
def _dequantize_task(codes, scales, table, ppb, out_pairs):
    """out_pairs[i] = table[256 * scale of i's block + codes[i]]: two decoded elements per code byte."""
    for b in range(scales.size):
        row = np.uint64(scales[b]) * np.uint64(256)
        start = np.uint64(b) * np.uint64(ppb)
        for i in range(start, start + np.uint64(ppb)):
            out_pairs[i] = table[row + np.uint64(codes[i])]


@numba.njit(**NJIT_OPTIONS)
def _dequantize_range(codes, scales, table, ppb, first, stop, out_pairs):
    """Decode blocks first .. stop - 1 (see _dequantize_task)."""
    span = slice(ppb * first, ppb * stop)
    _dequantize_task(codes[span], scales[first:stop], table, ppb, out_pairs[span])


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _dequantize_blocks(codes, scales, table, ppb, out_pairs):
    """Decode all blocks, in parallel tasks of _BLOCKS_PER_TASK blocks."""
    n_blocks = scales.size
    for task in numba.prange((n_blocks + _BLOCKS_PER_TASK - 1) // _BLOCKS_PER_TASK):
        _dequantize_range(codes, scales, table, ppb, task * _BLOCKS_PER_TASK,
                          min(n_blocks, (task + 1) * _BLOCKS_PER_TASK), out_pairs)


class Quantize(LastAxisQuantize):
    """mxfp4_quantize on the CPU: contiguous FP16/BF16/FP32 ``x`` into contiguous uint8 codes and scales."""

    def quantize_last_axis(self, x, block_size, scale_rule, rounding, codes, scales) -> None:
        if x.numel():
            quantize_into(x, block_size, scale_rule, rounding, codes, scales)


class Dequantize(LastAxisDequantize):
    """mxfp4_dequantize on the CPU: contiguous uint8 codes and scales into contiguous FP16/BF16/FP32."""

    def supports(self, codes, scales, dtype, axis) -> str | None:
        dtype = torch.bfloat16 if dtype is None else dtype
        return None if dtype in _PAIRS else f"output dtype {dtype}: this kernel writes float16, bfloat16 or float32"

    def dequantize_last_axis(self, codes, scales, out) -> None:
        if not out.numel():
            return
        pair_dtype, _ = _PAIRS[out.dtype]
        operands = (as_numpy(codes).reshape(-1), as_numpy(scales).reshape(-1), _dequant_pair_table(out.dtype),
                    codes.numel() // scales.numel())  # pairs per block
        serial = runs_serially(out.numel(), ONE_THREAD_ELEMENTS)
        run_tasks((_dequantize_range, _dequantize_blocks), operands, scales.numel(),
                  as_numpy(out.view(-1).view(pair_dtype)).view(_UNSIGNED[pair_dtype]), serial)


def fake_quantize(x: torch.Tensor, block_size: int, scale_rule: str, rounding: str, *, out: torch.Tensor) -> None:
    """Write ``dequantize(*quantize(x, block_size, scale_rule, rounding), out.dtype)`` (blocks along the
    last axis) into ``out`` in one pass; bit-exact with the reference pair.

    x: contiguous FP16/BF16/FP32 CPU tensor; out: contiguous FP16/BF16/FP32 CPU tensor of x's shape.
    Raises DtypeError / ShapeError / DeviceError (naming the argument) for anything else.
    """
    codes_shape, scales_shape, _ = ref.quantized_shapes(x, block_size, scale_rule, rounding, -1)
    if out.dtype not in _PAIRS:
        raise DtypeError(f"mxfp4 fake_quantize: out must be float16, bfloat16 or float32, got {out.dtype}")
    if out.shape != x.shape or not (out.is_contiguous() and x.is_contiguous()):
        raise ShapeError(f"mxfp4 fake_quantize: x {tuple(x.shape)} and out {tuple(out.shape)} must be contiguous "
                         "and of one shape")
    if x.device.type != "cpu" or out.device.type != "cpu":
        raise DeviceError(f"mxfp4 fake_quantize needs CPU tensors, got x on {x.device} and out on {out.device}")
    if not x.numel():
        return
    scales = torch.empty(scales_shape, dtype=torch.uint8)
    if out.dtype == x.dtype and fake_quantizes_in_registers(x.dtype, block_size):
        fake_quantize_into(x, block_size, scale_rule, rounding, scales, out)
        return
    quantize_into(x, block_size, scale_rule, rounding, torch.empty(codes_shape, dtype=torch.uint8), scales, out)


# Inputs of fewer elements are quantized on one thread (a decode step's activation: 2048 elements took 0.09 ms
# on two threads after a torch op, mostly the threads' wake-up).
ONE_THREAD_ELEMENTS = 1 << 16


def quantize_into(xt, block_size, scale_rule, rounding, codes, scales, dequantized=None):
    """Quantize contiguous ``xt`` (FP16/BF16/FP32 CPU, blocks along the last axis; arguments validated by
    the caller) into contiguous uint8 ``codes`` and ``scales`` of the reference's shapes, and when given
    its dequantized values into ``dequantized`` (contiguous, xt's shape, FP16/BF16/FP32)."""
    serial = runs_serially(xt.numel(), ONE_THREAD_ELEMENTS)
    _quantize_blocks_of(xt, block_size, scale_rule, rounding, codes, scales, dequantized, serial)


@numba.njit(**dict(NJIT_OPTIONS, inline="always"))
def fake_quantize_block16(elems, start, mask, scale_of, thr, values, out, at):
    """The 32 FP16 / BF16 elements ``elems[start ..]`` quantized then dequantized into ``out[at ..]`` in registers
    (both uint16 bit patterns of one dtype, no bounds checks): their scale byte (returned) from their largest
    magnitude, each value looked up by its threshold count in ``values`` (_block_values), its sign put back; a
    block with a NaN or Inf (scale 0xFF) is the reference's NaN throughout. ``mask``, ``scale_of``, ``thr``: as
    _quantize_range16's."""
    byte = scale_of[_block_amax16(elems, start, mask)]
    _store_block_values16(elems, start, mask, thr, byte, values, out, at)  # one code path (a branch for NaN blocks
    return byte  # here made every block 9x slower, Intel Xeon Emerald Rapids)


@numba.njit(**NJIT_OPTIONS)
def _fake_quantize_range16(elems, mask, scale_of, thr, values, scales, first_block, end_block, out):
    """Quantize then dequantize blocks first_block .. end_block - 1 of 32 FP16 / BF16 elements in registers
    (fake_quantize_block16): ``elems`` and ``out`` (32 * blocks,) uint16 bit patterns of one dtype, scales
    (blocks,) uint8 the blocks' scale bytes."""
    for b in range(np.uint64(first_block), np.uint64(end_block)):  # unsigned: no negative-index wrapping
        start = np.uint64(_BLOCK32) * b
        simd.prefetch_span(elems, start + np.uint64(_PREFETCH_ELEMENTS), _BLOCK32)
        scales[b] = fake_quantize_block16(elems, start, mask, scale_of, thr, values, out, start)


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _fake_quantize_blocks16(elems, mask, scale_of, thr, values, scales, out):
    """Every block, as _fake_quantize_range16, in parallel tasks of _BLOCKS_PER_TASK blocks."""
    n_blocks = scales.size
    for task in numba.prange((n_blocks + _BLOCKS_PER_TASK - 1) // _BLOCKS_PER_TASK):
        _fake_quantize_range16(elems, mask, scale_of, thr, values, scales, task * _BLOCKS_PER_TASK,
                               min(n_blocks, (task + 1) * _BLOCKS_PER_TASK), out)


def fake_quantizes_in_registers(dtype: torch.dtype, block_size: int) -> bool:
    """Whether :func:`fake_quantize_into` takes x of ``dtype`` in blocks of ``block_size``: FP16 / BF16 in MX's
    blocks of 32 on AVX512-BW CPUs (vpermw)."""
    return simd.HAS_AVX512BW and block_size == _BLOCK32 and dtype in (torch.float16, torch.bfloat16)


def fake_quantizer(dtype: torch.dtype, scale_rule: str, rounding: str) -> tuple:
    """(mask, scale_of, thr, values) of fake_quantize_block16 for FP16 / BF16 ``dtype``, the rule and rounding."""
    return (np.uint16(_ABS_MASK[dtype]), _scale_bytes(dtype, scale_rule), _padded_thresholds(dtype, rounding),
            _block_values(dtype))


def fake_quantize_into(xt, block_size, scale_rule, rounding, scales, out) -> None:
    """out <- dequantize(quantize(xt)) in xt's dtype and ``scales`` <- the blocks' scale bytes, in registers, no
    codes written (_fake_quantize_range16): contiguous ``xt`` and ``out`` of one shape and dtype, contiguous uint8
    ``scales`` of the reference's shape, where :func:`fake_quantizes_in_registers`; arguments validated by
    the caller. The reference's bits (tests: every BF16 and FP16 pattern in every lane, each rule)."""
    operands = (as_numpy(xt).reshape(-1).view(np.uint16), *fake_quantizer(xt.dtype, scale_rule, rounding),
                as_numpy(scales).reshape(-1))
    serial = runs_serially(xt.numel(), ONE_THREAD_ELEMENTS)
    run_tasks((_fake_quantize_range16, _fake_quantize_blocks16), operands, scales.numel(),
              as_numpy(out).reshape(-1).view(np.uint16), serial)


def _fake_quantize_at(x_address, out_address, blocks):
    """The template of fake_quantize_small's call: _fake_quantize_range16 over ``blocks`` blocks of 32 FP16 / BF16
    elements at ``x_address`` into ``out_address`` (int16_array_at), with the bound tables of one dtype and
    rule (``_MASK``, ``_SCALE_OF``, ``_THRESHOLDS``, ``_VALUES``: fake_quantizer's)."""
    elems = int16_array_at(x_address, 1, 32 * blocks).reshape(-1).view(np.uint16)
    out = int16_array_at(out_address, 1, 32 * blocks).reshape(-1).view(np.uint16)
    scales = np.empty(blocks, dtype=np.uint8)
    _fake_quantize_range16(elems, _MASK, _SCALE_OF, _THRESHOLDS, _VALUES, scales, 0, blocks, out)  # noqa: F821


@functools.cache
def _fake_quantize_at_for(dtype: torch.dtype, scale_rule: str, rounding: str):
    """The numba dispatcher of _fake_quantize_at bound to the tables of ``dtype``, the rule and the rounding."""
    mask, scale_of, thresholds, values = fake_quantizer(dtype, scale_rule, rounding)
    name = f"_fake_quantize_at_{str(dtype).removeprefix('torch.')}_{scale_rule}_{rounding}"
    return bound_njit(_fake_quantize_at, name, _MASK=mask, _SCALE_OF=scale_of, _THRESHOLDS=thresholds,
                      _VALUES=values)


def fake_quantize_small(x: torch.Tensor, scale_rule: str, rounding: str) -> torch.Tensor:
    """:func:`fake_quantize` of x in blocks of 32 (along its last axis) into a new tensor, in one numba call given
    the tensors' addresses, on the calling thread (its checks, views and tables cost tens of microseconds after
    other work, more than the work of a decode step's activation). Not checked: the caller's x is a
    C-contiguous, aligned FP16 / BF16 CPU tensor of at most ONE_THREAD_ELEMENTS elements, a multiple of 32 in
    its last axis, where :func:`fake_quantizes_in_registers`."""
    out = torch.empty_like(x)
    _fake_quantize_at_for(x.dtype, scale_rule, rounding)(x.data_ptr(), out.data_ptr(), x.numel() // _BLOCK32)
    return out


@functools.cache
def quantize_constants(dtype: torch.dtype, scale_rule: str, rounding: str) -> tuple:
    """The arguments of _quantize_blocks (and quantize_task) between the input pairs and ``ppb``: they
    depend only on the input dtype, the scale rule and the rounding."""
    pair_dtype, width = _PAIRS[dtype]
    unsigned = _UNSIGNED[pair_dtype]
    return (unsigned(width), unsigned(_ABS_MASK[dtype]), np.array([_ABS_MASK[dtype]], dtype=_ELEMENT_UNSIGNED[width]),
            unsigned(_NONFINITE_BITS[dtype]), _amax_to_fp32_bits(dtype), tables.RULE_ID[scale_rule],
            _thresholds(dtype, rounding))


_NO_DEQUANTIZED = (np.zeros(0, np.uint32), np.zeros(0, np.uint32))  # no table: codes and scales only


def _quantize_blocks_of(xt, block_size, scale_rule, rounding, codes, scales, dequantized, serial: bool):
    pair_dtype, _ = _PAIRS[xt.dtype]
    if dequantized is None:
        table, out_pairs = _NO_DEQUANTIZED
    else:
        out_word = _PAIRS[dequantized.dtype][0]
        table = _dequant_pair_table(dequantized.dtype)
        out_pairs = as_numpy(dequantized.view(-1).view(out_word)).view(_UNSIGNED[out_word])
    if block_size == _BLOCK32 and xt.element_size() == 2:  # MX's blocks of FP16 / BF16: the vector path
        operands = (as_numpy(xt.reshape(-1).view(torch.int16)).view(np.uint16), np.uint16(_ABS_MASK[xt.dtype]),
                    _scale_bytes(xt.dtype, scale_rule), _padded_thresholds(xt.dtype, rounding),
                    as_numpy(codes.view(-1)), as_numpy(scales.view(-1)), table)
        run_tasks((_quantize_range16, _quantize_blocks16), operands, scales.numel(), out_pairs, serial)
        return
    operands = (as_numpy(xt.reshape(-1).view(pair_dtype)).view(_UNSIGNED[pair_dtype]),
                *quantize_constants(xt.dtype, scale_rule, rounding), block_size // 2, as_numpy(codes.view(-1)),
                as_numpy(scales.view(-1)), table)
    run_tasks((_quantize_range, _quantize_blocks), operands, scales.numel(), out_pairs, serial)


QUANTIZE = Quantize()
DEQUANTIZE = Dequantize()
