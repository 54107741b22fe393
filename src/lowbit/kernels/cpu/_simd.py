"""LANES-wide SIMD values for numba kernels: the register tiles of the int4 matmul and weight-only kernels.

numba has no vector types, and LLVM does not reliably keep array-held accumulators in registers or find
VNNI dot products on its own. This module adds two value types, each lowered to one LLVM vector (so they
live in registers; LANES = 32: two AVX-512 registers each on x86):

    I32V   <LANES x i32>    integer accumulators / 4 * LANES bytes of packed weights
    F32V   <LANES x float>  float32 post-processing
    I16V   <LANES x i16>    small exact integer sums over LANES bytes of a raw int4 weight row
    U8P    <2 LANES x i8>   LANES unsigned nibbles of two weight rows, interleaved (row k, row k + 1)

and @intrinsic operations on them. Every operation is exact integer or IEEE float32 arithmetic (fmul/fadd
without fast-math flags, so LLVM never contracts them into FMA; ``f32v_fma`` is the explicit fused
multiply-add, for kernels that prove it gives the same bits): kernels built from them are bit-exact.

``i16v_maddubs(acc, pairs, a_words, index)`` (the raw-weight path): per int16 lane, two unsigned nibbles
times the two int8 of ``a_words[index]`` (int16), added to acc: vpmaddubsw with AVX512-BW, portable IR
elsewhere.

Table look-ups: ``lookup16`` (vpermps with AVX-512, lane by lane elsewhere) picks 16-entry float32 tables
by 4-bit indices (``lookup16_signed``: the same for tables whose upper 8 entries are the lower 8 negated, one
8-entry vpermps per 8 lanes with AVX2) (e.g. the nibbles of bytes from ``bytes_load``); ``f32v_sum_tree`` folds the lanes pairwise.

``dpbusd(acc, w, a_words, index)``: with ``a = a_words[index]`` (int32), for each int32 lane i,
``acc[i] + sum_j u8(w byte 4i+j) * s8(a byte j)``. On a CPU
with AVX512-VNNI it is the vpdpbusd instruction; elsewhere it is the same sum in portable LLVM IR.
``dpbusd_rows(acc, w, a_bytes, index)`` is the same with 4 * LANES signed bytes of ``a_bytes`` (one per
byte of w, not a broadcast word); ``shuffle_bytes`` (vpshufb with AVX512-BW) looks bytes up in 16-entry
tables; ``spread_bytes4`` and ``f32v_power_of_two`` turn per-block scale bytes into per-lane powers of two
(the MXFP4 x MXFP4 products of lowbit.kernels.cpu.svd_quant).
"""

from __future__ import annotations

import functools
import numba
import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import config as numba_config
from numba.core import cgutils
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic, models, register_model
from numba.np.arrayobj import populate_array

LANES = 32
_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_VI32 = ir.VectorType(_I32, LANES)
_VF32 = ir.VectorType(ir.FloatType(), LANES)
_VI16 = ir.VectorType(_I16, LANES)
_VPAIR = ir.VectorType(_I8, 2 * LANES)
_ZMM_I32 = ir.VectorType(_I32, 16)

_HOST_FEATURES = llvm_binding.get_host_cpu_features()  # this CPU's features by LLVM's names


def _host_has(*names: str) -> bool:
    """Whether numba compiles for this CPU (not a NUMBA_CPU_NAME / NUMBA_CPU_FEATURES override, e.g.
    "generic" for portable caches) and it has every feature in ``names`` (LLVM's names)."""
    if numba_config.CPU_NAME not in (None, "host") or numba_config.CPU_FEATURES:
        return False
    return all(_HOST_FEATURES.get(name) for name in names)


HAS_VNNI = _host_has("avx512vnni", "avx512bw", "avx512f")
# f32v_dot_bf16 declares the intrinsic with bfloat vectors, its signature from LLVM 16 on (numba >= 0.62).
HAS_AVX512BF16 = _host_has("avx512bf16", "avx512bw", "avx512f") and llvm_binding.llvm_version_info >= (16,)
HAS_AVX512BW = _host_has("avx512bw", "avx512f")
# AMX tiles with BF16 products (Intel Xeon since Sapphire Rapids): torch's BF16 GEMM (oneDNN) runs on them.
HAS_AMX_BF16 = _host_has("amx-bf16", "amx-tile")
# Whether torch's BF16 GEMM multiplies in BF16 hardware (AVX512-BF16 or AMX; whatever numba compiles for):
# without either it ran 3.5-4x slower than its float32 GEMM (AMD Zen 3, M = 256, N = K = 4096: 450-550 ms
# against 100-130 ms), so the GEMM paths hand it float32 tiles there.
TORCH_BF16_GEMM_IN_HARDWARE = bool(_HOST_FEATURES.get("avx512bf16") or _HOST_FEATURES.get("amx-bf16"))
HAS_AVX512F = _host_has("avx512f")
HAS_AVX512VBMI = _host_has("avx512vbmi", "avx512bw", "avx512f")
# vpshufbitqmb (every AVX512-BF16 CPU but Intel's Cooper Lake: AMD Zen 4, Intel Xeon since Sapphire Rapids)
HAS_AVX512BITALG = _host_has("avx512bitalg", "avx512bw", "avx512f")
# FP16 <-> float32 conversions: vcvtps2ph / vcvtph2ps (F16C). Without them (a "generic" target, see _host_has)
# LLVM lowers fptrunc / fpext of half to library calls that numba's JIT leaves unresolved (a call to address
# 0): f16_bits / f16_to_f32 then do the rounding in integer arithmetic.
HAS_F16C = _host_has("f16c")
# vpermps on 8 lanes (AMD Zen 3 and other CPUs without AVX-512): lookup16_signed in registers, not lane by lane.
HAS_AVX2 = _host_has("avx2")
# An AMD Zen CPU (LLVM's CPU name "znver*"; not under a NUMBA_CPU_NAME / NUMBA_CPU_FEATURES override): its
# vpmulld is one micro-op on the two vector pipes that do neither shuffles nor shifts (Intel's: two micro-ops,
# 10 cycles of latency).
HOST_IS_AMD_ZEN = (numba_config.CPU_NAME in (None, "host") and not numba_config.CPU_FEATURES
                   and llvm_binding.get_host_cpu_name().startswith("znver"))


class _VectorType(types.Type):
    def __init__(self, name: str):
        super().__init__(name=name)


# F32N: one register of float32 lanes (ymm: NARROW = 8 lanes; zmm where numba compiles for AVX-512), for loops
# whose many accumulators would not fit the registers as F32V (four registers each on AVX2).
NARROW = 16 if HAS_AVX512F else 8
_VF32N = ir.VectorType(ir.FloatType(), NARROW)
I32V = _VectorType("I32V")
F32V = _VectorType("F32V")
F32N = _VectorType("F32N")
I16V = _VectorType("I16V")
U8P = _VectorType("U8P")
_LLVM_TYPES = {"I32V": _VI32, "F32V": _VF32, "F32N": _VF32N, "I16V": _VI16, "U8P": _VPAIR}


class _VectorModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _LLVM_TYPES[fe_type.name])


register_model(_VectorType)(_VectorModel)


def _element_ptr(context, builder, arrty, arr, index, vector_type):
    """Pointer to arr[index] (a C-contiguous 1-D array) cast to a pointer to ``vector_type``."""
    data = context.make_array(arrty)(context, builder, arr).data
    return builder.bitcast(builder.gep(data, [index]), vector_type.as_pointer())


def _make_flat(counted: bool, doc: str):
    """An @intrinsic ``f(arr)``: a 1-D view of all elements of the C-contiguous array ``arr``, holding a
    reference to its memory (``counted``) or not."""

    @intrinsic
    def view_of(typingctx, arr):
        if not isinstance(arr, types.Array) or arr.layout != "C":
            return None
        result = arr.copy(ndim=1)

        def codegen(context, builder, sig, args):
            source = context.make_array(sig.args[0])(context, builder, args[0])
            view = context.make_array(sig.return_type)(context, builder)
            size = ir.Constant(ir.IntType(64), 1)
            for extent in cgutils.unpack_tuple(builder, source.shape):
                size = builder.mul(size, extent)
            populate_array(view, data=source.data, shape=[size], strides=[source.itemsize], itemsize=source.itemsize,
                           meminfo=source.meminfo if counted else None, parent=source.parent if counted else None)
            if counted:
                return impl_ret_borrowed(context, builder, sig.return_type, view._getvalue())
            return view._getvalue()

        return result(arr), codegen

    view_of.__doc__ = doc
    return view_of


flat = _make_flat(True, """A 1-D view of all elements of the C-contiguous array ``arr`` (what ``arr.reshape(-1)`` gives,
without the reshape's size check, which numba compiles with its error formatting: seconds per process).""")
borrowed_flat = _make_flat(False, """flat(arr) without a reference to arr's memory: passing it on costs no reference counting
(numba counts references with atomic operations, per call of an inlined function that loops). Only for an array
the caller keeps alive for the view's whole life (a kernel's argument).""")


def _aligned_stack(builder, size: int):
    """``size`` bytes in the entry block's stack frame of the function being compiled, 64-byte aligned."""
    storage = cgutils.alloca_once(builder, ir.ArrayType(_I8, size))
    storage.align = 64
    return storage


@intrinsic
def stack_bytes(typingctx, count):
    """A uint8[count] scratch array (``count`` a compile-time constant) in the compiled function's stack
    frame, not zeroed and without reference counting (as borrowed_flat): valid until that function returns,
    so it must not be returned or stored."""
    if not isinstance(count, types.IntegerLiteral):
        return None
    size = count.literal_value
    result = types.Array(types.uint8, 1, "C")

    def codegen(context, builder, sig, args):
        storage = _aligned_stack(builder, size)
        view = context.make_array(result)(context, builder)
        populate_array(view, data=builder.bitcast(storage, _I8.as_pointer()), shape=[ir.Constant(ir.IntType(64), size)],
                       strides=[ir.Constant(ir.IntType(64), 1)], itemsize=ir.Constant(ir.IntType(64), 1), meminfo=None)
        return view._getvalue()

    return result(count), codegen


