"""Weight-only linear layers on the CPU (numba): the packed weight is decoded in registers, never stored.

Two paths, chosen by the number of rows M of x (``GEMV_MAX_M``):

* **GEMV** (M <= GEMV_MAX_M, decoding): bit-exact with the reference (lowbit.formats.weight_only). The
  64 summation lanes are two F32V registers: one step decodes 64 consecutive weights of a row (k = 64t ..
  64t + 63) into float32 exactly as the reference does, multiplies them by x and adds them to the lanes
  (mul and add; for MXFP4 and HiFloat4 a fused multiply-add where every product of the row is exact, so
  that it gives the same bits, see _fused_bytes; on AVX512-BF16 CPUs, for rows of x that are BF16 values,
  two steps per BF16 dot product where that gives the same bits, see _paired_bytes); then
  :func:`f32v_sum_tree` folds the lanes in the reference's order. Rows are split across threads and
  summed four at a time where they can be (_block_sums); each row's sum is one thread's, in its own
  lanes, so the result does not depend on the thread count.
* **GEMM** (larger M, prefill): tiles of rows are decoded with the same step functions into a float32 (or,
  for weights that are BF16 values and BF16 x, BF16: as words straight from the look-ups on AVX-512) buffer,
  and torch multiplies x by each tile (its order: docs/weight_only.md, 'Tolerance of the GEMM path'; on AMX
  CPUs as y^T = W x^T, then transposed: 'CPU GEMM'); only one tile is ever decoded.

Decoding (docs/weight_only.md, 'Weights'):

* HiFloat8: dequantized in x's dtype, so a row has only 256 weights: they are put in a row table first
  (the bytes of each magnitude's BF16 or FP16 bits for vpermi2b with AVX512-VBMI, or for vpshufb with AVX2
  on CPUs without AVX512-BW; its words with AVX512-BW; otherwise the float32 values, gathered), then each
  code is a look-up.
* MXFP4: the block's 16-entry table (the E2M1 values times its E8M0 scale, the reference's products,
  precomputed for all 256 scale bytes) indexed by the nibbles (vpermps with AVX-512; with AVX2, an 8-entry
  vpermps on its sign-symmetric half, simd.lookup16_signed).
* HiFloat4: the block's 16-entry table (signed c/4 times the E6M2 scale: exact) indexed by the nibbles,
  doubled per lane where the e2 or e3 flag is set (exact; a multiply by 2 under the flags' lane mask).
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from lowbit.backends import Kernel
from lowbit.formats import hifloat8, mxfp4, mxfp8
from lowbit.formats import weight_only as reference
from lowbit.kernels.cpu import _code8_columns as _columns
from lowbit.kernels.cpu import amx
from lowbit.kernels.cpu import _transpose
from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu._runtime import (NJIT_OPTIONS, PARALLEL_NJIT_OPTIONS, SerialOrParallel, as_numpy, bound_njit,
                                         call_in_chunks, copy_elements, run_tasks, runs_serially,
                                         swap_parallel_chunksize)
from lowbit.kernels.cpu.memory import huge_page_empty, scratch_or_thread

LANES = reference.LANES  # 64 = two F32V
HALF = simd.LANES  # 32
GEMV_MAX_M = reference.EXACT_ROWS  # rows of x up to which the bit-exact GEMV path runs
# Bytes of one decoded GEMM tile (rows of W in float32 or BF16), decoded into the calling thread's scratch
# buffer (memory.thread_scratch: kept between calls, no page faults). Large tiles mean fewer, wider GEMM calls
# and fewer strided copies of their results: at M = 256, 4 tiles of 1024 rows cost 1.5 ms more than one
# 4096-row F.linear at K = 4096 (AMD EPYC Zen 4); on an Intel Xeon, whose BF16 GEMM runs on AMX tiles, kept
# tiles of 64 MiB took 1.05-1.15x F.linear's time at 12288 x 8192 and 1.25-1.33x at 4096^2, against
# 1.35-1.55x for 16 MiB ones allocated per call (benchmarks/results_weight_only.md, 'Intel Xeon').
GEMM_TILE_BYTES = 64 << 20
# A GEMV over fewer weights runs on one thread: waking numba's threads costs more than they save there
# (AMD Zen, following a torch op: 384^2 MXFP4 38 vs 115 us, 1024^2 92 vs 141 us, 2048^2 equal). Intel's CPUs
# gain from the second thread sooner (Intel Xeon Emerald Rapids, a converted layer at M = 1 after a BF16 F.linear,
# one thread against two: MXFP4 / HiFloat8 1536 x 384 0.078 / 0.106 against 0.079 / 0.129 ms, 1024^2 0.085 / 0.115
# against 0.081 / 0.108, 2048 x 1024 0.151 / 0.202 against 0.126 / 0.180, 1536^2 0.190 / 0.218 against 0.152 /
# 0.187; benchmarks/results_weight_only.md, 'Intel Xeon Emerald Rapids: HiFloat8 and FP8 in BF16 pairs').
GEMV_ONE_THREAD_WEIGHTS = 3 << 20 if simd.HOST_IS_AMD_ZEN else 1 << 20
_ROWS_PER_TASK = 8  # weight rows per prange iteration
_CHUNKS = 32  # prange iterations are handed out in about this many chunks (at least 4 iterations each)
_INLINE = dict(NJIT_OPTIONS, inline="always")

# ---- tables (from the reference formats) ------------------------------------------------------------------

# HiFloat8: the values of codes 0..127 in each x dtype, as float32. FP8 E4M3: exact values (0x7F: NaN).
_HIF8_MAGNITUDES = {dtype: hifloat8.decode_table(dtype)[:128].to(torch.float32).numpy()
                    for dtype in (torch.bfloat16, torch.float16)}
_E4M3_MAGNITUDES = mxfp8.e4m3_values(torch.arange(128, dtype=torch.uint8)).numpy()
_E4M3_NAN_CODE = 0x7F
assert _columns.FLOAT8_E4M3.encoded_nan == _E4M3_NAN_CODE  # so the code tables serve re-encoded MXFP8 codes too
# MXFP8: fixed code tables (E4M3 values are exact in BF16 and float32) of both kinds (see code8_decode), the
# E8M0 scale values, and which register lanes of a 64-element step hold its second 32-block.
_E4M3_VALUES = mxfp8.e4m3_values(torch.arange(256, dtype=torch.uint8)).numpy()
_E4M3_BF16_BYTES = np.concatenate([(_E4M3_VALUES[:128].view(np.uint32) >> shift).astype(np.uint8)
                                   for shift in (24, 16)])
_E4M3_BF16_WORDS = (_E4M3_VALUES[:128].view(np.uint32) >> 16).astype(np.int16)
_E4M3_BYTE_TABLES = simd.byte_tables(_E4M3_BF16_BYTES)  # as simd.byte_table_words reads them here
_E8M0_SCALES = reference.e8m0_scales().numpy()
# 16-entry tables of every scale byte, (256 * 16,) float32: entry 16 b + nibble. MXFP4: the E2M1 value times
# the E8M0 scale (one rounding: the reference's weight); HiFloat4: (-1)^s c/4 times the E6M2 scale (exact).
_MXFP4_TABLES = (reference.e8m0_scales()[:, None] * mxfp4.e2m1_values(torch.float32)).reshape(-1).numpy()
_HIFLOAT4_TABLES = (reference.e6m2_scales()[:, None] * reference.hifloat4_quarters()).reshape(-1).numpy()


def _sign_symmetric(tables: np.ndarray) -> bool:
    """Whether each 16-entry table's entries 8-15 are its entries 0-7 with the sign bit set, NaN entries
    aside (what simd.lookup16_signed needs: the code's bit 3 is its sign)."""
    bits = tables.reshape(-1, 16).view(np.uint32)
    flipped = bits[:, :8] ^ np.uint32(0x80000000)
    return bool(np.all((bits[:, 8:] == flipped) | np.isnan(tables.reshape(-1, 16)[:, 8:])))


assert _sign_symmetric(_MXFP4_TABLES) and _sign_symmetric(_HIFLOAT4_TABLES)
# The same tables as simd.lookup16_signed reads them (on AVX2 CPUs without AVX-512, entries marked for its
# mask-free sign: simd.signed_tables_avx2).
_MXFP4_LOOKUP = simd.signed_tables(_MXFP4_TABLES)
_HIFLOAT4_LOOKUP = simd.signed_tables(_HIFLOAT4_TABLES)


def _exponent_bounds(tables: np.ndarray, multiplier: float) -> np.ndarray:
    """(2, 256) int32: per scale byte b, floor(log2) of the smallest nonzero |weight| of its 16-entry table
    and of the largest finite one times ``multiplier`` (HiFloat4's levels: up to x4); both never decrease
    with b. The NaN table of byte 0xFF (a NaN scale or a poisoned block) gets the bounds of 0xFE."""
    magnitudes = np.abs(tables.reshape(256, 16)).astype(np.float64)
    nan = np.isnan(magnitudes).any(axis=1)
    assert nan.tolist() == [False] * 255 + [True]  # the NaN / poison byte is 0xFF
    smallest = np.where(magnitudes > 0, magnitudes, np.inf).min(axis=1)
    largest = np.where(np.isinf(magnitudes), 0.0, magnitudes).max(axis=1) * multiplier  # Inf * x: exact
    bounds = np.floor(np.log2(np.stack([smallest, largest])[:, :255])).astype(np.int32)
    assert (np.diff(bounds, axis=1) >= 0).all()  # both grow with the byte: see _all_fused
    return np.concatenate([bounds, bounds[:, -1:]], axis=1)  # 0xFF (NaN products in any order) as 0xFE


_MXFP4_EXPONENTS = _exponent_bounds(_MXFP4_TABLES, 1.0)
_HIFLOAT4_EXPONENTS = _exponent_bounds(_HIFLOAT4_TABLES, 4.0)
_NO_EXPONENT = 1 << 20  # _x_exponents of a row without finite nonzero values

# ---- register orders ---------------------------------------------------------------------------------------
# A step's 64 weights sit in two F32V registers in an order that is cheap to decode into: register lane p
# (0..63; lanes 32..63 are the second register) holds element ORDER[p] of the step. x is stored in the same
# order, so every register lane accumulates one logical lane of the reference; the lanes are put back in the
# logical order (one shuffle) before the reference's pairwise fold.

# An order is given as a split of the 64 elements into dimensions and a permutation of them (so that x is
# put in it by one strided copy); ORDER lists the element of each register lane.


def _reorder(x32: torch.Tensor, split: tuple[int, ...], perm: tuple[int, ...]) -> torch.Tensor:
    """x32 (M, Kp), Kp a multiple of 64, with every 64-element step put in the order (split, perm)."""
    m, kp = x32.shape
    steps = x32.view(m, kp // LANES, *split).permute(0, 1, *(2 + p for p in perm))
    return steps.reshape(m, kp)


def _order(split: tuple[int, ...], perm: tuple[int, ...]) -> list[int]:
    return _reorder(torch.arange(LANES, dtype=torch.float32).unsqueeze(0), split, perm).int().flatten().tolist()


# HiFloat8: the byte unpacks of 64 codes; register quarter q (16 lanes), lane r: element 16 (r // 4) + 4 q + r % 4.
CODE8_BLOCK_SPLIT = ((4, 4, 4), (1, 0, 2))
# The same on AVX2 CPUs without AVX-512, each half of the step (codes 0-31, 32-63: one 32-byte register each)
# unpacked on its own, so that a row can be summed in two passes of 32 lanes (_code8_row_sum): register
# (half, byte unpack w, word unpack h), lane 4 a + d holds element 32 half + 16 a + 8 w + 4 h + d (a: the
# 128-bit lane).
CODE8_HALVES_SPLIT = ((2, 2, 2, 2, 4), (0, 2, 3, 1, 4))
# MXFP4, HiFloat4: the low nibbles of 32 bytes (elements 0, 2, .., 62), then the high nibbles (1, 3, .., 63).
NIBBLE_SPLIT = ((32, 2), (1, 0))
# MXFP4 and HiFloat4 on AVX2 CPUs without AVX-512 (_bf16_byte_lookups): the 32 bytes of a step are one
# 32-byte register, bytes 0-15 in its low 128-bit lane (MXFP4: block a; HiFloat4: elements 0-31) and 16-31 in
# the high one; vpshufb looks up each nibble's BF16 bytes, vpunpck{l,h}bw pairs them into words (bytes 0-7,
# then 8-15 of each lane), and a shift by 16 (even words) or a mask (odd words) makes float32 lanes. Register
# (nibble, unpack half h, word parity) holds, in lane 4 * half + d, element 32 * half + 16 h + 4 d + 2 parity
# + nibble (half: the 128-bit lane).
BYTE_SHUFFLE_SPLIT = ((2, 2, 4, 2, 2), (4, 1, 3, 0, 2))
BYTE_SHUFFLE_NIBBLES = simd.HAS_AVX2 and not simd.HAS_AVX512F  # (AVX-512 CPUs sum four rows at once instead)
FOUR_BIT_SPLIT = BYTE_SHUFFLE_SPLIT if BYTE_SHUFFLE_NIBBLES else NIBBLE_SPLIT
# HiFloat4 on those CPUs (hifloat4_bf16_step): value bytes 0-15, then 16-31, each in both 128-bit lanes of a
# register, the low lane's low nibbles and the high lane's high nibbles looked up, then unpacked as above:
# register (bytes half, unpack half h, word parity) holds, in lane 4 * nibble + d, element 32 * half + 16 h +
# 4 d + 2 parity + nibble.
HIFLOAT4_SHUFFLE_SPLIT = ((2, 2, 4, 2, 2), (0, 1, 3, 4, 2))
HIFLOAT4_SPLIT = HIFLOAT4_SHUFFLE_SPLIT if BYTE_SHUFFLE_NIBBLES else NIBBLE_SPLIT
CODE8_HALVES = BYTE_SHUFFLE_NIBBLES  # the CPUs that sum rows one by one and look bytes up by vpshufb
CODE8_SPLIT = CODE8_HALVES_SPLIT if CODE8_HALVES else CODE8_BLOCK_SPLIT
CODE8_ORDER = _order(*CODE8_SPLIT)
NIBBLE_ORDER = _order(*NIBBLE_SPLIT)
FOUR_BIT_ORDER = _order(*FOUR_BIT_SPLIT)
HIFLOAT4_ORDER = _order(*HIFLOAT4_SPLIT)
_CODE8_ELEMENTS = np.array(CODE8_ORDER)
_SECOND_BLOCK = (_CODE8_ELEMENTS >= 32).astype(np.int32)  # MXFP8: lanes of the step's second 32-block
_FIRST_BLOCK = 1 - _SECOND_BLOCK

_V8x64 = ir.VectorType(ir.IntType(8), 64)
_V16x32 = ir.VectorType(ir.IntType(16), 32)
_V32x16 = ir.VectorType(ir.IntType(32), 16)
_I32 = ir.IntType(32)


def _mask(values) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I32, len(values)), list(values))


def _halves(builder, vector64):
    """A 64-lane vector as two 32-lane ones."""
    return (builder.shuffle_vector(vector64, vector64, _mask(range(HALF))),
            builder.shuffle_vector(vector64, vector64, _mask(range(HALF, LANES))))


def _make_reorder(source, target):
    sources = [source.index(element) for element in target]

    @intrinsic
    def reorder(typingctx, first, second):
        """The 64 lanes of (``first``, ``second``), kept in register order ``source``, put in register order
        ``target`` (an identity costs nothing)."""

        def codegen(context, builder, sig, args):
            low = builder.shuffle_vector(args[0], args[1], _mask(sources[:HALF]))
            high = builder.shuffle_vector(args[0], args[1], _mask(sources[HALF:]))
            return context.make_tuple(builder, sig.return_type, [low, high])

        return types.UniTuple(simd.F32V, 2)(first, second), codegen

    return reorder


def _make_logical(order):
    """The 64 lanes kept in register order ``order`` as logical lanes (0..31, 32..63)."""
    return _make_reorder(order, list(range(LANES)))


def _fold_levels(order):
    """The shuffles of _make_fold: per level of the reference's tree (width w: element j plus element j + w,
    j < w), the lanes holding the lower elements and the lanes of their partners, in register order."""
    logical, levels = list(order), []
    while len(logical) > 1:
        width = len(logical) // 2
        lane_of = {element: lane for lane, element in enumerate(logical)}
        lower = [lane for lane, element in enumerate(logical) if element < width]
        levels.append((lower, [lane_of[logical[lane] + width] for lane in lower]))
        logical = [logical[lane] for lane in lower]
    return levels


def _make_fold(order):
    levels = _fold_levels(order)

    @intrinsic
    def fold(typingctx, first, second):
        """The float32 sum of the 64 lanes of (``first``, ``second``), kept in this register order, folded
        as the reference does: lane[i] + lane[i + 32] in logical order, then f32v_sum_tree. Each level adds
        the lanes of the lower elements to their partners where they lie (docs/weight_only.md, 'Kernels')."""

        def codegen(context, builder, sig, args):
            vector = builder.shuffle_vector(args[0], args[1], _mask(range(LANES)))
            for lower, upper in levels:
                vector = builder.fadd(builder.shuffle_vector(vector, vector, _mask(lower)),
                                      builder.shuffle_vector(vector, vector, _mask(upper)))
            return builder.extract_element(vector, ir.Constant(_I32, 0))

        return types.float32(first, second), codegen

    return fold


code8_logical = _make_logical(CODE8_ORDER)
four_bit_logical = _make_logical(FOUR_BIT_ORDER)
hifloat4_logical = _make_logical(HIFLOAT4_ORDER)
_row_sum_code8 = _make_fold(CODE8_ORDER)
_row_sum_nibbles = _make_fold(NIBBLE_ORDER)
_row_sum_4bit = _make_fold(FOUR_BIT_ORDER)
_row_sum_hifloat4 = _make_fold(HIFLOAT4_ORDER)
_to_4bit_order = _make_reorder(NIBBLE_ORDER, FOUR_BIT_ORDER)  # the float32 tables' steps in FOUR_BIT_ORDER

# ---- 8-bit codes (HiFloat8, FP8 E4M3): 64 codes -> two F32V in CODE8_ORDER -------------------------------
# An 8-bit weight is dequantized in x's dtype (docs/weight_only.md, 'Weights'), so one row of W holds at
# most 256 values: each row's are put in a table first (_fill_row_table), then every code is a look-up. The
# kind of row table is its array type (the code's sign is XORed in, except for value tables):
#   uint8 (256,)    BF16 x, AVX512-VBMI or AVX2 without AVX512-BW: the high, then the low bytes of the
#                   BF16 bits of codes 0..127 (one vpermi2b each per 64 codes; with AVX2, eight vpshufb per
#                   32 codes on the bytes telescoped: simd.byte_table_words);
#   uint8 (2, 128)  FP16 x, the same CPUs: the same bytes of the FP16 bits;
#   int16 (128,)    BF16 x, AVX512-BW: the BF16 bits of codes 0..127 (two vpermi2w and a blend per 32);
#   uint16 (128,)   FP16 x, AVX512-BW: the FP16 bits, likewise (then vcvtph2ps);
#   float32 (256,)  elsewhere: the values of all 256 codes (NaN at the NaN code), gathered.


