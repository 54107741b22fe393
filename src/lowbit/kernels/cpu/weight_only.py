"""Weight-only linear layers on the CPU (numba): the packed weight is decoded in registers, never stored.

Two paths, chosen by the number of rows M of x (``GEMV_MAX_M``):

* **GEMV** (M <= GEMV_MAX_M, decoding): bit-exact with the reference (lowbit.formats.weight_only). The
  64 summation lanes are two F32V registers: one step decodes 64 consecutive weights of a row (k = 64t ..
  64t + 63) into float32 exactly as the reference does, multiplies them by x and adds them to the lanes
  (mul and add; for MXFP4 and HiFloat4 a fused multiply-add where every product of the row is exact, so
  that it gives the same bits, see _fused_bytes; on AVX512-BF16 CPUs, for rows of x that are BF16 values,
  two steps per BF16 dot product where that gives the same bits, see _paired_bytes); then
  :func:`f32v_sum_tree` folds the lanes in the reference's order. Rows are split across threads and
  summed four at a time where they can be (_block_sums); each row's sum is one thread's, in its own
  lanes, so the result does not depend on the thread count.
* **GEMM** (larger M, prefill): tiles of rows are decoded with the same step functions into a float32 (or,
  for weights that are BF16 values and BF16 x, BF16: as words straight from the look-ups on AVX-512) buffer,
  and torch multiplies x by each tile (its order: docs/weight_only.md, 'Tolerance of the GEMM path'; on AMX
  CPUs as y^T = W x^T, then transposed: 'CPU GEMM'); only one tile is ever decoded.

Decoding (docs/weight_only.md, 'Weights'):

* HiFloat8: dequantized in x's dtype, so a row has only 256 weights: they are put in a row table first
  (the bytes of each magnitude's BF16 or FP16 bits for vpermi2b with AVX512-VBMI, or for vpshufb with AVX2
  on CPUs without AVX512-BW; its words with AVX512-BW; otherwise the float32 values, gathered), then each
  code is a look-up.
* MXFP4: the block's 16-entry table (the E2M1 values times its E8M0 scale, the reference's products,
  precomputed for all 256 scale bytes) indexed by the nibbles (vpermps with AVX-512; with AVX2, an 8-entry
  vpermps on its sign-symmetric half, simd.lookup16_signed).
* HiFloat4: the block's 16-entry table (signed c/4 times the E6M2 scale: exact) indexed by the nibbles,
  doubled per lane where the e2 or e3 flag is set (exact: a multiply by 2 under the flags' lane mask, or by
  each lane's 2^(e2 + e3) from a table); on AMD Zen with AVX512-BW, the block's 64-word table.

This module holds the kernel objects (WeightOnlyLinear and the five operators' instances), the choice of
path, the GEMV's input and output in numba, and the GEMM path. The private modules below it, each depending
only on those listed before it: _weight_only_layout (register orders, tables, lane folds),
_weight_only_decode8 and _weight_only_decode4 (decoding in registers), _weight_only_steps (a row's steps,
where fused multiply-adds and BF16 pairs are exact, blocks of rows, x's operands), _weight_only_gemv8 and
_weight_only_gemv4 (the GEMV kernels), _weight_only_tiles (GEMM tiles), _weight_only_batched (batched kernels).
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np
import torch

from lowbit.backends import Kernel
from lowbit.formats import hifloat8
from lowbit.formats import weight_only as reference
from lowbit.kernels.cpu import _code8_columns as _columns
from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu import _transpose
from lowbit.kernels.cpu import amx
from lowbit.kernels.cpu._runtime import (NJIT_OPTIONS, SerialOrParallel, aligned_empty, as_numpy, bound_njit,
                                         call_in_chunks, copy_elements, int16_array_at, run_tasks, runs_serially,
                                         swap_parallel_chunksize)
from lowbit.kernels.cpu._weight_only_batched import (BATCH_IN_BF16, _code8_batched, _code8_batched_rows, _gather_x_bits,
                                                     _hifloat4_batched, _hifloat4_batched_rows, _mxfp4_batched,
                                                     _mxfp4_batched_rows, _mxfp8_batched, _mxfp8_batched_rows)
from lowbit.kernels.cpu._weight_only_decode4 import (PAIR_ORDER, _hifloat4_indexed_operands, _hifloat4_prepare_values,
                                                     _hifloat4_prepared_words)
from lowbit.kernels.cpu._weight_only_decode8 import (CODE8_COLUMNS, CODE8_PAIR_ORDER, CODE8_PAIRS, _NOT_BY_COLUMNS,
                                                     _NO_FAST_ROWS, _NO_SLOW_BLOCKS)
from lowbit.kernels.cpu._weight_only_gemv4 import (_HIFLOAT4_PAIRS, _hifloat4_gemv, _hifloat4_rows, _mxfp4_gemv,
                                                   _mxfp4_rows)
from lowbit.kernels.cpu._weight_only_gemv8 import (_code8_gemv, _code8_gemv_paired, _code8_rows, _code8_rows_paired,
                                                   _mxfp8_gemv, _mxfp8_rows)
from lowbit.kernels.cpu._weight_only_layout import (BYTE_SHUFFLE_NIBBLES, CODE8_SPLIT, FOUR_BIT_SPLIT, GEMV_MAX_M, HALF,
                                                    HIFLOAT4_SPLIT, LANES, _CODE8_ELEMENTS, _E4M3_BF16_BYTES,
                                                    _E4M3_BF16_WORDS, _E4M3_BYTE_TABLES, _E4M3_MAGNITUDES,
                                                    _E4M3_NAN_CODE, _E4M3_VALUES, _E8M0_SCALES, _HIF8_MAGNITUDES,
                                                    _HIFLOAT4_EXPONENTS, _INLINE, _MXFP4_EXPONENTS, _ROWS_PER_TASK,
                                                    _order)
from lowbit.kernels.cpu._weight_only_steps import (_NO_PAIR_SOURCES, _ROW_TABLE_BYTES, _code8_direct_x_operands,
                                                   _code8_x_operands, _four_bit_x_operands, _pair_sources,
                                                   _x_bounds_operands)
from lowbit.kernels.cpu._weight_only_tiles import (_code8_tile, _code8_tile_rows, _hifloat4_tile, _hifloat4_tile_rows,
                                                   _mxfp4_tile, _mxfp4_tile_rows, _mxfp8_tile, _mxfp8_tile_rows)
from lowbit.kernels.cpu.memory import huge_page_empty, scratch_or_thread


# Bytes of one decoded GEMM tile (rows of W in float32 or BF16), decoded into the calling thread's scratch
# buffer (memory.thread_scratch: kept between calls, no page faults). Large tiles mean fewer, wider GEMM calls
# and fewer strided copies of their results: at M = 256, 4 tiles of 1024 rows cost 1.5 ms more than one
# 4096-row F.linear at K = 4096 (AMD EPYC Zen 4); on an Intel Xeon, whose BF16 GEMM runs on AMX tiles, kept
# tiles of 64 MiB took 1.05-1.15x F.linear's time at 12288 x 8192 and 1.25-1.33x at 4096^2, against
# 1.35-1.55x for 16 MiB ones allocated per call (benchmarks/results_weight_only.md, 'Intel Xeon').
GEMM_TILE_BYTES = 64 << 20
# A GEMV over fewer weights runs on one thread: waking numba's threads costs more than they save there
# (AMD Zen, following a torch op: 384^2 MXFP4 38 vs 115 us, 1024^2 92 vs 141 us, 2048^2 equal). Intel's CPUs
# gain from the second thread sooner (Intel Xeon Emerald Rapids, a converted layer at M = 1 after a BF16 F.linear,
# one thread against two: MXFP4 / HiFloat8 1536 x 384 0.078 / 0.106 against 0.079 / 0.129 ms, 1024^2 0.085 / 0.115
# against 0.081 / 0.108, 2048 x 1024 0.151 / 0.202 against 0.126 / 0.180, 1536^2 0.190 / 0.218 against 0.152 /
# 0.187; benchmarks/results_weight_only.md, 'Intel Xeon Emerald Rapids: HiFloat8 and FP8 in BF16 pairs'). With the
# bounded spin `import lowbit` sets (README, 'Threads'; the figures above are of threads that slept at once), an
# Intel Xeon ran 512 x 1024 layers faster on two threads (MXFP4 / HiFloat4 / HiFloat8, one thread against two:
# 43 / 41, 62 / 47, 67 / 54 us) and 256 x 1024 ones no slower (benchmarks/results_weight_only.md, 'The bounded
# spin'): 0.5M there. AMD Zen's threshold was not measured again.
GEMV_ONE_THREAD_WEIGHTS = 3 << 20 if simd.HOST_IS_AMD_ZEN else 1 << 19
_CHUNKS = 32  # prange iterations are handed out in about this many chunks (at least 4 iterations each)
# Rows of x up to which the batched kernels run: with BF16 products, 32; with float32 ones, 64: beyond, the GEMM
# path's float32 GEMM caught up (AMD Zen 3, two threads, 4096^2 and 12288 x 8192: batched 0.17-0.20x F.linear's
# time at M = 64 against 0.22-0.30x, at M = 128 0.17-0.20x against 0.18-0.27x).
BATCH_MAX_M = 32 if BATCH_IN_BF16 else 64
# On CPUs with AMX-BF16, weights of at least AMX_GEMM_WEIGHTS take the GEMM path above AMX_BATCH_MAX_M rows of x,
# that is from M = 5 on: its decode costs the same whatever M is, and a BF16 GEMM on AMX tiles costs little more
# at M = 32 than at M = 1. Since the tiles are decoded as BF16 words and the GEMM runs transposed, the GEMM path
# took 1.36-1.38x F.linear's time at M = 5 against 1.39-1.65x for the batched kernel, 1.30-1.53x against
# 2.19-2.94x at M = 11 and 1.16-1.38x against 2.17-4.48x at M = 12-32 (Intel Xeon, MXFP4 and HiFloat4, 4096^2
# and 12288 x 8192; before, the batched kernel was the faster one up to M = 11). Smaller weights keep the
# batched kernel: there torch's GEMM call and its threads' hand-over cost more than the batched kernel's
# products (1536 x 384 at M = 31: 0.37 ms against 0.47 ms; 2048^2: 1.60 against 0.96 ms;
# benchmarks/results_weight_only.md, 'Intel Xeon').
AMX_BATCH_MAX_M = GEMV_MAX_M
AMX_GEMM_WEIGHTS = 2 << 20


# ---- the GEMV's input and output, in numba (no torch op between a call's start and its end) ------------------


@numba.njit(**_INLINE)
def _widen(bits, count, bf16, widened, chunk):
    """widened (float32, a multiple of HALF long) <- the FP16/BF16 bit patterns (int16) bits[:count] widened
    exactly, zeros past ``count``; ``chunk``: HALF int16 of scratch."""
    for j in range(0, len(widened), HALF):
        if j + HALF <= count:
            source, at = bits, j
        else:  # the last, short chunk (zeros after it)
            chunk[:] = 0
            copy_elements(chunk, 0, bits, j, max(0, count - j))
            source, at = chunk, 0
        value = simd.bf16v_load(source, at) if bf16 else simd.f16v_load(source, at)
        simd.f32v_store(widened, j, value)


@numba.njit(**NJIT_OPTIONS)
def _gather_x(x_bits, bf16, order, x_reg):
    """x_reg (M, Kp) float32 <- x (M, K) FP16/BF16 bit patterns (int16) widened exactly, each 64-element step
    in the register order ``order`` (int32[64]: the element of each register lane), zero past K."""
    m_rows, k = x_bits.shape
    kp = x_reg.shape[1]
    widened = np.zeros(kp, dtype=np.float32)
    chunk = np.zeros(HALF, dtype=np.int16)
    for m in range(m_rows):
        _widen(x_bits[m], k, bf16, widened, chunk)
        for j in range(0, kp, LANES):
            for p in range(LANES):
                x_reg[m, j + p] = widened[j + order[p]]


_NO_BIAS, _BIAS_LIKE_X, _BIAS_FLOAT32 = amx.BIAS_NONE, amx.BIAS_BF16, amx.BIAS_FLOAT32  # _finish's bias kinds


@numba.njit(**NJIT_OPTIONS)
def _finish(y32, bias_bits, bias_kind, bf16, out_bits):
    """The reference's step 4 (lowbit.formats.weight_only.finish) into ``out_bits`` (M, N) int16: fl32(y32 +
    bias), rounded once to BF16 (``bf16``) or FP16, NaN canonical. The bias as int16 bit patterns, by
    ``bias_kind``: _NO_BIAS (none), _BIAS_LIKE_X ((N,), x's dtype: widened exactly) or _BIAS_FLOAT32 ((2N,),
    the float32 values' bits)."""
    m_rows, n = y32.shape
    bias32 = np.zeros(-(-n // HALF) * HALF, dtype=np.float32)
    if bias_kind == _BIAS_LIKE_X:
        _widen(bias_bits, n, bf16, bias32, np.zeros(HALF, dtype=np.int16))
    elif bias_kind == _BIAS_FLOAT32:
        copy_elements(bias32, 0, bias_bits.view(np.float32), 0, n)
    y_chunk = np.zeros(HALF, dtype=np.float32)
    out_chunk = np.zeros(HALF, dtype=np.int16)
    y_flat, out_flat = simd.flat(y32), simd.flat(out_bits)
    for m in range(m_rows):
        for j in range(0, n, HALF):
            count = min(HALF, n - j)
            if count == HALF:  # read and written in place; a short last chunk goes through the scratch chunks
                value = simd.f32v_load(y_flat, m * n + j)
            else:
                copy_elements(y_chunk, 0, y32[m], j, count)
                value = simd.f32v_load(y_chunk, 0)
            if bias_kind != _NO_BIAS:
                value = simd.f32v_add(value, simd.f32v_load(bias32, j))
            target, at = (out_flat, m * n + j) if count == HALF else (out_chunk, 0)
            if bf16:
                simd.f32v_store_as_bf16(target, at, value)
            else:
                simd.f32v_store_as_f16(target, at, value)
            if count < HALF:
                copy_elements(out_bits[m], j, out_chunk, 0, count)


# The canonical-NaN pass over a GEMM's output: words per prange iteration, and the size from which it runs on
# numba's threads (M = 1888, N = 1536: 0.20 ms on one thread, a tenth of the layer's time on an Intel Xeon).
_CANONICAL_TASK_WORDS = 1 << 16
_CANONICAL_ONE_THREAD_WORDS = 1 << 19


def _canonical_nans(bits):
    """Every NaN of BF16 bit patterns (a 1-D int16 array) replaced by the canonical one, in place."""
    size, words = np.uint64(bits.size), np.uint64(_CANONICAL_TASK_WORDS)
    for task in numba.prange((size + words - np.uint64(1)) // words):
        for i in range(np.uint64(task) * words, min(size, (np.uint64(task) + np.uint64(1)) * words)):
            # unsigned i: no negative-index code, so LLVM vectorizes the loop
            bits[i] = _transpose.canonical_word(bits[i])


_CANONICAL_NANS = SerialOrParallel(_canonical_nans)


def canonical_nan_bf16(bits: np.ndarray) -> None:
    """Every NaN of BF16 bit patterns (a 1-D int16 array) replaced by the canonical one, in place; on numba's
    threads from _CANONICAL_ONE_THREAD_WORDS words on, its tasks split evenly among them (chunk size 0, whatever
    the caller's: run_gemm_path's suits the tile decoder's rows)."""
    if runs_serially(bits.size, _CANONICAL_ONE_THREAD_WORDS):
        _CANONICAL_NANS.serial(bits)
    else:
        call_in_chunks(0, _CANONICAL_NANS.parallel, bits)


@numba.njit(**NJIT_OPTIONS)
def transpose_bf16(src, dst):
    """dst (M, N) <- src (N, M) transposed, both C-contiguous int16 (BF16 bits), every NaN the canonical one:
    blocks of 32 x 32 words in registers (_transpose.transpose_block; with non-temporal stores where every
    row of dst starts on a cache line: a new output is then not read before it is written, 0.45-0.6 -> 0.25 ms
    at 4096 x 256 in a layer's call on an Intel Xeon), the edges word by word. The caller checks the shapes."""
    n, m = src.shape
    src_flat, dst_flat = simd.flat(src), simd.flat(dst)
    n_blocks, m_blocks = n - n % _transpose.BLOCK, m - m % _transpose.BLOCK
    streaming = dst.ctypes.data % 64 == 0 and n % _transpose.BLOCK == 0
    for i in range(0, n_blocks, _transpose.BLOCK):
        for j in range(0, m_blocks, _transpose.BLOCK):
            if streaming:
                _transpose.transpose_block_streaming(src_flat, i * m + j, m, dst_flat, j * n + i, n)
            else:
                _transpose.transpose_block(src_flat, i * m + j, m, dst_flat, j * n + i, n)
    if streaming:  # the non-temporal stores ordered before whatever reads dst next
        _transpose.store_fence()
    for j in range(m_blocks, m):  # src's last columns, all its rows
        for i in range(n):
            dst[j, i] = _transpose.canonical_word(src[i, j])
    for i in range(n_blocks, n):  # src's last rows, in the columns the blocks covered
        for j in range(m_blocks):
            dst[j, i] = _transpose.canonical_word(src[i, j])


# ---- kernels -----------------------------------------------------------------------------------------------


_NO_BIAS_BITS = np.zeros(0, dtype=np.int16)


def _bias_bits(bias) -> tuple[np.ndarray, int]:
    """(bias_bits, bias_kind) of _finish for ``bias``: None, (N,) in x's dtype or (N,) float32."""
    if bias is None:
        return _NO_BIAS_BITS, _NO_BIAS
    if bias.dtype == torch.float32:
        return as_numpy(bias).view(np.int16), _BIAS_FLOAT32
    return as_numpy(bias), _BIAS_LIKE_X


def _round_into(y32: np.ndarray, bias, bf16: bool, out: torch.Tensor) -> None:
    """out <- fl32(y32 + bias) rounded to BF16 (``bf16``) or FP16, NaN canonical (_finish)."""
    _finish(y32, *_bias_bits(bias), bf16, as_numpy(out))


@numba.njit(**_INLINE)
def _gemv_arrays(x_bits, bf16, order, n):
    """(x_reg, y32) of a one-call GEMV: x (M, K) FP16 / BF16 bit patterns (int16) gathered into the register
    order (M, Kp) float32, and the (M, N) float32 sums' array."""
    m, k = x_bits.shape
    x_reg = aligned_empty(m, -(-k // LANES) * LANES, np.float32)
    _gather_x(x_bits, bf16, order, x_reg)
    return x_reg, np.empty((m, n), dtype=np.float32)


def _serial_gemv(x_address, m, k, bf16, order, n, operands, x_consts, bias_bits, bias_kind, out_address):
    """A format's whole GEMV on the calling thread in one numba call (bound per format by _one_call_gemv: its
    rows kernel ``_KERNEL`` and x's per-call operands ``_X_OPERANDS``): x (M, K) FP16 / BF16 bit patterns
    at ``x_address`` (int16_array_at) gathered into the register order, W's N rows summed, the reference's
    rounding into the (M, N) int16 array at ``out_address`` (_finish). After a torch op each call from Python,
    and each torch or numpy call between them, runs with cold caches (tens of microseconds each:
    docs/weight_only.md, 'One call')."""
    x_reg, y32 = _gemv_arrays(int16_array_at(x_address, m, k), bf16, order, n)
    _KERNEL(x_reg, *operands, *_X_OPERANDS(x_reg, operands, x_consts), 0, n, y32)  # noqa: F821 (bound per format)
    _finish(y32, bias_bits, bias_kind, bf16, int16_array_at(out_address, m, n))


def _parallel_gemv(x_address, m, k, bf16, order, n, operands, x_consts, bias_bits, bias_kind, out_address,
                   chunksize):
    """_serial_gemv with the rows in numba's parallel loop: ``_KERNEL`` is the format's parallel GEMV (a call
    of it from here launches the threads as a call from Python would), its loop in chunks of ``chunksize``
    iterations, set and put back in here (call_in_chunks from Python: two more calls after other work)."""
    x_reg, y32 = _gemv_arrays(int16_array_at(x_address, m, k), bf16, order, n)
    previous = swap_parallel_chunksize(numba.uintp(chunksize))
    _KERNEL(x_reg, *operands, *_X_OPERANDS(x_reg, operands, x_consts), y32)  # noqa: F821 (bound per format)
    swap_parallel_chunksize(previous)
    _finish(y32, bias_bits, bias_kind, bf16, int16_array_at(out_address, m, n))


def _one_call_gemv(template, kernel, x_operands):
    """The numba dispatcher of ``template`` (_serial_gemv or _parallel_gemv) with ``_KERNEL`` = kernel (the
    format's rows kernel, or its parallel GEMV) and ``_X_OPERANDS`` = x_operands, named after both."""
    return bound_njit(template, f"{template.__name__}{kernel.py_func.__name__}", _KERNEL=kernel,
                      _X_OPERANDS=x_operands)


@numba.njit(**_INLINE)
def _batched_bits_arrays(x_bits, bf16, order, n):
    """_gemv_arrays for the batched kernels where BATCH_IN_BF16: x's BF16 bits in the register order (M, Kp)
    (_gather_x_bits), and the (M, N) float32 sums' array."""
    m, k = x_bits.shape
    x_reg = aligned_empty(m, -(-k // LANES) * LANES, np.int16)
    _gather_x_bits(x_bits, order, x_reg)
    return x_reg, np.empty((m, n), dtype=np.float32)


def _serial_batched(x_address, m, k, bf16, order, n, operands, bias_bits, bias_kind, out_address):
    """WeightOnlyLinear._run_batched in one numba call on the calling thread (bound per format by
    _one_call_batched: its batched rows kernel ``_KERNEL``, and ``_ARRAYS``, x's gather), x and out as for
    _serial_gemv: the same steps, the same bits, without two calls from Python (docs/weight_only.md, 'One
    call')."""
    x_reg, y32 = _ARRAYS(int16_array_at(x_address, m, k), bf16, order, n)  # noqa: F821 (bound)
    _KERNEL(x_reg, *operands, 0, n, y32)  # noqa: F821 (bound per format)
    _finish(y32, bias_bits, bias_kind, bf16, int16_array_at(out_address, m, n))


def _parallel_batched(x_address, m, k, bf16, order, n, operands, bias_bits, bias_kind, out_address):
    """_serial_batched with the rows of W in numba's parallel loop (``_KERNEL``: the format's parallel batched
    kernel), one task (_BATCH_ROWS_PER_TASK rows of W) per chunk."""
    x_reg, y32 = _ARRAYS(int16_array_at(x_address, m, k), bf16, order, n)  # noqa: F821 (bound)
    previous = swap_parallel_chunksize(numba.uintp(1))
    _KERNEL(x_reg, *operands, y32)  # noqa: F821 (bound per format)
    swap_parallel_chunksize(previous)
    _finish(y32, bias_bits, bias_kind, bf16, int16_array_at(out_address, m, n))


def _one_call_batched(template, kernel):
    """The numba dispatcher of ``template`` (_serial_batched or _parallel_batched) with ``_KERNEL`` = kernel and
    x gathered as _run_batched gathers it (BF16 bits where BATCH_IN_BF16, else float32 as the GEMV's)."""
    return bound_njit(template, f"{template.__name__}{kernel.py_func.__name__}", _KERNEL=kernel,
                      _ARRAYS=_batched_bits_arrays if BATCH_IN_BF16 else _gemv_arrays)


# Whether the GEMM path hands BF16 x to torch's BF16 GEMM (on BF16 tiles) rather than its float32 GEMM: only
# where the CPU multiplies BF16 in hardware (simd.TORCH_BF16_GEMM_IN_HARDWARE). Without AVX512-BF16 or AMX
# (AMD Zen 3, Intel Xeon before Cooper Lake) torch's BF16 GEMM, and F.linear in BF16, ran 3.5-4x slower than
# its float32 one (docs/weight_only.md, 'Kernels').
BF16_GEMM = simd.TORCH_BF16_GEMM_IN_HARDWARE
# On CPUs with AMX-BF16 the GEMM path computes y^T = W x^T and transposes it: torch's BF16 GEMM took 20-35 %
# less time with the (N, K) weight tile as its first operand than as F.linear's second, which oneDNN repacks
# on every call (Intel Xeon, M = 64-256: docs/weight_only.md, 'CPU GEMM');
# not where the (N, M) result passes TRANSPOSED_GEMM_BYTES (M = 1024 gained 8 %, and the buffer is kept).
TRANSPOSED_GEMM = simd.HAS_AMX_BF16
TRANSPOSED_GEMM_BYTES = 16 << 20
# Only for weights whose N and K are both at least TRANSPOSED_MIN_SIDE, and past TRANSPOSED_MAX_M rows of x only
# where K is at least TRANSPOSED_LONG_K: elsewhere the transpose costs more than the GEMM gains (Intel Xeon
# Emerald Rapids, the GEMM and transpose alone, over F.linear's orientation: K = 384 1.10-1.89x at M = 32-1888;
# N = K = 1536 0.80-0.91x up to M = 512, 1.00-1.11x from 1024; K = 1536, N = 4096 1.03-1.12x from 1024; K = 4096,
# N = 1536 or 4096 0.62-0.92x at every M; all-MiniLM-L6-v2's layers at M = 1024: 1.3-1.5x as long in the layer;
# benchmarks/results_weight_only.md, 'Intel Xeon Emerald Rapids: the GEMM's orientation by shape').
TRANSPOSED_MIN_SIDE = 1536
TRANSPOSED_MAX_M = 512
TRANSPOSED_LONG_K = 4096
# Its tiles: M = 256 on the Intel Xeon, 4096^2 in tiles of 2048 rows (16 MiB) took 5.2 ms against 5.8 ms in one
# tile, 12288 x 8192 in tiles of 1024 rows 33.9 against 35.6 ms (the decoded rows still in the cache when the
# GEMM reads them); 256-row tiles were slower (a GEMM call's own cost).
TRANSPOSED_TILE_BYTES = 16 << 20


def _gemm_tile_bytes(transposed: bool) -> int:
    """The GEMM path's tile budget: GEMM_TILE_BYTES, capped by TRANSPOSED_TILE_BYTES for the transposed GEMM."""
    return min(GEMM_TILE_BYTES, TRANSPOSED_TILE_BYTES) if transposed else GEMM_TILE_BYTES


def _gemv_chunksize(n: int) -> int:
    """prange iterations of the GEMV's N rows a thread takes at a time (about _CHUNKS chunks, at least 4)."""
    return max(4, -(-n // _ROWS_PER_TASK) // _CHUNKS)


class BoundGemv:
    """A prepared weight's product with x of one dtype and K in one numba call: the GEMV for up to GEMV_MAX_M rows
    (``serial_gemv`` on the calling thread, or ``parallel_gemv`` on numba's threads, as the kernel's ``run``
    chooses: runs_serially), the batched kernel for more, up to ``max_rows`` = _batch_max_m (``serial_batched``,
    ``parallel_batched``), or, where the GEMM path runs on lowbit's AMX kernel, that kernel up to ``max_rows`` =
    _amx_max_m (amx.run). ``f(x, m, out) -> True``: x (..., K) with M = ``m`` rows and out (..., N), C-contiguous
    CPU tensors of the bound dtype, not checked here (the caller's: lowbit.ops.library.PreparedCall._bound_gemv);
    the numba call takes their addresses (_runtime.int16_array_at)."""

    def __init__(self, kernel: "WeightOnlyLinear", prepared: tuple, n: int, k: int, dtype: torch.dtype) -> None:
        operands, _, bias_bits = prepared
        self._serial, self._parallel = kernel.serial_gemv, kernel.parallel_gemv
        self._k = k
        self._args = (dtype == torch.bfloat16, kernel.order, n, operands, kernel.x_consts, *bias_bits)
        self._work, self._chunksize = n * k, _gemv_chunksize(n)
        self._batched = kernel.serial_batched, kernel.parallel_batched
        self._batched_args = (dtype == torch.bfloat16, kernel.order, n, operands, *bias_bits)
        self._amx_args = (kernel.tile[0], operands, n, _tile_width(k), *bias_bits)
        self._on_tiles = _amx_max_m(k, dtype) > GEMV_MAX_M
        self.max_rows = one_call_max_rows(n, k, dtype)

    def __call__(self, x: torch.Tensor, m: int, out: torch.Tensor) -> bool:
        k = self._k
        if m > GEMV_MAX_M and self._on_tiles:
            tile_rows, operands, n, width, *bias_bits = self._amx_args
            amx.run(tile_rows, operands, as_numpy(x).reshape(m, k), n, width, *bias_bits, as_numpy(out).reshape(m, n))
            return True
        if m > GEMV_MAX_M:  # as _run's batched path: tasks of _BATCH_ROWS_PER_TASK rows, one at a time
            batched = self._batched[0 if runs_serially(m * self._work, GEMV_ONE_THREAD_WEIGHTS) else 1]
            batched(x.data_ptr(), m, k, *self._batched_args, out.data_ptr())
            return True
        if runs_serially(self._work, GEMV_ONE_THREAD_WEIGHTS):
            self._serial(x.data_ptr(), m, k, *self._args, out.data_ptr())
        else:
            self._parallel(x.data_ptr(), m, k, *self._args, out.data_ptr(), self._chunksize)
        return True


def one_call_max_rows(n: int, k: int, dtype: torch.dtype) -> int:
    """Rows of x of ``dtype`` up to which a prepared (N, K) weight's product runs in one numba call (BoundGemv):
    the GEMV's, and the AMX kernel's (_amx_max_m) or else the batched kernel's (_batch_max_m)."""
    on_tiles = _amx_max_m(k, dtype)
    return max(GEMV_MAX_M, on_tiles if on_tiles > GEMV_MAX_M else _batch_max_m(n, k, dtype))


def _batch_max_m(n: int, k: int, dtype: torch.dtype) -> int:
    """Rows of x of ``dtype`` up to which an (N, K) weight runs the batched kernel (GEMV_MAX_M: never)."""
    if BATCH_IN_BF16 and dtype != torch.bfloat16 or AMX_GEMM and dtype == torch.bfloat16:
        return GEMV_MAX_M
    if simd.HAS_AMX_BF16 and n * k >= AMX_GEMM_WEIGHTS:
        return AMX_BATCH_MAX_M
    return BATCH_MAX_M


def _padded_k(k: int) -> int:
    return -(-k // LANES) * LANES


class WeightOnlyLinear(Kernel):
    """One format's kernel: ``run(x, a, b, bias, out=)`` with x (..., K) FP16/BF16, the format's two weight
    tensors (validated by lowbit.ops.weight_only), bias (N,) or None, out (..., N) in x's dtype.

    ``gemv``, ``batched`` and ``tile``: the format's numba kernels (M <= GEMV_MAX_M; M <= _batch_max_m, BF16 x
    only on AVX512-BF16 CPUs; the GEMM path), each a pair (serial, parallel): ``serial(*args, row,
    end, out)`` computes output rows row .. end - 1 on the calling thread, ``parallel(*args, out)`` all of
    them in numba's parallel loop (compiled on its first call only: a process that never runs a kernel on
    several threads, such as ``lowbit smoke``, never compiles it). args: (x_reg, *operands[, fused, x_pairs,
    paired][, x_bounds]) for the GEMV, (x_reg, *operands) batched, (*operands, r0) for a tile of rows r0 ... of W.
    ``split``: the register order (see _reorder); ``operands(a, b, k, dtype)``: the numba kernels' weight
    operands for x of ``dtype``; ``exponents``: a 4-bit format's table for _exact_bytes, whose results (fused,
    x_pairs, paired) the GEMV kernels take after the operands (None: an 8-bit format, whose GEMV takes x's
    exponent bounds there instead, and with a ``pair_order`` x's BF16 pairs too: _code8_x_operands;
    _x_bounds_operands); ``pair_order``: the format's BF16 pair order (None: no pair kernel). The GEMV's
    per-call operands of x: ``x_operands(x_reg, operands, x_consts)`` (``direct_x_operands`` in the operator's
    direct call); on the calling thread the whole call is one numba function, ``serial_gemv`` (_serial_gemv),
    and so it is on numba's threads, ``parallel_gemv`` (_parallel_gemv), both over ``one_call_gemv``'s rows
    (default: ``gemv``; HiFloat8 and FP8: rows that take BF16 pairs, compiled for prepared weights only). With
    BF16 x every
    format's decoded weight is a BF16 value (the GEMM path uses torch's BF16 GEMM).
    """

    def __init__(self, gemv: tuple, batched: tuple, tile: tuple, split: tuple, operands, exponents=None,
                 pair_order=None, prepared_operands=None, one_call_gemv=None):
        self.gemv, self.batched, self.tile, self.split, self._operands = gemv, batched, tile, split, operands
        self._prepared_operands = prepared_operands or operands
        self.exponents = exponents
        self.order = np.array(_order(*split), dtype=np.int32)
        self.pair_sources = (_pair_sources(_order(*split), pair_order)
                             if pair_order is not None and simd.HAS_AVX512BF16 else None)
        sources = _NO_PAIR_SOURCES if self.pair_sources is None else self.pair_sources
        if exponents is not None:  # a 4-bit format: fused multiply-adds and BF16 pairs where exact
            self.x_operands, self.x_consts = _four_bit_x_operands, (exponents, sources, self.pair_sources is not None)
        elif pair_order is not None:  # HiFloat8, FP8: BF16 pairs where exact; by columns: fused multiply-adds
            self.x_operands, self.x_consts = _code8_x_operands, (sources,)
        else:  # MXFP8 by columns: fused multiply-adds where exact
            self.x_operands, self.x_consts = _x_bounds_operands, ()
        # The direct call's x operands (gemv_sums): for HiFloat8 and FP8 without x's pairs, which their direct
        # call's rows kernel does not read (one_call_gemv)
        code8_pairs = pair_order is not None and exponents is None
        self.direct_x_operands = _code8_direct_x_operands if code8_pairs else self.x_operands
        self.one_call_gemv = one_call_gemv = one_call_gemv or gemv
        self.serial_gemv = _one_call_gemv(_serial_gemv, one_call_gemv[0], self.x_operands)
        self.parallel_gemv = _one_call_gemv(_parallel_gemv, one_call_gemv[1], self.x_operands)
        self.serial_batched = _one_call_batched(_serial_batched, batched[0])
        self.parallel_batched = _one_call_batched(_parallel_batched, batched[1])

    def run(self, x: torch.Tensor, *args, out: torch.Tensor) -> None:
        *weight, bias = args
        self._run(x, (self._operands(*weight, x.shape[-1], x.dtype), bias, None), out, one_call=False)

    def prepare(self, dtype: torch.dtype, k: int, *args) -> tuple:
        """(numba operands, bias, _bias_bits of the bias) of a validated, contiguous packed weight of K = ``k``
        and its bias, for x of ``dtype``, made once for many calls: the operands are views of the weight's
        tensors (and, for HiFloat8, its scales rounded to ``dtype``; for HiFloat8, FP8 and MXFP8 with BF16 x
        where CODE8_COLUMNS, their codes re-encoded and their rows' column tables; for HiFloat4 on AVX2 CPUs
        without AVX-512, its scale words and value bytes rearranged), valid while those keep their memory and
        values (lowbit.ops.library.PreparedCall)."""
        *weight, bias = args
        return self._prepared_operands(*weight, k, dtype), bias, _bias_bits(bias)

    def run_prepared(self, x: torch.Tensor, prepared: tuple, *, out: torch.Tensor) -> None:
        """:meth:`run` with the weight's operands and the bias from :meth:`prepare` (for x's dtype); the GEMV in
        one numba call (serial_gemv, parallel_gemv: docs/weight_only.md, 'One call'), which a weight bound
        for many calls repays the compiling of (about 2-4 s per format, once; the operator's direct call,
        as in ``lowbit smoke``, keeps the three calls, compiled anyway)."""
        self._run(x, prepared, out, one_call=True)

    def _run(self, x: torch.Tensor, prepared: tuple, out: torch.Tensor, one_call: bool) -> None:
        """out <- x times the weight (``prepared``: operands, bias, its bits or None where not ``one_call``), by
        the GEMV (in one numba call, BoundGemv, where ``one_call``), the batched kernel or the GEMM path."""
        operands, bias, _ = prepared
        k, n = x.shape[-1], out.shape[-1]
        m = out.numel() // n
        if out.dim() != 2:  # x too: (..., K) -> (M, K)
            x, out = x.reshape(m, k), out.view(m, n)
        # Rows in chunks: under numba's TBB layer handed out on demand, so a thread that the OS deschedules on a
        # shared machine does not make the other one wait at the end (OpenMP and workqueue split them evenly
        # up front: docs/architecture.md, 'CPU threads').
        if one_call and m <= max(GEMV_MAX_M, _batch_max_m(n, k, x.dtype)) and out.is_contiguous():
            self.bind_gemv(prepared, n, k, x.dtype)(x.contiguous(), m, out)
            return
        if m <= GEMV_MAX_M:
            path, work, chunksize = self._run_gemv, n * k, _gemv_chunksize(n)
        elif m <= _batch_max_m(n, k, x.dtype):
            path, work, chunksize = self._run_batched, m * n * k, 1  # tasks of _BATCH_ROWS_PER_TASK rows
        else:  # the GEMM path: the decoded tile's rows (torch's GEMM takes torch's threads)
            run_gemm_path(self.tile, operands, x, bias, out)
            return
        # Below GEMV_ONE_THREAD_WEIGHTS the calling thread: waking numba's threads after a torch op would cost
        # more than they save there, and the rows run without the parallel loop's launch (about 13 us of a
        # 1536 x 384 MXFP4 GEMV's 54 us); numba's thread count is left as it is.
        if runs_serially(work, GEMV_ONE_THREAD_WEIGHTS):
            path(x, operands, bias, out, serial=True)
            return
        call_in_chunks(chunksize, path, x, operands, bias, out, False)

    def run_low_rank(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, t: torch.Tensor, u: torch.Tensor,
                     *, out: torch.Tensor, x_scales: torch.Tensor | None = None) -> None:
        """out (M, N) <- bf16(bf16(t @ u) + bf16(x W^T)) on lowbit's AMX kernel (amx.run with a low-rank branch),
        the sums of both products on the tiles: x (M, K), t (M, R), u (R, N) and out (M, N) BF16, C-contiguous,
        M at most _amx_max_m(K); ``a``, ``b`` the format's weight (validated). With ``x_scales`` ((M, K/32) uint8,
        C-contiguous; K a multiple of 32), x's MXFP4 fake quant (svd_quant's activation quantizer: floor scale,
        ties away) takes x's place, laid out straight into the tiles' operand, and ``x_scales`` gets its scale
        bytes. Raises ValueError for a tensor that is not a 2-D CPU one, RuntimeError where the AMX kernel does not
        take x, ValueError for other shapes, dtypes or layouts."""
        given = {"x": x, "t": t, "u": u, "out": out, **({} if x_scales is None else {"x_scales": x_scales})}
        for name, v in given.items():
            if v.dim() != 2 or v.device.type != "cpu":
                raise ValueError(f"run_low_rank: {name} must be a 2-D CPU tensor, got {tuple(v.shape)} on {v.device}")
        (m, k), n = x.shape, out.shape[1]
        if not 0 < m <= _amx_max_m(k, x.dtype):
            raise RuntimeError(f"run_low_rank: lowbit's AMX kernel does not take x {tuple(x.shape)} {x.dtype} here")
        tensors = {"t": t, "u": u, "out": out}
        if any(v.dtype != torch.bfloat16 or not v.is_contiguous() for v in tensors.values()):
            raise ValueError("run_low_rank: t, u and out must be C-contiguous BF16, got "
                             + ", ".join(f"{name} {tuple(v.shape)} {v.dtype}" for name, v in tensors.items()))
        if t.shape[0] != m or out.shape[0] != m or u.shape != (t.shape[1], n) or not x.is_contiguous():
            raise ValueError(f"run_low_rank: x {tuple(x.shape)} (C-contiguous), t {tuple(t.shape)}, u {tuple(u.shape)}"
                             f" and out {tuple(out.shape)} do not make (M, K) (M, R) (R, N) (M, N)")
        fake_quant = None
        if x_scales is not None:
            fits = x_scales.dtype == torch.uint8 and x_scales.shape == (m, k // 32) and x_scales.is_contiguous()
            if k % 32 or not fits:
                raise ValueError(f"run_low_rank: x_scales {tuple(x_scales.shape)} {x_scales.dtype} for x "
                                 f"{tuple(x.shape)}: expected (M, K/32) uint8, C-contiguous, K a multiple of 32")
            # imported here: only svd_quant's prefill runs the MXFP4 fake quant, and its warm-up task (which
            # waits for the MXFP4 family: lowbit.kernels.cpu.warm) compiles it, not the weight-only family's
            from lowbit.kernels.cpu.mxfp4 import fake_quantizer

            fake_quant = (*fake_quantizer(x.dtype, "floor", "ta"), as_numpy(x_scales))
        amx.run(self.tile[0], self._operands(a, b, k, x.dtype), as_numpy(x), n, _tile_width(k),
                *_bias_bits(None), as_numpy(out), low_rank=(as_numpy(t), as_numpy(u)), fake_quant=fake_quant)

    def bind_gemv(self, prepared: tuple, n: int, k: int, dtype: torch.dtype) -> "BoundGemv":
        """:class:`BoundGemv` of the weight (N, K) prepared by :meth:`prepare` for x of ``dtype``."""
        return BoundGemv(self, prepared, n, k, dtype)

    def _run_gemv(self, x: torch.Tensor, operands: tuple, bias, out: torch.Tensor, serial: bool) -> None:
        """The GEMV in three numba calls: x in register order, the lane sums, then the reference's rounding."""
        bf16 = x.dtype == torch.bfloat16
        x_reg, y32 = _gemv_arrays(as_numpy(x), bf16, self.order, out.shape[1])
        self.gemv_sums(x_reg, operands, y32, serial)
        _round_into(y32, bias, bf16, out)

    def gemv_sums(self, x_reg: np.ndarray, operands: tuple, y32: np.ndarray, serial: bool) -> None:
        """y32 (M, N) float32 <- the GEMV's float32 sums of x_reg (M, Kp) float32 (x in the register order,
        zero-padded) with the weight ``operands``, before the rounding to x's dtype."""
        extra = self.direct_x_operands(x_reg, operands, self.x_consts)
        run_tasks(self.gemv, (x_reg, *operands, *extra), y32.shape[1], y32, serial)

    def _run_batched(self, x: torch.Tensor, operands: tuple, bias, out: torch.Tensor, serial: bool) -> None:
        """GEMV_MAX_M < M <= _batch_max_m: the batched kernel on x in the register order (zero-padded to Kp;
        BF16 bits where BATCH_IN_BF16, else float32), then the reference's rounding."""
        n = out.shape[1]
        bf16 = x.dtype == torch.bfloat16
        arrays = _batched_bits_arrays if BATCH_IN_BF16 else _gemv_arrays
        x_reg, y32 = arrays(as_numpy(x), bf16, self.order, n)
        run_tasks(self.batched, (x_reg, *operands), n, y32, serial)
        _round_into(y32, bias, bf16, out)


# On CPUs with AMX-BF16, BF16 x of at most AMX_MAX_M rows whose x^T (M and K padded to the tiles) takes at most
# AMX_X_BYTES multiplies the packed weight on AMX tiles itself (lowbit.kernels.cpu.amx: each panel of W decoded
# into the cache, no BF16 tile written out, no torch GEMM), from GEMV_MAX_M + 1 rows on (the batched kernel is
# not used there). Beyond, torch's GEMM (oneDNN) reached more of the tiles' throughput than lowbit's kernel,
# which reads x^T again for every task (Intel Xeon Emerald Rapids, MXFP4 / HiFloat4 / HiFloat8, time over
# F.linear's: 4096^2 at M = 512 1.00-1.05x either way; 1536 x 384 at M = 768 1.77-1.82x against 1.51-1.71x;
# benchmarks/results_weight_only.md, 'Intel Xeon Emerald Rapids: lowbit's AMX kernel'). Since the kernel runs
# a long K in chunks (amx.k_chunk_of), x^T of up to 16 MiB (M = 512 at K = 16384): MXFP4 / HiFloat8 on torch's
# GEMM against the tiles (chunks of 128 KiB), time over F.linear's: 12288 x 8192 at M = 256 1.23-1.27 / 1.26-1.35
# against 0.95 / 1.04-1.05x, M = 512 1.74-2.05 / 1.79-2.10 against 0.94 / 0.97-0.99x; 4096 x 11008 at M = 256
# 1.24-1.31 / 1.26-1.37 against 0.95-0.96 / 1.04x; 4096^2 at M = 512 (one pass) 1.19-1.20 against 0.90-0.96 /
# 0.95-1.01x (Intel Xeon, 480 MiB L3, family 6 model 167, `benchmarks/amx_gemm.py --x-chunk-kib`;
# benchmarks/results_weight_only.md, 'K in chunks on the AMX tiles'; on the Emerald Rapids the one-pass kernel
# had taken 1.41-1.49x against 1.06-1.09x at 12288 x 8192, M = 256).
AMX_GEMM = amx.AVAILABLE
AMX_MAX_M = 512
AMX_X_BYTES = 16 << 20


def _amx_max_m(k: int, dtype: torch.dtype) -> int:
    """Rows of x of ``dtype`` with K columns up to which the GEMM path runs on lowbit's own AMX kernel (0: never)."""
    if not (AMX_GEMM and dtype == torch.bfloat16):
        return 0
    return min(AMX_MAX_M, AMX_X_BYTES // (2 * -(-k // amx.TILE_K) * amx.TILE_K) // amx.PANEL * amx.PANEL)


def _transposes(m: int, n: int, k: int) -> bool:
    """Whether the BF16 GEMM of M rows of x and an (N, K) weight runs transposed (TRANSPOSED_GEMM and the limits
    after it)."""
    return (TRANSPOSED_GEMM and m * n * 2 <= TRANSPOSED_GEMM_BYTES and min(n, k) >= TRANSPOSED_MIN_SIDE
            and (m <= TRANSPOSED_MAX_M or k >= TRANSPOSED_LONG_K))


def _gemm_path(m: int, n: int, k: int, dtype: torch.dtype, bias) -> tuple:
    """(path, tile dtype, transposed) of the GEMM path for M rows of x of ``dtype``, an (N, K) weight and
    ``bias``: _transposed_gemm_bf16 where :func:`_transposes`, _gemm_bf16 for other BF16 x where BF16_GEMM (a bias
    None or BF16), _gemm_float32 otherwise."""
    bf16_gemm = BF16_GEMM and dtype == torch.bfloat16 and (bias is None or bias.dtype == torch.bfloat16)
    transposed = bf16_gemm and _transposes(m, n, k)
    path = _transposed_gemm_bf16 if transposed else _gemm_bf16 if bf16_gemm else _gemm_float32
    return path, torch.bfloat16 if bf16_gemm else torch.float32, transposed


# Elements past _padded_k(K) in each row of a GEMM tile: rows one cache line apart modulo 4 KiB, so that a
# decoder writing several rows at once (the int4 tiles of wqbmm_dequant: 16) does not have them alias in the L1
# (Intel Xeon, 4096 x 2048 of int4 tiles, one thread: 1.36 ms with rows of 8 KiB, 0.83 ms with 64 bytes more).
_TILE_ROW_PAD = HALF


def _tile_width(k: int) -> int:
    """Elements per row of a GEMM tile of K columns."""
    return _padded_k(k) + _TILE_ROW_PAD


# Rows of a GEMM tile that is not all of N: counted without the rows' padding (which made 4096^2 at M = 256
# three tiles of 2032, 2032 and 32 rows instead of two) and a multiple of this where the budget allows, so that
# every tile starts on a step of the int4 tile decoder (wqbmm_dequant: 16 columns).
_TILE_ROW_ALIGN = 128


def _tile_layout(n: int, k: int, tile_dtype: torch.dtype, transposed: bool) -> tuple[int, int]:
    """(rows, bytes) of the GEMM path's tile of an (N, K) weight: _gemm_tile_bytes of rows of _padded_k(K)
    elements (at least one row; a multiple of _TILE_ROW_ALIGN rows where more), each row _tile_width(K)
    elements; the bytes rounded up to 64."""
    rows = max(1, min(n, _gemm_tile_bytes(transposed) // (_padded_k(k) * tile_dtype.itemsize)))
    if _TILE_ROW_ALIGN < rows < n:
        rows -= rows % _TILE_ROW_ALIGN
    return rows, -(-rows * _tile_width(k) * tile_dtype.itemsize // 64) * 64


def gemm_scratch_nbytes(m: int, n: int, k: int, dtype: torch.dtype) -> int:
    """Bytes of the ``scratch`` that :func:`run_gemm_path` uses for M rows of x of ``dtype``, an (N, K) weight
    and no bias: the AMX kernel's x^T and task buffers where it runs (amx.scratch_bytes), else its tile, and the
    transposed GEMM's (N, M) result after it."""
    if m <= _amx_max_m(k, dtype):
        return amx.scratch_bytes(m, k, _tile_width(k))
    _, tile_dtype, transposed = _gemm_path(m, n, k, dtype, None)
    return _tile_layout(n, k, tile_dtype, transposed)[1] + (2 * n * m if transposed else 0)


def run_gemm_path(tile: tuple, operands: tuple, x: torch.Tensor, bias, out: torch.Tensor, scratch=None) -> None:
    """out (M, N) <- x (M, K) FP16 / BF16 times an (N, K) weight decoded tile by tile by ``tile`` (a pair
    (serial, parallel) for run_tasks with args (*operands, r0): rows r0 ... of the weight, as float32 values
    or BF16 bits, int16, in the tile's dtype; each decoded weight a value of x's dtype), plus ``bias`` ((N,) or
    None): lowbit's AMX kernel where it runs (_amx_max_m), else torch's GEMM (float32 sums, one rounding), NaN
    canonical. The tiles (the AMX kernel's buffers) go in the calling thread's scratch buffer, or in ``scratch``
    (uint8, at least :func:`gemm_scratch_nbytes`; bias None) where given. Operands checked by the caller; out
    C-contiguous."""
    (m, k), n = x.shape, out.shape[1]
    if m <= _amx_max_m(k, x.dtype):
        amx.run(tile[0], operands, as_numpy(x.contiguous()), n, _tile_width(k), *_bias_bits(bias), as_numpy(out),
                scratch)
        return
    path, tile_dtype, transposed = _gemm_path(m, n, k, x.dtype, bias)
    rows, _ = _tile_layout(n, k, tile_dtype, transposed)
    after = (n, m) if transposed else (0,)

    def tiles(serial):
        return _tiles(tile, operands, n, k, tile_dtype, serial, after, transposed, scratch)

    if runs_serially(n * k, GEMV_ONE_THREAD_WEIGHTS):
        path(tiles(serial=True), x, bias, out)
        return
    call_in_chunks(max(4, -(-rows // _ROWS_PER_TASK) // _CHUNKS), path, tiles(serial=False), x, bias, out)


def _tiles(tile: tuple, operands: tuple, n: int, k: int, dtype: torch.dtype, serial: bool, after: tuple,
           transposed: bool, scratch):
    """(first row, (rows, _tile_width(K)) tile, spare) of W decoded tile by tile (_tile_layout) by ``tile``
    into ``scratch`` or the calling thread's scratch buffer, viewed as ``dtype`` (float32 or BF16); columns
    K .. of a row hold zeros or are not written. Each tile is valid until the next one is yielded.
    ``spare``: a (``after``) tensor of ``dtype`` in the same buffer, after the tile, the same for every tile."""
    width = _tile_width(k)
    rows, tile_bytes = _tile_layout(n, k, dtype, transposed)
    nbytes = tile_bytes + math.prod(after) * dtype.itemsize
    with scratch_or_thread(scratch, nbytes) as raw:
        buffer = raw[:tile_bytes].view(dtype)[: rows * width].view(rows, width)
        spare = raw[tile_bytes:].view(dtype).view(after)
        for r0 in range(0, n, rows):
            part = buffer[: min(rows, n - r0)]
            run_tasks(tile, (*operands, r0), part.shape[0], as_numpy(part), serial)
            yield r0, part, spare


def _gemm_float32(tiles, x: torch.Tensor, bias, out: torch.Tensor) -> None:
    """float32 GEMM on decoded tiles (torch's order), then the reference's rounding."""
    (m, k), n = x.shape, out.shape[1]
    x32 = x.to(torch.float32)
    y32 = torch.empty(m, n, dtype=torch.float32)
    for r0, tile, _ in tiles:
        y32[:, r0 : r0 + tile.shape[0]] = x32 @ tile[:, :k].T
    out.copy_(reference.finish(y32, bias, out.dtype))


def _gemm_bf16(tiles, x: torch.Tensor, bias, out: torch.Tensor) -> None:
    """BF16 x (every decoded weight is a BF16 value): torch's BF16 GEMM (float32 accumulation, one
    rounding to BF16) on tiles decoded to BF16. A BF16 bias goes to F.linear, which adds it to the float32
    sums before that rounding (the same bits as the bias as one more column of W and of x, a column of
    ones; tests/test_weight_only_gemm.py checks this of torch), without the strided K + 1 columns (0.8 ms at
    M = 256, N = K = 4096)."""
    k, n = x.shape[1], out.shape[1]
    for r0, tile, _ in tiles:
        if tile.shape[0] == n:  # one tile: written straight into out (addmm and mm are what F.linear runs)
            if bias is None:
                torch.mm(x, tile[:, :k].t(), out=out)
            else:
                torch.addmm(bias, x, tile[:, :k].t(), out=out)
            break
        rows = slice(r0, r0 + tile.shape[0])
        out[:, rows] = torch.nn.functional.linear(x, tile[:, :k], None if bias is None else bias[rows])
    canonical_nan_bf16(as_numpy(out).reshape(-1))


def _transposed_gemm_bf16(tiles, x: torch.Tensor, bias, out: torch.Tensor) -> None:
    """_gemm_bf16 as y^T = W x^T, tile by tile into rows of the (N, M) spare buffer (torch's BF16 GEMM with
    the decoded tile as its first operand, a BF16 bias as a column added before the one rounding), then
    out <- its transpose, NaN canonical (transpose_bf16)."""
    k, n = x.shape[1], out.shape[1]
    for r0, tile, y_t in tiles:
        rows = slice(r0, r0 + tile.shape[0])
        if bias is None:
            torch.mm(tile[:, :k], x.t(), out=y_t[rows])
        else:
            torch.addmm(bias[rows, None], tile[:, :k], x.t(), out=y_t[rows])
        if rows.stop == n:
            transpose_bf16(as_numpy(y_t), as_numpy(out))


def _default_table_kind() -> str:
    if simd.HAS_AVX512VBMI:
        return "bytes"
    if simd.HAS_AVX512BW:
        return "words"
    return "bytes" if simd.BYTE_TABLES else "values"


# Arrays of each row-table kind (see code8_decode) by (kind, BF16 x), and per K % 64 the lanes of a last, short
# step (int32[64], nonzero to keep): constants the code-8 kernels take.
_ROW_TABLES_LIKE = {("bytes", True): np.zeros(256, dtype=np.uint8),
                    ("bytes", False): np.zeros((2, 128), dtype=np.uint8),
                    ("values", True): np.zeros(256, dtype=np.float32),
                    ("values", False): np.zeros(256, dtype=np.float32),
                    ("words", True): np.zeros(128, dtype=np.int16),
                    ("words", False): np.zeros(128, dtype=np.uint16)}
assert all(t.nbytes <= _ROW_TABLE_BYTES for t in _ROW_TABLES_LIKE.values())  # _row_table's stack room
_KEEP = (_CODE8_ELEMENTS[None, :] < np.arange(LANES)[:, None]).astype(np.int32)


def _code8_operands(codes, scale, magnitudes, nan_code, k, dtype, table_kind):
    """The _code8_gemv / _code8_tile operands. ``table_kind`` (see code8_decode): "bytes" (AVX512-VBMI, or
    AVX2 without AVX512-BW), "words" (AVX512-BW) or "values" (gathered); None: the fastest this CPU has."""
    bf16 = dtype == torch.bfloat16
    table_like = _ROW_TABLES_LIKE[table_kind or _default_table_kind(), bf16]
    return (as_numpy(codes), as_numpy(scale.contiguous()), bf16, magnitudes, nan_code, table_like, _KEEP[k % LANES],
            _NO_FAST_ROWS, _NO_SLOW_BLOCKS, _NOT_BY_COLUMNS)


def _hifloat8_operands(codes, scale, k, dtype, table_kind=None):
    """HiFloat8: code values and row scales both rounded to x's dtype first."""
    return _code8_operands(codes, scale.to(dtype).to(torch.float32), _HIF8_MAGNITUDES[dtype], hifloat8.NAN_CODE, k,
                           dtype, table_kind)


def _encoded_by_columns(codes, column_code, scale):
    """(encoded, fast, tables, slow_blocks) of column_code.encode_rows for ``codes`` (N, K) uint8, K a multiple
    of 64, and the rows' float32 ``scale`` (N,) numpy: the re-encoded codes in a copy (one more byte per
    weight; in 2 MiB pages, as the deploy modules keep their weights: docs/quantize.md)."""
    n, k = codes.shape
    encoded = as_numpy(huge_page_empty(codes.shape, codes.dtype))
    fast = np.empty(n, dtype=np.uint8)
    tables = np.empty((n, _columns.TABLE_BYTES), dtype=np.uint8)
    slow_blocks = np.empty((n, k // _columns.BLOCK), dtype=np.uint8)
    column_code.encode_rows(as_numpy(codes), scale, encoded, fast, tables, slow_blocks)
    return encoded, fast, tables, slow_blocks


def _by_columns_operands(operands, codes, k, dtype, column_code):
    """A code-8 weight's ``operands`` (_code8_operands) for a weight prepared once (WeightOnlyLinear.prepare):
    for BF16 x where CODE8_COLUMNS and K is a multiple of 64, its ``codes`` re-encoded by ``column_code``'s
    columns, the rows the column decode serves (fast 1; 2: but for the blocks of 32 codes holding one it
    leaves to the table, slow_blocks) and their column tables (_encoded_by_columns)."""
    if not (CODE8_COLUMNS and dtype == torch.bfloat16 and k % LANES == 0):
        return operands
    _, scale_np, bf16, magnitudes, _, table_like, keep, _, _, _ = operands
    encoded, fast, tables, slow_blocks = _encoded_by_columns(codes, column_code, scale_np)
    return (encoded, scale_np, bf16, column_code.encoded_magnitudes(magnitudes), column_code.encoded_nan, table_like,
            keep, fast, slow_blocks, tables)


def _hifloat8_prepared_operands(codes, scale, k, dtype):
    """_hifloat8_operands of a weight prepared once: _by_columns_operands."""
    return _by_columns_operands(_hifloat8_operands(codes, scale, k, dtype), codes, k, dtype, _columns.HIFLOAT8)


def _float8_operands(codes, scale, k, dtype, table_kind=None):
    """FP8 E4M3: exact code values times the FP32 row scales (0x7F / 0xFF are NaN codes)."""
    return _code8_operands(codes, scale, _E4M3_MAGNITUDES, _E4M3_NAN_CODE, k, dtype, table_kind)


def _float8_prepared_operands(codes, scale, k, dtype):
    """_float8_operands of a weight prepared once: _by_columns_operands."""
    return _by_columns_operands(_float8_operands(codes, scale, k, dtype), codes, k, dtype, _columns.FLOAT8_E4M3)


def _mxfp8_operands(codes, scales, k, dtype, table_kind=None):
    """``table_kind`` as for _code8_operands (E4M3 values are BF16 values: BF16 tables serve FP16 x too); no
    rows by columns."""
    table = {"bytes": _E4M3_BYTE_TABLES, "words": _E4M3_BF16_WORDS,
             "values": _E4M3_VALUES}[table_kind or _default_table_kind()]
    return (as_numpy(codes), as_numpy(scales), dtype == torch.bfloat16, table, _NO_FAST_ROWS, _NO_SLOW_BLOCKS,
            _NOT_BY_COLUMNS)


# MXFP8 rows by columns: E8M0 bytes whose scale 2^(b - 127) lies in the column decode's range [2^-110, 2^110]
# (within _MXFP8_EXACT_BYTES_BF16: every weight such a row holds is a normal BF16 value, the reference's exactly).
_MXFP8_COLUMN_BYTES = (17, 237)


@functools.cache
def _mxfp8_column_operands() -> tuple[np.ndarray, np.ndarray]:
    """(the E4M3 byte table of FP8's re-encoded codes, the column tables of the 256 E8M0 bytes): byte b's
    the FP8 column table of the scale 2^(b - 127) where b lies in _MXFP8_COLUMN_BYTES, zeros elsewhere (no
    fast row holds such a byte)."""
    code = _columns.FLOAT8_E4M3
    halves = _E4M3_BF16_BYTES.reshape(2, 128)  # the high bytes of codes 0..127, then their low bytes
    table = simd.byte_tables(np.concatenate([code.encoded_magnitudes(half) for half in halves]))
    low, high = _MXFP8_COLUMN_BYTES
    tables = np.zeros((256, _columns.TABLE_BYTES), dtype=np.uint8)
    tables[low : high + 1] = code.scale_tables(_E8M0_SCALES[low : high + 1])
    return table, tables


def _mxfp8_prepared_operands(codes, scales, k, dtype):
    """_mxfp8_operands of a weight prepared once: for BF16 x where CODE8_COLUMNS and K is a multiple of 64, its
    codes re-encoded by FP8 E4M3's columns (_encoded_by_columns: the codes' own values, scale 1) and decoded
    by columns, with the column table of each 32-block's byte (_mxfp8_column_operands), in the rows whose
    E8M0 bytes all lie in _MXFP8_COLUMN_BYTES: fast 1 where the columns take all of the row's codes, else 2,
    its blocks holding a code they leave out marked in slow_blocks (decoded by the table of the re-encoded
    codes, as the other rows are). docs/weight_only.md, '8-bit codes by columns'."""
    operands = _mxfp8_operands(codes, scales, k, dtype)
    if not (CODE8_COLUMNS and dtype == torch.bfloat16 and k % LANES == 0 and _default_table_kind() == "bytes"):
        return operands
    scales_np = operands[1]
    code = _columns.FLOAT8_E4M3
    encoded, fast, _, slow_blocks = _encoded_by_columns(codes, code, np.ones(codes.shape[0], dtype=np.float32))
    low, high = _MXFP8_COLUMN_BYTES
    in_range = ((scales_np >= low) & (scales_np <= high)).all(axis=1)
    fast[~in_range] = 0
    table, column_tables = _mxfp8_column_operands()
    return encoded, scales_np, True, table, fast, slow_blocks, column_tables


def _mxfp4_operands(codes, scales, k, dtype):
    return as_numpy(scales), as_numpy(codes)


_NO_CODES, _NO_SIGNS = np.empty((0, 0), dtype=np.uint8), np.empty((0, 0), dtype=np.uint32)


def _hifloat4_operands(scale, value, k, dtype):
    """(words, value, codes, signs): the scale words (one little-endian int32 per block) and value bytes as
    views; codes and signs empty (the GEMV's BF16 pairs decode the packed weight in place)."""
    words = as_numpy(scale).reshape(scale.shape[0], -1).view(np.int32)
    return words, as_numpy(value), _NO_CODES, _NO_SIGNS


def _hifloat4_prepared_operands(scale, value, k, dtype):
    """_hifloat4_operands of a weight prepared once: on AVX2 CPUs without AVX-512 (the byte-shuffle step),
    copies of its scale words and value bytes rearranged for hifloat4_bf16_step (_hifloat4_prepared_words,
    _hifloat4_prepare_values: 0.5625 bytes more per weight; the values in huge pages); where the GEMV sums
    BF16 pairs (BF16 x, an even number of blocks) the codes and signs of the pairs by magnitude index beside
    the views (_hifloat4_indexed_operands: 0.625 bytes more per weight, in huge pages); else views."""
    words, value_np, codes, signs = _hifloat4_operands(scale, value, k, dtype)
    if BYTE_SHUFFLE_NIBBLES:
        prepared = as_numpy(huge_page_empty(value.shape, value.dtype))
        _hifloat4_prepare_values(value_np, prepared)
        return _hifloat4_prepared_words(words), prepared, codes, signs
    if _HIFLOAT4_PAIRS and dtype == torch.bfloat16 and words.shape[1] % 2 == 0:
        codes = as_numpy(huge_page_empty(value.shape, value.dtype))
        signs = as_numpy(huge_page_empty((words.shape[0], 2 * words.shape[1]), torch.int32)).view(np.uint32)
        _hifloat4_indexed_operands(words, value_np, codes, signs)
    return words, value_np, codes, signs


_CODE8 = ((_code8_rows, _code8_gemv), (_code8_batched_rows, _code8_batched), (_code8_tile_rows, _code8_tile))
# The one-call GEMV's rows with x's BF16 pairs, compiled only where they may run (CODE8_PAIRS)
_CODE8_PAIRED = (_code8_rows_paired, _code8_gemv_paired) if CODE8_PAIRS else _CODE8[0]
HIFLOAT8_LINEAR = WeightOnlyLinear(*_CODE8, CODE8_SPLIT, _hifloat8_operands, pair_order=CODE8_PAIR_ORDER,
                                  prepared_operands=_hifloat8_prepared_operands, one_call_gemv=_CODE8_PAIRED)
FLOAT8_E4M3FN_LINEAR = WeightOnlyLinear(*_CODE8, CODE8_SPLIT, _float8_operands, pair_order=CODE8_PAIR_ORDER,
                                        prepared_operands=_float8_prepared_operands, one_call_gemv=_CODE8_PAIRED)
MXFP8_LINEAR = WeightOnlyLinear((_mxfp8_rows, _mxfp8_gemv), (_mxfp8_batched_rows, _mxfp8_batched),
                                (_mxfp8_tile_rows, _mxfp8_tile), CODE8_SPLIT, _mxfp8_operands,
                                prepared_operands=_mxfp8_prepared_operands)
MXFP4_LINEAR = WeightOnlyLinear((_mxfp4_rows, _mxfp4_gemv), (_mxfp4_batched_rows, _mxfp4_batched),
                                (_mxfp4_tile_rows, _mxfp4_tile), FOUR_BIT_SPLIT, _mxfp4_operands, _MXFP4_EXPONENTS,
                                PAIR_ORDER)
amx.carry_low_rank(_mxfp4_tile_rows)  # svd_quant's prefill on the tiles (WeightOnlyLinear.run_low_rank)
HIFLOAT4_LINEAR = WeightOnlyLinear((_hifloat4_rows, _hifloat4_gemv), (_hifloat4_batched_rows, _hifloat4_batched),
                                   (_hifloat4_tile_rows, _hifloat4_tile), HIFLOAT4_SPLIT, _hifloat4_operands,
                                   _HIFLOAT4_EXPONENTS, PAIR_ORDER if _HIFLOAT4_PAIRS else None,
                                   _hifloat4_prepared_operands)
