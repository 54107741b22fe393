"""The GEMV kernels of 4-bit weights (MXFP4, HiFloat4): y32 (M, N) <- x (M, Kp, register order) @ W.T,
bit-exact with the reference (docs/weight_only.md, 'Kernels')."""

from __future__ import annotations

import numba
import numpy as np

from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu._runtime import NJIT_OPTIONS, PARALLEL_NJIT_OPTIONS, bound_njit
from lowbit.kernels.cpu._weight_only_decode4 import hifloat4_indexed_pairs, hifloat4_pairs, mxfp4_pairs
from lowbit.kernels.cpu._weight_only_layout import (HALF, LANES, _INLINE, _ROWS_PER_TASK, _row_sum_4bit,
                                                    _row_sum_hifloat4, _row_sum_nibbles)
from lowbit.kernels.cpu._weight_only_steps import (BLOCK_ROWS, ROW_BLOCK, _accumulate, _accumulate_fused, _block_sums,
                                                   _block_sums_pair, _dot_pairs, _dot_pairs_four_x, _fma_products,
                                                   _hifloat4_step, _low_byte_range, _mxfp4_odd_block,
                                                   _mxfp4_pair_of_blocks, _mxfp4_step, _prefetch_ahead, _store_block,
                                                   _x_pair_step, _x_row_products, _x_step)


