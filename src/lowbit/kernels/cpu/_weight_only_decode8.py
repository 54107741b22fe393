"""Decoding 8-bit weight codes (HiFloat8, FP8 E4M3, MXFP8) in registers: the row tables, the look-up
intrinsics of each table kind, and the BF16 pairs of the codes (docs/weight_only.md, 'Weights', 'Kernels')."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from lowbit.formats import hifloat8
from lowbit.kernels.cpu import _code8_columns as _columns
from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu._runtime import NJIT_OPTIONS
from lowbit.kernels.cpu._weight_only_layout import (CODE8_HALVES, CODE8_ORDER, HALF, LANES, _E4M3_MAGNITUDES,
                                                    _E4M3_NAN_CODE, _I32, _V16x32, _V8x64, _halves, _make_fold, _mask)


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
    table a row: T's low, then high bytes; _code8_columns.fill_column_table), with ``addends`` =
    _code8_columns.ADDENDS: per code, T[j] and the addend of its high nibble (one vpshufb each for the low and
    the high bytes; zero's slot looked up as 0), paired into words and added, widened in CODE8_ORDER. AVX2;
    codes whose weights the table gives only (rows of _code8_columns.encode_rows's ``fast``)."""

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


