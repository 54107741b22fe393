"""The GEMV kernels of 8-bit weights (HiFloat8, FP8 E4M3, MXFP8): y32 (M, N) <- x (M, Kp, register order)
@ W.T, bit-exact with the reference (docs/weight_only.md, 'Kernels')."""

from __future__ import annotations

import math

import numba
import numpy as np

from lowbit.formats import mxfp8
from lowbit.kernels.cpu import _code8_columns as _columns
from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu._runtime import NJIT_OPTIONS, PARALLEL_NJIT_OPTIONS
from lowbit.kernels.cpu._weight_only_decode8 import (_CODE8_NAN_BY_MINIMUM, _COLUMN_AHEAD_ROWS, _by_column_tables,
                                                     _fill_row_table, _row_sum_code8_pairs, code8_columns_half,
                                                     code8_decode, code8_decode_half, code8_pairs, u8p_holds_minimum,
                                                     u8p_largest)
from lowbit.kernels.cpu._weight_only_layout import (CODE8_HALVES, HALF, LANES, _E4M3_NAN_CODE, _E8M0_SCALES, _INLINE,
                                                    _ROWS_PER_TASK, _row_sum_code8)
from lowbit.kernels.cpu._weight_only_steps import (BLOCK_ROWS, PAIR_LANES, ROW_BLOCK, _MXFP8_EXACT_BYTES_BF16,
                                                   _MXFP8_EXACT_BYTES_F16, _accumulate, _add_products, _bits_exponent,
                                                   _block_sums, _block_sums_pair, _code8_tail, _dot_pairs,
                                                   _dot_pairs_four_x, _exact, _low_byte_range, _mxfp8_row_step,
                                                   _mxfp8_step, _prefetch_ahead, _round_to_x, _row_table, _store_block,
                                                   _x_pair_step, _x_step)


@numba.njit(**_INLINE)
def _code8_pair_step(codes_flat, start, t, table, low, ahead):
    """Pair step t of the row of codes at ``start`` with its byte ``table`` (code8_pairs: w0, w1 and the running
    minimum ``low``), after prefetching its two cache lines of codes ``ahead`` codes on (_prefetch_ahead)."""
    at = np.uint64(start + PAIR_LANES * t)  # unsigned: no negative-index wraparound code
    _prefetch_ahead(codes_flat, at, ahead)
    _prefetch_ahead(codes_flat, at + np.uint64(LANES), ahead)
    return code8_pairs(codes_flat, at, table, low)


@numba.njit(**_INLINE)
def _code8_pair_rows(x_flat, x0, steps, codes_flat, table_a, table_b, first, second, ahead, nan_by_minimum):
    """The folded sums of two rows of W (codes at ``first`` and ``second``, their byte tables ``table_a`` and
    ``table_b``) in BF16 pairs (code8_pairs: ``steps`` pair steps) times x's pairs at x_flat[x0:]
    (_code8_x_operands); a row holding the code 0x80 sums to NaN where ``nan_by_minimum`` (HiFloat8's NaN).
    Each pair step prefetches its two cache lines of codes ``ahead`` codes on (_prefetch_ahead)."""
    a0, a1, b0, b1 = simd.f32v_zero(), simd.f32v_zero(), simd.f32v_zero(), simd.f32v_zero()
    low_a, low_b = u8p_largest(), u8p_largest()
    for t in range(steps):
        x_low, x_high = _x_pair_step(x_flat, x0, t)
        w0, w1, low_a = _code8_pair_step(codes_flat, first, t, table_a, low_a, ahead)
        a0, a1 = _dot_pairs(a0, a1, x_low, x_high, w0, w1)
        w0, w1, low_b = _code8_pair_step(codes_flat, second, t, table_b, low_b, ahead)
        b0, b1 = _dot_pairs(b0, b1, x_low, x_high, w0, w1)
    return (_nan_where_minimum(_row_sum_code8_pairs(a0, a1), low_a, nan_by_minimum),
            _nan_where_minimum(_row_sum_code8_pairs(b0, b1), low_b, nan_by_minimum))


@numba.njit(**_INLINE)
def _nan_where_minimum(row_sum, low, nan_by_minimum):
    """A row's folded pair sum, NaN where ``nan_by_minimum`` and its codes held the code 0x80 (``low``: the
    running minimum of code8_pairs)."""
    return np.float32(np.nan) if nan_by_minimum and u8p_holds_minimum(low) else row_sum


@numba.njit(**_INLINE)
def _code8_pair_rows_two_x(x_flat, x0, x1, steps, codes_flat, table_a, table_b, first, second, ahead,
                           nan_by_minimum):
    """_code8_pair_rows for two rows of x (their pairs at x_flat[x0:] and x_flat[x1:]): each pair step of W
    decoded once for both, every (x row, W row) summed with _code8_pair_rows' operations in its order (so its
    sums, bit for bit). Returns the two rows of W's sums for x0, then for x1."""
    a0, a1, b0, b1 = simd.f32v_zero(), simd.f32v_zero(), simd.f32v_zero(), simd.f32v_zero()
    c0, c1, d0, d1 = simd.f32v_zero(), simd.f32v_zero(), simd.f32v_zero(), simd.f32v_zero()
    low_a, low_b = u8p_largest(), u8p_largest()
    for t in range(steps):
        x_low, x_high = _x_pair_step(x_flat, x0, t)
        y_low, y_high = _x_pair_step(x_flat, x1, t)
        w0, w1, low_a = _code8_pair_step(codes_flat, first, t, table_a, low_a, ahead)
        a0, a1 = _dot_pairs(a0, a1, x_low, x_high, w0, w1)
        c0, c1 = _dot_pairs(c0, c1, y_low, y_high, w0, w1)
        w0, w1, low_b = _code8_pair_step(codes_flat, second, t, table_b, low_b, ahead)
        b0, b1 = _dot_pairs(b0, b1, x_low, x_high, w0, w1)
        d0, d1 = _dot_pairs(d0, d1, y_low, y_high, w0, w1)
    a, b = _row_sum_code8_pairs(a0, a1), _row_sum_code8_pairs(b0, b1)
    c, d = _row_sum_code8_pairs(c0, c1), _row_sum_code8_pairs(d0, d1)
    return ((_nan_where_minimum(a, low_a, nan_by_minimum), _nan_where_minimum(b, low_b, nan_by_minimum)),
            (_nan_where_minimum(c, low_a, nan_by_minimum), _nan_where_minimum(d, low_b, nan_by_minimum)))


