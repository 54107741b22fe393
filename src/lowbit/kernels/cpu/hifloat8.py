"""HiFloat8 encode/decode on the CPU (numba): encode by branch-free int16 arithmetic that LLVM vectorizes (by
small table look-ups where the CPU has AVX512-BW), decode by table look-ups.

A per-element load from a 64 KiB table of every pattern's code does not vectorize (about 0.47 ns/element on
one Zen 4 core); the arithmetic below runs 32 elements per AVX-512 instruction. Without AVX512-BW (AVX2 CPUs,
16 elements per instruction) the table is the faster one and is what runs (``_encode_by_patterns``: 64M
elements in 20-22 ms against 39-44 ms on an AMD Zen 3). Its rounding and code assembly depend on
the binade only, so with AVX512-BW three 64-entry tables indexed by the exponent (one vpermi2w each) replace
most of it (``_encode32_bf16``: 0.24 cycles per element in L2 on an AMD EPYC Zen 5 against 0.83-0.91).
Decode has only 256 codes: with AVX512-VBMI, ``_decode_by_table`` looks up the high and the low bytes of
64 codes' patterns with one vpermi2b each (``_simd.store_table_words64``); on the Zen 5 at 2.6 GHz the
arithmetic decode this replaced was bound by its instructions (0.40-0.61 of memcpy at 64M), the table kernels
run at 0.57-0.92 (benchmarks/results_hifloat8.md, 'AMD EPYC Zen 5'). Other CPUs load each code's 16-bit
pattern from a 512-byte table (``_decode_by_words``): on an AMD Zen 3 (AVX2) 64M codes took 14.5-17 ms
against 38-41 ms for the arithmetic decode (memcpy 9-10 ms). Every
intermediate is cast back to int16 with ``_i16``: numba widens integer arithmetic to int64, and the casts
let LLVM keep 16-bit lanes. The kernels are checked bit for bit against the reference on all 65536
FP16/BF16 patterns and all 256 codes (tests and the ops layer's self-check).

Encode, on the BF16 magnitude bits ``a`` of a finite value (exponent E = (a >> 7) - 127):

1. Saturate: clamp ``a`` to 2^15 (every finite |x| >= 2^15 gives 0x6E, the code of 2^15).
2. ``band(|E|)`` = 0, 1, 2, 3 for |E| <= 3, <= 7, <= 15, > 15: the binade keeps M = 3 - band mantissa bits
   (band 3 is the denormal band E < -15, whose grid 2^(k-23) has one point per binade: M = 0).
3. Round half away from zero by adding half a grid step, ``8 << band``, to ``a``; a carry out of the
   mantissa moves into the next binade exactly as in IEEE rounding. TA rounding only reads the first
   dropped bit, so no sticky bits are needed.
4. From the rounded ``u`` re-derive E and the band and assemble the code: ``m = mantissa >> (4 + band)``;
   E = 0 and |E| = 1 (Dot 0001, 001): ``(0x10 + 0x10 * (E < 0)) / 2 + (|E| << 3) + m``; |E| = 2..15
   (Dot 01, 10, 11): ``0x10 + 0x20 * band + 0x10 * (E < 0) + (|E| << M) + m`` (the prefix minus the
   implicit exponent MSB plus the exponent sign bit); denormal band: ``max(23 - |E|, 1)``
   (E = -23 always rounds up to 2^-22, code 1); |x| < 2^-23 gives 0.
5. Inf -> 0x6F, NaN -> 0x80; the sign bit is ORed in unless the code is 0 or NaN.

FP16 inputs are turned into a BF16 pattern first: rebias the exponent and truncate the mantissa to 7 bits
(exact here because only the first 4 mantissa bits matter, step 3). Subnormals need normalizing: their
bits are their value in units of 2^-24, so the FP32 of that integer, exponent minus 24, is the value
(an int -> float cast: no FP32 subnormal arithmetic, which is slow). The cast needs 32-bit lanes, so the
FP16 encoder works in blocks and takes the 16-bit-only path for blocks without subnormals (the usual case).

Decode: a code magnitude of Dot class with M mantissa bits has the value bits
``bias + (v << (mantissa width - M))``, ``v = (|E| << M) + m`` for E >= 0 and ``m - (|E| << M)`` for E < 0,
where ``|E| << M = (code & 0xF) - m + 16`` for Dot 01/10/11, ``8`` for Dot 001 and 0 for Dot 0001. The
denormal codes 1..7 (2^(m-23)), the FP16 subnormal outputs (E = -15 and the denormal codes), zero, Inf
and NaN are selected apart.

Every kernel runs in blocks of _BLOCK elements (the parallel loop's steps). Each block first prefetches the
input of the block _PREFETCH_BLOCKS on, and its loop is compiled for 512-bit vectors
(``prefer_512_bit_vectors``). Both matter on Intel CPUs only: LLVM picks 256-bit vectors there, and one core
streamed the input at about a third of the speed without the prefetch (benchmarks/results_hifloat8.md,
'Intel Xeon').
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from lowbit.backends import Kernel
from lowbit.formats import hifloat8 as reference
from lowbit.kernels.cpu._runtime import SerialOrParallel, as_numpy, bound_njit, int16_array_at, runs_serially
from lowbit.kernels.cpu._simd import (HAS_AVX512BW, HAS_AVX512VBMI, prefer_512_bit_vectors, prefetch_span,
                                      store_table_words64)

_i16 = np.int16

# band(|E|) for q = |E| >> 2 = 0..7 is 0, 1, 2, 2, 3, 3, 3, 3: 2-bit fields packed into one int16 so
# that the look-up is a shift (vectorizes) rather than a gather.
_BANDS = np.uint16(sum(band << (2 * q) for q, band in enumerate((0, 1, 2, 2, 3, 3, 3, 3)))).astype(np.int16)
_BF16_INF = _i16(0x7F80)
_FP16_INF = _i16(0x7C00)
_NAN_CODE = reference.NAN_CODE
_BLOCK = 1024  # elements per parallel step
# Each step prefetches the block this many blocks on: on an Intel Xeon the loops stream from memory at about a
# third of the speed otherwise (benchmarks/results_hifloat8.md, 'Intel Xeon').
_PREFETCH_BLOCKS = 2
# Inputs of fewer elements run the kernels' serial versions on the calling thread (see SerialOrParallel): waking
# numba's threads costs more than they save there (after a torch op, AMD EPYC Zen 4, 2 threads: 256K FP16
# elements encode in 95 us serially, 97 us in parallel; benchmarks/results_first_run.md). The self-check's
# exhaustive probe (2^16 patterns) runs serially too, so a cold start compiles no parallel loop.
ONE_THREAD_ELEMENTS = 1 << 18


@numba.njit(inline="always")
def _band(abs_exponent):
    """0, 1, 2, 3 for |E| <= 3, <= 7, <= 15, 16..31 (mantissa bits kept: 3 - band).

    Larger |E| wrap around; they only occur below 2^-23, whose code is forced to 0.
    """
    field_shift = _i16(_i16(abs_exponent >> _i16(1)) & _i16(0xE))  # 2 * (|E| >> 2) mod 16
    return _i16(_i16(_BANDS >> field_shift) & _i16(3))


@numba.njit(inline="always")
def _magnitude_code(a):
    """Code 0..0x7E of the finite BF16 magnitude bits ``a`` (int16); see the module docstring."""
    a = min(a, _i16(0x4700))  # 2^15
    exponent = _i16(_i16(a >> _i16(7)) - _i16(127))
    u = _i16(a + _i16(_i16(8) << _band(_i16(abs(exponent)))))
    exponent = _i16(_i16(u >> _i16(7)) - _i16(127))
    abs_e = _i16(abs(exponent))
    band = _band(abs_e)
    m = _i16(_i16(u & _i16(0x7F)) >> _i16(_i16(4) + band))
    prefix = _i16(_i16(_i16(0x10) + _i16(band << _i16(5))) + (_i16(0x10) if exponent < _i16(0) else _i16(0)))
    prefix = _i16(prefix >> _i16(1)) if abs_e <= _i16(1) else prefix
    normal = _i16(_i16(prefix + _i16(_i16(abs_e << _i16(3)) >> band)) + m)
    denormal = max(_i16(_i16(23) - abs_e), _i16(1))
    code = denormal if band == _i16(3) else normal
    return _i16(0) if a < _i16(0x3400) else code  # |x| < 2^-23


# ---- Encode by exponent tables (AVX512-BW): 32 elements per step -------------------------------------------
# Steps 3-4 of _magnitude_code depend on the binade only: with i = max(e - 103, 0) for the biased exponent e of a
# BF16 magnitude (i = 0: |x| < 2^-23, code 0; i = 1..39: E = i - 24 = -23..15), the rounded magnitude is
# u = a + HALF_STEP[i(a)] and its code is CODE_BASE[i(u)] + ((u & 0x7F) >> MANTISSA_SHIFT[i(u)]). Each table has
# 64 int16 entries (two vpermi2w operands); entries 40-63 are never looked up (a is clamped to 2^15, i <= 39).
_EXPONENT_OFFSET = 103


def _encode_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(HALF_STEP, CODE_BASE, MANTISSA_SHIFT), int16[64] each, from the module docstring's steps 2-4."""
    half_step, code_base, shift = (np.zeros(64, np.int16) for _ in range(3))
    shift[:] = 7  # m = 0 (index 0 and the denormal band)
    for i in range(1, 40):
        exponent = i - 24
        magnitude = abs(exponent)
        band = 0 if magnitude <= 3 else 1 if magnitude <= 7 else 2 if magnitude <= 15 else 3
        half_step[i] = 8 << band
        if band == 3:
            code_base[i] = max(23 - magnitude, 1)
            continue
        prefix = 0x10 + (band << 5) + (0x10 if exponent < 0 else 0)
        prefix = prefix >> 1 if magnitude <= 1 else prefix
        code_base[i] = prefix + (magnitude << (3 - band))
        shift[i] = 4 + band
    return half_step, code_base, shift


