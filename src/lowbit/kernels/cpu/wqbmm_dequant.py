"""CPU path of WeightQuantBatchMatmul's ``dequant`` algorithm (docs/wqbmm.md, section 'Dequant numerics'):
the int4 weight is decoded, column tile by column tile, to exactly the reference's dequantized weight
``round_D(fl32(fl32(W + offset) * scale))`` in a reused buffer, and torch's GEMM multiplies. Only one tile
of the dense weight exists at a time.

* BF16 x on CPUs with AVX512-BF16 or AMX (``BF16_GEMM``): the tile holds BF16 values (their bit patterns) and
  torch's BF16 GEMM (float32 accumulation, one rounding to BF16) writes the output columns;
* FP16 x, and BF16 x elsewhere: the tile holds the weights (values of x's dtype) widened to float32, x is
  widened, torch's float32 GEMM sums, and the sums are rounded once to x's dtype.

NaN outputs are made canonical (FP16 0x7E00, BF16 0x7FC0). The summation order is torch's, not the
reference's ascending k, so the result is within the interval of
``lowbit.formats.wqbmm.dequant_interval`` rather than bit-equal.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from lowbit.formats import wqbmm as reference
from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu._runtime import NJIT_OPTIONS, PARALLEL_NJIT_OPTIONS, as_numpy, copy_elements, sync_threads
from lowbit.kernels.cpu.weight_only import canonical_nan_bf16

TILE_BYTES = 64 << 20  # the dense tile's budget: a whole 4096 x 4096 BF16 weight (32 MiB) is one tile
_COLUMNS = simd.LANES  # columns decoded per step (16 weight bytes)
_ROWS_PER_TASK = 64  # tile rows per parallel iteration
# torch's BF16 GEMM multiplies a (K, N) BF16 tile fast only with BF16 hardware (AVX512-BF16 or AMX): on an
# AMD EPYC Zen 3 (AVX2) an int4 layer at M = 256, N = K = 4096 took 29.6 s this way against 0.45 s for BF16
# F.linear; the float32 GEMM on the widened tile gives the same contract (float32 sums, one rounding)
# (docs/wqbmm.md, 'Dequant numerics').
BF16_GEMM = simd.TORCH_BF16_GEMM_IN_HARDWARE


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


# One kernel per tile dtype (a function passed from Python would keep numba from caching the kernel).
@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _decode_tile_bf16(weight, scale32, offset32, has_offset, group_size, c0, tile):
    _decode_tile(_store_bf16, weight, scale32, offset32, has_offset, group_size, c0, tile)


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _decode_tile_f16(weight, scale32, offset32, has_offset, group_size, c0, tile):
    _decode_tile(_store_f16_as_f32, weight, scale32, offset32, has_offset, group_size, c0, tile)


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _decode_tile_bf16_as_f32(weight, scale32, offset32, has_offset, group_size, c0, tile):
    _decode_tile(_store_bf16_as_f32, weight, scale32, offset32, has_offset, group_size, c0, tile)


def padded_columns(n: int) -> int:
    """N rounded up to a whole number of decode steps."""
    return -(-n // _COLUMNS) * _COLUMNS


def tile_columns(k: int, n: int, itemsize: int) -> int:
    """Columns per tile: as many as TILE_BYTES hold (a multiple of the decode step, at least one), at most N."""
    return min(n, max(_COLUMNS, TILE_BYTES // (k * itemsize) // _COLUMNS * _COLUMNS))


def workspace_sizes(m: int, k: int, n: int, group_size: int) -> dict[str, int]:
    """Bytes of the workspace buffers of a dequant call: the float32 scale / offset (K/G, Np), the tile (room
    for either dtype's), and for FP16 x the widened x and one tile's float32 sums."""
    groups, np_ = k // group_size, padded_columns(n)
    return {
        "scale32": 4 * groups * np_,
        "offset32": 4 * groups * np_,
        "tile": max(k * tile_columns(k, n, 2) * 2, k * tile_columns(k, n, 4) * 4),
        "x32": 4 * m * k,
        "y32": 4 * m * tile_columns(k, n, 4),
    }


def dequant_into(x: torch.Tensor, weight: torch.Tensor, antiquant_scale: torch.Tensor,
                 antiquant_offset: torch.Tensor | None, group_size: int, view, out: torch.Tensor) -> None:
    """out (M, N) <- the dequant product, all on the CPU and checked by the kernel's ``run``: x (M, K) FP16 /
    BF16, ``weight`` the contiguous (K, N/2) uint8 int4 weight, scale / offset (K/G, N) in x's dtype;
    ``view(name, dtype, shape)`` gives the workspace buffers of :func:`workspace_sizes`. Allocates nothing
    but torch's GEMM output of a tile that is not all of N."""
    (m, k), n = x.shape, out.shape[1]
    groups, np_ = k // group_size, padded_columns(n)
    bf16 = x.dtype == torch.bfloat16
    scale32 = view("scale32", torch.float32, (groups, np_))
    scale32[:, :n].copy_(antiquant_scale)
    scale32[:, n:].zero_()
    offset32 = view("offset32", torch.float32, (groups, np_))
    if antiquant_offset is not None:
        offset32[:, :n].copy_(antiquant_offset)
        offset32[:, n:].zero_()
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
        decode(*arrays, c0, as_numpy(tile))
        if bf16_tile:
            torch.mm(x, tile, out=out if width == n else out[:, c0 : c0 + width])
        else:
            y32 = view("y32", torch.float32, (m, width))
            torch.mm(x32, tile, out=y32)
            out[:, c0 : c0 + width].copy_(y32 if bf16 else reference.canonicalize_nan(y32))
    if bf16:  # torch rounds a float32 NaN to the BF16 pattern 0xFFFF
        canonical_nan_bf16(as_numpy(out).reshape(-1))
