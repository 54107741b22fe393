"""CPU path of WeightQuantBatchMatmul's ``dequant`` algorithm (docs/wqbmm.md, section 'Dequant numerics'):
the int4 weight is decoded, column tile by column tile, to exactly the reference's dequantized weight
``round_D(fl32(fl32(W + offset) * scale))`` in a reused buffer, and torch's GEMM multiplies. Only one tile
of the dense weight exists at a time.

* BF16 x on CPUs with AVX512-BF16 or AMX (``BF16_GEMM``): the tile holds BF16 values (their bit patterns) and
  torch's BF16 GEMM (float32 accumulation, one rounding to BF16) writes the output columns;
* FP16 x, and BF16 x elsewhere: the tile holds the weights (values of x's dtype) widened to float32, x is
  widened, torch's float32 GEMM sums, and the sums are rounded once to x's dtype.

A PackedWeight (the CPU kernel's tiles, lowbit.kernels.cpu.wqbmm) is decoded into (N, K) rows instead, which
the weight-only kernels' GEMM path multiplies (weight_only.run_gemm_path; docs/wqbmm.md, 'Dequant on a
PackedWeight'): the same decoded weights.

NaN outputs are made canonical (FP16 0x7E00, BF16 0x7FC0). The summation order is torch's, not the
reference's ascending k, so the result is within the interval of
``lowbit.formats.wqbmm.dequant_interval`` rather than bit-equal.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import types
from numba.extending import overload

from lowbit.formats import wqbmm as reference
from lowbit.kernels.cpu import _int4_tiles, weight_only
from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu._runtime import (NJIT_OPTIONS, PARALLEL_NJIT_OPTIONS, SerialOrParallel, as_numpy, copy_elements,
                                         parallel_loops_allowed, sync_threads)
from lowbit.kernels.cpu.weight_only import canonical_nan_bf16

TILE_BYTES = 64 << 20  # the dense tile's budget: a whole 4096 x 4096 BF16 weight (32 MiB) is one tile
_COLUMNS = simd.LANES  # columns decoded per step (16 weight bytes)
_ROWS_PER_TASK = 64  # tile rows per parallel iteration
# torch's BF16 GEMM multiplies a (K, N) BF16 tile fast only with BF16 hardware (AVX512-BF16 or AMX): on an
# AMD EPYC Zen 3 (AVX2) an int4 layer at M = 256, N = K = 4096 took 29.6 s this way against 0.45 s for BF16
# F.linear; the float32 GEMM on the widened tile gives the same contract (float32 sums, one rounding)
# (docs/wqbmm.md, 'Dequant numerics').
BF16_GEMM = simd.TORCH_BF16_GEMM_IN_HARDWARE


def packed_is_faster(dtype: torch.dtype) -> bool:
    """Whether a dequant call with x of ``dtype`` runs faster on a PackedWeight than on the raw weight: BF16 x
    where BF16_GEMM and the packed tiles decode 16 columns at a time (AVX512-VBMI). On an Intel Xeon with AMX,
    int4 at M = 256, N = K = 4096: the decode 1.6 -> 0.9 ms, the GEMM in the orientation AMX runs fastest
    (docs/wqbmm.md, 'Dequant on a PackedWeight'); elsewhere the packed decode goes column by column."""
    return dtype == torch.bfloat16 and BF16_GEMM and simd.HAS_AVX512VBMI


@numba.njit(**dict(NJIT_OPTIONS, inline="always"))
def _store_bf16(tile, at, value):
    simd.f32v_store_as_bf16(tile, at, value)


@numba.njit(**dict(NJIT_OPTIONS, inline="always"))
def _store_f16_as_f32(tile, at, value):
    simd.f32v_store(tile, at, simd.f32v_round_to_f16(value))


@numba.njit(**dict(NJIT_OPTIONS, inline="always"))
def _store_bf16_as_f32(tile, at, value):
    simd.f32v_store(tile, at, simd.f32v_round_to_bf16(value))


@numba.njit(**dict(NJIT_OPTIONS, inline="always"))
def _decode_tile(store, weight, scale32, offset32, has_offset, group_size, c0, tile):
    """tile (K, T), BF16 bits (int16, ``store`` = _store_bf16) or float32 FP16 / BF16 values
    (_store_f16_as_f32 / _store_bf16_as_f32) <-
    columns c0 .. c0 + T of ``round_D(fl32(fl32(W + offset) * scale))``. ``weight``: the (K, N/2) uint8
    int4 weight; ``scale32`` / ``offset32``: (K/G, Np) float32, Np = N rounded up to _COLUMNS (zeros past N;
    ``offset32`` is read only with ``has_offset``); c0 a multiple of _COLUMNS."""
    k, half = weight.shape
    n, t = 2 * half, tile.shape[1]
    np_ = scale32.shape[1]
    w_flat, s_flat, o_flat, t_flat = simd.flat(weight), simd.flat(scale32), simd.flat(offset32), simd.flat(tile)
    for task in numba.prange(-(-k // _ROWS_PER_TASK)):
        tail_bytes = np.zeros(_COLUMNS // 2, dtype=np.uint8)
        tail_out = np.zeros(_COLUMNS, dtype=tile.dtype)
        for row in range(task * _ROWS_PER_TASK, min(k, (task + 1) * _ROWS_PER_TASK)):
            g = row // group_size
            for c in range(c0, c0 + t, _COLUMNS):
                count = min(_COLUMNS, n - c)
                if count == _COLUMNS:
                    codes = simd.int4_columns(w_flat, row * half + c // 2)
                else:  # a short last step: its bytes copied, zeros after them
                    tail_bytes[:] = 0
                    copy_elements(tail_bytes, 0, w_flat, row * half + c // 2, count // 2)
                    codes = simd.int4_columns(tail_bytes, 0)
                w = simd.i32v_to_f32v(codes)
                if has_offset:
                    w = simd.f32v_add(w, simd.f32v_load(o_flat, g * np_ + c))
                w = simd.f32v_mul(w, simd.f32v_load(s_flat, g * np_ + c))
                if count == _COLUMNS:
                    store(t_flat, row * t + c - c0, w)
                else:
                    store(tail_out, 0, w)
                    copy_elements(t_flat, row * t + c - c0, tail_out, 0, count)


def _decode_tile_of(weight, scale32, offset32, has_offset, group_size, c0, tile):
    """_decode_tile with the store ``_STORE`` (a bound global)."""
    _decode_tile(_STORE, weight, scale32, offset32, has_offset, group_size, c0, tile)  # noqa: F821


# One kernel per tile dtype (a function passed from Python would keep numba from caching the kernel).
_decode_tile_bf16 = SerialOrParallel(_decode_tile_of, "_decode_tile_bf16", _STORE=_store_bf16)
_decode_tile_f16 = SerialOrParallel(_decode_tile_of, "_decode_tile_f16", _STORE=_store_f16_as_f32)
_decode_tile_bf16_as_f32 = SerialOrParallel(_decode_tile_of, "_decode_tile_bf16_as_f32", _STORE=_store_bf16_as_f32)


# ---- the tiles of a PackedWeight, in the (N, K) orientation (docs/wqbmm.md, 'Dequant on a PackedWeight') ----


_W_TWICE = np.array([j % 16 - 8 for j in range(simd.LANES)], dtype=np.float32)  # W of each table entry (u = W + 8)


def _column_table(tables, at, scale, offset, has_offset, bf16):
    """tables[at .. at + 31] <- ``round_D(fl32(fl32(W + offset) * scale))`` for W = -8 .. 7, twice (the
    offset added only with ``has_offset``): BF16 bits (int16 tables: BF16 x), or float32 values rounded to
    BF16 (``bf16``) or FP16."""


@overload(_column_table, jit_options=NJIT_OPTIONS)
def _column_table_typed(tables, at, scale, offset, has_offset, bf16):
    words = tables.dtype == types.int16

    def column_table(tables, at, scale, offset, has_offset, bf16):
        w = simd.f32v_load(_W_TWICE, 0)
        if has_offset:
            w = simd.f32v_add(w, simd.f32v_splat(offset))
        w = simd.f32v_mul(w, simd.f32v_splat(scale))
        if words:
            _store_bf16(tables, at, w)
        elif bf16:
            _store_bf16_as_f32(tables, at, w)
        else:
            _store_f16_as_f32(tables, at, w)

    return column_table


@numba.njit(**dict(NJIT_OPTIONS, inline="always"))
def _column_row(tiles, scale32, offset32, has_offset, group_size, bf16, col, tables, w_flat, at):
    """w_flat[at + k] <- the dequantized weight of column ``col`` at every row k (element by element)."""
    groups, chunks = scale32.shape[0], group_size // 8
    tile, lane = col // _int4_tiles.COLUMNS // 2, col % (2 * _int4_tiles.COLUMNS)
    for g in range(groups):
        _column_table(tables, 0, scale32[g, col], offset32[g, col], has_offset, bf16)
        base = (tile * groups + g) * chunks * _int4_tiles.CHUNK_BYTES + 4 * lane
        for r in range(group_size):
            byte = np.int32(tiles[base + r // 8 * _int4_tiles.CHUNK_BYTES + r % 4])
            w_flat[at + g * group_size + r] = tables[(byte >> (4 * (r % 8 // 4))) & 15]


def _sixteen_columns(tiles, scale32, offset32, has_offset, group_size, bf16, col, tables, w_flat, at, stride):
    """w_flat[at + c * stride + k] <- the dequantized weight of column ``col + c`` at row k, for c < 16 and
    every k; ``col`` a multiple of 16, ``tables`` room for 16 columns' tables."""