_V16 = ir.VectorType(ir.IntType(16), 32)


def _word_pair(table: np.ndarray) -> list[ir.Constant]:
    return [ir.Constant(_V16, [int(v) for v in table[h * 32:h * 32 + 32]]) for h in (0, 1)]


def _magnitude_codes32(builder, a):
    """_magnitude_code of 32 clamped BF16 magnitudes ``a`` (<32 x i16>) by the exponent tables."""
    lookup = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16, [_V16] * 3),
                                            "llvm.x86.avx512.vpermi2var.hi.512")
    half_step, code_base, shift = (_word_pair(t) for t in _encode_tables())

    def words(value):
        return ir.Constant(_V16, [value] * 32)

    def index(magnitude):
        exponent = builder.lshr(magnitude, words(7))
        above = builder.icmp_unsigned(">", exponent, words(_EXPONENT_OFFSET))
        return builder.select(above, builder.sub(exponent, words(_EXPONENT_OFFSET)), words(0))

    u = builder.add(a, builder.call(lookup, [half_step[0], index(a), half_step[1]]))
    i = index(u)
    m = builder.lshr(builder.and_(u, words(0x7F)), builder.call(lookup, [shift[0], i, shift[1]]))
    return builder.add(builder.call(lookup, [code_base[0], i, code_base[1]]), m)


