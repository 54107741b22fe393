"""HiFloat4 numba kernels: fake-quant over any qdim, pack and unpack, bit for bit equal to
:mod:`lowbit.formats.hifloat4`.

A tensor is seen as (outer, L, inner) around the quant dim; block n covers 64 elements spaced ``inner``
apart. No transposed copy of the tensor is made: with ``inner > 1``, tiles of _BLOCKS_PER_TILE blocks
side by side (64 x 32 elements) go through a small scratch buffer. Tasks of about _BLOCKS_PER_TASK blocks
run in parallel, scheduled dynamically.

Per block (docs/hifloat4.md, section 'Quantization': every fp32 operation of the reference in the same
order), in loops that LLVM vectorizes:

1. one pass over the 16 4-groups: maxima compared as magnitude bits (non-finite elements count 0 and
   poison the block);
2. scalar: bf16(M * c7), clamps and E6M2 rounding as integer arithmetic on the bits, ``bf16(1 / sf)``
   from a four-entry table instead of a division;
3. one pass over the 16 4-groups: flags e2, e3 as arithmetic (no branches), giving 2^-level and
   2^level * sf / 4 per group;
4. one pass over the 64 elements: the in-group bf16 rounding by a magic-number addition (the FPU rounds
   to nearest even), the half-up code as floor, ``code * 2^level * sf / 4`` (exact in fp32) turned into
   the output dtype's bits (FP16 rounds to nearest even); a poisoned block is then overwritten with NaN.

On CPUs with AVX512-BW, or AVX2 and F16C (``BLOCKS_IN_REGISTERS``), blocks skip steps 1, 3 and 4 as loops:
lowbit.kernels.cpu._hifloat4_blocks does them in vector registers with per-element group maxima, around the
same scalar step 2. Which route a kernel
compiles is its work argument's type (``_task_work``): only one of them is compiled per input width.

Performance notes (numba/LLVM specifics behind the shape of the code): the per-block helpers that take
arrays are inlined at numba IR level, blocks are rows of 2-D views and per-task scratch is one small
array, because every array view created or passed per block costs atomic reference counting; scalar
helpers are ordinary compiled functions, which LLVM inlines (numba's IR-level inlining copies the callee's
IR at every call site, and did so for most of this module's compile time); the block code exists once per
output kind (FP32 for 32-bit inputs, BF16 and FP16 for 16-bit ones), in _fake_quant_rows, which the tile
path calls per tile; integer lanes are kept at 32 bits
with explicit ``np.uint32`` casts (numba widens integer arithmetic to 64 bits).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import types
from numba.extending import overload

from lowbit.backends import Kernel
from lowbit.dtypes import SAME_WIDTH_INT
from lowbit.formats import hifloat4 as ref
from lowbit.formats.hifloat4 import BLOCK
from lowbit.kernels.cpu import _transpose
from lowbit.kernels.cpu._runtime import NJIT_OPTIONS, SerialOrParallel, aligned_empty, as_numpy, runs_serially
from lowbit.kernels.cpu._hifloat4_blocks import BLOCK_FAKE_QUANT, BLOCK_MAXIMUM
from lowbit.kernels.cpu._simd import HAS_AVX2, HAS_AVX512BW, HAS_F16C, flat, prefer_512_bit_vectors, prefetch

_BLOCKS_PER_TASK = 256  # blocks per parallel task
# Inputs of fewer blocks run the kernels' serial versions on the calling thread (see SerialOrParallel): waking
# numba's threads costs more than they save there.
_ONE_THREAD_BLOCKS = 1 << 10
_BLOCKS_PER_TILE = 32  # blocks side by side in a tile when the quant dim is not the last

_F0 = np.float32(0.0)
_F_QUARTER = np.float32(0.25)
_F_HALF = np.float32(0.5)
_F1 = np.float32(1.0)
_F2 = np.float32(2.0)
_F4 = np.float32(4.0)
_F_CODE_MAX = np.float32(1.75)
_F_BF16_MAGIC = np.float32(1.5 * 2.0**16)
_C7 = np.float32(ref.C7)
_SCALE_MIN = np.float32(ref.SCALE_MIN)
_SCALE_MAX = np.float32(ref.SCALE_MAX)
_F16_MIN_NORMAL = np.float32(2.0**-14)
_F16_OVERFLOW = np.float32(65520.0)  # the smallest fp32 that rounds to +inf in fp16

# Per-block helpers that take arrays are inlined into their callers in numba IR: a call of a compiled
# function that takes arrays costs atomic reference-count updates per array, more than the block's
# arithmetic. Scalar helpers need not be: LLVM inlines them.
_INLINE = dict(NJIT_OPTIONS, inline="always")

# Output kinds (how the fp32 result becomes the output's bits).
_KIND_F32, _KIND_BF16, _KIND_F16 = 0, 1, 2


class _Format:
    """How a dtype's bit pattern (viewed as int16/int32) maps to fp32 and back."""

    def __init__(self, mag_mask, inf_mag, shift, widen, kind):
        self.mag_mask = mag_mask  # magnitude bits (all but the sign)
        self.inf_mag = inf_mag  # magnitudes >= this are Inf or NaN
        self.shift = shift  # magnitude << shift is the fp32 bit pattern ...
        self.widen = widen  # ... times this factor (2^112 rebiases the FP16 exponent, exact)
        self.kind = kind


