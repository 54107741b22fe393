"""The GEMV's steps and blocks of rows: a row's 64 weights per step in its format's register order, where
fused multiply-adds and BF16 pairs give the reference's bits, short last steps, the sums of ROW_BLOCK rows
at once, and x's per-call operands (docs/weight_only.md, 'Summation order', 'Kernels')."""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import overload

from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu._runtime import NJIT_OPTIONS, aligned_empty, copy_elements
from lowbit.kernels.cpu._weight_only_decode4 import (_hifloat4_levels_by_halves, _hifloat4_scale_levels,
                                                     hifloat4_bf16_step, hifloat4_words_decode, mxfp4_bf16_step)
from lowbit.kernels.cpu._weight_only_decode8 import CODE8_PAIRS, _by_column_tables, code8_decode
from lowbit.kernels.cpu._weight_only_layout import (BYTE_SHUFFLE_NIBBLES, FOUR_BIT_ORDER, HALF, HIFLOAT4_ORDER, LANES,
                                                    NIBBLE_ORDER, _E4M3_NAN_CODE, _E8M0_SCALES, _FIRST_BLOCK,
                                                    _HIFLOAT4_LOOKUP, _INLINE, _MXFP4_LOOKUP, _NO_EXPONENT,
                                                    _SECOND_BLOCK, _to_4bit_order)


# ---- one step: the 64 weights k0 .. k0 + 63 of a row, as two F32V in the format's register order ----------
# The 16-entry tables are read from 64-byte-aligned copies (simd.aligned_table_halves: one cache line a row)
_mxfp4_table_halves = simd.aligned_table_halves("lowbit.mxfp4.lookup", _MXFP4_LOOKUP)
_hifloat4_table_halves = simd.aligned_table_halves("lowbit.hifloat4.lookup", _HIFLOAT4_LOOKUP)


@numba.njit(**_INLINE)
def _nibble_step(tables, packed, start):
    """MXFP4 / HiFloat4: 32 bytes at ``packed[start]`` (flat) through ``tables`` (in simd.signed_tables' form;
    piece p of the F32V serves bytes 16p .. 16p + 15)."""
    pairs = simd.bytes_load(packed, start)
    return simd.lookup16_signed(tables, pairs), simd.lookup16_signed(tables, simd.i32v_shift_right(pairs, 4))


@numba.njit(**_INLINE)
def _mxfp4_step(codes, start, scale_a, scale_b):
    """MXFP4: two blocks (their 32 code bytes at ``codes[start]``) with E8M0 bytes ``scale_a``, ``scale_b``."""
    tables = _mxfp4_table_halves(16 * np.int64(scale_a), 16 * np.int64(scale_b))
    return _nibble_step(tables, codes, start)


@numba.njit(**_INLINE)
def _hifloat4_step_tables(levels, words, value, block):
    """HiFloat4: block ``block`` (flat index): scale word ``words[block]``, 32 value bytes at 32 * block;
    16-entry float32 tables, then ``levels(w0, w1, word)`` applies the flags' powers of two."""
    word = np.uint32(words[np.uint64(block)])
    table = 16 * np.int64(word & 0xFF)
    w0, w1 = _nibble_step(_hifloat4_table_halves(table, table), value, 32 * block)
    return levels(w0, w1, word)


@numba.njit(**_INLINE)
def _hifloat4_step_flags(words, value, block):
    """The tables, then the flags' doublings (any CPU)."""
    return _hifloat4_step_tables(_hifloat4_scale_levels, words, value, block)


@numba.njit(**_INLINE)
def _hifloat4_step_words(words, value, block):
    """The same from the 64-word tables (AVX512-BW): no float work besides the look-up."""
    return hifloat4_words_decode(value, 32 * block, np.uint32(words[np.uint64(block)]))


@numba.njit(**_INLINE)
def _hifloat4_step_shuffled(words, value, block):
    """The same by byte shuffles (hifloat4_bf16_step; AVX2 without AVX-512), in HIFLOAT4_ORDER."""
    return hifloat4_bf16_step(value, 32 * block, words, np.uint64(block))


