"""SVDQuant on the CPU: the numba MXFP4 activation quantizer, numba products with the packed MXFP4 weight,
and the low-rank branch in numba at decode (where it gives torch's results; see add_low_rank), torch's
BF16 matmuls (oneDNN) otherwise.

The quantized activation is exact in BF16 (an E2M1 value times a power of two), and so is every product of
it with an MXFP4 weight. L is added in BF16: ``out = bf16(L + bf16(P))`` (docs/svd_quant.md, section 'The
final add'). ``P = deq(xq) @ deq(w)^T``:

* At decode (up to GEMV_MAX_M rows), with AVX512-VNNI or AVX2: integer dot products over the packed codes of
  both operands (:func:`product_gemv`, below; AVX2 multiplies with vpmaddubsw, exact for the looked-up
  weights 0..24); the weight rows it cannot take exactly go to the float32 weight-only kernel
  (lowbit.kernels.cpu.weight_only) on the dequantized activation, as does every row on a CPU with neither.
  Float32 sums, rounded once to BF16.
* With more rows, the weight-only MXFP4 kernel on the dequantized activation: its batched kernel (up to its
  BATCH_MAX_M rows) or its GEMM path (the weight decoded in tiles of rows for torch's GEMM); a float32
  matmul of the whole dequantized weight where a block's values are BF16 subnormals
  (:func:`_has_subnormal_values`). On AMX CPUs, up to the AMX kernel's rows, that kernel computes L = T u
  beside P and the final add (WeightOnlyLinear.run_low_rank; docs/svd_quant.md, 'Prefill on AMX tiles').

The integer products: every E2M1 value is an integer over 2 (0, 0.5, 1, 1.5, 2, 3, 4, 6), so a product of
an activation element and a weight element of blocks with scales 2^ex and 2^ew is
``(2 cx)(2 cw) * 2^(ex + ew - 2)``. Per step of 256 elements of a weight row (128 code bytes, 8 blocks),
vpdpbusd sums the integer products of 8 consecutive elements into each of 32 int32 lanes (4 lanes per
block; |sum| <= 8 * 144), exactly; each lane is converted to float32 and multiplied by its block's power
of two with a fused multiply-add into float32 lane sums, which are added up at the end (docs/svd_quant.md,
'Weight handling on the CPU': P may differ from the reference's float32 matmul in its summation order
only). vpdpbusd multiplies unsigned by signed bytes: the weight is looked up as ``2 cw + 12`` (0..24) and
the activation as ``2 cx`` (-12..12); each lane starts from ``-12 * sum(2 cx)`` over its 8 elements, which
cancels the offset. On AVX2 without AVX-512 (BLOCK_SUMS) a step sums each block's 32 products exactly in
integers instead, so 8 lanes, one per block, are converted and scaled (lowbit.kernels.cpu._block_sums).
Exactness is checked per pair of (activation row, weight row) from the scale bytes (:func:`_safe`).

Memory: the activation's codes, scales and integer operands (at decode; its (M, K) BF16 dequantized copy
only for rows that fall back, or at prefill), and with more than GEMV_MAX_M rows a temporary BF16 tile of
the weight (the weight-only kernel's, at most 16 MiB; the AMX kernel's buffers instead where it runs; a float32
copy of the whole weight where a block's values are BF16 subnormals); nothing is cached between calls.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from lowbit.backends import Kernel
from lowbit.formats import mxfp4 as mxfp4_format
from lowbit.formats.svd_quant import BLOCK, weight_scales
from lowbit.kernels.cpu import _block_sums, amx, mxfp4
from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu._runtime import (NJIT_OPTIONS, SerialOrParallel, as_numpy, bound_njit, copy_elements,
                                         int16_array_at, kernel_threads, parallel_loops_allowed, sync_threads)
from lowbit.kernels.cpu._weight_only_steps import _low_byte_range, _prefetch_ahead
from lowbit.kernels.cpu.weight_only import GEMV_MAX_M, GEMV_ONE_THREAD_WEIGHTS, MXFP4_LINEAR, _amx_max_m

INTEGER_PRODUCTS = simd.HAS_VNNI or simd.HAS_AVX2  # else decode runs the float32 weight-only kernel
# The integer GEMV runs on one thread below this many weights. With VNNI it takes half the float32 GEMV's time
# per weight, so waking the second thread pays off only on about twice the work (AMD Zen 4, N = 2816, K = 2048
# at decode: a call of svd_quant 0.26-0.29 ms on one thread, 0.29-0.34 ms on two; 4096 x 4096: two threads are
# faster). AVX2's two-instruction emulation of vpdpbusd cost about what the float32 GEMV does per weight, so
# the float GEMV's threshold holds there (AMD Zen 3, N = 2816, K = 2048, each call after an F.linear: 265-282 us
# on two threads against 425-430 us on one; benchmarks/results_weight_only.md, 'svd_quant's product on AVX2').
# Measured again with the block sums (BLOCK_SUMS; AMD Zen 3, run_prepared after a 4096^2 F.linear, K = 2048):
# one thread 185 / 212 / 247 / 290 us at N = 512 / 768 / 1024 / 1536, two 215 / 262 / 243 / 263 us: two threads
# pay off from about 2-3M weights, so the threshold stays. Intel's VNNI CPUs wake the second thread for less: on
# an Intel Xeon Emerald Rapids (the op, hot loop / each call after an F.linear, one thread against two) 1024 x 1024
# 0.113 / 0.171 against 0.114 / 0.162 ms, 1536 x 1024 0.163 / 0.258 against 0.158 / 0.235, 1536 x 1536 0.195 /
# 0.272 against 0.163 / 0.236, 2816 x 2048 0.288 / 0.364 against 0.244 / 0.313 (benchmarks/results_weight_only.md,
# 'Intel Xeon Emerald Rapids: HiFloat8 and FP8 in BF16 pairs'). Those figures were taken with threads that slept
# at once after each region (OMP_WAIT_POLICY=PASSIVE alone); with the bounded spin that `import lowbit` sets, two
# threads were faster from 0.5M weights on an Intel Xeon (each call after an F.linear, one thread against two:
# 512 x 1024 0.135 / 0.104 ms, 1024^2 0.190 / 0.145, 2816 x 2048 0.365 / 0.271; benchmarks/results_weight_only.md,
# 'The bounded spin'), so two threads from 0.5M weights on Intel. AMD Zen's threshold was not measured again.
_PRODUCT_ONE_THREAD_WEIGHTS = ((6 << 20 if simd.HOST_IS_AMD_ZEN else 1 << 19) if simd.HAS_VNNI
                               else GEMV_ONE_THREAD_WEIGHTS)
# Weights below which product_gemv runs its serial version (see SerialOrParallel); from there to
# _PRODUCT_ONE_THREAD_WEIGHTS its parallel loop on one thread, which is faster there with VNNI (AMD Zen 4: the
# serial version took 0.29 ms at N = 2816, K = 2048 against 0.27 ms: benchmarks/results_first_run.md). On AVX2
# the serial version is the faster one (AMD Zen 3, each call after an F.linear: 1536 x 384 117 against 143 us,
# 1024 x 1024 71 against 81 us; benchmarks/results_weight_only.md, 'svd_quant's product on AVX2').
_PRODUCT_SERIAL_WEIGHTS = 1 << 16 if simd.HAS_VNNI else _PRODUCT_ONE_THREAD_WEIGHTS
_BF16_QUANTIZER = mxfp4.quantize_constants(torch.bfloat16, "floor", "ta")  # the activation quantizer's constants
# Each step prefetches its codes in the row this many rows on (_weight_only_steps._prefetch_ahead): N = 2816, K = 2048
# at decode, the weight streamed from memory, Intel Xeon: 0.58 ms per call on one thread against 0.72 ms.
_PREFETCH_ROWS = 4
STEP = 256  # elements of a row per step: 128 code bytes, 8 blocks
# AVX2 without AVX-512: each block summed exactly in integers, then scaled (lowbit.kernels.cpu._block_sums);
# else 32 int32 lanes of 8 elements each, each scaled
BLOCK_SUMS = simd.HAS_AVX2 and not simd.HAS_VNNI and simd.NARROW == _block_sums.BLOCKS
_LANE_ELEMENTS = BLOCK if BLOCK_SUMS else 8  # consecutive elements summed into one int32 (one start, one field)
_BLOCK_LANES = BLOCK // _LANE_ELEMENTS
_DOUBLED = (2 * mxfp4_format.e2m1_values()).to(torch.int8).numpy()  # code -> 2 * its value
_OFFSET = 12  # 2 * the largest E2M1 magnitude: the weight's offset that makes it unsigned
# vpshufb's table: the 16 weight bytes 2 cw + 12, once per 16-byte piece of an I32V (128 bytes)
_WEIGHT_BYTES = np.tile((_DOUBLED.astype(np.int16) + _OFFSET).astype(np.uint8), 4 * simd.LANES // 16)
_ROWS_PER_TASK = 8  # weight rows per prange iteration
_NAN_SCALE = 0xFF
_LARGEST_FINITE_SCALE = 252  # 6 * 2^(252 - 127) is finite in float32; 6 * 2^126 is not
_EXPONENT_BIAS = 2 * 127 + 2 - 127  # field of 2^(ex + ew - 2) = sx + sw - _EXPONENT_BIAS


@numba.njit(**NJIT_OPTIONS)
def activation_operands(codes, scales, kp):
    """The activation rows' operands: codes (M, K/2) and scales (M, K/32) uint8 from the MXFP4 quantizer
    (block 32), ``kp`` a multiple of STEP >= K. Returns

    * low, high: (M, kp/2) int8, ``2 cx`` of the even / odd elements (element 2i, 2i + 1 at i), zeros past K;
    * start: (M, kp/E) int32, each lane's starting value ``-12 * sum(2 cx)`` over its E = _LANE_ELEMENTS
      elements (8, or with BLOCK_SUMS a block's 32);
    * field: (M, kp/E) int32, ``sx - _EXPONENT_BIAS`` of the lane's block where the block is nonzero, else 0
      (its products are zero; the power of two stays finite);
    * bounds: (M, 3) int64: lowest and highest scale byte over the nonzero blocks, and whether the row has
      a NaN block (scale 0xFF: a NaN or Inf in x); (256, -1, nan) for a row with no nonzero block.
    """
    m_rows, half_k = codes.shape
    blocks = scales.shape[1]
    low = np.zeros((m_rows, kp // 2), dtype=np.int8)
    high = np.zeros((m_rows, kp // 2), dtype=np.int8)
    start = np.zeros((m_rows, kp // _LANE_ELEMENTS), dtype=np.int32)
    field = np.zeros((m_rows, kp // _LANE_ELEMENTS), dtype=np.int32)
    bounds = np.empty((m_rows, 3), dtype=np.int64)
    for m in range(m_rows):
        lowest, highest, nan = 256, -1, 0
        for i in range(half_k):
            byte = codes[m, i]
            low[m, i] = _DOUBLED[byte & 15]
            high[m, i] = _DOUBLED[byte >> 4]
            start[m, 2 * i // _LANE_ELEMENTS] -= _OFFSET * (np.int32(low[m, i]) + np.int32(high[m, i]))
        for g in range(blocks):
            byte = np.int64(scales[m, g])
            nonzero = False
            for i in range(16 * g, 16 * g + 16):
                nonzero |= (codes[m, i] & 0x77) != 0
            if byte == _NAN_SCALE:
                nan = 1
            elif nonzero:
                lowest, highest = min(lowest, byte), max(highest, byte)
                field[m, g * _BLOCK_LANES : (g + 1) * _BLOCK_LANES] = byte - _EXPONENT_BIAS
        bounds[m, 0], bounds[m, 1], bounds[m, 2] = lowest, highest, nan
    return low, high, start, field, bounds


@numba.njit(**NJIT_OPTIONS)
def quantized_operands(x_pairs, m_rows, kp, width, abs_mask, element_abs_mask, nonfinite_bits, to_fp32, rule, thr):
    """The activation (M, K) BF16 as uint32 pairs of elements, ``x_pairs`` (M * K/2,), quantized by the MXFP4
    quantizer (lowbit.kernels.cpu.mxfp4.quantize_task; the arguments after ``kp`` are its constants for BF16,
    floor scale and ties-away elements), then :func:`activation_operands`. Returns its five arrays and the
    codes (M, K/2) and scales (M, K/32)."""
    half_k = x_pairs.size // m_rows
    codes = np.empty((m_rows, half_k), dtype=np.uint8)
    scales = np.empty((m_rows, 2 * half_k // BLOCK), dtype=np.uint8)
    lo = np.empty(x_pairs.size, dtype=thr.dtype)
    hi = np.empty(x_pairs.size, dtype=thr.dtype)
    mag = np.empty(x_pairs.size, dtype=thr.dtype)
    mxfp4.quantize_task(x_pairs, width, abs_mask, element_abs_mask, nonfinite_bits, to_fp32, rule, thr, BLOCK // 2,
                        simd.flat(codes), simd.flat(scales), lo, hi, mag)
    low, high, start, field, bounds = activation_operands(codes, scales, kp)
    return low, high, start, field, bounds, codes, scales


@numba.njit(**{**NJIT_OPTIONS, "inline": "always"})  # called per weight row: no call, no array view
def _safe(bounds, m, low, high, limit):
    """Whether activation row m of ``bounds`` (see activation_operands) and a weight row with scale bytes
    in [low, high] give only normal float32 products (field >= 1) and sums that cannot overflow (the row's
    largest product times K below 2^127: ``field_max <= limit``), with every weight finite."""
    if bounds[m, 2] != 0 or high > _LARGEST_FINITE_SCALE:
        return False
    if bounds[m, 1] < 0:
        return True  # x is all zeros and W is finite: every product is zero
    return bounds[m, 0] + low - _EXPONENT_BIAS >= 1 and bounds[m, 1] + high - _EXPONENT_BIAS <= limit


@numba.njit(**{**NJIT_OPTIONS, "inline": "always"})
def _step_of(acc, table, packed, weight_scales, low, high, x0, start, field, lane0):
    """acc + one step: 128 code bytes ``packed`` (I32V) with their scale bytes spread over the lanes
    (``weight_scales``, see simd.spread_bytes4) times the activation's low / high bytes at x0, its lanes'
    start / field at lane0."""
    sums = simd.i32v_load(start, lane0)
    sums = simd.dpbusd_rows(sums, simd.shuffle_bytes(table, simd.low_nibbles(packed)), low, x0)
    sums = simd.dpbusd_rows(sums, simd.shuffle_bytes(table, simd.high_nibbles(packed)), high, x0)
    exponent = simd.i32v_add(weight_scales, simd.i32v_load(field, lane0))
    return simd.f32v_fma(simd.i32v_to_f32v(sums), simd.f32v_power_of_two(exponent), acc)


@numba.njit(**{**NJIT_OPTIONS, "inline": "always"})
def _lane_step(acc, table, codes, c, low, high, x0, start, field, s0, scale_codes, lane0):
    """acc (F32V) + one step: the 128 code bytes at ``codes[c]`` (their scale bytes at ``scale_codes[s0]``),
    see _step_of."""
    return _step_of(acc, table, simd.i32v_load(codes, c), simd.spread_bytes4(scale_codes, s0), low, high, x0, start,
                    field, lane0)


@numba.njit(**{**NJIT_OPTIONS, "inline": "always"})
def _last_lane_step(acc, table, codes, c, code_count, low, high, x0, start, field, s0, scale_codes, scale_count,
                    lane0):
    """:func:`_lane_step` of a row's last, short step: only its ``code_count`` code bytes and ``scale_count``
    scale bytes are read (masked loads), the rest taken as 0 (the activation is zero there)."""
    return _step_of(acc, table, simd.i32v_load_first(codes, c, code_count),
                    simd.spread_bytes4_first(scale_codes, s0, scale_count), low, high, x0, start, field, lane0)


@numba.njit(**{**NJIT_OPTIONS, "inline": "always"})
def _block_step(acc, table, codes, c, low, high, x0, start, field, s0, scale_codes, block0):
    """:func:`_lane_step` with BLOCK_SUMS: acc (F32N, one lane per block of the step) + each block's exact sum
    (lowbit.kernels.cpu._block_sums) times its power of two; start / field per block, at block0."""
    sums = _block_sums.block_sums(table, simd.i32v_load(codes, c), low, high, x0, start, block0)
    return simd.f32n_fma(sums, _block_sums.block_powers(scale_codes, s0, field, block0), acc)


@numba.njit(**{**NJIT_OPTIONS, "inline": "always"})
def _last_block_step(acc, table, codes, c, code_count, low, high, x0, start, field, s0, scale_codes, scale_count,
                     block0):
    """:func:`_block_step` of a row's last, short step (see _last_lane_step)."""
    sums = _block_sums.block_sums(table, simd.i32v_load_first(codes, c, code_count), low, high, x0, start, block0)
    return simd.f32n_fma(sums, _block_sums.block_powers_first(scale_codes, s0, scale_count, field, block0), acc)


_zero_sums, _step, _last_step = ((simd.f32n_zero, _block_step, _last_block_step) if BLOCK_SUMS
                                 else (simd.f32v_zero, _lane_step, _last_lane_step))


@SerialOrParallel
def product_gemv(low, high, start, field, bounds, codes, scales, y32, fallback):
    """y32 (M, N) float32 <- the activation operands (see activation_operands) times the weight codes
    (N, K/2) and scales (N, K/32) uint8 (blocks of 32 along K), for each weight row that :func:`_safe`
    admits for every activation row; ``fallback[n]`` (uint8, zeros on entry) is set to 1 for the others
    (their y32 is not written). Returns how many rows fell back."""
    n, half_k = codes.shape
    m_rows, blocks = low.shape[0], scales.shape[1]
    full = 2 * half_k // STEP  # steps that lie inside the row; a last, short one is copied first
    limit = 241 - int(np.ceil(np.log2(2 * half_k)))  # then |P| <= K * 36 * 2^(field - 125) < 2^122
    x_bytes, x_lanes = low.shape[1], start.shape[1]
    codes_flat, scales_flat = simd.flat(codes), simd.flat(scales)
    low_flat, high_flat = simd.flat(low), simd.flat(high)
    start_flat, field_flat = simd.flat(start), simd.flat(field)
    table = simd.i32v_load(_WEIGHT_BYTES, 0)
    ahead = np.uint64(_PREFETCH_ROWS * half_k)
    tail_codes, tail_scales = half_k - full * STEP // 2, blocks - full * STEP // BLOCK  # the last, short step
    for task in numba.prange((n + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        for row in range(task * _ROWS_PER_TASK, min(n, (task + 1) * _ROWS_PER_TASK)):
            c0, s0 = row * half_k, row * blocks
            smallest, largest = _low_byte_range(scales_flat, s0, blocks)
            admitted = True
            for m in range(m_rows):
                admitted &= _safe(bounds, m, smallest, largest, limit)
            if not admitted:
                fallback[row] = 1
                continue
            for m in range(m_rows):
                x0, lane0 = m * x_bytes, m * x_lanes
                acc = _zero_sums()
                for t in range(full):
                    at = np.uint64(c0 + t * STEP // 2)  # a step reads two cache lines of codes
                    _prefetch_ahead(codes_flat, at, ahead)
                    _prefetch_ahead(codes_flat, at + np.uint64(64), ahead)
                    acc = _step(acc, table, codes_flat, c0 + t * STEP // 2, low_flat, high_flat,
                                x0 + t * STEP // 2, start_flat, field_flat, s0 + t * STEP // BLOCK, scales_flat,
                                lane0 + t * STEP // _LANE_ELEMENTS)
                if tail_codes:
                    acc = _last_step(acc, table, codes_flat, c0 + full * STEP // 2, tail_codes, low_flat, high_flat,
                                     x0 + full * STEP // 2, start_flat, field_flat, s0 + full * STEP // BLOCK,
                                     scales_flat, tail_scales, lane0 + full * STEP // _LANE_ELEMENTS)
                y32[m, row] = simd.f32v_sum_tree(acc)
    return np.count_nonzero(fallback)


# ---- the low-rank branch and the final add at decode ------------------------------------------------------
# Float32 sums of exact BF16 products, as torch's BF16 matmuls, in another order. Order matters only when
# a partial sum can overflow or an input is NaN/Inf (which sums then meet +Inf and -Inf depends on it):
# add_low_rank runs only where neither can happen, and leaves the other calls to torch. Nor may a value,
# a product or a partial sum be subnormal: torch's BF16 GEMM (vdpbf16ps, AMX) treats subnormal inputs and
# results as zero for some shapes, and its plain loops do not.

_OVERFLOW_BOUND = 2.0**126  # float32 sums whose terms' magnitudes add up to less never overflow
# A normal BF16 value with exponent field E is a multiple of 2^(E - 134), so the products of two with fields
# of at least Ea and Eb, and every float32 sum of them, are multiples of 2^(Ea + Eb - 268): never subnormal
# (nonzero ones are at least that) when Ea + Eb >= 142.
_NORMAL_PRODUCT_FIELDS = 142


@numba.njit(**NJIT_OPTIONS)
def _magnitude_range(bits):
    """(smallest exponent field of the nonzero values: 0 if one is subnormal, 255 if all are zero; largest
    |value| as float64: inf if one is NaN or Inf) of BF16 bit patterns (a 1-D C-contiguous int16 array)."""
    largest_lanes, negated_lanes = simd.i16v_zero(), simd.i16v_zero()
    full = bits.size - bits.size % simd.LANES
    for i in range(0, full, simd.LANES):
        largest_lanes, negated_lanes = simd.bf16v_magnitude_bounds(largest_lanes, negated_lanes, bits, i)
    largest, negated = simd.i16v_max_lane(largest_lanes), simd.i16v_max_lane(negated_lanes)
    for i in range(full, bits.size):
        magnitude = np.int64(bits[i]) & 0x7FFF
        largest, negated = max(largest, magnitude), max(negated, -magnitude & 0xFFFF)
    smallest = 255 if negated == 0 else (0x10000 - negated) >> 7  # negated: 2^16 - the smallest nonzero one
    if largest >= 0x7F80:
        return smallest, np.inf
    exponent, fraction = largest >> 7, largest & 0x7F
    return smallest, math.ldexp(fraction, -133) if exponent == 0 else math.ldexp(128 + fraction, exponent - 134)


@numba.njit(**NJIT_OPTIONS)
def _sums_are_plain(count, a_range, b_range):
    """Whether ``count``-term float32 sums of products of values with the (smallest field, largest) ranges
    a_range and b_range (see _magnitude_range) are finite and never subnormal, in any order."""
    return (count * a_range[1] * b_range[1] < _OVERFLOW_BOUND
            and a_range[0] + b_range[0] >= _NORMAL_PRODUCT_FIELDS)


@numba.njit(**NJIT_OPTIONS)
def _vector_matrix(a, bits, y):
    """y[:cols] (float32, length cols rounded up to LANES) <- sum over i of a[i] * B[i, :] for B (rows, cols)
    BF16 bit patterns (int16); float32 multiply, then add, in ascending i."""
    rows, cols = bits.shape
    lanes = simd.LANES
    flat = simd.flat(bits)
    for c0 in range(0, cols, lanes):
        source, offset, stride = flat, c0, cols
        if c0 + lanes > cols:  # the last, narrow columns: copied with zeros after them
            source = np.zeros(rows * lanes, dtype=np.int16)
            for i in range(rows):
                copy_elements(source, i * lanes, bits[i], c0, cols - c0)
            offset, stride = 0, lanes
        acc = simd.f32v_zero()
        for i in range(rows):
            acc = simd.f32v_add(acc, simd.f32v_mul(simd.bf16v_load(source, offset + i * stride), a[i]))
        simd.f32v_store(y, c0, acc)


@numba.njit(**NJIT_OPTIONS)
def _round_to_bf16(values, count, chunk):
    """values[:count] (float32, length a multiple of LANES) rounded to BF16 values in place (ties to even)."""
    for j in range(0, count, simd.LANES):
        simd.f32v_store_as_bf16(chunk, 0, simd.f32v_load(values, j))
        simd.f32v_store(values, j, simd.bf16v_load(chunk, 0))


@numba.njit(**NJIT_OPTIONS)
def add_low_rank(x_bits, d_bits, u_bits, products, out_bits):
    """out (M, N) BF16 bits <- bf16(L + bf16(P)) with L = bf16(bf16(x @ d) @ u) and P = ``products`` (M, N)
    float32: x (M, K), d (K, R), u (R, N) BF16 bit patterns (int16). Returns False, leaving ``out`` as it
    was, when an input is NaN/Inf, a sum could overflow (:data:`_OVERFLOW_BOUND`) or a value, product or
    sum could be subnormal (:data:`_NORMAL_PRODUCT_FIELDS`)."""
    m_rows, k = x_bits.shape
    r, n = u_bits.shape
    range_d, range_u = _magnitude_range(simd.flat(d_bits)), _magnitude_range(simd.flat(u_bits))
    lanes = simd.LANES
    chunk = np.zeros(lanes, dtype=np.int16)
    one = np.ones(1, dtype=np.float32)
    x32 = np.zeros(-(-k // lanes) * lanes, dtype=np.float32)
    t = np.zeros(-(-r // lanes) * lanes, dtype=np.float32)
    low = np.zeros((m_rows, -(-n // lanes) * lanes), dtype=np.float32)
    for m in range(m_rows):
        if not _sums_are_plain(k, _magnitude_range(x_bits[m]), range_d):
            return False
        _vector_matrix(one, x_bits[m : m + 1], x32)
        _vector_matrix(x32, d_bits, t)
        _round_to_bf16(t, r, chunk)
        t_bits = (t.view(np.int32)[:r] >> 16).astype(np.int16)  # T's BF16 bit patterns
        if not _sums_are_plain(r, _magnitude_range(t_bits), range_u):
            return False
        _vector_matrix(t, u_bits, low[m])
        _round_to_bf16(low[m], n, chunk)
    total = np.zeros(low.shape[1], dtype=np.float32)
    for m in range(m_rows):
        copy_elements(total, 0, products[m], 0, n)
        _round_to_bf16(total, n, chunk)
        for j in range(0, n, lanes):
            value = simd.f32v_add(simd.f32v_load(low[m], j), simd.f32v_load(total, j))
            simd.f32v_store_as_bf16(chunk, 0, value)
            copy_elements(out_bits[m], j, chunk, 0, min(lanes, n - j))
    return True


@numba.njit(**NJIT_OPTIONS)
def _add_bias(out_bits, bias_bits):
    """out (M, N) BF16 bit patterns <- bf16(out + bias) for ``bias_bits`` (N,) BF16 bit patterns: the float32 sum
    rounded to nearest even, as torch's BF16 add. Returns False (out partly written) where a result is NaN,
    whose bit pattern torch's add leaves to its code path (vectorized or not)."""
    m_rows, n = out_bits.shape
    lanes = simd.LANES
    chunk, bias_chunk = np.zeros(lanes, dtype=np.int16), np.zeros(lanes, dtype=np.int16)
    for m in range(m_rows):
        for j in range(0, n, lanes):
            count = min(lanes, n - j)
            copy_elements(chunk, 0, out_bits[m], j, count)
            copy_elements(bias_chunk, 0, bias_bits, j, count)
            simd.f32v_store_as_bf16(chunk, 0, simd.f32v_add(simd.bf16v_load(chunk, 0), simd.bf16v_load(bias_chunk, 0)))
            copy_elements(out_bits[m], j, chunk, 0, count)
            for i in range(count):
                if (chunk[i] & 0x7FFF) > 0x7F80:
                    return False
    return True


_NO_BIAS = np.zeros(0, dtype=np.int16)


def _decode_template(x_bits, kp, quantizer, codes, scales, d_bits, u_bits, out_bits, bias_bits):
    """The decode in one numba call (bound by _one_call_decode: ``_PRODUCT`` is product_gemv's serial or
    parallel form; its ``py_func`` runs the same steps from Python, as three numba calls): x (M, K) BF16 bit
    patterns (int16, C-contiguous) quantized into its operands (quantized_operands, with the quantizer's
    constants ``quantizer``), P by _PRODUCT with the weight codes and scales, and where no row fell back the
    low-rank branch and the final add into ``out_bits`` (add_low_rank), then a bias (``bias_bits``, empty: none;
    _add_bias). Returns (rows that fell back, whether out_bits holds the result, y32 (M, N) float32, fallback
    flags (N,) uint8). After a torch op each call from Python runs with cold caches (tens of microseconds
    each: docs/weight_only.md, 'One call')."""
    m_rows = x_bits.shape[0]
    n = codes.shape[0]
    operands = quantized_operands(x_bits.reshape(-1).view(np.uint32), m_rows, kp, *quantizer)
    y32 = np.empty((m_rows, n), dtype=np.float32)
    fallback = np.zeros(n, dtype=np.uint8)
    fell_back = _PRODUCT(*operands[:5], codes, scales, y32, fallback)  # noqa: F821 (bound by _one_call_decode)
    done = fell_back == 0 and add_low_rank(x_bits, d_bits, u_bits, y32, out_bits)
    if done and bias_bits.size:
        done = _add_bias(out_bits, bias_bits)
    return fell_back, done, y32, fallback


def _one_call_decode(product):
    """The numba dispatcher of _decode_template with ``_PRODUCT`` = ``product`` (a form of product_gemv)."""
    return bound_njit(_decode_template, f"svd_quant_decode_{product.py_func.__name__}", _PRODUCT=product)


def _decode_at_template(x_address, m, k, kp, quantizer, codes, scales, d_bits, u_bits, out_address, bias_bits):
    """``_DECODE`` (a bound _decode_template) on x (M, K) and out (M, N) BF16 bit patterns at these addresses
    (_runtime.int16_array_at): whether out holds the result. Its numba call takes three ints where two
    numpy views made in Python cost more after other work (docs/weight_only.md, 'The deploy layer's one
    call')."""
    out_bits = int16_array_at(out_address, m, codes.shape[0])
    return _DECODE(int16_array_at(x_address, m, k), kp, quantizer, codes, scales, d_bits, u_bits,  # noqa: F821
                   out_bits, bias_bits)[1]


def _one_call_decode_at(product):
    """The numba dispatcher of _decode_at_template over _one_call_decode(``product``)."""
    return bound_njit(_decode_at_template, f"svd_quant_decode_at_{product.py_func.__name__}",
                      _DECODE=_one_call_decode(product))


def _in_python(product):
    """_decode_template with ``_PRODUCT`` = ``product``, run by Python (its three numba calls)."""
    return _one_call_decode(product).py_func


def _decode_call(work: int, decode_of, args: tuple):
    """``decode_of(product)(*args)`` (_one_call_decode, _one_call_decode_at or _in_python) on a weight of
    ``work`` = N * K weights: product_gemv's serial form below _PRODUCT_SERIAL_WEIGHTS or where parallel loops
    may not run (parallel_loops_allowed), else its parallel loop, on one thread below _PRODUCT_ONE_THREAD_WEIGHTS."""
    if work < _PRODUCT_SERIAL_WEIGHTS or not parallel_loops_allowed():
        return decode_of(product_gemv.serial)(*args)
    decode = decode_of(product_gemv.parallel)
    if work < _PRODUCT_ONE_THREAD_WEIGHTS:
        with kernel_threads(work, _PRODUCT_ONE_THREAD_WEIGHTS):
            return decode(*args)
    sync_threads()
    return decode(*args)


class BoundDecode:
    """A prepared weight's decode with a BF16 bias (or none) added as torch adds it, in one numba call, for BF16
    x of at most ``max_rows`` = GEMV_MAX_M rows: ``f(x, m, out) -> bool`` on x (..., K) with M = ``m`` rows and
    out (..., N), C-contiguous BF16 CPU tensors, not checked here (the caller's: lowbit.ops.library.PreparedCall
    ._bound_gemv). True where out holds the result; False (out partly written) where a row needs the float32
    kernel, the low-rank branch torch's matmuls, or a result is NaN: the caller's full path."""

    max_rows = GEMV_MAX_M

    def __init__(self, prepared: tuple, n: int, k: int, bias) -> None:
        w, scales, d, u = prepared
        self._work, self._k = n * k, k
        self._args = (-(-k // STEP) * STEP, _BF16_QUANTIZER, as_numpy(w), as_numpy(scales), as_numpy(d), as_numpy(u))
        self._bias = _NO_BIAS if bias is None else as_numpy(bias)

    def __call__(self, x: torch.Tensor, m: int, out: torch.Tensor) -> bool:
        args = (x.data_ptr(), m, self._k, *self._args, out.data_ptr(), self._bias)
        return bool(_decode_call(self._work, _one_call_decode_at, args))


_SMALLEST_NORMAL_SCALE = 2  # below this E8M0 byte, an MXFP4 block's nonzero values are BF16 subnormals


@numba.njit(**NJIT_OPTIONS)
def _smallest_byte(flat):
    """The smallest of a 1-D uint8 array's bytes (255 for none): a loop LLVM vectorizes (2816 x 64 scale bytes:
    8 us against 24 us for _low_byte_range's minimum and maximum, Intel Xeon Emerald Rapids)."""
    low = np.uint8(255)
    for i in range(flat.size):
        low = min(low, flat[i])
    return low


def _has_subnormal_values(codes: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether a block of MXFP4 codes (..., K/2) with scales (..., K/32) holds a nonzero value that is a BF16
    subnormal (scale byte below 2). torch's BF16 GEMM treats those as zero, so the prefill path multiplies in
    float32 then, as the reference does (their products with large weights are normal numbers). The scale
    bytes are scanned in numba (two torch ops on them cost 0.2 ms at prefill, in thread wake-ups)."""
    if _smallest_byte(as_numpy(scales).reshape(-1)) >= _SMALLEST_NORMAL_SCALE:  # numba: no torch op
        return False
    tiny = scales < _SMALLEST_NORMAL_SCALE
    nonzero = (codes.view(*scales.shape, BLOCK // 2) & 0x77).ne(0).any(-1)
    return bool(nonzero[tiny].any())


def _tiles_sum_as_torch(d: torch.Tensor) -> bool:
    """Whether the AMX kernel's low-rank sums T u come out as torch's ``T @ u`` for a rank R = d.shape[1] (what
    the upstream check of svd_quant compares with, which one BF16 step of L can fail where L and P nearly
    cancel): R up to a tile row (32) or a multiple of it, where oneDNN's AMX GEMM sums in the tiles' order
    (every output equal on all data compared, torch 2.13); it sums a remainder past 32 otherwise."""
    r = d.shape[1]
    return r <= amx.TILE_K or r % amx.TILE_K == 0


def _quantized_activation(x2d: torch.Tensor, x_scales: torch.Tensor) -> torch.Tensor:
    """deq(MXFP4(x)) (M, K) BF16, and ``x_scales`` (M, K/32) <- the blocks' scale bytes: quantized and
    dequantized in registers where the CPU allows (mxfp4.fake_quantize_into: 0.08 against 0.15 ms on one thread
    at 256 x 2048, Intel Xeon Emerald Rapids), else the quantizer's codes decoded."""
    x_deq = torch.empty_like(x2d)
    if mxfp4.fake_quantizes_in_registers(x2d.dtype, BLOCK):
        mxfp4.fake_quantize_into(x2d, BLOCK, "floor", "ta", x_scales, x_deq)
    else:
        codes = torch.empty(x2d.shape[0], x2d.shape[1] // 2, dtype=torch.uint8)
        mxfp4.quantize_into(x2d, BLOCK, "floor", "ta", codes, x_scales, x_deq)
    return x_deq


def _activation_has_subnormal_values(x2d: torch.Tensor, x_scales: torch.Tensor) -> bool:
    """_has_subnormal_values of x's MXFP4 blocks (``x_scales`` their scale bytes): from the scale bytes alone
    where none is below 2 (the usual case), else from the blocks' codes, made again here."""
    if _smallest_byte(as_numpy(x_scales).reshape(-1)) >= _SMALLEST_NORMAL_SCALE:
        return False
    codes = torch.empty(x2d.shape[0], x2d.shape[1] // 2, dtype=torch.uint8)
    mxfp4.quantize_into(x2d, BLOCK, "floor", "ta", codes, torch.empty_like(x_scales))
    return _has_subnormal_values(codes, x_scales)


class SvdQuant(Kernel):
    """svd_quant on the CPU: contiguous x (B..., S, K) BF16 and the other inputs into contiguous BF16 ``out``."""

    def run(self, x, w, s, d, u, *, out) -> None:
        self._run(x, self.prepare(x.dtype, x.shape[-1], w, s, d, u), out, one_call=False)

    @staticmethod
    def prepare(dtype, k, w, s, d, u) -> tuple:
        """(w, per-block scales (N, K/32), d, u) of validated, contiguous inputs of K = ``k``: the scales are
        made once where the weight stays as it is (lowbit.ops.library.PreparedCall)."""
        return w, weight_scales(s, k).contiguous(), d, u

    @staticmethod
    def bind_gemv(prepared, n: int, k: int, dtype: torch.dtype, bias=None):
        """A BoundDecode of a prepared weight (N, K) with ``bias`` (N,) BF16 or None added, for BF16 x; None
        where the decode has no integer products or x or the bias is not BF16."""
        if not INTEGER_PRODUCTS or dtype != torch.bfloat16 or (bias is not None and bias.dtype != torch.bfloat16):
            return None
        return BoundDecode(prepared, n, k, bias)

    def run_prepared(self, x, prepared, *, out) -> None:
        """:meth:`run` with the weight's part from :meth:`prepare`; the decode in one numba call
        (_decode_template), which a weight bound for many calls repays the compiling of (about 1.6 s, once;
        the operator's direct call, as in ``lowbit smoke``, runs the same steps as three numba calls)."""
        self._run(x, prepared, out, one_call=True)

    def _run(self, x, prepared, out, one_call: bool) -> None:
        w, scales, d, u = prepared
        k, n = x.shape[-1], u.shape[1]
        x2d, out2d = x.view(-1, k), out.view(-1, n)
        m = x2d.shape[0]
        if m <= GEMV_MAX_M and INTEGER_PRODUCTS:
            self._decode(x2d, w, scales, d, u, out2d, one_call)
            return
        prefill = m > GEMV_MAX_M
        x_scales = torch.empty(m, k // BLOCK, dtype=torch.uint8)
        if self._on_tiles(x2d, w, scales, d, u, out2d, x_scales):
            return
        x_deq = _quantized_activation(x2d, x_scales)
        if prefill and (_activation_has_subnormal_values(x2d, x_scales) or _has_subnormal_values(w, scales)):
            w32 = torch.empty(n, k, dtype=torch.float32)
            mxfp4.DEQUANTIZE.run(w, scales, torch.float32, -1, out=w32)
            out2d.copy_(x_deq.float() @ w32.T)
        else:  # the weight-only kernel: its float32 GEMV, its batched kernel, or decoded tiles and torch's GEMM
            MXFP4_LINEAR.run(x_deq, w, scales, None, out=out2d)
        out2d.add_((x2d @ d) @ u)

    @staticmethod
    def _on_tiles(x2d, w, scales, d, u, out2d, x_scales) -> bool:
        """Prefill on lowbit's AMX kernel where it takes x (GEMV_MAX_M < M <= _amx_max_m) and the rank
        (_tiles_sum_as_torch), and no MXFP4 value of x or W is a BF16 subnormal (the tiles would flush it):
        T = x d by torch, then x's fake quant laid out straight into the tiles' operand, P, L = T u and the final
        add in one call (WeightOnlyLinear.run_low_rank). Returns whether ``out2d`` holds the result; ``x_scales``
        gets x's scale bytes either way where it ran."""
        m, k = x2d.shape
        if not (GEMV_MAX_M < m <= _amx_max_m(k, x2d.dtype) and _tiles_sum_as_torch(d)):
            return False
        if _has_subnormal_values(w, scales):
            return False
        t = x2d @ d  # torch's matmul before the numba kernels: one hand-over of threads
        MXFP4_LINEAR.run_low_rank(x2d, w, scales, t, u, out=out2d, x_scales=x_scales)
        return not _activation_has_subnormal_values(x2d, x_scales)  # else the float32 path redoes it

    @staticmethod
    def _decode(x2d, w, scales, d, u, out2d, one_call: bool) -> None:
        """Decode with integer products (VNNI or AVX2) by _decode_template, compiled (one numba call) where
        ``one_call``, else run by Python (its three numba calls): the activation quantized and turned into
        operands, P by :func:`product_gemv`, the low-rank branch and the final add. The weight rows it leaves
        to the float32 path (non-finite or extreme scales) are computed here by MXFP4_LINEAR on the
        dequantized activation, then the low-rank branch and the add; where add_low_rank declines, torch's
        matmuls."""
        (m, k), n = x2d.shape, out2d.shape[1]
        args = (as_numpy(x2d), -(-k // STEP) * STEP, _BF16_QUANTIZER, as_numpy(w), as_numpy(scales), as_numpy(d),
                as_numpy(u), as_numpy(out2d), _NO_BIAS)
        fell_back, done, y32, fallback = _decode_call(n * k, _one_call_decode if one_call else _in_python, args)
        if fell_back:
            rows = torch.from_numpy(np.flatnonzero(fallback))
            x_deq = torch.empty(m, k, dtype=torch.bfloat16)
            x_codes = torch.empty(m, k // 2, dtype=torch.uint8)
            x_scales = torch.empty(m, k // BLOCK, dtype=torch.uint8)
            mxfp4.quantize_into(x2d, BLOCK, "floor", "ta", x_codes, x_scales, x_deq)
            products = torch.empty(m, len(rows), dtype=torch.bfloat16)
            MXFP4_LINEAR.run(x_deq, w[rows], scales[rows], None, out=products)
            y32[:, rows.numpy()] = products.float().numpy()
            done = add_low_rank(as_numpy(x2d), as_numpy(d), as_numpy(u), y32, as_numpy(out2d))
        if not done:
            out2d.copy_(torch.from_numpy(y32))
            out2d.add_((x2d @ d) @ u)


SVD_QUANT = SvdQuant()