def _make_encode32(from_fp16: bool):
    inf = 0x7C00 if from_fp16 else 0x7F80

    @intrinsic
    def encode32(typingctx, src, index, dst):
        def codegen(context, builder, sig, args):
            src_ty, _, dst_ty = sig.args
            pointer = builder.gep(context.make_array(src_ty)(context, builder, args[0]).data, [args[1]])
            bits = builder.load(builder.bitcast(pointer, _V16.as_pointer()), align=1)

            def words(value):
                return ir.Constant(_V16, [value] * 32)

            magnitude = builder.and_(bits, words(0x7FFF))
            a = magnitude
            if from_fp16:  # no subnormals here: zero or the BF16 pattern of a normal / Inf / NaN
                normal = builder.add(builder.lshr(magnitude, words(3)), words(0x3800))
                a = builder.select(builder.icmp_unsigned(">=", magnitude, words(0x400)), normal, words(0))
            a = builder.select(builder.icmp_unsigned("<", a, words(0x4700)), a, words(0x4700))  # 2^15
            code = _magnitude_codes32(builder, a)
            sign = builder.and_(builder.lshr(bits, words(8)), words(0x80))
            signed = builder.select(builder.icmp_unsigned("!=", code, words(0)), builder.or_(code, sign), code)
            special = builder.select(builder.icmp_unsigned("==", magnitude, words(inf)), builder.or_(signed, words(1)),
                                     words(0x80))
            result = builder.select(builder.icmp_unsigned(">=", magnitude, words(inf)), special, signed)
            pointer = builder.gep(context.make_array(dst_ty)(context, builder, args[2]).data, [args[1]])
            codes = builder.trunc(result, ir.VectorType(ir.IntType(8), 32))
            builder.store(codes, builder.bitcast(pointer, codes.type.as_pointer()), align=1)
            return context.get_dummy_value()

        return types.none(src, index, dst), codegen

    encode32.__doc__ = (f"dst[index : index + 32] (uint8) <- the codes of the {'FP16' if from_fp16 else 'BF16'} "
                        "bit patterns src[index : index + 32] (int16" + (", no subnormals" if from_fp16 else "") +
                        "), by the exponent tables. AVX512-BW only.")
    return encode32


