"""Blocks of the transpose of a matrix of BF16 bit patterns, every NaN made the canonical one, for the CPU
GEMM path's last step where torch computed y^T = W x^T (weight_only.transpose_bf16; docs/weight_only.md,
'CPU GEMM'); ``transpose_words``, the same without NaN handling (HiFloat4 fake quant's tiles,
lowbit.kernels.cpu.hifloat4); and ``transpose_pairs``, the same rounds on 16 x 16 pairs of words (32-bit
elements, no NaN handling): x^T in the AMX tiles' pair layout (lowbit.kernels.cpu.amx), HiFloat4's FP32 tiles.

Blocks of 32 x 32 words are transposed in registers: 32 rows of 32 words, then five rounds that each swap one
bit of the row index with the same bit of the column index (rows i and i + b exchange the second half of
every 2b-word chunk of row i with the first half of row i + b's, for b = 16, 8, 4, 2, 1), which LLVM lowers
to 128/256-bit lane shuffles, 64-bit unpacks and two-source permutes (vpermt2q / d / w): 160 shuffles per
1024 words. 4096 x 256 words took 0.27 ms against 0.77 ms for torch's strided copy on an Intel Xeon
(benchmarks/results_weight_only.md, 'Intel Xeon: transposed GEMM and BF16 tiles as words').
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from lowbit.formats import weight_only as reference
from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu._runtime import NJIT_OPTIONS

BLOCK = 32  # words per block side: one 512-bit register per row
_I16 = ir.IntType(16)
_ROW = ir.VectorType(_I16, BLOCK)


_BF16_NAN = np.int16(reference.NAN_BITS[torch.bfloat16])


@numba.njit(**dict(NJIT_OPTIONS, inline="always"))
def canonical_word(word):
    """A BF16 bit pattern, the canonical NaN if it is a NaN."""
    return _BF16_NAN if (word & 0x7FFF) > 0x7F80 else word


PAIR_BLOCK = 16  # pairs of words per block side of transpose_pairs: one 512-bit register per row
_PAIR_ROW = ir.VectorType(ir.IntType(32), PAIR_BLOCK)


def _round_masks(b: int, block: int) -> tuple[list[int], list[int]]:
    """shufflevector masks of rows i and i + b after the round that swaps bit b of the row and column index."""
    first = [c for s in range(0, block, 2 * b) for c in (*range(s, s + b), *range(block + s, block + s + b))]
    return first, [c + b for c in first]


def _rounds(block: int) -> list:
    """(b, first mask, second mask) of each round of a ``block`` x ``block`` transpose."""
    return [(b, *(ir.Constant(ir.VectorType(ir.IntType(32), block), mask) for mask in _round_masks(b, block)))
            for b in (block // 2, block // 4, block // 8, block // 16, block // 32) if b]


_ROUNDS, _PAIR_ROUNDS = _rounds(BLOCK), _rounds(PAIR_BLOCK)


def _transposed_rows(builder, rows: list, rounds: list) -> list:
    """The registers ``rows`` (one row of a square block each) after ``rounds``: the block's transpose."""
    for b, first, second in rounds:
        swapped = list(rows)
        for i in (r for r in range(len(rows)) if not r & b):
            swapped[i] = builder.shuffle_vector(rows[i], rows[i + b], first)
            swapped[i + b] = builder.shuffle_vector(rows[i], rows[i + b], second)
        rows = swapped
    return rows


def _offsets(builder, args):
    """Element offsets and strides, as i64."""
    i64 = ir.IntType(64)
    return [builder.sext(a, i64) if a.type.width < 64 else a for a in args]


def _row_pointer(context, builder, array_type, array, at, stride, row, vector_type):
    """Pointer to the ``vector_type`` at element ``at + row * stride`` of a 1-D int16 array."""
    at = builder.add(at, builder.mul(stride, ir.Constant(ir.IntType(64), row)))
    return simd._element_ptr(context, builder, array_type, array, at, vector_type)