@numba.njit(**NJIT_OPTIONS)
def _code8_pair_sums(x_flat, x0, steps, codes_flat, tables, starts, ahead, nan_by_minimum):
    """The folded sums of a block of ROW_BLOCK rows of W (``tables``, ``starts``: theirs) in BF16 pairs, two rows
    at a time (_code8_pair_rows; four at once measured no faster). A function of its own, not inlined into the
    rows kernel (its compile time, as _mxfp4_pair_sums_bf16), called directly: a chooser between it and a
    stand-in, called with the arguments as a tuple, cost about 650 cycles a block."""
    a, b = _code8_pair_rows(x_flat, x0, steps, codes_flat, tables[0], tables[1], starts[0], starts[1], ahead,
                            nan_by_minimum)
    c, d = _code8_pair_rows(x_flat, x0, steps, codes_flat, tables[2], tables[3], starts[2], starts[3], ahead,
                            nan_by_minimum)
    return a, b, c, d


@numba.njit(**NJIT_OPTIONS)
def _code8_pair_sums_two_x(x_flat, x0, x1, steps, codes_flat, tables, starts, ahead, nan_by_minimum):
    """_code8_pair_sums for two rows of x (_code8_pair_rows_two_x): the 4-tuple of x0's sums, then x1's."""
    (a, b), (e, f) = _code8_pair_rows_two_x(x_flat, x0, x1, steps, codes_flat, tables[0], tables[1], starts[0],
                                            starts[1], ahead, nan_by_minimum)
    (c, d), (g, h) = _code8_pair_rows_two_x(x_flat, x0, x1, steps, codes_flat, tables[2], tables[3], starts[2],
                                            starts[3], ahead, nan_by_minimum)
    return (a, b, c, d), (e, f, g, h)


@numba.njit(**_INLINE)
def _code8_pairable(x_bounds, kq, m, scale_bits, row):
    """Whether x row m and the ROW_BLOCK rows of W from ``row`` may be summed in BF16 pairs (vdpbf16ps flushes
    subnormal inputs and results): x's pairs were made (``kq`` > 0 columns: _code8_x_operands, for BF16 x, K a
    multiple of PAIR_LANES), x holds no subnormal value, no weight is subnormal and every nonzero |x w| lies in
    [2^-103, 2^128) (x's exponent bounds _x_bounds; each row's weights' from its scale's exponent, _CODE8_LOW ..
    _COLUMN_HIGH above it, read from ``scale_bits``, the int32 bits of the float32 row scales, viewed once by the
    caller: a view made here cost 200 cycles a block), so every product is exact and a multiple of 2^-126 and
    no partial sum is flushed (docs/weight_only.md, 'BF16 pairs')."""
    if kq == 0 or x_bounds[m, 0] < -126:
        return False
    for r in range(ROW_BLOCK):
        e_s = _bits_exponent(np.int64(scale_bits[row + r]) & 0x7FFFFFFF)  # zero, Inf, NaN: out of range
        if not (e_s + _CODE8_LOW >= -126 and x_bounds[m, 0] + e_s + _CODE8_LOW >= -103
                and x_bounds[m, 1] + e_s + _COLUMN_HIGH <= 126):
            return False
    return True


@numba.njit(**_INLINE)
def _code8_x_row_pairs(step, x_flat, kp, steps, operands, starts, row, y32, m_end):
    """y32[:m_end, row : row + ROW_BLOCK] of an 8-bit format's block of W rows (``step``, ``operands``, ``starts``
    as for _block_sums; mul + add products): rows 0 .. m_end - 1 of x (``m_end`` even; Kp = ``kp`` apart in
    x_flat) in pairs, each step decoded once for both."""
    for m in range(0, m_end - 1, 2):
        _code8_x_row_pair(step, x_flat, kp, steps, operands, starts, row, y32, m)


@numba.njit(**_INLINE)
def _code8_x_row_pair(step, x_flat, kp, steps, operands, starts, row, y32, m):
    """y32[m : m + 2, row : row + ROW_BLOCK] as _code8_x_row_pairs makes them: rows m and m + 1 of x."""
    first, second = _block_sums_pair(step, _add_products, _row_sum_code8, _x_step, x_flat, m * kp, (m + 1) * kp,
                                     steps, operands, starts)
    _store_block(y32, m, row, first)
    _store_block(y32, m + 1, row, second)


