"""The batched kernels (GEMV_MAX_M < M <= BATCH_MAX_M): blocks of rows of W decoded once into a small
buffer and multiplied with every row of x, no torch GEMM (docs/weight_only.md, 'Kernels', CPU batched kernel)."""

from __future__ import annotations

import numba
import numpy as np

from lowbit.kernels.cpu import _code8_columns as _columns
from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu._runtime import NJIT_OPTIONS, PARALLEL_NJIT_OPTIONS, aligned_empty
from lowbit.kernels.cpu._weight_only_decode8 import _by_column_tables, _fill_row_table, code8_columns_half
from lowbit.kernels.cpu._weight_only_layout import HALF, LANES, _INLINE
from lowbit.kernels.cpu._weight_only_steps import ROW_BLOCK, _prefetch_ahead, _round_bf16, _round_f16, _row_table
from lowbit.kernels.cpu._weight_only_tiles import _code8_tile_row, _hifloat4_tile_row, _mxfp4_tile_row, _mxfp8_tile_row


# y32 (M, N) <- x (M, Kp) @ W.T, x in the format's register order. Per task, blocks of ROW_BLOCK rows of W are
# decoded once into a small buffer (the same register order) and multiplied with every row of x, in chunks of K
# that keep the four rows' chunk in the L1 cache. No torch GEMM and no dense copy of W. The products:
# * AVX512-BF16 CPUs (BATCH_IN_BF16): BF16 x's bits and BF16 weights, two rows of x at a time, by BF16 dot
#   products (vdpbf16ps: 32 multiply-adds per instruction, twice a float32 FMA's); every weight is a BF16 value
#   for BF16 x, so nothing is rounded on the way in. BF16 x only.
# * Other CPUs: x widened to float32 (FP16 or BF16, exactly), float32 weights, float32 fused multiply-adds, two
#   rows of x at a time into one-register accumulators (F32N: as F32V, eight of them would not fit AVX2's 16
#   registers). Without BF16 instructions torch's BF16 GEMM is slow, and the GEMM path's float32 GEMM reads a
#   float32 copy of W, tile by tile: at M = 5 it took 3.8x the time of four rows' bit-exact GEMVs (AMD Zen 3,
#   benchmarks/results_weight_only.md, 'Batched decode without BF16 instructions').
# The order of the sums is not the reference's (the GEMM path's tolerance, docs/weight_only.md).
BATCH_IN_BF16 = simd.HAS_AVX512BF16
_BATCH_ROWS_PER_TASK = 64  # rows of W per prange iteration (16 blocks: one buffer allocation each)
_BATCH_CHUNK = 1024  # elements of K per pass over the rows of x (four rows of W: 8 KiB of BF16, 16 KiB of float32)


@numba.njit(**_INLINE)
def _block_products(zero, load, product, width, x_flat, kp, m_rows, w_flat, rows, row, y32):
    """y32[:, row .. row + rows - 1] <- x (M rows of Kp, flat) times the ``rows`` <= ROW_BLOCK rows of W in w_flat
    (ROW_BLOCK * Kp; rows past ``rows`` finite), two rows of x at a time against the four of W, ``width``
    elements of K per ``load``, ``product(acc, x, w)`` into eight accumulators from ``zero()``."""
    for c0 in range(0, kp, _BATCH_CHUNK):
        c1 = min(kp, c0 + _BATCH_CHUNK)
        for m in range(0, m_rows, 2):
            m1 = min(m + 1, m_rows - 1)  # an odd last row of x is taken twice
            a0 = b0 = a1 = b1 = a2 = b2 = a3 = b3 = zero()
            for t in range(c0, c1, width):
                xa = load(x_flat, m * kp + t)
                xb = load(x_flat, m1 * kp + t)
                w = load(w_flat, t)
                a0, b0 = product(a0, xa, w), product(b0, xb, w)
                w = load(w_flat, kp + t)
                a1, b1 = product(a1, xa, w), product(b1, xb, w)
                w = load(w_flat, 2 * kp + t)
                a2, b2 = product(a2, xa, w), product(b2, xb, w)
                w = load(w_flat, 3 * kp + t)
                a3, b3 = product(a3, xa, w), product(b3, xb, w)
            sums_a = (simd.f32v_sum_tree(a0), simd.f32v_sum_tree(a1), simd.f32v_sum_tree(a2),
                      simd.f32v_sum_tree(a3))
            sums_b = (simd.f32v_sum_tree(b0), simd.f32v_sum_tree(b1), simd.f32v_sum_tree(b2),
                      simd.f32v_sum_tree(b3))
            for r in range(rows):
                if c0 == 0:
                    y32[m, row + r] = sums_a[r]
                    y32[m1, row + r] = sums_b[r]
                else:
                    y32[m1, row + r] += sums_b[r]
                    if m1 != m:
                        y32[m, row + r] += sums_a[r]