_encode32_bf16 = _make_encode32(from_fp16=False)
_encode32_fp16_normal = _make_encode32(from_fp16=True)


@numba.njit(inline="always")
def _signed_code(bits, magnitude, code, inf_magnitude):
    """uint8 code: the sign of ``bits`` unless the code is 0; Inf/NaN from the input ``magnitude`` bits.

    ``code`` is ``_magnitude_code`` of the clamped magnitude: 0x6E for Inf and NaN, so Inf is ``code | 1``.
    """
    sign = _i16(_i16(bits >> _i16(8)) & _i16(0x80))
    signed = _i16(code | (sign if code != _i16(0) else _i16(0)))
    special = _i16(signed | _i16(1)) if magnitude == inf_magnitude else _i16(0x80)
    return np.uint8(special if magnitude >= inf_magnitude else signed)


@numba.njit(inline="always")
def _bits_from_f32(f):
    return np.float32(f).view(np.uint32)


@numba.njit(inline="always")
def _bf16_from_fp16_normal(magnitude):
    """BF16 pattern of FP16 magnitude bits >= 0x400 (normal, Inf, NaN): rebias, keep 7 mantissa bits."""
    return _i16(_i16(magnitude >> _i16(3)) + _i16(0x3800))


@numba.njit(inline="always")
def _bf16_from_fp16_subnormal(magnitude):
    """BF16 pattern of FP16 magnitude bits 1..0x3FF (value: the bits times 2^-24); 0 gives a negative one."""
    return _i16(_i16(_bits_from_f32(np.float32(magnitude)) >> np.uint32(16)) - _i16(24 << 7))


@numba.njit(inline="always")
def _bf16_from_fp16(magnitude):
    """BF16 pattern of any FP16 magnitude bits (zero: negative, which encodes to 0)."""
    normal = _bf16_from_fp16_normal(magnitude)
    return normal if magnitude >= _i16(0x400) else _bf16_from_fp16_subnormal(magnitude)


@numba.njit(inline="always")
def _bf16_from_fp16_without_subnormals(magnitude):
    """As ``_bf16_from_fp16`` for magnitudes that are zero or >= 0x400, in 16-bit lanes only."""
    return _bf16_from_fp16_normal(magnitude) if magnitude >= _i16(0x400) else _i16(0)


@numba.njit(inline="always")
def _has_fp16_subnormal(src, start, stop):
    """Whether src[start:stop] (FP16 bits) holds a nonzero subnormal (magnitude 1..0x3FF)."""
    found = False
    for i in range(start, stop):
        found |= np.uint16(_i16(src[i] & _i16(0x7FFF)) - _i16(1)) < np.uint16(0x3FF)
    return found


@numba.njit(inline="always")
def _steps(src):
    """Parallel steps over the elements of ``src``: blocks of _BLOCK."""
    return (src.size + _BLOCK - 1) // _BLOCK


@numba.njit(inline="always")
def _block_range(src, block):
    """(start, stop) of step ``block`` over ``src``, unsigned (no wrap-around checks), after prefetching the
    input of the step _PREFETCH_BLOCKS on."""
    start = np.uint64(block * _BLOCK)
    prefetch_span(src, start + np.uint64(_PREFETCH_BLOCKS * _BLOCK), _BLOCK)
    return start, np.uint64(min(block * _BLOCK + _BLOCK, src.size))


@numba.njit(inline="always")
def _step_range(src, block):
    """``_block_range`` in a function marked for 512-bit vectors (inlined into the parallel loop's body, the
    mark lands there): the set-up of the auto-vectorized loops' steps."""
    prefer_512_bit_vectors()
    return _block_range(src, block)


@numba.njit(inline="always")
def _encode_bf16_elements(src, dst, start, stop):
    """dst[start:stop] <- the codes of the BF16 patterns src[start:stop], one element at a time (LLVM vectorizes)."""
    for i in range(start, stop):
        magnitude = _i16(src[i] & _i16(0x7FFF))
        dst[i] = _signed_code(src[i], magnitude, _magnitude_code(magnitude), _BF16_INF)


