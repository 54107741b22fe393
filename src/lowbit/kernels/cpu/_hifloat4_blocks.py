"""HiFloat4 fake quant of one block in vector registers (512-bit vectors: AVX512-BW, or two AVX2 registers
each, with F16C for FP16): the vector steps of
:mod:`lowbit.kernels.cpu.hifloat4` for a block of 64 BF16, FP16 or FP32 values, as numba intrinsics made per
input format (``BLOCK_MAXIMUM[name]``, ``BLOCK_FAKE_QUANT[name]``, name "bf16", "f16" or "f32"):

* ``maximum(src, at)``: (largest finite magnitude's bits as uint32, whether an element is NaN or Inf) of the
  block src[at : at + 64] (the input's bit patterns, int16 or int32; any C-contiguous array, ``at`` a flat
  index);
* ``fake_quant(src, at, dst, r, quarter_sf)``: dst[at : at + 64] <- the block's fake quant in the same format,
  given its ``r = bf16(1 / sf)`` and ``sf / 4`` (the scalar steps, computed by the caller).

Every element carries its own 4-group and 8-group maxima (two and three pairwise maxima of neighbouring
lanes: the groups are 4 and 8 consecutive elements), so the flags e2, e3 and every later step are the same
IEEE float32 operations as in the reference, in the same order (docs/hifloat4.md, 'Quantization'), on 16
lanes at a time: no per-group arrays, no scalar loop. Magnitudes are compared as bits (they order like the
values); non-finite elements count 0, and the caller overwrites a block that holds one. How each format
becomes float32 and back: BF16 words are unpacked with zero words below them (``vpunpck[lh]wd``, exact) and
packed back in the same lane order; FP16 words are converted (``vcvtph2ps``, exact) and the results
rounded to nearest even (``vcvtps2ph``, as torch casts); FP32 needs neither.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from lowbit.kernels.cpu._simd import _element_ptr, _splat

_I1, _I16, _I32 = ir.IntType(1), ir.IntType(16), ir.IntType(32)
_FLOATS = ir.VectorType(ir.FloatType(), 16)
_HALFS = ir.VectorType(ir.HalfType(), 16)


def _floats(value: float) -> ir.Constant:
    return ir.Constant(_FLOATS, [value] * 16)


def _lanes(values) -> ir.Constant:
    values = list(values)
    return ir.Constant(ir.VectorType(_I32, len(values)), values)


class _Format:
    """One input format: its bit patterns in 512-bit vectors of ``width``-bit lanes, the NaN / Inf bound of
    its magnitude bits, and how those become float32 vectors (``to_floats``) and results come back
    (``from_floats``)."""

    def __init__(self, name: str, width: int, inf_magnitude: int):
        self.name = name
        self.element = ir.IntType(width)
        self.lanes = 512 // width
        self.vector = ir.VectorType(self.element, self.lanes)
        self.vectors = 64 // self.lanes  # per block
        self.magnitude_mask = (1 << (width - 1)) - 1
        self.sign_bit = 1 << (width - 1)
        self.inf_magnitude = inf_magnitude

    def splat(self, value: int) -> ir.Constant:
        if value >= 1 << (self.element.width - 1):  # llvmlite writes the constant as a signed integer
            value -= 1 << self.element.width
        return ir.Constant(self.vector, [value] * self.lanes)

    def to_floats(self, builder, bits) -> list:
        """Non-negative magnitude bits as float32 vectors of 16 lanes (in the lane order from_floats undoes)."""
        if self.name == "f32":
            return [builder.bitcast(bits, _FLOATS)]
        if self.name == "bf16":  # lanes 0-3 / 4-7 of each 128-bit lane, each word the high half of a dword
            zero = ir.Constant(self.vector, [0] * 32)
            return [builder.bitcast(builder.shuffle_vector(zero, bits, _lanes(
                i for lane in range(4) for j in range(4 * high, 4 * high + 4) for i in (j, 32 + 8 * lane + j))),
                _FLOATS) for high in (0, 1)]
        return [builder.fpext(builder.bitcast(builder.shuffle_vector(bits, bits, _lanes(range(16 * h, 16 * h + 16))),
                                              _HALFS), _FLOATS) for h in (0, 1)]

    def from_floats(self, builder, results):
        """The format's bit patterns of exact non-negative float32 results (to_floats' lane order undone)."""
        if self.name == "f32":
            return builder.bitcast(results[0], self.vector)
        if self.name == "bf16":  # the high words of the dwords, in the lanes to_floats took them from
            low, high = (builder.bitcast(v, self.vector) for v in results)
            return builder.shuffle_vector(low, high, _lanes(
                32 * h + 8 * lane + 2 * j + 1 for lane in range(4) for h in (0, 1) for j in range(4)))
        low, high = (builder.bitcast(builder.fptrunc(v, _HALFS), ir.VectorType(_I16, 16)) for v in results)
        return builder.shuffle_vector(low, high, _lanes(range(32)))

    def pointers(self, context, builder, arrty, arr, at) -> list:
        """Pointers to the block's vectors at flat index ``at``."""
        first = _element_ptr(context, builder, arrty, arr, at, self.vector)
        return [first] + [builder.gep(first, [ir.Constant(_I32, v)]) for v in range(1, self.vectors)]

    def finite_magnitudes(self, builder, bits):
        """(magnitude bits with NaN / Inf as 0, the lanes that are NaN or Inf)."""
        magnitude = builder.and_(bits, self.splat(self.magnitude_mask))
        nonfinite = builder.icmp_unsigned(">=", magnitude, self.splat(self.inf_magnitude))
        return builder.select(nonfinite, self.splat(0), magnitude), nonfinite


