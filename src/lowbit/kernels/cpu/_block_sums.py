"""svd_quant's integer products on AVX2 CPUs without AVX-512 (lowbit.kernels.cpu.svd_quant), a block at a time.

One step covers 256 elements of a weight row: 128 code bytes, 8 blocks of 32 elements. Where the VNNI step
converts 32 int32 lanes of 8 products each to float32 and scales each lane by its block's power of two,
this one sums each block exactly in integers first, so only 8 lanes are converted, scaled and added: about
half the vector instructions of a step (docs/svd_quant.md, 'Weight handling on the CPU').

Per 32 code bytes (two blocks): the weight bytes ``2 cw + 12`` (0..24) are looked up by vpshufb from the
nibbles, vpmaddubsw multiplies them by the activation bytes ``2 cx`` (-12..12) and adds pairs (at most
2 * 288 in magnitude, so nothing saturates), and the even and odd elements' int16 sums are added (4
elements each). Three vphaddw fold four registers into one of 16-element sums (at most 16 * 288 = 4608:
exact in int16), vpmaddwd by ones gives each block's sum as an int32, in the block order 0 2 4 6 1 3 5 7 that
the in-lane folds leave, which one permutation puts back in order. Each block's ``start`` (``-12 * sum(2
cx)`` over its elements) removes the weight's offset: the result is ``sum (2 cw)(2 cx)``, at most 32 * 144
in magnitude, exact in float32.

For NARROW == 8 (F32N is one ymm register): numba compiling for AVX2 without AVX-512.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils
from numba.extending import intrinsic

from lowbit.kernels.cpu import _simd as simd

BLOCKS = 8  # blocks of 32 elements per step: one F32N
_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_V32B, _V16W, _V8D = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)
_V8F = ir.VectorType(ir.FloatType(), BLOCKS)
_NATURAL_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # lane of block b after the folds: blocks 0 2 4 6 1 3 5 7


def _avx2(builder, name: str, result, *operands):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(result, [o.type for o in operands]),
                                        f"llvm.x86.avx2.{name}")
    return builder.call(fn, list(operands))


def _pieces(builder, vector, element_type):
    """An I32V's 128 bytes (or a <128 x i8>) as four 32-byte registers of ``element_type`` vectors."""
    count = 256 // element_type.width
    return [builder.bitcast(piece, ir.VectorType(element_type, count))
            for piece in simd._pieces_of(builder, vector, _I8, 32)]


def block_sums_ir(builder, table, packed, low, high, start):
    """<8 x i32>: ``start`` plus, per block b, the sum over its 32 elements of the weight byte looked up in
    ``table`` (its first 32 bytes: the 16-entry table in both 128-bit lanes) by the element's nibble of
    ``packed`` (I32V: 128 code bytes, the low nibble the even element) times the activation byte (``low``: the
    even elements', ``high``: the odd ones', <32 x i32> each, byte i of block b at 16 b + i)."""
    nibble = ir.Constant(_V32B, [0x0F] * 32)
    four = ir.Constant(_V16W, [4] * 16)
    table32 = _pieces(builder, table, _I8)[0]
    sums = []
    for codes, x_even, x_odd in zip(*(_pieces(builder, v, _I8) for v in (packed, low, high))):
        even = simd.vpshufb(builder, table32, builder.and_(codes, nibble))
        odd_index = builder.and_(builder.bitcast(builder.lshr(builder.bitcast(codes, _V16W), four), _V32B), nibble)
        odd = simd.vpshufb(builder, table32, odd_index)
        sums.append(builder.add(_avx2(builder, "pmadd.ub.sw", _V16W, even, x_even),
                                _avx2(builder, "pmadd.ub.sw", _V16W, odd, x_odd)))
    folded = _avx2(builder, "phadd.w", _V16W, _avx2(builder, "phadd.w", _V16W, sums[0], sums[1]),
                   _avx2(builder, "phadd.w", _V16W, sums[2], sums[3]))
    blocks = _avx2(builder, "pmadd.wd", _V8D, folded, ir.Constant(_V16W, [1] * 16))
    return builder.add(builder.shuffle_vector(blocks, blocks, ir.Constant(_V8D, _NATURAL_ORDER)), start)


def _load(context, builder, arrty, arr, index, vector_type):
    return builder.load(simd._element_ptr(context, builder, arrty, arr, index, vector_type), align=1)


@intrinsic
def block_sums(typingctx, table, packed, low, high, x0, start, b0):
    """F32N: the 8 blocks' exact sums ``start[b0 + b] + sum (2 cw + 12)(2 cx)`` (see block_sums_ir) as float32,
    for the code bytes ``packed`` (I32V) looked up in ``table`` (I32V), the activation bytes at ``low[x0]`` and
    ``high[x0]`` (int8, 128 each) and ``start`` (int32); 1-D C-contiguous arrays, no bounds check."""

    def codegen(context, builder, sig, args):
        table_, packed_, low_, high_, x0_, start_, b0_ = args
        x_even, x_odd = (_load(context, builder, sig.args[i], arr, x0_, simd._VI32)
                         for i, arr in ((2, low_), (3, high_)))
        offsets = _load(context, builder, sig.args[5], start_, b0_, _V8D)
        return builder.sitofp(block_sums_ir(builder, table_, packed_, x_even, x_odd, offsets), _V8F)

    return simd.F32N(table, packed, low, high, x0, start, b0), codegen


def _powers_ir(context, builder, sig, args, scale_bytes):
    """<8 x float>: 2 ** (scale byte + field[b0 + b] - 127) per block (sums in 0..254; 0 gives +0.0)."""
    fields = _load(context, builder, sig.args[-2], args[-2], args[-1], _V8D)
    exponent = builder.add(builder.zext(scale_bytes, _V8D), fields)
    return builder.bitcast(builder.shl(exponent, ir.Constant(_V8D, [23] * BLOCKS)), _V8F)


@intrinsic
def block_powers(typingctx, scale_codes, s0, field, b0):
    """F32N: per block b, the float32 2 ** (``scale_codes[s0 + b]`` + ``field[b0 + b]`` - 127), the field sum
    in 0..254, 0 giving +0.0 (a zero block of x and a weight scale byte of 0, or past K) (uint8 and int32 1-D
    C-contiguous arrays)."""

    def codegen(context, builder, sig, args):
        scale_bytes = _load(context, builder, sig.args[0], args[0], args[1], ir.VectorType(_I8, BLOCKS))
        return _powers_ir(context, builder, sig, args, scale_bytes)

    return simd.F32N(scale_codes, s0, field, b0), codegen


@intrinsic
def block_powers_first(typingctx, scale_codes, s0, count, field, b0):
    """:func:`block_powers` with only the first ``count`` scale bytes read (0 <= count <= 8; the others 0)."""

    def codegen(context, builder, sig, args):
        scale_bytes = simd._first_bytes(context, builder, sig.args[0], args[0], args[1], BLOCKS, args[2])
        return _powers_ir(context, builder, sig, args, scale_bytes)

    return simd.F32N(scale_codes, s0, count, field, b0), codegen