@numba.njit(inline="always")
def _encode_fp16_elements(src, dst, start, stop, subnormals):
    """The same for FP16 patterns; ``subnormals``: whether the range may hold subnormals (the FP32 cast),
    else the 16-bit-only path."""
    if subnormals:
        for i in range(start, stop):
            magnitude = _i16(src[i] & _i16(0x7FFF))
            dst[i] = _signed_code(src[i], magnitude, _magnitude_code(_bf16_from_fp16(magnitude)), _FP16_INF)
    else:
        for i in range(start, stop):
            magnitude = _i16(src[i] & _i16(0x7FFF))
            code = _magnitude_code(_bf16_from_fp16_without_subnormals(magnitude))
            dst[i] = _signed_code(src[i], magnitude, code, _FP16_INF)


@SerialOrParallel
def _encode_by_patterns(src, dst, table):
    # src: int16[n] FP16 or BF16 bit patterns, dst: uint8[n], table: uint8[65536] (_pattern_table): one load per
    # element (CPUs without AVX512-BW)
    for block in numba.prange(_steps(src)):
        start, stop = _step_range(src, block)
        for i in range(start, stop):
            dst[i] = table[np.uint16(src[i])]


@SerialOrParallel
def _encode_bf16_by_table(src, dst):
    # src: int16[n] BF16 bit patterns, dst: uint8[n]; AVX512-BW. 32 elements per step, the last n % 32 one by one.
    for block in numba.prange(_steps(src)):
        start, stop = _block_range(src, block)
        i = start
        while i + np.uint64(32) <= stop:
            _encode32_bf16(src, i, dst)
            i += np.uint64(32)
        _encode_bf16_elements(src, dst, i, stop)


@SerialOrParallel
def _encode_fp16_by_table(src, dst):
    # src: int16[n] FP16 bit patterns, dst: uint8[n]; AVX512-BW. Blocks with subnormals take the FP32 cast.
    for block in numba.prange(_steps(src)):
        start, stop = _block_range(src, block)
        if _has_fp16_subnormal(src, start, stop):
            _encode_fp16_elements(src, dst, start, stop, True)
            continue
        i = start
        while i + np.uint64(32) <= stop:
            _encode32_fp16_normal(src, i, dst)
            i += np.uint64(32)
        _encode_fp16_elements(src, dst, i, stop, False)


@SerialOrParallel
def _decode_by_words(src, dst, table):
    # src: uint8[n] codes, dst: int16[n] FP16 or BF16 bit patterns, table: int16[256] (_word_table): one load
    # per code (CPUs without AVX512-VBMI)
    for block in numba.prange(_steps(src)):
        start, stop = _step_range(src, block)
        for i in range(start, stop):
            dst[i] = table[src[i]]


@SerialOrParallel
def _decode_by_table(src, dst, table):
    # src: uint8[n] codes, dst: int16[n] FP16 or BF16 bit patterns, table: uint8[256] (_byte_table). AVX512-VBMI:
    # 64 codes per look-up, the last (n % 64) one at a time.
    for block in numba.prange(_steps(src)):
        start, stop = _block_range(src, block)
        i = start
        while i + np.uint64(64) <= stop:
            store_table_words64(src, i, table, _NAN_CODE, dst, i)
            i += np.uint64(64)
        for j in range(i, stop):
            code = np.int32(src[j])
            magnitude = code & 0x7F
            word = ((np.int32(table[magnitude]) << 8) | np.int32(table[128 + magnitude])) ^ ((code & 0x80) << 8)
            dst[j] = _i16(0x7FFF) if code == _NAN_CODE else _i16(word)



@functools.cache
def _byte_table(dtype: torch.dtype) -> np.ndarray:
    """uint8[256]: the high, then the low bytes of the ``dtype`` (FP16 / BF16) bit patterns of codes 0..127."""
    bits = reference.decode_table(dtype)[:128].view(torch.int16).numpy().view(np.uint16)
    return np.concatenate([bits >> 8, bits & 0xFF]).astype(np.uint8)