def _umax(builder, a, b):
    return builder.select(builder.icmp_unsigned(">", a, b), a, b)


def _neighbour_max(builder, values, distance):
    """Per lane i: the larger of lanes i and i ^ distance."""
    lanes = values.type.count
    partner = builder.shuffle_vector(values, values, _lanes(i ^ distance for i in range(lanes)))
    return _umax(builder, values, partner)


def _make_maximum(fmt: _Format):
    @intrinsic
    def maximum(typingctx, src, at):
        def codegen(context, builder, sig, args):
            largest = any_nonfinite = None
            for pointer in fmt.pointers(context, builder, sig.args[0], args[0], args[1]):
                finite, nonfinite = fmt.finite_magnitudes(builder, builder.load(pointer, align=1))
                largest = finite if largest is None else _umax(builder, largest, finite)
                any_nonfinite = nonfinite if any_nonfinite is None else builder.or_(any_nonfinite, nonfinite)
            reduce_max = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(fmt.element, [fmt.vector]),
                f"llvm.vector.reduce.umax.v{fmt.lanes}i{fmt.element.width}")
            reduce_or = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I1, [any_nonfinite.type]),
                                                       f"llvm.vector.reduce.or.v{fmt.lanes}i1")
            largest = builder.call(reduce_max, [largest])
            largest = builder.zext(largest, _I32) if fmt.element.width < 32 else largest
            return context.make_tuple(builder, sig.return_type, [largest, builder.call(reduce_or, [any_nonfinite])])

        return types.Tuple((types.uint32, types.boolean))(src, at), codegen

    maximum.__doc__ = f"(uint32 bits of the largest finite magnitude, bool: an element is NaN or Inf) of the {fmt.name} block."
    return maximum


def _quantized(builder, a, m4, m8, r, quarter_sf):
    """The float32 results of 16 elements (exact values of the format, without their signs): magnitudes
    ``a``, their 4- and 8-group maxima ``m4`` / ``m8`` (float32), the block's r and sf / 4 (splats). The
    reference's float32 operations in its order (the flags, w, its code, the product)."""
    floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_FLOATS, [_FLOATS]), "llvm.floor.v16f32")
    e2 = builder.fcmp_ordered(">=", builder.fmul(m8, r), _floats(4.0))
    e3 = builder.fcmp_ordered(">=", builder.fmul(m4, r), builder.select(e2, _floats(4.0), _floats(2.0)))
    down = builder.fmul(builder.select(e2, _floats(0.5), _floats(1.0)), builder.select(e3, _floats(0.5), _floats(1.0)))
    up = builder.fmul(builder.fmul(quarter_sf, builder.select(e2, _floats(2.0), _floats(1.0))),
                      builder.select(e3, _floats(2.0), _floats(1.0)))
    w = builder.fmul(builder.fmul(a, r), down)
    w = builder.select(builder.fcmp_ordered("<", w, _floats(1.75)), w, _floats(1.75))  # code 7 at most
    dwords = ir.VectorType(_I32, 16)
    exponent = builder.and_(builder.bitcast(w, dwords), ir.Constant(dwords, [0x7F800000] * 16))
    magic = builder.fmul(builder.bitcast(exponent, _FLOATS), _floats(1.5 * 2.0**16))  # rounds w to BF16
    v = builder.fsub(builder.fadd(w, magic), magic)
    code = builder.call(floor, [builder.fadd(builder.fmul(_floats(4.0), v), _floats(0.5))])
    return builder.fmul(code, up)


def _make_fake_quant(fmt: _Format):
    @intrinsic
    def fake_quant(typingctx, src, at, dst, r, quarter_sf):
        def codegen(context, builder, sig, args):
            r = _splat(builder, args[3], _FLOATS)
            quarter_sf = _splat(builder, args[4], _FLOATS)
            sources = fmt.pointers(context, builder, sig.args[0], args[0], args[1])
            targets = fmt.pointers(context, builder, sig.args[2], args[2], args[1])
            for source, target in zip(sources, targets):
                bits = builder.load(source, align=1)
                finite, _ = fmt.finite_magnitudes(builder, bits)
                m4 = _neighbour_max(builder, _neighbour_max(builder, finite, 1), 2)
                m8 = _neighbour_max(builder, m4, 4)
                negative = builder.and_(builder.icmp_signed("<", bits, fmt.splat(0)),
                                        builder.icmp_unsigned("!=", finite, fmt.splat(0)))
                results = [_quantized(builder, a, f4, f8, r, quarter_sf) for a, f4, f8 in
                           zip(*(fmt.to_floats(builder, v) for v in (finite, m4, m8)))]
                signs = builder.select(negative, fmt.splat(fmt.sign_bit), fmt.splat(0))
                builder.store(builder.or_(fmt.from_floats(builder, results), signs), target, align=1)
            return context.get_dummy_value()

        return types.none(src, at, dst, r, quarter_sf), codegen

    fake_quant.__doc__ = f"dst[at : at + 64] <- the fake quant of the {fmt.name} block src[at : at + 64] (no NaN or Inf)."
    return fake_quant


_FORMATS = [_Format("bf16", 16, 0x7F80), _Format("f16", 16, 0x7C00), _Format("f32", 32, 0x7F800000)]
BLOCK_MAXIMUM = {fmt.name: _make_maximum(fmt) for fmt in _FORMATS}
BLOCK_FAKE_QUANT = {fmt.name: _make_fake_quant(fmt) for fmt in _FORMATS}