@numba.njit(**_INLINE)
def _code8_block_rows(step, x_flat, kp, steps, operands, starts, row, y32):
    """y32[:, row : row + ROW_BLOCK] of an 8-bit format's block of W rows: the rows of x (M = y32.shape[0]) in
    pairs (_code8_x_row_pairs), then a last, odd one."""
    m_rows = y32.shape[0]
    _code8_x_row_pairs(step, x_flat, kp, steps, operands, starts, row, y32, m_rows - m_rows % 2)
    if m_rows % 2:
        _store_block(y32, m_rows - 1, row, _block_sums(step, _add_products, _row_sum_code8, _x_step, x_flat,
                                                       (m_rows - 1) * kp, steps, operands, starts))


@numba.njit(**NJIT_OPTIONS)
def _code8_pair_block(pairs, m, operands, steps, starts, row, y32):
    """y32[m, row : row + ROW_BLOCK] by _code8_pair_sums where _code8_pairable (``pairs``: x's exponent bounds,
    its pairs' flat view and columns, the rows' scale bits, the NaN rule of _code8_pair_rows; ``operands``,
    ``steps`` and ``starts`` as _code8_block_rows has them); whether it did. A function of its own: inlined, its
    code made numba's passes over every rows kernel slower even where they prune it."""
    x_bounds, xp_flat, kq, scale_bits, nan_by_minimum = pairs
    if not _code8_pairable(x_bounds, kq, m, scale_bits, row):
        return False
    codes_flat, tables, _, ahead = operands
    _store_block(y32, m, row, _code8_pair_sums(xp_flat, m * kq, steps // 2, codes_flat, tables, starts, ahead,
                                               nan_by_minimum))
    return True


@numba.njit(**_INLINE)
def _code8_pair_row_four_x(x_flat, xs, steps, codes_flat, table, start, ahead, nan_by_minimum):
    """One row of W (codes at ``start``, byte table ``table``) in BF16 pairs times four rows of x (their pairs at
    x_flat[xs[i]:]): each pair step decoded once for all four, every (x row, W row) summed as _code8_pair_rows
    sums it (its bits). Returns the four sums."""
    zero = simd.f32v_zero()
    accs = (zero, zero, zero, zero, zero, zero, zero, zero)
    low = u8p_largest()
    for t in range(steps):
        w0, w1, low = _code8_pair_step(codes_flat, start, t, table, low, ahead)
        accs = _dot_pairs_four_x(accs, x_flat, xs, t, w0, w1)
    a0, a1, b0, b1, c0, c1, d0, d1 = accs
    return (_nan_where_minimum(_row_sum_code8_pairs(a0, a1), low, nan_by_minimum),
            _nan_where_minimum(_row_sum_code8_pairs(b0, b1), low, nan_by_minimum),
            _nan_where_minimum(_row_sum_code8_pairs(c0, c1), low, nan_by_minimum),
            _nan_where_minimum(_row_sum_code8_pairs(d0, d1), low, nan_by_minimum))


@numba.njit(**NJIT_OPTIONS)
def _code8_pair_block_four_x(pairs, m, x_rows, operands, steps, starts, row, y32):
    """_code8_pair_block for rows m .. m + x_rows - 1 of x together (``x_rows`` 4 or 3: the fourth row of x then
    repeats the third, its sums dropped), one row of W at a time (_code8_pair_row_four_x: eight accumulators),
    where all are _code8_pairable; whether it did."""
    x_bounds, xp_flat, kq, scale_bits, nan_by_minimum = pairs
    for i in range(x_rows):
        if not _code8_pairable(x_bounds, kq, m + i, scale_bits, row):
            return False
    codes_flat, tables, _, ahead = operands
    xs = (m * kq, (m + 1) * kq, (m + 2) * kq, (m + x_rows - 1) * kq)
    for r in range(ROW_BLOCK):
        a, b, c, d = _code8_pair_row_four_x(xp_flat, xs, steps // 2, codes_flat, tables[r], starts[r], ahead,
                                            nan_by_minimum)
        y32[m, row + r], y32[m + 1, row + r], y32[m + 2, row + r] = a, b, c
        if x_rows == 4:
            y32[m + 3, row + r] = d
    return True


@numba.njit(**NJIT_OPTIONS)
def _code8_pair_block_two_x(pairs, m, operands, steps, starts, row, y32):
    """_code8_pair_block for rows m and m + 1 of x together (_code8_pair_sums_two_x), where both are
    _code8_pairable; whether it did."""
    x_bounds, xp_flat, kq, scale_bits, nan_by_minimum = pairs
    if not (_code8_pairable(x_bounds, kq, m, scale_bits, row) and _code8_pairable(x_bounds, kq, m + 1, scale_bits,
                                                                                  row)):
        return False
    codes_flat, tables, _, ahead = operands
    first, second = _code8_pair_sums_two_x(xp_flat, m * kq, (m + 1) * kq, steps // 2, codes_flat, tables, starts,
                                           ahead, nan_by_minimum)
    _store_block(y32, m, row, first)
    _store_block(y32, m + 1, row, second)
    return True


@numba.njit(**_INLINE)
def _code8_paired_block_rows(pairs, step, x_flat, kp, steps, operands, starts, row, y32):
    """_code8_block_rows where x's BF16 pairs were made: four (or a last three) rows of x in BF16 pairs where
    all may be (_code8_pair_block_four_x), else each pair of rows of x in BF16 pairs where both may be
    (_code8_pair_block_two_x), else with products of both from one decode (_block_sums_pair); a row left over
    in BF16 pairs where it may be (_code8_pair_block), else alone."""
    m_rows = y32.shape[0]
    m = np.int64(0)  # not the literal 0: numba would compile the pair kernels called with m for it too
    while m + 1 < m_rows:
        x_rows = min(4, m_rows - m)
        if x_rows >= 3 and _code8_pair_block_four_x(pairs, m, x_rows, operands, steps, starts, row, y32):
            m += x_rows
            continue
        if not _code8_pair_block_two_x(pairs, m, operands, steps, starts, row, y32):
            _code8_x_row_pair(step, x_flat, kp, steps, operands, starts, row, y32, m)
        m += 2
    last = m_rows - 1
    if m == last and not _code8_pair_block(pairs, last, operands, steps, starts, row, y32):
        _store_block(y32, last, row, _block_sums(step, _add_products, _row_sum_code8, _x_step, x_flat, last * kp,
                                                 steps, operands, starts))


