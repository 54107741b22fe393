"""numba kernel for the MSD A16W4 matmul (lowbit.formats.wqbmm), bit-exact with the reference; the kernel
object is :data:`MATMUL` (docs/wqbmm.md, section 'CPU kernel').

Weight tiles (built by ``MATMUL.pack_weight``, or per call into the workspace by ``MATMUL.run``; nothing
is cached): the (K, N) int4 weight as unsigned nibbles ``u = W + 8`` (0..15; padded columns hold 8, i.e. W = 0),
in column tiles of TILE_N = 32 columns (``NB = ceil(N / 32)``), per tile and K-group g, ``G / 8`` chunks of
128 bytes::

    tiles[nb, g, p, lane, j] = u[k0 + j, col] | u[k0 + 4 + j, col] << 4
    k0 = g * G + 8 * p,  col = 32 * nb + lane,  lane < 32,  j < 4

so one chunk is 32 int32 lanes (one per column) whose low nibbles hold 4 consecutive k of one "quad" and
whose high nibbles the next quad: two vpdpbusd per chunk and activation component. Rows are processed
four at a time (then one by one), so each chunk is unpacked once for four rows.

Activations (pre-process, :func:`_msd_preprocess`): per row m and group g the MSD components A1..A3 as
int8 (K values per component; 4 consecutive k read as one int32 "quad" operand), a_max (NaN when the
group holds a NaN or an infinity) and the component sums ``S_i``. Integer matmul of a group:
``Y_i = sum_k A_i[k] * (u[k] - 8) = dpbusd(A_i, u) - 8 * S_i``: exact in int32.

Post-process (per group, per 32 columns, float32 in the reference's order, no FMA):
``c = (Y1 * R1 + Y2 * R2) + Y3 * R3``; ``acc = acc + (c * scale) * a_max``; skipped when a_max = 0.

Templates (same numbers):

* ``basic``: pre-process every row -> integer matmul of every (group, row, column tile) into the workspace
  (``Y_int``, 3 * M * (K/G) * N int32) -> post-process; each stage is a separate parallel loop.
* ``preload``: pre-process, then one fused loop per 32-column tile where each group's integer matmul
  stays in registers and is post-processed at once (no ``Y_int``); the weight stream of the next group
  overlaps the post-processing of this one (out-of-order execution and the hardware prefetcher).

Raw-weight path (:func:`_raw_preload`; docs/wqbmm.md, section 'Raw-weight path'): ``preload`` with a raw
(K, N/2) weight and at most RAW_MAX_ROWS rows reads the raw bytes as they are, row by row (two rows per
``vpmaddubsw``, int16 sums over at most RAW_SPAN_K rows, then int32; the sums in registers, or without
AVX512-BW in an L1 scratch while row pairs stream by: RAW_ROWS_STREAMED), and post-processes with the same
:func:`_accumulate_row`: the same integers, the same float order, the same bits, without the repack.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import numba
import numpy as np
import torch

from lowbit.errors import ShapeError
from lowbit.formats import wqbmm as reference
from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu import wqbmm_dequant as dequant
from lowbit.kernels.cpu._runtime import (NJIT_OPTIONS, SerialOrParallel, as_numpy, bound_njit, call_in_chunks,
                                         int16_array_at, runs_serially, swap_parallel_chunksize)
from lowbit.kernels.cpu.memory import thread_scratch
from lowbit.kernels.wqbmm_kernel import MSD, WqbmmKernel, aligned_offsets

TILE_N = simd.LANES  # columns per register tile (32)
CHUNK_BYTES = 4 * TILE_N  # one weight chunk: TILE_N int32 lanes
# Helpers are inlined into the kernels at numba-IR level: no call boundary, no reference counting of the
# arrays they are passed (which otherwise costs more than the arithmetic in the inner loops).
_INLINE_OPTIONS = dict(NJIT_OPTIONS, inline="always")
_F1, _F2 = np.float32(reference.F1), np.float32(reference.F2)
_FLOAT32_MAX = np.float32(np.finfo(np.float32).max)
_R1, _R2, _R3 = np.float32(reference.R1), np.float32(reference.R2), np.float32(reference.R3)


def padded_n(n: int) -> int:
    """N rounded up to a whole number of TILE_N-column tiles."""
    return -(-n // TILE_N) * TILE_N


@numba.njit(**_INLINE_OPTIONS)
def _unsigned_nibble(weight, kk, col, n):
    """u = W + 8 of column ``col`` at row ``kk`` of the packed (K, N/2) weight; 8 (W = 0) for padding."""
    if col >= n:
        return 8
    byte = np.int32(weight[kk, col >> 1])
    nibble = (byte >> 4) if col & 1 else (byte & 0x0F)
    return nibble ^ 0x08  # two's-complement nibble + 8 == nibble xor 8


@SerialOrParallel
def _pack_tiles(weight, group_size, tiles):
    """tiles (flat uint8, K * padded N / 2 bytes) <- the (K, N/2) uint8 weight (any strides).

    Per (group, chunk p, column tile nb) one 128-byte chunk; the weight rows k0 .. k0 + 7 are read in order.
    In a tile without padding, weight byte b of rows k0 + j and k0 + 4 + j gives lanes 2b (low nibbles)
    and 2b + 1 (high nibbles); u = W + 8 is nibble xor 8, so a byte of two u is the byte xor 0x88.
    """
    k, half = weight.shape
    n = 2 * half
    groups, chunks = k // group_size, group_size // 8
    n_tiles, full_tiles = tiles.size // (k * TILE_N // 2), half // (TILE_N // 2)
    for g in numba.prange(groups):
        for p in range(chunks):
            k0 = g * group_size + 8 * p
            for nb in range(n_tiles):
                base = ((nb * groups + g) * chunks + p) * CHUNK_BYTES
                if nb < full_tiles:
                    c0 = nb * (TILE_N // 2)
                    for j in range(4):
                        for b in range(TILE_N // 2):
                            low, high = np.int32(weight[k0 + j, c0 + b]), np.int32(weight[k0 + 4 + j, c0 + b])
                            tiles[base + 8 * b + j] = np.uint8(((low & 0x0F) | ((high & 0x0F) << 4)) ^ 0x88)
                            tiles[base + 8 * b + 4 + j] = np.uint8(((low >> 4) | (high & 0xF0)) ^ 0x88)
                else:
                    for lane in range(TILE_N):
                        col = TILE_N * nb + lane
                        for j in range(4):
                            low = _unsigned_nibble(weight, k0 + j, col, n)
                            high = _unsigned_nibble(weight, k0 + 4 + j, col, n)
                            tiles[base + 4 * lane + j] = np.uint8(low | (high << 4))


def tiles_nbytes(k: int, n: int) -> int:
    """Bytes of the kernel tiles of a (K, N/2) weight."""
    return k * padded_n(n) // 2


def _pack_into(weight: torch.Tensor, group_size: int, tiles: torch.Tensor) -> None:
    """tiles (flat uint8, :func:`tiles_nbytes` bytes) <- the (K, N/2) uint8 CPU weight; allocates nothing."""
    serial = runs_serially(2 * weight.numel(), _ONE_THREAD_WORK)
    _pack_tiles(as_numpy(weight), group_size, as_numpy(tiles), serial=serial)


def reads_raw_weight(m: int, template: str, prepacked: bool) -> bool:
    """Whether a call reads the raw (K, N/2) weight as it is (:func:`_raw_preload`) instead of repacking it
    into tiles: ``preload`` with at most RAW_MAX_ROWS rows, where one pass over the raw bytes costs less than
    a repack (docs/wqbmm.md, section 'Raw-weight path'). Same bits either way."""
    return not prepacked and template == "preload" and m <= RAW_MAX_ROWS


@dataclass(frozen=True)
class WorkspaceLayout:
    """Byte offsets of the scratch arrays inside one uint8 workspace."""

    m: int
    k: int
    n: int
    group_size: int
    template: str
    raw: bool  # the raw (K, N/2) weight is read as it is (:func:`_raw_preload`)
    offsets: dict
    nbytes: int

    @staticmethod
    def build(m: int, k: int, n: int, group_size: int, template: str, prepacked: bool = False,
              algorithm: str = MSD) -> "WorkspaceLayout":
        """``prepacked``: the caller passes tiles from ``MATMUL.pack_weight``; otherwise the weight is raw and
        either read as it is (:func:`reads_raw_weight`: room for the block sums) or repacked into tiles in the
        workspace on every call. ``algorithm`` "dequant": the buffers of lowbit.kernels.cpu.wqbmm_dequant
        (sized from its tile budget at this call: not cached)."""
        if algorithm != MSD:
            offsets, total = aligned_offsets(dequant.workspace_sizes(m, k, n, group_size, prepacked))
            return WorkspaceLayout(m, k, n, group_size, template, False, offsets, total)
        return WorkspaceLayout._msd(m, k, n, group_size, template, prepacked)

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def _msd(m: int, k: int, n: int, group_size: int, template: str, prepacked: bool) -> "WorkspaceLayout":
        groups, npad = k // group_size, padded_n(n)
        raw = reads_raw_weight(m, template, prepacked)
        if raw:
            block_elements = 3 * m * RAW_BLOCK_N * -(-npad // RAW_BLOCK_N)
            sizes = {"ysum": 4 * block_elements}
        else:
            sizes = {} if prepacked else {"tiles": tiles_nbytes(k, n)}
        sizes.update({
            "x32": 4 * m * k,  # float32 activations
            "a_i8": 3 * m * k,  # A1..A3
            "a_max": 4 * m * groups,
            "a_sum": 4 * 3 * m * groups,
            "y32": 4 * m * npad,  # float32 accumulators
        })
        if npad != n:  # padded copies of scale and offset
            sizes["scale"] = sizes["offset"] = 2 * groups * npad
        if template == "basic":
            sizes["y_int"] = 4 * 3 * m * groups * npad
        offsets, total = aligned_offsets(sizes)
        return WorkspaceLayout(m, k, n, group_size, template, raw, offsets, total)

    def view(self, workspace: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        """The first bytes of buffer ``name`` as a contiguous tensor of ``dtype`` and ``shape`` (-1 allowed:
        the whole buffer)."""
        start, size = self.offsets[name]
        if -1 not in shape:
            size = dtype.itemsize * math.prod(shape)
            if size > self.offsets[name][1]:
                raise ShapeError(f"weight_quant_batch_matmul (CPU): workspace buffer {name!r} has "
                                 f"{self.offsets[name][1]} bytes, {tuple(shape)} {dtype} needs {size}")
        return workspace[start : start + size].view(dtype).view(shape)


@numba.njit(**_INLINE_OPTIONS)
def _msd_preprocess_group(x32, m, g, group_size, a_i8, a_max, a_sum):
    """MSD components of row m, group g: a_i8[m, :, group], a_max[m, g], a_sum[m, :, g]. 32 lanes at a time
    (G is a multiple of 32), each lane in the reference's float32 order; the sums of the components are
    exact in float32 (at most 32 integers of magnitude <= 8 per step)."""
    k = x32.shape[1]
    x_flat, a_flat = simd.flat(x32), simd.flat(a_i8)
    x0 = m * k + g * group_size
    peak = simd.f32v_zero()
    for j in range(0, group_size, simd.LANES):
        peak = simd.f32v_maximum(peak, simd.f32v_abs(simd.f32v_load(x_flat, x0 + j)))
    amax = simd.f32v_max_lane(peak)  # NaN if the group holds a NaN; Inf if an infinity
    s1 = s2 = s3 = np.float32(0.0)
    out0 = (m * 3) * k + g * group_size
    if amax <= _FLOAT32_MAX and amax != 0:
        for j in range(0, group_size, simd.LANES):
            t1 = simd.f32v_mul(simd.f32v_div(simd.f32v_load(x_flat, x0 + j), amax), _F1)
            q1 = simd.f32v_rint(t1)
            t2 = simd.f32v_mul(simd.f32v_sub(t1, q1), _F2)
            q2 = simd.f32v_rint(t2)
            t3 = simd.f32v_mul(simd.f32v_sub(t2, q2), _F2)
            q3 = simd.f32v_rint(t3)
            simd.f32v_store_as_i8(a_flat, out0 + j, q1)
            simd.f32v_store_as_i8(a_flat, out0 + k + j, q2)
            simd.f32v_store_as_i8(a_flat, out0 + 2 * k + j, q3)
            s1 += simd.f32v_sum_tree(q1)
            s2 += simd.f32v_sum_tree(q2)
            s3 += simd.f32v_sum_tree(q3)
    else:
        a_i8[m, :, g * group_size : (g + 1) * group_size] = 0
        if not amax <= _FLOAT32_MAX:
            amax = np.float32(np.nan)
    a_max[m, g] = amax
    a_sum[m, 0, g], a_sum[m, 1, g], a_sum[m, 2, g] = np.int32(s1), np.int32(s2), np.int32(s3)


@SerialOrParallel
def _msd_preprocess(x32, group_size, a_i8, a_max, a_sum):
    """x32 (M, K) float32 -> a_i8 (M, 3, K) int8, a_max (M, K/G) float32, a_sum (M, 3, K/G) int32."""
    groups = a_max.shape[1]
    for task in numba.prange(x32.shape[0] * groups):
        _msd_preprocess_group(x32, task // groups, task % groups, group_size, a_i8, a_max, a_sum)


_SERIAL_PREPROCESS_MAX = 1 << 16  # elements of x up to which the pre-process runs on the calling thread
# Products (rows of x times weights; packing: weights) below which a whole call runs on the calling thread (the
# kernels' serial versions, see SerialOrParallel): waking numba's threads costs more than they save there. An
# int4 layer's decode (M = 1) after a two-thread F.linear, AMD EPYC Zen 3: serial and parallel cost the same at
# 1.2-1.6M weights (1536 x 384: 35-39 us on the calling thread, 49-50 us on two; docs/wqbmm.md, 'Threads').
# On an Intel Xeon, with the bounded spin `import lowbit` sets (README, 'Threads'), two threads were no slower from
# 0.26M weights and faster from 0.5M (each call after an F.linear, one thread against two: 256 x 1024 23 / 22 us,
# 512 x 1024 33 / 28 us, 1024^2 62 / 45 us; benchmarks/results_weight_only.md, 'The bounded spin'): 0.5M there.
# AMD Zen's threshold was measured with threads that slept at once and not since.
_ONE_THREAD_WORK = 3 << 19 if simd.HOST_IS_AMD_ZEN else 1 << 19
_PARALLEL_CHUNK = 4  # prange iterations (32-column tiles) a thread takes at a time (raw-weight blocks: 1)


@numba.njit(**_INLINE_OPTIONS)
def _group_dot(tiles, chunk0, chunks, a_quads, q1, q2, q3):
    """dpbusd sums of one (TILE_N-column tile, group): three I32V (before the -8 * S correction).

    ``chunk0``: byte offset of the group's first chunk; ``q1..q3``: index in ``a_quads`` (int32)
    of the first quad of A1..A3 for this row and group.
    """
    acc1 = simd.i32v_zero()
    acc2 = simd.i32v_zero()
    acc3 = simd.i32v_zero()
    for p in range(chunks):
        packed = simd.i32v_load(tiles, chunk0 + CHUNK_BYTES * p)
        low = simd.low_nibbles(packed)
        high = simd.high_nibbles(packed)
        acc1 = simd.dpbusd(simd.dpbusd(acc1, low, a_quads, q1 + 2 * p), high, a_quads, q1 + 2 * p + 1)
        acc2 = simd.dpbusd(simd.dpbusd(acc2, low, a_quads, q2 + 2 * p), high, a_quads, q2 + 2 * p + 1)
        acc3 = simd.dpbusd(simd.dpbusd(acc3, low, a_quads, q3 + 2 * p), high, a_quads, q3 + 2 * p + 1)
    return acc1, acc2, acc3


@numba.njit(**_INLINE_OPTIONS)
def _group_dot_4rows(tiles, chunk0, chunks, a_quads, q0, row_stride, plane):
    """:func:`_group_dot` of four rows at once: each weight chunk is unpacked once for all of them (12
    accumulators, 24 AVX-512 registers). Row r's A1 quads start at ``q0 + r * row_stride``; A2/A3 follow
    at ``+plane``, ``+2 * plane``. Returns the 12 tiles row by row."""
    a1 = a2 = a3 = b1 = b2 = b3 = c1 = c2 = c3 = d1 = d2 = d3 = simd.i32v_zero()
    qa, qb, qc, qd = q0, q0 + row_stride, q0 + 2 * row_stride, q0 + 3 * row_stride
    p1, p2 = plane, 2 * plane
    for p in range(chunks):
        packed = simd.i32v_load(tiles, chunk0 + CHUNK_BYTES * p)
        lo = simd.low_nibbles(packed)
        hi = simd.high_nibbles(packed)
        i = 2 * p
        a1 = simd.dpbusd(simd.dpbusd(a1, lo, a_quads, qa + i), hi, a_quads, qa + i + 1)
        a2 = simd.dpbusd(simd.dpbusd(a2, lo, a_quads, qa + p1 + i), hi, a_quads, qa + p1 + i + 1)
        a3 = simd.dpbusd(simd.dpbusd(a3, lo, a_quads, qa + p2 + i), hi, a_quads, qa + p2 + i + 1)
        b1 = simd.dpbusd(simd.dpbusd(b1, lo, a_quads, qb + i), hi, a_quads, qb + i + 1)
        b2 = simd.dpbusd(simd.dpbusd(b2, lo, a_quads, qb + p1 + i), hi, a_quads, qb + p1 + i + 1)
        b3 = simd.dpbusd(simd.dpbusd(b3, lo, a_quads, qb + p2 + i), hi, a_quads, qb + p2 + i + 1)
        c1 = simd.dpbusd(simd.dpbusd(c1, lo, a_quads, qc + i), hi, a_quads, qc + i + 1)
        c2 = simd.dpbusd(simd.dpbusd(c2, lo, a_quads, qc + p1 + i), hi, a_quads, qc + p1 + i + 1)
        c3 = simd.dpbusd(simd.dpbusd(c3, lo, a_quads, qc + p2 + i), hi, a_quads, qc + p2 + i + 1)
        d1 = simd.dpbusd(simd.dpbusd(d1, lo, a_quads, qd + i), hi, a_quads, qd + i + 1)
        d2 = simd.dpbusd(simd.dpbusd(d2, lo, a_quads, qd + p1 + i), hi, a_quads, qd + p1 + i + 1)
        d3 = simd.dpbusd(simd.dpbusd(d3, lo, a_quads, qd + p2 + i), hi, a_quads, qd + p2 + i + 1)
    return a1, a2, a3, b1, b2, b3, c1, c2, c3, d1, d2, d3


@numba.njit(**_INLINE_OPTIONS)
def _load_half(bits, index, is_bf16):
    if is_bf16:
        return simd.bf16v_load(bits, index)
    return simd.f16v_load(bits, index)


@numba.njit(**_INLINE_OPTIONS)
def _post_process(acc, y1, y2, y3, s1, s2, s3, amax, scale_bits, offset_bits, index, is_bf16, has_offset):
    """acc + (c * scale) * a_max for one (row, group, TILE_N columns).

    ``y1..y3``: dpbusd sums (before the -8 * S correction), ``s1..s3``: the component sums S_i.
    """
    f1 = simd.i32v_to_f32v(simd.i32v_add_scalar(y1, np.int32(-8 * s1)))
    f2 = simd.i32v_to_f32v(simd.i32v_add_scalar(y2, np.int32(-8 * s2)))
    f3 = simd.i32v_to_f32v(simd.i32v_add_scalar(y3, np.int32(-8 * s3)))
    if has_offset:
        offset = _load_half(offset_bits, index, is_bf16)
        f1 = simd.f32v_add(f1, simd.f32v_mul(offset, np.float32(s1)))
        f2 = simd.f32v_add(f2, simd.f32v_mul(offset, np.float32(s2)))
        f3 = simd.f32v_add(f3, simd.f32v_mul(offset, np.float32(s3)))
    c = simd.f32v_add(simd.f32v_add(simd.f32v_mul(f1, _R1), simd.f32v_mul(f2, _R2)), simd.f32v_mul(f3, _R3))
    term = simd.f32v_mul(simd.f32v_mul(c, _load_half(scale_bits, index, is_bf16)), amax)
    return simd.f32v_add(acc, term)


@numba.njit(**_INLINE_OPTIONS)
def _accumulate_row(y_flat, at, m, g, y1, y2, y3, a_max, a_sum, scale_bits, offset_bits, index, is_bf16, has_offset):
    """y_flat[at : at + TILE_N] += this group's term for row m (nothing when a_max = 0)."""
    amax = a_max[m, g]
    if amax != 0:
        acc = simd.f32v_load(y_flat, at)
        acc = _post_process(
            acc, y1, y2, y3, a_sum[m, 0, g], a_sum[m, 1, g], a_sum[m, 2, g], amax, scale_bits, offset_bits, index,
            is_bf16, has_offset,
        )
        simd.f32v_store(y_flat, at, acc)


