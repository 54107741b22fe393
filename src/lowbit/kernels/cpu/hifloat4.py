"""HiFloat4 numba kernels: fake-quant over any qdim, pack and unpack, bit for bit equal to
:mod:`lowbit.formats.hifloat4`.

A tensor is seen as (outer, L, inner) around the quant dim; block n covers 64 elements spaced ``inner``
apart. No transposed copy of the tensor is made: with ``inner > 1``, tiles of 64 x 32 blocks side by
side go through a small scratch buffer. Tasks of about 256 blocks run in parallel, scheduled dynamically.

Per block: load (bit patterns -> fp32 magnitudes and signs, non-finite -> 0), encode (every fp32
operation of the reference in the same order; bf16 round-to-nearest-even as integer arithmetic on the
bits; ``bf16(1 / sf)`` from a four-entry table instead of a division), store (``code << level`` times
``sf / 4`` is exact in fp32 and is turned into the output dtype's bits; FP16 rounds to nearest even).
The per-block helpers are inlined so that their 64-element loops vectorize.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from lowbit.formats import hifloat4 as ref
from lowbit.kernels.cpu._runtime import NJIT_OPTIONS, PARALLEL_NJIT_OPTIONS, as_numpy, sync_threads

BLOCK = ref.BLOCK
_TASK_BLOCKS = 256  # blocks per parallel task
_TILE_COLUMNS = 32  # blocks side by side in a tile when the quant dim is not the last

_F0 = np.float32(0.0)
_F_QUARTER = np.float32(0.25)
_F_HALF = np.float32(0.5)
_F1 = np.float32(1.0)
_F2 = np.float32(2.0)
_F4 = np.float32(4.0)
_C7 = np.float32(ref.C7)
_SCALE_MIN = np.float32(ref.SCALE_MIN)
_SCALE_MAX = np.float32(ref.SCALE_MAX)
_F16_MIN_NORMAL = np.float32(2.0**-14)
_F16_OVERFLOW = np.float32(65520.0)  # the smallest fp32 that rounds to +inf in fp16

# Per-block helpers are inlined into their callers in numba IR: a call of a compiled function that takes
# arrays costs atomic reference-count updates per array, more than the block's arithmetic.
_INLINE = dict(NJIT_OPTIONS, inline="always")

# Output kinds (how the fp32 result becomes the output's bits).
_KIND_F32, _KIND_BF16, _KIND_F16 = 0, 1, 2


class _Format:
    """How a dtype's bit pattern (viewed as int16/int32) maps to fp32 and back."""

    def __init__(self, int_view, mag_mask, inf_mag, shift, widen, kind):
        self.int_view = int_view  # torch integer dtype of the same width
        self.mag_mask = mag_mask  # magnitude bits (all but the sign)
        self.inf_mag = inf_mag  # magnitudes >= this are Inf or NaN
        self.shift = shift  # magnitude << shift is the fp32 bit pattern ...
        self.widen = widen  # ... times this factor (2^112 rebiases the FP16 exponent, exact)
        self.kind = kind


