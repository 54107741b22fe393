"""The GEMM path's tiles: rows of W decoded into a float32 or BF16 buffer in logical order, one tile at a
time, for torch's GEMM (docs/weight_only.md, 'Tolerance of the GEMM path')."""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu._runtime import NJIT_OPTIONS, PARALLEL_NJIT_OPTIONS
from lowbit.kernels.cpu._weight_only_decode4 import hifloat4_store_words, mxfp4_store_words
from lowbit.kernels.cpu._weight_only_decode8 import _fill_row_table, code8_decode
from lowbit.kernels.cpu._weight_only_layout import (HALF, LANES, _E4M3_NAN_CODE, _INLINE, _ROWS_PER_TASK, _mask,
                                                    code8_logical, four_bit_logical, hifloat4_logical)
from lowbit.kernels.cpu._weight_only_steps import (ROW_BLOCK, _MXFP8_EXACT_BYTES_BF16, _code8_tail, _hifloat4_step,
                                                   _mxfp4_odd_block, _mxfp4_pair_of_blocks, _mxfp8_row_step,
                                                   _prefetch_ahead, _round_bf16, _round_f16, _row_table)


# ---- GEMM tiles: rows r0 .. r0 + R - 1 of W decoded into w32 (R, >= Kp), logical order, float32 or BF16 ---------


@numba.njit(**_INLINE)
def _store_logical(w_flat, at, low, high):
    """A step's 64 weights in logical order into float32, or BF16 bits (int16; exact: MXFP4 and HiFloat4
    weights are BF16 values, HiFloat8 ones for BF16 x)."""
    simd.f32v_store_any(w_flat, at, low)
    simd.f32v_store_any(w_flat, at + HALF, high)


@numba.njit(**_INLINE)
def _store_code8(w_flat, at, w0, w1):
    low, high = code8_logical(w0, w1)
    _store_logical(w_flat, at, low, high)


@numba.njit(**_INLINE)
def _store_4bit(w_flat, at, w0, w1):
    low, high = four_bit_logical(w0, w1)
    _store_logical(w_flat, at, low, high)


@numba.njit(**_INLINE)
def _store_hifloat4(w_flat, at, w0, w1):
    low, high = hifloat4_logical(w0, w1)
    _store_logical(w_flat, at, low, high)


@numba.njit(**_INLINE)
def _code8_tile_row(store, codes_flat, k, row, table, nan_code, keep, scratch, w_flat, at):
    """Row ``row`` of an 8-bit row-table weight (its ``table`` filled) into w_flat[at:] by ``store``."""
    full = k // LANES
    for t in range(full):
        _prefetch_ahead(codes_flat, np.uint64(row * k + LANES * t), np.uint64(ROW_BLOCK * k))
        w0, w1 = code8_decode(codes_flat, row * k + LANES * t, table, nan_code)
        store(w_flat, at + LANES * t, w0, w1)
    if k % LANES:
        w0, w1 = _code8_tail(codes_flat, row * k + LANES * full, k % LANES, table, nan_code, keep, scratch)
        store(w_flat, at + LANES * full, w0, w1)


def _code8_tile_row_any(codes_flat, k, row, table, nan_code, keep, scratch, w_flat, at):
    """Row ``row`` of an 8-bit row-table weight (its ``table`` filled) into the tile's row at ``w_flat[at]``:
    float32, or BF16 bits (int16), stored as the table's 16-bit patterns where the table holds BF16 bytes and
    the CPU has AVX512-VBMI (simd.store_table_words64: the same bits as the float32 steps, no widening)."""


@overload(_code8_tile_row_any, jit_options=NJIT_OPTIONS)
def _code8_tile_row_any_typed(codes_flat, k, row, table, nan_code, keep, scratch, w_flat, at):
    if not (simd.HAS_AVX512VBMI and w_flat.dtype == types.int16 and table.dtype == types.uint8 and table.ndim == 1):
        return lambda codes_flat, k, row, table, nan_code, keep, scratch, w_flat, at: _code8_tile_row(
            _store_code8, codes_flat, k, row, table, nan_code, keep, scratch, w_flat, at)

    def tile_row_words(codes_flat, k, row, table, nan_code, keep, scratch, w_flat, at):
        full = k // LANES
        for t in range(full):
            _prefetch_ahead(codes_flat, np.uint64(row * k + LANES * t), np.uint64(ROW_BLOCK * k))
            simd.store_table_words64(codes_flat, row * k + LANES * t, table, nan_code, w_flat, at + LANES * t)
        if k % LANES:
            w0, w1 = _code8_tail(codes_flat, row * k + LANES * full, k % LANES, table, nan_code, keep, scratch)
            _store_code8(w_flat, at + LANES * full, w0, w1)

    return tile_row_words