@intrinsic
def stack_like(typingctx, like, count):
    """An array of ``like``'s type and shape (C-contiguous) on ``count`` bytes (a compile-time constant, at least
    ``like.nbytes``: not checked) of the compiled function's stack frame, 64-byte aligned, not initialised and
    without reference counting (as stack_bytes): no reshape or view, whose size checks numba compiles with its
    error formatting (seconds per process)."""
    if not (isinstance(like, types.Array) and like.layout == "C" and isinstance(count, types.IntegerLiteral)):
        return None
    size = count.literal_value

    def codegen(context, builder, sig, args):
        storage = _aligned_stack(builder, size)
        source = context.make_array(sig.args[0])(context, builder, args[0])
        view = context.make_array(sig.return_type)(context, builder)
        data = builder.bitcast(storage, source.data.type)
        populate_array(view, data=data, shape=cgutils.unpack_tuple(builder, source.shape),
                       strides=cgutils.unpack_tuple(builder, source.strides), itemsize=source.itemsize, meminfo=None)
        return view._getvalue()

    return like(like, count), codegen


PREFER_512_BIT = '"prefer-vector-width"="512"'  # the LLVM function attribute (what clang -mprefer-vector-width sets)


@intrinsic
def prefer_512_bit_vectors(typingctx):
    """Marks the function being compiled (for a ``numba.prange`` body: the parallel loop's own function) so
    that LLVM's auto-vectorizer uses 512-bit vectors where the CPU has them. LLVM prefers 256-bit vectors
    on Intel CPUs with AVX-512 (not on AMD Zen 4), which halves the lanes of element-wise loops that only
    the auto-vectorizer vectorizes (HiFloat8 encode / decode: 20-30 % more time on an Intel Xeon,
    benchmarks/results_hifloat8.md). Not for functions that build 512-bit vectors themselves: there the
    preference changes LLVM's lowering of their shuffles for the worse. Compiles to nothing."""

    def codegen(context, builder, sig, args):
        # llvmlite's FunctionAttributes admits only its known keywords; a string attribute is written as is.
        # Should a later llvmlite store attributes otherwise, the hint is dropped: same code as before it.
        try:
            set.add(builder.function.attributes, PREFER_512_BIT)
        except TypeError:
            pass
        return context.get_dummy_value()

    return types.none(), codegen


def aligned_constant(builder, name: str, array: np.ndarray, align: int = 64):
    """An i8 pointer to the bytes of ``array`` as a constant of the module being built (global ``name``, made
    once per module), starting on an ``align``-byte boundary: numba's own array constants are aligned to
    their element only, so a table's 64-byte rows would straddle two cache lines."""
    try:
        table = builder.module.get_global(name)
    except KeyError:
        data = ir.Constant(ir.ArrayType(_I8, array.nbytes), bytearray(np.ascontiguousarray(array).tobytes()))
        table = ir.GlobalVariable(builder.module, data.type, name=name)
        table.linkage, table.global_constant, table.initializer, table.align = "internal", True, data, align
    return builder.bitcast(table, _I8.as_pointer())


def vpermw(builder):
    """The function ``vpermw(table, index)`` (<32 x i16> each): a look-up in one register of 32 words, by bits
    0-4 of each index word (AVX512-BW). On an Intel Xeon (Emerald Rapids) it issued one shuffle uop per
    instruction, vpermi2w (64 words in two registers) two."""
    return cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_VI16, [_VI16] * 2), "llvm.x86.avx512.permvar.hi.512")


def _splat(builder, scalar, vector_type):
    undef = ir.Constant(vector_type, None)
    first = builder.insert_element(undef, scalar, ir.Constant(_I32, 0))
    zeros = ir.Constant(ir.VectorType(_I32, vector_type.count), [0] * vector_type.count)
    return builder.shuffle_vector(first, undef, zeros)


# blend_lanes is inline assembly, which numba's JIT assembles with the target's assembly parser.
llvm_binding.initialize_native_asmparser()


def blend_lanes(builder, low, high):
    """<32 x i8>: 16 bytes from memory at the pointers ``low`` and ``high`` (<16 x i8>*) in the low and the high
    128-bit lane (AVX2: two vbroadcasti128 and a vpblendd). Inline assembly for the blend: LLVM turns a
    shuffle or select of the two broadcasts into vinserti128, which runs on one of AMD Zen 3's two shuffle
    pipes, where vpblendd runs on any of its four vector pipes (the MXFP4 step: 13.3-13.7 -> 12.5-12.7 cycles,
    docs/weight_only.md, 'CPUs without AVX-512')."""
    wide = ir.VectorType(_I8, 32)
    blend = ir.InlineAsm(ir.FunctionType(wide, [wide, wide]), "vpblendd $$0xF0, $2, $1, $0", "=x,x,x")
    return builder.call(blend, [broadcast_lanes(builder, low), broadcast_lanes(builder, high)])


def broadcast_lanes(builder, pointer, align=16):
    """<32 x i8>: the 16 bytes at ``pointer`` (<16 x i8>*, ``align``-byte aligned) in both 128-bit lanes
    (vbroadcasti128: a load alone)."""
    half = builder.load(pointer, align=align)
    return builder.shuffle_vector(half, half, ir.Constant(ir.VectorType(_I32, 32), list(range(16)) * 2))


def _concatenated(builder, pieces):
    """One vector of the equally long vectors ``pieces`` (a power of two of them), in order."""
    while len(pieces) > 1:
        n = pieces[0].type.count
        pieces = [builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 2 * n), list(range(2 * n))))
                  for lo, hi in zip(pieces[0::2], pieces[1::2])]
    return pieces[0]


def _make_binary(lower, result, doc):
    """An @intrinsic ``f(a, b)`` of result type ``result`` (I32V or F32V) lowered by ``lower(builder, a, b)``."""

    @intrinsic
    def binary(typingctx, a, b):
        def codegen(context, builder, sig, args):
            return lower(builder, args[0], args[1])

        return result(a, b), codegen

    binary.__doc__ = doc
    return binary


# ---- integer tiles -------------------------------------------------------------------------------------


@intrinsic
def i32v_zero(typingctx):
    """All-zero I32V."""

    def codegen(context, builder, sig, args):
        return ir.Constant(_VI32, [0] * LANES)

    return I32V(), codegen


def _make_load(vector_type, result, doc):
    """An @intrinsic ``load(arr, index)``: the ``vector_type`` (LLVM) at element ``index`` of a 1-D
    C-contiguous array (any alignment), typed ``result``."""

    @intrinsic
    def load(typingctx, arr, index):
        def codegen(context, builder, sig, args):
            return builder.load(_element_ptr(context, builder, sig.args[0], args[0], args[1], vector_type), align=1)

        return result(arr, index), codegen

    load.__doc__ = doc
    return load


def _make_store(vector_type, doc):
    """An @intrinsic ``store(arr, index, value)``: ``value`` (of LLVM type ``vector_type``) stored at element
    ``index`` of a 1-D C-contiguous array (any alignment)."""

    @intrinsic
    def store(typingctx, arr, index, value):
        def codegen(context, builder, sig, args):
            builder.store(args[2], _element_ptr(context, builder, sig.args[0], args[0], args[1], vector_type), align=1)
            return context.get_dummy_value()

        return types.void(arr, index, value), codegen

    store.__doc__ = doc
    return store


i32v_load = _make_load(_VI32, I32V, """LANES int32 lanes from a 1-D C-contiguous array at element ``index`` (4 * LANES
bytes, any alignment); a uint8 array is read as 4 * LANES bytes, lane i = bytes 4i..4i+3 (little-endian).""")
i32v_store = _make_store(_VI32, "Store LANES int32 lanes into a 1-D C-contiguous int32 array at element ``index``.")
i16v_load = _make_load(_VI16, I16V, "LANES int16 lanes from a 1-D C-contiguous int16 array at element ``index``.")
i16v_store = _make_store(_VI16, "Store LANES int16 lanes into a 1-D C-contiguous int16 array at element ``index``.")


@intrinsic
def low_nibbles(typingctx, packed):
    """Each byte's bits 0-3 (as bytes 0..15)."""

    def codegen(context, builder, sig, args):
        return builder.and_(args[0], ir.Constant(_VI32, [0x0F0F0F0F] * LANES))

    return I32V(packed), codegen


@intrinsic
def high_nibbles(typingctx, packed):
    """Each byte's bits 4-7 (as bytes 0..15)."""

    def codegen(context, builder, sig, args):
        shifted = builder.lshr(args[0], ir.Constant(_VI32, [4] * LANES))
        return builder.and_(shifted, ir.Constant(_VI32, [0x0F0F0F0F] * LANES))

    return I32V(packed), codegen


def _dpbusd_portable(builder, acc, w, a_splat):
    """acc + per-lane dot product of 4 unsigned bytes of w with 4 signed bytes of a, in plain LLVM IR."""
    v_i8, v_i32 = ir.VectorType(_I8, 4 * LANES), ir.VectorType(_I32, 4 * LANES)
    w_wide = builder.zext(builder.bitcast(w, v_i8), v_i32)
    products = builder.mul(w_wide, builder.sext(builder.bitcast(a_splat, v_i8), v_i32))
    for j in range(4):
        lane_j = ir.Constant(_VI32, [4 * i + j for i in range(LANES)])
        acc = builder.add(acc, builder.shuffle_vector(products, ir.Constant(v_i32, None), lane_j))
    return acc


def _dpbusd_vnni(builder, acc, w, a_splat):
    """The same with vpdpbusd on four 16-lane pieces."""
    fnty = ir.FunctionType(_ZMM_I32, [_ZMM_I32] * 3)
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512.vpdpbusd.512")
    undef = ir.Constant(_VI32, None)
    pieces = []
    for p in range(LANES // 16):
        lanes = ir.Constant(ir.VectorType(_I32, 16), list(range(16 * p, 16 * p + 16)))
        acc_p, w_p = (builder.shuffle_vector(v, undef, lanes) for v in (acc, w))
        pieces.append(builder.call(fn, [acc_p, w_p, builder.shuffle_vector(a_splat, undef, lanes)]))
    return _concatenated(builder, pieces)


def _pieces_of(builder, vector, element, count):
    """``vector`` (an I32V's LLVM value) as consecutive pieces of ``count`` elements of type ``element``."""
    total = 4 * LANES * 8 // element.width
    flat_ = builder.bitcast(vector, ir.VectorType(element, total))
    return [builder.shuffle_vector(flat_, flat_, ir.Constant(ir.VectorType(_I32, count), list(range(c, c + count))))
            for c in range(0, total, count)]


def _dpbusd_avx2(builder, acc, w, a):
    """The same with vpmaddubsw (u8 x s8 pairs summed to int16, saturating) and vpmaddwd by ones (pairs of
    int16 summed to int32) per 256 bits: exact when every w byte is at most 127 (2 * 127 * 128 < 2^15), which
    holds for every caller (int4 nibbles 0..15, svd_quant's look-ups 0..24)."""
    v32b, v16w, v8d = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)
    maddubs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16w, [v32b, v32b]),
                                             "llvm.x86.avx2.pmadd.ub.sw")
    madd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8d, [v16w, v16w]),
                                          "llvm.x86.avx2.pmadd.wd")
    ones = ir.Constant(v16w, [1] * 16)
    sums = [builder.call(madd, [builder.call(maddubs, [w_p, a_p]), ones])
            for w_p, a_p in zip(_pieces_of(builder, w, _I8, 32), _pieces_of(builder, a, _I8, 32))]
    return builder.add(acc, _concatenated(builder, sums))