@overload(_sixteen_columns, jit_options=NJIT_OPTIONS)
def _sixteen_columns_typed(tiles, scale32, offset32, has_offset, group_size, bf16, col, tables, w_flat, at, stride):
    if not (simd.HAS_AVX512VBMI and w_flat.dtype == types.int16):
        def by_columns(tiles, scale32, offset32, has_offset, group_size, bf16, col, tables, w_flat, at, stride):
            for c in range(_int4_tiles.COLUMNS):
                _column_row(tiles, scale32, offset32, has_offset, group_size, bf16, col + c, tables, w_flat,
                            at + c * stride)

        return by_columns

    def by_steps(tiles, scale32, offset32, has_offset, group_size, bf16, col, tables, w_flat, at, stride):
        groups, chunks = scale32.shape[0], group_size // 8
        tile, half = col // _int4_tiles.COLUMNS // 2, col // _int4_tiles.COLUMNS % 2
        for g in range(groups):
            for c in range(_int4_tiles.COLUMNS):
                _column_table(tables, 32 * c, scale32[g, col + c], offset32[g, col + c], has_offset, bf16)
            base = (tile * groups + g) * chunks * _int4_tiles.CHUNK_BYTES + 4 * _int4_tiles.COLUMNS * half
            for p in range(group_size // _int4_tiles.ROWS):
                _int4_tiles.int4_rows_words(tiles, base + 4 * _int4_tiles.CHUNK_BYTES * p, tables, w_flat,
                                            at + g * group_size + _int4_tiles.ROWS * p, stride)

    return by_steps


@numba.njit(**NJIT_OPTIONS)
def _packed_tile_rows(tiles, scale32, offset32, has_offset, group_size, bf16, r0, first, end, w):
    """Rows first .. end - 1 of ``w`` (rows, width: float32, or BF16 bits, int16) <- columns r0 + first ...
    of the dequantized (K, N) weight, ``round_D(fl32(fl32(W + offset) * scale))`` as ``_decode_tile``'s, one
    column per row of ``w`` (its first K = groups * G elements): ``tiles``, the 1-D uint8 tiles of a
    PackedWeight (lowbit.kernels.cpu.wqbmm); ``scale32`` / ``offset32``: (K/G, N or more) float32 (the offset
    read only with ``has_offset``); ``bf16``: D is BF16 (else FP16). 16 columns at a time where they start on
    a multiple of 16 (_int4_tiles), else one by one."""
    width = w.shape[1]
    w_flat = simd.flat(w)
    tables = np.empty(_int4_tiles.COLUMNS * simd.LANES, dtype=w.dtype)
    row = first
    while row < end:
        col = r0 + row
        if col % _int4_tiles.COLUMNS == 0 and row + _int4_tiles.COLUMNS <= end:
            _sixteen_columns(tiles, scale32, offset32, has_offset, group_size, bf16, col, tables, w_flat,
                             row * width, width)
            row += _int4_tiles.COLUMNS
        else:
            _column_row(tiles, scale32, offset32, has_offset, group_size, bf16, col, tables, w_flat, row * width)
            row += 1


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _packed_tile(tiles, scale32, offset32, has_offset, group_size, bf16, r0, w):
    """_packed_tile_rows of every row of ``w``, in parallel tasks of the 16-column steps."""
    step = _int4_tiles.COLUMNS
    first_step, end_step = r0 // step, -(-(r0 + w.shape[0]) // step)
    for s in numba.prange(end_step - first_step):
        start = (first_step + s) * step - r0
        _packed_tile_rows(tiles, scale32, offset32, has_offset, group_size, bf16, r0, max(0, start),
                          min(w.shape[0], start + step), w)


PACKED_TILE = (_packed_tile_rows, _packed_tile)


def padded_columns(n: int) -> int:
    """N rounded up to a whole number of decode steps."""
    return -(-n // _COLUMNS) * _COLUMNS


def tile_columns(k: int, n: int, itemsize: int) -> int:
    """Columns per tile: as many as TILE_BYTES hold (a multiple of the decode step, at least one), at most N."""
    return min(n, max(_COLUMNS, TILE_BYTES // (k * itemsize) // _COLUMNS * _COLUMNS))


def workspace_sizes(m: int, k: int, n: int, group_size: int, prepacked: bool = False) -> dict[str, int]:
    """Bytes of the workspace buffers of a dequant call: the float32 scale / offset (K/G, Np); on the raw
    weight the tile (room for either dtype's), and for FP16 x the widened x and one tile's float32 sums; on a
    PackedWeight the GEMM path's scratch (weight_only.gemm_scratch_nbytes, the larger of FP16's and BF16's)."""
    groups, np_ = k // group_size, padded_columns(n)
    scales = {"scale32": 4 * groups * np_, "offset32": 4 * groups * np_}
    if prepacked:
        return {**scales, "gemm": max(weight_only.gemm_scratch_nbytes(m, n, k, dtype)
                                      for dtype in (torch.float16, torch.bfloat16))}
    return {
        **scales,
        "tile": max(k * tile_columns(k, n, 2) * 2, k * tile_columns(k, n, 4) * 4),
        "x32": 4 * m * k,
        "y32": 4 * m * tile_columns(k, n, 4),
    }


def _float32_scales(antiquant_scale: torch.Tensor, antiquant_offset: torch.Tensor | None, view) -> tuple:
    """(scale32, offset32): the (K/G, N) scale and offset widened into (K/G, Np) float32 buffers from ``view``
    (the workspace's, or new ones), zeros past N (the offset's buffer left as it is without an offset)."""
    groups, n = antiquant_scale.shape
    scale32 = view("scale32", torch.float32, (groups, padded_columns(n)))
    offset32 = view("offset32", torch.float32, (groups, padded_columns(n)))
    for wide, narrow in ((scale32, antiquant_scale), (offset32, antiquant_offset)):
        if narrow is not None:
            wide[:, :n].copy_(narrow)
            wide[:, n:].zero_()
    return scale32, offset32


def dequant_packed_into(x: torch.Tensor, tiles: torch.Tensor, antiquant_scale: torch.Tensor,
                        antiquant_offset: torch.Tensor | None, group_size: int, view, out: torch.Tensor) -> None:
    """dequant_into on a PackedWeight's ``tiles`` (the flat uint8 tiles of lowbit.kernels.cpu.wqbmm): the
    weight decoded in the (N, K) orientation (_packed_tile) into the GEMM path of the weight-only kernels
    (weight_only.run_gemm_path: on AMX CPUs y^T = W x^T, transposed), in the workspace's "gemm" buffer. The
    same decoded weights and contract (docs/wqbmm.md, 'Dequant on a PackedWeight')."""
    scale32, offset32 = _float32_scales(antiquant_scale, antiquant_offset, view)
    operands = _packed_operands(tiles, scale32, offset32, antiquant_offset is not None, group_size, x.dtype)
    weight_only.run_gemm_path(PACKED_TILE, operands, x, None, out, scratch=view("gemm", torch.uint8, (-1,)))


def _packed_operands(tiles, scale32, offset32, has_offset: bool, group_size: int, dtype: torch.dtype) -> tuple:
    """PACKED_TILE's operands (before the first column) for x of ``dtype``."""
    return as_numpy(tiles), as_numpy(scale32), as_numpy(offset32), has_offset, group_size, dtype == torch.bfloat16


class BoundDequant:
    """An Int4Linear's prefill ``y.to(dtype) + bias`` after :func:`dequant_packed_into`, with the PackedWeight's
    tiles, the scale, offset and bias fixed: the scale and offset widened once (a copy: its maker makes a new
    one whenever they change), the GEMM path's tile in the calling thread's scratch buffer. ``f(x, m, out) ->
    True``: x (..., K) with M = ``m`` rows and out (..., N), C-contiguous CPU tensors of the scale's dtype, not
    checked here (the caller's); the bias (N,) of that dtype or None (held as it is, not copied), added by
    torch in place. The same bits as the operator's path; every row count (``max_rows``)."""

    max_rows = 1 << 62

    def __init__(self, tiles: torch.Tensor, scale: torch.Tensor, offset, bias, group_size: int) -> None:
        wide = _float32_scales(scale.detach(), None if offset is None else offset.detach(),
                               lambda name, dtype, shape: torch.empty(shape, dtype=dtype))
        self.dtype, self.bias = scale.dtype, None if bias is None else bias.detach()
        self.operands = _packed_operands(tiles, *wide, offset is not None, group_size, scale.dtype)

    def __call__(self, x: torch.Tensor, m: int, out: torch.Tensor) -> bool:
        out = out.view(m, -1)
        weight_only.run_gemm_path(PACKED_TILE, self.operands, x.view(m, -1), None, out)
        if self.bias is not None:
            out.add_(self.bias)
        return True


def dequant_into(x: torch.Tensor, weight: torch.Tensor, antiquant_scale: torch.Tensor,
                 antiquant_offset: torch.Tensor | None, group_size: int, view, out: torch.Tensor) -> None:
    """out (M, N) <- the dequant product, all on the CPU and checked by the kernel's ``run``: x (M, K) FP16 /
    BF16, ``weight`` the contiguous (K, N/2) uint8 int4 weight, scale / offset (K/G, N) in x's dtype;
    ``view(name, dtype, shape)`` gives the workspace buffers of :func:`workspace_sizes`. Allocates nothing
    but torch's GEMM output of a tile that is not all of N."""
    (m, k), n = x.shape, out.shape[1]
    bf16 = x.dtype == torch.bfloat16
    scale32, offset32 = _float32_scales(antiquant_scale, antiquant_offset, view)
    bf16_tile = bf16 and BF16_GEMM
    tile_dtype = torch.bfloat16 if bf16_tile else torch.float32
    columns = tile_columns(k, n, tile_dtype.itemsize)
    decode = _decode_tile_bf16 if bf16_tile else _decode_tile_bf16_as_f32 if bf16 else _decode_tile_f16
    arrays = (as_numpy(weight), as_numpy(scale32), as_numpy(offset32), antiquant_offset is not None, group_size)
    if not bf16_tile:
        x32 = view("x32", torch.float32, (m, k))
        x32.copy_(x)
    for c0 in range(0, n, columns):
        width = min(columns, n - c0)
        tile = view("tile", tile_dtype, (k, width))
        sync_threads()
        decode(*arrays, c0, as_numpy(tile), serial=not parallel_loops_allowed())
        if bf16_tile:
            torch.mm(x, tile, out=out if width == n else out[:, c0 : c0 + width])
        else:
            y32 = view("y32", torch.float32, (m, width))
            torch.mm(x32, tile, out=y32)
            out[:, c0 : c0 + width].copy_(y32 if bf16 else reference.canonicalize_nan(y32))
    if bf16:  # torch rounds a float32 NaN to the BF16 pattern 0xFFFF
        canonical_nan_bf16(as_numpy(out).reshape(-1))