_FORMATS = {
    torch.float32: _Format(0x7FFFFFFF, 0x7F800000, 0, 1.0, _KIND_F32),
    torch.bfloat16: _Format(0x7FFF, 0x7F80, 16, 1.0, _KIND_BF16),
    torch.float16: _Format(0x7FFF, 0x7C00, 13, 2.0**112, _KIND_F16),
}


@numba.njit(**NJIT_OPTIONS)
def _bits(v):
    return np.float32(v).view(np.uint32)


@numba.njit(**NJIT_OPTIONS)
def _float(u):
    return np.uint32(u).view(np.float32)


@numba.njit(**NJIT_OPTIONS)
def _bf16(v):
    """Round a finite fp32 value to bfloat16, nearest with ties to even; the result stays fp32."""
    u = _bits(v)
    return _float((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000))


@numba.njit(**NJIT_OPTIONS)
def _scale_value(byte):
    """fp32 value of an E6M2 byte 0..254: 2^((b >> 2) - 48) * (1 + (b & 3) / 4), built from its bits."""
    return _float((((byte >> 2) + 79) << 23) | ((byte & 3) << 21))


_RECIPROCAL_MANTISSA = np.array(ref.RECIPROCAL_MANTISSA, dtype=np.float32)


@numba.njit(**NJIT_OPTIONS)
def _reciprocal(byte):
    """bf16(1 / sf) of an E6M2 byte without a division: 2^-E * bf16(1 / (1 + m / 4)) (the power of two
    commutes with the rounding, as 1 / sf is far from the subnormal range)."""
    return _RECIPROCAL_MANTISSA[byte & 3] * _float((127 + 48 - (byte >> 2)) << 23)


_I1 = np.int32(1)
_I2 = np.int32(2)


@numba.njit(**NJIT_OPTIONS)
def _pow2(level):
    """2^level and 2^-level as float32 for an int32 level 0..2 (selects on int32: numba would widen
    shifts and integer arithmetic to 64-bit lanes, halving the vector width)."""
    if level == _I2:
        return _F4, _F_QUARTER
    if level == _I1:
        return _F2, _F_HALF
    return _F1, _F1


@numba.njit(**NJIT_OPTIONS)
def _f16_bits(y):
    """FP16 bits of a finite fp32 value ``y >= 0``, rounded to nearest even (as torch casts)."""
    u = _bits(y)
    normal = (u - np.uint32(0x38000000) + np.uint32(0xFFF) + ((u >> np.uint32(13)) & np.uint32(1))) \
        >> np.uint32(13)
    # Below 2^-14 the FP16 grid is 2^-24, half an fp32 ulp of 0.5: adding 0.5 lets the FPU round.
    subnormal = _bits(y + _F_HALF) - np.uint32(0x3F000000)
    overflow = np.uint32(0x7C00)
    return overflow if y >= _F16_OVERFLOW else subnormal if y < _F16_MIN_NORMAL else normal


@numba.njit(**NJIT_OPTIONS)
def _magnitude(raw, mag_mask, shift, widen):
    """fp32 |x| of one input bit pattern (exact; Inf and NaN give Inf and NaN). ``shift & 31`` tells LLVM
    that a 32-bit shift suffices (numba widens integer arithmetic to 64 bits, halving the vector lanes)."""
    return _float(np.uint32(np.uint32(np.uint32(raw) & mag_mask) << (shift & np.uint32(31)))) * widen