def _code8_decode_bytes(context, builder, codes, table_arg, nan_code):
    """16-bit patterns of the code's magnitude from the row's byte tables (simd.byte_table_words): BF16
    for a 1-D table, FP16 for a 2-D one; the code's sign XORed in, NaN for ``nan_code``; bytes -> words by
    unpacking, words -> FP32 by unpacking with zeros below (BF16) or vcvtph2ps (FP16), in CODE8_ORDER (all
    64 bytes' 128-bit lanes at once, or each 32-byte half on its own: CODE8_HALVES)."""
    table_type, table = table_arg
    data = context.make_array(table_type)(context, builder, table).data
    high, low = simd.byte_table_words(builder, codes, builder.bitcast(data, ir.IntType(8).as_pointer()),
                                      builder.trunc(nan_code, ir.IntType(8)))
    parts = [(0, 64)] if not CODE8_HALVES else [(0, 32), (32, 64)]
    pieces = []
    for begin, end in parts:
        lanes = (end - begin) // 16  # 128-bit lanes
        for w in _byte_pairs(builder, low, high, begin, end):
            if table_type.ndim == 2:  # FP16 bits: vcvtph2ps
                for h in (0, 1):
                    chosen = builder.shuffle_vector(w, w, _mask([8 * lane + j for lane in range(lanes)
                                                                 for j in range(4 * h, 4 * h + 4)]))
                    pieces.append(simd.f16_to_f32(builder, chosen))
            else:
                pieces.extend(_bf16_words_widened(builder, w, lanes))
    middle = len(pieces) // 2
    return simd._concatenated(builder, pieces[:middle]), simd._concatenated(builder, pieces[middle:])


def _byte_pairs(builder, low, high, begin, end):
    """The two <8 * lanes x i16> of bytes begin .. end - 1 (``lanes`` 128-bit lanes) of the byte vectors ``low``
    and ``high`` paired into words (low byte, high byte), as unpack{l,h}bw per 128-bit lane: the words of
    bytes 0-7, then of bytes 8-15, of each lane (CODE8_ORDER)."""
    lanes, width = (end - begin) // 16, low.type.count
    return [builder.bitcast(builder.shuffle_vector(low, high, _mask(
        [i for lane in range(lanes) for j in range(begin + 16 * lane + 8 * h, begin + 16 * lane + 8 * h + 8)
         for i in (j, width + j)])), ir.VectorType(ir.IntType(16), 8 * lanes)) for h in (0, 1)]


def _bf16_words_widened(builder, words, lanes):
    """The float32 values of BF16 bit patterns ``words`` (<8 * lanes x i16>) as two <4 * lanes x float>: words
    0-3, then 4-7, of each 128-bit lane, unpacked ({l,h}wd) with zero below (CODE8_ORDER)."""
    zero = ir.Constant(words.type, [0] * 8 * lanes)
    pieces = []
    for h in (0, 1):
        pairs = [i for lane in range(lanes) for j in range(4 * h, 4 * h + 4)
                 for i in (8 * lane + j, 8 * lanes + 8 * lane + j)]
        pieces.append(builder.bitcast(builder.shuffle_vector(zero, words, _mask(pairs)),
                                      ir.VectorType(ir.FloatType(), 4 * lanes)))
    return pieces


def _code8_decode_gather(context, builder, codes, table_arg, nan_code):
    """The values gathered from the row's 256-entry float32 table, in plain LLVM IR."""
    table_type, table = table_arg
    data = context.make_array(table_type)(context, builder, table).data
    ordered = builder.shuffle_vector(codes, codes, _mask(CODE8_ORDER))
    i64 = ir.IntType(64)
    v64 = ir.VectorType(i64, HALF)
    base = builder.insert_element(ir.Constant(v64, None), builder.ptrtoint(data, i64), ir.Constant(_I32, 0))
    bases = builder.shuffle_vector(base, base, _mask([0] * HALF))
    v_f32, v_i1 = ir.VectorType(ir.FloatType(), HALF), ir.VectorType(ir.IntType(1), HALF)
    halves = []
    for part in _halves(builder, ordered):
        offsets = builder.shl(builder.zext(part, v64), ir.Constant(v64, [2] * HALF))
        pointers = builder.inttoptr(builder.add(bases, offsets), ir.VectorType(data.type, HALF))
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v_f32, [pointers.type, _I32, v_i1, v_f32]),
            f"llvm.masked.gather.v{HALF}f32.v{HALF}p0")
        halves.append(builder.call(fn, [pointers, ir.Constant(_I32, 4), ir.Constant(v_i1, [1] * HALF),
                                        ir.Constant(v_f32, None)]))
    return halves


def _code8_decode_words(context, builder, codes, table_arg, nan_code):
    """The 16-bit patterns (BF16 for an int16 table, FP16 for a uint16 one) of the code's magnitude from the
    row's 128 words (two vpermi2w on index bits 0-5, a blend on bit 6), the code's sign XORed in, NaN for
    ``nan_code``; widened to float32 in CODE8_ORDER."""
    table_type, table = table_arg
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_V16x32, [_V16x32] * 3), "llvm.x86.avx512.vpermi2var.hi.512")
    data = builder.bitcast(context.make_array(table_type)(context, builder, table).data, _V16x32.as_pointer())
    quarters = [builder.load(builder.gep(data, [ir.Constant(_I32, q)]), align=1) for q in range(4)]
    ordered = builder.shuffle_vector(codes, codes, _mask(CODE8_ORDER))
    nan_word = simd._splat(builder, builder.trunc(nan_code, ir.IntType(16)), _V16x32)
    words16 = ir.VectorType(ir.IntType(16), HALF)
    halves = []
    for part in _halves(builder, ordered):
        index = builder.zext(part, words16)
        low = builder.call(fn, [quarters[0], index, quarters[1]])
        high = builder.call(fn, [quarters[2], index, quarters[3]])
        upper = builder.icmp_unsigned("!=", builder.and_(index, ir.Constant(words16, [64] * HALF)),
                                      ir.Constant(words16, [0] * HALF))
        word = builder.select(upper, high, low)
        sign = builder.shl(builder.and_(index, ir.Constant(words16, [0x80] * HALF)), ir.Constant(words16, [8] * HALF))
        word = builder.xor(word, sign)
        word = builder.select(builder.icmp_unsigned("==", index, nan_word), ir.Constant(words16, [0x7FFF] * HALF), word)
        if table_type.dtype == types.uint16:  # FP16 bits
            halves.append(simd.f16_to_f32(builder, word))
        else:  # BF16 bits
            widened = builder.shl(builder.zext(word, simd._VI32), ir.Constant(simd._VI32, [16] * HALF))
            halves.append(builder.bitcast(widened, simd._VF32))
    return halves


_DECODE_BY_TABLE = {types.uint8: _code8_decode_bytes, types.int16: _code8_decode_words,
                    types.uint16: _code8_decode_words, types.float32: _code8_decode_gather}


@intrinsic
def code8_decode(typingctx, codes, index, table, nan_code):
    """The row's weights of the 64 codes ``codes[index : index + 64]`` (a 1-D C-contiguous uint8 array) as
    two F32V in CODE8_ORDER, looked up in the row ``table`` (_fill_row_table; its kinds above). ``nan_code``
    (int) decodes to a NaN whose payload depends on the table kind (outputs are made canonical)."""
    lower = _DECODE_BY_TABLE[table.dtype]

    def codegen(context, builder, sig, args):
        ptr = simd._element_ptr(context, builder, sig.args[0], args[0], args[1], _V8x64)
        first, second = lower(context, builder, builder.load(ptr, align=1), (sig.args[2], args[2]), args[3])
        return context.make_tuple(builder, sig.return_type, [first, second])

    return types.UniTuple(simd.F32V, 2)(codes, index, table, nan_code), codegen


@intrinsic
def code8_decode_half(typingctx, codes, index, table, nan_code):
    """The first F32V of code8_decode for the 32 codes ``codes[index : index + 32]``: with CODE8_HALVES, the
    weights of those codes (CODE8_ORDER's first 32 lanes hold a step's codes 0-31, its last 32 codes 32-63)."""
    lower = _DECODE_BY_TABLE[table.dtype]

    def codegen(context, builder, sig, args):
        ptr = simd._element_ptr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(ir.IntType(8), HALF))
        half = builder.load(ptr, align=1)
        both = builder.shuffle_vector(half, half, _mask(list(range(HALF)) * 2))  # the copy's lanes go unused
        return lower(context, builder, both, (sig.args[2], args[2]), args[3])[0]

    return simd.F32V(codes, index, table, nan_code), codegen


# HiFloat8 and FP8 E4M3 in BF16 pairs (code8_pairs; CPUs with AVX512-BF16 and VBMI, BF16 x): a pair step is two
# steps t and t + 1 of a row, their 128 codes interleaved byte by byte (vpunpck{l,h}bw: step t + 1's code of
# element e, then step t's), looked up in the row's BF16 byte tables (vpermi2b each for the high and the low
# bytes, the code's sign XORed in) and paired into words again by unpacks: dword lane i of each register holds
# element e of step t + 1 (even word) and of step t (odd word), so one vdpbf16ps makes lane e's two reference
# additions in order (docs/weight_only.md, 'Summation order', 'BF16 pairs'). I32V A (from the codes' low
# unpack) lane i holds element 16 (i % 16 // 4) + 4 (i // 16) + i % 4, I32V B the same plus 8.
CODE8_PAIRS = simd.HAS_AVX512BF16 and simd.HAS_AVX512VBMI
CODE8_PAIR_ORDER = [16 * (i % 16 // 4) + 8 * register + 4 * (i // 16) + i % 4
                    for register in (0, 1) for i in range(HALF)]
assert sorted(CODE8_PAIR_ORDER) == list(range(LANES))
_row_sum_code8_pairs = _make_fold(CODE8_PAIR_ORDER)
# HiFloat8's NaN code is 0x80, the sign bit over zero's magnitude: the byte tables cannot hold it (code 0x00 shares
# its look-up), so the pair step also keeps the smallest signed byte of a row's codes (-128: a NaN weight); FP8
# E4M3's NaN codes 0x7F / 0xFF look up the NaN its table holds (checked here).
_CODE8_NAN_BY_MINIMUM = 0x80
assert hifloat8.NAN_CODE == _CODE8_NAN_BY_MINIMUM and np.isnan(_E4M3_MAGNITUDES[_E4M3_NAN_CODE])


def _code8_pair_registers(builder, codes, quarters, vpermi2b):
    """I32V of BF16 word pairs from the interleaved codes ``codes`` (<64 x i8>): the
    high and low bytes looked up in the row's tables (``quarters``: its four 64-byte quarters), the code's sign
    XORed into the high byte, the bytes paired into words per 128-bit lane (bytes 0-7, then 8-15)."""
    high = builder.call(vpermi2b, [quarters[0], codes, quarters[1]])
    low = builder.call(vpermi2b, [quarters[2], codes, quarters[3]])
    high = builder.xor(high, builder.and_(codes, ir.Constant(_V8x64, [0x80] * LANES)))
    words = [i for h in (0, 1) for lane in range(4) for j in range(16 * lane + 8 * h, 16 * lane + 8 * h + 8)
             for i in (j, LANES + j)]
    return builder.bitcast(builder.shuffle_vector(low, high, _mask(words)), simd._VI32)


@intrinsic
def code8_pairs(typingctx, codes, start, table, smallest):
    """(A, B, smallest): the BF16 pairs of the pair step of 128 codes at ``codes[start]`` (1-D uint8; steps t and
    t + 1) from the row's byte ``table`` (uint8[256]: _fill_row_table's BF16 bytes, for BF16 x), two I32V in
    CODE8_PAIR_ORDER; and ``smallest`` (U8P) lowered to the signed minimum of these codes' bytes (-128 where one
    is 0x80: HiFloat8's NaN code). Where CODE8_PAIRS (AVX512-BF16 and VBMI). Typed for any row table, so that
    the rows kernel compiles for every table kind: for other tables (and CPUs) zeros, never used, as x's pairs
    are made only for BF16 byte tables there (_code8_x_operands)."""
    if not isinstance(table, types.Array):
        return None

    def codegen(context, builder, sig, args):
        if not (CODE8_PAIRS and table.dtype == types.uint8 and table.ndim == 1):  # never run (_code8_pairable)
            zero = ir.Constant(simd._VI32, [0] * HALF)
            return context.make_tuple(builder, sig.return_type, [zero, zero, args[3]])
        first = builder.load(simd._element_ptr(context, builder, sig.args[0], args[0], args[1], _V8x64), align=1)
        second = builder.load(simd._element_ptr(context, builder, sig.args[0], args[0],
                                                builder.add(args[1], ir.Constant(args[1].type, LANES)), _V8x64),
                              align=1)
        smin = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8x64, [_V8x64] * 2), "llvm.smin.v64i8")
        smallest = builder.call(smin, [args[3], builder.call(smin, [first, second])])
        vpermi2b = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8x64, [_V8x64] * 3),
                                                  "llvm.x86.avx512.vpermi2var.qi.512")
        data = builder.bitcast(context.make_array(sig.args[2])(context, builder, args[2]).data,
                               ir.IntType(8).as_pointer())
        quarters = [builder.load(builder.bitcast(builder.gep(data, [ir.Constant(_I32, LANES * q)]),
                                                 _V8x64.as_pointer()), align=1) for q in range(4)]
        registers = []
        for half in (0, 1):  # step t + 1's byte, then step t's, per 128-bit lane: bytes 0-7, then 8-15
            interleaved = builder.shuffle_vector(second, first, _mask(
                [i for lane in range(4) for j in range(16 * lane + 8 * half, 16 * lane + 8 * half + 8)
                 for i in (j, LANES + j)]))
            registers.append(_code8_pair_registers(builder, interleaved, quarters, vpermi2b))
        return context.make_tuple(builder, sig.return_type, [*registers, smallest])

    return types.Tuple([simd.I32V, simd.I32V, simd.U8P])(codes, start, table, smallest), codegen


@intrinsic
def u8p_largest(typingctx):
    """U8P of 0x7F in every byte: the start of code8_pairs' signed minimum."""
    return simd.U8P(), lambda context, builder, sig, args: ir.Constant(_V8x64, [0x7F] * LANES)


@intrinsic
def u8p_holds_minimum(typingctx, smallest):
    """Whether a byte of ``smallest`` (U8P) is -128 (0x80)."""

    def codegen(context, builder, sig, args):
        found = builder.icmp_signed("==", args[0], ir.Constant(_V8x64, [-128] * LANES))
        return builder.icmp_unsigned("!=", builder.bitcast(found, ir.IntType(LANES)), ir.Constant(ir.IntType(LANES), 0))

    return types.boolean(smallest), codegen


# HiFloat8 and FP8 E4M3 codes re-encoded by columns (lowbit.kernels.cpu._code8_columns): a prepared BF16-x weight
# on the CPUs that look bytes up by vpshufb (CODE8_HALVES) decodes in about half the vector instructions of
# the telescoped 128-entry table (docs/weight_only.md, '8-bit codes by columns').
CODE8_COLUMNS = CODE8_HALVES
# The column operands (fast, slow_blocks, column_tables) of codes not re-encoded: column tables of a type of
# their own (int8), on which _by_column_tables chooses the table decode when numba compiles a kernel.
_NO_FAST_ROWS = np.zeros(0, dtype=np.uint8)
_NO_SLOW_BLOCKS = np.zeros((0, 1), dtype=np.uint8)
_NOT_BY_COLUMNS = np.zeros((0, _columns.TABLE_BYTES), dtype=np.int8)


def _by_column_tables(by_columns, by_table):
    """A numba function ``f(column_tables, args)``: ``by_columns(*args)`` where ``column_tables`` are column
    tables (uint8: codes re-encoded by columns), else ``by_table(*args)`` (_NOT_BY_COLUMNS), chosen when numba
    compiles the caller, which compiles only that one (a weight's operator calls, as in ``lowbit smoke``,
    compile no column code). ``by_columns``, ``by_table``: numba functions."""

    def choose(column_tables, args):
        raise NotImplementedError("numba only")

    @overload(choose, jit_options=NJIT_OPTIONS)
    def choose_typed(column_tables, args):
        if column_tables.dtype == types.int8:
            return lambda column_tables, args: by_table(*args)
        return lambda column_tables, args: by_columns(*args)

    return choose
# Rows ahead that a row's first pass prefetches (the GEMV from memory, AMD Zen 3: 12.2-12.6 -> 10.0-10.4 cycles
# per 32 codes; 1, 2 and 4 rows alike).
_COLUMN_AHEAD_ROWS = 2


def _both_lanes(builder, data, offset):
    """<32 x i8>: the 16 bytes at data + offset (an i8 pointer, any alignment) in both 128-bit lanes."""
    pointer = builder.bitcast(builder.gep(data, [ir.Constant(_I32, offset)]),
                              ir.VectorType(ir.IntType(8), 16).as_pointer())
    return simd.broadcast_lanes(builder, pointer, align=1)


@intrinsic
def code8_columns_half(typingctx, codes, index, tables, row, addends):
    """code8_decode_half of 32 re-encoded 8-bit codes ``codes[index : index + 32]`` (uint8) whose column table
    is ``tables[row]`` (``tables``: (R, _code8_columns.TABLE_BYTES) uint8, C-contiguous, or its flat view, a
    table a row: T's low, then high bytes; _code8_columns.fill_column_table), with ``addends`` = _code8_columns.ADDENDS: per
    code, T[j] and the addend of its high nibble (one vpshufb each for the low and the high bytes; zero's
    slot looked up as 0), paired into words and added, widened in CODE8_ORDER. AVX2; codes whose weights the
    table gives only (rows of _code8_columns.encode_rows's ``fast``)."""

    def codegen(context, builder, sig, args):
        i8p, i64 = ir.IntType(8).as_pointer(), ir.IntType(64)
        v32, v16 = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(16), 16)
        r = builder.load(simd._element_ptr(context, builder, sig.args[0], args[0], args[1], v32), align=1)
        tables_data, fixed = (builder.bitcast(context.make_array(sig.args[i])(context, builder, args[i]).data, i8p)
                              for i in (2, 4))
        row_at = builder.mul(context.cast(builder, args[3], sig.args[3], types.int64),
                             ir.Constant(i64, _columns.TABLE_BYTES))
        table = builder.gep(tables_data, [row_at])
        column = builder.and_(r, ir.Constant(v32, [0x0F] * 32))
        zero = builder.sext(builder.icmp_unsigned("==", r, ir.Constant(v32, [_columns.ZERO_CODE] * 32)), v32)
        column = builder.or_(column, zero)  # index bit 7: vpshufb gives 0
        nibble = builder.lshr(builder.bitcast(r, v16), ir.Constant(v16, [4] * 16))
        nibble = builder.and_(builder.bitcast(nibble, v32), ir.Constant(v32, [0x0F] * 32))
        bases = [simd.vpshufb(builder, _both_lanes(builder, table, at), column) for at in (0, 16)]
        addends = [simd.vpshufb(builder, _both_lanes(builder, fixed, at), nibble) for at in (0, 16)]
        pieces = []
        for base, addend in zip(_byte_pairs(builder, *bases, 0, 32), _byte_pairs(builder, *addends, 0, 32)):
            pieces.extend(_bf16_words_widened(builder, builder.add(base, addend), 2))
        return simd._concatenated(builder, pieces)

    return simd.F32V(codes, index, tables, row, addends), codegen


def _fill_row_table(magnitudes, scale, bf16, nan_code, table):
    """Put one row's weights in ``table``: code c's is ``fl32(magnitudes[c & 0x7F] * scale)`` rounded to x's
    dtype (BF16 if ``bf16``, else FP16), negated for c >= 0x80, NaN for ``nan_code``. ``magnitudes`` (128,)
    float32 and the row's ``scale`` (float32) are the format's (HiFloat8: both already rounded to x's dtype,
    so the float32 product is exact; FP8: the code value and the FP32 scale, as fake quant multiplies them).
    A uint8 table gets the BF16 (1-D) or FP16 (2-D) bytes of codes 0..127, an int16 / uint16 one their BF16
    / FP16 bits, a float32 table the values of all 256."""


