"""BF16 rows of an int4 weight decoded from the CPU kernel's tiles, for the dequant algorithm's tiles in the
(N, K) orientation (lowbit.kernels.cpu.wqbmm_dequant; docs/wqbmm.md, 'Dequant on a PackedWeight').

The tiles (docs/wqbmm.md, 'Weight tiles') hold, per column tile of 32 and K-group, chunks of 128 bytes of
8 rows of k: column ``lane``'s dword at byte 4 * lane holds u[k0 + j] in the low nibble of its byte j and
u[k0 + 4 + j] in the high one (u = W + 8). Four consecutive chunks are 32 rows of k. Per 16 columns:

* the four chunks' 64-byte halves of those columns (one dword per column each) are transposed so that each
  column's four dwords lie together (four dword and four qword two-source permutes);
* per column, one vpermt2b puts each of its 32 nibbles, in k order, in the low bits of a word, from the
  bytes and from the bytes shifted right by 4 (one word shift per four columns, which leaves each byte's
  high nibble in its low bits: the bits above are ignored);
* one vpermw looks the words up in the column's table: the 16 BF16 words of its K-group's dequantized values,
  held twice (32 words), so the index's bit 4, another nibble's, does not matter.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from lowbit.kernels.cpu import _simd as simd

COLUMNS = 16  # columns per step
ROWS = 32  # rows of k per step: four chunks
CHUNK_BYTES = 128
_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_DWORDS, _QWORDS = ir.VectorType(_I32, 16), ir.VectorType(_I64, 8)
_BYTES, _WORDS = ir.VectorType(_I8, 64), ir.VectorType(_I16, 32)


def _mask(indices: list[int]) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I32, len(indices)), indices)


def _interleave(first: int, count: int, size: int) -> ir.Constant:
    """Mask taking elements first .. first + count - 1 of two vectors of ``size``, alternately."""
    return _mask([i for e in range(first, first + count) for i in (e, size + e)])


def _nibble_mask(column: int) -> ir.Constant:
    """vpermt2b mask over (bytes, bytes >> 4) of four columns of 16 bytes: word w of ``column`` (both of its
    bytes) the byte whose nibble is row k0 + w: chunk w // 8, byte w % 4, high nibble (the shifted bytes) for
    w % 8 >= 4."""
    def source(w):
        return 16 * column + 4 * (w // 8) + w % 4 + (64 if w % 8 >= 4 else 0)

    return _mask([source(w) for w in range(ROWS) for _ in range(2)])


@intrinsic
def int4_rows_words(typingctx, tiles, at, tables, out, out_at, out_stride):
    """out[out_at + c * out_stride + r] <- tables[32 c + u] for the 16 columns c whose dwords start at
    ``tiles[at]`` in four consecutive chunks, and the 32 rows of k r they hold (u: the row's nibble).
    ``tiles``: 1-D uint8; ``tables``: 1-D int16, 32 words per column (its 16 values twice); ``out``: 1-D
    int16. AVX512-VBMI."""
    if not (isinstance(tables, types.Array) and tables.dtype == types.int16
            and isinstance(out, types.Array) and out.dtype == types.int16):
        return None

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        at, out_at, out_stride = (builder.sext(a, i64) if a.type.width < 64 else a for a in (args[1], args[4], args[5]))
        lookup = simd.vpermw(builder)
        chunks = [builder.load(simd._element_ptr(context, builder, sig.args[0], args[0],
                                                 builder.add(at, ir.Constant(i64, CHUNK_BYTES * p)), _DWORDS), align=1)
                  for p in range(4)]
        low01, high01 = (builder.bitcast(builder.shuffle_vector(chunks[0], chunks[1], _interleave(f, 8, 16)), _QWORDS)
                         for f in (0, 8))
        low23, high23 = (builder.bitcast(builder.shuffle_vector(chunks[2], chunks[3], _interleave(f, 8, 16)), _QWORDS)
                         for f in (0, 8))
        quads = [builder.shuffle_vector(a, b, _interleave(f, 4, 8))
                 for a, b in ((low01, low23), (high01, high23)) for f in (0, 4)]
        for q, quad in enumerate(quads):  # columns 4q .. 4q + 3, 16 bytes each
            as_bytes = builder.bitcast(quad, _BYTES)
            shifted = builder.bitcast(builder.lshr(builder.bitcast(quad, _WORDS), ir.Constant(_WORDS, [4] * 32)),
                                      _BYTES)
            for c in range(4):
                column = 4 * q + c
                index = builder.bitcast(builder.shuffle_vector(as_bytes, shifted, _nibble_mask(c)), _WORDS)
                table = builder.load(simd._element_ptr(context, builder, sig.args[2], args[2],
                                                       ir.Constant(i64, 32 * column), _WORDS), align=1)
                row_at = builder.add(out_at, builder.mul(out_stride, ir.Constant(i64, column)))
                builder.store(builder.call(lookup, [table, index]),
                              simd._element_ptr(context, builder, sig.args[3], args[3], row_at, _WORDS), align=1)
        return context.get_dummy_value()

    return types.void(tiles, at, tables, out, out_at, out_stride), codegen