@numba.njit(**NJIT_OPTIONS)
def _code8_tile_rows(codes, scale, bf16, magnitudes, nan_code, table_like, keep, fast, slow_blocks, column_tables, r0,
                     row, end, w32):
    """Rows row .. end - 1 of the tile (W's rows r0 + row ...): the serial part of _code8_tile."""
    k = codes.shape[1]
    kp = w32.shape[1]
    codes_flat, w_flat = simd.flat(codes), simd.flat(w32)
    scratch = np.zeros(LANES, dtype=np.uint8)
    table = _row_table(table_like)
    for i in range(row, end):
        _fill_row_table(magnitudes, scale[r0 + i], bf16, nan_code, table)
        _code8_tile_row_any(codes_flat, k, r0 + i, table, nan_code, keep, scratch, w_flat, i * kp)


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _code8_tile(codes, scale, bf16, magnitudes, nan_code, table_like, keep, fast, slow_blocks, column_tables, r0, w32):
    rows = w32.shape[0]
    for task in numba.prange((rows + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        _code8_tile_rows(codes, scale, bf16, magnitudes, nan_code, table_like, keep, fast, slow_blocks, column_tables,
                         r0, task * _ROWS_PER_TASK, min(rows, (task + 1) * _ROWS_PER_TASK), w32)


@numba.njit(**_INLINE)
def _mxfp8_tile_row(round_to, store, codes_flat, scales_flat, row, k, blocks, table, w_flat, at):
    scratch = np.zeros(LANES, dtype=np.uint8)
    for t in range(-(-k // LANES)):
        _prefetch_ahead(codes_flat, np.uint64(row * k + LANES * t), np.uint64(ROW_BLOCK * k))
        w0, w1 = _mxfp8_row_step(round_to, codes_flat, scales_flat, row * k, row * blocks, t, k, table, scratch,
                                 False)
        store(w_flat, at + LANES * t, w0, w1)


@intrinsic
def mxfp8_store_words(typingctx, codes, start, table, byte_a, byte_b, words, at):
    """Store the 64 weights of two MXFP8 blocks (their codes at ``codes[start]``, 1-D uint8; E8M0 bytes
    ``byte_a``, ``byte_b``, each within _MXFP8_EXACT_BYTES_BF16) as BF16 bits in logical order at
    ``words[at]`` (1-D int16): the E4M3 patterns from the byte table (simd.table_patterns64, one vpermi2b per
    byte plane), then the scale's power of two added to the exponent field of every finite nonzero word (not
    to NaN, either sign), which in that range is the reference's weight exactly (a normal BF16 value).
    AVX512-VBMI."""
    if not (isinstance(words, types.Array) and words.dtype == types.int16):
        return None

    def codegen(context, builder, sig, args):
        v16x64, i16 = ir.VectorType(ir.IntType(16), LANES), ir.IntType(16)
        patterns = simd.table_patterns64(context, builder, sig.args[0], args[0], args[1], sig.args[2], args[2],
                                         ir.Constant(ir.IntType(8), _E4M3_NAN_CODE))

        def exponent_step(byte):  # (byte - 127) << 7 as an i16
            return builder.shl(builder.sub(builder.zext(byte, i16), ir.Constant(i16, 127)), ir.Constant(i16, 7))

        steps = [simd._splat(builder, exponent_step(b), ir.VectorType(i16, HALF)) for b in (args[3], args[4])]
        step = builder.shuffle_vector(steps[0], steps[1], _mask(range(LANES)))
        magnitude = builder.and_(patterns, ir.Constant(v16x64, [0x7FFF] * LANES))
        scaled = builder.and_(builder.icmp_unsigned("!=", magnitude, ir.Constant(v16x64, [0] * LANES)),
                              builder.icmp_unsigned("<", magnitude, ir.Constant(v16x64, [0x7F80] * LANES)))
        result = builder.select(scaled, builder.add(patterns, step), patterns)
        builder.store(result, simd._element_ptr(context, builder, sig.args[5], args[5], args[6], v16x64), align=1)
        return context.get_dummy_value()

    return types.void(codes, start, table, byte_a, byte_b, words, at), codegen


def _mxfp8_tile_row_any(codes_flat, scales_flat, row, k, blocks, table, w_flat, at):
    """Row ``row`` of W into the BF16 tile's row at ``w_flat[at]`` (int16; x is BF16): steps whose two E8M0
    bytes lie in _MXFP8_EXACT_BYTES_BF16 as words where the CPU has AVX512-VBMI and ``table`` holds bytes
    (mxfp8_store_words: the same bits), the others, and every step elsewhere, by _mxfp8_tile_row's steps."""


@overload(_mxfp8_tile_row_any, jit_options=NJIT_OPTIONS)
def _mxfp8_tile_row_any_typed(codes_flat, scales_flat, row, k, blocks, table, w_flat, at):
    if not (simd.HAS_AVX512VBMI and w_flat.dtype == types.int16 and table.dtype == types.uint8):
        return lambda codes_flat, scales_flat, row, k, blocks, table, w_flat, at: _mxfp8_tile_row(
            _round_bf16, _store_code8, codes_flat, scales_flat, row, k, blocks, table, w_flat, at)
    low, high = _MXFP8_EXACT_BYTES_BF16

    def tile_row_words(codes_flat, scales_flat, row, k, blocks, table, w_flat, at):
        scratch = np.zeros(LANES, dtype=np.uint8)
        for t in range(-(-k // LANES)):
            _prefetch_ahead(codes_flat, np.uint64(row * k + LANES * t), np.uint64(ROW_BLOCK * k))
            whole = LANES * (t + 1) <= k  # else one last 32-block
            byte_a = scales_flat[row * blocks + 2 * t]
            byte_b = scales_flat[row * blocks + 2 * t + 1] if whole else byte_a
            if whole and low <= byte_a <= high and low <= byte_b <= high:
                mxfp8_store_words(codes_flat, row * k + LANES * t, table, byte_a, byte_b, w_flat, at + LANES * t)
            else:
                w0, w1 = _mxfp8_row_step(_round_bf16, codes_flat, scales_flat, row * k, row * blocks, t, k, table,
                                         scratch, True)
                _store_code8(w_flat, at + LANES * t, w0, w1)

    return tile_row_words


@numba.njit(**NJIT_OPTIONS)
def _mxfp8_tile_rows(codes, scales, bf16, table, fast, slow_blocks, column_tables, r0, row, end, w32):
    """Rows row .. end - 1 of the tile: the serial part of _mxfp8_tile (every row by the table; ``fast``,
    ``slow_blocks`` and ``column_tables``, the GEMV's, not read)."""
    k, blocks, kp = codes.shape[1], scales.shape[1], w32.shape[1]
    codes_flat, scales_flat, w_flat = simd.flat(codes), simd.flat(scales), simd.flat(w32)
    for i in range(row, end):
        if bf16:
            _mxfp8_tile_row_any(codes_flat, scales_flat, r0 + i, k, blocks, table, w_flat, i * kp)
        else:
            _mxfp8_tile_row(_round_f16, _store_code8, codes_flat, scales_flat, r0 + i, k, blocks, table, w_flat,
                            i * kp)


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _mxfp8_tile(codes, scales, bf16, table, fast, slow_blocks, column_tables, r0, w32):
    rows = w32.shape[0]
    for task in numba.prange((rows + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        _mxfp8_tile_rows(codes, scales, bf16, table, fast, slow_blocks, column_tables, r0, task * _ROWS_PER_TASK,
                         min(rows, (task + 1) * _ROWS_PER_TASK), w32)


@numba.njit(**_INLINE)
def _mxfp4_tile_row(store, scales_flat, codes_flat, row, blocks, scratch, w_flat, at):
    b0 = row * blocks
    for t in range(blocks // 2):
        b = np.uint64(b0 + 2 * t)
        if t % 2 == 0:
            _prefetch_ahead(codes_flat, np.uint64(16) * b, np.uint64(ROW_BLOCK * 16 * blocks))
        w0, w1 = _mxfp4_pair_of_blocks(codes_flat, scales_flat, b)
        store(w_flat, at + LANES * t, w0, w1)
    if blocks % 2:
        w0, w1 = _mxfp4_odd_block(codes_flat, b0 + blocks - 1, scales_flat, scratch)
        store(w_flat, at + LANES * (blocks // 2), w0, w1)


def _mxfp4_tile_row_any(scales_flat, codes_flat, row, blocks, scratch, w_flat, at):
    """Row ``row`` of W into the tile's row at ``w_flat[at]``: float32, or BF16 bits (int16), by the words'
    look-ups where the CPU has AVX512-VBMI (mxfp4_store_words; the same bits, a third of the instructions)."""


@overload(_mxfp4_tile_row_any, jit_options=NJIT_OPTIONS)
def _mxfp4_tile_row_any_typed(scales_flat, codes_flat, row, blocks, scratch, w_flat, at):
    if not (simd.HAS_AVX512VBMI and w_flat.dtype == types.int16):
        return lambda scales_flat, codes_flat, row, blocks, scratch, w_flat, at: _mxfp4_tile_row(
            _store_4bit, scales_flat, codes_flat, row, blocks, scratch, w_flat, at)

    def tile_row_words(scales_flat, codes_flat, row, blocks, scratch, w_flat, at):
        b0 = row * blocks
        for t in range(blocks // 2):
            b = np.uint64(b0 + 2 * t)
            if t % 2 == 0:
                _prefetch_ahead(codes_flat, np.uint64(16) * b, np.uint64(ROW_BLOCK * 16 * blocks))
            mxfp4_store_words(codes_flat, np.uint64(16) * b, scales_flat, b, w_flat, np.uint64(at + LANES * t))
        if blocks % 2:
            w0, w1 = _mxfp4_odd_block(codes_flat, b0 + blocks - 1, scales_flat, scratch)
            _store_4bit(w_flat, at + LANES * (blocks // 2), w0, w1)

    return tile_row_words


@numba.njit(**NJIT_OPTIONS)
def _mxfp4_tile_rows(scales, codes, r0, row, end, w32):
    """Rows row .. end - 1 of the tile: the serial part of _mxfp4_tile."""
    blocks = scales.shape[1]
    kp = w32.shape[1]
    w_flat, codes_flat, scales_flat = simd.flat(w32), simd.flat(codes), simd.flat(scales)
    scratch = np.zeros(HALF, dtype=np.uint8)
    for i in range(row, end):
        _mxfp4_tile_row_any(scales_flat, codes_flat, r0 + i, blocks, scratch, w_flat, i * kp)


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _mxfp4_tile(scales, codes, r0, w32):
    rows = w32.shape[0]
    for task in numba.prange((rows + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        _mxfp4_tile_rows(scales, codes, r0, task * _ROWS_PER_TASK, min(rows, (task + 1) * _ROWS_PER_TASK), w32)


@numba.njit(**_INLINE)
def _hifloat4_tile_row(store, words_flat, value_flat, row, blocks, w_flat, at):
    for b in range(blocks):
        if b % 2 == 0:
            _prefetch_ahead(value_flat, np.uint64(32 * (row * blocks + b)), np.uint64(ROW_BLOCK * 32 * blocks))
        w0, w1 = _hifloat4_step(words_flat, value_flat, row * blocks + b)
        store(w_flat, at + LANES * b, w0, w1)


def _hifloat4_tile_row_any(words_flat, value_flat, row, blocks, w_flat, at):
    """Row ``row`` of W into the tile's row at ``w_flat[at]``: float32, or BF16 bits (int16), looked up as
    words where the CPU has AVX512-BW (hifloat4_store_words: the same bits, no widening)."""


@overload(_hifloat4_tile_row_any, jit_options=NJIT_OPTIONS)
def _hifloat4_tile_row_any_typed(words_flat, value_flat, row, blocks, w_flat, at):
    if not (simd.HAS_AVX512BW and w_flat.dtype == types.int16):
        return lambda words_flat, value_flat, row, blocks, w_flat, at: _hifloat4_tile_row(
            _store_hifloat4, words_flat, value_flat, row, blocks, w_flat, at)

    def tile_row_words(words_flat, value_flat, row, blocks, w_flat, at):
        for b in range(blocks):
            if b % 2 == 0:
                _prefetch_ahead(value_flat, np.uint64(32 * (row * blocks + b)), np.uint64(ROW_BLOCK * 32 * blocks))
            hifloat4_store_words(value_flat, np.uint64(32 * (row * blocks + b)), words_flat[row * blocks + b],
                                 w_flat, np.uint64(at + LANES * b))

    return tile_row_words


@numba.njit(**NJIT_OPTIONS)
def _hifloat4_tile_rows(words, value, codes, signs, r0, row, end, w32):
    """Rows row .. end - 1 of the tile: the serial part of _hifloat4_tile (codes, signs: the GEMV's indexed
    pairs, unused here)."""
    blocks = words.shape[1]
    kp = w32.shape[1]
    w_flat, words_flat, value_flat = simd.flat(w32), simd.flat(words), simd.flat(value)
    for i in range(row, end):
        _hifloat4_tile_row_any(words_flat, value_flat, r0 + i, blocks, w_flat, i * kp)


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _hifloat4_tile(words, value, codes, signs, r0, w32):
    rows = w32.shape[0]
    for task in numba.prange((rows + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        _hifloat4_tile_rows(words, value, codes, signs, r0, task * _ROWS_PER_TASK,
                            min(rows, (task + 1) * _ROWS_PER_TASK), w32)