@numba.njit(**_INLINE)
def _group_maxima(src, n, work, mag_mask, inf_mag, shift, widen):
    """The 16 4-group maxima (fp32) of block ``src[n]`` ((blocks, 64) bits) into ``work[_M4 + k]``,
    non-finite elements counted as 0 (compared as magnitude bits, which order like the values). Returns
    (block maximum bits, whether an element was non-finite)."""
    block_max = np.uint32(0)
    any_max = np.uint32(0)  # including non-finite elements
    for k in range(16):
        m = np.uint32(0)
        for p in range(4):
            mag = np.uint32(np.uint32(src[n, 4 * k + p]) & mag_mask)  # np.uint32(): keep 32-bit lanes
            any_max = np.uint32(max(any_max, mag))
            m = np.uint32(max(m, mag if mag < inf_mag else np.uint32(0)))
        work[_M4 + k] = _magnitude(m, mag_mask, shift, widen)
        block_max = np.uint32(max(block_max, m))
    return block_max, any_max >= inf_mag


@numba.njit(**NJIT_OPTIONS)
def _block_scale(block_max):
    """(E6M2 byte, r = bf16(1 / sf)) of a block whose largest finite magnitude is ``block_max`` (fp32)."""
    sf1 = min(max(_bf16(block_max * _C7), _SCALE_MIN), _SCALE_MAX)
    # E6M2 byte = RNE(sf1 / 2^(E - 2)) - 4 + 4 (E + 48) = RNE(y / 32) with y = bf16 bits - (127 - 48) * 128.
    y = np.int64(_bits(sf1) >> np.uint32(16)) - 79 * 128
    byte = (y + 15 + ((y >> 5) & 1)) >> 5
    return byte, _reciprocal(byte)


@numba.njit(**NJIT_OPTIONS)
def _group_flags(m8, m4, r):
    """(e2, e3) as fp32 0 / 1 of a 4-group whose maximum is ``m4`` inside an 8-group whose maximum is
    ``m8`` (fp32); arithmetic instead of branches, so that the 16 groups vectorize."""
    e2 = np.float32(m8 * r >= _F4)
    e3 = np.float32(m4 * r >= _F2 + _F2 * e2)  # (m4 * r) * 2^-e2 >= 2; halving is exact or irrelevant there
    return e2, e3


@numba.njit(**_INLINE)
def _group_shifts(work, r, quarter_sf):
    """Per 4-group k of a block, from its maximum ``work[_M4 + k]``: ``work[_DOWN + k]`` = 2^-(e2 + e3) and
    ``work[_UP + k]`` = 2^(e2 + e3) * sf / 4 (4-groups k and k ^ 1 form an 8-group)."""
    for k in range(16):
        m8 = max(work[_M4 + k], work[_M4 + (k ^ 1)])
        work[_DOWN + k], work[_UP + k] = _level_factors(m8, work[_M4 + k], r, quarter_sf)


@numba.njit(**NJIT_OPTIONS)
def _level_factors(m8, m4, r, quarter_sf):
    """(2^-level, 2^level * sf / 4) of a 4-group, level = e2 + e3 (see _group_flags), branch-free."""
    e2, e3 = _group_flags(m8, m4, r)
    return (_F1 - _F_HALF * e2) * (_F1 - _F_HALF * e3), quarter_sf * (_F1 + e2) * (_F1 + e3)


@numba.njit(**NJIT_OPTIONS)
def _code(w):
    """Element code (0..7, as fp32) of the scaled magnitude ``w = fp32(a * r) * 2^-(e2 + e3)``:
    ``min(floor(4 * bf16(w) + 0.5), 7)``. Clamping w to 1.75 first gives the same codes (bf16(w) >= 1.75
    gives 7 either way) and keeps the sum below 8. bf16 rounding by the FPU: adding 1.5 * 2^(e + 16) to w
    in [2^e, 2^(e + 1)) leaves the sum's ulp at 2^(e - 7), bf16's ulp of w, so the sum rounds w to bf16
    (nearest even); for subnormal w the magic is 0 and the code 0 either way."""
    w = min(w, _F_CODE_MAX)
    magic = _float(_bits(w) & np.uint32(0x7F800000)) * _F_BF16_MAGIC
    v = (w + magic) - magic
    return np.floor(_F4 * v + _F_HALF)