@overload(_fill_row_table, jit_options=NJIT_OPTIONS)
def _fill_row_table_typed(magnitudes, scale, bf16, nan_code, table):
    if table.dtype == types.uint8:
        store = simd.f32v_store_f16_bytes if table.ndim == 2 else simd.f32v_store_bf16_bytes

        def fill_bytes(magnitudes, scale, bf16, nan_code, table):
            for i in range(0, 128, HALF):
                store(table, i, 128 + i, simd.f32v_mul(simd.f32v_load(magnitudes, i), scale))
            if simd.TELESCOPED_BYTE_TABLES:
                simd.telescope_byte_tables(simd.flat(table))

        return fill_bytes
    if table.dtype == types.int16:
        def fill_bf16_words(magnitudes, scale, bf16, nan_code, table):
            for i in range(0, 128, HALF):
                simd.f32v_store_as_bf16(table, i, simd.f32v_mul(simd.f32v_load(magnitudes, i), scale))

        return fill_bf16_words
    if table.dtype == types.uint16:
        def fill_f16_words(magnitudes, scale, bf16, nan_code, table):
            for i in range(0, 128, HALF):
                simd.f32v_store_as_f16(table, i, simd.f32v_mul(simd.f32v_load(magnitudes, i), scale))

        return fill_f16_words

    def fill_values(magnitudes, scale, bf16, nan_code, table):
        for i in range(0, 128, HALF):
            value = simd.f32v_mul(simd.f32v_load(magnitudes, i), scale)
            value = simd.f32v_round_to_bf16(value) if bf16 else simd.f32v_round_to_f16(value)
            simd.f32v_store(table, i, value)
            simd.f32v_store(table, 128 + i, simd.f32v_mul(value, np.float32(-1.0)))
        table[nan_code] = np.nan

    return fill_values