@numba.njit(**_INLINE)
def _f32v_zero():
    return simd.f32v_zero()


@numba.njit(**_INLINE)
def _f32n_zero():
    return simd.f32n_zero()


@numba.njit(**_INLINE)
def _i32v_load(arr, index):
    return simd.i32v_load(arr, index)


@numba.njit(**_INLINE)
def _f32n_load(arr, index):
    return simd.f32n_load(arr, index)


@numba.njit(**_INLINE)
def _dot_bf16(acc, x, w):
    return simd.f32v_dot_bf16(acc, x, w)


@numba.njit(**_INLINE)
def _fma_narrow(acc, x, w):
    return simd.f32n_fma(x, w, acc)


@numba.njit(**NJIT_OPTIONS)
def _batch_block(x_flat, kp, m_rows, w_flat, rows, row, y32):
    """_block_products of x and W as BF16 bits (flat int16; 64 per load: 32 pairs) by BF16 dot products."""
    _block_products(_f32v_zero, _i32v_load, _dot_bf16, LANES, x_flat, kp, m_rows, w_flat, rows, row, y32)


@numba.njit(**NJIT_OPTIONS)
def _batch_block_f32(x_flat, kp, m_rows, w_flat, rows, row, y32):
    """_block_products of x and W in float32 (flat) by fused multiply-adds into one-register accumulators (F32N):
    six loads per eight multiply-adds."""
    _block_products(_f32n_zero, _f32n_load, _fma_narrow, simd.NARROW, x_flat, kp, m_rows, w_flat, rows, row, y32)


# The batched kernels' products and the element type of their decoded rows of W.
_batch_products = _batch_block if BATCH_IN_BF16 else _batch_block_f32
_BATCH_WEIGHT = np.int16 if BATCH_IN_BF16 else np.float32


@numba.njit(**_INLINE)
def _store_steps(w_flat, at, w0, w1):
    """A step's weights in the format's register order: float32, or BF16 bits (int16, by truncation: exact for
    BF16 values)."""
    simd.f32v_store_any(w_flat, at, w0)
    simd.f32v_store_any(w_flat, at + HALF, w1)


@numba.njit(**NJIT_OPTIONS)
def _gather_x_bits(x_bits, order, x_reg):
    """x_reg (M, Kp) int16 <- the BF16 bits of x (M, K), each 64-element step in the register order ``order``
    (int32[64]), zeros past K."""
    m_rows, k = x_bits.shape
    kp = x_reg.shape[1]
    full = k // LANES * LANES
    for m in range(m_rows):
        for j in range(0, full, LANES):
            for p in range(LANES):
                x_reg[m, j + p] = x_bits[m, j + order[p]]
        for j in range(full, kp, LANES):  # the short last step: zeros past K
            for p in range(LANES):
                e = j + order[p]
                x_reg[m, j + p] = x_bits[m, e] if e < k else 0


@numba.njit(**_INLINE)
def _batch_buffer(kp, rows):
    """A ROW_BLOCK * Kp row buffer (_BATCH_WEIGHT) whose rows from ``rows`` on are zeros, starting on a 64-byte
    boundary (aligned_empty: a numba array of 64 KiB landed 32 bytes off one every time, and every 64-byte load
    of a row then straddled two cache lines)."""
    w = aligned_empty(ROW_BLOCK, kp, _BATCH_WEIGHT).reshape(ROW_BLOCK * kp)
    w[rows * kp :] = 0
    return w