@functools.cache
def _word_table(dtype: torch.dtype) -> np.ndarray:
    """int16[256]: the ``dtype`` (FP16 / BF16) bit pattern of every code, 0x7FFF for the NaN code (as
    _decode_by_table gives)."""
    bytes_ = _byte_table(dtype).astype(np.int32)
    codes = np.arange(256)
    magnitude = codes & 0x7F
    words = ((bytes_[magnitude] << 8) | bytes_[128 + magnitude]) ^ ((codes & 0x80) << 8)
    words[_NAN_CODE] = 0x7FFF
    return words.astype(np.uint16).view(np.int16)


@functools.cache
def _pattern_table(dtype: torch.dtype) -> np.ndarray:
    """uint8[65536]: the code of every ``dtype`` (FP16 / BF16) bit pattern, indexed by the pattern (64 KiB)."""
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    return reference.encode(patterns).numpy()


_ENCODERS_BY_TABLE = {torch.bfloat16: _encode_bf16_by_table, torch.float16: _encode_fp16_by_table}


class Encode(Kernel):
    """encode_to_hifloat8 on the CPU: contiguous FP16/BF16 ``x`` into contiguous uint8 ``out`` (by exponent
    tables with AVX512-BW, else by a table of every bit pattern's code)."""

    def run(self, x: torch.Tensor, *, out: torch.Tensor) -> None:
        serial = runs_serially(x.numel(), ONE_THREAD_ELEMENTS)
        src, dst = as_numpy(x).reshape(-1), as_numpy(out).reshape(-1)
        if HAS_AVX512BW:
            _ENCODERS_BY_TABLE[x.dtype](src, dst, serial=serial)
        else:
            _encode_by_patterns(src, dst, _pattern_table(x.dtype), serial=serial)


class Decode(Kernel):
    """decode_from_hifloat8 on the CPU: contiguous uint8 ``codes`` into contiguous FP16/BF16 ``out`` (by table
    look-up: bytes, 64 codes per instruction, with AVX512-VBMI; else one 16-bit word per code)."""

    def run(self, codes: torch.Tensor, dtype: torch.dtype | None, *, out: torch.Tensor) -> None:
        serial = runs_serially(codes.numel(), ONE_THREAD_ELEMENTS)
        src, dst = as_numpy(codes).reshape(-1), as_numpy(out).reshape(-1)
        if HAS_AVX512VBMI:
            _decode_by_table(src, dst, _byte_table(out.dtype), serial=serial)
        else:
            _decode_by_words(src, dst, _word_table(out.dtype), serial=serial)


ENCODE = Encode()
DECODE = Decode()


def _round_trip_at(x_address, out_address, count):
    """The template of round_trip_small's call: ``_ENCODE`` (a serial encoder above) of the ``count`` FP16 / BF16
    bit patterns at ``x_address``, then ``_DECODE`` with ``_DECODE_TABLE`` (a serial decoder above and its table
    for the same dtype) of those codes into ``out_address`` (int16_array_at)."""
    codes = np.empty(count, dtype=np.uint8)
    _ENCODE(int16_array_at(x_address, 1, count).reshape(-1), codes)  # noqa: F821 (bound)
    _DECODE(codes, int16_array_at(out_address, 1, count).reshape(-1), _DECODE_TABLE)  # noqa: F821 (bound)


@functools.cache
def _round_trip_at_for(dtype: torch.dtype):
    """The numba dispatcher of _round_trip_at bound to this CPU's kernels for ``dtype`` (FP16 / BF16)."""
    decode, table = (_decode_by_table, _byte_table(dtype)) if HAS_AVX512VBMI else (_decode_by_words, _word_table(dtype))
    return bound_njit(_round_trip_at, f"_hifloat8_round_trip_at_{str(dtype).removeprefix('torch.')}",
                      _ENCODE=_ENCODERS_BY_TABLE[dtype].serial, _DECODE=decode.serial, _DECODE_TABLE=table)


def round_trip_small(x: torch.Tensor) -> torch.Tensor:
    """``decode(encode(x), x.dtype)`` (the HiF8 round trip, as ENCODE then DECODE give it) into a new tensor, in
    one numba call given the tensors' addresses, on the calling thread (the two operators' checks and views cost
    tens of microseconds after other work, more than the work of a decode step's activation). Not checked: the
    caller's x is a C-contiguous FP16 / BF16 CPU tensor of at most ONE_THREAD_ELEMENTS elements, and the CPU
    has AVX512-BW (its encoders; elsewhere the caller takes the operators)."""
    out = torch.empty_like(x)
    _round_trip_at_for(x.dtype)(x.data_ptr(), out.data_ptr(), x.numel())
    return out