@numba.njit(**_INLINE)
def _quantize_block(src, dst, n, work, mag_mask, inf_mag, shift, widen, to_bits, nan_bits):
    """Fake-quant block ``src[n]`` (input bits, (blocks, 64)) into ``dst[n]`` (output bits, written by
    ``to_bits(y, negative)``); ``work`` is per-task scratch (_scratch). Blocks are rows of 2-D views, not
    slices: a slice costs atomic reference counting per block."""
    block_max, poisoned = _group_maxima(src, n, work, mag_mask, inf_mag, shift, widen)
    byte, r = _block_scale(_magnitude(block_max, mag_mask, shift, widen))
    _group_shifts(work, r, _scale_value(byte) * _F_QUARTER)
    for k in range(16):
        for p in range(4):
            raw = src[n, 4 * k + p]
            a = _magnitude(raw, mag_mask, shift, widen)  # non-finite only in poisoned blocks, rewritten below
            y = _code((a * r) * work[_DOWN + k]) * work[_UP + k]
            dst[n, 4 * k + p] = to_bits(y, (raw < 0) & (a != _F0))
    if poisoned:
        for i in range(BLOCK):
            dst[n, i] = nan_bits


@numba.njit(**NJIT_OPTIONS)
def _bf16_out(y, negative):
    """BF16 bits of an exact fp32 result ``y >= 0`` (at most 6 significant bits) with the sign."""
    return (_bits(y) >> np.uint32(16)) | (np.uint32(negative) << np.uint32(15))


@numba.njit(**NJIT_OPTIONS)
def _f16_out(y, negative):
    """FP16 bits (round to nearest even) of an fp32 result ``y >= 0`` with the sign."""
    return _f16_bits(y) | (np.uint32(negative) << np.uint32(15))


@numba.njit(**NJIT_OPTIONS)
def _f32_out(y, negative):
    """FP32 bits of ``y >= 0`` with the sign."""
    return _bits(y) | (np.uint32(negative) << np.uint32(31))


# Per-task scratch, one float32 array (one base pointer lets LLVM see that the parts never overlap, so
# the 16-group loops vectorize without runtime alias checks): per 4-group k the maximum, 2^-level and
# 2^level * sf / 4 at _M4 + k, _DOWN + k, _UP + k.
_M4, _DOWN, _UP = 0, 16, 32


@numba.njit(**NJIT_OPTIONS)
def _scratch():
    """Per-task work array (see _M4)."""
    return np.empty(48, np.float32)


_bf16_block_maximum, _f16_block_maximum, _f32_block_maximum = (BLOCK_MAXIMUM[f] for f in ("bf16", "f16", "f32"))
_bf16_block_fake_quant, _f16_block_fake_quant, _f32_block_fake_quant = (
    BLOCK_FAKE_QUANT[f] for f in ("bf16", "f16", "f32"))


@numba.njit(**_INLINE)
def _scale_in_registers(block_max, poisoned, dst, n, mag_mask, shift, widen, nan_bits):
    """(r, sf / 4) of block n from its maximum bits, or (0, 0) after writing NaN over a poisoned block."""
    if poisoned:
        for i in range(BLOCK):
            dst[n, i] = nan_bits
        return _F0, _F0
    byte, r = _block_scale(_magnitude(block_max, mag_mask, shift, widen))
    return r, _scale_value(byte) * _F_QUARTER


@numba.njit(**NJIT_OPTIONS)
def _rows_in_registers16(src, dst, first, last, mag_mask, shift, widen, kind, nan_bits):
    """BF16 (kind _KIND_BF16) or FP16 blocks first..last-1 of ``src`` ((blocks, 64) int16 bits) into
    ``dst``, each block's vector steps in vector registers (lowbit.kernels.cpu._hifloat4_blocks), its scale
    here. A function of its own: LLVM's preference for 512-bit vectors, set in the callers, lowers those
    registers' shuffles worse."""
    bf16 = kind == _KIND_BF16
    for n in range(first, last):
        at = np.int64(n) * BLOCK
        block_max, poisoned = _bf16_block_maximum(src, at) if bf16 else _f16_block_maximum(src, at)
        r, quarter_sf = _scale_in_registers(block_max, poisoned, dst, n, mag_mask, shift, widen, nan_bits)
        if poisoned:
            continue
        if bf16:
            _bf16_block_fake_quant(src, at, dst, r, quarter_sf)
        else:
            _f16_block_fake_quant(src, at, dst, r, quarter_sf)