@numba.njit(**_INLINE)
def _code8_row_sum(x_flat, x0, codes_flat, c0, k, table, nan_code, keep, scratch):
    """One row of W (codes_flat[c0 : c0 + k]) times x_flat[x0:] (register order) with the row's ``table``.
    A multiply and an add per product: here a fused multiply-add (same bits, as the products are exact but
    for the extremes) measured slower, as the lanes' chains of additions bound the loop."""
    full = k // LANES
    acc0 = simd.f32v_zero()
    acc1 = simd.f32v_zero()
    if CODE8_HALVES:  # the lanes of codes 0-31 of every step, then those of 32-63: four accumulators live
        # (written out twice: a helper taking the row's table, a counted array, measured 3 % slower)
        for t in range(full):
            w = code8_decode_half(codes_flat, c0 + LANES * t, table, nan_code)
            acc0 = simd.f32v_add(acc0, simd.f32v_mul(simd.f32v_load(x_flat, x0 + LANES * t), w))
        for t in range(full):
            w = code8_decode_half(codes_flat, c0 + LANES * t + HALF, table, nan_code)
            acc1 = simd.f32v_add(acc1, simd.f32v_mul(simd.f32v_load(x_flat, x0 + LANES * t + HALF), w))
    else:
        for t in range(full):
            w0, w1 = code8_decode(codes_flat, c0 + LANES * t, table, nan_code)
            acc0, acc1 = _accumulate(acc0, acc1, x_flat, x0 + LANES * t, w0, w1)
    if k % LANES:
        w0, w1 = _code8_tail(codes_flat, c0 + LANES * full, k % LANES, table, nan_code, keep, scratch)
        acc0, acc1 = _accumulate(acc0, acc1, x_flat, x0 + LANES * full, w0, w1)
    return _row_sum_code8(acc0, acc1)


@numba.njit(**_INLINE)
def _column_pass(accumulate, x_flat, x0, codes_flat, c0, steps, decode, rows, half):
    """The lanes of codes ``half`` .. ``half`` + 31 of every step t of a row of re-encoded 8-bit codes, their
    weights ``decode(rows, codes_flat, start, t, half)`` (the F32V of the 32 codes at ``start``: _row_columns,
    _block_columns, _block_columns_or_table), each product added by ``accumulate`` (_mul_then_add or
    _fused_multiply_add); the first pass (``half`` 0) prefetches the row _COLUMN_AHEAD_ROWS on."""
    acc = simd.f32v_zero()
    for t in range(steps):
        if half == 0:
            _prefetch_ahead(codes_flat, np.uint64(c0 + LANES * t), np.uint64(_COLUMN_AHEAD_ROWS * LANES * steps))
        w = decode(rows, codes_flat, c0 + LANES * t + half, t, half)
        acc = accumulate(acc, simd.f32v_load(x_flat, x0 + LANES * t + half), w)
    return acc


assert _columns.BLOCK == HALF == mxfp8.BLOCK  # a block marked in slow_blocks, and MXFP8's, is half a step


@numba.njit(**_INLINE)
def _step_block(b0, t, half):
    """The index of the 32-code block of step t's ``half`` (0 or HALF) in a row whose first block is b0."""
    return b0 + 2 * t + half // HALF


@numba.njit(**_INLINE)
def _row_columns(rows, codes_flat, start, t, half):
    """HiFloat8 / FP8: by the weight row's own column table; rows = (the rows' column tables, the row)."""
    tables, row = rows
    return code8_columns_half(codes_flat, start, tables, row, _columns.ADDENDS)


@numba.njit(**_INLINE)
def _row_columns_or_table(rows, codes_flat, start, t, half):
    """HiFloat8 / FP8 rows with a code the columns leave out: _row_columns, but the blocks of 32 codes
    ``slow_flat`` marks by the row's table (_fill_row_table); rows = (the rows' column tables, the row,
    slow_flat, the index of the row's first block, the row's table, its NaN code)."""
    tables, row, slow_flat, b0, table, nan_code = rows
    if slow_flat[_step_block(b0, t, half)]:
        return code8_decode_half(codes_flat, start, table, nan_code)
    return code8_columns_half(codes_flat, start, tables, row, _columns.ADDENDS)


@numba.njit(**_INLINE)
def _block_columns(rows, codes_flat, start, t, half):
    """MXFP8: by the column table of the 32-block's E8M0 byte; rows = (the 256 bytes' column tables, the E8M0
    bytes (flat), the index of the row's first, ...)."""
    tables, scales_flat, b0 = rows[0], rows[1], rows[2]
    return code8_columns_half(codes_flat, start, tables, scales_flat[_step_block(b0, t, half)], _columns.ADDENDS)