def _make_dpbusd(lower):
    @intrinsic
    def dpbusd(typingctx, acc, w, a_words, index):
        """acc[i] + sum_j u8(w byte 4i+j) * s8(a byte j) with ``a = a_words[index]``, an int32 holding 4
        signed bytes (a 1-D C-contiguous int32 array; no negative-index wraparound, no bounds check)."""

        def codegen(context, builder, sig, args):
            acc, w, arr, idx = args
            data = context.make_array(sig.args[2])(context, builder, arr).data
            a = builder.load(builder.gep(data, [idx]))
            return lower(builder, acc, w, _splat(builder, a, _VI32))

        return I32V(acc, w, a_words, index), codegen

    return dpbusd


dpbusd_portable = _make_dpbusd(_dpbusd_portable)
dpbusd_vnni = _make_dpbusd(_dpbusd_vnni)
dpbusd_avx2 = _make_dpbusd(_dpbusd_avx2)
dpbusd = dpbusd_vnni if HAS_VNNI else dpbusd_avx2 if HAS_AVX2 else dpbusd_portable


def _make_dpbusd_rows(lower):
    @intrinsic
    def dpbusd_rows(typingctx, acc, w, a_bytes, index):
        """acc[i] + sum_j u8(w byte 4i+j) * s8(a byte 4i+j), the 4 * LANES signed bytes ``a`` read from a
        1-D C-contiguous int8 array at element ``index`` (any alignment; no bounds check)."""

        def codegen(context, builder, sig, args):
            acc, w, arr, idx = args
            a = builder.load(_element_ptr(context, builder, sig.args[2], arr, idx, _VI32), align=1)
            return lower(builder, acc, w, a)

        return I32V(acc, w, a_bytes, index), codegen

    return dpbusd_rows


dpbusd_rows_portable = _make_dpbusd_rows(_dpbusd_portable)
dpbusd_rows_vnni = _make_dpbusd_rows(_dpbusd_vnni)
dpbusd_rows_avx2 = _make_dpbusd_rows(_dpbusd_avx2)
dpbusd_rows = dpbusd_rows_vnni if HAS_VNNI else dpbusd_rows_avx2 if HAS_AVX2 else dpbusd_rows_portable


def _shuffle_bytes_avx512(builder, table, index):
    """vpshufb on each 64-byte piece."""
    v64 = ir.VectorType(_I8, 64)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v64, [v64, v64]),
                                        "llvm.x86.avx512.pshuf.b.512")
    table, index = (builder.bitcast(v, ir.VectorType(_I8, 4 * LANES)) for v in (table, index))
    pieces = []
    for p in range(4 * LANES // 64):
        lanes = ir.Constant(ir.VectorType(_I32, 64), list(range(64 * p, 64 * p + 64)))
        pieces.append(builder.call(fn, [builder.shuffle_vector(v, v, lanes) for v in (table, index)]))
    return builder.bitcast(_concatenated(builder, pieces), _VI32)


def vpshufb(builder, table, index):
    """AVX2 vpshufb of two <32 x i8>: byte p <- table byte 16 (p // 16) + (index byte p & 15), or 0 where index
    byte p has its top bit set."""
    v32 = ir.VectorType(_I8, 32)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v32, [v32, v32]), "llvm.x86.avx2.pshuf.b")
    return builder.call(fn, [table, index])


def _shuffle_bytes_avx2(builder, table, index):
    """vpshufb on each 32-byte piece."""
    pieces = [vpshufb(builder, t, i) for t, i in zip(_pieces_of(builder, table, _I8, 32),
                                                       _pieces_of(builder, index, _I8, 32))]
    return builder.bitcast(_concatenated(builder, pieces), _VI32)


def _shuffle_bytes_portable(builder, table, index):
    """The same, one byte at a time (variable extractelement), in plain LLVM IR."""
    v_bytes = ir.VectorType(_I8, 4 * LANES)
    table, index = (builder.bitcast(v, v_bytes) for v in (table, index))
    result = ir.Constant(v_bytes, None)
    for p in range(4 * LANES):
        byte = builder.extract_element(index, ir.Constant(_I32, p))
        entry = builder.add(builder.zext(builder.and_(byte, ir.Constant(_I8, 15)), _I32),
                            ir.Constant(_I32, p & ~15))
        value = builder.extract_element(table, entry)
        value = builder.select(builder.icmp_signed("<", byte, ir.Constant(_I8, 0)), ir.Constant(_I8, 0), value)
        result = builder.insert_element(result, value, ir.Constant(_I32, p))
    return builder.bitcast(result, _VI32)


_SHUFFLE_BYTES_DOC = """Byte look-up within 16-byte pieces (vpshufb): byte p <- byte ``16 (p // 16) + (index byte p & 15)``
of ``table``, or 0 where index byte p has its top bit set."""
shuffle_bytes_portable = _make_binary(_shuffle_bytes_portable, I32V, _SHUFFLE_BYTES_DOC)
shuffle_bytes_avx512 = _make_binary(_shuffle_bytes_avx512, I32V, _SHUFFLE_BYTES_DOC)
shuffle_bytes_avx2 = _make_binary(_shuffle_bytes_avx2, I32V, _SHUFFLE_BYTES_DOC)
shuffle_bytes = shuffle_bytes_avx512 if HAS_AVX512BW else shuffle_bytes_avx2 if HAS_AVX2 else shuffle_bytes_portable


_V8x64 = ir.VectorType(_I8, 64)


# 128-entry byte look-ups (byte_table_words): one vpermi2b per 64 bytes with AVX512-VBMI; with AVX2, eight
# vpshufb per 32 bytes on a table kept in a telescoped form (TELESCOPED_BYTE_TABLES, telescope_byte_tables).
BYTE_TABLES = HAS_AVX512VBMI or HAS_AVX2
TELESCOPED_BYTE_TABLES = not HAS_AVX512VBMI


def telescoped(planes: np.ndarray) -> np.ndarray:
    """A copy of 128-byte look-up tables (uint8, a multiple of 128 bytes, flat) in the telescoped form: 16-byte
    chunk i > 0 of each table XORed with chunk i - 1 (see _telescoped_lookup)."""
    chunks = planes.reshape(-1, 8, 16)
    result = chunks.copy()
    result[:, 1:] ^= chunks[:, :-1]
    return result.reshape(planes.shape)


def byte_tables(planes: np.ndarray) -> np.ndarray:
    """The form of 128-byte look-up tables (flat uint8) that byte_table_words reads on this CPU (a copy)."""
    return telescoped(planes) if TELESCOPED_BYTE_TABLES else planes.copy()


@intrinsic
def telescope_byte_tables(typingctx, flat):
    """In place, :func:`telescoped` of the two 128-byte tables of ``flat`` (uint8[256], 1-D C-contiguous):
    each table XORed with itself moved up by 16 bytes, in registers."""

    def codegen(context, builder, sig, args):
        v128 = ir.VectorType(_I8, 128)
        zero = ir.Constant(v128, [0] * 128)
        for plane in (0, 128):
            pointer = _element_ptr(context, builder, sig.args[0], args[0], ir.Constant(ir.IntType(64), plane), v128)
            table = builder.load(pointer, align=1)
            moved = builder.shuffle_vector(zero, table, ir.Constant(ir.VectorType(_I32, 128),
                                                                     list(range(16)) + list(range(128, 240))))
            builder.store(builder.xor(table, moved), pointer, align=1)
        return context.get_dummy_value()

    return types.none(flat), codegen


def _telescoped_lookup(builder, index, chunks):
    """<32 x i8>: entry ``index`` (bit 7 clear) of a 128-byte table whose telescoped 16-byte chunks C0 = T0,
    Ci = Ti ^ Ti-1 are ``chunks`` (each broadcast to <32 x i8>). vpshufb(Ci, index - 16 i) is 0 where
    index < 16 i (a negative byte) and Ci[index & 15] elsewhere, so for index in chunk j the XOR of all eight
    is T0 ^ (T1 ^ T0) ^ .. ^ (Tj ^ Tj-1) = Tj[index & 15]."""
    v32 = ir.VectorType(_I8, 32)
    result = vpshufb(builder, chunks[0], index)
    for i in range(1, 8):
        shifted = builder.sub(index, ir.Constant(v32, [16 * i] * 32))
        result = builder.xor(result, vpshufb(builder, chunks[i], shifted))
    return result


def _byte_lookup_avx2(builder, codes, table, plane):
    """<64 x i8>: bytes ``table[plane + (code & 0x7F)]`` of the 64 ``codes`` (the table telescoped)."""
    v16 = ir.VectorType(_I8, 16)
    chunks = []
    for i in range(8):
        chunk = builder.load(builder.bitcast(builder.gep(table, [ir.Constant(_I32, plane + 16 * i)]),
                                             v16.as_pointer()), align=1)
        chunks.append(builder.shuffle_vector(chunk, chunk, ir.Constant(ir.VectorType(_I32, 32), list(range(16)) * 2)))
    index = builder.and_(codes, ir.Constant(_V8x64, [0x7F] * 64))
    halves = [_telescoped_lookup(builder, builder.shuffle_vector(index, index, ir.Constant(
        ir.VectorType(_I32, 32), list(range(32 * h, 32 * h + 32)))), chunks) for h in (0, 1)]
    return builder.shuffle_vector(halves[0], halves[1], ir.Constant(ir.VectorType(_I32, 64), list(range(64))))