@numba.njit(**_INLINE)
def _hifloat4_step_multiplied(words, value, block):
    """The tables, then one multiply per register by each lane's 2^(e2 + e3) (_hifloat4_levels_by_halves;
    AVX-512)."""
    return _hifloat4_step_tables(_hifloat4_levels_by_halves, words, value, block)


# A HiFloat4 block as this CPU decodes it fastest, in HIFLOAT4_ORDER: on an Intel Xeon with 480 MiB of L3 the
# multiplied step took 13.0-13.4 cycles per 64 weights where the 64-word tables took 15.9-16.4 (benchmarks/
# results_weight_only.md, 'HiFloat4 by level multipliers'); AMD Zen 4 keeps the word tables it was tuned with.
_hifloat4_step = (_hifloat4_step_multiplied if simd.HAS_AVX512BW and not simd.HOST_IS_AMD_ZEN else
                  _hifloat4_step_words if simd.HAS_AVX512BW else
                  _hifloat4_step_shuffled if BYTE_SHUFFLE_NIBBLES else _hifloat4_step_flags)


@numba.njit(**_INLINE)
def _add_products(acc0, acc1, x_low, x_high, w0, w1):
    """Lanes += (x_low, x_high) * (w0, w1): a multiply, then an add."""
    return simd.f32v_add(acc0, simd.f32v_mul(x_low, w0)), simd.f32v_add(acc1, simd.f32v_mul(x_high, w1))


@numba.njit(**_INLINE)
def _fma_products(acc0, acc1, x_low, x_high, w0, w1):
    """The same with fused multiply-adds: the same bits where every product x * w is exact in float32
    (then fma(x, w, acc) = fl(acc + x * w)); see _fused_bytes."""
    return simd.f32v_fma(x_low, w0, acc0), simd.f32v_fma(x_high, w1, acc1)


@numba.njit(**_INLINE)
def _accumulate(acc0, acc1, x_flat, x0, w0, w1):
    """Lanes += x[x0 .. x0 + 63] * (w0, w1) (x in the same register order), by _add_products."""
    return _add_products(acc0, acc1, simd.f32v_load(x_flat, x0), simd.f32v_load(x_flat, x0 + HALF), w0, w1)


@numba.njit(**_INLINE)
def _accumulate_fused(acc0, acc1, x_flat, x0, w0, w1):
    """The same by _fma_products."""
    return _fma_products(acc0, acc1, simd.f32v_load(x_flat, x0), simd.f32v_load(x_flat, x0 + HALF), w0, w1)


# ---- where a fused multiply-add gives the reference's bits --------------------------------------------------
# x is an FP16 or BF16 value (at most 11 significant bits) and an MXFP4 or HiFloat4 weight has at most 6, so
# x * w fits float32's 24-bit significand: the product is exact unless it falls below 2^-126 (subnormal
# results lose bits) or reaches 2^128 (overflow). Both are ruled out per block from the exponent range of
# the x row and the smallest and largest scale byte of the W row (_fused_bytes); other rows take the mul + add step
# (docs/weight_only.md, 'Summation order').


@numba.njit(**NJIT_OPTIONS)
def _x_exponents(x_flat, start, count):
    """(lowest, highest) floor(log2 |x|) over the finite nonzero float32 x[start : start + count] (a
    subnormal counts as -149: every nonzero float32 is at least 2^-149); (_NO_EXPONENT, -_NO_EXPONENT) when
    there is none. The smallest and largest magnitude bits, HALF lanes at a time (simd.magnitude_range)."""
    low, high = simd.i32v_add_scalar(simd.i32v_zero(), np.int32(-1)), simd.i32v_zero()
    full = count - count % HALF
    for i in range(start, start + full, HALF):
        low, high = simd.magnitude_range(low, high, simd.f32v_load(x_flat, i))
    smallest, largest = simd.i32v_range(low)[0], simd.i32v_range(high)[1]
    bits = x_flat[start + full : start + count].view(np.int32)
    for i in range(count - full):
        magnitude = np.int64(bits[i]) & 0x7FFFFFFF
        if 0 < magnitude < 0x7F800000:
            smallest, largest = min(smallest, magnitude), max(largest, magnitude)
    if largest == 0:
        return _NO_EXPONENT, -_NO_EXPONENT
    return _bits_exponent(smallest), _bits_exponent(largest)