@numba.njit(**_INLINE)
def _block_columns_or_table(rows, codes_flat, start, t, half):
    """MXFP8 rows with a code the columns leave out: _block_columns, but the blocks ``slow_flat`` marks by the
    table of the (re-encoded) E4M3 values times the block's scale: exactly the reference's weights, as the
    columns' (bytes of the column range); rows = (as _block_columns', slow_flat, the table)."""
    tables, scales_flat, b0, slow_flat, table = rows
    b = _step_block(b0, t, half)
    if slow_flat[b]:
        return simd.f32v_mul(code8_decode_half(codes_flat, start, table, _E4M3_NAN_CODE), _E8M0_SCALES[scales_flat[b]])
    return code8_columns_half(codes_flat, start, tables, scales_flat[b], _columns.ADDENDS)


@numba.njit(**_INLINE)
def _mul_then_add(acc, x, w):
    """acc + x * w: a multiply, then an add (the reference's two roundings)."""
    return simd.f32v_add(acc, simd.f32v_mul(x, w))


@numba.njit(**_INLINE)
def _fused_multiply_add(acc, x, w):
    """The same in one instruction: the same bits where every product x * w is exact (_columns_fused)."""
    return simd.f32v_fma(x, w, acc)


# Bounds of floor(log2 |w|) - floor(log2 s) over a fast row's nonzero weights w = bf16(v s): |v| s <= |w| <=
# |v| 2^(floor(log2 s) + 1) (rounding stays within the binade's end); _CODE8_LOW: the low bound of every
# code's (a row with blocks by the table: slow_blocks).
# (both formats' bounds at once: a wider range only declines a fused multiply-add somewhat earlier).
_COLUMN_LOW = min(_columns.HIFLOAT8.fast_exponents[0], _columns.FLOAT8_E4M3.fast_exponents[0])
_COLUMN_HIGH = max(_columns.HIFLOAT8.fast_exponents[1], _columns.FLOAT8_E4M3.fast_exponents[1]) + 1
_CODE8_LOW = min(_columns.HIFLOAT8.lowest_exponent, _columns.FLOAT8_E4M3.lowest_exponent)


@numba.njit(**_INLINE)
def _columns_fused(x_bounds, m, e_low, e_high, lowest):
    """Whether every nonzero product of x row m (its exponent bounds: _x_bounds) with a row by columns whose
    scales s have floor(log2 s) in [e_low, e_high] (HiFloat8 / FP8: the row's one scale; MXFP8: its blocks'
    powers of two) and whose weights' floor(log2 |w|) - floor(log2 s) are at least ``lowest`` (_COLUMN_LOW, or
    _CODE8_LOW where blocks go by the table) lies in [2^-126, 2^128), so that it is exact in float32 (BF16 x
    BF16: 16 significant bits) and a fused multiply-add gives _mul_then_add's bits (as _fused_bytes for the
    4-bit formats). Infinite weights (HiFloat8's, by the table) give Inf or NaN by either."""
    return x_bounds[m, 0] + e_low + lowest >= -126 and x_bounds[m, 1] + e_high + _COLUMN_HIGH <= 126


@numba.njit(**_INLINE)
def _scale_exponent(s):
    """floor(log2 s) of a normal float32 ``s``."""
    return math.frexp(s)[1] - 1


@numba.njit(**_INLINE)
def _code8_column_row_sum(x_flat, x0, codes_flat, c0, k, decode, rows, fused):
    """_code8_row_sum of a fast row of re-encoded 8-bit codes (K a multiple of 64; its weights by ``decode(rows,
    ...)``: _column_pass): the same bits, by fused multiply-adds where ``fused`` (_columns_fused)."""
    steps = k // LANES
    if fused:
        return _row_sum_code8(_column_pass(_fused_multiply_add, x_flat, x0, codes_flat, c0, steps, decode, rows, 0),
                              _column_pass(_fused_multiply_add, x_flat, x0, codes_flat, c0, steps, decode, rows, HALF))
    return _row_sum_code8(_column_pass(_mul_then_add, x_flat, x0, codes_flat, c0, steps, decode, rows, 0),
                          _column_pass(_mul_then_add, x_flat, x0, codes_flat, c0, steps, decode, rows, HALF))


@numba.njit(**_INLINE)
def _code8_block_step(operands, start, r, t):
    """Step t of block row r (codes from ``start``), with that row's table: operands (codes, tables, nan,
    ahead: the prefetch distance, see _prefetch_ahead)."""
    codes_flat, tables, nan_code, ahead = operands
    _prefetch_ahead(codes_flat, np.uint64(start + LANES * t), ahead)  # a step reads one cache line of codes
    return code8_decode(codes_flat, start + LANES * t, tables[r], nan_code)