@numba.njit(**NJIT_OPTIONS)
def _rows_in_registers32(src, dst, first, last, mag_mask, shift, widen, nan_bits):
    """The same for FP32 blocks ((blocks, 64) int32 bits)."""
    for n in range(first, last):
        at = np.int64(n) * BLOCK
        block_max, poisoned = _f32_block_maximum(src, at)
        r, quarter_sf = _scale_in_registers(block_max, poisoned, dst, n, mag_mask, shift, widen, nan_bits)
        if not poisoned:
            _f32_block_fake_quant(src, at, dst, r, quarter_sf)


def _task_work(work_like):
    """A task's ``work`` for _fake_quant_rows: _scratch() for the per-group loops (``work_like`` an array), None
    for blocks in vector registers (``work_like`` None)."""


@overload(_task_work, jit_options=NJIT_OPTIONS)
def _task_work_typed(work_like):
    if isinstance(work_like, types.NoneType):
        return lambda work_like: None
    return lambda work_like: _scratch()


def _fake_quant_rows(src, dst, first, last, work, mag_mask, inf_mag, shift, widen, kind, nan_bits):
    """Fake-quant blocks first..last-1 of ``src`` ((blocks, 64) bits) into ``dst`` as the output kind's bits;
    ``work`` is _task_work(...): _scratch() for the per-group loops, None for blocks in registers. The one copy
    of the block code per output kind: the quant-dim-last tasks and each tile call it."""


@overload(_fake_quant_rows, jit_options=NJIT_OPTIONS)
def _fake_quant_rows_typed(src, dst, first, last, work, mag_mask, inf_mag, shift, widen, kind, nan_bits):
    # Only the output kinds of the input's width are compiled (each is a copy of the block code, about a
    # second of compiling): FP32 for 32-bit patterns, BF16 and FP16 for 16-bit ones; and only one route.
    if isinstance(work, types.NoneType):
        if src.dtype.bitwidth == 32:
            def registers32(src, dst, first, last, work, mag_mask, inf_mag, shift, widen, kind, nan_bits):
                _rows_in_registers32(src, dst, first, last, mag_mask, shift, widen, nan_bits)
            return registers32

        def registers16(src, dst, first, last, work, mag_mask, inf_mag, shift, widen, kind, nan_bits):
            _rows_in_registers16(src, dst, first, last, mag_mask, shift, widen, kind, nan_bits)
        return registers16

    if src.dtype.bitwidth == 32:
        def rows_f32(src, dst, first, last, work, mag_mask, inf_mag, shift, widen, kind, nan_bits):
            prefer_512_bit_vectors()
            for n in range(first, last):
                _quantize_block(src, dst, n, work, mag_mask, inf_mag, shift, widen, _f32_out, nan_bits)
        return rows_f32

    def rows_16(src, dst, first, last, work, mag_mask, inf_mag, shift, widen, kind, nan_bits):
        prefer_512_bit_vectors()
        for n in range(first, last):
            if kind == _KIND_BF16:
                _quantize_block(src, dst, n, work, mag_mask, inf_mag, shift, widen, _bf16_out, nan_bits)
            else:
                _quantize_block(src, dst, n, work, mag_mask, inf_mag, shift, widen, _f16_out, nan_bits)
    return rows_16


@numba.njit(**NJIT_OPTIONS)
def _transpose_32(src, src_at, src_stride, dst, dst_at, dst_stride):
    """dst[dst_at + r * dst_stride + c] <- src[src_at + c * src_stride + r] for r, c < 32 (1-D int16 or int32
    arrays of the same type, offsets and strides in elements): one 32 x 32 block of words, or four 16 x 16 blocks
    of 32-bit elements, transposed in registers (lowbit.kernels.cpu._transpose)."""
    src_words, dst_words = src.view(np.int16), dst.view(np.int16)
    if src.itemsize == 2:
        _transpose.transpose_words(src_words, src_at, src_stride, dst_words, dst_at, dst_stride)
        return
    for r in range(0, _BLOCKS_PER_TILE, _transpose.PAIR_BLOCK):
        for c in range(0, _BLOCKS_PER_TILE, _transpose.PAIR_BLOCK):
            _transpose.transpose_pairs(src_words, 2 * (src_at + c * src_stride + r), 2 * src_stride,
                                       dst_words, 2 * (dst_at + r * dst_stride + c), 2 * dst_stride)