@numba.njit(**_INLINE)
def _bits_exponent(magnitude):
    """floor(log2 v) of the finite nonzero float32 v >= 0 of bits ``magnitude`` (-149 for a subnormal)."""
    biased = magnitude >> 23
    return biased - 127 if biased != 0 else np.int64(-149)


@numba.njit(**NJIT_OPTIONS)
def _x_bounds(x_reg):
    """(M, 2) int64: _x_exponents of each row of x_reg (M, Kp)."""
    m_rows, kp = x_reg.shape
    bounds = np.empty((m_rows, 2), dtype=np.int64)
    x_flat = simd.flat(x_reg)
    for m in range(m_rows):
        bounds[m, 0], bounds[m, 1] = _x_exponents(x_flat, m * kp, kp)
    return bounds


@numba.njit(**_INLINE)
def _fused_bytes(bounds, exponents):
    """(M, 256) bool: whether every product of x row m (exponent bounds: _x_bounds) with a block of scale
    byte b is exact (all nonzero |x w| in [2^-126, 2^128)). As the weight bounds grow with b, the bytes
    where this holds are one interval: a row of W may be summed with _accumulate_fused when its smallest
    and its largest scale byte both pass (_all_fused)."""
    fused = np.empty((bounds.shape[0], 256), dtype=np.bool_)
    for m in range(bounds.shape[0]):
        for b in range(256):
            fused[m, b] = bounds[m, 0] + exponents[0, b] >= -126 and bounds[m, 1] + exponents[1, b] <= 126
    return fused


PAIR_LANES = 2 * LANES  # elements of x per pair step (two steps)


_NO_PAIR_SOURCES = np.zeros(PAIR_LANES, dtype=np.int32)


def _pair_sources(order: list[int], pair_order: list[int]) -> np.ndarray:
    """int32[128]: for each BF16 word of a pair step of x (_paired_bytes), where it comes from in the two
    steps of x in register order ``order``: word 64 r + 2 i + s of the step holds the element
    pair_order[32 r + i] of the second step (s = 0) or the first (s = 1)."""
    position = [order.index(element) for element in range(LANES)]
    return np.array([(1 - s) * LANES + position[pair_order[HALF * r + i]]
                     for r in range(2) for i in range(HALF) for s in range(2)], dtype=np.int32)


@numba.njit(**_INLINE)
def _fill_x_pairs(row, kp, sources, pairs):
    """``pairs`` (Kq,) int16 <- each pair step's BF16 bits of x ``row`` (Kp,) (the int32 view of float32 BF16
    values in register order) in the order ``sources`` (_pair_sources), zeros past Kp."""
    for j0 in range(0, pairs.size, PAIR_LANES):
        for j in range(PAIR_LANES):
            source = j0 + sources[j]
            pairs[j0 + j] = np.int16(row[source] >> 16) if source < kp else np.int16(0)


@numba.njit(**_INLINE)
def _paired_bytes(x_reg, bounds, exponents, sources, x_pairs):
    """(M, 256) bool: whether row m of x_reg (M, Kp) float32, register order, may be summed in BF16 pairs
    (vdpbf16ps, which flushes subnormal inputs and results) with blocks of scale byte b: the row holds BF16
    values only, none of them subnormal, every weight of byte b is a normal float32 and every nonzero |x w|
    lies in [2^-103, 2^128): then every product is exact and a multiple of 2^-126, so no partial sum is
    subnormal and nothing is flushed (docs/weight_only.md, 'Summation order'). As for _fused_bytes, the
    bytes that pass are one interval. Fills the rows of x_pairs (M, Kq) int16, Kq = Kp rounded up to
    PAIR_LANES, that pass anywhere: each pair step's BF16 bits in the order ``sources`` (_pair_sources),
    zeros past Kp."""
    m_rows, kp = x_reg.shape
    kq = x_pairs.shape[1]
    paired = np.zeros((m_rows, 256), dtype=np.bool_)
    for m in range(m_rows):
        if kq == 0 or bounds[m, 0] < -126:  # no pairs on this CPU, or a subnormal x
            continue
        row = x_reg[m].view(np.int32)
        low_bits = 0
        for i in range(kp):
            low_bits |= row[i] & 0xFFFF
        if low_bits != 0:  # not BF16 values
            continue
        _fill_x_pairs(row, kp, sources, x_pairs[m])
        for b in range(256):
            paired[m, b] = (exponents[0, b] >= -126 and bounds[m, 0] + exponents[0, b] >= -103
                            and bounds[m, 1] + exponents[1, b] <= 126)
    return paired