def byte_table_words(builder, codes, table, nan_code):
    """(high, low), each <64 x i8>: the high and low bytes of the 16-bit patterns of 64 codes (``codes``,
    <64 x i8>), looked up by their bits 0-6 in ``table`` (an i8 pointer to 256 bytes: the high bytes of the
    patterns of codes 0..127, then their low bytes; one vpermi2b for each; without AVX512-VBMI, the table
    telescoped and eight vpshufb per 32 bytes each), the code's bit 7 XORed into the high byte (the sign of a
    float pattern), 0x7FFF where the code is ``nan_code`` (i8). CPUs with BYTE_TABLES only."""
    if HAS_AVX512VBMI:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8x64, [_V8x64] * 3),
                                            "llvm.x86.avx512.vpermi2var.qi.512")
        quarters = [builder.load(builder.bitcast(builder.gep(table, [ir.Constant(_I32, 64 * q)]),
                                                 _V8x64.as_pointer()), align=1) for q in range(4)]
        high = builder.call(fn, [quarters[0], codes, quarters[1]])
        low = builder.call(fn, [quarters[2], codes, quarters[3]])
    else:
        high, low = (_byte_lookup_avx2(builder, codes, table, plane) for plane in (0, 128))
    high = builder.xor(high, builder.and_(codes, ir.Constant(_V8x64, [0x80] * 64)))
    nan = builder.icmp_unsigned("==", codes, _splat(builder, nan_code, _V8x64))
    return (builder.select(nan, ir.Constant(_V8x64, [0x7F] * 64), high),
            builder.select(nan, ir.Constant(_V8x64, [0xFF] * 64), low))


def table_patterns64(context, builder, codes_type, codes, index, table_type, table, nan_code):
    """<64 x i16>: the 16-bit patterns of the 64 codes at ``codes[index]`` (a 1-D uint8 array) by
    ``byte_table_words`` from ``table`` (a 1-D uint8 array of 256), in the codes' order; ``nan_code`` an i8."""
    values = builder.load(_element_ptr(context, builder, codes_type, codes, index, _V8x64), align=1)
    table_data = builder.bitcast(context.make_array(table_type)(context, builder, table).data, _I8.as_pointer())
    high, low = byte_table_words(builder, values, table_data, nan_code)
    return builder.bitcast(builder.shuffle_vector(
        low, high, ir.Constant(ir.VectorType(_I32, 128), [i for j in range(64) for i in (j, 64 + j)])),
        ir.VectorType(_I16, 64))


@intrinsic
def store_table_words64(typingctx, codes, index, table, nan_code, out, out_index):
    """out[out_index : out_index + 64] <- the 16-bit patterns of the codes codes[index : index + 64] by
    ``byte_table_words`` (``codes`` uint8, ``table`` uint8[256], ``out`` int16: 1-D C-contiguous arrays;
    ``nan_code`` an int). CPUs with BYTE_TABLES; the table telescoped where TELESCOPED_BYTE_TABLES."""

    def codegen(context, builder, sig, args):
        words = table_patterns64(context, builder, sig.args[0], args[0], args[1], sig.args[2], args[2],
                                 builder.trunc(args[3], _I8))
        builder.store(words, _element_ptr(context, builder, sig.args[4], args[4], args[5], words.type), align=1)
        return context.get_dummy_value()

    return types.none(codes, index, table, nan_code, out, out_index), codegen