@numba.njit(**_INLINE)
def _mxfp4_row_sum(accumulate, x_flat, x0, scales_flat, codes_flat, b0, blocks, scratch):
    """One row of W (its blocks b0 .. b0 + blocks - 1) times x_flat[x0:] (FOUR_BIT_ORDER), summed with
    ``accumulate`` (_accumulate or _accumulate_fused: a compile-time choice, so each loop is branch-free)."""
    acc0 = simd.f32v_zero()
    acc1 = simd.f32v_zero()
    for t in range(blocks // 2):
        w0, w1 = _mxfp4_pair_of_blocks(codes_flat, scales_flat, np.uint64(b0 + 2 * t))
        acc0, acc1 = accumulate(acc0, acc1, x_flat, x0 + LANES * t, w0, w1)
    if blocks % 2:
        w0, w1 = _mxfp4_odd_block(codes_flat, b0 + blocks - 1, scales_flat, scratch)
        acc0, acc1 = accumulate(acc0, acc1, x_flat, x0 + LANES * (blocks // 2), w0, w1)
    return _row_sum_4bit(acc0, acc1)


@numba.njit(**_INLINE)
def _hifloat4_row_sum(accumulate, x_flat, x0, words_flat, value_flat, b0, blocks):
    """One row of W (blocks b0 .. b0 + blocks - 1) times x_flat[x0:], as _mxfp4_row_sum."""
    acc0 = simd.f32v_zero()
    acc1 = simd.f32v_zero()
    for b in range(blocks):
        w0, w1 = _hifloat4_step(words_flat, value_flat, b0 + b)
        acc0, acc1 = accumulate(acc0, acc1, x_flat, x0 + LANES * b, w0, w1)
    return _row_sum_hifloat4(acc0, acc1)


@numba.njit(**_INLINE)
def _mxfp4_block_step(operands, start, r, t):
    """MXFP4 step t of the row whose blocks start at ``start``: operands (scales, codes, ahead: the prefetch
    distance of the codes, see _prefetch_ahead), flat."""
    scales_flat, codes_flat, ahead = operands
    b = np.uint64(start + 2 * t)  # unsigned: no negative-index wraparound code
    # a step reads half a cache line of codes; prefetched at every step all the same: a prefetch every other
    # step made a branch in the loop, and the fused GEMV of one row of x took 3-12 % more time from memory
    # (Intel Xeon Emerald Rapids, 4096^2 and 12288 x 8192, two threads)
    _prefetch_ahead(codes_flat, np.uint64(16) * b, ahead)
    return _mxfp4_step(codes_flat, 16 * b, scales_flat[b], scales_flat[b + np.uint64(1)])


@numba.njit(**_INLINE)
def _hifloat4_block_step(operands, start, r, t):
    """HiFloat4 step t (= block t) of the row whose blocks start at ``start``: operands (words, value, ahead:
    the prefetch distance of the value bytes, see _prefetch_ahead), flat."""
    words_flat, value_flat, ahead = operands
    _prefetch_ahead(value_flat, np.uint64(32 * (start + t)), ahead)  # at every step: see _mxfp4_block_step
    return _hifloat4_step(words_flat, value_flat, start + t)


@numba.njit(**_INLINE)
def _hifloat4_pair_step(operands, start, r, t):
    """HiFloat4 pair step t (blocks start + 2t and start + 2t + 1) of a row as two I32V of BF16 pairs (low,
    high nibbles; PAIR_ORDER): operands as _hifloat4_block_step's."""
    words_flat, value_flat, ahead = operands
    block = np.uint64(start + 2 * t)
    _prefetch_ahead(value_flat, np.uint64(32) * block, ahead)  # a pair step reads one cache line of value bytes
    return hifloat4_pairs(value_flat, np.uint64(32) * block, words_flat, block)


@numba.njit(**_INLINE)
def _hifloat4_indexed_pair_step(operands, start, r, t):
    """The pair step of _hifloat4_pair_step from a weight prepared for hifloat4_indexed_pairs: operands (words,
    codes, signs, ahead: the prefetch distance of the codes), flat."""
    words_flat, codes_flat, signs_flat, ahead = operands
    block = np.uint64(start + 2 * t)
    _prefetch_ahead(codes_flat, np.uint64(32) * block, ahead)  # a pair step reads one cache line of codes
    if t % 4 == 0:  # and a quarter of one of signs
        _prefetch_ahead(signs_flat, np.uint64(2) * block, ahead // np.uint64(16))
    return hifloat4_indexed_pairs(codes_flat, np.uint64(32) * block, signs_flat, words_flat, block)


@numba.njit(**_INLINE)
def _mxfp4_pair_step(operands, start, r, t):
    """MXFP4 pair step t (blocks start + 4t .. start + 4t + 3) of a row as two I32V of BF16 pairs (PAIR_ORDER):
    operands as _mxfp4_block_step's."""
    scales_flat, codes_flat, ahead = operands
    b = np.uint64(start + 4 * t)  # unsigned: no negative-index wraparound code
    _prefetch_ahead(codes_flat, np.uint64(16) * b, ahead)  # a pair step reads one cache line of codes
    return mxfp4_pairs(codes_flat, np.uint64(16) * b, scales_flat, b)


@numba.njit(**_INLINE)
def _all_fused(fused, m, lows, highs, count):
    """Whether row m of x may use fused multiply-adds with each of the ``count`` rows of W whose scale-byte
    ranges are lows[r] .. highs[r] (see _fused_bytes)."""
    result = True
    for r in range(count):
        result = result and fused[m, lows[r]] and fused[m, highs[r]]
    return result


@numba.njit(**_INLINE)
def _x_rows_fused(fused, m, rows, lows, highs):
    """Whether rows m .. m + rows - 1 of x may each use fused multiply-adds with the ROW_BLOCK rows of W whose
    scale-byte ranges are lows / highs (_all_fused)."""
    result = True
    for i in range(rows):
        result = result and _all_fused(fused, m + i, lows, highs, ROW_BLOCK)
    return result


def _nibble_rows(x_reg, scales, packed, *args):
    """Rows row .. end - 1 of a 4-bit GEMV: the template of _mxfp4_rows and _hifloat4_rows (bound_njit), whose
    format is in the bound globals ``_BLOCK_STEPS`` (of a row's number of blocks: the steps of the row for
    _block_sums, or 0 where rows cannot be blocked, an MXFP4 row of an odd number of blocks), ``_ROW_SUM``,
    ``_BLOCK_STEP``, ``_PAIRS``, ``_FUSED_X_ROWS`` and the kernels ``_FUSED_SUMS_X``, ``_PAIR_SUMS``,
    ``_PAIR_SUMS_TWO_X``, ``_PAIR_SUMS_FOUR_X``. A template rather than a function inlined into each format's
    rows kernel: numba copies an inlined function's whole IR, twice, at each call site (3.7 s of compiling for
    the two formats).
    x_reg (M, Kp) register order, scales / packed the format's two weight arrays (N, ...); ``args``: the
    format's arrays for the pair kernels (none for MXFP4; HiFloat4's codes and signs), then fused (M, 256)
    from _fused_bytes, x_pairs and paired from _paired_bytes, row, end and y32 (M, N).
    The last two or three rows of x, where at most ``_FUSED_X_ROWS`` are left and each may fuse with the block,
    are summed with fused multiply-adds together (``_FUSED_SUMS_X``: MXFP4 off AMD Zen). Else, where the number
    of steps is even, a block of rows is summed in BF16 pairs (two steps per product instruction) for four or
    three rows of x at once, else two, where every one of its rows may be for each and ``_PAIR_SUMS_FOUR_X`` /
    ``_PAIR_SUMS_TWO_X`` do them (MXFP4; HiFloat4 prepared by magnitude index); else with fused multiply-adds
    for two rows of x at once where ``_PAIRS`` and both may (_block_sums_pair: HiFloat4 in place, whose step is
    costly to decode; MXFP4's cheap step measured 15-22 % slower so at M = 2 and 4); else in BF16 pairs for
    one row of x (``_PAIR_SUMS``) where ``_FUSED_X_ROWS`` is 0, else with fused multiply-adds, where every one
    of its rows may be; else row by row."""
    # the names of an underscore and capitals (_ROW_SUM, ...) are the bound globals: no module-level value (F821)
    pair_arrays = args[:-6]
    fused, x_pairs, paired, row, end, y32 = args[-6:]
    blocks = scales.shape[1]
    block_steps = _BLOCK_STEPS(blocks)
    m_rows, kp = x_reg.shape
    kq = x_pairs.shape[1]
    pair_steps = block_steps // 2 if block_steps % 2 == 0 else 0
    # borrowed: the rows' loop passes them to inlined functions that loop, each call counting references
    x_flat, scales_flat, packed_flat = simd.borrowed_flat(x_reg), simd.borrowed_flat(scales), simd.borrowed_flat(packed)
    xp_flat = simd.flat(x_pairs)
    scratch = simd.stack_bytes(HALF)
    lows = np.empty(ROW_BLOCK, dtype=np.int64)
    highs = np.empty(ROW_BLOCK, dtype=np.int64)
    while row < end:
        count = ROW_BLOCK if BLOCK_ROWS and block_steps > 0 and row + ROW_BLOCK <= end else 1
        for r in range(count):
            lows[r], highs[r] = _low_byte_range(scales_flat, (row + r) * blocks, blocks)
        starts = (row * blocks, (row + 1) * blocks, (row + 2) * blocks, (row + 3) * blocks)
        operands = (scales_flat, packed_flat, np.uint64(ROW_BLOCK * packed.shape[1]))
        m = np.int64(0)  # not the literal 0: numba would compile each kernel called with m for it too
        while m < m_rows:
            if BLOCK_ROWS:  # a constant: on other CPUs numba prunes the block code before compiling it
                rest = m_rows - m
                if count == ROW_BLOCK and 1 < rest <= _FUSED_X_ROWS and _x_rows_fused(fused, m, rest, lows, highs):
                    _FUSED_SUMS_X(x_flat, (m * kp, (m + 1) * kp, (m_rows - 1) * kp), rest, block_steps, operands,
                                 starts, y32, m, row)
                    m = m_rows
                    continue
                both_paired = m + 1 < m_rows and _all_fused(paired, m, lows, highs, count) and _all_fused(
                    paired, m + 1, lows, highs, count)
                three_paired = both_paired and m + 2 < m_rows and _all_fused(paired, m + 2, lows, highs, count)
                x_rows = 4 if three_paired and m + 3 < m_rows and _all_fused(paired, m + 3, lows, highs, count) else 3
                xs = (m * kq, (m + 1) * kq, (m + 2) * kq, (m + x_rows - 1) * kq)
                if count == ROW_BLOCK and pair_steps > 0 and three_paired and _PAIR_SUMS_FOUR_X(
                        xp_flat, xs, x_rows, pair_steps, operands, pair_arrays, starts, y32, m, row):
                    m += x_rows
                    continue
                if count == ROW_BLOCK and pair_steps > 0 and both_paired:
                    done, first, second = _PAIR_SUMS_TWO_X(xp_flat, m * kq, (m + 1) * kq, pair_steps, operands,
                                                          pair_arrays, starts)
                    if done:
                        _store_block(y32, m, row, first)
                        _store_block(y32, m + 1, row, second)
                        m += 2
                        continue
                if count == ROW_BLOCK and _all_fused(fused, m, lows, highs, count):
                    if _PAIRS and m + 1 < m_rows and _all_fused(fused, m + 1, lows, highs, count):
                        first, second = _block_sums_pair(_BLOCK_STEP, _fma_products, _row_sum_nibbles, _x_step, x_flat,
                                                         m * kp, (m + 1) * kp, block_steps, operands, starts)
                        _store_block(y32, m, row, first)
                        _store_block(y32, m + 1, row, second)
                        m += 2
                        continue
                if (count == ROW_BLOCK and _FUSED_X_ROWS == 0 and pair_steps > 0
                        and _all_fused(paired, m, lows, highs, count)):
                    _store_block(y32, m, row, _PAIR_SUMS(xp_flat, m * kq, pair_steps, operands, pair_arrays, starts))
                    m += 1
                    continue
                if count == ROW_BLOCK and _all_fused(fused, m, lows, highs, count):
                    _store_block(y32, m, row, _block_sums(_BLOCK_STEP, _fma_products, _row_sum_nibbles, _x_step, x_flat,
                                                          m * kp, block_steps, operands, starts))
                    m += 1
                    continue
            for r in range(count):
                b0 = (row + r) * blocks
                if fused[m, lows[r]] and fused[m, highs[r]]:
                    y32[m, row + r] = _ROW_SUM(_accumulate_fused, x_flat, m * kp, scales_flat, packed_flat, b0, blocks,
                                              scratch)
                else:
                    y32[m, row + r] = _ROW_SUM(_accumulate, x_flat, m * kp, scales_flat, packed_flat, b0, blocks,
                                              scratch)
            m += 1
        row += count


@numba.njit(**_INLINE)
def _hifloat4_row(accumulate, x_flat, x0, words_flat, value_flat, b0, blocks, scratch):
    return _hifloat4_row_sum(accumulate, x_flat, x0, words_flat, value_flat, b0, blocks)


@numba.njit(**_INLINE)
def _pair_rows(step, x_flat, x0, steps, operands, first, second):
    """The folded sums of two rows of W (weights at ``first`` and ``second``) in BF16 pairs (pair steps
    ``step``, PAIR_ORDER; x_flat: _paired_bytes's pairs, the x row at x0)."""
    a0, a1, b0, b1 = simd.f32v_zero(), simd.f32v_zero(), simd.f32v_zero(), simd.f32v_zero()
    for t in range(steps):
        x_low, x_high = _x_pair_step(x_flat, x0, t)
        w0, w1 = step(operands, first, 0, t)
        a0, a1 = _dot_pairs(a0, a1, x_low, x_high, w0, w1)
        w0, w1 = step(operands, second, 1, t)
        b0, b1 = _dot_pairs(b0, b1, x_low, x_high, w0, w1)
    return _row_sum_nibbles(a0, a1), _row_sum_nibbles(b0, b1)


@numba.njit(**_INLINE)
def _rows_two_x(step, product, load_x, x_flat, x0, x1, steps, operands, first, second):
    """Two rows of W (weights at ``first`` and ``second``, steps ``step``) times two rows of x (at x0 and x1,
    steps ``load_x``: _x_pair_step with _dot_pairs, or _x_step with _fma_products as ``product``): each step of W
    decoded once for both rows of x, every (x row, W row) summed with the one-row kernel's operations in its
    order (so its sums, bit for bit). Returns the two rows of W's sums for x0, then for x1."""
    a0, a1, b0, b1 = simd.f32v_zero(), simd.f32v_zero(), simd.f32v_zero(), simd.f32v_zero()
    c0, c1, d0, d1 = simd.f32v_zero(), simd.f32v_zero(), simd.f32v_zero(), simd.f32v_zero()
    for t in range(steps):
        x_low, x_high = load_x(x_flat, x0, t)
        y_low, y_high = load_x(x_flat, x1, t)
        w0, w1 = step(operands, first, 0, t)
        a0, a1 = product(a0, a1, x_low, x_high, w0, w1)
        c0, c1 = product(c0, c1, y_low, y_high, w0, w1)
        w0, w1 = step(operands, second, 1, t)
        b0, b1 = product(b0, b1, x_low, x_high, w0, w1)
        d0, d1 = product(d0, d1, y_low, y_high, w0, w1)
    return (_row_sum_nibbles(a0, a1), _row_sum_nibbles(b0, b1)), (_row_sum_nibbles(c0, c1), _row_sum_nibbles(d0, d1))


@numba.njit(**_INLINE)
def _pair_sums_two_x(step, x_flat, x0, x1, steps, operands, starts):
    """The folded sums of a block of rows in BF16 pairs for two rows of x, two rows of W at a time (four would
    take 32 vector registers for the accumulators alone): the 4-tuple of x0's, then x1's."""
    (a, b), (e, f) = _rows_two_x(step, _dot_pairs, _x_pair_step, x_flat, x0, x1, steps, operands, starts[0],
                                 starts[1])
    (c, d), (g, h) = _rows_two_x(step, _dot_pairs, _x_pair_step, x_flat, x0, x1, steps, operands, starts[2],
                                 starts[3])
    return (a, b, c, d), (e, f, g, h)


@numba.njit(**_INLINE)
def _fused_row_three_x(step, x_flat, xs, steps, operands, start):
    """One row of W (weights at ``start``) times three rows of x (float32, register order, at x_flat[xs[i]:])
    with fused multiply-adds: each step decoded once for the three, every (x row, W row) summed as the one-row
    kernel sums it (_block_sums with _fma_products: its bits). Returns the three folded sums."""
    a0, a1, b0, b1 = simd.f32v_zero(), simd.f32v_zero(), simd.f32v_zero(), simd.f32v_zero()
    c0, c1 = simd.f32v_zero(), simd.f32v_zero()
    for t in range(steps):
        w0, w1 = step(operands, start, 0, t)
        a0, a1 = _x_row_products(_fma_products, _x_step, a0, a1, x_flat, xs[0], t, w0, w1)
        b0, b1 = _x_row_products(_fma_products, _x_step, b0, b1, x_flat, xs[1], t, w0, w1)
        c0, c1 = _x_row_products(_fma_products, _x_step, c0, c1, x_flat, xs[2], t, w0, w1)
    return _row_sum_nibbles(a0, a1), _row_sum_nibbles(b0, b1), _row_sum_nibbles(c0, c1)


@numba.njit(**NJIT_OPTIONS)
def _mxfp4_fused_sums_x(x_flat, xs, x_rows, steps, operands, starts, y32, m, row):
    """y32[m : m + x_rows, row : row + ROW_BLOCK]: a block of MXFP4 rows (operands and starts as the block step's)
    times ``x_rows`` (2 or 3) rows of x (float32 in register order at x_flat[xs[i]:]; xs[2] unused for two)
    with fused multiply-adds, each step decoded once for every row of x: for two, two rows of W at a time
    (_rows_two_x); for three, one (_fused_row_three_x: twelve accumulators). A function of its own, as the
    pair kernels."""
    if x_rows == 2:
        for r in range(0, ROW_BLOCK, 2):
            (a, b), (c, d) = _rows_two_x(_mxfp4_block_step, _fma_products, _x_step, x_flat, xs[0], xs[1], steps,
                                         operands, starts[r], starts[r + 1])
            y32[m, row + r], y32[m, row + r + 1], y32[m + 1, row + r], y32[m + 1, row + r + 1] = a, b, c, d
        return
    for r in range(ROW_BLOCK):
        y32[m, row + r], y32[m + 1, row + r], y32[m + 2, row + r] = _fused_row_three_x(
            _mxfp4_block_step, x_flat, xs, steps, operands, starts[r])


@numba.njit(**_INLINE)
def _no_fused_sums_x(x_flat, xs, x_rows, steps, operands, starts, y32, m, row):
    """Stands in for _mxfp4_fused_sums_x where _nibble_rows is told not to use it (``fused_x_rows`` below 2)."""


@numba.njit(**_INLINE)
def _pair_row_four_x(step, x_flat, xs, steps, operands, start):
    """One row of W (weights at ``start``) in BF16 pairs times four rows of x (their pairs at x_flat[xs[i]:]):
    each pair step decoded once for all four, every (x row, W row) summed as _pair_rows sums it (its bits).
    Returns the four folded sums."""
    zero = simd.f32v_zero()
    accs = (zero, zero, zero, zero, zero, zero, zero, zero)
    for t in range(steps):
        w0, w1 = step(operands, start, 0, t)
        accs = _dot_pairs_four_x(accs, x_flat, xs, t, w0, w1)
    a0, a1, b0, b1, c0, c1, d0, d1 = accs
    return _row_sum_nibbles(a0, a1), _row_sum_nibbles(b0, b1), _row_sum_nibbles(c0, c1), _row_sum_nibbles(d0, d1)


@numba.njit(**_INLINE)
def _pair_sums_four_x(step, x_flat, xs, x_rows, steps, operands, starts, y32, m, row):
    """y32[m : m + x_rows, row : row + ROW_BLOCK]: a block of rows in BF16 pairs for ``x_rows`` (4 or 3) rows of x
    (pairs at x_flat[xs[i]:]; for three, xs[3] repeats xs[2] and its sums are dropped), one row of W at a time
    (_pair_row_four_x: eight accumulators)."""
    for r in range(ROW_BLOCK):
        a, b, c, d = _pair_row_four_x(step, x_flat, xs, steps, operands, starts[r])
        y32[m, row + r], y32[m + 1, row + r], y32[m + 2, row + r] = a, b, c
        if x_rows == 4:
            y32[m + 3, row + r] = d


@numba.njit(**_INLINE)
def _pair_sums(step, x_flat, x0, steps, operands, starts):
    """The folded sums of a block of rows in BF16 pairs, two rows at a time: HiFloat4's pair look-ups take
    more registers than a block of four rows leaves (LLVM spilled accumulators every step)."""
    a, b = _pair_rows(step, x_flat, x0, steps, operands, starts[0], starts[1])
    c, d = _pair_rows(step, x_flat, x0, steps, operands, starts[2], starts[3])
    return a, b, c, d


@numba.njit(**_INLINE)
def _indexed_operands(operands, codes, signs):
    """_hifloat4_indexed_pair_step's operands from the rows kernel's (words, value, ahead) and the codes and
    signs of _hifloat4_indexed_operands."""
    words_flat, _, ahead = operands
    return words_flat, simd.borrowed_flat(codes), simd.borrowed_flat(signs), ahead


# Functions of their own, not inlined into the rows kernels: LLVM compiles two small functions much faster
# than one large one (a first run's cost, see docs/weight_only.md, 'Kernels').
@numba.njit(**NJIT_OPTIONS)
def _hifloat4_pair_sums_bf16(x_flat, x0, steps, operands, pair_arrays, starts):
    """HiFloat4's BF16 pair sums of a block of rows: by magnitude index, four rows at a time, where the weight
    was prepared for it (``pair_arrays``: (codes, signs) of _hifloat4_indexed_operands, else empty), else
    from the packed weight in place, two rows at a time."""
    codes, signs = pair_arrays
    if signs.size:
        return _block_sums(_hifloat4_indexed_pair_step, _dot_pairs, _row_sum_nibbles, _x_pair_step, x_flat, x0, steps,
                           _indexed_operands(operands, codes, signs), starts)
    return _pair_sums(_hifloat4_pair_step, x_flat, x0, steps, operands, starts)


@numba.njit(**NJIT_OPTIONS)
def _mxfp4_pair_sums_bf16(x_flat, x0, steps, operands, pair_arrays, starts):
    # four rows at once: with the weight streamed from memory, four streams measured 6 % faster than two
    return _block_sums(_mxfp4_pair_step, _dot_pairs, _row_sum_nibbles, _x_pair_step, x_flat, x0, steps, operands,
                       starts)


@numba.njit(**NJIT_OPTIONS)
def _hifloat4_pair_sums_two_x_bf16(x_flat, x0, x1, steps, operands, pair_arrays, starts):
    """(done, x0's sums, x1's sums): _hifloat4_pair_sums_bf16 for two rows of x where the weight was prepared
    for the pairs by magnitude index (else not done: the rows kernel sums them with fused multiply-adds)."""
    codes, signs = pair_arrays
    if signs.size:
        first, second = _pair_sums_two_x(_hifloat4_indexed_pair_step, x_flat, x0, x1, steps,
                                         _indexed_operands(operands, codes, signs), starts)
        return True, first, second
    return _no_pair_sums_two_x(x_flat, x0, x1, steps, operands, pair_arrays, starts)


@numba.njit(**NJIT_OPTIONS)
def _mxfp4_pair_sums_two_x_bf16(x_flat, x0, x1, steps, operands, pair_arrays, starts):
    first, second = _pair_sums_two_x(_mxfp4_pair_step, x_flat, x0, x1, steps, operands, starts)
    return True, first, second


@numba.njit(**NJIT_OPTIONS)
def _hifloat4_pair_sums_four_x_bf16(x_flat, xs, x_rows, steps, operands, pair_arrays, starts, y32, m, row):
    """_pair_sums_four_x of HiFloat4 where the weight was prepared for the pairs by magnitude index, and True;
    else False (as _hifloat4_pair_sums_two_x_bf16)."""
    codes, signs = pair_arrays
    if not signs.size:
        return False
    _pair_sums_four_x(_hifloat4_indexed_pair_step, x_flat, xs, x_rows, steps,
                      _indexed_operands(operands, codes, signs), starts, y32, m, row)
    return True


@numba.njit(**NJIT_OPTIONS)
def _mxfp4_pair_sums_four_x_bf16(x_flat, xs, x_rows, steps, operands, pair_arrays, starts, y32, m, row):
    _pair_sums_four_x(_mxfp4_pair_step, x_flat, xs, x_rows, steps, operands, starts, y32, m, row)
    return True


@numba.njit(**_INLINE)
def _no_pair_sums(x_flat, x0, steps, operands, pair_arrays, starts):
    """Stands in for a pair kernel where there is none (no row is ever paired there: _paired_bytes) or, for one
    row of x, where _nibble_rows is told not to use it (``fused_x_rows`` above 0)."""
    zero = np.float32(0.0)
    return zero, zero, zero, zero


@numba.njit(**_INLINE)
def _no_pair_sums_two_x(x_flat, x0, x1, steps, operands, pair_arrays, starts):
    """Stands in for a two-row pair kernel where there is none: not done."""
    zero = np.float32(0.0)
    return False, (zero, zero, zero, zero), (zero, zero, zero, zero)


@numba.njit(**_INLINE)
def _no_pair_sums_four_x(x_flat, xs, x_rows, steps, operands, pair_arrays, starts, y32, m, row):
    """Stands in for a four-row pair kernel where there is none: not done."""
    return False


# BF16 pairs need AVX512-BF16 (and the HiFloat4 look-ups AVX512-BITALG): elsewhere they are never compiled
_HIFLOAT4_PAIRS = simd.HAS_AVX512BF16 and simd.HAS_AVX512BITALG
_hifloat4_pair_sums = _hifloat4_pair_sums_bf16 if _HIFLOAT4_PAIRS else _no_pair_sums
# Rows of x with MXFP4 weights: on AMD Zen 4 one row in BF16 pairs (0.72-0.81x the fused multiply-adds' time);
# elsewhere (Intel's Xeons) up to three rows with fused multiply-adds, each step decoded once for all (on an
# Emerald Rapids, whose vdpbf16ps runs one per two cycles and never beside a look-up, a 4096^2 layer took
# 0.79-0.81x the pairs' time at M = 1, 0.74-0.76x at M = 2 and 3), four rows in BF16 pairs
# (benchmarks/results_weight_only.md, 'MXFP4's lone row of x by fused multiply-adds').
_MXFP4_FUSED_X_ROWS = 0 if simd.HAS_AVX512BF16 and simd.HOST_IS_AMD_ZEN else 3
_mxfp4_pair_sums = _mxfp4_pair_sums_bf16 if _MXFP4_FUSED_X_ROWS == 0 else _no_pair_sums
_hifloat4_pair_sums_two_x = _hifloat4_pair_sums_two_x_bf16 if _HIFLOAT4_PAIRS else _no_pair_sums_two_x
_mxfp4_pair_sums_two_x = _mxfp4_pair_sums_two_x_bf16 if simd.HAS_AVX512BF16 else _no_pair_sums_two_x
_hifloat4_pair_sums_four_x = _hifloat4_pair_sums_four_x_bf16 if _HIFLOAT4_PAIRS else _no_pair_sums_four_x
_mxfp4_pair_sums_four_x = _mxfp4_pair_sums_four_x_bf16 if simd.HAS_AVX512BF16 else _no_pair_sums_four_x


@numba.njit(**_INLINE)
def _mxfp4_block_steps(blocks):
    """_block_sums' steps of an MXFP4 row of ``blocks`` blocks of 32 (two blocks each), 0 for an odd number."""
    return blocks // 2 if blocks % 2 == 0 else 0


@numba.njit(**_INLINE)
def _hifloat4_block_steps(blocks):
    """_block_sums' steps of a HiFloat4 row of ``blocks`` blocks of 64: one per block."""
    return blocks


# _mxfp4_rows(x_reg, scales, codes, fused, x_pairs, paired, row, end, y32) and
# _hifloat4_rows(x_reg, words, value, codes, signs, fused, x_pairs, paired, row, end, y32): one task of the GEMV
# (functions of their own, so that numba's parallel passes do not analyse them)
_mxfp4_rows = bound_njit(
    _nibble_rows, "_mxfp4_rows", _BLOCK_STEPS=_mxfp4_block_steps, _ROW_SUM=_mxfp4_row_sum,
    _BLOCK_STEP=_mxfp4_block_step, _PAIRS=False, _FUSED_X_ROWS=_MXFP4_FUSED_X_ROWS, _FUSED_SUMS_X=_mxfp4_fused_sums_x,
    _PAIR_SUMS=_mxfp4_pair_sums, _PAIR_SUMS_TWO_X=_mxfp4_pair_sums_two_x, _PAIR_SUMS_FOUR_X=_mxfp4_pair_sums_four_x)
_hifloat4_rows = bound_njit(
    _nibble_rows, "_hifloat4_rows", _BLOCK_STEPS=_hifloat4_block_steps, _ROW_SUM=_hifloat4_row,
    _BLOCK_STEP=_hifloat4_block_step, _PAIRS=True, _FUSED_X_ROWS=0, _FUSED_SUMS_X=_no_fused_sums_x,
    _PAIR_SUMS=_hifloat4_pair_sums, _PAIR_SUMS_TWO_X=_hifloat4_pair_sums_two_x,
    _PAIR_SUMS_FOUR_X=_hifloat4_pair_sums_four_x)


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _mxfp4_gemv(x_reg, scales, codes, fused, x_pairs, paired, y32):
    """scales (N, K/32) uint8 E8M0, codes (N, K/2) uint8; x_reg (M, Kp) register order; fused, paired:
    _exact_bytes(x_reg, _MXFP4_EXPONENTS, sources, x_pairs), which fills x_pairs; y32 (M, N). Every row, as
    _code8_gemv."""
    n = scales.shape[0]
    for task in numba.prange((n + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        _mxfp4_rows(x_reg, scales, codes, fused, x_pairs, paired, task * _ROWS_PER_TASK,
                    min(n, (task + 1) * _ROWS_PER_TASK), y32)


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _hifloat4_gemv(x_reg, words, value, codes, signs, fused, x_pairs, paired, y32):
    """words (N, K/64) int32 (the scale bytes; or uint32 from _hifloat4_prepared_words, with value in
    _hifloat4_prepare_values' order), value (N, K/2) uint8; codes (N, K/2) uint8 and signs (N, K/32) uint32
    from _hifloat4_indexed_operands for the BF16 pairs, or both empty; x_reg (M, Kp) register order; fused,
    paired: _exact_bytes(x_reg, _HIFLOAT4_EXPONENTS, sources, x_pairs), which fills x_pairs; y32 (M, N). Every
    row, as _code8_gemv."""
    n = words.shape[0]
    for task in numba.prange((n + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        _hifloat4_rows(x_reg, words, value, codes, signs, fused, x_pairs, paired, task * _ROWS_PER_TASK,
                       min(n, (task + 1) * _ROWS_PER_TASK), y32)