@numba.njit(**NJIT_OPTIONS)
def _exact_bytes(x_reg, exponents, sources, x_pairs):
    """(_fused_bytes, _paired_bytes) of x_reg (M, Kp) float32 in register order, for a 4-bit format's weight
    ``exponents`` (_exponent_bounds); fills x_pairs as _paired_bytes does."""
    bounds = _x_bounds(x_reg)
    return _fused_bytes(bounds, exponents), _paired_bytes(x_reg, bounds, exponents, sources, x_pairs)


@numba.njit(**_INLINE)
def _low_byte_range(flat, start, count):
    """(min, max) of the low bytes of ``flat[start : start + count]``: a uint8 array (MXFP4's E8M0 bytes of a
    row) or an int32 / uint32 one (HiFloat4's scale words, whose low byte is the E6M2 scale)."""
    low, high = np.int64(255), np.int64(0)  # not literals: callers would compile a specialization for them
    full = start + count - count % HALF
    for i in range(start, full, HALF):
        lo, hi = simd.i32v_range(simd.low_bytes_load(flat, i))
        low, high = min(low, lo), max(high, hi)
    for i in range(full, start + count):
        low, high = min(low, np.int64(flat[i]) & 0xFF), max(high, np.int64(flat[i]) & 0xFF)
    return low, high


# ---- steps of a row that end early (a K that is not a multiple of 64) -------------------------------------


_ROW_TABLE_BYTES = 1024  # the largest row table: 256 float32 values


@numba.njit(**_INLINE)
def _row_table(table_like):
    """An uninitialised row table like ``table_like`` (its dtype and shape) in the calling kernel's stack frame
    (simd.stack_bytes: valid until it returns), on a 64-byte boundary and without reference counting: the
    look-ups load it in 64-byte pieces, which numba's own allocations (32 bytes past a boundary) split over two
    cache lines each, and every tuple of arrays built around it counted references at each block of rows
    (about 0.1 ms of a 4096 x 4096 GEMV)."""
    return simd.stack_like(table_like, _ROW_TABLE_BYTES)


@numba.njit(**_INLINE)
def _code8_tail(codes, start, count, table, nan_code, keep, scratch):
    """The last ``count`` < 64 weights of a row from ``codes[start]``; lanes whose element is past them
    are +0.0 (``keep``: int32[64], nonzero for the lanes to keep). The codes are copied into ``scratch``
    (64 bytes) so that nothing past the row is read."""
    scratch[:] = 0
    copy_elements(scratch, 0, codes, start, count)
    w0, w1 = code8_decode(scratch, 0, table, nan_code)
    return simd.f32v_select(simd.i32v_load(keep, 0), w0), simd.f32v_select(simd.i32v_load(keep, HALF), w1)


@numba.njit(**_INLINE)
def _mxfp4_last_block(codes, start, scale, scratch):
    """An odd last MXFP4 block (16 code bytes at ``codes[start]``) as a step whose second block is zeros."""
    scratch[:] = 0
    copy_elements(scratch, 0, codes, start, 16)
    return _mxfp4_step(scratch, 0, scale, np.uint8(127))


# ---- blocks of rows: ROW_BLOCK rows of W summed at once, each in its own lanes -------------------------------------
# Rows of W are summed ROW_BLOCK at a time where they can be (_block_sums): x is loaded once for all of them
# and their weights are read as ROW_BLOCK streams at once, which this VM's memory serves faster than one (at
# N = 12288, K = 8192 on one thread: MXFP4 15 -> 19-21 G weights/s, HiFloat8 9 -> 13). Each row keeps its own
# lanes, so its sum is the one-row sum, bit for bit.
ROW_BLOCK = 4  # _block_sums, _store_block and the callers' ``starts`` are written out for four rows
# Whether the GEMVs sum blocks of ROW_BLOCK rows at all: a row's 64 float32 lanes take 4 AVX-512 registers but
# 8 AVX2 ones, so a block's accumulators alone need 32 AVX2 registers of the 16 there are; the spills made an
# AVX2 GEMV (AMD Zen 3) 6-9 times slower than summing the rows one by one (docs/weight_only.md, 'Kernels').
BLOCK_ROWS = simd.HAS_AVX512F
# the row blocks decode 4-bit steps in NIBBLE_ORDER
assert not BLOCK_ROWS or FOUR_BIT_ORDER == HIFLOAT4_ORDER == NIBBLE_ORDER