@intrinsic
def spread_bytes4(typingctx, arr, index):
    """I32V whose lane i is byte ``index + i // 4`` of a 1-D C-contiguous uint8 array, zero-extended (LANES / 4
    bytes read: one per group of 4 lanes)."""

    def codegen(context, builder, sig, args):
        v_bytes = ir.VectorType(_I8, LANES // 4)
        ptr = _element_ptr(context, builder, sig.args[0], args[0], args[1], v_bytes)
        wide = builder.zext(builder.load(ptr, align=1), ir.VectorType(_I32, LANES // 4))
        return builder.shuffle_vector(wide, wide, ir.Constant(_VI32, [i // 4 for i in range(LANES)]))

    return I32V(arr, index), codegen


def _masked_first(context, builder, arrty, arr, index, element, lanes, count):
    """<lanes x element>: the first ``count`` elements of that type at byte ``index`` of a 1-D C-contiguous
    uint8 array, zeros after them; a masked load, so nothing past them is read."""
    vector = ir.VectorType(element, lanes)
    v_index = ir.VectorType(_I32, lanes)
    count = builder.trunc(count, _I32) if count.type.width > 32 else count
    mask = builder.icmp_unsigned("<", ir.Constant(v_index, list(range(lanes))), _splat(builder, count, v_index))
    fnty = ir.FunctionType(vector, [vector.as_pointer(), _I32, ir.VectorType(ir.IntType(1), lanes), vector])
    fn = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.masked.load.v{lanes}i{element.width}.p0")
    pointer = _element_ptr(context, builder, arrty, arr, index, vector)
    return builder.call(fn, [pointer, ir.Constant(_I32, 1), mask, ir.Constant(vector, [0] * lanes)])


def _first_bytes(context, builder, arrty, arr, index, lanes, count):
    """<lanes x i8>: the bytes arr[index : index + count] of a 1-D C-contiguous uint8 array, zeros after them
    (a byte-masked load: one instruction with AVX512-BW, a branch per byte elsewhere)."""
    return _masked_first(context, builder, arrty, arr, index, _I8, lanes, count)


def _first_words(context, builder, arrty, arr, index, count):
    """<LANES x i32>: the bytes arr[index : index + count] (``count`` a multiple of 4), zeros after them, by
    a masked load of 32-bit lanes (vpmaskmovd with AVX2): what _first_bytes gives, without a branch per byte."""
    words = builder.lshr(builder.trunc(count, _I32) if count.type.width > 32 else count, ir.Constant(_I32, 2))
    return _masked_first(context, builder, arrty, arr, index, _I32, LANES, words)


@intrinsic
def i32v_load_first(typingctx, arr, index, count):
    """:func:`i32v_load` of a uint8 array with only its first ``count`` bytes read (0 <= count <= 4 * LANES, a
    multiple of 4 without AVX512-BW; the others 0): a row's last, short step without copying it anywhere."""

    def codegen(context, builder, sig, args):
        if not HAS_AVX512BW:
            return _first_words(context, builder, sig.args[0], args[0], args[1], args[2])
        return builder.bitcast(_first_bytes(context, builder, sig.args[0], args[0], args[1], 4 * LANES, args[2]), _VI32)

    return I32V(arr, index, count), codegen


@intrinsic
def spread_bytes4_first(typingctx, arr, index, count):
    """:func:`spread_bytes4` with only the first ``count`` bytes read (0 <= count <= LANES / 4; the others 0)."""

    def codegen(context, builder, sig, args):
        first = _first_bytes(context, builder, sig.args[0], args[0], args[1], LANES // 4, args[2])
        wide = builder.zext(first, ir.VectorType(_I32, LANES // 4))
        return builder.shuffle_vector(wide, wide, ir.Constant(_VI32, [i // 4 for i in range(LANES)]))

    return I32V(arr, index, count), codegen


@intrinsic
def f32v_power_of_two(typingctx, field):
    """The float32 with exponent field ``field`` (int32 lanes in 0..254) and zero fraction and sign:
    2 ** (field - 127), +0.0 for field 0."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.shl(args[0], ir.Constant(_VI32, [23] * LANES)), _VF32)

    return F32V(field), codegen


@intrinsic
def i32v_add_scalar(typingctx, value, scalar):
    """value + scalar in every lane (int32, wrapping)."""

    def codegen(context, builder, sig, args):
        return builder.add(args[0], _splat(builder, args[1], _VI32))

    return I32V(value, types.int32), codegen


@intrinsic
def f32v_splat(typingctx, value):
    """``value`` (a float32) in every lane."""

    def codegen(context, builder, sig, args):
        return _splat(builder, args[0], _VF32)

    return F32V(types.float32), codegen


@intrinsic
def i32v_to_f32v(typingctx, value):
    """Convert int32 lanes to float32 (exact below 2**24)."""

    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], _VF32)

    return F32V(value), codegen


# ---- float32 tiles -------------------------------------------------------------------------------------


def _make_float_zero(vector_type, result, doc):
    """An @intrinsic ``zero()``: the ``result`` vector (LLVM ``vector_type``) of +0.0 lanes."""

    @intrinsic
    def zero(typingctx):
        def codegen(context, builder, sig, args):
            return ir.Constant(vector_type, [0.0] * vector_type.count)

        return result(), codegen

    zero.__doc__ = doc
    return zero


f32v_zero = _make_float_zero(_VF32, F32V, "All +0.0 F32V.")
f32n_zero = _make_float_zero(_VF32N, F32N, "All +0.0 F32N.")


f32v_load = _make_load(_VF32, F32V, "LANES float32 lanes from a 1-D C-contiguous float32 array at element ``index``.")
f32v_store = _make_store(_VF32, "Store LANES float32 lanes into a 1-D C-contiguous float32 array at element ``index``.")
f32n_load = _make_load(_VF32N, F32N, "NARROW float32 lanes from a 1-D C-contiguous float32 array at element ``index``.")
f32n_store = _make_store(_VF32N, "Store NARROW float32 lanes into a 1-D C-contiguous float32 array at element ``index``.")


_F32_HALF = ir.VectorType(ir.FloatType(), LANES // 2)


def _joined_halves(builder, pointers):
    """F32V of the LANES / 2 float32 at each of the two ``pointers`` (to _F32_HALF), in that order."""
    low, high = (builder.load(pointer, align=4) for pointer in pointers)
    return builder.shuffle_vector(low, high, ir.Constant(_VI32, list(range(LANES))))


@intrinsic
def f32v_load_halves(typingctx, arr, first, second):
    """F32V of LANES / 2 float32 at element ``first`` of a 1-D C-contiguous float32 array, then LANES / 2
    at element ``second``."""

    def codegen(context, builder, sig, args):
        return _joined_halves(builder, [_element_ptr(context, builder, sig.args[0], args[0], index, _F32_HALF)
                                        for index in args[1:]])

    return F32V(arr, first, second), codegen


def aligned_table_halves(name: str, table: np.ndarray):
    """An intrinsic ``load(first, second)``: :func:`f32v_load_halves` of the 1-D float32 ``table`` kept as a
    64-byte-aligned constant of each module that uses it (:func:`aligned_constant`, global ``name``). numba's
    own array constants are aligned to their element only: where a module's strings come first, every 16-float
    row of such a table straddles two cache lines, and each load of it is a split load. ``first`` and
    ``second`` are element offsets (integers; multiples of 16 keep a row within one line), not checked."""
    if table.dtype != np.float32 or table.ndim != 1:
        raise TypeError(f"aligned_table_halves: need a 1-D float32 table, got {table.dtype} of shape {table.shape}")

    @intrinsic
    def load(typingctx, first, second):
        def codegen(context, builder, sig, args):
            base = builder.bitcast(aligned_constant(builder, name, table), ir.FloatType().as_pointer())
            offsets = [context.cast(builder, value, kind, types.intp) for value, kind in zip(args, sig.args)]
            return _joined_halves(builder, [builder.bitcast(builder.gep(base, [offset]), _F32_HALF.as_pointer())
                                            for offset in offsets])

        return F32V(first, second), codegen

    return load


@intrinsic
def f32v_load_quarters(typingctx, arr, first, second, third, fourth):
    """F32V of four runs of LANES / 4 float32 of a 1-D C-contiguous float32 array, at elements ``first``,
    ``second``, ``third`` and ``fourth``, in that order."""

    def codegen(context, builder, sig, args):
        quarter = ir.VectorType(ir.FloatType(), LANES // 4)
        pieces = [builder.load(_element_ptr(context, builder, sig.args[0], args[0], index, quarter), align=4)
                  for index in args[1:]]
        return _concatenated(builder, pieces)

    return F32V(arr, first, second, third, fourth), codegen


@intrinsic
def f32v_store_any(typingctx, arr, index, value):
    """Store LANES float32 lanes at element ``index`` of a 1-D C-contiguous float32 array, or, into an int16
    array, their BF16 bit patterns by truncation (the high 16 bits: exact for values that are BF16 values)."""
    bf16 = arr.dtype == types.int16
    if not bf16 and arr.dtype != types.float32:
        return None

    def codegen(context, builder, sig, args):
        value = args[2]
        if bf16:
            v_i16 = ir.VectorType(_I16, LANES)
            high = builder.lshr(builder.bitcast(value, _VI32), ir.Constant(_VI32, [16] * LANES))
            value = builder.trunc(high, v_i16)
        ptr = _element_ptr(context, builder, sig.args[0], args[0], args[1], value.type)
        builder.store(value, ptr, align=1)
        return context.get_dummy_value()

    return types.void(arr, index, value), codegen


@intrinsic
def f16v_load(typingctx, arr, index):
    """LANES FP16 values (an int16 bit-pattern array) at element ``index``, widened exactly to float32.

    Integer IR only (no half type, so no F16C or libcall needed): the 15 magnitude bits shifted into
    float32 position and scaled by 2**112 give every finite value exactly (subnormals included); exponent
    31 becomes 255 (inf; NaN keeps its payload and is quieted, as the hardware conversion does); the sign
    is copied.
    """

    def codegen(context, builder, sig, args):
        v_i16 = ir.VectorType(_I16, LANES)
        splat = lambda value: ir.Constant(_VI32, [value] * LANES)
        ptr = _element_ptr(context, builder, sig.args[0], args[0], args[1], v_i16)
        bits = builder.zext(builder.load(ptr, align=1), _VI32)
        sign = builder.shl(builder.and_(bits, splat(0x8000)), splat(16))
        magnitude = builder.shl(builder.and_(bits, splat(0x7FFF)), splat(13))
        finite = builder.fmul(builder.bitcast(magnitude, _VF32), ir.Constant(_VF32, [2.0**112] * LANES))
        inf_or_nan = builder.icmp_unsigned(">=", builder.and_(bits, splat(0x7C00)), splat(0x7C00))
        is_nan = builder.icmp_unsigned(">", builder.and_(bits, splat(0x7FFF)), splat(0x7C00))
        special = builder.or_(magnitude, builder.select(is_nan, splat(0x7FC00000), splat(0x7F800000)))
        widened = builder.select(inf_or_nan, special, builder.bitcast(finite, _VI32))
        return builder.bitcast(builder.or_(widened, sign), _VF32)

    return F32V(arr, index), codegen


@intrinsic
def bf16v_load(typingctx, arr, index):
    """LANES BF16 values (an int16 bit-pattern array) at element ``index``, widened exactly to float32."""

    def codegen(context, builder, sig, args):
        v_i16 = ir.VectorType(_I16, LANES)
        bits = builder.load(_element_ptr(context, builder, sig.args[0], args[0], args[1], v_i16), align=1)
        widened = builder.shl(builder.zext(bits, _VI32), ir.Constant(_VI32, [16] * LANES))
        return builder.bitcast(widened, _VF32)

    return F32V(arr, index), codegen


def _f32_binary(op_name):
    @intrinsic
    def op(typingctx, a, b):
        scalar_b = isinstance(b, types.Float)
        if scalar_b and b != types.float32:
            return None  # refuse float64 scalars: an implicit cast would round

        def codegen(context, builder, sig, args):
            lhs, rhs = args
            if scalar_b:
                rhs = _splat(builder, rhs, _VF32)
            return getattr(builder, op_name)(lhs, rhs)

        return F32V(a, types.float32 if scalar_b else F32V), codegen

    return op


f32v_add = _f32_binary("fadd")
f32v_mul = _f32_binary("fmul")
f32v_sub = _f32_binary("fsub")
f32v_div = _f32_binary("fdiv")
f32v_add.__doc__ = "IEEE float32 a + b per lane (b: F32V or float32 scalar)."
f32v_mul.__doc__ = "IEEE float32 a * b per lane (b: F32V or float32 scalar)."
f32v_sub.__doc__ = "IEEE float32 a - b per lane (b: F32V or float32 scalar)."
f32v_div.__doc__ = "IEEE float32 a / b per lane (b: F32V or float32 scalar)."


def _f32_unary(name, doc):
    @intrinsic
    def op(typingctx, value):
        def codegen(context, builder, sig, args):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF32, [_VF32]),
                                                f"llvm.{name}.v{LANES}f32")
            return builder.call(fn, list(args))

        return F32V(value), codegen

    op.__doc__ = doc
    return op


f32v_rint = _f32_unary("rint", "Each lane rounded to an integer, ties to even (np.rint; vroundps).")
f32v_abs = _f32_unary("fabs", "|value| per lane (the sign bit cleared, NaN stays NaN).")


@intrinsic
def f32v_maximum(typingctx, a, b):
    """The larger of a and b per lane, NaN if either is NaN (IEEE 754-2019 maximum)."""

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF32, [_VF32, _VF32]),
                                            f"llvm.maximum.v{LANES}f32")
        return builder.call(fn, list(args))

    return F32V(a, b), codegen


@intrinsic
def f32v_max_lane(typingctx, value):
    """The largest lane, NaN if any lane is NaN (a float32 scalar): halves compared by llvm.maximum down to one
    lane (llvm.vector.reduce.fmaximum needs LLVM 17)."""

    def codegen(context, builder, sig, args):
        v = args[0]
        width = LANES
        while width > 1:
            width //= 2
            half = ir.VectorType(ir.FloatType(), width)
            low = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, width), list(range(width))))
            high = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, width),
                                                            list(range(width, 2 * width))))
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(half, [half, half]),
                                                f"llvm.maximum.v{width}f32")
            v = builder.call(fn, [low, high])
        return builder.extract_element(v, ir.Constant(_I32, 0))

    return types.float32(value), codegen


@intrinsic
def f32v_store_as_i8(typingctx, arr, index, value):
    """Each lane converted to int8 (truncated toward zero; lanes must hold integers in [-128, 127]) and
    stored at element ``index`` of a 1-D C-contiguous int8 array."""

    def codegen(context, builder, sig, args):
        v_i8 = ir.VectorType(_I8, LANES)
        bytes_ = builder.fptosi(args[2], v_i8)
        builder.store(bytes_, _element_ptr(context, builder, sig.args[0], args[0], args[1], v_i8), align=1)
        return context.get_dummy_value()

    return types.void(arr, index, value), codegen


def _make_fma(vector_type, result, doc):
    """An @intrinsic ``fma(a, b, c)`` of ``result`` vectors (LLVM ``vector_type``): llvm.fma."""

    @intrinsic
    def fma(typingctx, a, b, c):
        def codegen(context, builder, sig, args):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector_type, [vector_type] * 3),
                                                f"llvm.fma.v{vector_type.count}f32")
            return builder.call(fn, list(args))

        return result(a, b, c), codegen

    fma.__doc__ = doc
    return fma


f32v_fma = _make_fma(_VF32, F32V, "``a * b + c`` per lane with one rounding (llvm.fma: vfmadd with FMA hardware).")
f32n_fma = _make_fma(_VF32N, F32N, "F32N ``a * b + c`` per lane with one rounding (llvm.fma).")


def _round_to_bf16(builder, value):
    bits = builder.bitcast(value, _VI32)
    lsb = builder.and_(builder.lshr(bits, ir.Constant(_VI32, [16] * LANES)), ir.Constant(_VI32, [1] * LANES))
    rounded = builder.add(builder.add(bits, ir.Constant(_VI32, [0x7FFF] * LANES)), lsb)
    rounded = builder.and_(rounded, ir.Constant(_VI32, [-0x10000] * LANES))  # 0xFFFF0000
    is_nan = builder.fcmp_unordered("uno", value, value)
    rounded = builder.select(is_nan, ir.Constant(_VI32, [0x7FC00000] * LANES), rounded)
    return builder.bitcast(rounded, _VF32)


@intrinsic
def f32v_round_to_bf16(typingctx, value):
    """Each lane rounded to the nearest BF16 value (ties to even; overflow to Inf), as float32; NaN lanes
    become the quiet NaN 0x7FC00000."""

    def codegen(context, builder, sig, args):
        return _round_to_bf16(builder, args[0])

    return F32V(value), codegen


def _vector_constant(vector_type, value):
    return ir.Constant(vector_type, [value] * vector_type.count)


def f16_bits(builder, value):
    """The FP16 bits (an i16 vector) of the float32 vector ``value`` rounded to FP16: ties to even,
    subnormals, overflow to Inf, a NaN quieted (fptrunc with F16C, else f16_bits_portable: the same bits)."""
    if HAS_F16C:
        return builder.bitcast(builder.fptrunc(value, ir.VectorType(ir.HalfType(), value.type.count)),
                               ir.VectorType(_I16, value.type.count))
    return f16_bits_portable(builder, value)


def f16_bits_portable(builder, value):
    """f16_bits in integer arithmetic (a NaN keeps its sign and top payload bits, quieted)."""
    v_i16 = ir.VectorType(_I16, value.type.count)
    v_i32 = ir.VectorType(_I32, value.type.count)
    const = functools.partial(_vector_constant, v_i32)
    bits = builder.bitcast(value, v_i32)
    sign = builder.and_(bits, const(-0x80000000))
    magnitude = builder.xor(bits, sign)
    # normal results: rebias the exponent, add half an FP16 ulp minus one plus the kept lowest bit, shift
    odd = builder.and_(builder.lshr(magnitude, const(13)), const(1))
    normal = builder.lshr(builder.add(builder.add(magnitude, const(((15 - 127) << 23) + 0xFFF)), odd), const(13))
    # subnormal results (|value| < 2^-14): the float add rounds |value| + 0.5 to a multiple of 2^-24 (RNE)
    half_one = ir.Constant(value.type, [0.5] * value.type.count)
    summed = builder.fadd(builder.bitcast(magnitude, value.type), half_one)
    subnormal = builder.sub(builder.bitcast(summed, v_i32), const(0x3F000000))
    result = builder.select(builder.icmp_unsigned("<", magnitude, const(0x38800000)), subnormal, normal)
    result = builder.select(builder.icmp_unsigned(">=", magnitude, const(0x47800000)), const(0x7C00), result)
    quiet_nan = builder.or_(builder.and_(builder.lshr(magnitude, const(13)), const(0x3FF)), const(0x7E00))
    result = builder.select(builder.icmp_unsigned(">", magnitude, const(0x7F800000)), quiet_nan, result)
    return builder.trunc(builder.or_(result, builder.lshr(sign, const(16))), v_i16)


def f16_to_f32(builder, bits):
    """The float32 vector of the FP16 bit patterns ``bits`` (an i16 vector), exactly, NaN payloads kept and
    quieted (fpext with F16C, else f16_to_f32_portable: the same bits)."""
    if HAS_F16C:
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), bits.type.count)),
                             ir.VectorType(ir.FloatType(), bits.type.count))
    return f16_to_f32_portable(builder, bits)


def f16_to_f32_portable(builder, bits):
    """f16_to_f32 in integer arithmetic and one exact float subtraction (subnormals)."""
    count = bits.type.count
    v_f32 = ir.VectorType(ir.FloatType(), count)
    v_i32 = ir.VectorType(_I32, count)
    const = functools.partial(_vector_constant, v_i32)
    h = builder.zext(bits, v_i32)
    sign = builder.shl(builder.and_(h, const(0x8000)), const(16))
    shifted = builder.shl(builder.and_(h, const(0x7FFF)), const(13))
    exponent = builder.and_(shifted, const(0x7C00 << 13))
    normal = builder.add(shifted, const((127 - 15) << 23))
    widened = builder.add(normal, const((128 - 16) << 23))  # exponent 31 -> 255: Inf, NaN
    widened = builder.select(builder.icmp_unsigned(">", shifted, const(0x7C00 << 13)),
                             builder.or_(widened, const(0x400000)), widened)  # a NaN comes out quiet
    # subnormal: 2^-14 * (1 + m / 1024) - 2^-14 = m * 2^-24, exact
    magic = ir.Constant(v_f32, [2.0 ** -14] * count)
    subnormal = builder.bitcast(builder.fsub(builder.bitcast(builder.add(normal, const(1 << 23)), v_f32), magic),
                                v_i32)
    result = builder.select(builder.icmp_unsigned("==", exponent, const(0x7C00 << 13)), widened, normal)
    result = builder.select(builder.icmp_unsigned("==", exponent, const(0)), subnormal, result)
    return builder.bitcast(builder.or_(result, sign), v_f32)


@intrinsic
def f32v_round_to_f16(typingctx, value):
    """Each lane rounded to the nearest FP16 value (IEEE: ties to even, subnormals, overflow to Inf), as
    float32 (vcvtps2ph / vcvtph2ps on x86)."""

    def codegen(context, builder, sig, args):
        return f16_to_f32(builder, f16_bits(builder, args[0]))

    return F32V(value), codegen


def _make_store_rounded(fp16: bool):
    @intrinsic
    def store_rounded(typingctx, arr, index, value):
        def codegen(context, builder, sig, args):
            value = args[2]
            is_nan = builder.fcmp_unordered("uno", value, value)
            value = builder.select(is_nan, ir.Constant(_VF32, [float("nan")] * LANES), value)  # 0x7FC00000
            if fp16:
                bits = f16_bits(builder, value)
            else:
                rounded = builder.bitcast(_round_to_bf16(builder, value), _VI32)
                bits = builder.trunc(builder.lshr(rounded, ir.Constant(_VI32, [16] * LANES)), _VI16)
            builder.store(bits, _element_ptr(context, builder, sig.args[0], args[0], args[1], _VI16), align=1)
            return context.get_dummy_value()

        return types.void(arr, index, value), codegen

    return store_rounded


f32v_store_as_bf16 = _make_store_rounded(fp16=False)
f32v_store_as_f16 = _make_store_rounded(fp16=True)
f32v_store_as_bf16.__doc__ = """Each lane rounded to BF16 (ties to even; NaN as 0x7FC0) stored as LANES 16-bit patterns into the
1-D C-contiguous 16-bit integer array ``arr`` at element ``index``."""
f32v_store_as_f16.__doc__ = """The same for FP16 (IEEE rounding, subnormals, overflow to Inf; NaN as 0x7E00)."""


def _make_store_16bit_bytes(fp16: bool):
    @intrinsic
    def store_bytes(typingctx, arr, high_offset, low_offset, value):
        def codegen(context, builder, sig, args):
            if fp16:
                bits = builder.zext(f16_bits(builder, args[3]), _VI32)
            else:
                bits = builder.lshr(builder.bitcast(_round_to_bf16(builder, args[3]), _VI32),
                                    ir.Constant(_VI32, [16] * LANES))
            v_bytes = ir.VectorType(_I8, LANES)
            data = builder.bitcast(context.make_array(sig.args[0])(context, builder, args[0]).data, _I8.as_pointer())
            for shift, offset in ((8, args[1]), (0, args[2])):
                part = builder.trunc(builder.lshr(bits, ir.Constant(_VI32, [shift] * LANES)), v_bytes)
                builder.store(part, builder.bitcast(builder.gep(data, [offset]), v_bytes.as_pointer()), align=1)
            return context.get_dummy_value()

        return types.void(arr, high_offset, low_offset, value), codegen

    return store_bytes


f32v_store_bf16_bytes = _make_store_16bit_bytes(fp16=False)
f32v_store_f16_bytes = _make_store_16bit_bytes(fp16=True)
f32v_store_bf16_bytes.__doc__ = """Each lane rounded to BF16 (ties to even); the high and the low byte of its bits stored into the
C-contiguous array ``arr`` (any element type) at byte offsets ``high_offset`` and ``low_offset`` (LANES
bytes each)."""
f32v_store_f16_bytes.__doc__ = """The same with each lane rounded to FP16 (fptrunc: ties to even) and its FP16 bits."""


@intrinsic
def f32v_sum_tree(typingctx, value):
    """The float32 sum of an F32V's LANES lanes (or an F32N's NARROW) folded pairwise: ``lane[i] += lane[i +
    h]`` for ``i < h``, h = LANES / 2, ..., 1; returns lane 0."""

    def codegen(context, builder, sig, args):
        return sum_tree(builder, args[0])

    return types.float32(value), codegen


def sum_tree(builder, v):
    """f32v_sum_tree's codegen, for a float vector of any power-of-two width."""
    width = v.type.count
    while width > 1:
        width //= 2
        mask = ir.VectorType(_I32, width)
        low = builder.shuffle_vector(v, v, ir.Constant(mask, list(range(width))))
        high = builder.shuffle_vector(v, v, ir.Constant(mask, list(range(width, 2 * width))))
        v = builder.fadd(low, high)
    return builder.extract_element(v, ir.Constant(_I32, 0))


@intrinsic
def f32v_choose(typingctx, mask, if_set, if_clear):
    """Per lane ``if_set`` where ``mask`` (I32V) is nonzero, else ``if_clear`` (float32 scalars)."""

    def codegen(context, builder, sig, args):
        nonzero = builder.icmp_signed("!=", args[0], ir.Constant(_VI32, [0] * LANES))
        return builder.select(nonzero, _splat(builder, args[1], _VF32), _splat(builder, args[2], _VF32))

    return F32V(mask, types.float32, types.float32), codegen


@intrinsic
def f32v_select(typingctx, keep, value):
    """Lanes of ``value`` where ``keep`` (I32V) is nonzero; the others +0.0."""

    def codegen(context, builder, sig, args):
        nonzero = builder.icmp_signed("!=", args[0], ir.Constant(_VI32, [0] * LANES))
        return builder.select(nonzero, args[1], ir.Constant(_VF32, [0.0] * LANES))

    return F32V(keep, value), codegen


@intrinsic
def f32v_double_where(typingctx, value, bits):
    """``value`` times 2 in the lanes whose bit of the integer ``bits`` is set (lane i: bit i of its low 32
    bits), unchanged elsewhere: a multiply under a mask register with AVX-512."""

    def codegen(context, builder, sig, args):
        word = args[1]
        if word.type.width != 32:
            word = builder.trunc(word, _I32) if word.type.width > 32 else builder.zext(word, _I32)
        mask = builder.bitcast(word, ir.VectorType(ir.IntType(1), LANES))
        doubled = builder.fmul(args[0], ir.Constant(_VF32, [2.0] * LANES))
        return builder.select(mask, doubled, args[0])

    return F32V(value, bits), codegen


@intrinsic
def bytes_load(typingctx, arr, index):
    """LANES bytes of a 1-D C-contiguous uint8 array at element ``index``, zero-extended to int32 lanes."""

    def codegen(context, builder, sig, args):
        v_bytes = ir.VectorType(_I8, LANES)
        return builder.zext(builder.load(_element_ptr(context, builder, sig.args[0], args[0], args[1], v_bytes),
                                          align=1), _VI32)

    return I32V(arr, index), codegen


@intrinsic
def prefetch(typingctx, arr, index):
    """Hint that arr[index] (a 1-D C-contiguous array; ``index`` in bounds) is read soon: ``prefetcht0``
    (LLVM's llvm.prefetch, read, into all cache levels). Changes no value."""

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        pointer = _element_ptr(context, builder, sig.args[0], args[0], args[1], _I8)
        builder.call(fn, [pointer, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return types.none(arr, index), codegen


@numba.njit(nogil=True, boundscheck=False, inline="always")
def prefetch_span(arr, start, count):
    """Prefetch arr[start : start + count] (a 1-D C-contiguous array; unsigned ``start``, any of the span past
    the end skipped), one prefetch per 64 bytes. Streaming kernels ask for a block a few blocks before they
    read it: one core of the Intel Xeon VM streamed about 3.5 GB/s through the HiFloat8 encoder without it,
    8-9 GB/s with it (benchmarks/results_hifloat8.md, 'Intel Xeon')."""
    step = np.uint64(64 // arr.itemsize)
    end = min(start + np.uint64(count), np.uint64(arr.size))
    at = start
    while at < end:
        prefetch(arr, at)
        at += step


class _BFloat(ir.Type):
    """LLVM's ``bfloat`` (llvmlite has no class for it): the element type of the AVX512-BF16 intrinsics."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


def _flushed(builder, bits):
    """float32 lanes (``bits``: their <LANES x i32>) with subnormals replaced by zero of the same sign."""
    exponent = builder.and_(bits, ir.Constant(_VI32, [0x7F800000] * LANES))
    subnormal = builder.icmp_unsigned("==", exponent, ir.Constant(_VI32, [0] * LANES))
    return builder.bitcast(builder.select(subnormal, builder.and_(bits, ir.Constant(_VI32, [-(1 << 31)] * LANES)),
                                          bits), _VF32)


def _dot_bf16_portable(builder, acc, a, b):
    """vdpbf16ps's definition in plain LLVM IR (CPUs without AVX512-BF16): inputs flushed, the odd words'
    product added first, then the even words', each product and sum rounded to nearest even and flushed."""
    def bits(value):
        return builder.bitcast(value, _VI32)

    def words(value, odd):  # BF16 word as the upper half of a float32
        return (builder.and_(value, ir.Constant(_VI32, [-(1 << 16)] * LANES)) if odd
                else builder.shl(value, ir.Constant(_VI32, [16] * LANES)))

    total = _flushed(builder, bits(acc))
    for odd in (True, False):
        product = builder.fmul(_flushed(builder, words(a, odd)), _flushed(builder, words(b, odd)))
        total = _flushed(builder, bits(builder.fadd(total, _flushed(builder, bits(product)))))
    return total


def _dot_bf16_instruction(builder, acc, a, b):
    """The same by vdpbf16ps on each half (AVX512-BF16)."""
    half = LANES // 2
    v_bf16 = ir.VectorType(_BFloat(), 2 * half)
    v_f32 = ir.VectorType(ir.FloatType(), half)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v_f32, [v_f32, v_bf16, v_bf16]),
                                        "llvm.x86.avx512bf16.dpbf16ps.512")
    halves = []
    for h in range(2):
        lanes = ir.Constant(ir.VectorType(_I32, half), list(range(h * half, (h + 1) * half)))
        acc_h, a_h, b_h = (builder.shuffle_vector(v, v, lanes) for v in (acc, a, b))
        halves.append(builder.call(fn, [acc_h, builder.bitcast(a_h, v_bf16), builder.bitcast(b_h, v_bf16)]))
    return builder.shuffle_vector(halves[0], halves[1], ir.Constant(_VI32, list(range(LANES))))


@intrinsic
def f32v_dot_bf16(typingctx, acc, a, b):
    """``acc`` (F32V) plus, per lane i, ``a_hi * b_hi``, then plus ``a_lo * b_lo``, where lane i of the I32V
    ``a`` and ``b`` holds two BF16 values (lo: the low word): vdpbf16ps's definition (subnormal inputs and
    results flushed to zero, each addition rounded to nearest even). The instruction on AVX512-BF16 CPUs
    (HAS_AVX512BF16), the same arithmetic in portable IR elsewhere: kernels that hold it in steps they never
    take there still compile (LLVM aborts the process on the instruction's intrinsic for a CPU without it)."""

    def codegen(context, builder, sig, args):
        return (_dot_bf16_instruction if HAS_AVX512BF16 else _dot_bf16_portable)(builder, *args)

    return F32V(acc, a, b), codegen


@intrinsic
def int4_columns(typingctx, arr, index):
    """I32V of the LANES signed int4 values in LANES / 2 bytes of a 1-D C-contiguous uint8 array at element
    ``index``, in column order: lane 2j is byte j's low nibble, lane 2j + 1 its high nibble (two's complement,
    -8 .. 7; the packed int4 layout of docs/wqbmm.md)."""

    def codegen(context, builder, sig, args):
        half = LANES // 2
        v_bytes = ir.VectorType(_I8, half)
        wide = builder.zext(builder.load(_element_ptr(context, builder, sig.args[0], args[0], args[1], v_bytes),
                                         align=1), ir.VectorType(_I32, half))
        low = builder.and_(wide, ir.Constant(ir.VectorType(_I32, half), [0x0F] * half))
        high = builder.lshr(wide, ir.Constant(ir.VectorType(_I32, half), [4] * half))
        order = [lane for j in range(half) for lane in (j, half + j)]
        nibbles = builder.shuffle_vector(low, high, ir.Constant(_VI32, order))
        eight = ir.Constant(_VI32, [8] * LANES)
        return builder.sub(builder.xor(nibbles, eight), eight)  # two's complement nibble -> -8 .. 7

    return I32V(arr, index), codegen


@intrinsic
def i32v_shift_right(typingctx, value, count):
    """Logical right shift of every int32 lane by ``count`` bits (a constant-size int)."""

    def codegen(context, builder, sig, args):
        count = builder.trunc(args[1], _I32) if args[1].type.width > 32 else args[1]
        return builder.lshr(args[0], _splat(builder, count, _VI32))

    return I32V(value, count), codegen


def _lookup16_avx512(builder, table, index):
    """vpermps on each 16-lane piece with that piece's 16 table lanes."""
    v16f, v16i = ir.VectorType(ir.FloatType(), 16), ir.VectorType(_I32, 16)
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(v16f, [v16f, v16i]), "llvm.x86.avx512.permvar.sf.512")
    pieces = []
    for p in range(LANES // 16):
        piece = ir.Constant(v16i, list(range(16 * p, 16 * p + 16)))
        entries = builder.shuffle_vector(table, table, piece)
        pieces.append(builder.call(fn, [entries, builder.shuffle_vector(index, index, piece)]))
    return _concatenated(builder, pieces)


def _lookup16_signed_avx2(builder, table, index):
    """Per 8 lanes: vpermps in the piece's entries 0-7 (index bits 0-2), then the index shifted left by 28
    XORed into it: bit 3 into the sign bit, bits 0-2 into bits 28-30, which undoes what signed_tables XORed
    into entry ``index & 7`` (no mask instruction)."""
    v8f, v8i = ir.VectorType(ir.FloatType(), 8), ir.VectorType(_I32, 8)
    permute = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(v8f, [v8f, v8i]), "llvm.x86.avx2.permps")
    pieces = []
    for c in range(LANES // 8):
        first = 16 * (c // 2)  # the 16-lane piece's entries
        entries = builder.shuffle_vector(table, table, ir.Constant(v8i, list(range(first, first + 8))))
        lanes = builder.shuffle_vector(index, index, ir.Constant(v8i, list(range(8 * c, 8 * c + 8))))
        sign = builder.shl(lanes, ir.Constant(v8i, [28] * 8))
        looked_up = builder.bitcast(builder.call(permute, [entries, lanes]), v8i)
        pieces.append(builder.bitcast(builder.xor(looked_up, sign), v8f))
    return _concatenated(builder, pieces)


def _lookup16_portable(builder, table, index):
    """The same, one lane at a time (variable extractelement), in plain LLVM IR."""
    result = ir.Constant(_VF32, None)
    for i in range(LANES):
        lane = ir.Constant(_I32, i)
        entry = builder.and_(builder.extract_element(index, lane), ir.Constant(_I32, 15))
        entry = builder.add(entry, ir.Constant(_I32, 16 * (i // 16)))
        result = builder.insert_element(result, builder.extract_element(table, entry), lane)
    return result


_LOOKUP16_DOC = """Per 16-lane piece p: lane i <- table lane ``16 p + (index[i] & 15)`` (each piece of ``table`` holds
that piece's 16 entries; the index bits above the low 4 are ignored)."""
lookup16_portable = _make_binary(_lookup16_portable, F32V, _LOOKUP16_DOC)
lookup16_avx512 = _make_binary(_lookup16_avx512, F32V, _LOOKUP16_DOC)
lookup16 = lookup16_avx512 if HAS_AVX512F else lookup16_portable
lookup16_signed_avx2 = _make_binary(_lookup16_signed_avx2, F32V, """lookup16 for tables whose entries 8-15 are
entries 0-7 with the sign bit flipped (NaN entries: a NaN either way), in the form signed_tables_avx2 gives:
entry ``index & 7``, its sign bit XORed with index bit 3. One 8-entry vpermps, a shift and an XOR per 8 lanes
instead of two vpermps and a blend, and half the table registers.""")
_SIGNED_AVX2 = HAS_AVX2 and not HAS_AVX512F
# lookup16 where such tables are all there is (the MXFP4 and HiFloat4 weights: lowbit.kernels.cpu.weight_only)
lookup16_signed = lookup16_avx512 if HAS_AVX512F else lookup16_signed_avx2 if HAS_AVX2 else lookup16_portable


def signed_tables_avx2(tables: np.ndarray) -> np.ndarray:
    """A copy of sign-symmetric float32 tables (16 entries each, flat) with entry j (0-7) of each table XORed
    with j << 28, the form lookup16_signed_avx2 reads (entries 8-15 unchanged, unread)."""
    marked = tables.reshape(-1, 16).view(np.uint32).copy()
    marked[:, :8] ^= (np.arange(8, dtype=np.uint32) << np.uint32(28))
    return marked.view(np.float32).reshape(tables.shape)


def signed_tables(tables: np.ndarray) -> np.ndarray:
    """The form of sign-symmetric 16-entry float32 tables (flat) that lookup16_signed reads on this CPU."""
    return signed_tables_avx2(tables) if _SIGNED_AVX2 else tables.copy()


@intrinsic
def f32v_canonical_nan(typingctx, value):
    """Every NaN lane replaced by the canonical positive quiet NaN (0x7FC00000)."""

    def codegen(context, builder, sig, args):
        is_nan = builder.fcmp_unordered("uno", args[0], args[0])
        nan = ir.Constant(_VF32, [float("nan")] * LANES)
        return builder.select(is_nan, nan, args[0])

    return F32V(value), codegen


# ---- int16 sums over raw int4 weight rows -----------------------------------------------------------------


def _nibble_pairs_intrinsic(high: bool):
    @intrinsic
    def nibble_pairs(typingctx, arr, index, stride):
        def codegen(context, builder, sig, args):
            v_i8 = ir.VectorType(_I8, LANES)
            rows = []
            for offset in (args[1], builder.add(args[1], context.cast(builder, args[2], sig.args[2], sig.args[1]))):
                byte = builder.load(_element_ptr(context, builder, sig.args[0], args[0], offset, v_i8), align=1)
                u = builder.xor(byte, ir.Constant(v_i8, [0x88] * LANES))  # both nibbles + 8 (mod 16)
                if high:
                    rows.append(builder.lshr(u, ir.Constant(v_i8, [4] * LANES)))
                else:
                    rows.append(builder.and_(u, ir.Constant(v_i8, [0x0F] * LANES)))
            lanes = [index for t in range(LANES) for index in (t, LANES + t)]
            return builder.shuffle_vector(rows[0], rows[1], ir.Constant(ir.VectorType(_I32, 2 * LANES), lanes))

        return U8P(arr, index, stride), codegen

    return nibble_pairs


u4p_low = _nibble_pairs_intrinsic(False)
u4p_high = _nibble_pairs_intrinsic(True)
u4p_low.__doc__ = """U8P of u = W + 8 (0..15) of the LOW nibbles of LANES bytes of a uint8 array at element ``index``
(row k) and at ``index + stride`` (row k + 1), interleaved byte by byte: (u[k, 0], u[k + 1, 0], u[k, 1], ...).
A two's-complement nibble plus 8 is the nibble xor 8."""
u4p_high.__doc__ = "The same for the HIGH nibbles."


@intrinsic
def i16v_zero(typingctx):
    """All-zero I16V."""

    def codegen(context, builder, sig, args):
        return ir.Constant(_VI16, [0] * LANES)

    return I16V(), codegen


def _maddubs_portable(builder, pairs, weights):
    """Per int16 lane i: u8(pairs[2i]) * s8(weights[2i]) + u8(pairs[2i + 1]) * s8(weights[2i + 1])."""
    even, odd = (ir.Constant(_VI32, list(range(p, 2 * LANES, 2))) for p in (0, 1))
    undef = ir.Constant(_VPAIR, None)
    products = [
        builder.mul(builder.zext(builder.shuffle_vector(pairs, undef, lanes), _VI16),
                    builder.sext(builder.shuffle_vector(weights, undef, lanes), _VI16))
        for lanes in (even, odd)
    ]
    return builder.add(*products)


def _maddubs_avx512(builder, pairs, weights):
    """vpmaddubsw: the same with signed saturation, which sums of at most 2 * 15 * 128 never reach."""
    fnty = ir.FunctionType(_VI16, [_VPAIR, _VPAIR])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512.pmaddubs.w.512")
    return builder.call(fn, [pairs, weights])


def _maddubs_avx2(builder, pairs, weights):
    """vpmaddubsw per 256 bits (the same bounds as _maddubs_avx512)."""
    v32b, v16w = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16w, [v32b, v32b]),
                                        "llvm.x86.avx2.pmadd.ub.sw")
    halves = [ir.Constant(ir.VectorType(_I32, 32), list(range(h, h + 32))) for h in (0, 32)]
    pieces = [builder.call(fn, [builder.shuffle_vector(pairs, pairs, h), builder.shuffle_vector(weights, weights, h)])
              for h in halves]
    return _concatenated(builder, pieces)


def _make_maddubs(lower):
    @intrinsic
    def maddubs(typingctx, acc, pairs, a_words, index):
        """acc + u0 * a0 + u1 * a1 per int16 lane i, (u0, u1) = bytes 2i, 2i + 1 of ``pairs`` (unsigned, <= 15
        here) and (a0, a1) the two signed bytes (low, high) of ``a_words[index]`` (a 1-D C-contiguous int16
        array: two consecutive int8 activations viewed as one int16); exact for these ranges."""

        def codegen(context, builder, sig, args):
            acc, pairs, arr, idx = args
            data = context.make_array(sig.args[2])(context, builder, arr).data
            word = builder.load(builder.gep(data, [idx]))
            weights = builder.bitcast(_splat(builder, word, _VI16), _VPAIR)
            return builder.add(acc, lower(builder, pairs, weights))

        return I16V(acc, pairs, a_words, index), codegen

    return maddubs


i16v_maddubs_portable = _make_maddubs(_maddubs_portable)
i16v_maddubs_avx512 = _make_maddubs(_maddubs_avx512)
i16v_maddubs_avx2 = _make_maddubs(_maddubs_avx2)
i16v_maddubs = i16v_maddubs_avx512 if HAS_AVX512BW else i16v_maddubs_avx2 if HAS_AVX2 else i16v_maddubs_portable


def _zip_intrinsic(part: int):
    @intrinsic
    def zip_half(typingctx, low, high):
        def codegen(context, builder, sig, args):
            a, b = (builder.sext(v, _VI32) for v in args)
            half = LANES // 2
            lanes = [index for t in range(half) for index in (part * half + t, LANES + part * half + t)]
            return builder.shuffle_vector(a, b, ir.Constant(_VI32, lanes))

        return I32V(low, high), codegen

    return zip_half


i16v_zip_first = _zip_intrinsic(0)
i16v_zip_second = _zip_intrinsic(1)
i16v_zip_first.__doc__ = """I32V (low[0], high[0], low[1], high[1], ..., high[LANES/2 - 1]) of two I16V, sign-extended:
the even and odd columns of a raw weight row's sums back in column order."""
i16v_zip_second.__doc__ = "The same for lanes LANES/2 .. LANES - 1."


@intrinsic
def low_bytes_load(typingctx, arr, index):
    """LANES low bytes as int32 lanes, from element ``index`` of a 1-D C-contiguous uint8 array (its bytes) or
    int32 / uint32 array (each word & 0xFF)."""
    if arr.dtype not in (types.uint8, types.int32, types.uint32):
        return None

    def codegen(context, builder, sig, args):
        if sig.args[0].dtype == types.uint8:
            v_bytes = ir.VectorType(_I8, LANES)
            ptr = _element_ptr(context, builder, sig.args[0], args[0], args[1], v_bytes)
            return builder.zext(builder.load(ptr, align=1), _VI32)
        words = builder.load(_element_ptr(context, builder, sig.args[0], args[0], args[1], _VI32), align=1)
        return builder.and_(words, ir.Constant(_VI32, [0xFF] * LANES))

    return I32V(arr, index), codegen


@intrinsic
def i32v_range(typingctx, value):
    """(min, max) over the LANES lanes of ``value``, read as unsigned (int64 each)."""

    def codegen(context, builder, sig, args):
        ends = []
        for name in ("umin", "umax"):
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_I32, [_VI32]), f"llvm.vector.reduce.{name}.v{LANES}i32")
            ends.append(builder.zext(builder.call(fn, [args[0]]), ir.IntType(64)))
        return context.make_tuple(builder, sig.return_type, ends)

    return types.UniTuple(types.int64, 2)(value), codegen


@intrinsic
def magnitude_range(typingctx, low, high, value):
    """(low, high) I32V updated by the F32V ``value``: per lane the unsigned min of ``low`` and, the max of
    ``high`` and the magnitude bits (bits & 0x7FFFFFFF) of the lane where it is finite and nonzero; other
    lanes leave them as they are (start from all ones and zeros)."""

    def codegen(context, builder, sig, args):
        bits = builder.and_(builder.bitcast(args[2], _VI32), ir.Constant(_VI32, [0x7FFFFFFF] * LANES))
        finite_nonzero = builder.icmp_unsigned("<", builder.sub(bits, ir.Constant(_VI32, [1] * LANES)),
                                               ir.Constant(_VI32, [0x7F7FFFFF] * LANES))
        low = builder.select(finite_nonzero, bits, ir.Constant(_VI32, [-1] * LANES))
        high = builder.select(finite_nonzero, bits, ir.Constant(_VI32, [0] * LANES))
        low = builder.select(builder.icmp_unsigned("<", low, args[0]), low, args[0])
        high = builder.select(builder.icmp_unsigned(">", high, args[1]), high, args[1])
        return context.make_tuple(builder, sig.return_type, [low, high])

    return types.UniTuple(I32V, 2)(low, high, value), codegen


@intrinsic
def i32v_add(typingctx, a, b):
    """a + b per int32 lane (wrapping)."""

    def codegen(context, builder, sig, args):
        return builder.add(args[0], args[1])

    return I32V(a, b), codegen


@intrinsic
def bf16v_magnitude_bounds(typingctx, largest, negated, arr, index):
    """Folds the LANES BF16 bit patterns of the 1-D C-contiguous 16-bit array ``arr`` at element ``index``
    into two I16V accumulators (unsigned lanes): (max(largest, |pattern|), max(negated, -|pattern| mod 2^16)),
    |pattern| = pattern & 0x7FFF. ``negated``'s largest lane is 2^16 minus the smallest nonzero magnitude (0
    if all are zero), so that one unsigned max gives both ends of a magnitude range."""

    def codegen(context, builder, sig, args):
        words = builder.load(_element_ptr(context, builder, sig.args[2], args[2], args[3], _VI16), align=1)
        magnitudes = builder.and_(words, ir.Constant(_VI16, [0x7FFF] * LANES))
        negatives = builder.sub(ir.Constant(_VI16, [0] * LANES), magnitudes)
        results = []
        for acc, value in ((args[0], magnitudes), (args[1], negatives)):
            results.append(builder.select(builder.icmp_unsigned(">", value, acc), value, acc))
        return context.make_tuple(builder, sig.return_type, results)

    return types.UniTuple(I16V, 2)(largest, negated, arr, index), codegen


@intrinsic
def i16v_max_lane(typingctx, value):
    """The largest lane of an I16V read as unsigned (int64)."""

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I16, [_VI16]),
                                            f"llvm.vector.reduce.umax.v{LANES}i16")
        return builder.zext(builder.call(fn, [args[0]]), ir.IntType(64))

    return types.int64(value), codegen


i16v_load = _make_load(_VI16, I16V, "LANES int16 lanes from a 1-D C-contiguous int16 array at element ``index``.")
i16v_store = _make_store(_VI16, "Store LANES int16 lanes into a 1-D C-contiguous int16 array at element ``index``.")