# ---- HiFloat4 multipliers: 2^(e2 + e3) per lane ------------------------------------------------------------
# In NIBBLE_ORDER register lane i of either register holds element 2i or 2i + 1: 8-group i // 4, 4-group
# i // 2. Their flags in the block's little-endian scale word [E6M2, e2, e3 (groups 0-7), e3 (8-15)], flag
# bytes MSB first (docs/weight_only.md, 'Weights'): e2 of group g is bit 7 - g of byte 1, e3 of group g bit
# 7 - g of byte 2 (g < 8) or 15 - g of byte 3. A flag byte is turned into the lanes it doubles (bit i: lane
# i) by a table: _E2_LANES (byte 1: lanes 0..31) and _E3_LANES (byte 2: lanes 0..15; byte 3 shifted by 16).
_E2_LANES = np.array([sum(((v >> (7 - i // 4)) & 1) << i for i in range(HALF)) for v in range(256)], dtype=np.uint32)
_E3_LANES = np.array([sum(((v >> (7 - i // 2)) & 1) << i for i in range(HALF // 2)) for v in range(256)],
                     dtype=np.uint32)


# Without AVX-512 (no mask registers) a lane mask from bits costs several instructions per 8 lanes; there
# the doublings are one multiply by 1, 2 or 4 per 8 lanes instead. Lanes 8c .. 8c + 7 of either register
# (quarter c) hold the elements of 8-groups 2c, 2c + 1 and 4-groups 4c .. 4c + 3, whose flags are the 2 bits
# of the scale word at _E2_SHIFTS[c] and the 4 bits at _E3_SHIFTS[c] (first group in the higher bit): row
# ``e2 << 4 | e3`` of quarter c's 64 x 8 table _LEVEL_MULTIPLIERS[c] holds each lane's 2^(e2 + e3).
_E2_SHIFTS = tuple(14 - 2 * c for c in range(4))
_E3_SHIFTS = (20, 16, 28, 24)


def _level_multipliers() -> np.ndarray:
    """(4 * 64 * 8,) float32: _LEVEL_MULTIPLIERS, checked against the bit masks of _E2_LANES / _E3_LANES."""
    table = np.empty((4, 64, 8), dtype=np.float32)
    for c in range(4):
        for key in range(64):
            word = ((key >> 4) << _E2_SHIFTS[c]) | ((key & 15) << _E3_SHIFTS[c])
            e2 = _E2_LANES[(word >> 8) & 0xFF]
            e3 = _E3_LANES[(word >> 16) & 0xFF] | (_E3_LANES[(word >> 24) & 0xFF] << 16)
            for lane in range(8):
                i = 8 * c + lane
                table[c, key, lane] = 2.0 ** (((int(e2) >> i) & 1) + ((int(e3) >> i) & 1))
    return table.reshape(-1)


_LEVEL_MULTIPLIERS = _level_multipliers()


@numba.njit(**_INLINE)
def _level_row(word, c):
    """Element offset in _LEVEL_MULTIPLIERS of quarter c's multipliers for scale word ``word``."""
    key = ((word >> _E2_SHIFTS[c]) & 3) << 4 | ((word >> _E3_SHIFTS[c]) & 15)
    return np.int64(8 * (64 * c + key))


@numba.njit(**_INLINE)
def _hifloat4_levels_by_multipliers(w0, w1, word):
    """_hifloat4_levels by multiplying with 2^(e2 + e3) (exact)."""
    levels = simd.f32v_load_quarters(_LEVEL_MULTIPLIERS, _level_row(word, 0), _level_row(word, 1),
                                     _level_row(word, 2), _level_row(word, 3))
    return simd.f32v_mul(w0, levels), simd.f32v_mul(w1, levels)


@numba.njit(**_INLINE)
def _hifloat4_levels(w0, w1, word):
    """Both registers of a block times 2^(e2 flag + e3 flag) (doubled under the flags' lane masks: exact)."""
    e2 = _E2_LANES[(word >> 8) & 0xFF]
    e3 = _E3_LANES[(word >> 16) & 0xFF] | (_E3_LANES[(word >> 24) & 0xFF] << 16)
    return (simd.f32v_double_where(simd.f32v_double_where(w0, e2), e3),
            simd.f32v_double_where(simd.f32v_double_where(w1, e2), e3))


_hifloat4_scale_levels = _hifloat4_levels if simd.HAS_AVX512F else _hifloat4_levels_by_multipliers


# ---- HiFloat4 with AVX512-BW: every weight of a block from one 64-word table, no multiplier -----------------
# A block's weight is (-1)^s c/4 times the E6M2 scale times 2^(e2 + e3): at most six significant bits inside
# float32's normal range, so a BF16 value (checked below). Table row b (64 words) holds, at index
# nibble | e2 << 4 | e3 << 5, the BF16 bits of that weight for E6M2 byte b (NaN for the poisoned byte 0xFF).
# The 32 value bytes are zero-extended to words in the order [b0, b16, b1, b17, ..]; one vpermi2w per nibble
# (low, high) looks up 32 weights, whose even words (bytes 0-15) and odd words (bytes 16-31) are the two
# float32 registers of NIBBLE_ORDER. The flag bits of each word come from the scale word in registers (flag
# tables would not fit in the L1 cache beside the weight tables): its low and its high 16 bits are broadcast
# to every word and tested against a constant per word, the bit of that word's flag (_flag_bit).


def _hifloat4_word_tables(codes: int) -> np.ndarray:
    """(256 * 4 * codes,) int16: for every E6M2 byte, flags (e2 | e3 << 1) and nibble below ``codes`` (16: all,
    8: the magnitudes), the BF16 bits of its weight; ValueError if one of them is not a BF16 value (the
    tables would not be exact)."""
    levels = np.array([1.0, 2.0, 2.0, 4.0], dtype=np.float32)  # flags e2 | e3 << 1
    values = (_HIFLOAT4_TABLES.reshape(256, 1, 16)[:, :, :codes] * levels[None, :, None]).reshape(-1)
    bits = values.view(np.uint32)
    exact = np.isnan(values) | (bits & 0xFFFF == 0)
    if not exact.all():
        raise ValueError("a HiFloat4 weight is not a BF16 value")
    return np.where(np.isnan(values), 0x7FC0, bits >> 16).astype(np.uint16).view(np.int16)


def _flag_bit(flag: str, byte: int) -> int:
    """The bit of the little-endian scale word [E6M2, e2, e3, e3] that holds the ``flag`` ("e2" or "e3") of
    value byte ``byte`` of the block (elements 2 byte, 2 byte + 1): e2 of 8-group g is bit 7 - g of byte 1,
    e3 of 4-group g bit 7 - g of byte 2 (g < 8) or 15 - g of byte 3 (docs/weight_only.md, 'Weights')."""
    if flag == "e2":
        return 15 - byte // 4
    group = byte // 2
    return 23 - group if group < 8 else 39 - group


_HIFLOAT4_WORDS = _hifloat4_word_tables(16)
_DECODE_BYTES = [w // 2 + 16 * (w % 2) for w in range(HALF)]  # hifloat4_words_decode's words: [b0, b16, b1, ..]


def _decode_flags(builder, word, byte_of_word=_DECODE_BYTES):
    """<32 x i16>: for each of 32 words (the value byte each holds: ``byte_of_word``; by default
    hifloat4_words_decode's), 16 if its e2 flag is set plus 32 if its e3 flag is, from the integer scale word
    ``word`` (vptestmw on its broadcast halves)."""
    i16, zero = ir.IntType(16), ir.Constant(_V16x32, [0] * HALF)
    flags = zero
    for flag, shift, value in (("e2", 0, 16), ("e3", 16, 32)):
        half = builder.trunc(builder.lshr(word, ir.Constant(word.type, shift)), i16)
        bits = ir.Constant(_V16x32, [1 << (_flag_bit(flag, byte) - shift) for byte in byte_of_word])
        is_set = builder.icmp_unsigned("!=", builder.and_(simd._splat(builder, half, _V16x32), bits), zero)
        flags = builder.select(is_set, builder.or_(flags, ir.Constant(_V16x32, [value] * HALF)), flags)
    return flags


def _hifloat4_word_row(builder, word):
    """The two <32 x i16> halves of the 64-word row of _HIFLOAT4_WORDS (built into the code, 64-byte aligned)
    of the E6M2 byte of the integer scale word ``word``: the table of one vpermi2w, index nibble | e2 << 4 |
    e3 << 5."""
    table = builder.bitcast(simd.aligned_constant(builder, "lowbit.hifloat4.words", _HIFLOAT4_WORDS),
                            ir.IntType(16).as_pointer())
    row = builder.mul(builder.zext(builder.trunc(word, ir.IntType(8)), ir.IntType(64)),
                      ir.Constant(ir.IntType(64), LANES))

    def words_at(index):  # 32 words at an element index that is a multiple of 32: 64-byte aligned
        return builder.load(builder.bitcast(builder.gep(table, [index]), _V16x32.as_pointer()), align=64)

    return words_at(row), words_at(builder.add(row, ir.Constant(row.type, HALF)))


@intrinsic
def hifloat4_words_decode(typingctx, value, start, word):
    """The 64 weights of the HiFloat4 block whose 32 value bytes are at ``value[start]`` (1-D uint8) and whose
    scale word is ``word`` (an int32 / uint32: [E6M2, e2, e3, e3] bytes, little-endian) as two F32V in
    NIBBLE_ORDER, from _HIFLOAT4_WORDS (built into the code, 64-byte aligned). AVX512-BW (vpermi2w)."""
    v16f = ir.VectorType(ir.FloatType(), 16)

    def codegen(context, builder, sig, args):
        vperm = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_V16x32, [_V16x32] * 3), "llvm.x86.avx512.vpermi2var.hi.512")
        v8x32 = ir.VectorType(ir.IntType(8), HALF)
        raw = builder.load(simd._element_ptr(context, builder, sig.args[0], args[0], args[1], v8x32), align=1)
        words = builder.zext(builder.shuffle_vector(raw, raw, _mask(_DECODE_BYTES)), _V16x32)
        flags = _decode_flags(builder, args[2])
        low_table, high_table = _hifloat4_word_row(builder, args[2])
        registers = []
        for nibble in (builder.and_(words, ir.Constant(_V16x32, [15] * HALF)),
                       builder.lshr(words, ir.Constant(_V16x32, [4] * HALF))):
            looked_up = builder.bitcast(builder.call(vperm, [low_table, builder.or_(nibble, flags), high_table]),
                                        _V32x16)
            even = builder.bitcast(builder.shl(looked_up, ir.Constant(_V32x16, [16] * 16)), v16f)
            odd = builder.bitcast(builder.and_(looked_up, ir.Constant(_V32x16, [-65536] * 16)), v16f)
            registers.append(builder.shuffle_vector(even, odd, _mask(range(HALF))))
        return context.make_tuple(builder, sig.return_type, registers)

    return types.UniTuple(simd.F32V, 2)(value, start, word), codegen


_ODD_WORD_SHIFTS = [4 * (w % 2) for w in range(HALF)]


def _logical_nibbles(builder, raw, half):
    """<32 x i16>: the nibbles of bytes 16 half .. 16 half + 15 of ``raw`` (<32 x i8>) in logical order, word 2i
    the low nibble of byte 16 half + i and word 2i + 1 its high one: one vpermb puts the byte in both bytes of
    both words, one vpsrlvw moves the odd words' high nibble down."""
    doubled = [16 * half + w // 2 for w in range(HALF) for _ in (0, 1)]
    words = builder.bitcast(builder.shuffle_vector(raw, raw, _mask(doubled)), _V16x32)
    return builder.and_(builder.lshr(words, ir.Constant(_V16x32, _ODD_WORD_SHIFTS)), ir.Constant(_V16x32, [15] * HALF))


def _store_half(context, builder, array_type, array, at, half, value):
    """Store the <32 x i16> ``value`` at ``array[at + 32 half]`` (a 1-D int16 array)."""
    offset = builder.add(at, ir.Constant(at.type, HALF * half))
    builder.store(value, simd._element_ptr(context, builder, array_type, array, offset, _V16x32), align=1)


@intrinsic
def hifloat4_store_words(typingctx, value, start, word, words, at):
    """Store the 64 weights of the HiFloat4 block whose 32 value bytes are at ``value[start]`` (1-D uint8) and
    whose scale word is ``word`` (an int32 / uint32) as BF16 bits in logical order at ``words[at]`` (1-D
    int16): the GEMM path's BF16 tile, the reference's weights bit for bit (_HIFLOAT4_WORDS). Per 32 words:
    the nibbles in logical order (_logical_nibbles), the flags (_decode_flags) and one vpermi2w.
    AVX512-BW."""
    if not (isinstance(words, types.Array) and words.dtype == types.int16):
        return None

    def codegen(context, builder, sig, args):
        vperm = _vpermi2w(builder)
        v8x32 = ir.VectorType(ir.IntType(8), HALF)
        raw = builder.load(simd._element_ptr(context, builder, sig.args[0], args[0], args[1], v8x32), align=1)
        low_table, high_table = _hifloat4_word_row(builder, args[2])
        for half in (0, 1):  # words 32 half .. 32 half + 31: value bytes 16 half .. 16 half + 15
            flags = _decode_flags(builder, args[2], [16 * half + w // 2 for w in range(HALF)])
            index = builder.or_(_logical_nibbles(builder, raw, half), flags)
            _store_half(context, builder, sig.args[3], args[3], args[4], half,
                        builder.call(vperm, [low_table, index, high_table]))
        return context.get_dummy_value()

    return types.void(value, start, word, words, at), codegen


# ---- BF16 pairs: two steps per vdpbf16ps (AVX512-BF16 CPUs, rows of x that are BF16 values) ---------------
# vdpbf16ps adds to each float32 lane the products of two BF16 pairs, the odd word's first, each rounded once
# (the order Intel documents; AMD Zen 4 gives the same bits on 32 million random lanes), with subnormal inputs
# and results flushed to zero. A lane of the reference adds element e of step t, then element e of step t + 1:
# so a dword lane pairs step t's weight (odd word) with step t + 1's (even word) and x likewise, and one
# instruction does the reference's two additions (docs/weight_only.md, 'Summation order'). Exact where
# nothing is flushed: see _paired_bytes.
#
# The pairs are looked up in place: one vpermb puts byte i of step t's 32 bytes (codes, value bytes) in word
# 2i + 1 and byte i of step t + 1's in word 2i (bytes i + 16 in a second register), each byte in both halves
# of its word; one vpermi2w per nibble then looks up the 32 weights of a register in a 64-word table whose
# first 32 words belong to step t and the last 32 to step t + 1 (index bit 5 set in the even words). So the
# low nibbles' two registers hold elements 0, 2, .., 62 in lane order and the high nibbles' 1, 3, .., 63:
# lane L of a pair step's first I32V is element 2L, of its second 2L + 1.
PAIR_ORDER = NIBBLE_ORDER  # so the lanes fold as _row_sum_nibbles folds them
_SECOND_STEP = [0 if w % 2 else HALF for w in range(HALF)]  # index bit 5 of each word: the second step's table


def _pair_words(builder, raw, byte_half):
    """<32 x i16>: word 2i + 1 byte 16 byte_half + i of the first 32 bytes of ``raw`` (<64 x i8>), word 2i that
    of the last 32, each in both halves of its word (one vpermb)."""
    source = [w // 2 + 16 * byte_half + (HALF if w % 2 == 0 else 0) for w in range(HALF)]
    return builder.bitcast(builder.shuffle_vector(raw, raw, _mask([i for b in source for i in (b, b)])), _V16x32)


def _pair_registers(builder, registers):
    """The two I32V of a pair step from its four look-ups (registers[nibble][byte_half], <32 x i16> each)."""
    return [builder.bitcast(builder.shuffle_vector(a, b, _mask(range(LANES))), simd._VI32) for a, b in registers]


def _vpermi2w(builder):
    return cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_V16x32, [_V16x32] * 3), "llvm.x86.avx512.vpermi2var.hi.512")


# The BF16 bits of _MXFP4_TABLES, (256 * 16,) int16 (NaN for byte 0xFF): exact for every scale byte (see
# _bf16_byte_table); the pairs use the bytes whose weights are normal, the only ones _paired_bytes lets through.
_MXFP4_WORDS = (_MXFP4_TABLES.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)


def _bf16_byte_table(tables: np.ndarray) -> np.ndarray:
    """(256, 32) uint8 of 16-entry float32 tables (flat, 256 of them): per table, the low bytes of its
    entries' BF16 bits, then their high bytes (the two vpshufb tables of _bf16_byte_lookups). ValueError if a
    non-NaN entry is not a BF16 value. MXFP4's are all BF16 values: at most two significant bits, normal or
    subnormal (scale bytes 0 and 1: down to 2^-128; BF16's smallest subnormal is 2^-133); HiFloat4's at most
    six (_hifloat4_word_tables)."""
    bits = tables.view(np.uint32).reshape(256, 16)
    if not (np.isnan(tables.reshape(256, 16)) | (bits & 0xFFFF == 0)).all():
        raise ValueError("a weight is not a BF16 value")
    words = bits >> 16
    return np.concatenate([words & 0xFF, words >> 8], axis=1).astype(np.uint8)


_MXFP4_BF16_BYTES = _bf16_byte_table(_MXFP4_TABLES)
_UNPACK_LOW_BYTES = [i for lane in (0, 16) for j in range(lane, lane + 8) for i in (j, 32 + j)]  # vpunpcklbw
_UNPACK_HIGH_BYTES = [i + 8 for i in _UNPACK_LOW_BYTES]  # vpunpckhbw
_V32x8, _V16x8, _V8x32 = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(8), 16), ir.VectorType(_I32, 8)
_V16x16 = ir.VectorType(ir.IntType(16), 16)


def _float32_lanes(builder, words):
    """The float32 bits (two <8 x i32>: the even words, then the odd ones) of the BF16 bits ``words``
    (<16 x i16>). The even words move up by a multiply by 2^16 on AMD Zen CPUs (simd.HOST_IS_AMD_ZEN: off
    the pipes that the byte shuffles and shifts of the 4-bit decodes crowd; written as an instruction, as
    LLVM would make any multiply by a power of two a shift), else by a shift."""
    pairs = builder.bitcast(words, _V8x32)
    if simd.HOST_IS_AMD_ZEN:
        even = builder.asm(ir.FunctionType(_V8x32, [_V8x32] * 2), "vpmulld $2, $1, $0", "=x,x,x",
                           [pairs, ir.Constant(_V8x32, [1 << 16] * 8)], False)
    else:
        even = builder.shl(pairs, ir.Constant(_V8x32, [16] * 8))
    return [even, builder.and_(pairs, ir.Constant(_V8x32, [-65536] * 8))]


def _bf16_byte_lookups(builder, raw, low_bytes, high_bytes):
    """The 8 registers (<8 x i32>, BYTE_SHUFFLE_SPLIT's order) of the float32 weights of the 64 nibbles of
    ``raw`` (<32 x i8>), whose BF16 bits' low and high bytes ``low_bytes`` and ``high_bytes`` (<32 x i8>:
    16-entry tables for the low 128-bit lane's bytes, then the high lane's) look up (AVX2 vpshufb)."""
    fifteen = ir.Constant(_V32x8, [15] * 32)
    registers = []
    for nibble in (builder.and_(raw, fifteen), builder.and_(builder.lshr(raw, ir.Constant(_V32x8, [4] * 32)), fifteen)):
        low, high = simd.vpshufb(builder, low_bytes, nibble), simd.vpshufb(builder, high_bytes, nibble)
        for unpack in (_UNPACK_LOW_BYTES, _UNPACK_HIGH_BYTES):
            words = builder.bitcast(builder.shuffle_vector(low, high, _mask(unpack)), _V16x16)
            registers.extend(_float32_lanes(builder, words))
    return registers


def _f32v_pair(builder, registers):
    """Two F32V of 8 registers (<8 x i32> float32 bits), in order."""
    return [builder.bitcast(simd._concatenated(builder, registers[i : i + 4]), simd._VF32) for i in (0, 4)]


def _table_half(context, builder, table, row, high):
    """A pointer (<16 x i8>*) to 16 bytes of a (256, 32) byte table (``table``: an i8 pointer) at ``row`` (an i8
    byte value): its entries' low (``high`` = 0) or high bytes."""
    i64 = ir.IntType(64)
    at = builder.add(builder.mul(builder.zext(row, i64), ir.Constant(i64, 32)), ir.Constant(i64, 16 * high))
    return builder.bitcast(builder.gep(table, [at]), _V16x8.as_pointer())


@intrinsic
def mxfp4_bf16_step(typingctx, codes, start, scales, block):
    """MXFP4 blocks ``block`` and ``block + 1`` (flat; E8M0 bytes at ``scales[block]``, 1-D uint8; their 32
    code bytes at ``codes[start]``, 1-D uint8) as two F32V in BYTE_SHUFFLE_SPLIT's order, from
    _MXFP4_BF16_BYTES (the reference's weights, bit for bit): block a's table in the low 128-bit lane, block
    b's in the high one (_bf16_byte_lookups). AVX2."""

    def codegen(context, builder, sig, args):
        raw = builder.load(simd._element_ptr(context, builder, sig.args[0], args[0], args[1], _V32x8), align=1)
        table = simd.aligned_constant(builder, "lowbit.mxfp4.bf16_bytes", _MXFP4_BF16_BYTES)

        def scale(i):
            at = builder.add(args[3], ir.Constant(args[3].type, i))
            return builder.load(simd._element_ptr(context, builder, sig.args[2], args[2], at, ir.IntType(8)))

        bytes_a, bytes_b = scale(0), scale(1)
        low_bytes, high_bytes = (simd.blend_lanes(builder, _table_half(context, builder, table, bytes_a, h),
                                                  _table_half(context, builder, table, bytes_b, h)) for h in (0, 1))
        registers = _bf16_byte_lookups(builder, raw, low_bytes, high_bytes)
        return context.make_tuple(builder, sig.return_type, _f32v_pair(builder, registers))

    return types.UniTuple(simd.F32V, 2)(codes, start, scales, block), codegen


# HiFloat4 (hifloat4_bf16_step): per E6M2 byte, the low and high bytes of the BF16 bits of four times its 16
# weights, (-1)^s c times the scale (exact and normal: at least 2^-48; -0 as +0, which changes no sum, as a lane
# sum is never -0: docs/weight_only.md, 'CPUs without AVX-512'), in both 128-bit lanes. A block's 32 value
# bytes are two registers, bytes 0-15 and 16-31 each in both lanes, whose low 128-bit lane looks up the low
# nibbles and the high lane the high ones (HIFLOAT4_SHUFFLE_SPLIT): so both lanes of a register of words hold
# the same 4-groups and 8-groups. Each BF16 word then loses 2 - e2 - e3 from its exponent by one unsigned
# saturating subtraction of (2 - e2 - e3) << 7 (vpsubusw; +0 stays +0 and no weight leaves the normal range):
# the weight times 2^(e2 + e3), exact. The 16 words of a register need the e3 flags of four consecutive
# 4-groups and the e2 flags of two 8-groups: four and two adjacent bits of the scale word, shifted out by
# scalar instructions into the row of a 64 x 16 table of subtrahends (2 KiB) that the subtraction reads from
# memory. A poisoned block (E6M2 byte 0xFF: NaN weights) subtracts nothing: its rows come from a second, zero
# table. Multiplying the float32 lanes by 2^(e2 + e3) instead took eight vmulps per block on the two pipes the
# fused multiply-adds run on. A weight prepared once has its scale words and value bytes rearranged so that
# the step does less (_hifloat4_prepared_words, _hifloat4_prepare_values; docs/weight_only.md, 'Prepared
# HiFloat4 weights').
_HIFLOAT4_QUADRUPLED = np.where(_HIFLOAT4_TABLES == 0, np.float32(0), _HIFLOAT4_TABLES * np.float32(4))
_HIFLOAT4_BF16_BYTES = _bf16_byte_table(_HIFLOAT4_QUADRUPLED)


def _level_subtrahends() -> tuple[dict, np.ndarray]:
    """(shifts, table): the row of word register (half, h) (value bytes 16 half + 8 h .. + 7) is ``(word >> a)
    & 15 | ((word >> b) & 3) << 4`` for (a, b) = shifts[h, half], the lowest bits of its e3 and e2 flags in the
    scale word, and row i of ``table[0]`` ((2, 64, 16) int16) holds, in word w and w + 8 (both 128-bit lanes),
    (2 - e2 - e3) << 7 of value byte 16 half + 8 h + w; ``table[1]`` is zeros (poisoned blocks). ValueError
    unless each register's flags are adjacent bits, the rows are the same for all four registers and the
    subtraction keeps every nonzero finite entry of _HIFLOAT4_QUADRUPLED normal."""
    shifts, tables = {}, []
    for h in (0, 1):
        for half in (0, 1):
            bytes_ = [16 * half + 8 * h + w for w in range(8)]
            e3, e2 = ({_flag_bit(flag, b) for b in bytes_} for flag in ("e3", "e2"))
            if e3 != set(range(min(e3), min(e3) + 4)) or e2 != set(range(min(e2), min(e2) + 2)):
                raise ValueError("a register's flags are not adjacent bits")
            index_bit = {**{bit: bit - min(e3) for bit in e3}, **{bit: 4 + bit - min(e2) for bit in e2}}
            table = np.array([[(2 - sum((i >> index_bit[_flag_bit(flag, b)]) & 1 for flag in ("e2", "e3"))) << 7
                               for b in bytes_] * 2 for i in range(64)], dtype=np.int16)
            shifts[h, half] = min(e3), min(e2)
            tables.append(table)
    if not all(np.array_equal(t, tables[0]) for t in tables):
        raise ValueError("the registers' level tables differ")
    bits = (_HIFLOAT4_QUADRUPLED.view(np.uint32) >> 16).reshape(256, 16)[:255]  # the NaN byte subtracts nothing
    if (((bits >> 7) & 0xFF)[(bits & 0x7FFF) != 0] <= 2).any():
        raise ValueError("a weight would leave the normal range")
    return shifts, np.stack([tables[0], np.zeros_like(tables[0])])


_LEVEL_SHIFTS, _LEVEL_SUBTRAHENDS = _level_subtrahends()
_POISONED_ROWS = _LEVEL_SUBTRAHENDS[1].nbytes  # byte offset of the zero table
_ALL_FLAGS_ROW = 63  # e2 and e3 set in every word: subtracts nothing
assert not _LEVEL_SUBTRAHENDS[0][_ALL_FLAGS_ROW].any()


# The word registers (unpack half h, value bytes half) in the order of their rows' offsets (_hifloat4_shuffled_weights).
_WORD_REGISTERS = ((0, 0), (1, 0), (0, 1), (1, 1))
# A prepared weight's scale words (_hifloat4_prepared_words) hold each register's row index (six bits) at
# 8 + 6 i for register _WORD_REGISTERS[i]: two scalar instructions per row instead of about eight.
_ROW_INDEX_BITS = 6


def _hifloat4_prepare_values(value: np.ndarray, out: np.ndarray) -> None:
    """out <- HiFloat4 value bytes ``value`` (uint8, 32 per block, any shape) rearranged for
    hifloat4_bf16_step (``out``: C-contiguous, value's shape): byte j < 16 of a block holds the low nibbles
    of bytes j and 16 + j, byte 16 + j their high nibbles, so that the block's 32 bytes as one register give
    both registers of nibbles (its low nibbles: bytes 0-15's low then high nibbles; its high nibbles: bytes
    16-31's). ValueError if ``out`` is not C-contiguous (its reshape would be a copy)."""
    if not out.flags.c_contiguous:
        raise ValueError("_hifloat4_prepare_values: out must be C-contiguous")
    blocks, prepared = value.reshape(-1, 2, 16), out.reshape(-1, 2, 16)
    first, second = blocks[:, 0], blocks[:, 1]
    prepared[:, 0] = first & 15 | second << 4
    prepared[:, 1] = first >> 4 | second & 0xF0


def _hifloat4_prepared_words(words: np.ndarray) -> np.ndarray:
    """HiFloat4 scale words (int32, any shape) rearranged for hifloat4_bf16_step, as uint32 of the same shape:
    the E6M2 byte stays the low byte; above it, the row index in _LEVEL_SUBTRAHENDS[0] of each word register
    (_WORD_REGISTERS' order, _ROW_INDEX_BITS each). A poisoned block (E6M2 byte 0xFF) gets _ALL_FLAGS_ROW,
    whose subtrahends are zero: its NaN weights stay NaN without the kernel testing its byte."""
    bits = words.view(np.uint32)
    prepared = bits & np.uint32(0xFF)
    poisoned = prepared == 0xFF
    for i, register in enumerate(_WORD_REGISTERS):
        e3_at, e2_at = _LEVEL_SHIFTS[register]
        e3, e2 = (bits >> np.uint32(e3_at)) & np.uint32(15), (bits >> np.uint32(e2_at)) & np.uint32(3)
        index = e3 | e2 << np.uint32(4)
        index[poisoned] = _ALL_FLAGS_ROW
        prepared |= index << np.uint32(8 + _ROW_INDEX_BITS * i)
    return prepared


def _hifloat4_nibbles(context, builder, value_type, value, start, prepared):
    """The two <32 x i8> of nibbles of hifloat4_bf16_step, value bytes 0-15 then 16-31, each with the bytes'
    low nibbles in its low 128-bit lane and their high nibbles in the high lane: from 32 value bytes at
    ``start`` (``value``: a 1-D uint8 array of ``value_type``), in _hifloat4_prepare_values' order where
    ``prepared`` (one load, a mask and a shift), else as packed (each half loaded into both lanes)."""
    mask = ir.Constant(_V32x8, [15] * 32)
    if prepared:
        raw = builder.load(simd._element_ptr(context, builder, value_type, value, start, _V32x8), align=1)
        shifted = builder.bitcast(builder.lshr(builder.bitcast(raw, _V16x16), ir.Constant(_V16x16, [4] * 16)), _V32x8)
        return builder.and_(raw, mask), builder.and_(shifted, mask)
    nibble_shift = ir.Constant(_V8x32, [0] * 4 + [4] * 4)  # the high lane's bytes give their high nibbles
    registers = []
    for half in (0, 1):
        at = builder.add(start, ir.Constant(start.type, 16 * half))
        raw = simd.broadcast_lanes(builder, builder.bitcast(
            simd._element_ptr(context, builder, value_type, value, at, ir.IntType(8)), _V16x8.as_pointer()), 1)
        registers.append(builder.and_(builder.bitcast(builder.lshr(builder.bitcast(raw, _V8x32), nibble_shift),
                                                      _V32x8), mask))
    return registers


def _hifloat4_shuffled_weights(context, builder, nibble_registers, table_offset, row_offsets):
    """The two F32V of hifloat4_bf16_step from its two registers of nibbles (_hifloat4_nibbles), the byte
    offset of its E6M2 byte's row in _HIFLOAT4_BF16_BYTES (i64) and those of its four word registers' rows
    of subtrahends in _LEVEL_SUBTRAHENDS (i64, _WORD_REGISTERS' order)."""
    table = simd.aligned_constant(builder, "lowbit.hifloat4.bf16_bytes4", _HIFLOAT4_BF16_BYTES)
    low_bytes, high_bytes = (simd.broadcast_lanes(builder, builder.bitcast(builder.gep(table, [
        builder.add(table_offset, ir.Constant(table_offset.type, 16 * h))]), _V16x8.as_pointer())) for h in (0, 1))
    levels = simd.aligned_constant(builder, "lowbit.hifloat4.level_subtrahends", _LEVEL_SUBTRAHENDS)
    subtract = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16x16, [_V16x16] * 2),
                                              "llvm.usub.sat.v16i16")
    registers = []
    for half, nibbles in enumerate(nibble_registers):
        low, high = simd.vpshufb(builder, low_bytes, nibbles), simd.vpshufb(builder, high_bytes, nibbles)
        for h, unpack in enumerate((_UNPACK_LOW_BYTES, _UNPACK_HIGH_BYTES)):
            words = builder.bitcast(builder.shuffle_vector(low, high, _mask(unpack)), _V16x16)
            row = builder.gep(levels, [row_offsets[_WORD_REGISTERS.index((h, half))]])
            subtrahends = builder.load(builder.bitcast(row, _V16x16.as_pointer()), align=32)
            registers.extend(_float32_lanes(builder, builder.call(subtract, [words, subtrahends])))
    return _f32v_pair(builder, registers)


@intrinsic
def hifloat4_bf16_step(typingctx, value, start, words, block):
    """HiFloat4 block ``block`` (flat): scale word at ``words[block]`` (1-D: int32 as packed, or uint32 from
    _hifloat4_prepared_words), 32 value bytes at ``value[start]`` (1-D uint8), as two F32V in
    HIFLOAT4_SHUFFLE_SPLIT's order: four times the weights from _HIFLOAT4_BF16_BYTES by byte shuffles, each
    BF16 word's exponent less 2 - e2 - e3 (_LEVEL_SUBTRAHENDS; exact: _hifloat4_shuffled_weights). The NaN
    E6M2 byte gives NaN weights; -0 weights come out as +0. AVX2."""
    prepared = words.dtype == types.uint32

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        word = builder.zext(builder.load(simd._element_ptr(context, builder, sig.args[2], args[2], args[3], _I32)),
                            i64)
        scale_byte = builder.and_(word, ir.Constant(i64, 0xFF))
        table_offset = builder.mul(scale_byte, ir.Constant(i64, 32))
        nibbles = _hifloat4_nibbles(context, builder, sig.args[0], args[0], args[1], prepared)
        if prepared:  # row i's byte offset: its index times 32 (a row of 16 words)
            field = ir.Constant(i64, ((1 << _ROW_INDEX_BITS) - 1) << 5)
            rows = [builder.and_(builder.lshr(word, ir.Constant(i64, 8 + _ROW_INDEX_BITS * i - 5)), field)
                    for i in range(len(_WORD_REGISTERS))]
            weights = _hifloat4_shuffled_weights(context, builder, nibbles, table_offset, rows)
            return context.make_tuple(builder, sig.return_type, weights)
        poisoned = builder.icmp_unsigned("==", scale_byte, ir.Constant(i64, 0xFF))
        zero_rows = builder.select(poisoned, ir.Constant(i64, _POISONED_ROWS), ir.Constant(i64, 0))

        def flags(at, count):
            return builder.and_(builder.lshr(word, ir.Constant(i64, at)), ir.Constant(i64, (1 << count) - 1))

        def row(register):  # the byte offset of the word register's row of subtrahends
            e3_at, e2_at = _LEVEL_SHIFTS[register]
            index = builder.or_(flags(e3_at, 4), builder.shl(flags(e2_at, 2), ir.Constant(i64, 4)))
            return builder.add(builder.mul(index, ir.Constant(i64, 32)), zero_rows)

        weights = _hifloat4_shuffled_weights(context, builder, nibbles, table_offset,
                                             [row(register) for register in _WORD_REGISTERS])
        return context.make_tuple(builder, sig.return_type, weights)

    return types.UniTuple(simd.F32V, 2)(value, start, words, block), codegen


def _mxfp4_block_table(context, builder, sig, args, block_arg, first, second=None):
    """<32 x i16>: the 16 BF16 words (_MXFP4_WORDS) of blocks ``first`` and ``second`` (by default
    ``first + 1``) after the flat block index ``args[block_arg]``, whose E8M0 bytes the 1-D uint8 array
    ``args[block_arg - 1]`` holds."""
    v16x16, i64 = ir.VectorType(ir.IntType(16), 16), ir.IntType(64)
    table = builder.bitcast(simd.aligned_constant(builder, "lowbit.mxfp4.words", _MXFP4_WORDS),
                            ir.IntType(16).as_pointer())
    scales, block = args[block_arg - 1], args[block_arg]

    def block_row(i):  # block + i's 16 words: 32 bytes at a multiple of 32
        at = builder.add(block, ir.Constant(block.type, i))
        byte = builder.load(simd._element_ptr(context, builder, sig.args[block_arg - 1], scales, at, ir.IntType(8)))
        at = builder.mul(builder.zext(byte, i64), ir.Constant(i64, 16))
        return builder.load(builder.bitcast(builder.gep(table, [at]), v16x16.as_pointer()), align=32)

    return builder.shuffle_vector(block_row(first), block_row(first + 1 if second is None else second),
                                  _mask(range(HALF)))


@intrinsic
def mxfp4_pairs(typingctx, codes, start, scales, block):
    """The BF16 pairs of the MXFP4 pair step of blocks ``block`` .. ``block + 3`` (flat; E8M0 bytes at
    ``scales[block]``, 1-D uint8): 64 code bytes at ``codes[start]`` (1-D uint8), the first step's two
    blocks, then the second's. Two I32V (low nibbles, high nibbles; PAIR_ORDER); the look-ups: code bytes
    16 h .. 16 h + 15 belong to block h of each step, so one vpermw per register in the 16 weights (from
    _MXFP4_WORDS, built into the code, 64-byte aligned) of blocks h and 2 + h. AVX512-BW (VBMI: one vpermb)."""

    def codegen(context, builder, sig, args):
        vperm = simd.vpermw(builder)
        v8x64 = ir.VectorType(ir.IntType(8), LANES)
        raw = builder.load(simd._element_ptr(context, builder, sig.args[0], args[0], args[1], v8x64), align=1)
        block_bits = ir.Constant(_V16x32, [b // 2 for b in _SECOND_STEP])  # bit 4: the second step's block
        registers = [[], []]
        for byte_half in (0, 1):
            table = _mxfp4_block_table(context, builder, sig, args, 3, byte_half, 2 + byte_half)
            words = _pair_words(builder, raw, byte_half)
            high = builder.lshr(words, ir.Constant(_V16x32, [4] * HALF))
            for register, nibble in zip(registers, (words, high)):
                index = builder.or_(builder.and_(nibble, ir.Constant(_V16x32, [15] * HALF)), block_bits)
                register.append(builder.call(vperm, [table, index]))
        return context.make_tuple(builder, sig.return_type, _pair_registers(builder, registers))

    return types.UniTuple(simd.I32V, 2)(codes, start, scales, block), codegen


@intrinsic
def mxfp4_store_words(typingctx, codes, start, scales, block, words, at):
    """Store the 64 weights of MXFP4 blocks ``block`` and ``block + 1`` (flat; E8M0 bytes at ``scales[block]``,
    1-D uint8; their 32 code bytes at ``codes[start]``, 1-D uint8) as BF16 bits in logical order at
    ``words[at]`` (1-D int16): the GEMM path's BF16 tile, the reference's weights bit for bit (_MXFP4_WORDS).
    Per 32 words the nibbles in logical order (_logical_nibbles) and one vpermw that looks each up (bit 4:
    the second block) in the two blocks' 32 words. AVX512-VBMI."""
    if not (isinstance(words, types.Array) and words.dtype == types.int16):
        return None

    def codegen(context, builder, sig, args):
        vperm = simd.vpermw(builder)
        raw = builder.load(simd._element_ptr(context, builder, sig.args[0], args[0], args[1], _V32x8), align=1)
        table = _mxfp4_block_table(context, builder, sig, args, 3, 0)
        for half in (0, 1):  # words 32 half .. 32 half + 31: code bytes 16 half .. 16 half + 15, block ``half``
            index = builder.or_(_logical_nibbles(builder, raw, half), ir.Constant(_V16x32, [16 * half] * HALF))
            looked_up = builder.call(vperm, [table, index])
            _store_half(context, builder, sig.args[4], args[4], args[5], half, looked_up)
        return context.get_dummy_value()

    return types.void(codes, start, scales, block, words, at), codegen


# HiFloat4 (hifloat4_pairs): row b of _HIFLOAT4_MAGNITUDES holds 32 words, at index magnitude | e2 << 3 |
# e3 << 4 the BF16 bits of the weight of that magnitude (nibble & 7) and flags for E6M2 byte b, without its
# sign, so the rows of the pair's two blocks fill the 64 words of one vpermi2w; the nibble's sign (bit 3) is
# put into bit 15 of the word looked up.
_HIFLOAT4_MAGNITUDES = _hifloat4_word_tables(8)


def _pair_flag_bits(byte_half: int) -> list[int]:
    """vpshufbitqmb's 64 bit indices into the 64-bit word [first block's scale word, second's] for the words
    of byte half ``byte_half`` (value bytes 16 * byte_half + i): index w (< 32) the bit of word w's e2 flag,
    index 32 + w the bit of its e3 flag."""
    def bits(flag):  # even words: the second block's byte
        return [_flag_bit(flag, w // 2 + 16 * byte_half) + (32 if w % 2 == 0 else 0) for w in range(HALF)]

    return bits("e2") + bits("e3")


@intrinsic
def hifloat4_pairs(typingctx, value, start, words, block):
    """The BF16 pairs of the HiFloat4 blocks ``block`` and ``block + 1`` (flat): scale words at ``words[block]``
    (1-D int32), 64 value bytes at ``value[start]`` (1-D uint8). Two I32V (low nibbles, high nibbles;
    PAIR_ORDER), each dword the first block's weight (high word) and the second's (low word) of
    one element. AVX512-BITALG (vpshufbitqmb; with VBMI and VBMI2 one vpermb and one vpshldw per 32 words).
    The NaN E6M2 byte gives NaN weights (with the sign bit of their nibble)."""

    def codegen(context, builder, sig, args):
        vperm = _vpermi2w(builder)
        rotate = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16x32, [_V16x32] * 3),
                                                "llvm.fshl.v32i16")
        v1x64, v8x64 = ir.VectorType(ir.IntType(1), LANES), ir.VectorType(ir.IntType(8), LANES)
        bit_shuffle = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v1x64, [v8x64, v8x64]),
                                                     "llvm.x86.avx512.vpshufbitqmb.512")
        i16, i64 = ir.IntType(16), ir.IntType(64)
        raw = builder.load(simd._element_ptr(context, builder, sig.args[0], args[0], args[1], v8x64), align=1)
        both = builder.load(simd._element_ptr(context, builder, sig.args[2], args[2], args[3], i64), align=4)
        scale_words = builder.bitcast(simd._splat(builder, both, ir.VectorType(i64, 8)), v8x64)
        table = builder.bitcast(simd.aligned_constant(builder, "lowbit.hifloat4.magnitudes", _HIFLOAT4_MAGNITUDES),
                                i16.as_pointer())

        def row(shift):  # the 32 words of the E6M2 byte at bit ``shift``: 64 bytes at a multiple of 64
            byte = builder.and_(builder.lshr(both, ir.Constant(i64, shift)), ir.Constant(i64, 0xFF))
            at = builder.mul(byte, ir.Constant(i64, HALF))
            return builder.load(builder.bitcast(builder.gep(table, [at]), _V16x32.as_pointer()), align=64)

        tables = row(0), row(32)
        registers = [[], []]
        for byte_half in (0, 1):
            words = _pair_words(builder, raw, byte_half)
            flags = builder.call(bit_shuffle, [scale_words, ir.Constant(v8x64, _pair_flag_bits(byte_half))])
            e2, e3 = (builder.shuffle_vector(flags, flags, _mask(range(at, at + HALF))) for at in (0, HALF))
            index_bits = builder.select(e2, ir.Constant(_V16x32, [b + 8 for b in _SECOND_STEP]),
                                        ir.Constant(_V16x32, _SECOND_STEP))
            index_bits = builder.select(e3, builder.add(index_bits, ir.Constant(_V16x32, [16] * HALF)), index_bits)
            # rotated by 4: bits 0-2 the high nibble's magnitude, bit 15 the low nibble's sign (one vpshldw)
            rotated = builder.call(rotate, [words, words, ir.Constant(_V16x32, [4] * HALF)])
            for register, (magnitude_bits, sign_bit) in zip(registers, ((words, rotated), (rotated, words))):
                index = builder.or_(builder.and_(magnitude_bits, ir.Constant(_V16x32, [7] * HALF)), index_bits)
                magnitude = builder.call(vperm, [tables[0], index, tables[1]])
                register.append(builder.or_(magnitude, builder.and_(sign_bit, ir.Constant(_V16x32, [-32768] * HALF))))
        return context.make_tuple(builder, sig.return_type, _pair_registers(builder, registers))

    return types.UniTuple(simd.I32V, 2)(value, start, words, block), codegen


# ---- one step: the 64 weights k0 .. k0 + 63 of a row, as two F32V in the format's register order ----------


@numba.njit(**_INLINE)
def _nibble_step(tables, packed, start):
    """MXFP4 / HiFloat4: 32 bytes at ``packed[start]`` (flat) through ``tables`` (in simd.signed_tables' form;
    piece p of the F32V serves bytes 16p .. 16p + 15)."""
    pairs = simd.bytes_load(packed, start)
    return simd.lookup16_signed(tables, pairs), simd.lookup16_signed(tables, simd.i32v_shift_right(pairs, 4))


@numba.njit(**_INLINE)
def _mxfp4_step(codes, start, scale_a, scale_b):
    """MXFP4: two blocks (their 32 code bytes at ``codes[start]``) with E8M0 bytes ``scale_a``, ``scale_b``."""
    tables = simd.f32v_load_halves(_MXFP4_LOOKUP, 16 * np.int64(scale_a), 16 * np.int64(scale_b))
    return _nibble_step(tables, codes, start)


@numba.njit(**_INLINE)
def _hifloat4_step_flags(words, value, block):
    """HiFloat4: block ``block`` (flat index): scale word ``words[block]``, 32 value bytes at 32 * block;
    16-entry float32 tables, then the flags' doublings (any CPU)."""
    word = np.uint32(words[np.uint64(block)])
    table = 16 * np.int64(word & 0xFF)
    w0, w1 = _nibble_step(simd.f32v_load_halves(_HIFLOAT4_LOOKUP, table, table), value, 32 * block)
    return _hifloat4_scale_levels(w0, w1, word)


@numba.njit(**_INLINE)
def _hifloat4_step_words(words, value, block):
    """The same from the 64-word tables (AVX512-BW): no float work besides the look-up."""
    return hifloat4_words_decode(value, 32 * block, np.uint32(words[np.uint64(block)]))


@numba.njit(**_INLINE)
def _hifloat4_step_shuffled(words, value, block):
    """The same by byte shuffles (hifloat4_bf16_step; AVX2 without AVX-512), in HIFLOAT4_ORDER."""
    return hifloat4_bf16_step(value, 32 * block, words, np.uint64(block))


# A HiFloat4 block as this CPU decodes it fastest, in HIFLOAT4_ORDER.
_hifloat4_step = (_hifloat4_step_words if simd.HAS_AVX512BW else
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


# ---- GEMV kernels: y32 (M, N) <- x (M, Kp, register order) @ W.T in the lane order -------------------------
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
        at = np.uint64(first + PAIR_LANES * t)  # unsigned: no negative-index wraparound code
        _prefetch_ahead(codes_flat, at, ahead)
        _prefetch_ahead(codes_flat, at + np.uint64(LANES), ahead)
        w0, w1, low_a = code8_pairs(codes_flat, at, table_a, low_a)
        a0, a1 = _dot_pairs(a0, a1, x_low, x_high, w0, w1)
        at = np.uint64(second + PAIR_LANES * t)
        _prefetch_ahead(codes_flat, at, ahead)
        _prefetch_ahead(codes_flat, at + np.uint64(LANES), ahead)
        w0, w1, low_b = code8_pairs(codes_flat, at, table_b, low_b)
        b0, b1 = _dot_pairs(b0, b1, x_low, x_high, w0, w1)
    sum_a, sum_b = _row_sum_code8_pairs(a0, a1), _row_sum_code8_pairs(b0, b1)
    if nan_by_minimum and u8p_holds_minimum(low_a):
        sum_a = np.float32(np.nan)
    if nan_by_minimum and u8p_holds_minimum(low_b):
        sum_b = np.float32(np.nan)
    return sum_a, sum_b


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
    """_code8_rows (``x_pairs`` None: numba prunes the pair code) and _code8_rows_paired (x's pairs: a lone row
    of x may take BF16 pairs, _code8_block_rows)."""
    k = codes.shape[1]
    kp = x_reg.shape[1]
    codes_flat, x_flat = simd.borrowed_flat(codes), simd.borrowed_flat(x_reg)
    tables = (_row_table(table_like), _row_table(table_like), _row_table(table_like), _row_table(table_like))
    if BLOCK_ROWS and k % LANES == 0:  # blocks of rows (no short last step)
        m_rows = y32.shape[0]
        if x_pairs is not None:  # views made once, not per block (a view cost about 200 cycles)
            pairs = (x_bounds, simd.borrowed_flat(x_pairs), x_pairs.shape[1], simd.borrowed_flat(scale).view(np.int32),
                     nan_code == _CODE8_NAN_BY_MINIMUM)
        while row + ROW_BLOCK <= end:
            for r in range(ROW_BLOCK):
                _fill_row_table(magnitudes, scale[row + r], bf16, nan_code, tables[r])
            starts = (row * k, (row + 1) * k, (row + 2) * k, (row + 3) * k)
            operands = (codes_flat, tables, nan_code, np.uint64(ROW_BLOCK * k))
            if x_pairs is not None and m_rows % 2 and _code8_pair_block(pairs, m_rows - 1, operands, k // LANES,
                                                                        starts, row, y32):
                # the last row of x (a lone one) in BF16 pairs; the others in pairs of rows of x
                _code8_x_row_pairs(_code8_block_step, x_flat, kp, k // LANES, operands, starts, row, y32, m_rows - 1)
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
    """_code8_rows with a lone row of x in BF16 pairs where _code8_pairable: the rows of the one-call GEMV of a
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
        x_pairs = np.empty((m_rows, kp), dtype=np.int16)  # Kp = K: a multiple of PAIR_LANES
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
    x_pairs = np.empty((m, -(-kp // PAIR_LANES) * PAIR_LANES if pairs else 0), dtype=np.int16)
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
    if t % 2 == 0:  # a step reads half a cache line of codes
        _prefetch_ahead(codes_flat, np.uint64(16) * b, ahead)
    return _mxfp4_step(codes_flat, 16 * b, scales_flat[b], scales_flat[b + np.uint64(1)])


@numba.njit(**_INLINE)
def _hifloat4_block_step(operands, start, r, t):
    """HiFloat4 step t (= block t) of the row whose blocks start at ``start``: operands (words, value, ahead:
    the prefetch distance of the value bytes, see _prefetch_ahead), flat."""
    words_flat, value_flat, ahead = operands
    if t % 2 == 0:  # a step reads half a cache line of value bytes
        _prefetch_ahead(value_flat, np.uint64(32 * (start + t)), ahead)
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
def _mxfp4_pair_step(operands, start, r, t):
    """MXFP4 pair step t (blocks start + 4t .. start + 4t + 3) of a row as two I32V of BF16 pairs (PAIR_ORDER):
    operands as _mxfp4_block_step's."""
    scales_flat, codes_flat, ahead = operands
    b = np.uint64(start + 4 * t)  # unsigned: no negative-index wraparound code
    _prefetch_ahead(codes_flat, np.uint64(16) * b, ahead)  # a pair step reads one cache line of codes
    return mxfp4_pairs(codes_flat, np.uint64(16) * b, scales_flat, b)


@numba.njit(**_INLINE)
def _x_pair_step(x_flat, x0, t):
    """Pair step t of a row of x (_paired_bytes's x_pairs: BF16 bits at x_flat[x0:]): its two I32V."""
    return simd.i32v_load(x_flat, x0 + 2 * LANES * t), simd.i32v_load(x_flat, x0 + 2 * LANES * t + LANES)


@numba.njit(**_INLINE)
def _dot_pairs(acc0, acc1, x_low, x_high, w0, w1):
    """Lanes += the two products of each BF16 pair (vdpbf16ps), x's pairs times W's."""
    return simd.f32v_dot_bf16(acc0, x_low, w0), simd.f32v_dot_bf16(acc1, x_high, w1)


@numba.njit(**_INLINE)
def _all_fused(fused, m, lows, highs, count):
    """Whether row m of x may use fused multiply-adds with each of the ``count`` rows of W whose scale-byte
    ranges are lows[r] .. highs[r] (see _fused_bytes)."""
    result = True
    for r in range(count):
        result = result and fused[m, lows[r]] and fused[m, highs[r]]
    return result


@numba.njit(**_INLINE)
def _nibble_rows(row_sum, block_step, block_steps, pairs, pair_sums, x_reg, scales, packed, fused, x_pairs, paired,
                 row, end, y32):
    """Rows row .. end - 1 of a 4-bit GEMV (inlined into _mxfp4_rows / _hifloat4_rows, which pass their
    format's ``row_sum``, ``block_step`` and ``pair_sums``): x_reg (M, Kp) register order, scales / packed the
    format's two weight arrays (N, ...), fused (M, 256) from _fused_bytes, x_pairs and paired from
    _paired_bytes, y32 (M, N). ``block_steps``: steps of a row for _block_sums, or 0 where rows cannot be
    blocked (an MXFP4 row of an odd number of blocks). A block of rows is summed with fused multiply-adds
    for two rows of x at once where ``pairs`` and both may (_block_sums_pair: HiFloat4, whose step is
    costly to decode; MXFP4's cheap step measured 15-22 % slower so at M = 2 and 4), else in BF16 pairs
    (``pair_sums``: two steps per product instruction) where every one of its rows may be and the number
    of steps is even, else with fused multiply-adds where every one of its rows may be, else row by row."""
    blocks = scales.shape[1]
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
        m = 0
        while m < m_rows:
            if BLOCK_ROWS:  # a constant: on other CPUs numba prunes the block code before compiling it
                if count == ROW_BLOCK and _all_fused(fused, m, lows, highs, count):
                    if pairs and m + 1 < m_rows and _all_fused(fused, m + 1, lows, highs, count):
                        first, second = _block_sums_pair(block_step, _fma_products, _row_sum_nibbles, _x_step, x_flat,
                                                         m * kp, (m + 1) * kp, block_steps, operands, starts)
                        _store_block(y32, m, row, first)
                        _store_block(y32, m + 1, row, second)
                        m += 2
                        continue
                if count == ROW_BLOCK and pair_steps > 0 and _all_fused(paired, m, lows, highs, count):
                    _store_block(y32, m, row, pair_sums(xp_flat, m * kq, pair_steps, operands, starts))
                    m += 1
                    continue
                if count == ROW_BLOCK and _all_fused(fused, m, lows, highs, count):
                    _store_block(y32, m, row, _block_sums(block_step, _fma_products, _row_sum_nibbles, _x_step, x_flat,
                                                          m * kp, block_steps, operands, starts))
                    m += 1
                    continue
            for r in range(count):
                b0 = (row + r) * blocks
                if fused[m, lows[r]] and fused[m, highs[r]]:
                    y32[m, row + r] = row_sum(_accumulate_fused, x_flat, m * kp, scales_flat, packed_flat, b0, blocks,
                                              scratch)
                else:
                    y32[m, row + r] = row_sum(_accumulate, x_flat, m * kp, scales_flat, packed_flat, b0, blocks,
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
def _pair_sums(step, x_flat, x0, steps, operands, starts):
    """The folded sums of a block of rows in BF16 pairs, two rows at a time: HiFloat4's pair look-ups take
    more registers than a block of four rows leaves (LLVM spilled accumulators every step)."""
    a, b = _pair_rows(step, x_flat, x0, steps, operands, starts[0], starts[1])
    c, d = _pair_rows(step, x_flat, x0, steps, operands, starts[2], starts[3])
    return a, b, c, d


# Functions of their own, not inlined into the rows kernels: LLVM compiles two small functions much faster
# than one large one (a first run's cost, see docs/weight_only.md, 'Kernels').
@numba.njit(**NJIT_OPTIONS)
def _hifloat4_pair_sums_bf16(x_flat, x0, steps, operands, starts):
    return _pair_sums(_hifloat4_pair_step, x_flat, x0, steps, operands, starts)


@numba.njit(**NJIT_OPTIONS)
def _mxfp4_pair_sums_bf16(x_flat, x0, steps, operands, starts):
    # four rows at once: with the weight streamed from memory, four streams measured 6 % faster than two
    return _block_sums(_mxfp4_pair_step, _dot_pairs, _row_sum_nibbles, _x_pair_step, x_flat, x0, steps, operands, starts)


@numba.njit(**_INLINE)
def _no_pair_sums(x_flat, x0, steps, operands, starts):
    """Stands in for a pair kernel where there is none (no row is ever paired there: _paired_bytes)."""
    zero = np.float32(0.0)
    return zero, zero, zero, zero


# BF16 pairs need AVX512-BF16 (and the HiFloat4 look-ups AVX512-BITALG): elsewhere they are never compiled
_HIFLOAT4_PAIRS = simd.HAS_AVX512BF16 and simd.HAS_AVX512BITALG
_hifloat4_pair_sums = _hifloat4_pair_sums_bf16 if _HIFLOAT4_PAIRS else _no_pair_sums
_mxfp4_pair_sums = _mxfp4_pair_sums_bf16 if simd.HAS_AVX512BF16 else _no_pair_sums


@numba.njit(**NJIT_OPTIONS)
def _mxfp4_rows(x_reg, scales, codes, fused, x_pairs, paired, row, end, y32):
    """One task of _mxfp4_gemv (a function of its own, so that numba's parallel passes do not analyse it)."""
    blocks = scales.shape[1]
    _nibble_rows(_mxfp4_row_sum, _mxfp4_block_step, blocks // 2 if blocks % 2 == 0 else 0, False, _mxfp4_pair_sums,
                 x_reg, scales, codes, fused, x_pairs, paired, row, end, y32)


@numba.njit(**NJIT_OPTIONS)
def _hifloat4_rows(x_reg, words, value, fused, x_pairs, paired, row, end, y32):
    """One task of _hifloat4_gemv."""
    _nibble_rows(_hifloat4_row, _hifloat4_block_step, words.shape[1], True, _hifloat4_pair_sums, x_reg, words, value,
                 fused, x_pairs, paired, row, end, y32)


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
def _hifloat4_gemv(x_reg, words, value, fused, x_pairs, paired, y32):
    """words (N, K/64) int32 (the scale bytes; or uint32 from _hifloat4_prepared_words, with value in
    _hifloat4_prepare_values' order), value (N, K/2) uint8; x_reg (M, Kp) register order; fused, paired:
    _exact_bytes(x_reg, _HIFLOAT4_EXPONENTS, sources, x_pairs), which fills x_pairs; y32 (M, N). Every row, as
    _code8_gemv."""
    n = words.shape[0]
    for task in numba.prange((n + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        _hifloat4_rows(x_reg, words, value, fused, x_pairs, paired, task * _ROWS_PER_TASK,
                       min(n, (task + 1) * _ROWS_PER_TASK), y32)


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
def _hifloat4_tile_rows(words, value, r0, row, end, w32):
    """Rows row .. end - 1 of the tile: the serial part of _hifloat4_tile."""
    blocks = words.shape[1]
    kp = w32.shape[1]
    w_flat, words_flat, value_flat = simd.flat(w32), simd.flat(words), simd.flat(value)
    for i in range(row, end):
        _hifloat4_tile_row_any(words_flat, value_flat, r0 + i, blocks, w_flat, i * kp)


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _hifloat4_tile(words, value, r0, w32):
    rows = w32.shape[0]
    for task in numba.prange((rows + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        _hifloat4_tile_rows(words, value, r0, task * _ROWS_PER_TASK, min(rows, (task + 1) * _ROWS_PER_TASK), w32)


# ---- batched kernels (GEMV_MAX_M < M <= BATCH_MAX_M) ----------------------------------------------------------
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
# Rows of x up to which the batched kernels run: with BF16 products, 32; with float32 ones, 64: beyond, the GEMM
# path's float32 GEMM caught up (AMD Zen 3, two threads, 4096^2 and 12288 x 8192: batched 0.17-0.20x F.linear's
# time at M = 64 against 0.22-0.30x, at M = 128 0.17-0.20x against 0.18-0.27x).
BATCH_MAX_M = 32 if BATCH_IN_BF16 else 64
# On CPUs with AMX-BF16, weights of at least AMX_GEMM_WEIGHTS take the GEMM path above AMX_BATCH_MAX_M rows of x,
# that is from M = 5 on: its decode costs the same whatever M is, and a BF16 GEMM on AMX tiles costs little more
# at M = 32 than at M = 1. Since the tiles are decoded as BF16 words and the GEMM runs transposed, the GEMM path
# took 1.36-1.38x F.linear's time at M = 5 against 1.39-1.65x for the batched kernel, 1.30-1.53x against
# 2.19-2.94x at M = 11 and 1.16-1.38x against 2.17-4.48x at M = 12-32 (Intel Xeon, MXFP4 and HiFloat4, 4096^2
# and 12288 x 8192; before, the batched kernel was the faster one up to M = 11). Smaller weights keep the
# batched kernel: there torch's GEMM call and its threads' hand-over cost more than the batched kernel's
# products (1536 x 384 at M = 31: 0.37 ms against 0.47 ms; 2048^2: 1.60 against 0.96 ms;
# benchmarks/results_weight_only.md, 'Intel Xeon').
AMX_BATCH_MAX_M = GEMV_MAX_M
AMX_GEMM_WEIGHTS = 2 << 20
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
    """A ROW_BLOCK * Kp row buffer (_BATCH_WEIGHT) whose rows from ``rows`` on are zeros."""
    w = np.empty(ROW_BLOCK * kp, dtype=_BATCH_WEIGHT)
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
def _hifloat4_batched_rows(x_reg, words, value, row, end, y32):
    """Rows row .. end - 1 of W: the serial part of _hifloat4_batched."""
    m_rows, kp = x_reg.shape
    operands = (simd.flat(words), simd.flat(value), words.shape[1])
    _batch_rows(_hifloat4_batch_row, operands, row, end, simd.flat(x_reg), kp, m_rows, y32)


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _hifloat4_batched(x_reg, words, value, y32):
    n = words.shape[0]
    for task in numba.prange(-(-n // _BATCH_ROWS_PER_TASK)):
        _hifloat4_batched_rows(x_reg, words, value, task * _BATCH_ROWS_PER_TASK,
                               min(n, (task + 1) * _BATCH_ROWS_PER_TASK), y32)


# ---- the GEMV's input and output, in numba (no torch op between a call's start and its end) ------------------


@numba.njit(**_INLINE)
def _widen(bits, count, bf16, widened, chunk):
    """widened (float32, a multiple of HALF long) <- the FP16/BF16 bit patterns (int16) bits[:count] widened
    exactly, zeros past ``count``; ``chunk``: HALF int16 of scratch."""
    for j in range(0, len(widened), HALF):
        if j + HALF <= count:
            source, at = bits, j
        else:  # the last, short chunk (zeros after it)
            chunk[:] = 0
            copy_elements(chunk, 0, bits, j, max(0, count - j))
            source, at = chunk, 0
        value = simd.bf16v_load(source, at) if bf16 else simd.f16v_load(source, at)
        simd.f32v_store(widened, j, value)


@numba.njit(**NJIT_OPTIONS)
def _gather_x(x_bits, bf16, order, x_reg):
    """x_reg (M, Kp) float32 <- x (M, K) FP16/BF16 bit patterns (int16) widened exactly, each 64-element step
    in the register order ``order`` (int32[64]: the element of each register lane), zero past K."""
    m_rows, k = x_bits.shape
    kp = x_reg.shape[1]
    widened = np.zeros(kp, dtype=np.float32)
    chunk = np.zeros(HALF, dtype=np.int16)
    for m in range(m_rows):
        _widen(x_bits[m], k, bf16, widened, chunk)
        for j in range(0, kp, LANES):
            for p in range(LANES):
                x_reg[m, j + p] = widened[j + order[p]]


_NO_BIAS, _BIAS_LIKE_X, _BIAS_FLOAT32 = amx.BIAS_NONE, amx.BIAS_BF16, amx.BIAS_FLOAT32  # _finish's bias kinds


@numba.njit(**NJIT_OPTIONS)
def _finish(y32, bias_bits, bias_kind, bf16, out_bits):
    """The reference's step 4 (lowbit.formats.weight_only.finish) into ``out_bits`` (M, N) int16: fl32(y32 +
    bias), rounded once to BF16 (``bf16``) or FP16, NaN canonical. The bias as int16 bit patterns, by
    ``bias_kind``: _NO_BIAS (none), _BIAS_LIKE_X ((N,), x's dtype: widened exactly) or _BIAS_FLOAT32 ((2N,),
    the float32 values' bits)."""
    m_rows, n = y32.shape
    bias32 = np.zeros(-(-n // HALF) * HALF, dtype=np.float32)
    if bias_kind == _BIAS_LIKE_X:
        _widen(bias_bits, n, bf16, bias32, np.zeros(HALF, dtype=np.int16))
    elif bias_kind == _BIAS_FLOAT32:
        copy_elements(bias32, 0, bias_bits.view(np.float32), 0, n)
    y_chunk = np.zeros(HALF, dtype=np.float32)
    out_chunk = np.zeros(HALF, dtype=np.int16)
    y_flat, out_flat = simd.flat(y32), simd.flat(out_bits)
    for m in range(m_rows):
        for j in range(0, n, HALF):
            count = min(HALF, n - j)
            if count == HALF:  # read and written in place; a short last chunk goes through the scratch chunks
                value = simd.f32v_load(y_flat, m * n + j)
            else:
                copy_elements(y_chunk, 0, y32[m], j, count)
                value = simd.f32v_load(y_chunk, 0)
            if bias_kind != _NO_BIAS:
                value = simd.f32v_add(value, simd.f32v_load(bias32, j))
            target, at = (out_flat, m * n + j) if count == HALF else (out_chunk, 0)
            if bf16:
                simd.f32v_store_as_bf16(target, at, value)
            else:
                simd.f32v_store_as_f16(target, at, value)
            if count < HALF:
                copy_elements(out_bits[m], j, out_chunk, 0, count)


# The canonical-NaN pass over a GEMM's output: words per prange iteration, and the size from which it runs on
# numba's threads (M = 1888, N = 1536: 0.20 ms on one thread, a tenth of the layer's time on an Intel Xeon).
_CANONICAL_TASK_WORDS = 1 << 16
_CANONICAL_ONE_THREAD_WORDS = 1 << 19


def _canonical_nans(bits):
    """Every NaN of BF16 bit patterns (a 1-D int16 array) replaced by the canonical one, in place."""
    size, words = np.uint64(bits.size), np.uint64(_CANONICAL_TASK_WORDS)
    for task in numba.prange((size + words - np.uint64(1)) // words):
        for i in range(np.uint64(task) * words, min(size, (np.uint64(task) + np.uint64(1)) * words)):
            # unsigned i: no negative-index code, so LLVM vectorizes the loop
            bits[i] = _transpose.canonical_word(bits[i])


_CANONICAL_NANS = SerialOrParallel(_canonical_nans)


def canonical_nan_bf16(bits: np.ndarray) -> None:
    """Every NaN of BF16 bit patterns (a 1-D int16 array) replaced by the canonical one, in place; on numba's
    threads from _CANONICAL_ONE_THREAD_WORDS words on, its tasks split evenly among them (chunk size 0, whatever
    the caller's: run_gemm_path's suits the tile decoder's rows)."""
    if runs_serially(bits.size, _CANONICAL_ONE_THREAD_WORDS):
        _CANONICAL_NANS.serial(bits)
    else:
        call_in_chunks(0, _CANONICAL_NANS.parallel, bits)


@numba.njit(**NJIT_OPTIONS)
def transpose_bf16(src, dst):
    """dst (M, N) <- src (N, M) transposed, both C-contiguous int16 (BF16 bits), every NaN the canonical one:
    blocks of 32 x 32 words in registers (_transpose.transpose_block; with non-temporal stores where every
    row of dst starts on a cache line: a new output is then not read before it is written, 0.45-0.6 -> 0.25 ms
    at 4096 x 256 in a layer's call on an Intel Xeon), the edges word by word. The caller checks the shapes."""
    n, m = src.shape
    src_flat, dst_flat = simd.flat(src), simd.flat(dst)
    n_blocks, m_blocks = n - n % _transpose.BLOCK, m - m % _transpose.BLOCK
    streaming = dst.ctypes.data % 64 == 0 and n % _transpose.BLOCK == 0
    for i in range(0, n_blocks, _transpose.BLOCK):
        for j in range(0, m_blocks, _transpose.BLOCK):
            if streaming:
                _transpose.transpose_block_streaming(src_flat, i * m + j, m, dst_flat, j * n + i, n)
            else:
                _transpose.transpose_block(src_flat, i * m + j, m, dst_flat, j * n + i, n)
    if streaming:  # the non-temporal stores ordered before whatever reads dst next
        _transpose.store_fence()
    for j in range(m_blocks, m):  # src's last columns, all its rows
        for i in range(n):
            dst[j, i] = _transpose.canonical_word(src[i, j])
    for i in range(n_blocks, n):  # src's last rows, in the columns the blocks covered
        for j in range(m_blocks):
            dst[j, i] = _transpose.canonical_word(src[i, j])


# ---- kernels -----------------------------------------------------------------------------------------------


_NO_BIAS_BITS = np.zeros(0, dtype=np.int16)


def _bias_bits(bias) -> tuple[np.ndarray, int]:
    """(bias_bits, bias_kind) of _finish for ``bias``: None, (N,) in x's dtype or (N,) float32."""
    if bias is None:
        return _NO_BIAS_BITS, _NO_BIAS
    if bias.dtype == torch.float32:
        return as_numpy(bias).view(np.int16), _BIAS_FLOAT32
    return as_numpy(bias), _BIAS_LIKE_X


def _round_into(y32: np.ndarray, bias, bf16: bool, out: torch.Tensor) -> None:
    """out <- fl32(y32 + bias) rounded to BF16 (``bf16``) or FP16, NaN canonical (_finish)."""
    _finish(y32, *_bias_bits(bias), bf16, as_numpy(out))


@numba.njit(**_INLINE)
def _gemv_arrays(x_bits, bf16, order, n):
    """(x_reg, y32) of a one-call GEMV: x (M, K) FP16 / BF16 bit patterns (int16) gathered into the register
    order (M, Kp) float32, and the (M, N) float32 sums' array."""
    m, k = x_bits.shape
    x_reg = np.empty((m, -(-k // LANES) * LANES), dtype=np.float32)
    _gather_x(x_bits, bf16, order, x_reg)
    return x_reg, np.empty((m, n), dtype=np.float32)


def _serial_gemv(x_bits, bf16, order, n, operands, x_consts, bias_bits, bias_kind, out_bits):
    """A format's whole GEMV on the calling thread in one numba call (bound per format by _one_call_gemv: its
    rows kernel ``_KERNEL`` and x's per-call operands ``_X_OPERANDS``): x (M, K) FP16 / BF16 bit patterns
    (int16) gathered into the register order, W's N rows summed, the reference's rounding into out_bits
    (M, N) int16 (_finish). After
    a torch op each call from Python, and each torch or numpy call between them, runs with cold caches (tens
    of microseconds each: docs/weight_only.md, 'One call')."""
    x_reg, y32 = _gemv_arrays(x_bits, bf16, order, n)
    _KERNEL(x_reg, *operands, *_X_OPERANDS(x_reg, operands, x_consts), 0, n, y32)  # noqa: F821 (bound per format)
    _finish(y32, bias_bits, bias_kind, bf16, out_bits)


def _parallel_gemv(x_bits, bf16, order, n, operands, x_consts, bias_bits, bias_kind, out_bits, chunksize):
    """_serial_gemv with the rows in numba's parallel loop: ``_KERNEL`` is the format's parallel GEMV (a call
    of it from here launches the threads as a call from Python would), its loop in chunks of ``chunksize``
    iterations, set and put back in here (call_in_chunks from Python: two more calls after other work)."""
    x_reg, y32 = _gemv_arrays(x_bits, bf16, order, n)
    previous = swap_parallel_chunksize(numba.uintp(chunksize))
    _KERNEL(x_reg, *operands, *_X_OPERANDS(x_reg, operands, x_consts), y32)  # noqa: F821 (bound per format)
    swap_parallel_chunksize(previous)
    _finish(y32, bias_bits, bias_kind, bf16, out_bits)


def _one_call_gemv(template, kernel, x_operands):
    """The numba dispatcher of ``template`` (_serial_gemv or _parallel_gemv) with ``_KERNEL`` = kernel (the
    format's rows kernel, or its parallel GEMV) and ``_X_OPERANDS`` = x_operands, named after both."""
    return bound_njit(template, f"{template.__name__}{kernel.py_func.__name__}", _KERNEL=kernel,
                      _X_OPERANDS=x_operands)


@numba.njit(**_INLINE)
def _batched_bits_arrays(x_bits, bf16, order, n):
    """_gemv_arrays for the batched kernels where BATCH_IN_BF16: x's BF16 bits in the register order (M, Kp)
    (_gather_x_bits), and the (M, N) float32 sums' array."""
    m, k = x_bits.shape
    x_reg = np.empty((m, -(-k // LANES) * LANES), dtype=np.int16)
    _gather_x_bits(x_bits, order, x_reg)
    return x_reg, np.empty((m, n), dtype=np.float32)


def _serial_batched(x_bits, bf16, order, n, operands, bias_bits, bias_kind, out_bits):
    """WeightOnlyLinear._run_batched in one numba call on the calling thread (bound per format by
    _one_call_batched: its batched rows kernel ``_KERNEL``, and ``_ARRAYS``, x's gather): the same steps, the
    same bits, without two calls from Python (docs/weight_only.md, 'One call')."""
    x_reg, y32 = _ARRAYS(x_bits, bf16, order, n)  # noqa: F821 (bound)
    _KERNEL(x_reg, *operands, 0, n, y32)  # noqa: F821 (bound per format)
    _finish(y32, bias_bits, bias_kind, bf16, out_bits)


def _parallel_batched(x_bits, bf16, order, n, operands, bias_bits, bias_kind, out_bits):
    """_serial_batched with the rows of W in numba's parallel loop (``_KERNEL``: the format's parallel batched
    kernel), one task (_BATCH_ROWS_PER_TASK rows of W) per chunk."""
    x_reg, y32 = _ARRAYS(x_bits, bf16, order, n)  # noqa: F821 (bound)
    previous = swap_parallel_chunksize(numba.uintp(1))
    _KERNEL(x_reg, *operands, y32)  # noqa: F821 (bound per format)
    swap_parallel_chunksize(previous)
    _finish(y32, bias_bits, bias_kind, bf16, out_bits)


def _one_call_batched(template, kernel):
    """The numba dispatcher of ``template`` (_serial_batched or _parallel_batched) with ``_KERNEL`` = kernel and
    x gathered as _run_batched gathers it (BF16 bits where BATCH_IN_BF16, else float32 as the GEMV's)."""
    return bound_njit(template, f"{template.__name__}{kernel.py_func.__name__}", _KERNEL=kernel,
                      _ARRAYS=_batched_bits_arrays if BATCH_IN_BF16 else _gemv_arrays)


# Whether the GEMM path hands BF16 x to torch's BF16 GEMM (on BF16 tiles) rather than its float32 GEMM: only
# where the CPU multiplies BF16 in hardware (simd.TORCH_BF16_GEMM_IN_HARDWARE). Without AVX512-BF16 or AMX
# (AMD Zen 3, Intel Xeon before Cooper Lake) torch's BF16 GEMM, and F.linear in BF16, ran 3.5-4x slower than
# its float32 one (docs/weight_only.md, 'Kernels').
BF16_GEMM = simd.TORCH_BF16_GEMM_IN_HARDWARE
# On CPUs with AMX-BF16 the GEMM path computes y^T = W x^T and transposes it: torch's BF16 GEMM took 20-35 %
# less time with the (N, K) weight tile as its first operand than as F.linear's second, which oneDNN repacks
# on every call (Intel Xeon, M = 64-256: docs/weight_only.md, 'CPU GEMM');
# not where the (N, M) result passes TRANSPOSED_GEMM_BYTES (M = 1024 gained 8 %, and the buffer is kept).
TRANSPOSED_GEMM = simd.HAS_AMX_BF16
TRANSPOSED_GEMM_BYTES = 16 << 20
# Only for weights whose N and K are both at least TRANSPOSED_MIN_SIDE, and past TRANSPOSED_MAX_M rows of x only
# where K is at least TRANSPOSED_LONG_K: elsewhere the transpose costs more than the GEMM gains (Intel Xeon
# Emerald Rapids, the GEMM and transpose alone, over F.linear's orientation: K = 384 1.10-1.89x at M = 32-1888;
# N = K = 1536 0.80-0.91x up to M = 512, 1.00-1.11x from 1024; K = 1536, N = 4096 1.03-1.12x from 1024; K = 4096,
# N = 1536 or 4096 0.62-0.92x at every M; all-MiniLM-L6-v2's layers at M = 1024: 1.3-1.5x as long in the layer;
# benchmarks/results_weight_only.md, 'Intel Xeon Emerald Rapids: the GEMM's orientation by shape').
TRANSPOSED_MIN_SIDE = 1536
TRANSPOSED_MAX_M = 512
TRANSPOSED_LONG_K = 4096
# Its tiles: M = 256 on the Intel Xeon, 4096^2 in tiles of 2048 rows (16 MiB) took 5.2 ms against 5.8 ms in one
# tile, 12288 x 8192 in tiles of 1024 rows 33.9 against 35.6 ms (the decoded rows still in the cache when the
# GEMM reads them); 256-row tiles were slower (a GEMM call's own cost).
TRANSPOSED_TILE_BYTES = 16 << 20


def _gemm_tile_bytes(transposed: bool) -> int:
    """The GEMM path's tile budget: GEMM_TILE_BYTES, capped by TRANSPOSED_TILE_BYTES for the transposed GEMM."""
    return min(GEMM_TILE_BYTES, TRANSPOSED_TILE_BYTES) if transposed else GEMM_TILE_BYTES


def _gemv_chunksize(n: int) -> int:
    """prange iterations of the GEMV's N rows a thread takes at a time (about _CHUNKS chunks, at least 4)."""
    return max(4, -(-n // _ROWS_PER_TASK) // _CHUNKS)


class BoundGemv:
    """A prepared weight's product with x of one dtype and K in one numba call: the GEMV for up to GEMV_MAX_M rows
    (``serial_gemv`` on the calling thread, or ``parallel_gemv`` on numba's threads, as the kernel's ``run``
    chooses: runs_serially), the batched kernel for more, up to ``max_rows`` = _batch_max_m (``serial_batched``,
    ``parallel_batched``), or, where the GEMM path runs on lowbit's AMX kernel, that kernel up to ``max_rows`` =
    _amx_max_m (amx.run). ``f(x_bits, out_bits) -> True``: x's and out's int16 bit patterns, (M, K) and (M, N),
    C-contiguous, not checked here (the caller's: lowbit.ops.library.PreparedCall._bound_gemv)."""

    def __init__(self, kernel: "WeightOnlyLinear", prepared: tuple, n: int, k: int, dtype: torch.dtype) -> None:
        operands, _, bias_bits = prepared
        self._serial, self._parallel = kernel.serial_gemv, kernel.parallel_gemv
        self._args = (dtype == torch.bfloat16, kernel.order, n, operands, kernel.x_consts, *bias_bits)
        self._work, self._chunksize = n * k, _gemv_chunksize(n)
        self._batched = kernel.serial_batched, kernel.parallel_batched
        self._batched_args = (dtype == torch.bfloat16, kernel.order, n, operands, *bias_bits)
        self._amx_args = (kernel.tile[0], operands, n, _tile_width(k), *bias_bits)
        self._on_tiles = _amx_max_m(k, dtype) > GEMV_MAX_M
        self.max_rows = one_call_max_rows(n, k, dtype)

    def __call__(self, x_bits: np.ndarray, out_bits: np.ndarray) -> bool:
        m = x_bits.shape[0]
        if m > GEMV_MAX_M and self._on_tiles:
            tile_rows, operands, n, width, *bias_bits = self._amx_args
            amx.run(tile_rows, operands, x_bits, n, width, *bias_bits, out_bits)
            return True
        if m > GEMV_MAX_M:  # as _run's batched path: tasks of _BATCH_ROWS_PER_TASK rows, one at a time
            if runs_serially(m * self._work, GEMV_ONE_THREAD_WEIGHTS):
                self._batched[0](x_bits, *self._batched_args, out_bits)
            else:
                self._batched[1](x_bits, *self._batched_args, out_bits)
            return True
        if runs_serially(self._work, GEMV_ONE_THREAD_WEIGHTS):
            self._serial(x_bits, *self._args, out_bits)
        else:
            self._parallel(x_bits, *self._args, out_bits, self._chunksize)
        return True


def one_call_max_rows(n: int, k: int, dtype: torch.dtype) -> int:
    """Rows of x of ``dtype`` up to which a prepared (N, K) weight's product runs in one numba call (BoundGemv):
    the GEMV's, and the AMX kernel's (_amx_max_m) or else the batched kernel's (_batch_max_m)."""
    on_tiles = _amx_max_m(k, dtype)
    return max(GEMV_MAX_M, on_tiles if on_tiles > GEMV_MAX_M else _batch_max_m(n, k, dtype))


def _batch_max_m(n: int, k: int, dtype: torch.dtype) -> int:
    """Rows of x of ``dtype`` up to which an (N, K) weight runs the batched kernel (GEMV_MAX_M: never)."""
    if BATCH_IN_BF16 and dtype != torch.bfloat16 or AMX_GEMM and dtype == torch.bfloat16:
        return GEMV_MAX_M
    if simd.HAS_AMX_BF16 and n * k >= AMX_GEMM_WEIGHTS:
        return AMX_BATCH_MAX_M
    return BATCH_MAX_M


def _padded_k(k: int) -> int:
    return -(-k // LANES) * LANES


class WeightOnlyLinear(Kernel):
    """One format's kernel: ``run(x, a, b, bias, out=)`` with x (..., K) FP16/BF16, the format's two weight
    tensors (validated by lowbit.ops.weight_only), bias (N,) or None, out (..., N) in x's dtype.

    ``gemv``, ``batched`` and ``tile``: the format's numba kernels (M <= GEMV_MAX_M; M <= _batch_max_m, BF16 x
    only on AVX512-BF16 CPUs; the GEMM path), each a pair (serial, parallel): ``serial(*args, row,
    end, out)`` computes output rows row .. end - 1 on the calling thread, ``parallel(*args, out)`` all of
    them in numba's parallel loop (compiled on its first call only: a process that never runs a kernel on
    several threads, such as ``lowbit smoke``, never compiles it). args: (x_reg, *operands[, fused, x_pairs,
    paired][, x_bounds]) for the GEMV, (x_reg, *operands) batched, (*operands, r0) for a tile of rows r0 ... of W.
    ``split``: the register order (see _reorder); ``operands(a, b, k, dtype)``: the numba kernels' weight
    operands for x of ``dtype``; ``exponents``: a 4-bit format's table for _exact_bytes, whose results (fused,
    x_pairs, paired) the GEMV kernels take after the operands (None: an 8-bit format, whose GEMV takes x's
    exponent bounds there instead, and with a ``pair_order`` x's BF16 pairs too: _code8_x_operands;
    _x_bounds_operands); ``pair_order``: the format's BF16 pair order (None: no pair kernel). The GEMV's
    per-call operands of x: ``x_operands(x_reg, operands, x_consts)`` (``direct_x_operands`` in the operator's
    direct call); on the calling thread the whole call is one numba function, ``serial_gemv`` (_serial_gemv),
    and so it is on numba's threads, ``parallel_gemv`` (_parallel_gemv), both over ``one_call_gemv``'s rows
    (default: ``gemv``; HiFloat8 and FP8: rows that take BF16 pairs, compiled for prepared weights only). With
    BF16 x every
    format's decoded weight is a BF16 value (the GEMM path uses torch's BF16 GEMM).
    """

    def __init__(self, gemv: tuple, batched: tuple, tile: tuple, split: tuple, operands, exponents=None,
                 pair_order=None, prepared_operands=None, one_call_gemv=None):
        self.gemv, self.batched, self.tile, self.split, self._operands = gemv, batched, tile, split, operands
        self._prepared_operands = prepared_operands or operands
        self.exponents = exponents
        self.order = np.array(_order(*split), dtype=np.int32)
        self.pair_sources = (_pair_sources(_order(*split), pair_order)
                             if pair_order is not None and simd.HAS_AVX512BF16 else None)
        sources = _NO_PAIR_SOURCES if self.pair_sources is None else self.pair_sources
        if exponents is not None:  # a 4-bit format: fused multiply-adds and BF16 pairs where exact
            self.x_operands, self.x_consts = _four_bit_x_operands, (exponents, sources, self.pair_sources is not None)
        elif pair_order is not None:  # HiFloat8, FP8: BF16 pairs where exact; by columns: fused multiply-adds
            self.x_operands, self.x_consts = _code8_x_operands, (sources,)
        else:  # MXFP8 by columns: fused multiply-adds where exact
            self.x_operands, self.x_consts = _x_bounds_operands, ()
        # The direct call's x operands (gemv_sums): for HiFloat8 and FP8 without x's pairs, which their direct
        # call's rows kernel does not read (one_call_gemv)
        code8_pairs = pair_order is not None and exponents is None
        self.direct_x_operands = _code8_direct_x_operands if code8_pairs else self.x_operands
        self.one_call_gemv = one_call_gemv = one_call_gemv or gemv
        self.serial_gemv = _one_call_gemv(_serial_gemv, one_call_gemv[0], self.x_operands)
        self.parallel_gemv = _one_call_gemv(_parallel_gemv, one_call_gemv[1], self.x_operands)
        self.serial_batched = _one_call_batched(_serial_batched, batched[0])
        self.parallel_batched = _one_call_batched(_parallel_batched, batched[1])

    def run(self, x: torch.Tensor, *args, out: torch.Tensor) -> None:
        *weight, bias = args
        self._run(x, (self._operands(*weight, x.shape[-1], x.dtype), bias, None), out, one_call=False)

    def prepare(self, dtype: torch.dtype, k: int, *args) -> tuple:
        """(numba operands, bias, _bias_bits of the bias) of a validated, contiguous packed weight of K = ``k``
        and its bias, for x of ``dtype``, made once for many calls: the operands are views of the weight's
        tensors (and, for HiFloat8, its scales rounded to ``dtype``; for HiFloat8, FP8 and MXFP8 with BF16 x
        where CODE8_COLUMNS, their codes re-encoded and their rows' column tables; for HiFloat4 on AVX2 CPUs
        without AVX-512, its scale words and value bytes rearranged), valid while those keep their memory and
        values (lowbit.ops.library.PreparedCall)."""
        *weight, bias = args
        return self._prepared_operands(*weight, k, dtype), bias, _bias_bits(bias)

    def run_prepared(self, x: torch.Tensor, prepared: tuple, *, out: torch.Tensor) -> None:
        """:meth:`run` with the weight's operands and the bias from :meth:`prepare` (for x's dtype); the GEMV in
        one numba call (serial_gemv, parallel_gemv: docs/weight_only.md, 'One call'), which a weight bound
        for many calls repays the compiling of (about 2-4 s per format, once; the operator's direct call,
        as in ``lowbit smoke``, keeps the three calls, compiled anyway)."""
        self._run(x, prepared, out, one_call=True)

    def _run(self, x: torch.Tensor, prepared: tuple, out: torch.Tensor, one_call: bool) -> None:
        """out <- x times the weight (``prepared``: operands, bias, its bits or None where not ``one_call``), by
        the GEMV (in one numba call, BoundGemv, where ``one_call``), the batched kernel or the GEMM path."""
        operands, bias, _ = prepared
        k, n = x.shape[-1], out.shape[-1]
        m = out.numel() // n
        if out.dim() != 2:  # x too: (..., K) -> (M, K)
            x, out = x.reshape(m, k), out.view(m, n)
        # Rows in chunks: under numba's TBB layer handed out on demand, so a thread that the OS deschedules on a
        # shared machine does not make the other one wait at the end (OpenMP and workqueue split them evenly
        # up front: docs/architecture.md, 'CPU threads').
        if one_call and m <= max(GEMV_MAX_M, _batch_max_m(n, k, x.dtype)):
            self.bind_gemv(prepared, n, k, x.dtype)(x.view(torch.int16).numpy(), out.view(torch.int16).numpy())
            return
        if m <= GEMV_MAX_M:
            path, work, chunksize = self._run_gemv, n * k, _gemv_chunksize(n)
        elif m <= _batch_max_m(n, k, x.dtype):
            path, work, chunksize = self._run_batched, m * n * k, 1  # tasks of _BATCH_ROWS_PER_TASK rows
        else:  # the GEMM path: the decoded tile's rows (torch's GEMM takes torch's threads)
            run_gemm_path(self.tile, operands, x, bias, out)
            return
        # Below GEMV_ONE_THREAD_WEIGHTS the calling thread: waking numba's threads after a torch op would cost
        # more than they save there, and the rows run without the parallel loop's launch (about 13 us of a
        # 1536 x 384 MXFP4 GEMV's 54 us); numba's thread count is left as it is.
        if runs_serially(work, GEMV_ONE_THREAD_WEIGHTS):
            path(x, operands, bias, out, serial=True)
            return
        call_in_chunks(chunksize, path, x, operands, bias, out, False)

    def run_low_rank(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, t: torch.Tensor, u: torch.Tensor,
                     *, out: torch.Tensor, x_scales: torch.Tensor | None = None) -> None:
        """out (M, N) <- bf16(bf16(t @ u) + bf16(x W^T)) on lowbit's AMX kernel (amx.run with a low-rank branch),
        the sums of both products on the tiles: x (M, K), t (M, R), u (R, N) and out (M, N) BF16, C-contiguous,
        M at most _amx_max_m(K); ``a``, ``b`` the format's weight (validated). With ``x_scales`` ((M, K/32) uint8,
        C-contiguous; K a multiple of 32), x's MXFP4 fake quant (svd_quant's activation quantizer: floor scale,
        ties away) takes x's place, laid out straight into the tiles' operand, and ``x_scales`` gets its scale
        bytes. Raises ValueError for a tensor that is not a 2-D CPU one, RuntimeError where the AMX kernel does not
        take x, ValueError for other shapes, dtypes or layouts."""
        given = {"x": x, "t": t, "u": u, "out": out, **({} if x_scales is None else {"x_scales": x_scales})}
        for name, v in given.items():
            if v.dim() != 2 or v.device.type != "cpu":
                raise ValueError(f"run_low_rank: {name} must be a 2-D CPU tensor, got {tuple(v.shape)} on {v.device}")
        (m, k), n = x.shape, out.shape[1]
        if not 0 < m <= _amx_max_m(k, x.dtype):
            raise RuntimeError(f"run_low_rank: lowbit's AMX kernel does not take x {tuple(x.shape)} {x.dtype} here")
        tensors = {"t": t, "u": u, "out": out}
        if any(v.dtype != torch.bfloat16 or not v.is_contiguous() for v in tensors.values()):
            raise ValueError("run_low_rank: t, u and out must be C-contiguous BF16, got "
                             + ", ".join(f"{name} {tuple(v.shape)} {v.dtype}" for name, v in tensors.items()))
        if t.shape[0] != m or out.shape[0] != m or u.shape != (t.shape[1], n) or not x.is_contiguous():
            raise ValueError(f"run_low_rank: x {tuple(x.shape)} (C-contiguous), t {tuple(t.shape)}, u {tuple(u.shape)}"
                             f" and out {tuple(out.shape)} do not make (M, K) (M, R) (R, N) (M, N)")
        fake_quant = None
        if x_scales is not None:
            fits = x_scales.dtype == torch.uint8 and x_scales.shape == (m, k // 32) and x_scales.is_contiguous()
            if k % 32 or not fits:
                raise ValueError(f"run_low_rank: x_scales {tuple(x_scales.shape)} {x_scales.dtype} for x "
                                 f"{tuple(x.shape)}: expected (M, K/32) uint8, C-contiguous, K a multiple of 32")
            # imported here: only svd_quant's prefill runs the MXFP4 fake quant, and its warm-up task (which
            # waits for the MXFP4 family: lowbit.kernels.cpu.warm) compiles it, not the weight-only family's
            from lowbit.kernels.cpu.mxfp4 import fake_quantizer

            fake_quant = (*fake_quantizer(x.dtype, "floor", "ta"), as_numpy(x_scales))
        amx.run(self.tile[0], self._operands(a, b, k, x.dtype), as_numpy(x), n, _tile_width(k),
                *_bias_bits(None), as_numpy(out), low_rank=(as_numpy(t), as_numpy(u)), fake_quant=fake_quant)

    def bind_gemv(self, prepared: tuple, n: int, k: int, dtype: torch.dtype) -> "BoundGemv":
        """:class:`BoundGemv` of the weight (N, K) prepared by :meth:`prepare` for x of ``dtype``."""
        return BoundGemv(self, prepared, n, k, dtype)

    def _run_gemv(self, x: torch.Tensor, operands: tuple, bias, out: torch.Tensor, serial: bool) -> None:
        """The GEMV in three numba calls: x in register order, the lane sums, then the reference's rounding."""
        (m, k), n = x.shape, out.shape[1]
        bf16 = x.dtype == torch.bfloat16
        x_reg = np.empty((m, _padded_k(k)), dtype=np.float32)
        _gather_x(as_numpy(x), bf16, self.order, x_reg)
        y32 = np.empty((m, n), dtype=np.float32)
        self.gemv_sums(x_reg, operands, y32, serial)
        _round_into(y32, bias, bf16, out)

    def gemv_sums(self, x_reg: np.ndarray, operands: tuple, y32: np.ndarray, serial: bool) -> None:
        """y32 (M, N) float32 <- the GEMV's float32 sums of x_reg (M, Kp) float32 (x in the register order,
        zero-padded) with the weight ``operands``, before the rounding to x's dtype."""
        extra = self.direct_x_operands(x_reg, operands, self.x_consts)
        run_tasks(self.gemv, (x_reg, *operands, *extra), y32.shape[1], y32, serial)

    def _run_batched(self, x: torch.Tensor, operands: tuple, bias, out: torch.Tensor, serial: bool) -> None:
        """GEMV_MAX_M < M <= _batch_max_m: the batched kernel on x in the register order (zero-padded to Kp;
        BF16 bits where BATCH_IN_BF16, else float32), then the reference's rounding."""
        (m, k), n = x.shape, out.shape[1]
        bf16 = x.dtype == torch.bfloat16
        if BATCH_IN_BF16:
            x_reg = np.empty((m, _padded_k(k)), dtype=np.int16)
            _gather_x_bits(as_numpy(x), self.order, x_reg)
        else:
            x_reg = np.empty((m, _padded_k(k)), dtype=np.float32)
            _gather_x(as_numpy(x), bf16, self.order, x_reg)
        y32 = np.empty((m, n), dtype=np.float32)
        run_tasks(self.batched, (x_reg, *operands), n, y32, serial)
        _round_into(y32, bias, bf16, out)


# On CPUs with AMX-BF16, BF16 x of at most AMX_MAX_M rows whose x^T (M and K padded to the tiles) takes at most
# AMX_X_BYTES multiplies the packed weight on AMX tiles itself (lowbit.kernels.cpu.amx: each panel of W decoded
# into the cache, no BF16 tile written out, no torch GEMM), from GEMV_MAX_M + 1 rows on (the batched kernel is
# not used there). Beyond, torch's GEMM (oneDNN) reached more of the tiles' throughput than lowbit's kernel,
# which reads x^T again for every task (Intel Xeon Emerald Rapids, MXFP4 / HiFloat4 / HiFloat8, time over
# F.linear's: 4096^2 at M = 512 1.00-1.05x either way; 12288 x 8192 at M = 256 (4 MiB) 1.41-1.49x against
# 1.06-1.09x, at M = 64 0.96-1.16x against 1.08-1.15x; 1536 x 384 at M = 768 1.77-1.82x against 1.51-1.71x;
# benchmarks/results_weight_only.md, 'Intel Xeon Emerald Rapids: lowbit's AMX kernel').
AMX_GEMM = amx.AVAILABLE
AMX_MAX_M = 512
AMX_X_BYTES = 2 << 20


def _amx_max_m(k: int, dtype: torch.dtype) -> int:
    """Rows of x of ``dtype`` with K columns up to which the GEMM path runs on lowbit's own AMX kernel (0: never)."""
    if not (AMX_GEMM and dtype == torch.bfloat16):
        return 0
    return min(AMX_MAX_M, AMX_X_BYTES // (2 * -(-k // amx.TILE_K) * amx.TILE_K) // amx.PANEL * amx.PANEL)


def _transposes(m: int, n: int, k: int) -> bool:
    """Whether the BF16 GEMM of M rows of x and an (N, K) weight runs transposed (TRANSPOSED_GEMM and the limits
    after it)."""
    return (TRANSPOSED_GEMM and m * n * 2 <= TRANSPOSED_GEMM_BYTES and min(n, k) >= TRANSPOSED_MIN_SIDE
            and (m <= TRANSPOSED_MAX_M or k >= TRANSPOSED_LONG_K))


def _gemm_path(m: int, n: int, k: int, dtype: torch.dtype, bias) -> tuple:
    """(path, tile dtype, transposed) of the GEMM path for M rows of x of ``dtype``, an (N, K) weight and
    ``bias``: _transposed_gemm_bf16 where :func:`_transposes`, _gemm_bf16 for other BF16 x where BF16_GEMM (a bias
    None or BF16), _gemm_float32 otherwise."""
    bf16_gemm = BF16_GEMM and dtype == torch.bfloat16 and (bias is None or bias.dtype == torch.bfloat16)
    transposed = bf16_gemm and _transposes(m, n, k)
    path = _transposed_gemm_bf16 if transposed else _gemm_bf16 if bf16_gemm else _gemm_float32
    return path, torch.bfloat16 if bf16_gemm else torch.float32, transposed


# Elements past _padded_k(K) in each row of a GEMM tile: rows one cache line apart modulo 4 KiB, so that a
# decoder writing several rows at once (the int4 tiles of wqbmm_dequant: 16) does not have them alias in the L1
# (Intel Xeon, 4096 x 2048 of int4 tiles, one thread: 1.36 ms with rows of 8 KiB, 0.83 ms with 64 bytes more).
_TILE_ROW_PAD = HALF


def _tile_width(k: int) -> int:
    """Elements per row of a GEMM tile of K columns."""
    return _padded_k(k) + _TILE_ROW_PAD


# Rows of a GEMM tile that is not all of N: counted without the rows' padding (which made 4096^2 at M = 256
# three tiles of 2032, 2032 and 32 rows instead of two) and a multiple of this where the budget allows, so that
# every tile starts on a step of the int4 tile decoder (wqbmm_dequant: 16 columns).
_TILE_ROW_ALIGN = 128


def _tile_layout(n: int, k: int, tile_dtype: torch.dtype, transposed: bool) -> tuple[int, int]:
    """(rows, bytes) of the GEMM path's tile of an (N, K) weight: _gemm_tile_bytes of rows of _padded_k(K)
    elements (at least one row; a multiple of _TILE_ROW_ALIGN rows where more), each row _tile_width(K)
    elements; the bytes rounded up to 64."""
    rows = max(1, min(n, _gemm_tile_bytes(transposed) // (_padded_k(k) * tile_dtype.itemsize)))
    if _TILE_ROW_ALIGN < rows < n:
        rows -= rows % _TILE_ROW_ALIGN
    return rows, -(-rows * _tile_width(k) * tile_dtype.itemsize // 64) * 64


def gemm_scratch_nbytes(m: int, n: int, k: int, dtype: torch.dtype) -> int:
    """Bytes of the ``scratch`` that :func:`run_gemm_path` uses for M rows of x of ``dtype``, an (N, K) weight
    and no bias: the AMX kernel's x^T and task buffers where it runs (amx.scratch_bytes), else its tile, and the
    transposed GEMM's (N, M) result after it."""
    if m <= _amx_max_m(k, dtype):
        return amx.scratch_bytes(m, k, _tile_width(k))
    _, tile_dtype, transposed = _gemm_path(m, n, k, dtype, None)
    return _tile_layout(n, k, tile_dtype, transposed)[1] + (2 * n * m if transposed else 0)


def run_gemm_path(tile: tuple, operands: tuple, x: torch.Tensor, bias, out: torch.Tensor, scratch=None) -> None:
    """out (M, N) <- x (M, K) FP16 / BF16 times an (N, K) weight decoded tile by tile by ``tile`` (a pair
    (serial, parallel) for run_tasks with args (*operands, r0): rows r0 ... of the weight, as float32 values
    or BF16 bits, int16, in the tile's dtype; each decoded weight a value of x's dtype), plus ``bias`` ((N,) or
    None): lowbit's AMX kernel where it runs (_amx_max_m), else torch's GEMM (float32 sums, one rounding), NaN
    canonical. The tiles (the AMX kernel's buffers) go in the calling thread's scratch buffer, or in ``scratch``
    (uint8, at least :func:`gemm_scratch_nbytes`; bias None) where given. Operands checked by the caller; out
    C-contiguous."""
    (m, k), n = x.shape, out.shape[1]
    if m <= _amx_max_m(k, x.dtype):
        amx.run(tile[0], operands, as_numpy(x.contiguous()), n, _tile_width(k), *_bias_bits(bias), as_numpy(out),
                scratch)
        return
    path, tile_dtype, transposed = _gemm_path(m, n, k, x.dtype, bias)
    rows, _ = _tile_layout(n, k, tile_dtype, transposed)
    after = (n, m) if transposed else (0,)

    def tiles(serial):
        return _tiles(tile, operands, n, k, tile_dtype, serial, after, transposed, scratch)

    if runs_serially(n * k, GEMV_ONE_THREAD_WEIGHTS):
        path(tiles(serial=True), x, bias, out)
        return
    call_in_chunks(max(4, -(-rows // _ROWS_PER_TASK) // _CHUNKS), path, tiles(serial=False), x, bias, out)


def _tiles(tile: tuple, operands: tuple, n: int, k: int, dtype: torch.dtype, serial: bool, after: tuple,
           transposed: bool, scratch):
    """(first row, (rows, _tile_width(K)) tile, spare) of W decoded tile by tile (_tile_layout) by ``tile``
    into ``scratch`` or the calling thread's scratch buffer, viewed as ``dtype`` (float32 or BF16); columns
    K .. of a row hold zeros or are not written. Each tile is valid until the next one is yielded.
    ``spare``: a (``after``) tensor of ``dtype`` in the same buffer, after the tile, the same for every tile."""
    width = _tile_width(k)
    rows, tile_bytes = _tile_layout(n, k, dtype, transposed)
    nbytes = tile_bytes + math.prod(after) * dtype.itemsize
    with scratch_or_thread(scratch, nbytes) as raw:
        buffer = raw[:tile_bytes].view(dtype)[: rows * width].view(rows, width)
        spare = raw[tile_bytes:].view(dtype).view(after)
        for r0 in range(0, n, rows):
            part = buffer[: min(rows, n - r0)]
            run_tasks(tile, (*operands, r0), part.shape[0], as_numpy(part), serial)
            yield r0, part, spare


def _gemm_float32(tiles, x: torch.Tensor, bias, out: torch.Tensor) -> None:
    """float32 GEMM on decoded tiles (torch's order), then the reference's rounding."""
    (m, k), n = x.shape, out.shape[1]
    x32 = x.to(torch.float32)
    y32 = torch.empty(m, n, dtype=torch.float32)
    for r0, tile, _ in tiles:
        y32[:, r0 : r0 + tile.shape[0]] = x32 @ tile[:, :k].T
    out.copy_(reference.finish(y32, bias, out.dtype))


def _gemm_bf16(tiles, x: torch.Tensor, bias, out: torch.Tensor) -> None:
    """BF16 x (every decoded weight is a BF16 value): torch's BF16 GEMM (float32 accumulation, one
    rounding to BF16) on tiles decoded to BF16. A BF16 bias goes to F.linear, which adds it to the float32
    sums before that rounding (the same bits as the bias as one more column of W and of x, a column of
    ones; tests/test_weight_only.py checks this of torch), without the strided K + 1 columns (0.8 ms at
    M = 256, N = K = 4096)."""
    k, n = x.shape[1], out.shape[1]
    for r0, tile, _ in tiles:
        if tile.shape[0] == n:  # one tile: written straight into out (addmm and mm are what F.linear runs)
            if bias is None:
                torch.mm(x, tile[:, :k].t(), out=out)
            else:
                torch.addmm(bias, x, tile[:, :k].t(), out=out)
            break
        rows = slice(r0, r0 + tile.shape[0])
        out[:, rows] = torch.nn.functional.linear(x, tile[:, :k], None if bias is None else bias[rows])
    canonical_nan_bf16(as_numpy(out).reshape(-1))


def _transposed_gemm_bf16(tiles, x: torch.Tensor, bias, out: torch.Tensor) -> None:
    """_gemm_bf16 as y^T = W x^T, tile by tile into rows of the (N, M) spare buffer (torch's BF16 GEMM with
    the decoded tile as its first operand, a BF16 bias as a column added before the one rounding), then
    out <- its transpose, NaN canonical (transpose_bf16)."""
    k, n = x.shape[1], out.shape[1]
    for r0, tile, y_t in tiles:
        rows = slice(r0, r0 + tile.shape[0])
        if bias is None:
            torch.mm(tile[:, :k], x.t(), out=y_t[rows])
        else:
            torch.addmm(bias[rows, None], tile[:, :k], x.t(), out=y_t[rows])
        if rows.stop == n:
            transpose_bf16(as_numpy(y_t), as_numpy(out))


def _default_table_kind() -> str:
    if simd.HAS_AVX512VBMI:
        return "bytes"
    if simd.HAS_AVX512BW:
        return "words"
    return "bytes" if simd.BYTE_TABLES else "values"


# Arrays of each row-table kind (see code8_decode) by (kind, BF16 x), and per K % 64 the lanes of a last, short
# step (int32[64], nonzero to keep): constants the code-8 kernels take.
_ROW_TABLES_LIKE = {("bytes", True): np.zeros(256, dtype=np.uint8),
                    ("bytes", False): np.zeros((2, 128), dtype=np.uint8),
                    ("values", True): np.zeros(256, dtype=np.float32),
                    ("values", False): np.zeros(256, dtype=np.float32),
                    ("words", True): np.zeros(128, dtype=np.int16),
                    ("words", False): np.zeros(128, dtype=np.uint16)}
assert all(t.nbytes <= _ROW_TABLE_BYTES for t in _ROW_TABLES_LIKE.values())  # _row_table's stack room
_KEEP = (_CODE8_ELEMENTS[None, :] < np.arange(LANES)[:, None]).astype(np.int32)


def _code8_operands(codes, scale, magnitudes, nan_code, k, dtype, table_kind):
    """The _code8_gemv / _code8_tile operands. ``table_kind`` (see code8_decode): "bytes" (AVX512-VBMI, or
    AVX2 without AVX512-BW), "words" (AVX512-BW) or "values" (gathered); None: the fastest this CPU has."""
    bf16 = dtype == torch.bfloat16
    table_like = _ROW_TABLES_LIKE[table_kind or _default_table_kind(), bf16]
    return (as_numpy(codes), as_numpy(scale.contiguous()), bf16, magnitudes, nan_code, table_like, _KEEP[k % LANES],
            _NO_FAST_ROWS, _NO_SLOW_BLOCKS, _NOT_BY_COLUMNS)


def _hifloat8_operands(codes, scale, k, dtype, table_kind=None):
    """HiFloat8: code values and row scales both rounded to x's dtype first."""
    return _code8_operands(codes, scale.to(dtype).to(torch.float32), _HIF8_MAGNITUDES[dtype], hifloat8.NAN_CODE, k,
                           dtype, table_kind)


def _encoded_by_columns(codes, column_code, scale):
    """(encoded, fast, tables, slow_blocks) of column_code.encode_rows for ``codes`` (N, K) uint8, K a multiple
    of 64, and the rows' float32 ``scale`` (N,) numpy: the re-encoded codes in a copy (one more byte per
    weight; in 2 MiB pages, as the deploy modules keep their weights: docs/quantize.md)."""
    n, k = codes.shape
    encoded = as_numpy(huge_page_empty(codes.shape, codes.dtype))
    fast = np.empty(n, dtype=np.uint8)
    tables = np.empty((n, _columns.TABLE_BYTES), dtype=np.uint8)
    slow_blocks = np.empty((n, k // _columns.BLOCK), dtype=np.uint8)
    column_code.encode_rows(as_numpy(codes), scale, encoded, fast, tables, slow_blocks)
    return encoded, fast, tables, slow_blocks


def _by_columns_operands(operands, codes, k, dtype, column_code):
    """A code-8 weight's ``operands`` (_code8_operands) for a weight prepared once (WeightOnlyLinear.prepare):
    for BF16 x where CODE8_COLUMNS and K is a multiple of 64, its ``codes`` re-encoded by ``column_code``'s
    columns, the rows the column decode serves (fast 1; 2: but for the blocks of 32 codes holding one it
    leaves to the table, slow_blocks) and their column tables (_encoded_by_columns)."""
    if not (CODE8_COLUMNS and dtype == torch.bfloat16 and k % LANES == 0):
        return operands
    _, scale_np, bf16, magnitudes, _, table_like, keep, _, _, _ = operands
    encoded, fast, tables, slow_blocks = _encoded_by_columns(codes, column_code, scale_np)
    return (encoded, scale_np, bf16, column_code.encoded_magnitudes(magnitudes), column_code.encoded_nan, table_like,
            keep, fast, slow_blocks, tables)


def _hifloat8_prepared_operands(codes, scale, k, dtype):
    """_hifloat8_operands of a weight prepared once: _by_columns_operands."""
    return _by_columns_operands(_hifloat8_operands(codes, scale, k, dtype), codes, k, dtype, _columns.HIFLOAT8)


def _float8_operands(codes, scale, k, dtype, table_kind=None):
    """FP8 E4M3: exact code values times the FP32 row scales (0x7F / 0xFF are NaN codes)."""
    return _code8_operands(codes, scale, _E4M3_MAGNITUDES, _E4M3_NAN_CODE, k, dtype, table_kind)


def _float8_prepared_operands(codes, scale, k, dtype):
    """_float8_operands of a weight prepared once: _by_columns_operands."""
    return _by_columns_operands(_float8_operands(codes, scale, k, dtype), codes, k, dtype, _columns.FLOAT8_E4M3)


def _mxfp8_operands(codes, scales, k, dtype, table_kind=None):
    """``table_kind`` as for _code8_operands (E4M3 values are BF16 values: BF16 tables serve FP16 x too); no
    rows by columns."""
    table = {"bytes": _E4M3_BYTE_TABLES, "words": _E4M3_BF16_WORDS,
             "values": _E4M3_VALUES}[table_kind or _default_table_kind()]
    return (as_numpy(codes), as_numpy(scales), dtype == torch.bfloat16, table, _NO_FAST_ROWS, _NO_SLOW_BLOCKS,
            _NOT_BY_COLUMNS)


# MXFP8 rows by columns: E8M0 bytes whose scale 2^(b - 127) lies in the column decode's range [2^-110, 2^110]
# (within _MXFP8_EXACT_BYTES_BF16: every weight such a row holds is a normal BF16 value, the reference's exactly).
_MXFP8_COLUMN_BYTES = (17, 237)


@functools.cache
def _mxfp8_column_operands() -> tuple[np.ndarray, np.ndarray]:
    """(the E4M3 byte table of FP8's re-encoded codes, the column tables of the 256 E8M0 bytes): byte b's
    the FP8 column table of the scale 2^(b - 127) where b lies in _MXFP8_COLUMN_BYTES, zeros elsewhere (no
    fast row holds such a byte)."""
    code = _columns.FLOAT8_E4M3
    halves = _E4M3_BF16_BYTES.reshape(2, 128)  # the high bytes of codes 0..127, then their low bytes
    table = simd.byte_tables(np.concatenate([code.encoded_magnitudes(half) for half in halves]))
    low, high = _MXFP8_COLUMN_BYTES
    tables = np.zeros((256, _columns.TABLE_BYTES), dtype=np.uint8)
    tables[low : high + 1] = code.scale_tables(_E8M0_SCALES[low : high + 1])
    return table, tables


def _mxfp8_prepared_operands(codes, scales, k, dtype):
    """_mxfp8_operands of a weight prepared once: for BF16 x where CODE8_COLUMNS and K is a multiple of 64, its
    codes re-encoded by FP8 E4M3's columns (_encoded_by_columns: the codes' own values, scale 1) and decoded
    by columns, with the column table of each 32-block's byte (_mxfp8_column_operands), in the rows whose
    E8M0 bytes all lie in _MXFP8_COLUMN_BYTES: fast 1 where the columns take all of the row's codes, else 2,
    its blocks holding a code they leave out marked in slow_blocks (decoded by the table of the re-encoded
    codes, as the other rows are). docs/weight_only.md, '8-bit codes by columns'."""
    operands = _mxfp8_operands(codes, scales, k, dtype)
    if not (CODE8_COLUMNS and dtype == torch.bfloat16 and k % LANES == 0 and _default_table_kind() == "bytes"):
        return operands
    scales_np = operands[1]
    code = _columns.FLOAT8_E4M3
    encoded, fast, _, slow_blocks = _encoded_by_columns(codes, code, np.ones(codes.shape[0], dtype=np.float32))
    low, high = _MXFP8_COLUMN_BYTES
    in_range = ((scales_np >= low) & (scales_np <= high)).all(axis=1)
    fast[~in_range] = 0
    table, column_tables = _mxfp8_column_operands()
    return encoded, scales_np, True, table, fast, slow_blocks, column_tables


def _mxfp4_operands(codes, scales, k, dtype):
    return as_numpy(scales), as_numpy(codes)


def _hifloat4_operands(scale, value, k, dtype):
    words = as_numpy(scale).reshape(scale.shape[0], -1).view(np.int32)  # one little-endian word per block
    return words, as_numpy(value)


def _hifloat4_prepared_operands(scale, value, k, dtype):
    """_hifloat4_operands of a weight prepared once: on AVX2 CPUs without AVX-512 (the byte-shuffle step),
    copies of its scale words and value bytes rearranged for hifloat4_bf16_step (_hifloat4_prepared_words,
    _hifloat4_prepare_values: 0.5625 bytes more per weight; the values in huge pages), else views."""
    words, value_np = _hifloat4_operands(scale, value, k, dtype)
    if not BYTE_SHUFFLE_NIBBLES:
        return words, value_np
    prepared = as_numpy(huge_page_empty(value.shape, value.dtype))
    _hifloat4_prepare_values(value_np, prepared)
    return _hifloat4_prepared_words(words), prepared


_CODE8 = ((_code8_rows, _code8_gemv), (_code8_batched_rows, _code8_batched), (_code8_tile_rows, _code8_tile))
_CODE8_PAIRED = (_code8_rows_paired, _code8_gemv_paired)
HIFLOAT8_LINEAR = WeightOnlyLinear(*_CODE8, CODE8_SPLIT, _hifloat8_operands, pair_order=CODE8_PAIR_ORDER,
                                  prepared_operands=_hifloat8_prepared_operands, one_call_gemv=_CODE8_PAIRED)
FLOAT8_E4M3FN_LINEAR = WeightOnlyLinear(*_CODE8, CODE8_SPLIT, _float8_operands, pair_order=CODE8_PAIR_ORDER,
                                        prepared_operands=_float8_prepared_operands, one_call_gemv=_CODE8_PAIRED)
MXFP8_LINEAR = WeightOnlyLinear((_mxfp8_rows, _mxfp8_gemv), (_mxfp8_batched_rows, _mxfp8_batched),
                                (_mxfp8_tile_rows, _mxfp8_tile), CODE8_SPLIT, _mxfp8_operands,
                                prepared_operands=_mxfp8_prepared_operands)
MXFP4_LINEAR = WeightOnlyLinear((_mxfp4_rows, _mxfp4_gemv), (_mxfp4_batched_rows, _mxfp4_batched),
                                (_mxfp4_tile_rows, _mxfp4_tile), FOUR_BIT_SPLIT, _mxfp4_operands, _MXFP4_EXPONENTS,
                                PAIR_ORDER)
amx.carry_low_rank(_mxfp4_tile_rows)  # svd_quant's prefill on the tiles (WeightOnlyLinear.run_low_rank)
HIFLOAT4_LINEAR = WeightOnlyLinear((_hifloat4_rows, _hifloat4_gemv), (_hifloat4_batched_rows, _hifloat4_batched),
                                   (_hifloat4_tile_rows, _hifloat4_tile), HIFLOAT4_SPLIT, _hifloat4_operands,
                                   _HIFLOAT4_EXPONENTS, PAIR_ORDER if _HIFLOAT4_PAIRS else None,
                                   _hifloat4_prepared_operands)