@numba.njit(**_INLINE)
def _prefetch_ahead(flat, at, ahead):
    """Prefetch ``flat[at + ahead]`` (at most its last element; unsigned indices, as the callers'): a GEMV
    step asks for its own position in the weight row a few rows on (``ahead`` elements; the block steps
    here: ROW_BLOCK rows, which the next block of rows reads). With the weight streamed from memory this
    takes 25-30 % off a 4096 x 4096 GEMV on an Intel Xeon, whose hardware prefetchers start anew on every
    4 KiB page (benchmarks/results_weight_only.md, 'Intel Xeon')."""
    simd.prefetch(flat, min(at + ahead, np.uint64(flat.size - 1)))


@numba.njit(**_INLINE)
def _x_step(x_flat, x0, t):
    """Step t of a row of x in register order (float32 at x_flat[x0:]): its two F32V."""
    return simd.f32v_load(x_flat, x0 + LANES * t), simd.f32v_load(x_flat, x0 + LANES * t + HALF)


@numba.njit(**_INLINE)
def _block_sums(step, accumulate, fold, load_x, x_flat, x0, steps, operands, starts):
    """The folded lane sums of the ROW_BLOCK rows of W whose weights start at ``starts`` (a tuple) times
    x_flat[x0:] (register order): step ``t`` of row ``r`` is ``step(operands, starts[r], r, t)`` (two
    vectors), summed with ``accumulate`` (_add_products, _fma_products or _dot_pairs) with x's step
    ``load_x(x_flat, x0, t)`` and folded with ``fold`` (the format's logical order)."""
    a0, a1, b0, b1 = simd.f32v_zero(), simd.f32v_zero(), simd.f32v_zero(), simd.f32v_zero()
    c0, c1, d0, d1 = simd.f32v_zero(), simd.f32v_zero(), simd.f32v_zero(), simd.f32v_zero()
    for t in range(steps):
        x_low, x_high = load_x(x_flat, x0, t)
        w0, w1 = step(operands, starts[0], 0, t)
        a0, a1 = accumulate(a0, a1, x_low, x_high, w0, w1)
        w0, w1 = step(operands, starts[1], 1, t)
        b0, b1 = accumulate(b0, b1, x_low, x_high, w0, w1)
        w0, w1 = step(operands, starts[2], 2, t)
        c0, c1 = accumulate(c0, c1, x_low, x_high, w0, w1)
        w0, w1 = step(operands, starts[3], 3, t)
        d0, d1 = accumulate(d0, d1, x_low, x_high, w0, w1)
    return fold(a0, a1), fold(b0, b1), fold(c0, c1), fold(d0, d1)


