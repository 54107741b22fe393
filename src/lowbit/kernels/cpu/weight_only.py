"""Weight-only linear layers on the CPU (numba): the packed weight is decoded in registers, never stored.

Two paths, chosen by the number of rows M of x (``GEMV_MAX_M``):

* **GEMV** (M <= GEMV_MAX_M, decoding): bit-exact with the reference (lowbit.formats.weight_only). The
  64 summation lanes are two F32V registers: one step decodes 64 consecutive weights of a row (k = 64t ..
  64t + 63) into float32 exactly as the reference does, multiplies them by x and adds them to the lanes
  (mul and add, never FMA); then :func:`f32v_sum_tree` folds the lanes in the reference's order. Rows are
  split across threads; each row's sum is one thread's, so the result does not depend on the thread count.
* **GEMM** (larger M, prefill): tiles of rows are decoded with the same step functions into a float32
  buffer, and torch multiplies x by each tile (its order: docs/weight_only.md, 'Tolerance of the GEMM
  path'); only the tile is ever in full precision.

Decoding (docs/weight_only.md, 'Weights'):

* HiFloat8: the code's exact value from two 128-entry byte tables (the BF16 bits of each magnitude;
  vpermi2b with AVX512-VBMI, a gather from the FP32 decode table elsewhere), times the row's scale.
* MXFP4: a 16-entry table (the E2M1 values times the block's E8M0 scale, one multiply each, as the
  reference) indexed by the nibbles (vpermps with AVX-512).
* HiFloat4: a 16-entry table (signed c/4 times the E6M2 scale: exact) indexed by the nibbles, times
  2^(e2 + e3) per lane from the flag bytes (exact).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.core import cgutils
from numba.extending import intrinsic

from lowbit.backends import Kernel
from lowbit.formats import hifloat8, mxfp4
from lowbit.formats import weight_only as reference
from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu._runtime import NJIT_OPTIONS, PARALLEL_NJIT_OPTIONS, as_numpy, sync_threads

LANES = reference.LANES  # 64 = two F32V
HALF = simd.LANES  # 32
GEMV_MAX_M = 4  # rows of x up to which the bit-exact GEMV path runs
GEMM_TILE_ELEMENTS = 1 << 22  # float32 weights decoded per GEMM tile (16 MiB)
_ROWS_PER_TASK = 8  # weight rows a thread takes at a time
_INLINE = dict(NJIT_OPTIONS, inline="always")

# ---- tables (from the reference formats) ------------------------------------------------------------------

_HIF8_FP32 = hifloat8.decode_table(torch.float32).numpy()  # 256 entries, NaN at 0x80
_HIF8_BF16_BITS = hifloat8.decode_table(torch.bfloat16).view(torch.int16).numpy().astype(np.uint16)[:128]
_E2M1 = np.tile(mxfp4.e2m1_values(torch.float32).numpy(), 2)  # an F32V: entries 0..15, repeated
_HIF4_QUARTERS = np.tile(
    np.array([c / 4 for c in range(8)] + [-c / 4 for c in range(8)], dtype=np.float32), 2
)  # nibble = sign << 3 | c -> (-1)^sign * c / 4 (nibble 8 is -0.0)
_FP32_NAN_BITS = np.uint32(0x7FC00000)

# ---- HiFloat8 decode: 32 codes -> F32V --------------------------------------------------------------------

_V8x32 = ir.VectorType(ir.IntType(8), HALF)
_V8x64 = ir.VectorType(ir.IntType(8), 64)
_V32x32 = ir.VectorType(ir.IntType(32), HALF)


def _byte_table(values) -> tuple[ir.Constant, ir.Constant]:
    """A 128-entry byte table as the two 64-byte halves vpermi2b reads."""
    values = [int(v) & 0xFF for v in values]
    return ir.Constant(_V8x64, values[:64]), ir.Constant(_V8x64, values[64:])


def _hifloat8_decode_vbmi(context, builder, codes, table_arg):
    """Exact FP32 values of 32 codes (<32 x i8>): BF16 bits of the magnitude from two byte tables."""
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_V8x64, [_V8x64] * 3), "llvm.x86.avx512.vpermi2var.qi.512")
    wide = builder.shuffle_vector(codes, codes, ir.Constant(ir.VectorType(ir.IntType(32), 64), list(range(32)) * 2))
    first = ir.Constant(ir.VectorType(ir.IntType(32), HALF), list(range(HALF)))
    halves = []
    for shift in (8, 0):
        low, high = _byte_table([bits >> shift for bits in _HIF8_BF16_BITS])
        picked = builder.call(fn, [low, wide, high])  # index bits 0-6; bit 7 (the sign) is ignored
        halves.append(builder.zext(builder.shuffle_vector(picked, picked, first), _V32x32))
    sign = builder.zext(builder.and_(codes, ir.Constant(_V8x32, [0x80] * HALF)), _V32x32)
    high = builder.or_(halves[0], sign)
    bits = builder.or_(builder.shl(high, ir.Constant(_V32x32, [24] * HALF)),
                       builder.shl(halves[1], ir.Constant(_V32x32, [16] * HALF)))
    nan = builder.icmp_unsigned("==", codes, ir.Constant(_V8x32, [hifloat8.NAN_CODE] * HALF))
    bits = builder.select(nan, ir.Constant(_V32x32, [0x7FFFFFFF] * HALF), bits)
    return builder.bitcast(bits, ir.VectorType(ir.FloatType(), HALF))


def _hifloat8_decode_portable(context, builder, codes, table_arg):
    """The same values gathered from the 256-entry FP32 decode table (``table_arg``), in plain LLVM IR."""
    table_type, table = table_arg
    data = context.make_array(table_type)(context, builder, table).data
    i64 = ir.IntType(64)
    v64 = ir.VectorType(i64, HALF)
    base = builder.insert_element(ir.Constant(v64, None), builder.ptrtoint(data, i64), ir.Constant(ir.IntType(32), 0))
    bases = builder.shuffle_vector(base, base, ir.Constant(_V32x32, [0] * HALF))
    offsets = builder.shl(builder.zext(codes, v64), ir.Constant(v64, [2] * HALF))
    pointers = builder.inttoptr(builder.add(bases, offsets), ir.VectorType(data.type, HALF))
    v_f32, v_i1 = ir.VectorType(ir.FloatType(), HALF), ir.VectorType(ir.IntType(1), HALF)
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(v_f32, [pointers.type, ir.IntType(32), v_i1, v_f32]),
        f"llvm.masked.gather.v{HALF}f32.v{HALF}p0")
    return builder.call(fn, [pointers, ir.Constant(ir.IntType(32), 4), ir.Constant(v_i1, [1] * HALF),
                             ir.Constant(v_f32, None)])


def _make_hifloat8_decode(lower):
    @intrinsic
    def hifloat8_decode(typingctx, codes, index, table):
        """F32V of the exact values of the 32 HiFloat8 codes ``codes[index : index + 32]`` (a 1-D
        C-contiguous uint8 array); ``table``: the 256-entry FP32 decode table (read by the portable
        lowering only). NaN (0x80) gives 0x7FFFFFFF, as the reference's FP32 decode."""

        def codegen(context, builder, sig, args):
            ptr = simd._element_ptr(context, builder, sig.args[0], args[0], args[1], _V8x32)
            return lower(context, builder, builder.load(ptr, align=1), (sig.args[2], args[2]))

        return simd.F32V(codes, index, table), codegen

    return hifloat8_decode