@numba.njit(**NJIT_OPTIONS)
def _tile_start(t, tiles_per_row, inner):
    """The flat index of tile ``t``'s first element in an (outer, L, inner) tensor (see _fake_quant_tiles)."""
    return (t // tiles_per_row) * BLOCK * inner + (t % tiles_per_row) * _BLOCKS_PER_TILE


@numba.njit(**NJIT_OPTIONS)
def _prefetch_tile(src, dst, base, inner):
    """Prefetch the first cache line of each of a tile's 64 rows in ``src`` and in ``dst``: the 64 strided rows
    are more streams than the hardware prefetchers follow (on an Intel Xeon Ice Lake, without it the fake quant
    with the quant dim first took about 1.1x the time, its tiles in and out alone on one thread 1.8x:
    benchmarks/results_hifloat4.md, 'Intel Xeon Ice Lake: tiles in registers')."""
    for i in range(BLOCK):
        prefetch(src, base + i * inner)
        prefetch(dst, base + i * inner)


@numba.njit(**NJIT_OPTIONS)
def _fake_quant_tiles(src, dst, first, last, inner, mag_mask, inf_mag, shift, widen, kind, nan_bits, work_like):
    """Fake-quant tiles first..last-1 of an (outer, L, inner) tensor, inner > 1 (``src``, ``dst``: flat).

    Tile t covers 64 rows along the quant dim and up to _BLOCKS_PER_TILE neighbouring columns (one block
    per column). It is copied, transposed, into a scratch tile with each block contiguous, quantized block by
    block as in the quant-dim-last case, and copied back: reading a block's 64 elements in place would
    hit one cache set per element when ``inner`` is a power of two. Full tiles are transposed in registers
    (32 x 32 elements at a time), a last narrower one element by element; the scratch tiles start on a
    64-byte boundary, so that no 64-byte load of a block straddles two cache lines.
    """
    work = _task_work(work_like)
    tile_in = aligned_empty(_BLOCKS_PER_TILE, BLOCK, src.dtype)
    tile_out = aligned_empty(_BLOCKS_PER_TILE, BLOCK, dst.dtype)
    tile_in_flat, tile_out_flat = flat(tile_in), flat(tile_out)
    scratch_row = np.int64(BLOCK)  # not the literal: each literal argument compiles a specialization of its own
    tiles_per_row = (inner + _BLOCKS_PER_TILE - 1) // _BLOCKS_PER_TILE
    prefer_512_bit_vectors()
    for t in range(first, last):
        if t + 1 < last and inner >= _BLOCKS_PER_TILE:  # narrower tiles: one contiguous run, prefetched by the CPU
            _prefetch_tile(src, dst, _tile_start(t + 1, tiles_per_row, inner), inner)
        base = _tile_start(t, tiles_per_row, inner)
        width = min(_BLOCKS_PER_TILE, inner - base % inner)
        if width == _BLOCKS_PER_TILE:
            for half in range(0, BLOCK, _BLOCKS_PER_TILE):
                _transpose_32(src, base + half * inner, inner, tile_in_flat, half, scratch_row)
        else:
            for i in range(BLOCK):
                row = src[base + i * inner:base + i * inner + width]
                for c in range(width):
                    tile_in[c, i] = row[c]
        # np.int64(0), not 0: a literal argument would compile a second specialization of _fake_quant_rows
        _fake_quant_rows(tile_in, tile_out, np.int64(0), width, work, mag_mask, inf_mag, shift, widen, kind,
                         nan_bits)
        if width == _BLOCKS_PER_TILE:
            for half in range(0, BLOCK, _BLOCKS_PER_TILE):
                _transpose_32(tile_out_flat, half, scratch_row, dst, base + half * inner, inner)
        else:
            for i in range(BLOCK):
                row = dst[base + i * inner:base + i * inner + width]
                for c in range(width):
                    row[c] = tile_out[c, i]


@SerialOrParallel
def _fake_quant_kernel(src, dst, n_blocks, inner, mag_mask, inf_mag, shift, widen, kind, nan_bits, work_like):
    """Fake-quant all blocks of (outer, L, inner) bit patterns ``src`` ((n_blocks, 64), C-contiguous) into
    ``dst`` (the same) in parallel tasks of about _BLOCKS_PER_TASK blocks (one parallel loop for both
    layouts: each parallel loop is a function numba compiles); ``work_like``: see _task_work."""
    tiles_per_row = (inner + _BLOCKS_PER_TILE - 1) // _BLOCKS_PER_TILE
    units = n_blocks if inner == 1 else (n_blocks // inner) * tiles_per_row  # blocks or tiles
    per_task = _BLOCKS_PER_TASK if inner == 1 else max(1, _BLOCKS_PER_TASK // _BLOCKS_PER_TILE)
    for task in numba.prange((units + per_task - 1) // per_task):
        prefer_512_bit_vectors()  # the block code is inlined here too
        first = task * per_task
        last = min(units, first + per_task)
        if inner == 1:
            _fake_quant_rows(src, dst, first, last, _task_work(work_like), mag_mask, inf_mag, shift, widen, kind,
                             nan_bits)
        else:
            _fake_quant_tiles(flat(src), flat(dst), first, last, inner, mag_mask, inf_mag, shift, widen, kind,
                              nan_bits, work_like)


@SerialOrParallel
def _pack_kernel(src, scale, value, n_blocks, mag_mask, inf_mag, shift, widen):
    """Pack the blocks of ``src`` ((n_blocks, 64) bits) into ``scale`` (4 bytes per block) and ``value`` (32
    per block)."""
    n_tasks = (n_blocks + _BLOCKS_PER_TASK - 1) // _BLOCKS_PER_TASK
    for task in numba.prange(n_tasks):
        work = _scratch()
        for n in range(task * _BLOCKS_PER_TASK, min(n_blocks, (task + 1) * _BLOCKS_PER_TASK)):
            block_max, poisoned = _group_maxima(src, n, work, mag_mask, inf_mag, shift, widen)
            byte, r = _block_scale(_magnitude(block_max, mag_mask, shift, widen))
            _group_shifts(work, r, _F1)
            e2_flags = 0
            e3_flags = 0
            for j in range(8):
                low = work[_M4 + 2 * j]
                high = work[_M4 + 2 * j + 1]
                e2, e3_low = _group_flags(max(low, high), low, r)
                e3_high = _group_flags(max(low, high), high, r)[1]
                e2_flags = (e2_flags << 1) | np.int64(e2)
                e3_flags = (e3_flags << 2) | (np.int64(e3_low) << 1) | np.int64(e3_high)
            scale[4 * n] = ref.POISON_BYTE if poisoned else byte
            scale[4 * n + 1] = e2_flags
            scale[4 * n + 2] = e3_flags >> 8
            scale[4 * n + 3] = e3_flags & 0xFF
            for i in range(BLOCK // 2):
                nibbles = 0
                for h in range(2):
                    raw = src[n, 2 * i + h]
                    finite = (np.uint32(raw) & mag_mask) < inf_mag  # non-finite: code 0, sign 0
                    a = _magnitude(raw, mag_mask, shift, widen) if finite else _F0
                    code = np.int64(_code((a * r) * work[_DOWN + (2 * i + h) // 4]))
                    nibbles |= (code | (np.int64((raw < 0) & (a != _F0)) << 3)) << (4 * h)
                value[BLOCK // 2 * n + i] = nibbles


@numba.njit(**NJIT_OPTIONS)
def _out_bits(y, negative, kind):
    """Output bits of the exact fp32 result ``y >= 0`` with its sign for the output kind."""
    if kind == _KIND_BF16:
        return _bf16_out(y, negative)
    if kind == _KIND_F16:
        return _f16_out(y, negative)
    return _f32_out(y, negative)


@SerialOrParallel
def _unpack_kernel(scale, value, dst, n_blocks, kind, nan_bits):
    """Decode packed blocks into output bit patterns ``dst`` (64 per block)."""
    n_tasks = (n_blocks + _BLOCKS_PER_TASK - 1) // _BLOCKS_PER_TASK
    for task in numba.prange(n_tasks):
        for n in range(task * _BLOCKS_PER_TASK, min(n_blocks, (task + 1) * _BLOCKS_PER_TASK)):
            byte = np.int64(scale[4 * n])
            if byte == ref.POISON_BYTE:
                for i in range(BLOCK):
                    dst[BLOCK * n + i] = nan_bits
                continue
            quarter_sf = _scale_value(byte) * _F_QUARTER
            e2_flags = np.int64(scale[4 * n + 1])
            e3_flags = (np.int64(scale[4 * n + 2]) << 8) | np.int64(scale[4 * n + 3])
            for i in range(BLOCK):
                level = ((e2_flags >> (7 - i // 8)) & 1) + ((e3_flags >> (15 - i // 4)) & 1)
                nibble = (np.int64(value[BLOCK // 2 * n + i // 2]) >> (4 * (i % 2))) & 0xF
                y = np.float32(nibble & 7) * _pow2(np.int32(level))[0] * quarter_sf  # exact
                dst[BLOCK * n + i] = _out_bits(y, nibble >= 8, kind)


def _bit_view(t: torch.Tensor) -> np.ndarray:
    """Flat numpy view of a contiguous CPU float tensor's bit patterns (int16 / int32)."""
    return as_numpy(t.view(SAME_WIDTH_INT[t.dtype])).reshape(-1)


def _block_view(t: torch.Tensor) -> np.ndarray:
    """(blocks, 64) numpy view of a contiguous CPU float tensor's bit patterns (numel a multiple of 64)."""
    return _bit_view(t).reshape(-1, BLOCK)


def _run(kernel: SerialOrParallel, args: tuple, n_blocks: int) -> None:
    """``kernel(*args)`` on the calling thread for fewer than _ONE_THREAD_BLOCKS blocks (or one thread), else in
    numba's parallel loop, its tasks going to whichever thread is free (robust to a busy core)."""
    if runs_serially(n_blocks, _ONE_THREAD_BLOCKS):
        kernel(*args, serial=True)
        return
    with numba.parallel_chunksize(1):
        kernel(*args, serial=False)


_PER_GROUP_WORK = np.empty(0, np.float32)  # its type selects the per-group loops (_task_work)
# Blocks in vector registers (lowbit.kernels.cpu._hifloat4_blocks) where the CPU has AVX512-BW (0.75x the
# time per BF16 block on an AMD EPYC Zen 5, half for FP16) or AVX2 and F16C (each 512-bit vector two AVX2
# ones; AMD EPYC Zen 3: benchmarks/results_hifloat4.md); the per-group loops otherwise.
BLOCKS_IN_REGISTERS = HAS_AVX512BW or (HAS_AVX2 and HAS_F16C)


class FakeQuant(Kernel):
    """hifloat4_fake_quant on the CPU: contiguous FP16/BF16/FP32 ``x`` along ``qdim`` into contiguous
    ``out`` of the same shape and dtype (the operator validated them); equals the reference bit for bit."""

    def run(self, x: torch.Tensor, qdim: int, *, out: torch.Tensor) -> None:
        qdim %= x.dim()
        fmt = _FORMATS[x.dtype]
        inner = int(np.prod(x.shape[qdim + 1:], dtype=np.int64))
        work_like = None if BLOCKS_IN_REGISTERS else _PER_GROUP_WORK
        args = (_block_view(x), _block_view(out), x.numel() // BLOCK, inner, np.uint32(fmt.mag_mask),
                np.uint32(fmt.inf_mag), np.uint32(fmt.shift), np.float32(fmt.widen), fmt.kind, ref.NAN_BITS[x.dtype],
                work_like)
        _run(_fake_quant_kernel, args, x.numel() // BLOCK)


class Pack(Kernel):
    """hifloat4_pack on the CPU: contiguous 2-D ``x`` into contiguous uint8 ``out = (scale, value)`` of
    shapes (rows, cols / 64, 4) and (rows, cols / 2) (the operator validated them)."""

    def run(self, x: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor]) -> None:
        scale, value = out
        fmt = _FORMATS[x.dtype]
        args = (_block_view(x), as_numpy(scale).reshape(-1), as_numpy(value).reshape(-1), x.numel() // BLOCK,
                np.uint32(fmt.mag_mask), np.uint32(fmt.inf_mag), np.uint32(fmt.shift), np.float32(fmt.widen))
        _run(_pack_kernel, args, x.numel() // BLOCK)


class Unpack(Kernel):
    """hifloat4_unpack on the CPU: contiguous uint8 ``scale`` (rows, n_blocks, 4) and ``value``
    (rows, n_blocks * 32) into contiguous ``out`` (rows, n_blocks * 64) of its dtype (the operator
    validated the shapes: the numba kernel indexes without bounds checks)."""

    def run(self, scale: torch.Tensor, value: torch.Tensor, dtype: torch.dtype | None, *,
            out: torch.Tensor) -> None:
        args = (as_numpy(scale).reshape(-1), as_numpy(value).reshape(-1), _bit_view(out), out.numel() // BLOCK,
                _FORMATS[out.dtype].kind, ref.NAN_BITS[out.dtype])
        _run(_unpack_kernel, args, out.numel() // BLOCK)


FAKE_QUANT = FakeQuant()
PACK = Pack()
UNPACK = Unpack()