@numba.njit(**_INLINE)
def _block_sums_pair(step, accumulate, fold, load_x, x_flat, x0, x1, steps, operands, starts):
    """:func:`_block_sums` for two rows of x at once (at x_flat[x0:] and x_flat[x1:]): each step of W is
    decoded once for both; every lane of each (x row, W row) pair gets the same operations in the same
    order, so the sums are _block_sums' bit for bit. Returns the two 4-tuples."""
    a0, a1, b0, b1 = simd.f32v_zero(), simd.f32v_zero(), simd.f32v_zero(), simd.f32v_zero()
    c0, c1, d0, d1 = simd.f32v_zero(), simd.f32v_zero(), simd.f32v_zero(), simd.f32v_zero()
    e0, e1, f0, f1 = simd.f32v_zero(), simd.f32v_zero(), simd.f32v_zero(), simd.f32v_zero()
    g0, g1, h0, h1 = simd.f32v_zero(), simd.f32v_zero(), simd.f32v_zero(), simd.f32v_zero()
    for t in range(steps):
        x_low, x_high = load_x(x_flat, x0, t)
        y_low, y_high = load_x(x_flat, x1, t)
        w0, w1 = step(operands, starts[0], 0, t)
        a0, a1 = accumulate(a0, a1, x_low, x_high, w0, w1)
        e0, e1 = accumulate(e0, e1, y_low, y_high, w0, w1)
        w0, w1 = step(operands, starts[1], 1, t)
        b0, b1 = accumulate(b0, b1, x_low, x_high, w0, w1)
        f0, f1 = accumulate(f0, f1, y_low, y_high, w0, w1)
        w0, w1 = step(operands, starts[2], 2, t)
        c0, c1 = accumulate(c0, c1, x_low, x_high, w0, w1)
        g0, g1 = accumulate(g0, g1, y_low, y_high, w0, w1)
        w0, w1 = step(operands, starts[3], 3, t)
        d0, d1 = accumulate(d0, d1, x_low, x_high, w0, w1)
        h0, h1 = accumulate(h0, h1, y_low, y_high, w0, w1)
    return ((fold(a0, a1), fold(b0, b1), fold(c0, c1), fold(d0, d1)),
            (fold(e0, e1), fold(f0, f1), fold(g0, g1), fold(h0, h1)))


@numba.njit(**_INLINE)
def _store_block(y32, m, row, sums):
    y32[m, row], y32[m, row + 1], y32[m, row + 2], y32[m, row + 3] = sums


# ---- x's per-call operands of the GEMV kernels (after the weight's): f(x_reg, operands, x_consts) ----------


@numba.njit(**NJIT_OPTIONS)
def _x_bounds_operands(x_reg, operands, x_consts):
    """(x_bounds,) of _mxfp8_gemv: _x_bounds of x_reg where the weight was re-encoded by columns (its column
    tables, the operands' last: _by_column_tables), else an empty (0, 2) array (not read)."""
    return (_x_bounds_by(operands[-1], (x_reg,)),)


@numba.njit(**NJIT_OPTIONS)
def _code8_direct_x_operands(x_reg, operands, x_consts):
    """_code8_x_operands without x's pairs (M, 0), for the operator's direct call, whose rows kernel (_code8_rows)
    does not read them: compiled without the pairs' code."""
    return _x_bounds_by(operands[-1], (x_reg,)), np.empty((x_reg.shape[0], 0), dtype=np.int16)


def _pairs_for(table_like):
    raise NotImplementedError("numba only")


@overload(_pairs_for, jit_options=NJIT_OPTIONS)
def _pairs_for_typed(table_like):
    """Whether rows of this table kind may be summed in BF16 pairs (code8_pairs looks up BF16 byte tables only):
    a constant of the type, so that _code8_x_operands makes x's pairs only for them."""
    pairs = CODE8_PAIRS and table_like.dtype == types.uint8 and table_like.ndim == 1
    return lambda table_like: pairs


@numba.njit(**NJIT_OPTIONS)
def _code8_x_operands(x_reg, operands, x_consts):
    """(x_bounds, x_pairs) of _code8_gemv. x_pairs (M, Kp) int16: x's BF16 bits in the pair order of
    x_consts[0] (_pair_sources of CODE8_PAIR_ORDER) where rows may be summed in BF16 pairs (CODE8_PAIRS, BF16 x,
    BF16 byte tables, K a multiple of PAIR_LANES), else (M, 0); x_bounds: _x_bounds of x_reg there or where
    the weight was re-encoded by columns (its column tables, the operands' last: _by_column_tables), else an
    empty (0, 2) array (not read)."""
    (sources,) = x_consts
    codes, bf16, table_like = operands[0], operands[2], operands[5]
    m_rows, kp = x_reg.shape
    if _pairs_for(table_like) and bf16 and codes.shape[1] % PAIR_LANES == 0:
        x_pairs = aligned_empty(m_rows, kp, np.int16)  # Kp = K: a multiple of PAIR_LANES
        for m in range(m_rows):
            _fill_x_pairs(x_reg[m].view(np.int32), kp, sources, x_pairs[m])
        return _x_bounds(x_reg), x_pairs
    return _x_bounds_by(operands[-1], (x_reg,)), np.empty((m_rows, 0), dtype=np.int16)


