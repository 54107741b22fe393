"""The weight-only GEMV's layout: the 64 summation lanes' register orders per format, the reference's
weight tables, and the intrinsics that reorder and fold the lanes (docs/weight_only.md, 'Kernels')."""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from lowbit.formats import hifloat8, mxfp4, mxfp8
from lowbit.formats import weight_only as reference
from lowbit.kernels.cpu import _code8_columns as _columns
from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu._runtime import NJIT_OPTIONS


LANES = reference.LANES  # 64 = two F32V
HALF = simd.LANES  # 32
GEMV_MAX_M = reference.EXACT_ROWS  # rows of x up to which the bit-exact GEMV path runs
_ROWS_PER_TASK = 8  # weight rows per prange iteration
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