@numba.njit(**_INLINE)
def _batch_rows(decode_row, operands, first, end, x_flat, kp, m_rows, y32):
    """Rows first .. end - 1 of W: each block of ROW_BLOCK rows (from ``first``) decoded by ``decode_row(operands,
    row, w, at)`` into one buffer, then multiplied with every row of x (_batch_products)."""
    w = _batch_buffer(kp, ROW_BLOCK)
    for row in range(first, end, ROW_BLOCK):
        rows = min(ROW_BLOCK, end - row)
        if rows < ROW_BLOCK:
            w = _batch_buffer(kp, rows)
        for r in range(rows):
            decode_row(operands, row + r, w, r * kp)
        _batch_products(x_flat, kp, m_rows, w, rows, row, y32)


@numba.njit(**_INLINE)
def _code8_column_batch_row(operands, row, w, at):
    """A row of codes re-encoded by columns: by columns where they take all of its codes (fast 1), else by its
    table (_code8_table_batch_row)."""
    codes_flat, k, fast, column_tables = operands[0], operands[1], operands[-2], operands[-1]
    if fast[row] == 1:
        for t in range(k // LANES):
            _prefetch_ahead(codes_flat, np.uint64(row * k + LANES * t), np.uint64(ROW_BLOCK * k))
            start = row * k + LANES * t
            _store_steps(w, at + LANES * t, code8_columns_half(codes_flat, start, column_tables, row, _columns.ADDENDS),
                         code8_columns_half(codes_flat, start + HALF, column_tables, row, _columns.ADDENDS))
        return
    _code8_table_batch_row(operands, row, w, at)


@numba.njit(**_INLINE)
def _code8_table_batch_row(operands, row, w, at):
    """A row by its table (_fill_row_table)."""
    codes_flat, k, scale, bf16, magnitudes, nan_code, table, keep, scratch = operands[:9]
    _fill_row_table(magnitudes, scale[row], bf16, nan_code, table)
    _code8_tile_row(_store_steps, codes_flat, k, row, table, nan_code, keep, scratch, w, at)


@numba.njit(**_INLINE)
def _mxfp8_batch_row(operands, row, w, at):
    codes_flat, scales_flat, k, blocks, table, bf16 = operands
    if bf16:
        _mxfp8_tile_row(_round_bf16, _store_steps, codes_flat, scales_flat, row, k, blocks, table, w, at)
    else:
        _mxfp8_tile_row(_round_f16, _store_steps, codes_flat, scales_flat, row, k, blocks, table, w, at)


@numba.njit(**_INLINE)
def _mxfp4_batch_row(operands, row, w, at):
    scales_flat, codes_flat, blocks, scratch = operands
    _mxfp4_tile_row(_store_steps, scales_flat, codes_flat, row, blocks, scratch, w, at)


@numba.njit(**_INLINE)
def _hifloat4_batch_row(operands, row, w, at):
    words_flat, value_flat, blocks = operands
    _hifloat4_tile_row(_store_steps, words_flat, value_flat, row, blocks, w, at)


@numba.njit(**NJIT_OPTIONS)
def _code8_batched_rows(x_reg, codes, scale, bf16, magnitudes, nan_code, table_like, keep, fast, slow_blocks,
                        column_tables, row, end, y32):
    """Rows row .. end - 1 of W: the serial part of _code8_batched."""
    k = codes.shape[1]
    m_rows, kp = x_reg.shape
    operands = (simd.flat(codes), k, scale, bf16, magnitudes, nan_code, _row_table(table_like), keep,
                np.zeros(LANES, dtype=np.uint8), fast, column_tables)
    args = (operands, row, end, simd.flat(x_reg), kp, m_rows, y32)
    _code8_batch_rows_by(column_tables, args)


@numba.njit(**NJIT_OPTIONS)
def _code8_column_batch_rows(operands, first, end, x_flat, kp, m_rows, y32):
    _batch_rows(_code8_column_batch_row, operands, first, end, x_flat, kp, m_rows, y32)


@numba.njit(**NJIT_OPTIONS)
def _code8_table_batch_rows(operands, first, end, x_flat, kp, m_rows, y32):
    _batch_rows(_code8_table_batch_row, operands, first, end, x_flat, kp, m_rows, y32)


_code8_batch_rows_by = _by_column_tables(_code8_column_batch_rows, _code8_table_batch_rows)


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _code8_batched(x_reg, codes, scale, bf16, magnitudes, nan_code, table_like, keep, fast, slow_blocks, column_tables,
                   y32):
    n = codes.shape[0]
    for task in numba.prange(-(-n // _BATCH_ROWS_PER_TASK)):
        _code8_batched_rows(x_reg, codes, scale, bf16, magnitudes, nan_code, table_like, keep, fast, slow_blocks,
                            column_tables, task * _BATCH_ROWS_PER_TASK, min(n, (task + 1) * _BATCH_ROWS_PER_TASK), y32)


@numba.njit(**NJIT_OPTIONS)
def _mxfp8_batched_rows(x_reg, codes, scales, bf16, table, fast, slow_blocks, column_tables, row, end, y32):
    """Rows row .. end - 1 of W: the serial part of _mxfp8_batched (every row by the table)."""
    k = codes.shape[1]
    m_rows, kp = x_reg.shape
    operands = (simd.flat(codes), simd.flat(scales), k, scales.shape[1], table, bf16)
    _batch_rows(_mxfp8_batch_row, operands, row, end, simd.flat(x_reg), kp, m_rows, y32)


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _mxfp8_batched(x_reg, codes, scales, bf16, table, fast, slow_blocks, column_tables, y32):
    n = codes.shape[0]
    for task in numba.prange(-(-n // _BATCH_ROWS_PER_TASK)):
        _mxfp8_batched_rows(x_reg, codes, scales, bf16, table, fast, slow_blocks, column_tables,
                            task * _BATCH_ROWS_PER_TASK, min(n, (task + 1) * _BATCH_ROWS_PER_TASK), y32)


@numba.njit(**NJIT_OPTIONS)
def _mxfp4_batched_rows(x_reg, scales, codes, row, end, y32):
    """Rows row .. end - 1 of W: the serial part of _mxfp4_batched."""
    m_rows, kp = x_reg.shape
    operands = (simd.flat(scales), simd.flat(codes), scales.shape[1], np.zeros(HALF, dtype=np.uint8))
    _batch_rows(_mxfp4_batch_row, operands, row, end, simd.flat(x_reg), kp, m_rows, y32)


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _mxfp4_batched(x_reg, scales, codes, y32):
    n = scales.shape[0]
    for task in numba.prange(-(-n // _BATCH_ROWS_PER_TASK)):
        _mxfp4_batched_rows(x_reg, scales, codes, task * _BATCH_ROWS_PER_TASK,
                            min(n, (task + 1) * _BATCH_ROWS_PER_TASK), y32)


@numba.njit(**NJIT_OPTIONS)
def _hifloat4_batched_rows(x_reg, words, value, codes, signs, row, end, y32):
    """Rows row .. end - 1 of W: the serial part of _hifloat4_batched (codes, signs: the GEMV's indexed pairs,
    unused here)."""
    m_rows, kp = x_reg.shape
    operands = (simd.flat(words), simd.flat(value), words.shape[1])
    _batch_rows(_hifloat4_batch_row, operands, row, end, simd.flat(x_reg), kp, m_rows, y32)


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _hifloat4_batched(x_reg, words, value, codes, signs, y32):
    n = words.shape[0]
    for task in numba.prange(-(-n // _BATCH_ROWS_PER_TASK)):
        _hifloat4_batched_rows(x_reg, words, value, codes, signs, task * _BATCH_ROWS_PER_TASK,
                               min(n, (task + 1) * _BATCH_ROWS_PER_TASK), y32)