@numba.njit(**NJIT_OPTIONS)
def _no_x_bounds(x_reg):
    return np.zeros((0, 2), dtype=np.int64)


_x_bounds_by = _by_column_tables(_x_bounds, _no_x_bounds)


@numba.njit(**NJIT_OPTIONS)
def _four_bit_x_operands(x_reg, operands, x_consts):
    """(fused, x_pairs, paired) of a 4-bit format (_exact_bytes); x_consts: (its _exponent_bounds table, its
    pair sources, whether the BF16 pair kernels run: else x_pairs has no columns)."""
    exponents, sources, pairs = x_consts
    m, kp = x_reg.shape
    x_pairs = aligned_empty(m, -(-kp // PAIR_LANES) * PAIR_LANES if pairs else 0, np.int16)
    fused, paired = _exact_bytes(x_reg, exponents, sources, x_pairs)
    return fused, x_pairs, paired


@numba.njit(**_INLINE)
def _round_to_x(value, bf16):
    """``value`` rounded to x's dtype, BF16 if ``bf16`` else FP16: both roundings, one chosen, so that a loop
    rounding weights is compiled once for either dtype (for the GEMV's few rows outside the exact range; the
    batched kernel and the GEMM tiles round every row, and keep a loop per dtype: _round_bf16, _round_f16)."""
    to_bf16, to_f16 = simd.f32v_round_to_bf16(value), simd.f32v_round_to_f16(value)
    return to_bf16 if bf16 else to_f16


@numba.njit(**_INLINE)
def _round_bf16(value, bf16):
    return simd.f32v_round_to_bf16(value)


@numba.njit(**_INLINE)
def _round_f16(value, bf16):
    return simd.f32v_round_to_f16(value)


@numba.njit(**_INLINE)
def _exact(value, bf16):
    """No rounding: the weights are values of x's dtype already (see _MXFP8_EXACT_BYTES)."""
    return value


# MXFP8: E8M0 bytes b for which every E4M3 value times 2^(b - 127) is exactly a value of x's dtype, so that
# rounding the weight to that dtype changes nothing and a row whose scale bytes all lie in the range skips
# it (about a third of a step). E4M3 values are multiples of 2^-9 with 4 significant bits. BF16: normal,
# 2^-9 * 2^(b - 127) >= 2^-126, and 448 * 2^(b - 127) <= the largest finite BF16. FP16: multiples of its
# smallest subnormal, 2^-9 * 2^(b - 127) >= 2^-24, and 448 * 2^(b - 127) <= 65504 (weights of FP16 models
# have bytes of about 113-121, below the normal range's 122).
_MXFP8_EXACT_BYTES_BF16 = (10, 246)
_MXFP8_EXACT_BYTES_F16 = (112, 134)


@numba.njit(**_INLINE)
def _mxfp8_step(round_to, codes, start, table, byte_a, byte_b, bf16):
    """MXFP8: 64 codes at ``codes[start]`` (two 32-blocks with E8M0 bytes ``byte_a``, ``byte_b``) as weights:
    the E4M3 value (``table``: of the codes or of their re-encoding by columns, _mxfp8_prepared_operands)
    times the block's scale in float32, then ``round_to`` x's dtype (docs/weight_only.md)."""
    w0, w1 = code8_decode(codes, start, table, _E4M3_NAN_CODE)
    scale_a, scale_b = _E8M0_SCALES[byte_a], _E8M0_SCALES[byte_b]
    s0 = simd.f32v_choose(simd.i32v_load(_SECOND_BLOCK, 0), scale_b, scale_a)
    s1 = simd.f32v_choose(simd.i32v_load(_SECOND_BLOCK, HALF), scale_b, scale_a)
    return round_to(simd.f32v_mul(w0, s0), bf16), round_to(simd.f32v_mul(w1, s1), bf16)


@numba.njit(**_INLINE)
def _mxfp8_row_step(round_to, codes_flat, scales_flat, c0, s0, t, k, table, scratch, bf16):
    """Step t of the row whose codes start at c0 and E8M0 bytes at s0; a last step of one 32-block (K % 64
    == 32) is read from ``scratch`` and its second block's lanes made +0.0."""
    if LANES * (t + 1) <= k:
        return _mxfp8_step(round_to, codes_flat, c0 + LANES * t, table, scales_flat[s0 + 2 * t],
                           scales_flat[s0 + 2 * t + 1], bf16)
    scratch[:] = 0
    copy_elements(scratch, 0, codes_flat, c0 + LANES * t, HALF)
    w0, w1 = _mxfp8_step(round_to, scratch, 0, table, scales_flat[s0 + 2 * t], np.uint8(127), bf16)
    return (simd.f32v_select(simd.i32v_load(_FIRST_BLOCK, 0), w0),
            simd.f32v_select(simd.i32v_load(_FIRST_BLOCK, HALF), w1))



@numba.njit(**_INLINE)
def _mxfp4_table_step(codes_flat, scales_flat, b):
    """MXFP4 blocks b, b + 1 (flat, unsigned b) in FOUR_BIT_ORDER from the float32 tables."""
    return _to_4bit_order(*_mxfp4_step(codes_flat, np.uint64(16) * b, scales_flat[b], scales_flat[b + np.uint64(1)]))


@numba.njit(**_INLINE)
def _mxfp4_shuffled_step(codes_flat, scales_flat, b):
    """The same by byte shuffles (mxfp4_bf16_step; AVX2)."""
    return mxfp4_bf16_step(codes_flat, np.uint64(16) * b, scales_flat, b)


# An MXFP4 step of two whole blocks in FOUR_BIT_ORDER, as the CPU decodes it fastest.
_mxfp4_pair_of_blocks = _mxfp4_shuffled_step if BYTE_SHUFFLE_NIBBLES else _mxfp4_table_step


@numba.njit(**_INLINE)
def _mxfp4_odd_block(codes_flat, b, scales_flat, scratch):
    """An odd last block b (flat) in FOUR_BIT_ORDER, its second block zeros (_mxfp4_last_block)."""
    return _to_4bit_order(*_mxfp4_last_block(codes_flat, 16 * b, scales_flat[b], scratch))

@numba.njit(**_INLINE)
def _x_pair_step(x_flat, x0, t):
    """Pair step t of a row of x (_paired_bytes's x_pairs: BF16 bits at x_flat[x0:]): its two I32V."""
    return simd.i32v_load(x_flat, x0 + 2 * LANES * t), simd.i32v_load(x_flat, x0 + 2 * LANES * t + LANES)


@numba.njit(**_INLINE)
def _dot_pairs(acc0, acc1, x_low, x_high, w0, w1):
    """Lanes += the two products of each BF16 pair (vdpbf16ps), x's pairs times W's."""
    return simd.f32v_dot_bf16(acc0, x_low, w0), simd.f32v_dot_bf16(acc1, x_high, w1)


@numba.njit(**_INLINE)
def _x_row_products(product, load_x, acc0, acc1, x_flat, x0, t, w0, w1):
    """A row of x's accumulators (acc0, acc1) += its step t (``load_x`` at x_flat[x0:]: _x_step or _x_pair_step)
    times one step of W (w0, w1), by ``product`` (_fma_products or _dot_pairs)."""
    x_low, x_high = load_x(x_flat, x0, t)
    return product(acc0, acc1, x_low, x_high, w0, w1)


@numba.njit(**_INLINE)
def _dot_pairs_four_x(accs, x_flat, xs, t, w0, w1):
    """Four rows of x's accumulators ``accs`` (eight F32V, two a row) += each row's pair step t (its pairs at
    x_flat[xs[i]:], _x_pair_step) times one pair step of W (w0, w1), by _dot_pairs."""
    a0, a1, b0, b1, c0, c1, d0, d1 = accs
    a0, a1 = _x_row_products(_dot_pairs, _x_pair_step, a0, a1, x_flat, xs[0], t, w0, w1)
    b0, b1 = _x_row_products(_dot_pairs, _x_pair_step, b0, b1, x_flat, xs[1], t, w0, w1)
    c0, c1 = _x_row_products(_dot_pairs, _x_pair_step, c0, c1, x_flat, xs[2], t, w0, w1)
    d0, d1 = _x_row_products(_dot_pairs, _x_pair_step, d0, d1, x_flat, xs[3], t, w0, w1)
    return a0, a1, b0, b1, c0, c1, d0, d1