hifloat8_decode_portable = _make_hifloat8_decode(_hifloat8_decode_portable)
hifloat8_decode_vbmi = _make_hifloat8_decode(_hifloat8_decode_vbmi)
hifloat8_decode = hifloat8_decode_vbmi if simd.HAS_AVX512VBMI else hifloat8_decode_portable

# ---- HiFloat4 multipliers: 2^(e2 + e3) per lane ------------------------------------------------------------

# Lane i of a 32-element half: its 8-group flag is bit 7 - i // 8 of the (shifted) e2 byte, its 4-group flag
# bit 7 - i // 4 of the half's e3 byte (flag bytes are MSB first: docs/hifloat4.md, 'Packed layout').
_E2_SHIFTS = [7 - i // 8 for i in range(HALF)]
_E3_SHIFTS = [7 - i // 4 for i in range(HALF)]


@intrinsic
def hifloat4_multipliers(typingctx, e2, e3):
    """F32V of 2^(e2 flag + e3 flag) for the 32 elements of a half block: ``e2`` the block's e2 byte
    shifted left by 4 for the second half (int32), ``e3`` the half's e3 byte (int32)."""

    def codegen(context, builder, sig, args):
        levels = ir.Constant(_V32x32, [0] * HALF)
        for value, shifts in zip(args, (_E2_SHIFTS, _E3_SHIFTS)):
            splat = simd._splat(builder, builder.trunc(value, ir.IntType(32)) if value.type.width > 32 else value,
                                _V32x32)
            flag = builder.and_(builder.lshr(splat, ir.Constant(_V32x32, shifts)), ir.Constant(_V32x32, [1] * HALF))
            levels = builder.add(levels, flag)
        exponent = builder.add(levels, ir.Constant(_V32x32, [127] * HALF))
        return builder.bitcast(builder.shl(exponent, ir.Constant(_V32x32, [23] * HALF)), simd._VF32)

    return simd.F32V(e2, e3), codegen


# ---- scalar scales ---------------------------------------------------------------------------------------


@numba.njit(**_INLINE)
def _e8m0_value(byte):
    """2^(byte - 127) as float32 (byte 0: the subnormal 2^-127; 0xFF: NaN)."""
    b = np.uint32(byte)
    bits = np.uint32(0x00400000) if b == 0 else np.uint32(b << np.uint32(23))
    return np.uint32(_FP32_NAN_BITS if b == np.uint32(0xFF) else bits).view(np.float32)


@numba.njit(**_INLINE)
def _e6m2_value(byte):
    """The E6M2 scale 2^((b >> 2) - 48) * (1 + (b & 3) / 4) as float32 (0xFF: NaN, a poisoned block)."""
    b = np.uint32(byte)
    bits = np.uint32(((b >> np.uint32(2)) + np.uint32(127 - 48)) << np.uint32(23) | (b & np.uint32(3)) << np.uint32(21))
    return np.uint32(_FP32_NAN_BITS if b == np.uint32(0xFF) else bits).view(np.float32)


# ---- one step: 64 weights of a row (two F32V) --------------------------------------------------------------


@numba.njit(**_INLINE)
def _hifloat8_step(codes, row_start, k0, scale, table):
    """Weights k0 .. k0 + 63 of the row whose codes start at ``row_start`` (``codes`` flat)."""
    w0 = simd.f32v_mul(hifloat8_decode(codes, row_start + k0, table), scale)
    w1 = simd.f32v_mul(hifloat8_decode(codes, row_start + k0 + HALF, table), scale)
    return w0, w1


@numba.njit(**_INLINE)
def _mxfp4_half(codes, scales, row, block):
    """Weights of MXFP4 block ``block`` (32 elements) of ``row``: codes (N, K/2), scales (N, K/32)."""
    table = simd.f32v_mul(simd.f32v_load(_E2M1, 0), _e8m0_value(scales[row, block]))
    return simd.lookup16(table, simd.nibbles_load(codes.reshape(-1), row * codes.shape[1] + 16 * block))


@numba.njit(**_INLINE)
def _hifloat4_step(scale, value, row, block):
    """Weights of HiFloat4 block ``block`` (64 elements) of ``row``: scale (N, K/64, 4), value (N, K/2)."""
    table = simd.f32v_mul(simd.f32v_load(_HIF4_QUARTERS, 0), _e6m2_value(scale[row, block, 0]))
    e2 = np.int32(scale[row, block, 1])
    start = row * value.shape[1] + 32 * block
    flat = value.reshape(-1)
    w0 = simd.f32v_mul(simd.lookup16(table, simd.nibbles_load(flat, start)),
                       hifloat4_multipliers(e2, np.int32(scale[row, block, 2])))
    w1 = simd.f32v_mul(simd.lookup16(table, simd.nibbles_load(flat, start + 16)),
                       hifloat4_multipliers(e2 << 4, np.int32(scale[row, block, 3])))
    return w0, w1


@numba.njit(**_INLINE)
def _accumulate(acc0, acc1, x_flat, x0, w0, w1):
    """Lanes += x[x0 .. x0 + 63] * (w0, w1)."""
    acc0 = simd.f32v_add(acc0, simd.f32v_mul(simd.f32v_load(x_flat, x0), w0))
    acc1 = simd.f32v_add(acc1, simd.f32v_mul(simd.f32v_load(x_flat, x0 + HALF), w1))
    return acc0, acc1


# ---- GEMV kernels: y32 (M, N) <- x32 (M, Kp) @ W.T in the lane order ---------------------------------------


@numba.njit(**_INLINE)
def _hifloat8_tail(codes_flat, row_start, k0, count, scale, table, scratch):
    """The last ``count`` < 64 weights of a row (k0 ..), the other lanes +0.0 (through ``scratch``: the
    codes past the row are not read)."""
    scratch[:] = 0
    scratch[:count] = codes_flat[row_start + k0 : row_start + k0 + count]
    w0, w1 = _hifloat8_step(scratch, 0, 0, scale, table)
    return simd.f32v_keep_first(w0, count), simd.f32v_keep_first(w1, count - HALF)


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _hifloat8_gemv(x32, codes, scale, y32):
    """codes (N, K) uint8, scale (N,) float32, x32 (M, Kp) zero-padded, y32 (M, N) float32."""
    n, k = codes.shape
    m_rows, kp = x32.shape
    full = k // LANES
    tail = k - full * LANES
    codes_flat, x_flat = codes.reshape(-1), x32.reshape(-1)
    for task in numba.prange((n + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        scratch = np.zeros(LANES, dtype=np.uint8)
        for row in range(task * _ROWS_PER_TASK, min(n, (task + 1) * _ROWS_PER_TASK)):
            s = scale[row]
            for m in range(m_rows):
                acc0 = simd.f32v_zero()
                acc1 = simd.f32v_zero()
                for t in range(full):
                    w0, w1 = _hifloat8_step(codes_flat, row * k, LANES * t, s, _HIF8_FP32)
                    acc0, acc1 = _accumulate(acc0, acc1, x_flat, m * kp + LANES * t, w0, w1)
                if tail:
                    w0, w1 = _hifloat8_tail(codes_flat, row * k, LANES * full, tail, s, _HIF8_FP32, scratch)
                    acc0, acc1 = _accumulate(acc0, acc1, x_flat, m * kp + LANES * full, w0, w1)
                y32[m, row] = simd.f32v_sum_tree(simd.f32v_add(acc0, acc1))


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _mxfp4_gemv(x32, codes, scales, y32):
    """codes (N, K/2), scales (N, K/32) uint8; x32 (M, Kp) zero-padded; y32 (M, N) float32."""
    n, blocks = scales.shape
    m_rows, kp = x32.shape
    x_flat = x32.reshape(-1)
    for task in numba.prange((n + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        for row in range(task * _ROWS_PER_TASK, min(n, (task + 1) * _ROWS_PER_TASK)):
            for m in range(m_rows):
                acc0 = simd.f32v_zero()
                acc1 = simd.f32v_zero()
                for t in range(blocks // 2):
                    w0 = _mxfp4_half(codes, scales, row, 2 * t)
                    w1 = _mxfp4_half(codes, scales, row, 2 * t + 1)
                    acc0, acc1 = _accumulate(acc0, acc1, x_flat, m * kp + LANES * t, w0, w1)
                if blocks % 2:  # an odd last block fills lanes 0..31 only
                    w0 = _mxfp4_half(codes, scales, row, blocks - 1)
                    acc0 = simd.f32v_add(acc0, simd.f32v_mul(simd.f32v_load(x_flat, m * kp + HALF * (blocks - 1)), w0))
                y32[m, row] = simd.f32v_sum_tree(simd.f32v_add(acc0, acc1))


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _hifloat4_gemv(x32, scale, value, y32):
    """scale (N, K/64, 4), value (N, K/2) uint8; x32 (M, K); y32 (M, N) float32."""
    n, blocks = scale.shape[0], scale.shape[1]
    m_rows, kp = x32.shape
    x_flat = x32.reshape(-1)
    for task in numba.prange((n + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        for row in range(task * _ROWS_PER_TASK, min(n, (task + 1) * _ROWS_PER_TASK)):
            for m in range(m_rows):
                acc0 = simd.f32v_zero()
                acc1 = simd.f32v_zero()
                for b in range(blocks):
                    w0, w1 = _hifloat4_step(scale, value, row, b)
                    acc0, acc1 = _accumulate(acc0, acc1, x_flat, m * kp + LANES * b, w0, w1)
                y32[m, row] = simd.f32v_sum_tree(simd.f32v_add(acc0, acc1))


# ---- GEMM tiles: rows r0 .. r0 + R - 1 of W decoded into w32 (R, Kp) ---------------------------------------


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _hifloat8_tile(codes, scale, r0, w32):
    n, k = codes.shape
    kp = w32.shape[1]
    full = k // LANES
    tail = k - full * LANES
    codes_flat, w_flat = codes.reshape(-1), w32.reshape(-1)
    for task in numba.prange((w32.shape[0] + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        scratch = np.zeros(LANES, dtype=np.uint8)
        for i in range(task * _ROWS_PER_TASK, min(w32.shape[0], (task + 1) * _ROWS_PER_TASK)):
            row = r0 + i
            for t in range(full):
                w0, w1 = _hifloat8_step(codes_flat, row * k, LANES * t, scale[row], _HIF8_FP32)
                _store(w_flat, i * kp + LANES * t, w0, w1)
            if tail:
                w0, w1 = _hifloat8_tail(codes_flat, row * k, LANES * full, tail, scale[row], _HIF8_FP32, scratch)
                _store(w_flat, i * kp + LANES * full, w0, w1)


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _mxfp4_tile(codes, scales, r0, w32):
    blocks = scales.shape[1]
    kp = w32.shape[1]
    w_flat = w32.reshape(-1)
    for i in numba.prange(w32.shape[0]):
        for b in range(blocks):
            simd.f32v_store(w_flat, i * kp + HALF * b, _mxfp4_half(codes, scales, r0 + i, b))


@numba.njit(**PARALLEL_NJIT_OPTIONS)
def _hifloat4_tile(scale, value, r0, w32):
    kp = w32.shape[1]
    w_flat = w32.reshape(-1)
    for i in numba.prange(w32.shape[0]):
        for b in range(scale.shape[1]):
            w0, w1 = _hifloat4_step(scale, value, r0 + i, b)
            _store(w_flat, i * kp + LANES * b, w0, w1)


@numba.njit(**_INLINE)
def _store(w_flat, at, w0, w1):
    simd.f32v_store(w_flat, at, w0)
    simd.f32v_store(w_flat, at + HALF, w1)


# ---- kernels -----------------------------------------------------------------------------------------------


def _padded_k(k: int) -> int:
    return -(-k // LANES) * LANES


class _WeightOnlyLinear(Kernel):
    """Shared driver: ``run(x, *weight, bias, out=)`` with x (..., K) FP16/BF16, the weight tensors of the
    format (validated by lowbit.ops.weight_only), bias (N,) or None, out (..., N) in x's dtype."""

    def _gemv(self, x32: np.ndarray, weight: tuple, y32: np.ndarray) -> None:
        raise NotImplementedError

    def _tile(self, weight: tuple, r0: int, w32: np.ndarray) -> None:
        raise NotImplementedError

    def run(self, x: torch.Tensor, *args, out: torch.Tensor) -> None:
        *weight, bias = args
        k, n = x.shape[-1], out.shape[-1]
        m = out.numel() // n
        kp = _padded_k(k)
        x32 = torch.zeros(m, kp, dtype=torch.float32)
        x32[:, :k] = x.reshape(m, k)
        y32 = torch.empty(m, n, dtype=torch.float32)
        weight_np = tuple(as_numpy(t) for t in weight)
        sync_threads()
        if m <= GEMV_MAX_M:
            self._gemv(as_numpy(x32), weight_np, as_numpy(y32))
        else:
            self._gemm(x32[:, :k], weight_np, n, kp, y32)
        out.view(m, n).copy_(reference.finish(y32, bias, out.dtype))

    def _gemm(self, x32: torch.Tensor, weight_np: tuple, n: int, kp: int, y32: torch.Tensor) -> None:
        rows = max(1, min(n, GEMM_TILE_ELEMENTS // kp))
        w32 = torch.empty(rows, kp, dtype=torch.float32)
        for r0 in range(0, n, rows):
            tile = w32[: min(rows, n - r0)]
            self._tile(weight_np, r0, as_numpy(tile))
            y32[:, r0 : r0 + tile.shape[0]] = x32 @ tile[:, : x32.shape[1]].T


class HiFloat8Linear(_WeightOnlyLinear):
    """hifloat8_linear on the CPU: ``run(x, codes, scale, bias, out=)``."""

    def _gemv(self, x32, weight, y32):
        _hifloat8_gemv(x32, *weight, y32)

    def _tile(self, weight, r0, w32):
        _hifloat8_tile(*weight, r0, w32)


class Mxfp4Linear(_WeightOnlyLinear):
    """mxfp4_linear on the CPU: ``run(x, codes, scales, bias, out=)``."""

    def _gemv(self, x32, weight, y32):
        _mxfp4_gemv(x32, *weight, y32)

    def _tile(self, weight, r0, w32):
        _mxfp4_tile(*weight, r0, w32)


class HiFloat4Linear(_WeightOnlyLinear):
    """hifloat4_linear on the CPU: ``run(x, scale, value, bias, out=)``."""

    def _gemv(self, x32, weight, y32):
        _hifloat4_gemv(x32, *weight, y32)

    def _tile(self, weight, r0, w32):
        _hifloat4_tile(*weight, r0, w32)


HIFLOAT8_LINEAR = HiFloat8Linear()
MXFP4_LINEAR = Mxfp4Linear()
HIFLOAT4_LINEAR = HiFloat4Linear()