# A group's step prefetches the packed weight of the group this many groups on: on an Intel Xeon the preload
# GEMV took 0.68 -> 0.46 ms at 4096^2 and 3.60 -> 3.04 ms at 12288 x 8192 (one group and four groups ahead:
# 0.50 / 0.52 ms; benchmarks/results_wqbmm.md, 'Intel Xeon').
_PREFETCH_GROUPS = 2


@SerialOrParallel
def _preload(tiles, a_quads, a_max, a_sum, scale_bits, offset_bits, group_size, is_bf16, has_offset, y32):
    """Fused integer matmul + post-process; y32 (M, padded N) float32 is overwritten."""
    m_rows, groups = a_max.shape
    npad = y32.shape[1]
    quads = groups * group_size // 4
    chunks = group_size // 8
    y_flat = y32.reshape(-1)
    for nb in numba.prange(npad // TILE_N):
        for m in range(m_rows):
            simd.f32v_store(y_flat, m * npad + TILE_N * nb, simd.f32v_zero())
        for g in range(groups):
            chunk0 = (nb * groups + g) * chunks * CHUNK_BYTES
            simd.prefetch_span(tiles, np.uint64(chunk0 + _PREFETCH_GROUPS * chunks * CHUNK_BYTES),
                               chunks * CHUNK_BYTES)
            index = g * npad + TILE_N * nb
            for m in range(0, m_rows - 3, 4):  # rows by fours, then one by one
                q0 = m * 3 * quads + g * group_size // 4
                y = _group_dot_4rows(tiles, chunk0, chunks, a_quads, q0, 3 * quads, quads)
                at = m * npad + TILE_N * nb
                _accumulate_row(
                    y_flat, at, m, g, y[0], y[1], y[2],
                    a_max, a_sum, scale_bits, offset_bits, index, is_bf16, has_offset,
                )
                _accumulate_row(
                    y_flat, at + npad, m + 1, g, y[3], y[4], y[5],
                    a_max, a_sum, scale_bits, offset_bits, index, is_bf16, has_offset,
                )
                _accumulate_row(
                    y_flat, at + 2 * npad, m + 2, g, y[6], y[7], y[8],
                    a_max, a_sum, scale_bits, offset_bits, index, is_bf16, has_offset,
                )
                _accumulate_row(
                    y_flat, at + 3 * npad, m + 3, g, y[9], y[10], y[11],
                    a_max, a_sum, scale_bits, offset_bits, index, is_bf16, has_offset,
                )
            for m in range(m_rows - m_rows % 4, m_rows):
                q0 = m * 3 * quads + g * group_size // 4
                y1, y2, y3 = _group_dot(tiles, chunk0, chunks, a_quads, q0, q0 + quads, q0 + 2 * quads)
                _accumulate_row(
                    y_flat, m * npad + TILE_N * nb, m, g, y1, y2, y3,
                    a_max, a_sum, scale_bits, offset_bits, index, is_bf16, has_offset,
                )
        for m in range(m_rows):
            row = m * npad + TILE_N * nb
            simd.f32v_store(y_flat, row, simd.f32v_canonical_nan(simd.f32v_load(y_flat, row)))


RAW_BLOCK_N = 64 * TILE_N  # columns per parallel task of the raw-weight path (a multiple of TILE_N)
RAW_SPAN_K = 256  # weight rows summed in int16 before widening to int32: 256 * 7 * 15 < 2**15
RAW_PREFETCH_PAIRS = 8  # pairs of rows ahead that _span_streamed prefetches
# Whether the raw path streams the rows (_span_streamed) rather than walking down the columns with its sums in
# registers (_span_in_registers). AVX2's 16 vector registers cannot hold the walk's sums and operands, and
# there the walk, a cache line per row and a 4 KiB page every two rows, outruns the prefetchers: on an AMD
# EPYC Zen 3 the streamed rows took 1.0-1.5 ms against 2.3-2.7 ms (4096 x 4096, one thread, kernel alone).
# CPUs with AVX512-BW keep the walk, measured there at twice the speed of sums kept in memory
# (docs/wqbmm.md, section 'Raw-weight path').
RAW_ROWS_STREAMED = not simd.HAS_AVX512BW
RAW_MAX_ROWS = 16  # M up to which a raw weight is read as it is (above: repacked; docs/wqbmm.md)


@numba.njit(**_INLINE_OPTIONS)
def _raw_span(rows, weight, half, k0, k1, byte0, nbytes, a_i8, a_words, partial, ysum, at):
    """ysum += sum over rows k0..k1-1 (an even count, at most RAW_SPAN_K) of A_i[m, k] * u[k, col] for the
    block's columns: ``ysum[at + (m * 3 + i) * RAW_BLOCK_N + c]`` holds block column c (``2 * byte0 + c``).

    ``weight``: the flat raw bytes (rows of ``half`` bytes); ``a_words``: ``a_i8`` (M, 3, K) viewed as int16,
    one word per two consecutive k. u = W + 8. Per row m, the block's LANES-byte pieces of the rows by
    ``rows``, :func:`_span_in_registers` or :func:`_span_streamed` (``partial``: its int16 scratch, 6 *
    (RAW_BLOCK_N / 2) elements); the block's last ``nbytes % LANES`` bytes one by one.
    """
    m_rows, _, k = a_i8.shape
    vector_bytes = nbytes - nbytes % simd.LANES
    for m in range(m_rows):
        y0 = at + m * 3 * RAW_BLOCK_N
        w0 = (m * 3 * k + k0) // 2  # a_words index of the first pair of A1
        rows(weight, half, k0, k1, byte0, vector_bytes, k, a_words, w0, partial, ysum, y0)
        for j in range(vector_bytes, nbytes):
            for kk in range(k0, k1):
                u = np.int32(weight[kk * half + byte0 + j] ^ 0x88)
                for i in range(3):
                    a = np.int32(a_i8[m, i, kk])
                    ysum[y0 + i * RAW_BLOCK_N + 2 * j] += a * (u & 15)
                    ysum[y0 + i * RAW_BLOCK_N + 2 * j + 1] += a * (u >> 4)


@numba.njit(**_INLINE_OPTIONS)
def _span_in_registers(weight, half, k0, k1, byte0, vector_bytes, k, a_words, w0, partial, ysum, y0):
    """:func:`_raw_span` of one activation row (its A1 pairs from ``a_words[w0]``, its sums at ``ysum[y0]``;
    ``partial`` not used):
    per LANES bytes of the rows (2 * LANES columns), the six int16 sums (3 components x even / odd columns)
    stay in registers while the span's rows stream by two at a time (down the columns). Every product and
    partial sum is a small exact integer (|A| <= 7, u <= 15, at most RAW_SPAN_K rows), so int16 lanes hold
    them exactly. Then they are put back in column order, widened and added to ``ysum``."""
    for j in range(0, vector_bytes, simd.LANES):
        s1 = s2 = s3 = s4 = s5 = s6 = simd.i16v_zero()
        row = k0 * half + byte0 + j
        for p in range((k1 - k0) // 2):
            low, high = simd.u4p_low(weight, row, half), simd.u4p_high(weight, row, half)
            s1 = simd.i16v_maddubs(s1, low, a_words, w0 + p)
            s2 = simd.i16v_maddubs(s2, high, a_words, w0 + p)
            s3 = simd.i16v_maddubs(s3, low, a_words, w0 + k // 2 + p)
            s4 = simd.i16v_maddubs(s4, high, a_words, w0 + k // 2 + p)
            s5 = simd.i16v_maddubs(s5, low, a_words, w0 + k + p)
            s6 = simd.i16v_maddubs(s6, high, a_words, w0 + k + p)
            row += 2 * half
        c = y0 + 2 * j
        _add_zipped(ysum, c, s1, s2)
        _add_zipped(ysum, c + RAW_BLOCK_N, s3, s4)
        _add_zipped(ysum, c + 2 * RAW_BLOCK_N, s5, s6)


@numba.njit(**_INLINE_OPTIONS)
def _span_streamed(weight, half, k0, k1, byte0, vector_bytes, k, a_words, w0, partial, ysum, y0):
    """:func:`_span_in_registers` with the rows read two at a time each from its first to its last byte of
    the block (a stream, prefetched RAW_PREFETCH_PAIRS pairs ahead) and the six int16 sums of every LANES
    bytes kept in ``partial`` (in the L1 cache) instead of registers: the same integers."""
    ahead, last = RAW_PREFETCH_PAIRS * 2 * half, weight.size - 1
    stride = 6 * simd.LANES  # partial's elements per LANES bytes of a row
    partial[: vector_bytes // simd.LANES * stride] = 0
    for p in range((k1 - k0) // 2):
        row = (k0 + 2 * p) * half + byte0
        for j in range(0, vector_bytes, simd.LANES):
            simd.prefetch(weight, min(row + j + ahead, last))
            simd.prefetch(weight, min(row + j + half + ahead, last))
            low, high = simd.u4p_low(weight, row + j, half), simd.u4p_high(weight, row + j, half)
            s = j // simd.LANES * stride
            for i in range(3):
                word = w0 + i * (k // 2) + p
                even, odd = s + 2 * i * simd.LANES, s + (2 * i + 1) * simd.LANES
                simd.i16v_store(partial, even, simd.i16v_maddubs(simd.i16v_load(partial, even), low, a_words, word))
                simd.i16v_store(partial, odd, simd.i16v_maddubs(simd.i16v_load(partial, odd), high, a_words, word))
    for j in range(0, vector_bytes, simd.LANES):
        s = j // simd.LANES * stride
        for i in range(3):
            _add_zipped(ysum, y0 + i * RAW_BLOCK_N + 2 * j, simd.i16v_load(partial, s + 2 * i * simd.LANES),
                        simd.i16v_load(partial, s + (2 * i + 1) * simd.LANES))


@numba.njit(**_INLINE_OPTIONS)
def _add_zipped(ysum, at, even, odd):
    """ysum[at : at + 2 * LANES] += the even / odd column sums in column order (sign-extended)."""
    _add_at(ysum, at, simd.i16v_zip_first(even, odd))
    _add_at(ysum, at + simd.LANES, simd.i16v_zip_second(even, odd))


@numba.njit(**_INLINE_OPTIONS)
def _add_at(ysum, at, y):
    simd.i32v_store(ysum, at, simd.i32v_add(simd.i32v_load(ysum, at), y))


def _raw_preload(weight, a_i8, a_max, a_sum, scale_bits, offset_bits, group_size, is_bf16, has_offset, ysum, y32):
    """The fused MSD matmul reading the flat raw (K * N/2) weight (rows <= RAW_MAX_ROWS); y32 (M, padded N)
    float32 is overwritten. Per RAW_BLOCK_N-column block and group: the group's sums ``sum_k A_i[k] * u[k, n]``
    (:func:`_raw_span` by the bound ``_SPAN_ROWS``, into ``ysum``: 3 * M * RAW_BLOCK_N int32 per block), then
    :func:`_accumulate_row` per TILE_N columns, exactly as :func:`_preload` post-processes its tiles. A
    template: _RAW_PRELOAD holds its kernels."""
    half = weight.size // a_i8.shape[2]
    m_rows, groups = a_max.shape
    npad = y32.shape[1]
    width = RAW_BLOCK_N // 2  # weight bytes per block
    a_words = a_i8.reshape(-1).view(np.int16)
    block_size = 3 * m_rows * RAW_BLOCK_N
    y_flat = y32.reshape(-1)
    for block in numba.prange(-(-npad // RAW_BLOCK_N)):
        partial = np.empty(6 * width, dtype=np.int16)
        col0 = block * RAW_BLOCK_N
        byte0 = col0 // 2
        nbytes = min(width, half - byte0)
        tiles = (min(npad, col0 + RAW_BLOCK_N) - col0) // TILE_N
        at = block * block_size
        for m in range(m_rows):
            y_flat[m * npad + col0 : m * npad + col0 + tiles * TILE_N] = 0
        for g in range(groups):
            ysum[at : at + block_size] = 0
            for k0 in range(g * group_size, (g + 1) * group_size, RAW_SPAN_K):
                k1 = min(k0 + RAW_SPAN_K, (g + 1) * group_size)
                _raw_span(_SPAN_ROWS, weight, half, k0, k1, byte0, nbytes, a_i8, a_words,  # noqa: F821 (bound)
                          partial, ysum, at)
            for m in range(m_rows):
                for t in range(tiles):
                    y0 = at + m * 3 * RAW_BLOCK_N + TILE_N * t
                    y1 = simd.i32v_load(ysum, y0)
                    y2 = simd.i32v_load(ysum, y0 + RAW_BLOCK_N)
                    y3 = simd.i32v_load(ysum, y0 + 2 * RAW_BLOCK_N)
                    _accumulate_row(
                        y_flat, m * npad + col0 + TILE_N * t, m, g, y1, y2, y3,
                        a_max, a_sum, scale_bits, offset_bits, g * npad + col0 + TILE_N * t, is_bf16, has_offset,
                    )
        for m in range(m_rows):
            for t in range(tiles):
                row = m * npad + col0 + TILE_N * t
                simd.f32v_store(y_flat, row, simd.f32v_canonical_nan(simd.f32v_load(y_flat, row)))


# The raw-weight kernels, by RAW_ROWS_STREAMED: each compiles only the row order it reads, so a first call
# compiles one of them.
_raw_preload_streamed = SerialOrParallel(_raw_preload, "_raw_preload_streamed", _SPAN_ROWS=_span_streamed)
_raw_preload_walked = SerialOrParallel(_raw_preload, "_raw_preload_walked", _SPAN_ROWS=_span_in_registers)
_RAW_PRELOAD = {True: _raw_preload_streamed, False: _raw_preload_walked}


@SerialOrParallel
def _basic_matmul(tiles, a_quads, group_size, y_int):
    """Stage 2 of ``basic``: y_int (3, M, K/G, padded N) int32 = dpbusd sums of every group."""
    _, m_rows, groups, npad = y_int.shape
    quads = groups * group_size // 4
    chunks = group_size // 8
    y_flat = y_int.reshape(-1)
    plane = m_rows * groups * npad
    for nb in numba.prange(npad // TILE_N):
        for g in range(groups):
            chunk0 = (nb * groups + g) * chunks * CHUNK_BYTES
            for m in range(0, m_rows - 3, 4):  # rows by fours, then one by one
                q0 = m * 3 * quads + g * group_size // 4
                y = _group_dot_4rows(tiles, chunk0, chunks, a_quads, q0, 3 * quads, quads)
                at = (m * groups + g) * npad + TILE_N * nb
                step = groups * npad  # next row
                _store_y_int(y_flat, at, plane, y[0], y[1], y[2])
                _store_y_int(y_flat, at + step, plane, y[3], y[4], y[5])
                _store_y_int(y_flat, at + 2 * step, plane, y[6], y[7], y[8])
                _store_y_int(y_flat, at + 3 * step, plane, y[9], y[10], y[11])
            for m in range(m_rows - m_rows % 4, m_rows):
                q0 = m * 3 * quads + g * group_size // 4
                y1, y2, y3 = _group_dot(tiles, chunk0, chunks, a_quads, q0, q0 + quads, q0 + 2 * quads)
                _store_y_int(y_flat, (m * groups + g) * npad + TILE_N * nb, plane, y1, y2, y3)


@numba.njit(**_INLINE_OPTIONS)
def _store_y_int(y_flat, at, plane, y1, y2, y3):
    simd.i32v_store(y_flat, at, y1)
    simd.i32v_store(y_flat, plane + at, y2)
    simd.i32v_store(y_flat, 2 * plane + at, y3)


@SerialOrParallel
def _basic_post_process(y_int, a_max, a_sum, scale_bits, offset_bits, is_bf16, has_offset, y32):
    """Stage 3 of ``basic``: y32 (M, padded N) float32 from y_int, group by group in order."""
    _, m_rows, groups, npad = y_int.shape
    y_flat = y_int.reshape(-1)
    plane = m_rows * groups * npad
    for task in numba.prange(m_rows * (npad // TILE_N)):
        m, nb = task // (npad // TILE_N), task % (npad // TILE_N)
        acc = simd.f32v_zero()
        for g in range(groups):
            amax = a_max[m, g]
            if amax == 0:
                continue
            at = (m * groups + g) * npad + TILE_N * nb
            y1 = simd.i32v_load(y_flat, at)
            y2 = simd.i32v_load(y_flat, plane + at)
            y3 = simd.i32v_load(y_flat, 2 * plane + at)
            acc = _post_process(
                acc, y1, y2, y3, a_sum[m, 0, g], a_sum[m, 1, g], a_sum[m, 2, g], amax,
                scale_bits, offset_bits, g * npad + TILE_N * nb, is_bf16, has_offset,
            )
        simd.f32v_store(y32[m], TILE_N * nb, simd.f32v_canonical_nan(acc))


def _padded_bits(t: torch.Tensor, layout: WorkspaceLayout, workspace: torch.Tensor, name: str) -> np.ndarray:
    """Flat int16 bit patterns of a (K/G, N) half tensor, copied into the padded workspace slot if needed."""
    groups, npad = layout.k // layout.group_size, padded_n(layout.n)
    if npad == layout.n:
        return as_numpy(t.contiguous()).reshape(-1)
    padded = layout.view(workspace, name, t.dtype, (groups, npad))
    padded[:, : layout.n].copy_(t)
    padded[:, layout.n :].zero_()
    return as_numpy(padded).reshape(-1)


def _msd_into(
    x: torch.Tensor,
    weight: torch.Tensor,
    antiquant_scale: torch.Tensor,
    antiquant_offset: torch.Tensor | None,
    layout: WorkspaceLayout,
    workspace: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """MSD matmul on CPU into ``out`` (M, N) of x's dtype.

    ``x`` (M, K) FP16/BF16 CPU tensor, ``weight``: the tiles of the packed layout, or the raw
    contiguous (K, N/2) weight when ``layout.raw``; scale/offset (K/G, N) in
    x's dtype, ``workspace`` a uint8 CPU tensor of at least ``layout.nbytes``, all checked by
    ``MATMUL.run``. Allocates nothing.
    """
    m, k, g = layout.m, layout.k, layout.group_size
    groups = k // g
    x32 = layout.view(workspace, "x32", torch.float32, (m, k))
    x32.copy_(x)
    a_i8 = layout.view(workspace, "a_i8", torch.int8, (m, 3, k))
    a_max = layout.view(workspace, "a_max", torch.float32, (m, groups))
    a_sum = layout.view(workspace, "a_sum", torch.int32, (m, 3, groups))
    y32 = layout.view(workspace, "y32", torch.float32, (m, padded_n(layout.n)))
    scale_bits = _padded_bits(antiquant_scale, layout, workspace, "scale")
    has_offset = antiquant_offset is not None
    offset_bits = _padded_bits(antiquant_offset, layout, workspace, "offset") if has_offset else scale_bits
    is_bf16 = x.dtype == torch.bfloat16
    stages = (x32, a_i8, a_max, a_sum, y32, weight, scale_bits, offset_bits, is_bf16, has_offset, layout, workspace)
    if runs_serially(m * k * layout.n, _ONE_THREAD_WORK):
        _run_stages(*stages, serial=True)
    else:
        # Column tiles in small chunks: under numba's TBB layer handed out on demand, so a thread that the OS
        # deschedules on a shared machine does not make the other one wait at the end (docs/architecture.md,
        # 'CPU threads').
        call_in_chunks(1 if layout.raw else _PARALLEL_CHUNK, lambda: _run_stages(*stages, serial=False))
    out.copy_(y32[:, : layout.n])


def _run_stages(x32, a_i8, a_max, a_sum, y32, weight, scale_bits, offset_bits, is_bf16, has_offset, layout, workspace,
                serial: bool):
    """Pre-process, then the stages of the layout's template (numba kernels on workspace views); ``serial``:
    the kernels' serial versions, on the calling thread."""
    m, k, g = layout.m, layout.k, layout.group_size
    groups = k // g
    a_np, amax_np, asum_np, y_np = as_numpy(a_i8), as_numpy(a_max), as_numpy(a_sum), as_numpy(y32)
    _msd_preprocess(as_numpy(x32), g, a_np, amax_np, asum_np, serial=serial or m * k <= _SERIAL_PREPROCESS_MAX)
    a_quads = a_np.reshape(-1).view(np.int32)
    weight_np = as_numpy(weight)
    if layout.raw:
        ysum = as_numpy(layout.view(workspace, "ysum", torch.int32, (-1,)))
        _RAW_PRELOAD[RAW_ROWS_STREAMED](weight_np.reshape(-1), a_np, amax_np, asum_np, scale_bits, offset_bits, g,
                                        is_bf16, has_offset, ysum, y_np, serial=serial)
    elif layout.template == "preload":
        _preload(weight_np, a_quads, amax_np, asum_np, scale_bits, offset_bits, g, is_bf16, has_offset, y_np,
                 serial=serial)
    else:
        y_int = as_numpy(layout.view(workspace, "y_int", torch.int32, (3, m, groups, padded_n(layout.n))))
        _basic_matmul(weight_np, a_quads, g, y_int, serial=serial)
        _basic_post_process(y_int, amax_np, asum_np, scale_bits, offset_bits, is_bf16, has_offset, y_np, serial=serial)


class WeightQuantBatchMatmul(WqbmmKernel):
    """weight_quant_batch_matmul (MSD) on the CPU. Packed weight: the tiles above, a flat uint8 tensor of
    :func:`tiles_nbytes` bytes. Workspace: :class:`WorkspaceLayout` (with room for the tiles unless
    ``prepacked``). Allocates nothing when given a workspace."""

    name = "weight_quant_batch_matmul (CPU)"

    def supports(self, x, weight, antiquant_scale, antiquant_offset, group_size, algorithm, template,
                 workspace=None, prepacked=False):
        """MSD and "dequant", each on the raw (K, N/2) weight or on a PackedWeight of this kernel's tiles
        (docs/wqbmm.md, 'Dequant numerics' and 'Dequant on a PackedWeight')."""
        return None

    def workspace_nbytes(self, m: int, k: int, n: int, group_size: int, template: str, prepacked: bool,
                         algorithm: str = MSD) -> int:
        """Bytes of the call's WorkspaceLayout; for "dequant" on a raw weight at least those of a PackedWeight's
        too (the two lay out different buffers), so that a plan made without ``prepacked`` runs either weight,
        as an MSD plan does."""
        nbytes = WorkspaceLayout.build(m, k, n, group_size, template, prepacked, algorithm).nbytes
        if algorithm != MSD and not prepacked:
            nbytes = max(nbytes, WorkspaceLayout.build(m, k, n, group_size, template, True, algorithm).nbytes)
        return nbytes

    def packed_shape(self, k: int, n: int, group_size: int) -> tuple[int, ...]:
        return (tiles_nbytes(k, n),)

    def pack_weight(self, weight: torch.Tensor, group_size: int) -> torch.Tensor:
        k, n = weight.shape[0], 2 * weight.shape[1]
        tiles = torch.empty(tiles_nbytes(k, n), dtype=torch.uint8)
        _pack_into(weight, group_size, tiles)
        return tiles

    def _compute(self, x, weight, antiquant_scale, antiquant_offset, group_size, algorithm, template, workspace,
                 out, prepacked) -> None:
        m, k = x.shape
        n = out.shape[1]
        layout = WorkspaceLayout.build(m, k, n, group_size, template, prepacked, algorithm)
        if algorithm != MSD:
            run = dequant.dequant_packed_into if prepacked else dequant.dequant_into
            run(x, weight, antiquant_scale, antiquant_offset, group_size,
                lambda name, dtype, shape: layout.view(workspace, name, dtype, shape), out)
            return
        if not prepacked and not layout.raw:
            tiles = layout.view(workspace, "tiles", torch.uint8, (tiles_nbytes(k, n),))
            _pack_into(weight, group_size, tiles)
            weight = tiles
        _msd_into(x, weight, antiquant_scale, antiquant_offset, layout, workspace, out)

    @staticmethod
    def bind_decode(tiles: torch.Tensor, antiquant_scale: torch.Tensor, antiquant_offset: torch.Tensor | None,
                    bias: torch.Tensor | None, group_size: int) -> "BoundDecode":
        """:class:`BoundDecode` of this kernel's packed ``tiles`` (a prepacked weight's data), the (K/G, N)
        scale and offset (FP16 / BF16) and a bias (N,) of their dtype or None, all validated by the caller."""
        return BoundDecode(tiles, antiquant_scale, antiquant_offset, bias, group_size, antiquant_scale.shape[1])

    @staticmethod
    def decode_into(x: torch.Tensor, m: int, tiles: torch.Tensor, antiquant_scale: torch.Tensor,
                    antiquant_offset: torch.Tensor | None, group_size: int, workspace: torch.Tensor | None,
                    out: torch.Tensor) -> bool:
        """``out`` (..., N) <- the MSD ``preload`` product of x (..., K) with M = ``m`` rows and the packed
        ``tiles`` in one numba call (:func:`_decode`), as :meth:`run` computes it, for a plan's run of few rows;
        False, ``out`` unspecified, where that call does not apply (M above :func:`decode_rows`, N not a whole
        number of TILE_N-column tiles) or a NaN came out (run then computes it). x, scale, offset and out
        C-contiguous CPU tensors of one dtype (FP16 / BF16), tiles from :meth:`pack_weight`, ``workspace``
        (None: the thread's scratch buffer) of at least :meth:`workspace_nbytes` bytes for a prepacked
        ``preload`` call, sharing no memory with the others: all checked by the caller."""
        k, n = x.shape[-1], out.shape[-1]
        if m > decode_rows(k) or padded_n(n) != n:
            return False
        parts = _decode_parts(m, k, n, group_size)
        scale_bits = as_numpy(antiquant_scale).reshape(-1)
        offset_bits = scale_bits if antiquant_offset is None else as_numpy(antiquant_offset).reshape(-1)
        operands = (as_numpy(tiles), scale_bits, offset_bits, antiquant_offset is not None, group_size, _NO_BIAS, False)
        decode = _decode_kernel(runs_serially(m * k * n, _ONE_THREAD_WORK))
        with contextlib.nullcontext(workspace) if workspace is not None else thread_scratch(int(parts[-1])) as scratch:
            return decode(x.data_ptr(), m, k, n, x.dtype == torch.bfloat16, *operands, out.data_ptr(),
                          as_numpy(scratch), parts)  # (no workspace: the thread's scratch buffer, as run takes)

    def compile_more(self) -> None:
        """Compile (and cache) :meth:`decode_into`'s serial kernel, which a prepacked plan's run of few rows
        calls and the operator's self-check does not: the warm-up calls this after the self-check passed, so
        that the kernel compiles in a warm-up worker beside the other families (lowbit.kernels.cpu.warm)."""
        k, n, group_size = 64, TILE_N, 64
        tiles = self.pack_weight(torch.zeros(k, n // 2, dtype=torch.uint8), group_size)
        x, scale = torch.zeros(1, k, dtype=torch.float16), torch.ones(1, n, dtype=torch.float16)
        self.decode_into(x, 1, tiles, scale, None, group_size, None, torch.empty(1, n, dtype=x.dtype))

    @staticmethod
    def bind_dequant(tiles: torch.Tensor, antiquant_scale: torch.Tensor, antiquant_offset: torch.Tensor | None,
                     bias: torch.Tensor | None, group_size: int) -> "dequant.BoundDequant":
        """:class:`~lowbit.kernels.cpu.wqbmm_dequant.BoundDequant`, the dequant algorithm's counterpart of
        :meth:`bind_decode` for any number of rows (the same arguments, validated by the caller)."""
        return dequant.BoundDequant(tiles, antiquant_scale, antiquant_offset, bias, group_size)


MATMUL = WeightQuantBatchMatmul()


# ---- Int4Linear's decode in one numba call -------------------------------------------------------------------
# After a torch op (a model's previous layer) each Python, torch or numba call runs with cold caches and costs
# tens of microseconds (docs/weight_only.md, 'One call'); a deploy layer's MSD decode of few rows is one numba
# call here: x widened, the pre-process, the preload product, the rounding to x's dtype and the bias.


@numba.njit(**_INLINE_OPTIONS)
def _widen_rows(x_bits, is_bf16, x32):
    """x32 (M, K) float32 <- x (M, K) FP16 / BF16 bit patterns widened exactly (K a multiple of TILE_N)."""
    x_flat, x32_flat = simd.flat(x_bits), simd.flat(x32)
    for at in range(0, x_bits.size, TILE_N):
        simd.f32v_store(x32_flat, at, _load_half(x_flat, at, is_bf16))


@numba.njit(**_INLINE_OPTIONS)
def _round_and_add_bias(y32, bias32, has_bias, is_bf16, out_bits):
    """out_bits (M, N) <- y32 (M, padded N) rounded to x's dtype, then (``has_bias``) that plus ``bias32``
    (float32, padded N, the bias widened) rounded again: torch's ``y.to(dtype) + bias``. Returns False where
    a NaN came out (torch's NaN bit patterns depend on its code path: the caller computes those calls)."""
    m_rows, n = out_bits.shape
    npad = y32.shape[1]
    nan_above = 0x7F80 if is_bf16 else 0x7C00
    y_flat, chunk = simd.flat(y32), np.empty(TILE_N, dtype=np.int16)
    no_nan = True
    for m in range(m_rows):
        for j in range(0, n, TILE_N):
            value = simd.f32v_load(y_flat, m * npad + j)
            for rounding in range(2 if has_bias else 1):
                if rounding:
                    value = simd.f32v_add(_load_half(chunk, 0, is_bf16), simd.f32v_load(bias32, j))
                if is_bf16:
                    simd.f32v_store_as_bf16(chunk, 0, value)
                else:
                    simd.f32v_store_as_f16(chunk, 0, value)
            for i in range(min(TILE_N, n - j)):
                no_nan &= (chunk[i] & 0x7FFF) <= nan_above
                out_bits[m, j + i] = chunk[i]
    return no_nan


def _decode(x_address, m, k, n, is_bf16, tiles, scale_bits, offset_bits, has_offset, group_size, bias32, has_bias,
            out_address, scratch, parts):
    """Template of the one-call decode (bound by :func:`_decode_kernel`: ``_PRELOAD`` is _preload's serial or
    parallel dispatcher): out (M, N) <- round(round(x @ W) + bias) for x (M, K), both FP16 / BF16 bit
    patterns at ``x_address`` and ``out_address`` (_runtime.int16_array_at), W the prepacked ``tiles``,
    ``scale_bits`` / ``offset_bits`` (K/G, padded N) in x's dtype; the scratch arrays at the byte offsets
    ``parts`` (:func:`_decode_parts`) of ``scratch`` (uint8), or of a new array where ``scratch`` is empty; False
    where a NaN came out (:func:`_round_and_add_bias`)."""
    x_bits, out_bits = int16_array_at(x_address, m, k), int16_array_at(out_address, m, n)
    groups, npad = k // group_size, scale_bits.size // (k // group_size)
    if scratch.size == 0:
        scratch = np.empty(parts[5], dtype=np.uint8)
    x32 = scratch[parts[0]:parts[0] + 4 * m * k].view(np.float32).reshape(m, k)
    _widen_rows(x_bits, is_bf16, x32)
    a_i8 = scratch[parts[1]:parts[1] + 3 * m * k].view(np.int8).reshape(m, 3, k)
    a_max = scratch[parts[2]:parts[2] + 4 * m * groups].view(np.float32).reshape(m, groups)
    a_sum = scratch[parts[3]:parts[3] + 12 * m * groups].view(np.int32).reshape(m, 3, groups)
    _msd_preprocess_serial(x32, group_size, a_i8, a_max, a_sum)
    y32 = scratch[parts[4]:parts[4] + 4 * m * npad].view(np.float32).reshape(m, npad)
    previous = numba.uintp(0)
    if _CHUNK:  # noqa: F821 (bound: 0 in the serial form, whose branches numba prunes: it has no parallel loop)
        previous = swap_parallel_chunksize(numba.uintp(_CHUNK))  # noqa: F821
    _PRELOAD(tiles, a_i8.reshape(-1).view(np.int32), a_max, a_sum, scale_bits,  # noqa: F821 (bound)
             offset_bits, group_size, is_bf16, has_offset, y32)
    if _CHUNK:  # noqa: F821
        swap_parallel_chunksize(previous)
    return _round_and_add_bias(y32, bias32, has_bias, is_bf16, out_bits)


_DECODE_BUFFERS = ("x32", "a_i8", "a_max", "a_sum", "y32")
_NO_SCRATCH = np.empty(0, dtype=np.uint8)  # _decode allocates its own
_NO_BIAS = np.zeros(0, dtype=np.float32)  # with has_bias False: not read


@functools.lru_cache(maxsize=256)
def _decode_parts(m: int, k: int, n: int, group_size: int) -> np.ndarray:
    """int64 [byte offsets of x32, a_i8, a_max, a_sum and y32, total bytes] of the workspace layout of an MSD
    ``preload`` call with a prepacked weight (:class:`WorkspaceLayout`): where :func:`_decode` finds its scratch
    arrays in such a workspace, or in an array it makes."""
    layout = WorkspaceLayout.build(m, k, n, group_size, "preload", prepacked=True)
    parts = np.array([layout.offsets[name][0] for name in _DECODE_BUFFERS] + [layout.nbytes], dtype=np.int64)
    parts.flags.writeable = False
    return parts


_msd_preprocess_serial = _msd_preprocess.serial


def decode_rows(k: int) -> int:
    """The most rows of x (M) the one-call decode takes for K = ``k``: x is pre-processed on the calling thread."""
    return max(1, _SERIAL_PREPROCESS_MAX // k)


@functools.cache  # looked up on every decode_into
def _decode_kernel(serial: bool):
    """The numba dispatcher of :func:`_decode` with the serial or the parallel preload (its loop in chunks of
    _PARALLEL_CHUNK)."""
    preload = _preload.serial if serial else _preload.parallel
    return bound_njit(_decode, "_decode" + ("_serial" if serial else "_parallel"), _PRELOAD=preload,
                      _CHUNK=0 if serial else _PARALLEL_CHUNK)


class BoundDecode:
    """An Int4Linear's product ``round(round(x @ W) + bias)`` (torch's ``y.to(dtype) + bias`` after the MSD
    matmul) for x of few rows, with the weight, scales, offset and bias fixed: one numba call each time.
    Made by :meth:`WeightQuantBatchMatmul.bind_decode`; holds copies of the scales, offset and bias (padded)
    and a view of the packed tiles, so its maker must make a new one whenever those change. ``max_rows``: the
    rows of x it takes (x is pre-processed on the calling thread: a decode step's few rows)."""

    def __init__(self, tiles: torch.Tensor, scale: torch.Tensor, offset, bias, group_size: int, n: int) -> None:
        self.dtype, self.k, self.n = scale.dtype, scale.shape[0] * group_size, n
        npad = padded_n(n)
        self.tiles = as_numpy(tiles)
        self.scale_bits = self._padded_bits(scale, npad)
        self.offset_bits = self.scale_bits if offset is None else self._padded_bits(offset, npad)
        self.bias32 = np.zeros(npad, dtype=np.float32)
        if bias is not None:
            self.bias32[:n] = as_numpy(bias.detach().float())  # the layer's bias may require grad: values only
        self.operands = (self.tiles, self.scale_bits, self.offset_bits, offset is not None, group_size, self.bias32,
                         bias is not None)
        self.is_bf16 = self.dtype == torch.bfloat16
        self.max_rows = decode_rows(self.k)
        self._serial, self._parallel = _decode_kernel(True), _decode_kernel(False)  # compiled on first use
        self.group_size = group_size

    @staticmethod
    def _padded_bits(t: torch.Tensor, npad: int) -> np.ndarray:
        bits = np.zeros((t.shape[0], npad), dtype=np.int16)
        bits[:, : t.shape[1]] = as_numpy(t.detach())
        return bits.reshape(-1)

    def __call__(self, x: torch.Tensor, m: int, out: torch.Tensor) -> bool:
        """out (..., N) <- the product for x (..., K) with M = ``m`` rows (C-contiguous CPU tensors of the scales'
        dtype, M at most ``max_rows``, not checked here: the caller's); False where a NaN came out (out then
        unspecified). The numba call takes their addresses (_runtime.int16_array_at)."""
        decode = self._serial if runs_serially(m * self.k * self.n, _ONE_THREAD_WORK) else self._parallel
        return decode(x.data_ptr(), m, self.k, self.n, self.is_bf16, *self.operands, out.data_ptr(), _NO_SCRATCH,
                      _decode_parts(m, self.k, self.n, self.group_size))