_FORMATS = {
    torch.float32: _Format(torch.int32, 0x7FFFFFFF, 0x7F800000, 0, 1.0, _KIND_F32),
    torch.bfloat16: _Format(torch.int16, 0x7FFF, 0x7F80, 16, 1.0, _KIND_BF16),
    torch.float16: _Format(torch.int16, 0x7FFF, 0x7C00, 13, 2.0**112, _KIND_F16),
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


# bf16(1 / (1 + m / 4)) for the E6M2 mantissa m = 0..3 (formats.md 2.2).
_RECIPROCAL_MANTISSA = np.array([1.0, 0.80078125, 0.66796875, 0.5703125], dtype=np.float32)


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


@numba.njit(**_INLINE)
def _load_block(src, a, negative, mag_mask, inf_mag, shift, widen):
    """Read 64 bit patterns ``src`` (a contiguous or strided view) into fp32 magnitudes ``a`` and sign
    flags ``negative`` (x < 0); non-finite elements become 0. Returns whether any was non-finite."""
    poisoned = False
    for i in range(BLOCK):
        raw = src[i]
        mag = np.uint32(raw) & mag_mask
        finite = mag < inf_mag
        poisoned |= not finite
        mag = mag if finite else np.uint32(0)
        a[i] = _float(mag << shift) * widen
        negative[i] = (raw < 0) & (mag != 0)
    return poisoned


@numba.njit(**_INLINE)
def _encode_block(a, m4, code, level):
    """Quantize 64 finite fp32 magnitudes ``a`` (formats.md 2.4).

    Fills ``code`` (0..7) and ``level`` (e2 + e3) per element; ``m4`` (float32[16]) is scratch. Returns
    (E6M2 byte, e2 flags, e3 flags), flags packed most significant bit first (8 and 16 bits).
    """
    block_max = _F0
    for k in range(16):
        m = max(max(a[4 * k], a[4 * k + 1]), max(a[4 * k + 2], a[4 * k + 3]))
        m4[k] = m
        block_max = max(block_max, m)
    sf1 = min(max(_bf16(block_max * _C7), _SCALE_MIN), _SCALE_MAX)
    # E6M2 byte = RNE(sf1 / 2^(E - 2)) - 4 + 4 (E + 48) = RNE(y / 32) with y = bf16 bits - (127 - 48) * 128.
    y = np.int64(_bits(sf1) >> np.uint32(16)) - 79 * 128
    byte = (y + 15 + ((y >> 5) & 1)) >> 5
    r = _reciprocal(byte)

    e2_flags = 0
    e3_flags = 0
    for j in range(8):
        e2 = max(m4[2 * j], m4[2 * j + 1]) * r >= _F4
        e2_flags = (e2_flags << 1) | np.int64(e2)
        for k in range(2 * j, 2 * j + 2):
            t = m4[k] * r
            if e2:
                t = t * _F_HALF
            e3 = t >= _F2
            e3_flags = (e3_flags << 1) | np.int64(e3)
            for i in range(4 * k, 4 * k + 4):
                level[i] = np.int32(e2) + np.int32(e3)

    for i in range(BLOCK):
        v = _bf16((a[i] * r) * _pow2(level[i])[1])
        code[i] = np.int32(min(np.floor(_F4 * v + _F_HALF), _F4 + _F2 + _F1))
    return byte, e2_flags, e3_flags


@numba.njit(**_INLINE)
def _store_block(dst, byte, code, level, negative, kind, nan_bits):
    """Write the decoded block (sign, code / 4 * 2^level * sf) as output bits into the 64-element view
    ``dst``; every element is ``nan_bits`` if ``byte`` is 0xFF."""
    if byte == ref.POISON_BYTE:
        for i in range(BLOCK):
            dst[i] = nan_bits
        return
    quarter_sf = _scale_value(byte) * _F_QUARTER
    if kind == _KIND_F32:
        for i in range(BLOCK):
            y = (np.float32(code[i]) * _pow2(level[i])[0]) * quarter_sf  # exact
            dst[i] = _bits(y) | (np.uint32(negative[i]) << np.uint32(31))
    elif kind == _KIND_BF16:
        for i in range(BLOCK):
            y = (np.float32(code[i]) * _pow2(level[i])[0]) * quarter_sf  # exact, at most 6 significant bits
            dst[i] = (_bits(y) >> np.uint32(16)) | (np.uint32(negative[i]) << np.uint32(15))
    else:
        for i in range(BLOCK):
            y = (np.float32(code[i]) * _pow2(level[i])[0]) * quarter_sf
            dst[i] = _f16_bits(y) | (np.uint32(negative[i]) << np.uint32(15))


@numba.njit(**_INLINE)
def _fake_quant_block(src, dst, scratch, mag_mask, inf_mag, shift, widen, kind, nan_bits):
    """Fake-quant one block: 64-element views ``src`` (input bits) and ``dst`` (output bits)."""
    a, negative, m4, code, level = scratch
    poisoned = _load_block(src, a, negative, mag_mask, inf_mag, shift, widen)
    byte, _, _ = _encode_block(a, m4, code, level)
    _store_block(dst, ref.POISON_BYTE if poisoned else byte, code, level, negative, kind, nan_bits)


@numba.njit(**NJIT_OPTIONS)
def _scratch():
    """Per-task work arrays: magnitudes, signs, 4-group maxima, codes, levels."""
    return (np.empty(BLOCK, np.float32), np.empty(BLOCK, np.bool_), np.empty(16, np.float32),
            np.empty(BLOCK, np.int32), np.empty(BLOCK, np.int32))


@numba.njit(**NJIT_OPTIONS)
def _fake_quant_rows(src, dst, first, last, mag_mask, inf_mag, shift, widen, kind, nan_bits):
    """Fake-quant contiguous blocks first..last-1 (quant dim last) of ``src`` into ``dst``."""
    scratch = _scratch()
    for n in range(first, last):
        _fake_quant_block(src[n * BLOCK:(n + 1) * BLOCK], dst[n * BLOCK:(n + 1) * BLOCK], scratch, mag_mask,
                          inf_mag, shift, widen, kind, nan_bits)


@numba.njit(**NJIT_OPTIONS)
def _fake_quant_tiles(src, dst, first, last, inner, mag_mask, inf_mag, shift, widen, kind, nan_bits):
    """Fake-quant tiles first..last-1 of an (outer, L, inner) tensor, inner > 1.

    Tile t covers 64 rows along the quant dim and up to _TILE_COLUMNS neighbouring columns (one block per
    column). It is copied, transposed, into a scratch tile with each block contiguous, quantized block by
    block as in the quant-dim-last case, and copied back: reading a block's 64 elements in place would
    hit one cache set per element when ``inner`` is a power of two.
    """
    scratch = _scratch()
    tile_in = np.empty(BLOCK * _TILE_COLUMNS, src.dtype)
    tile_out = np.empty(BLOCK * _TILE_COLUMNS, dst.dtype)
    tiles_per_row = (inner + _TILE_COLUMNS - 1) // _TILE_COLUMNS
    for t in range(first, last):
        column = (t % tiles_per_row) * _TILE_COLUMNS
        width = min(_TILE_COLUMNS, inner - column)
        base = (t // tiles_per_row) * BLOCK * inner + column
        for i in range(BLOCK):
            row = src[base + i * inner:base + i * inner + width]
            for c in range(width):
                tile_in[c * BLOCK + i] = row[c]
        for c in range(width):
            _fake_quant_block(tile_in[c * BLOCK:(c + 1) * BLOCK], tile_out[c * BLOCK:(c + 1) * BLOCK], scratch,
                              mag_mask, inf_mag, shift, widen, kind, nan_bits)
        for i in range(BLOCK):
            row = dst[base + i * inner:base + i * inner + width]
            for c in range(width):
                row[c] = tile_out[c * BLOCK + i]


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _fake_quant_kernel(src, dst, n_blocks, inner, mag_mask, inf_mag, shift, widen, kind, nan_bits):
    """Fake-quant all blocks of flat (outer, L, inner) bit patterns ``src`` into ``dst`` in parallel tasks
    of about _TASK_BLOCKS blocks."""
    if inner == 1:
        n_tasks = (n_blocks + _TASK_BLOCKS - 1) // _TASK_BLOCKS
        for task in numba.prange(n_tasks):
            first = task * _TASK_BLOCKS
            _fake_quant_rows(src, dst, first, min(n_blocks, first + _TASK_BLOCKS), mag_mask, inf_mag, shift,
                             widen, kind, nan_bits)
    else:
        n_tiles = (n_blocks // inner) * ((inner + _TILE_COLUMNS - 1) // _TILE_COLUMNS)
        tiles_per_task = max(1, _TASK_BLOCKS // _TILE_COLUMNS)
        n_tasks = (n_tiles + tiles_per_task - 1) // tiles_per_task
        for task in numba.prange(n_tasks):
            first = task * tiles_per_task
            _fake_quant_tiles(src, dst, first, min(n_tiles, first + tiles_per_task), inner, mag_mask, inf_mag,
                              shift, widen, kind, nan_bits)


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _pack_kernel(src, scale, value, n_blocks, mag_mask, inf_mag, shift, widen):
    """Pack contiguous blocks of ``src`` into ``scale`` (4 bytes per block) and ``value`` (32 per block)."""
    n_tasks = (n_blocks + _TASK_BLOCKS - 1) // _TASK_BLOCKS
    for task in numba.prange(n_tasks):
        a, negative, m4, code, level = _scratch()
        for n in range(task * _TASK_BLOCKS, min(n_blocks, (task + 1) * _TASK_BLOCKS)):
            poisoned = _load_block(src[n * BLOCK:(n + 1) * BLOCK], a, negative, mag_mask, inf_mag, shift,
                                   widen)
            byte, e2_flags, e3_flags = _encode_block(a, m4, code, level)
            scale[4 * n] = ref.POISON_BYTE if poisoned else byte
            scale[4 * n + 1] = e2_flags
            scale[4 * n + 2] = e3_flags >> 8
            scale[4 * n + 3] = e3_flags & 0xFF
            for i in range(BLOCK // 2):
                low = code[2 * i] | (np.int32(negative[2 * i]) << 3)
                high = code[2 * i + 1] | (np.int32(negative[2 * i + 1]) << 3)
                value[BLOCK // 2 * n + i] = low | (high << 4)


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _unpack_kernel(scale, value, dst, n_blocks, kind, nan_bits):
    """Decode packed blocks into output bit patterns ``dst`` (64 per block)."""
    n_tasks = (n_blocks + _TASK_BLOCKS - 1) // _TASK_BLOCKS
    for task in numba.prange(n_tasks):
        code = np.empty(BLOCK, np.int32)
        level = np.empty(BLOCK, np.int32)
        negative = np.empty(BLOCK, np.bool_)
        for n in range(task * _TASK_BLOCKS, min(n_blocks, (task + 1) * _TASK_BLOCKS)):
            e2_flags = np.int64(scale[4 * n + 1])
            e3_flags = (np.int64(scale[4 * n + 2]) << 8) | np.int64(scale[4 * n + 3])
            for i in range(BLOCK):
                level[i] = ((e2_flags >> (7 - i // 8)) & 1) + ((e3_flags >> (15 - i // 4)) & 1)
                nibble = (np.int64(value[BLOCK // 2 * n + i // 2]) >> (4 * (i % 2))) & 0xF
                code[i] = nibble & 7
                negative[i] = nibble >= 8
            _store_block(dst[n * BLOCK:(n + 1) * BLOCK], np.int64(scale[4 * n]), code, level, negative, kind,
                         nan_bits)


def _int_view(t: torch.Tensor) -> np.ndarray:
    """Flat numpy view of a contiguous CPU float tensor's bit patterns (int16 / int32)."""
    if not t.is_contiguous():
        raise ValueError(f"HiFloat4 CPU kernels need contiguous tensors, got strides {t.stride()}")
    return as_numpy(t.view(_FORMATS[t.dtype].int_view)).reshape(-1)


def fake_quant_into(x: torch.Tensor, qdim: int, out: torch.Tensor) -> None:
    """HiF4 fake-quant of contiguous CPU ``x`` along ``qdim`` into contiguous ``out`` (same shape and
    dtype); equals :func:`lowbit.formats.hifloat4.fake_quant`. Errors as the reference's check_qdim."""
    qdim = ref.check_qdim(x, qdim)
    if x.numel() == 0:
        return
    fmt = _FORMATS[x.dtype]
    inner = int(np.prod(x.shape[qdim + 1:], dtype=np.int64))
    sync_threads()
    with numba.parallel_chunksize(1):  # tasks go to whichever thread is free (robust to a busy core)
        _fake_quant_kernel(_int_view(x), _int_view(out), x.numel() // BLOCK, inner, np.uint32(fmt.mag_mask),
                           np.uint32(fmt.inf_mag), np.uint32(fmt.shift), np.float32(fmt.widen), fmt.kind,
                           ref.NAN_BITS[x.dtype])


def pack(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AMCT-packed HiF4 bytes of a 2-D CPU tensor; equals :func:`lowbit.formats.hifloat4.pack`."""
    ref.check_pack_input(x)
    rows, cols = x.shape
    scale = torch.empty((rows, cols // BLOCK, 4), dtype=torch.uint8)
    value = torch.empty((rows, cols // 2), dtype=torch.uint8)
    if x.numel():
        fmt = _FORMATS[x.dtype]
        sync_threads()
        with numba.parallel_chunksize(1):
            _pack_kernel(_int_view(x.contiguous()), as_numpy(scale).reshape(-1), as_numpy(value).reshape(-1),
                         x.numel() // BLOCK, np.uint32(fmt.mag_mask), np.uint32(fmt.inf_mag),
                         np.uint32(fmt.shift), np.float32(fmt.widen))
    return scale, value


def unpack(scale: torch.Tensor, value: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode AMCT-packed HiF4 bytes on the CPU; equals :func:`lowbit.formats.hifloat4.unpack`."""
    scale, value = ref.check_packed(scale, value, dtype)
    rows, n_blocks = scale.shape[:2]
    out = torch.empty((rows, n_blocks * BLOCK), dtype=dtype)
    if out.numel():
        fmt = _FORMATS[dtype]
        sync_threads()
        with numba.parallel_chunksize(1):
            _unpack_kernel(as_numpy(scale.contiguous()).reshape(-1), as_numpy(value.contiguous()).reshape(-1),
                           _int_view(out), rows * n_blocks, fmt.kind, ref.NAN_BITS[dtype])
    return out
