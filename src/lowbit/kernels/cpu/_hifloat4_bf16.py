"""HiFloat4 fake quant of BF16 blocks in AVX-512 registers (AVX512-BW): the vector steps of
:mod:`lowbit.kernels.cpu.hifloat4` for one block of 64 BF16 values, as two numba intrinsics.

* ``bf16_block_maximum(src, at)``: (largest finite magnitude's bits, whether an element is NaN or Inf) of
  the block src[at : at + 64] (int16 BF16 patterns; any C-contiguous array, ``at`` a flat index);
* ``bf16_block_fake_quant(src, at, dst, r, quarter_sf)``: dst[at : at + 64] <- the block's fake quant, given
  its ``r = bf16(1 / sf)`` and ``sf / 4`` (the scalar steps, computed by the caller).

Every element carries its own 4-group and 8-group maxima (two and three pairwise maxima of neighbouring
words: the groups are 4 and 8 consecutive elements), so the flags e2, e3 and every later step are the same
IEEE float32 operations as in the reference, in the same order (docs/hifloat4.md, 'Quantization'), on 16
lanes at a time: no per-group arrays, no scalar loop. Magnitudes are compared as bits (they order like the
values); non-finite elements count 0, and the caller overwrites a block that holds one.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from lowbit.kernels.cpu._simd import _element_ptr, _splat

_I1, _I16, _I32 = ir.IntType(1), ir.IntType(16), ir.IntType(32)
_WORDS = ir.VectorType(_I16, 32)  # one half of a block
_LANES16 = ir.VectorType(_I32, 16)
_FLOATS = ir.VectorType(ir.FloatType(), 16)


def _words(value: int) -> ir.Constant:
    return ir.Constant(_WORDS, [value] * 32)


def _floats(value: float) -> ir.Constant:
    return ir.Constant(_FLOATS, [value] * 16)


def _halves(context, builder, arrty, arr, at):
    """Pointers to the two 32-word halves of the block at flat index ``at``."""
    first = _element_ptr(context, builder, arrty, arr, at, _WORDS)
    return first, builder.gep(first, [ir.Constant(_I32, 1)])


def _finite_magnitudes(builder, bits):
    """(magnitude bits with NaN / Inf as 0, the lanes that are NaN or Inf) of 32 BF16 patterns."""
    magnitude = builder.and_(bits, _words(0x7FFF))
    nonfinite = builder.icmp_unsigned(">=", magnitude, _words(0x7F80))
    return builder.select(nonfinite, _words(0), magnitude), nonfinite


def _umax(builder, a, b):
    return builder.select(builder.icmp_unsigned(">", a, b), a, b)


def _neighbour_max(builder, values, distance):
    """Per lane i: the larger of lanes i and i ^ distance."""
    partner = builder.shuffle_vector(values, values, ir.Constant(ir.VectorType(_I32, 32),
                                                                 [i ^ distance for i in range(32)]))
    return _umax(builder, values, partner)


@intrinsic
def bf16_block_maximum(typingctx, src, at):
    """(uint32 bits of the largest finite magnitude, bool: an element is NaN or Inf) of src[at : at + 64]."""

    def codegen(context, builder, sig, args):
        largest = None
        any_nonfinite = None
        for pointer in _halves(context, builder, sig.args[0], args[0], args[1]):
            finite, nonfinite = _finite_magnitudes(builder, builder.load(pointer, align=1))
            largest = finite if largest is None else _umax(builder, largest, finite)
            any_nonfinite = nonfinite if any_nonfinite is None else builder.or_(any_nonfinite, nonfinite)
        reduce_max = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I16, [_WORDS]),
                                                    "llvm.vector.reduce.umax.v32i16")
        reduce_or = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I1, [any_nonfinite.type]),
                                                   "llvm.vector.reduce.or.v32i1")
        maximum = builder.zext(builder.call(reduce_max, [largest]), _I32)
        return context.make_tuple(builder, sig.return_type, [maximum, builder.call(reduce_or, [any_nonfinite])])

    return types.Tuple((types.uint32, types.boolean))(src, at), codegen


def _unpacked(builder, words, high):
    """The words of lanes 4-7 (``high``) or 0-3 of each 128-bit lane of 32 BF16 magnitude bits as float32 values
    (each in the high half of a dword: vpunpck[hl]wd with zero; the caller packs the results back the same
    way)."""
    zero = ir.Constant(_WORDS, [0] * 32)
    mask = [i for lane in range(4) for j in range(4 * high, 4 * high + 4) for i in (j, 32 + 8 * lane + j)]
    return builder.bitcast(builder.shuffle_vector(zero, words, ir.Constant(ir.VectorType(_I32, 32), mask)), _FLOATS)


def _packed(builder, low, high):
    """The high halves of the dwords of two float32 vectors made by _unpacked(..., False) and (..., True), as 32
    words in the lanes the unpacking took them from."""
    low, high = (builder.bitcast(v, _WORDS) for v in (low, high))
    mask = [32 * h + 8 * lane + 2 * j + 1 for lane in range(4) for h in (0, 1) for j in range(4)]
    return builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(_I32, 32), mask))


def _quantized(builder, a, m4, m8, r, quarter_sf):
    """The float32 results of 16 elements (exact BF16 values, without their signs): magnitudes ``a``, their 4-
    and 8-group maxima ``m4`` / ``m8`` (float32), the block's r and sf / 4 (splats). The reference's float32
    operations in its order (the flags, w, its code, the product)."""
    floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_FLOATS, [_FLOATS]), "llvm.floor.v16f32")
    e2 = builder.fcmp_ordered(">=", builder.fmul(m8, r), _floats(4.0))
    e3 = builder.fcmp_ordered(">=", builder.fmul(m4, r), builder.select(e2, _floats(4.0), _floats(2.0)))
    down = builder.fmul(builder.select(e2, _floats(0.5), _floats(1.0)), builder.select(e3, _floats(0.5), _floats(1.0)))
    up = builder.fmul(builder.fmul(quarter_sf, builder.select(e2, _floats(2.0), _floats(1.0))),
                      builder.select(e3, _floats(2.0), _floats(1.0)))
    w = builder.fmul(builder.fmul(a, r), down)
    w = builder.select(builder.fcmp_ordered("<", w, _floats(1.75)), w, _floats(1.75))  # code 7 at most
    exponent = builder.and_(builder.bitcast(w, _LANES16), ir.Constant(_LANES16, [0x7F800000] * 16))
    magic = builder.fmul(builder.bitcast(exponent, _FLOATS), _floats(1.5 * 2.0**16))  # rounds w to BF16
    v = builder.fsub(builder.fadd(w, magic), magic)
    code = builder.call(floor, [builder.fadd(builder.fmul(_floats(4.0), v), _floats(0.5))])
    return builder.fmul(code, up)


@intrinsic
def bf16_block_fake_quant(typingctx, src, at, dst, r, quarter_sf):
    """dst[at : at + 64] <- the fake quant of the block src[at : at + 64] (int16 BF16 patterns, no NaN or Inf)
    with the block's float32 ``r`` = bf16(1 / sf) and ``quarter_sf`` = sf / 4."""

    def codegen(context, builder, sig, args):
        r = _splat(builder, args[3], _FLOATS)
        quarter_sf = _splat(builder, args[4], _FLOATS)
        sources = _halves(context, builder, sig.args[0], args[0], args[1])
        targets = _halves(context, builder, sig.args[2], args[2], args[1])
        for source, target in zip(sources, targets):
            bits = builder.load(source, align=1)
            finite, _ = _finite_magnitudes(builder, bits)
            m4 = _neighbour_max(builder, _neighbour_max(builder, finite, 1), 2)
            m8 = _neighbour_max(builder, m4, 4)
            negative = builder.and_(builder.icmp_signed("<", bits, _words(0)),
                                    builder.icmp_unsigned("!=", finite, _words(0)))
            results = [_quantized(builder, *(_unpacked(builder, v, high) for v in (finite, m4, m8)), r, quarter_sf)
                       for high in (False, True)]
            words = builder.or_(_packed(builder, *results), builder.select(negative, _words(0x8000), _words(0)))
            builder.store(words, target, align=1)
        return context.get_dummy_value()

    return types.none(src, at, dst, r, quarter_sf), codegen