@numba.njit(**NJIT_OPTIONS)
def _code8_rows_body(x_reg, codes, scale, bf16, magnitudes, nan_code, table_like, keep, fast, slow_blocks,
                     column_tables, x_bounds, x_pairs, row, end, y32):
    """_code8_rows (``x_pairs`` None: numba prunes the pair code) and _code8_rows_paired (x's pairs: rows of x
    may take BF16 pairs, _code8_paired_block_rows)."""
    k = codes.shape[1]
    kp = x_reg.shape[1]
    codes_flat, x_flat = simd.borrowed_flat(codes), simd.borrowed_flat(x_reg)
    tables = (_row_table(table_like), _row_table(table_like), _row_table(table_like), _row_table(table_like))
    if BLOCK_ROWS and k % LANES == 0:  # blocks of rows (no short last step)
        if x_pairs is not None:  # views made once, not per block (a view cost about 200 cycles)
            pairs = (x_bounds, simd.borrowed_flat(x_pairs), x_pairs.shape[1], simd.borrowed_flat(scale).view(np.int32),
                     nan_code == _CODE8_NAN_BY_MINIMUM)
        while row + ROW_BLOCK <= end:
            for r in range(ROW_BLOCK):
                _fill_row_table(magnitudes, scale[row + r], bf16, nan_code, tables[r])
            starts = (row * k, (row + 1) * k, (row + 2) * k, (row + 3) * k)
            operands = (codes_flat, tables, nan_code, np.uint64(ROW_BLOCK * k))
            if x_pairs is not None:
                _code8_paired_block_rows(pairs, _code8_block_step, x_flat, kp, k // LANES, operands, starts, row, y32)
            else:
                _code8_block_rows(_code8_block_step, x_flat, kp, k // LANES, operands, starts, row, y32)
            row += ROW_BLOCK
    args = (x_flat, kp, codes_flat, k, scale, bf16, magnitudes, nan_code, table_like, keep, fast, slow_blocks,
            column_tables, x_bounds, row, end, y32)
    _code8_rows_by(column_tables, args)


@numba.njit(**NJIT_OPTIONS)
def _code8_rows(x_reg, codes, scale, bf16, magnitudes, nan_code, table_like, keep, fast, slow_blocks, column_tables,
                x_bounds, x_pairs, row, end, y32):
    """Rows row .. end - 1 of _code8_gemv (one task; a function of its own, so that numba's parallel
    passes do not analyse its body): on AVX-512 CPUs blocks of ROW_BLOCK rows first, then the rest one by one,
    by columns where the codes are re-encoded (_code8_column_rows), else by the table (_code8_table_rows).
    Compiled without the BF16 pairs (x_pairs not read): the operator's direct call, as in ``lowbit smoke``, which
    would otherwise compile them too (about 2 s more for its first call)."""
    _code8_rows_body(x_reg, codes, scale, bf16, magnitudes, nan_code, table_like, keep, fast, slow_blocks,
                     column_tables, x_bounds, None, row, end, y32)


@numba.njit(**NJIT_OPTIONS)
def _code8_rows_paired(x_reg, codes, scale, bf16, magnitudes, nan_code, table_like, keep, fast, slow_blocks,
                       column_tables, x_bounds, x_pairs, row, end, y32):
    """_code8_rows with rows of x in BF16 pairs where _code8_pairable: the rows of the one-call GEMV of a
    prepared weight (serial_gemv, parallel_gemv), compiled only for it."""
    _code8_rows_body(x_reg, codes, scale, bf16, magnitudes, nan_code, table_like, keep, fast, slow_blocks,
                     column_tables, x_bounds, x_pairs, row, end, y32)


@numba.njit(**NJIT_OPTIONS)
def _code8_table_rows(x_flat, kp, codes_flat, k, scale, bf16, magnitudes, nan_code, table_like, keep, fast,
                      slow_blocks, column_tables, x_bounds, row, end, y32):
    """Rows row .. end - 1 of _code8_rows one by one, by the table (codes not re-encoded)."""
    x_flat, codes_flat = simd.borrowed_flat(x_flat), simd.borrowed_flat(codes_flat)  # see _code8_column_rows
    table, scratch = _row_table(table_like), simd.stack_bytes(LANES)
    for row in range(row, end):
        _code8_table_row(x_flat, kp, codes_flat, k, scale, bf16, magnitudes, nan_code, table, keep, scratch, row, y32)


@numba.njit(**NJIT_OPTIONS)
def _code8_column_rows(x_flat, kp, codes_flat, k, scale, bf16, magnitudes, nan_code, table_like, keep, fast,
                       slow_blocks, column_tables, x_bounds, row, end, y32):
    """Rows row .. end - 1 of _code8_rows one by one, codes re-encoded by columns: as ``fast`` says."""
    # The loops take views without reference counting (the arrays, though borrowed views in the caller, again:
    # an argument's reference counting is not compiled away; numba counts references at every step of an
    # inlined loop: 2-3x the time) and this function's own scratch and row table (the caller's, which might
    # alias anything: 8-10 % more time); the row's table is a 1-D byte table (BF16 x only, as every row by
    # columns).
    table, scratch = _row_table(table_like), simd.stack_bytes(LANES)
    x_flat, codes_flat = simd.borrowed_flat(x_flat), simd.borrowed_flat(codes_flat)
    slow_flat, tables, row_table = (simd.borrowed_flat(slow_blocks), simd.borrowed_flat(column_tables),
                                    simd.borrowed_flat(table))
    for row in range(row, end):
        if fast[row] == 0:
            _code8_table_row(x_flat, kp, codes_flat, k, scale, bf16, magnitudes, nan_code, table, keep, scratch, row,
                             y32)
            continue
        e_s = _scale_exponent(scale[row])
        if fast[row] == 1:
            for m in range(y32.shape[0]):
                y32[m, row] = _code8_column_row_sum(x_flat, m * kp, codes_flat, row * k, k, _row_columns,
                                                    (tables, row),
                                                    _columns_fused(x_bounds, m, e_s, e_s, _COLUMN_LOW))
            continue
        _fill_row_table(magnitudes, scale[row], bf16, nan_code, table)
        rows = (tables, row, slow_flat, row * (k // _columns.BLOCK), row_table, nan_code)
        for m in range(y32.shape[0]):
            y32[m, row] = _code8_column_row_sum(x_flat, m * kp, codes_flat, row * k, k, _row_columns_or_table, rows,
                                                _columns_fused(x_bounds, m, e_s, e_s, _CODE8_LOW))


_code8_rows_by = _by_column_tables(_code8_column_rows, _code8_table_rows)


@numba.njit(**_INLINE)
def _code8_table_row(x_flat, kp, codes_flat, k, scale, bf16, magnitudes, nan_code, table, keep, scratch, row, y32):
    """y32[:, row] of a row of W by its row table (``table``, filled here), for every row of x."""
    _fill_row_table(magnitudes, scale[row], bf16, nan_code, table)
    for m in range(y32.shape[0]):
        y32[m, row] = _code8_row_sum(x_flat, m * kp, codes_flat, row * k, k, table, nan_code, keep, scratch)


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _code8_gemv(x_reg, codes, scale, bf16, magnitudes, nan_code, table_like, keep, fast, slow_blocks, column_tables,
                x_bounds, x_pairs, y32):
    """codes (N, K) uint8; scale (N,) float32 and magnitudes (128,) float32 as _fill_row_table takes them;
    bf16: x is BF16 (else FP16); nan_code: the code that decodes to NaN; table_like: an array of the
    row-table kind (see code8_decode); keep int32[64] (the tail's lanes); fast (N,) uint8: for 8-bit codes
    re-encoded by columns, per row 1 where code8_columns_half decodes it with its column table (column_tables
    (N, _columns.TABLE_BYTES) uint8), 2 where it does but for the blocks of 32 codes marked in slow_blocks
    (N, K/32) uint8 (by the row's table), 0 where the table decodes it (whose magnitudes and NaN code are then
    the re-encoded ones); for codes not re-encoded the three are empty, column_tables int8 (_NOT_BY_COLUMNS:
    the kernels are compiled without the columns' code); x_bounds, x_pairs: _code8_x_operands (x's exponent
    bounds, read where the codes are re-encoded or x's BF16 pairs were made; x_pairs (M, 0) where they were
    not; read by _code8_gemv_paired only); x_reg (M, Kp) float32 (register order, zero-padded); y32 (M, N)
    float32. Every row, in numba's parallel loop (_code8_rows: some rows on the calling thread)."""
    n = codes.shape[0]
    for task in numba.prange((n + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        _code8_rows(x_reg, codes, scale, bf16, magnitudes, nan_code, table_like, keep, fast, slow_blocks,
                    column_tables, x_bounds, x_pairs, task * _ROWS_PER_TASK, min(n, (task + 1) * _ROWS_PER_TASK), y32)


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _code8_gemv_paired(x_reg, codes, scale, bf16, magnitudes, nan_code, table_like, keep, fast, slow_blocks,
                       column_tables, x_bounds, x_pairs, y32):
    """_code8_gemv by _code8_rows_paired: the one-call GEMV's parallel rows."""
    n = codes.shape[0]
    for task in numba.prange((n + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        _code8_rows_paired(x_reg, codes, scale, bf16, magnitudes, nan_code, table_like, keep, fast, slow_blocks,
                           column_tables, x_bounds, x_pairs, task * _ROWS_PER_TASK,
                           min(n, (task + 1) * _ROWS_PER_TASK), y32)


@numba.njit(**_INLINE)
def _mxfp8_row_sum(round_to, x_flat, x0, codes_flat, scales_flat, c0, s0, k, table, scratch, bf16):
    acc0 = simd.f32v_zero()
    acc1 = simd.f32v_zero()
    for t in range(-(-k // LANES)):
        w0, w1 = _mxfp8_row_step(round_to, codes_flat, scales_flat, c0, s0, t, k, table, scratch, bf16)
        acc0, acc1 = _accumulate(acc0, acc1, x_flat, x0 + LANES * t, w0, w1)
    return _row_sum_code8(acc0, acc1)


@numba.njit(**_INLINE)
def _mxfp8_block_step(operands, start, r, t):
    """Step t of the MXFP8 row whose codes start at ``start`` (its E8M0 bytes at start // mxfp8.BLOCK), for
    rows whose weights need no rounding (_MXFP8_EXACT_BYTES): operands (codes, scales, table, ahead: the
    prefetch distance of the codes, see _prefetch_ahead), flat."""
    codes_flat, scales_flat, table, ahead = operands
    _prefetch_ahead(codes_flat, np.uint64(start + LANES * t), ahead)
    s = start // mxfp8.BLOCK + 2 * t
    return _mxfp8_step(_exact, codes_flat, start + LANES * t, table, scales_flat[s], scales_flat[s + 1], False)


@numba.njit(**_INLINE)
def _mxfp8_table_row(x_flat, kp, codes_flat, scales_flat, k, blocks, bf16, table, scratch, row, y32):
    """y32[:, row] of a row of W decoded by the table (_mxfp8_step), for every row of x: the rounding to x's
    dtype skipped where every scale byte of the row lies in the exact range."""
    low, high = _low_byte_range(scales_flat, row * blocks, blocks)
    exact_range = _MXFP8_EXACT_BYTES_BF16 if bf16 else _MXFP8_EXACT_BYTES_F16
    exact = exact_range[0] <= low and high <= exact_range[1]
    c0, s0 = row * k, row * blocks
    for m in range(y32.shape[0]):
        if exact:
            y32[m, row] = _mxfp8_row_sum(_exact, x_flat, m * kp, codes_flat, scales_flat, c0, s0, k, table,
                                         scratch, bf16)
        else:
            y32[m, row] = _mxfp8_row_sum(_round_to_x, x_flat, m * kp, codes_flat, scales_flat, c0, s0, k, table,
                                         scratch, bf16)


@numba.njit(**NJIT_OPTIONS)
def _mxfp8_rows(x_reg, codes, scales, bf16, table, fast, slow_blocks, column_tables, x_bounds, row, end, y32):
    """Rows row .. end - 1 of _mxfp8_gemv (one task). Codes re-encoded by columns (_mxfp8_column_rows): the rows
    of ``fast`` by columns (the table of each 32-block's E8M0 byte in ``column_tables``; in the rows marked 2
    the blocks ``slow_blocks`` marks by the table: _block_columns_or_table), the others one by one by the
    table. Else (_mxfp8_table_rows) blocks of ROW_BLOCK rows whose scale bytes all lie in the exact range (and
    K a multiple of 64) go through _block_sums, other rows one by one."""
    k = codes.shape[1]
    blocks = scales.shape[1]
    kp = x_reg.shape[1]
    x_flat, codes_flat, scales_flat = simd.borrowed_flat(x_reg), simd.borrowed_flat(codes), simd.borrowed_flat(scales)
    args = (x_flat, kp, codes_flat, scales_flat, k, blocks, bf16, table, fast, slow_blocks, column_tables, x_bounds,
            row, end, y32)
    _mxfp8_rows_by(column_tables, args)


@numba.njit(**NJIT_OPTIONS)
def _mxfp8_table_rows(x_flat, kp, codes_flat, scales_flat, k, blocks, bf16, table, fast, slow_blocks, column_tables,
                      x_bounds, row, end, y32):
    """Rows row .. end - 1 of _mxfp8_rows, codes not re-encoded: by the table."""
    x_flat, codes_flat = simd.borrowed_flat(x_flat), simd.borrowed_flat(codes_flat)  # see _code8_column_rows
    scales_flat, scratch = simd.borrowed_flat(scales_flat), simd.stack_bytes(LANES)
    exact_range = _MXFP8_EXACT_BYTES_BF16 if bf16 else _MXFP8_EXACT_BYTES_F16
    while row < end:
        if BLOCK_ROWS and k % LANES == 0 and row + ROW_BLOCK <= end:
            low, high = _low_byte_range(scales_flat, row * blocks, ROW_BLOCK * blocks)  # four consecutive rows
            if exact_range[0] <= low and high <= exact_range[1]:
                starts = (row * k, (row + 1) * k, (row + 2) * k, (row + 3) * k)
                operands = (codes_flat, scales_flat, table, np.uint64(ROW_BLOCK * k))
                _code8_block_rows(_mxfp8_block_step, x_flat, kp, k // LANES, operands, starts, row, y32)
                row += ROW_BLOCK
                continue
        _mxfp8_table_row(x_flat, kp, codes_flat, scales_flat, k, blocks, bf16, table, scratch, row, y32)
        row += 1


@numba.njit(**NJIT_OPTIONS)
def _mxfp8_column_rows(x_flat, kp, codes_flat, scales_flat, k, blocks, bf16, table, fast, slow_blocks, column_tables,
                       x_bounds, row, end, y32):
    """Rows row .. end - 1 of _mxfp8_rows, codes re-encoded by columns: as ``fast`` says."""
    # views without reference counting and a scratch of its own (as _code8_column_rows')
    x_flat, codes_flat = simd.borrowed_flat(x_flat), simd.borrowed_flat(codes_flat)
    scales_flat, scratch = simd.borrowed_flat(scales_flat), simd.stack_bytes(LANES)
    slow_flat, tables, flat_table = (simd.borrowed_flat(slow_blocks), simd.borrowed_flat(column_tables),
                                     simd.borrowed_flat(table))
    for row in range(row, end):
        if fast[row] == 0:
            _mxfp8_table_row(x_flat, kp, codes_flat, scales_flat, k, blocks, bf16, table, scratch, row, y32)
            continue
        low, high = _low_byte_range(scales_flat, row * blocks, blocks)
        lowest = _COLUMN_LOW if fast[row] == 1 else _CODE8_LOW
        rows = (tables, scales_flat, row * blocks, slow_flat, flat_table)
        for m in range(y32.shape[0]):
            fused = _columns_fused(x_bounds, m, low - 127, high - 127, lowest)
            if fast[row] == 1:
                y32[m, row] = _code8_column_row_sum(x_flat, m * kp, codes_flat, row * k, k, _block_columns, rows,
                                                    fused)
            else:
                y32[m, row] = _code8_column_row_sum(x_flat, m * kp, codes_flat, row * k, k, _block_columns_or_table,
                                                    rows, fused)


_mxfp8_rows_by = _by_column_tables(_mxfp8_column_rows, _mxfp8_table_rows)


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _mxfp8_gemv(x_reg, codes, scales, bf16, table, fast, slow_blocks, column_tables, x_bounds, y32):
    """codes (N, K) uint8 E4M3, scales (N, K/32) uint8 E8M0; bf16: x is BF16 (else FP16); table: the E4M3
    code table of the kind code8_decode reads; fast (N,) uint8: for codes re-encoded by columns
    (_mxfp8_prepared_operands), per row 1 where code8_columns_half decodes it with the column tables of the
    256 E8M0 bytes, column_tables (256, _columns.TABLE_BYTES) uint8, 2 where it does but for the 32-blocks
    marked in slow_blocks (N, K/32) uint8 (by the table), 0 where the table decodes it; for codes not
    re-encoded the three are empty, column_tables int8 (as _code8_gemv's); x_bounds (M, 2) int64: _x_bounds
    of x_reg where the codes are re-encoded (else empty, not read); x_reg (M, Kp) float32 (CODE8_ORDER,
    zero-padded); y32 (M, N) float32. Every row, as _code8_gemv."""
    n = codes.shape[0]
    for task in numba.prange((n + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        _mxfp8_rows(x_reg, codes, scales, bf16, table, fast, slow_blocks, column_tables, x_bounds,
                    task * _ROWS_PER_TASK, min(n, (task + 1) * _ROWS_PER_TASK), y32)

