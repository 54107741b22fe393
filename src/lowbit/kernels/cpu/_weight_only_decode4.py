"""Decoding 4-bit weights (MXFP4, HiFloat4) in registers: the block tables, the look-up intrinsics of each
CPU kind, and the BF16 pairs of two steps (docs/weight_only.md, 'Weights', 'Kernels')."""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu._runtime import NJIT_OPTIONS
from lowbit.kernels.cpu._weight_only_layout import (HALF, LANES, NIBBLE_ORDER, _HIFLOAT4_TABLES, _I32, _INLINE,
                                                    _MXFP4_TABLES, _V16x32, _V32x16, _mask)


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


# ---- HiFloat4 multipliers from two tables, 16 lanes at a time ----------------------------------------------
# Lanes 0-15 of NIBBLE_ORDER (value bytes 0-15) take their e3 flags from byte 2 of the scale word and their
# e2 flags from the high nibble of byte 1; lanes 16-31 from byte 3 and the low nibble of byte 1, in the same
# pattern (lane j of a half: e3 bit 7 - j // 2 of its byte, e2 bit 3 - j // 4 of its nibble). So one table of
# 2^e3 per e3 byte (16 KiB) and one of 2^e2 per e2 nibble (1 KiB) serve both halves; their product is each
# lane's 2^(e2 + e3), exact.
def _half_multipliers(bits: int, group: int) -> np.ndarray:
    """(2^bits * 16,) float32: row v holds, for lane j of a half, 2 if bit bits - 1 - j // group of v is set."""
    key, lane = np.arange(1 << bits)[:, None], np.arange(HALF // 2)[None, :]
    return np.where((key >> (bits - 1 - lane // group)) & 1, 2.0, 1.0).astype(np.float32).reshape(-1)


_E3_HALF_MULTIPLIERS = _half_multipliers(8, 2)
_E2_HALF_MULTIPLIERS = _half_multipliers(4, 4)
_e3_multiplier_halves = simd.aligned_table_halves("lowbit.hifloat4.e3_multipliers", _E3_HALF_MULTIPLIERS)
_e2_multiplier_halves = simd.aligned_table_halves("lowbit.hifloat4.e2_multipliers", _E2_HALF_MULTIPLIERS)


@numba.njit(**_INLINE)
def _hifloat4_levels_by_halves(w0, w1, word):
    """_hifloat4_levels by multiplying with each lane's 2^(e2 + e3) from the two tables above (exact; a test
    compares them for every flag byte)."""
    e3 = _e3_multiplier_halves(16 * np.int64((word >> 16) & 0xFF), 16 * np.int64(word >> 24))
    e2 = _e2_multiplier_halves(np.int64((word >> 8) & 0xF0), 16 * np.int64((word >> 8) & 0xF))
    levels = simd.f32v_mul(e3, e2)
    return simd.f32v_mul(w0, levels), simd.f32v_mul(w1, levels)


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


# ---- HiFloat4 by magnitude index: a prepared weight's pairs at MXFP4's cost (hifloat4_indexed_pairs) -----
# A HiFloat4 weight's magnitude c * 2^(e2 + e3) (c in 0..7, e2 + e3 in 0..2) takes exactly 16 values,
# INDEXED_MAGNITUDES. A weight prepared once for the BF16 pairs (_hifloat4_indexed_operands) stores per
# element the index of its magnitude in a nibble (codes, in the value bytes' places) and its sign in a bit
# plane ordered as the pair step's registers (signs); the E6M2 byte stays in the scale word. Row b of
# _HIFLOAT4_INDEXED_WORDS holds, at index m, the BF16 bits of INDEXED_MAGNITUDES[m] / 4 times E6M2 byte b's
# scale (the same values as _HIFLOAT4_MAGNITUDES, NaN for the poisoned byte), so a pair step of two blocks
# looks every weight up in one 32-word table (vpermw, bit 4: the second block) and adds the sign bit under a
# mask loaded from the bit plane: no flags, no 64-word look-ups (docs/weight_only.md, 'Prepared HiFloat4
# pairs').
INDEXED_MAGNITUDES = np.array(sorted({c << level for c in range(8) for level in range(3)}), dtype=np.int64)
assert len(INDEXED_MAGNITUDES) == 16
_MAGNITUDE_INDEX = np.zeros(29, dtype=np.uint8)  # c << (e2 + e3) -> its index in INDEXED_MAGNITUDES
_MAGNITUDE_INDEX[INDEXED_MAGNITUDES] = np.arange(16)


def _indexed_words() -> np.ndarray:
    """(256 * 16,) int16: _HIFLOAT4_INDEXED_WORDS, taken from _HIFLOAT4_MAGNITUDES (index c | e2 << 3 | e3 << 4)
    at the smallest level of each magnitude."""
    at = []
    for magnitude in INDEXED_MAGNITUDES:
        level = int(magnitude > 7) + int(magnitude > 14)  # 8-14: c = 4..7 doubled; 16-28: quadrupled
        at.append(int(magnitude >> level) | ((0, 1, 3)[level] << 3))  # flags: none, e2, e2 and e3
    return _HIFLOAT4_MAGNITUDES.reshape(256, HALF)[:, at].reshape(-1).copy()


_HIFLOAT4_INDEXED_WORDS = _indexed_words()
_INDEXED_SIGN_WORDS = 4  # uint32 sign masks per pair step: (low nibbles, high nibbles) x (value bytes half)


def _sign_elements() -> np.ndarray:
    """(4, 32) int64: for sign mask i of a pair step (nibble i // 2, value bytes half i % 2) and bit w, the
    element of the pair's 128 (64 * block + element in the block) whose sign that bit holds: the weight of word
    w of the pair step's register (_pair_words' bytes: odd words the first block's, even words the second's;
    the nibble's element)."""
    table = np.empty((_INDEXED_SIGN_WORDS, HALF), dtype=np.int64)
    for i in range(_INDEXED_SIGN_WORDS):
        nibble, byte_half = divmod(i, 2)
        for w in range(HALF):
            table[i, w] = (0 if w % 2 else 64) + 2 * (16 * byte_half + w // 2) + nibble
    return table


_SIGN_ELEMENTS = _sign_elements()


def _hifloat4_indexed_operands(words: np.ndarray, value: np.ndarray, codes: np.ndarray, signs: np.ndarray) -> None:
    """codes, signs <- the operands of hifloat4_indexed_pairs of a HiFloat4 weight: ``words`` (N, B) int32 scale
    words and ``value`` (N, 32 B) uint8 value bytes (B even) -> ``codes`` (N, 32 B) uint8 (element 2 j's
    magnitude index in the low nibble of byte j of its block, 2 j + 1's in the high one) and ``signs``
    (N, 2 B) uint32 (per pair of blocks _INDEXED_SIGN_WORDS masks, bit w of mask i the sign of
    _SIGN_ELEMENTS[i, w]). ValueError if the shapes do not match or B is odd."""
    n, blocks = words.shape
    if blocks % 2 or value.shape != (n, 32 * blocks) or codes.shape != value.shape or signs.shape != (n, 2 * blocks):
        raise ValueError(f"_hifloat4_indexed_operands: words {words.shape}, value {value.shape}, codes {codes.shape} "
                         f"and signs {signs.shape} do not make pairs of blocks")
    _fill_indexed(words, value, codes, signs, _SIGN_ELEMENTS, _MAGNITUDE_INDEX)


@numba.njit(**NJIT_OPTIONS)
def _fill_indexed(words, value, codes, signs, sign_elements, magnitude_index):
    """_hifloat4_indexed_operands' loops (18 ms for 4096 x 4096 on one thread of an Intel Xeon, where numpy's
    vectorized form took 100-190 ms)."""
    n, blocks = words.shape
    for r in range(n):
        for b in range(blocks):
            word = np.uint32(words[r, b])
            for g in range(16):  # 4-group g: e2 of 8-group g // 2 at bit 15 - g // 2, e3 at bit 23 - g or 39 - g
                e3_at = 23 - g if g < 8 else 39 - g
                level = ((word >> np.uint32(15 - g // 2)) & 1) + ((word >> np.uint32(e3_at)) & 1)
                for j in range(2):  # its two value bytes
                    at = 32 * b + 2 * g + j
                    byte = value[r, at]
                    codes[r, at] = (magnitude_index[(byte & 7) << level]
                                    | magnitude_index[((byte >> 4) & 7) << level] << 4)
        for p in range(blocks // 2):
            for i in range(sign_elements.shape[0]):
                mask = np.uint32(0)
                for w in range(sign_elements.shape[1]):
                    e = sign_elements[i, w]
                    byte = value[r, 64 * p + e // 2]
                    mask |= np.uint32((byte >> (4 * (e % 2) + 3)) & 1) << np.uint32(w)
                signs[r, sign_elements.shape[0] * p + i] = mask


def _add_under_mask(builder, a, b, mask):
    """<32 x i16>: a + b in the words whose bit of ``mask`` (<32 x i1>) is set, else a: one masked vpaddw
    (inline assembly: LLVM makes the select an addition and a masked move, two instructions)."""
    v1x32 = ir.VectorType(ir.IntType(1), HALF)
    return builder.asm(ir.FunctionType(_V16x32, [_V16x32, _V16x32, v1x32]), "vpaddw $2, $1, $0 {$3}", "=v,0,v,^Yk",
                       [a, b, mask], False)


@intrinsic
def hifloat4_indexed_pairs(typingctx, codes, start, signs, words, block):
    """The BF16 pairs of the prepared HiFloat4 blocks ``block`` and ``block + 1`` (flat, ``block`` even): scale
    words at ``words[block]`` (1-D int32 or uint32: the E6M2 byte is the low byte), 64 magnitude-index bytes at
    ``codes[start]`` (1-D uint8) and the pair's _INDEXED_SIGN_WORDS sign masks at ``signs[2 * block]`` (1-D
    uint32), from _hifloat4_indexed_operands. Two I32V (low nibbles, high nibbles; PAIR_ORDER), bit for bit
    hifloat4_pairs' of the packed weight. AVX512-VBMI (one vpermb and one vpermw per 32 words)."""

    def codegen(context, builder, sig, args):
        vperm = simd.vpermw(builder)
        i16, i32, i64 = ir.IntType(16), ir.IntType(32), ir.IntType(64)
        v8x64, v1x32 = ir.VectorType(ir.IntType(8), LANES), ir.VectorType(ir.IntType(1), HALF)
        raw = builder.load(simd._element_ptr(context, builder, sig.args[0], args[0], args[1], v8x64), align=1)
        table = builder.bitcast(simd.aligned_constant(builder, "lowbit.hifloat4.indexed", _HIFLOAT4_INDEXED_WORDS),
                                i16.as_pointer())
        v16x16 = ir.VectorType(i16, 16)

        def block_row(i):  # the 16 words of block + i's E6M2 byte: 32 bytes at a multiple of 32
            at = builder.add(args[4], ir.Constant(args[4].type, i))
            word = builder.load(simd._element_ptr(context, builder, sig.args[3], args[3], at, i32))
            row = builder.mul(builder.zext(builder.trunc(word, ir.IntType(8)), i64), ir.Constant(i64, 16))
            return builder.load(builder.bitcast(builder.gep(table, [row]), v16x16.as_pointer()), align=32)

        pair_table = builder.shuffle_vector(block_row(0), block_row(1), _mask(range(HALF)))
        sign_at = builder.mul(args[4], ir.Constant(args[4].type, 2))
        block_bits = ir.Constant(_V16x32, [b // 2 for b in _SECOND_STEP])  # bit 4: the second block
        sign_bit = ir.Constant(_V16x32, [-32768] * HALF)
        registers = [[], []]
        for byte_half in (0, 1):
            words = _pair_words(builder, raw, byte_half)
            high = builder.lshr(words, ir.Constant(_V16x32, [4] * HALF))
            for nibble, (register, nibbles) in enumerate(zip(registers, (words, high))):
                index = builder.or_(builder.and_(nibbles, ir.Constant(_V16x32, [15] * HALF)), block_bits)
                magnitude = builder.call(vperm, [pair_table, index])
                at = builder.add(sign_at, ir.Constant(sign_at.type, 2 * nibble + byte_half))
                mask = builder.bitcast(builder.load(simd._element_ptr(context, builder, sig.args[2], args[2], at, i32)),
                                       v1x32)
                register.append(_add_under_mask(builder, magnitude, sign_bit, mask))
        return context.make_tuple(builder, sig.return_type, _pair_registers(builder, registers))

    return types.UniTuple(simd.I32V, 2)(codes, start, signs, words, block), codegen