def _make_transpose_block(streaming: bool, canonical_nan: bool = True):
    """The block intrinsic; ``streaming``: its stores non-temporal (every destination row 64-byte aligned),
    so that an output the cache does not hold is written without being read first; ``canonical_nan``: every
    BF16 NaN stored as the canonical one (else every word as it was)."""

    @intrinsic
    def transpose_block(typingctx, src, src_at, src_stride, dst, dst_at, dst_stride):
        """dst[dst_at + r * dst_stride + c] <- src[src_at + c * src_stride + r] for r, c < BLOCK, NaN canonical
        where the maker says so (``src`` and ``dst``: 1-D int16 arrays)."""
        if not all(isinstance(a, types.Array) and a.dtype == types.int16 for a in (src, dst)):
            return None

        def codegen(context, builder, sig, args):
            src_at, src_stride, dst_at, dst_stride = _offsets(builder, (args[1], args[2], args[4], args[5]))

            def pointer(array_type, array, at, stride, row):
                return _row_pointer(context, builder, array_type, array, at, stride, row, _ROW)

            rows = [builder.load(pointer(sig.args[0], args[0], src_at, src_stride, r), align=1)
                    for r in range(BLOCK)]
            rows = _transposed_rows(builder, rows, _ROUNDS)
            magnitude, infinity = ir.Constant(_ROW, [0x7FFF] * BLOCK), ir.Constant(_ROW, [0x7F80] * BLOCK)
            nan = ir.Constant(_ROW, [int(reference.NAN_BITS[torch.bfloat16])] * BLOCK)
            for r, row in enumerate(rows):
                if canonical_nan:
                    row = builder.select(builder.icmp_unsigned(">", builder.and_(row, magnitude), infinity), nan, row)
                at = pointer(sig.args[3], args[3], dst_at, dst_stride, r)
                store = builder.store(row, at, align=64 if streaming else 1)
                if streaming:
                    store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
            return context.get_dummy_value()

        return types.void(src, src_at, src_stride, dst, dst_at, dst_stride), codegen

    return transpose_block


transpose_block = _make_transpose_block(streaming=False)
transpose_block_streaming = _make_transpose_block(streaming=True)
transpose_words = _make_transpose_block(streaming=False, canonical_nan=False)  # every bit pattern kept


@intrinsic
def transpose_pairs(typingctx, src, src_at, src_stride, dst, dst_at, dst_stride):
    """dst[dst_at + r * dst_stride + 2 c + e] <- src[src_at + c * src_stride + 2 r + e] for r, c < PAIR_BLOCK and
    e < 2 (``src`` and ``dst``: 1-D int16 arrays): a 16 x 16 block of 32-bit pairs of words transposed."""
    if not all(isinstance(a, types.Array) and a.dtype == types.int16 for a in (src, dst)):
        return None

    def codegen(context, builder, sig, args):
        src_at, src_stride, dst_at, dst_stride = _offsets(builder, (args[1], args[2], args[4], args[5]))
        rows = [builder.load(_row_pointer(context, builder, sig.args[0], args[0], src_at, src_stride, r, _PAIR_ROW),
                             align=1) for r in range(PAIR_BLOCK)]
        for r, row in enumerate(_transposed_rows(builder, rows, _PAIR_ROUNDS)):
            builder.store(row, _row_pointer(context, builder, sig.args[3], args[3], dst_at, dst_stride, r, _PAIR_ROW),
                          align=1)
        return context.get_dummy_value()

    return types.void(src, src_at, src_stride, dst, dst_at, dst_stride), codegen


@intrinsic
def store_fence(typingctx):
    """sfence: the weakly ordered (non-temporal) stores before it made visible before any store after it."""

    def codegen(context, builder, sig, args):
        fence = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                               "llvm.x86.sse.sfence")
        builder.call(fence, [])
        return context.get_dummy_value()

    return types.void(), codegen
