"""The GEMM path on AMX tiles: a packed weight decoded 32 rows at a time into the cache and multiplied there by
``tdpbf16ps``, for BF16 x on CPUs with AMX-BF16 (Intel Xeon since Sapphire Rapids; docs/weight_only.md, 'AMX').

torch's BF16 GEMM reads a decoded weight from memory: the GEMM path wrote every decoded weight as a BF16 word
(stores that ran at 16-20 GB/s per core) and oneDNN read it back, repacked. Here a task decodes a panel of 32
rows of W (the format's own tile decoder, ``tile_rows``) into a buffer that stays in the L1 / L2 and runs the
tiles on it for every row of x at once:

    C^T (32 rows of W x 32 rows of x) += W panel (A: 2 tiles of 16 rows x 32 K) . x^T (B: 2 tiles of 16 K pairs
    x 16 rows of x, the pair layout tdpbf16ps reads)

Past CHUNKED_K columns a task runs K in chunks (``k_chunk_of``) whose x^T and decoded rows stay in the L2, each
block's sums kept in the task's buffer between chunks (the one pass's bits).

x^T is laid out once per call (``transpose_pairs``), each C^T block is rounded to BF16 (the bias added first)
and transposed into the output by the GEMM path's word transpose, every NaN made the canonical one. The sums
are float32 in AMX's order, with its handling of subnormals (inputs and results flushed to zero), as torch's
GEMM on these CPUs: inside the GEMM path's interval (docs/weight_only.md, 'Tolerance of the GEMM path'). With
svd_quant's low-rank branch each block also gets L = T u on the tiles and is written as bf16(bf16(L) + bf16(P))
(docs/weight_only.md, 'AMX': 'A low-rank branch').

The tile registers: C^T blocks tmm0-3, the two W tiles tmm4-5, the two x^T tiles tmm6-7, each 16 rows of 64
bytes. Instructions come as inline assembly (LLVM's intrinsics for them are not reachable from numba), which
numba's JIT can only assemble once LLVM's assembly parser is set up (``_enable``). Linux lets a process use
the tiles' 8 KiB of state only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM): ``AVAILABLE`` is whether it
did; where the CPU, the OS or a ``NUMBA_CPU_NAME`` override rules AMX out, nothing here is compiled or run.
"""

from __future__ import annotations

import ctypes
import sys

import numba
import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu import _transpose
from lowbit.kernels.cpu.mxfp4 import fake_quantize_block16 as _fake_quantize_block
from lowbit.kernels.cpu._runtime import NJIT_OPTIONS, SerialOrParallel, call_in_chunks, copy_elements, runs_serially
from lowbit.kernels.cpu.memory import scratch_or_thread

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def _enable() -> bool:
    """Ask Linux for the tile data state (once per process; inherited by its threads) and set up LLVM's
    assembly parser; whether AMX-BF16 can run here."""
    if not (simd.HAS_AMX_BF16 and sys.platform == "linux"):
        return False
    try:
        granted = ctypes.CDLL(None, use_errno=True).syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM,
                                                             _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False
    if granted:
        llvm_binding.initialize_native_asmparser()
    return granted


AVAILABLE = _enable()

PANEL = 32  # rows of W per C^T block: two A tiles
SUBPANELS = 4  # panels per task
TILE_K = 32  # elements of K per tile row (64 bytes of BF16)
_I8P, _I64, _VOID = ir.IntType(8).as_pointer(), ir.IntType(64), ir.VoidType()


def _config() -> np.ndarray:
    """ldtilecfg's 64 bytes: palette 1, tiles 0-7 of 16 rows x 64 bytes."""
    cfg = np.zeros(64, dtype=np.uint8)
    cfg[0] = 1
    for t in range(8):
        cfg[16 + 2 * t] = 64  # bytes per row (16-bit little-endian field)
        cfg[48 + t] = 16  # rows
    return cfg


_CONFIG = _config()


def _asm(builder, text: str, operands=()) -> None:
    """Inline assembly ``text`` (AT&T) with pointer / i64 ``operands`` as $0, $1, ...; it touches memory."""
    kinds = [op.type for op in operands]
    constraints = ",".join(["r"] * len(operands) + ["~{memory}"])
    builder.call(ir.InlineAsm(ir.FunctionType(_VOID, kinds), text, constraints, side_effect=True), list(operands))


def _byte_pointer(context, builder, array_type, array, offset):
    """i8* to byte ``offset`` of an array's data."""
    data = builder.bitcast(context.make_array(array_type)(context, builder, array).data, _I8P)
    return builder.gep(data, [offset])


@intrinsic
def _load_config(typingctx, cfg):
    """ldtilecfg from a 64-byte uint8 array."""

    def codegen(context, builder, sig, args):
        _asm(builder, "ldtilecfg ($0)", [_byte_pointer(context, builder, sig.args[0], args[0], ir.Constant(_I64, 0))])
        return context.get_dummy_value()

    return types.void(cfg), codegen


@intrinsic
def _release(typingctx):
    """tilerelease: the tiles back to their initial state (the thread's AMX state no longer in use)."""

    def codegen(context, builder, sig, args):
        _asm(builder, "tilerelease")
        return context.get_dummy_value()

    return types.void(), codegen


def _make_tile_op(text: str, doc: str):
    """An intrinsic ``op(array, byte offset, byte stride)`` emitting ``text`` with $0 the address, $1 the stride."""

    @intrinsic
    def op(typingctx, array, offset, stride):
        def codegen(context, builder, sig, args):
            offset, stride = (builder.sext(a, _I64) if a.type.width < 64 else a for a in args[1:])
            _asm(builder, text, [_byte_pointer(context, builder, sig.args[0], args[0], offset), stride])
            return context.get_dummy_value()

        return types.void(array, types.int64, types.int64), codegen

    op.__doc__ = doc
    return op


def _make_plain(text: str, doc: str):
    @intrinsic
    def op(typingctx):
        def codegen(context, builder, sig, args):
            _asm(builder, text)
            return context.get_dummy_value()

        return types.void(), codegen

    op.__doc__ = doc
    return op


_HALF = ir.VectorType(ir.FloatType(), simd.LANES // 2)


@intrinsic
def _tile_sums_as_bf16(typingctx, value):
    """A vector of the tiles' float32 sums (simd.F32V), each rounded to BF16 (as float32) by one
    ``vcvtne2ps2bf16``: ties to even, NaN stays NaN. The instruction flushes subnormal inputs to zero, which
    the tiles' sums never are (tdpbf16ps flushes its subnormal results), so it rounds them exactly."""

    def codegen(context, builder, sig, args):
        halves = [builder.shuffle_vector(args[0], args[0], ir.Constant(ir.VectorType(ir.IntType(32), simd.LANES // 2),
                                                                        list(range(h, h + simd.LANES // 2))))
                  for h in (0, simd.LANES // 2)]
        words_type = ir.VectorType(ir.IntType(16), simd.LANES)
        convert = ir.InlineAsm(ir.FunctionType(words_type, [_HALF, _HALF]), "vcvtne2ps2bf16 $2, $1, $0", "=v,v,v")
        words = builder.call(convert, [halves[1], halves[0]])  # the low half from the last operand
        widened = builder.zext(words, ir.VectorType(ir.IntType(32), simd.LANES))
        upper = builder.shl(widened, ir.Constant(widened.type, [16] * simd.LANES))
        return builder.bitcast(upper, ir.VectorType(ir.FloatType(), simd.LANES))

    return simd.F32V(value), codegen


_load = [_make_tile_op(f"tileloadd ($0,$1,1), %tmm{t}", f"tmm{t} <- 16 rows of 64 bytes") for t in range(8)]
_store = [_make_tile_op(f"tilestored %tmm{t}, ($0,$1,1)", f"16 rows of 64 bytes <- tmm{t}") for t in range(4)]
_zero = [_make_plain(f"tilezero %tmm{t}", f"tmm{t} <- 0") for t in range(4)]
_C00, _C01, _C10, _C11 = (_make_plain(f"tdpbf16ps %tmm{b}, %tmm{a}, %tmm{c}", f"tmm{c} += tmm{a} . tmm{b}")
                          for c, a, b in ((0, 4, 6), (1, 4, 7), (2, 5, 6), (3, 5, 7)))
_load_c00, _load_c01, _load_c10, _load_c11 = _load[:4]
_load_a0, _load_a1, _load_b0, _load_b1 = _load[4:]
_store_c00, _store_c01, _store_c10, _store_c11 = _store
_zero_c00, _zero_c01, _zero_c10, _zero_c11 = _zero


@numba.njit(**NJIT_OPTIONS)
def x_pairs(x_bits, xt):
    """xt <- x^T for the B tiles, in slabs of PANEL rows of x: xt (mp / PANEL, kp / 2, PANEL) int32 (any contents
    before), slab s row i column j the pair of words (x[r, 2i], x[r, 2i + 1]) of row r = PANEL s + j, from x_bits
    (M, K) int16, C-contiguous; zero past M and K (kp: K rounded up to TILE_K, mp: M rounded up to PANEL). A
    slab's B tiles (16 rows of 64 bytes, 128 bytes apart) then lie in 2 KiB, not in 16 rows a whole x^T row
    apart (16 pages at M = 1888; with the scratch kept between calls, 4096^2 at M = 256 went from 1.5-2.2x to
    1.1x F.linear's time on the Xeon here). Slab by slab (:func:`_x_pairs_slab`)."""
    for s in range(xt.shape[0]):
        _x_pairs_slab(x_bits, xt, s)


@numba.njit(**NJIT_OPTIONS)
def _x_pairs_slab(x_bits, xt, s):
    """Slab ``s`` of x_pairs' xt: rows PANEL s .. PANEL s + PANEL - 1 of x."""
    m, k = x_bits.shape
    pairs = xt.shape[1]
    xt_words = xt.view(np.int16)
    x_flat, xt_flat = simd.flat(x_bits), simd.flat(xt_words)
    block = _transpose.PAIR_BLOCK
    full_m, full_k = m - m % block, k - k % (2 * block)
    first, end = PANEL * s, min(PANEL * (s + 1), m)
    for i in range(full_k // 2 if PANEL * (s + 1) <= full_m else 0, pairs):  # zeros where the blocks do not write:
        for j in range(PANEL):  # the edges fill theirs in after
            xt[s, i, j] = 0
    slab_at = s * 2 * pairs * PANEL
    for m0 in range(first, min(end, full_m), block):
        for k0 in range(0, full_k, 2 * block):
            _transpose.transpose_pairs(x_flat, m0 * k + k0, k, xt_flat, slab_at + 2 * (m0 - first) + k0 * PANEL,
                                       2 * PANEL)
    for i in range(first, end):  # the edges: rows past the blocks, then columns past them
        for c in range(0 if i >= full_m else full_k, k):
            xt_words[s, c // 2, 2 * (i - first) + c % 2] = x_bits[i, c]


@numba.njit(**dict(NJIT_OPTIONS, inline="always"))
def _zero_padding(w, rows, k, kp):
    """Columns K .. kp - 1 of the decoded rows set to 0: x^T is 0 there, but a NaN or Inf left in the buffer would
    still make a NaN. (Rows of the buffer past the weight's last one are left as they are: each row of W only
    makes its own row of sums, which is not stored.)"""
    for r in range(rows):
        for c in range(k, kp):
            w[r, c] = 0


@numba.njit(**dict(NJIT_OPTIONS, inline="always"))
def _multiply_panel(w, r0, xt, m0, k0, k1, c32, columns, accumulate):
    """c32 (PANEL, PANEL) float32 <- rows r0 .. r0 + PANEL - 1 of ``w`` (decoded W, BF16 bits, rows of k1 or
    more words) times x^T's columns m0 .. m0 + PANEL - 1 over K's columns k0 .. k1 - 1 (multiples of TILE_K),
    added to c32's sums where ``accumulate`` (the tiles' order over K, as one call over all of it: the float32
    sums go out and back exactly), on the tiles (configured by the caller); only the first 16 columns where
    ``columns`` (the rows of x left from m0) is at most 16: half the tile loads and products (rows of x past M
    are zeros, so the other half would be thrown away)."""
    w_stride, slab = 2 * w.shape[1], m0 // PANEL
    both = columns > 16
    if accumulate:
        _load_c00(c32, 0, 4 * PANEL)
        _load_c10(c32, 4 * 16 * PANEL, 4 * PANEL)
        if both:
            _load_c01(c32, 4 * 16, 4 * PANEL)
            _load_c11(c32, 4 * (16 * PANEL + 16), 4 * PANEL)
    else:
        _zero_c00()
        _zero_c10()
        if both:
            _zero_c01()
            _zero_c11()
    for kk in range(k0, k1, TILE_K):
        _load_a0(w, 2 * (r0 * w.shape[1] + kk), w_stride)
        _load_a1(w, 2 * ((r0 + 16) * w.shape[1] + kk), w_stride)
        _load_b0(xt, 4 * PANEL * (slab * xt.shape[1] + kk // 2), 4 * PANEL)
        _C00()
        _C10()
        if both:
            _load_b1(xt, 4 * (PANEL * (slab * xt.shape[1] + kk // 2) + 16), 4 * PANEL)
            _C01()
            _C11()
    _store_c00(c32, 0, 4 * PANEL)
    _store_c10(c32, 4 * 16 * PANEL, 4 * PANEL)
    if both:
        _store_c01(c32, 4 * 16, 4 * PANEL)
        _store_c11(c32, 4 * (16 * PANEL + 16), 4 * PANEL)


@numba.njit(**dict(NJIT_OPTIONS, inline="always"))
def _round_block(c32, bias32, has_bias, low32, has_low, n0, rows, m0, words, out_bits):
    """out[m0 .., n0 ..] <- c32^T (the block's float32 sums, a row per row of W) plus the bias, rounded to BF16,
    NaN canonical; where ``has_low``, bf16(bf16(low32) + that), ``low32`` the block's low-rank sums (as c32).
    Only the block's ``rows`` rows of W and the rows of x below M."""
    m, n = out_bits.shape
    c_flat, low_flat = simd.flat(c32), simd.flat(low32)
    for r in range(PANEL):  # a row is one vector (simd.LANES == PANEL)
        value = simd.f32v_load(c_flat, r * PANEL)
        if has_bias:
            value = simd.f32v_add(value, simd.f32v_splat(bias32[n0 + r]))
        if has_low:  # both sums straight from the tiles
            value = simd.f32v_add(_tile_sums_as_bf16(simd.f32v_load(low_flat, r * PANEL)), _tile_sums_as_bf16(value))
        simd.f32v_store_as_bf16(words, r * PANEL, value)
    cols, out_flat = min(PANEL, m - m0), simd.flat(out_bits)
    if rows == PANEL and cols == PANEL:
        _transpose.transpose_block(words, 0, PANEL, out_flat, m0 * n + n0, n)
        return
    _transpose.transpose_block(words, 0, PANEL, words, 0, PANEL)  # in place (every row is loaded first)
    for i in range(cols):  # whole rows as vectors: scalar loads of the words just stored would stall
        if rows == PANEL:
            simd.i16v_store(out_flat, (m0 + i) * n + n0, simd.i16v_load(words, i * PANEL))
        else:
            copy_elements(out_flat, (m0 + i) * n + n0, words, i * PANEL, rows)


BIAS_NONE, BIAS_BF16, BIAS_FLOAT32 = 0, 1, 2  # kinds of ``bias_bits``


@numba.njit(**NJIT_OPTIONS)
def _bias_values(bias_bits, bias_kind, n):
    """The bias as float32, N rounded up to PANEL (zeros past N, and everywhere for BIAS_NONE): ``bias_bits``
    holds BF16 bit patterns (N,) for BIAS_BF16, float32 values' bits (2N,) for BIAS_FLOAT32."""
    words = np.zeros(-(-n // PANEL) * PANEL, dtype=np.int32)
    if bias_kind == BIAS_BF16:
        for i in range(n):
            words[i] = np.int32(bias_bits[i] & 0xFFFF) << 16  # a BF16 value is its float32's upper half
    elif bias_kind == BIAS_FLOAT32:
        copy_elements(words, 0, bias_bits.view(np.int32), 0, n)
    return words.view(np.float32)


@numba.njit(**dict(NJIT_OPTIONS, inline="always"))
def _lines(nbytes):
    return -(-nbytes // 64) * 64


@numba.njit(**NJIT_OPTIONS)
def scratch_layout(m, k, rp, width, slots, k_chunk):
    """(x^T's bytes, T^T's bytes, one task slot's bytes, total) of _amx_gemm's scratch for M rows of x, K columns,
    a low-rank branch of ``rp`` (R rounded up to TILE_K; 0: none), decoded rows of ``width`` words, ``slots``
    task slots (one per thread that may run tasks) and chunks of ``k_chunk`` columns of K (k_chunk_of): x^T
    (x_pairs) first, then T^T, then per slot a task's decoded rows (SUBPANELS * PANEL rows of ``width``), four
    blocks of float32 sums, one of words, the task's rows of u^T (SUBPANELS * PANEL rows of ``rp``) and, where
    K takes several chunks, a block of float32 sums per block of the task (SUBPANELS * mp / PANEL); each part a
    whole number of 64-byte lines."""
    mp, kp = -(-m // PANEL) * PANEL, -(-k // TILE_K) * TILE_K
    xt, tt = _lines(mp * kp * 2), _lines(mp * rp * 2)
    slot = (_lines(SUBPANELS * PANEL * width * 2) + _lines(4 * PANEL * PANEL * 4) + _lines(PANEL * PANEL * 2)
            + _lines(SUBPANELS * PANEL * rp * 2) + (_lines(SUBPANELS * mp * PANEL * 4) if k_chunk < kp else 0))
    return xt, tt, slot, xt + tt + slots * slot


@numba.njit(**dict(NJIT_OPTIONS, inline="always"))
def _task_slot(scratch, at, width, rp, mp_chunked):
    """(decoded rows, four blocks of sums: two of products, two of low-rank sums, one block of words, rows of u^T,
    the blocks' sums between K's chunks: SUBPANELS * mp_chunked / PANEL blocks, none where ``mp_chunked`` is 0)
    in the task slot at byte ``at`` of ``scratch`` (scratch_layout)."""
    rows = SUBPANELS * PANEL
    w_bytes, c_bytes, words_bytes = _lines(rows * width * 2), _lines(4 * PANEL * PANEL * 4), _lines(PANEL * PANEL * 2)
    w = scratch[at : at + rows * width * 2].view(np.int16).reshape((rows, width))
    at += w_bytes
    c32 = scratch[at : at + c_bytes].view(np.float32).reshape((4, PANEL, PANEL))
    at += c_bytes
    words = scratch[at : at + PANEL * PANEL * 2].view(np.int16)
    at += words_bytes
    ut = scratch[at : at + rows * rp * 2].view(np.int16).reshape((rows, rp))
    at += _lines(rows * rp * 2)
    blocks = SUBPANELS * mp_chunked // PANEL
    acc = scratch[at : at + blocks * PANEL * PANEL * 4].view(np.float32).reshape((blocks, PANEL, PANEL))
    return w, c32, words, ut, acc


@numba.njit(**NJIT_OPTIONS)
def _low_rank_rows(u_bits, first, rows, ut):
    """ut[i, c] <- u[c, first + i] for i < ``rows`` and c < R, 0 for R <= c < rp: a task's rows of u^T, from
    u_bits (R, N) int16 C-contiguous into ut (>= rows, rp) int16 (rows past ``rows`` not written: each only
    makes its own row of sums, which is not stored). NaN canonical (transpose_block's)."""
    r, n = u_bits.shape
    rp = ut.shape[1]
    u_flat, ut_flat = simd.flat(u_bits), simd.flat(ut)
    full_rows, full_r = rows - rows % PANEL, r - r % PANEL
    for i0 in range(0, full_rows, PANEL):
        for c0 in range(0, full_r, PANEL):
            _transpose.transpose_block(u_flat, c0 * n + first + i0, n, ut_flat, i0 * rp + c0, rp)
    for i in range(rows):  # the edges: columns past the blocks, then rows past them
        for c in range(full_r if i < full_rows else 0, rp):
            ut[i, c] = u_bits[c, first + i] if c < r else 0


@numba.njit(**NJIT_OPTIONS)
def _quantized_pairs_slab(x_bits, xt, s, mask, scale_of, thr, values, scales):
    """Slab ``s`` of x_pairs' xt for x's MXFP4 fake quant instead of x (blocks of 32 along K, K a multiple of 32;
    lowbit.kernels.cpu.mxfp4.fake_quantize_block16 with ``mask`` .. ``values``), and ``scales`` (M, K/32) uint8
    <- the blocks' scale bytes: 16 rows' blocks quantized into 1 KiB, then transposed as pairs, so the
    quantized x is never written out. Columns of the slab past M are left as they are: each only makes its own
    column of sums, which is not stored (and with K a multiple of 32 there are no pairs past K)."""
    m, k = x_bits.shape
    pairs, block = xt.shape[1], _transpose.PAIR_BLOCK
    xt_words = xt.view(np.int16)
    x_flat, xt_flat = simd.flat(x_bits).view(np.uint16), simd.flat(xt_words)
    full_m, first, end = m - m % block, PANEL * s, min(PANEL * (s + 1), m)
    rows = np.empty(block * TILE_K, dtype=np.uint16)
    row_words = rows.view(np.int16)
    slab_at = s * 2 * pairs * PANEL
    for m0 in range(first, min(end, full_m), block):
        for b in range(k // TILE_K):
            for r in range(block):
                scales[m0 + r, b] = _fake_quantize_block(x_flat, (m0 + r) * k + TILE_K * b, mask, scale_of, thr,
                                                         values, rows, TILE_K * r)
            _transpose.transpose_pairs(row_words, 0, TILE_K, xt_flat, slab_at + 2 * (m0 - first) + TILE_K * b * PANEL,
                                       2 * PANEL)
    for i in range(max(first, full_m), end):
        for b in range(k // TILE_K):
            scales[i, b] = _fake_quantize_block(x_flat, i * k + TILE_K * b, mask, scale_of, thr, values, rows, 0)
            for c in range(TILE_K):
                xt_words[s, (TILE_K * b + c) // 2, 2 * (i - first) + c % 2] = row_words[c]


def _lay_out(x_bits, t_bits, rp, scratch, xt_bytes, slab_args):
    """x^T (x_pairs' slabs, slab by slab: ``_SLAB(x_bits, xt, s, *slab_args)``, bound) at the start of ``scratch``
    and, where ``rp`` (R rounded up to TILE_K) is not 0, T^T at byte ``xt_bytes``: _amx_gemm's operands of the
    tiles' B (scratch_layout)."""
    m, k = x_bits.shape
    kp, mp = -(-k // TILE_K) * TILE_K, -(-m // PANEL) * PANEL
    xt = scratch[: mp * kp * 2].view(np.int32).reshape((mp // PANEL, kp // 2, PANEL))
    for s in numba.prange(mp // PANEL):
        _SLAB(x_bits, xt, s, *slab_args)  # noqa: F821 (bound)
    if rp:
        tt = scratch[xt_bytes : xt_bytes + mp * rp * 2].view(np.int32)
        x_pairs(t_bits, tt.reshape((mp // PANEL, rp // 2, PANEL)))


# One layout for every format's kernel: its parallel loop compiled once (inside each kernel's parallel loop, a
# second prange cost 2.5 s of compiling per format), run by :func:`run` before the kernel's parallel form; the
# serial form calls the serial one itself (one numba call from Python). The quantized one: svd_quant's prefill.
_LAY_OUT = SerialOrParallel(_lay_out, "_amx_lay_out", _SLAB=_x_pairs_slab)
_LAY_OUT_QUANTIZED = SerialOrParallel(_lay_out, "_amx_lay_out_quantized", _SLAB=_quantized_pairs_slab)
_lay_out_here = _LAY_OUT.serial


def _amx_gemm(operands, x_bits, n, width, bias_bits, bias_kind, t_bits, u_bits, scratch, slots, k_chunk, laid_out,
              out_bits):
    """out_bits (M, N) int16 <- x_bits (M, K) BF16 bits times the (N, K) weight whose rows
    ``_TILE_ROWS(*operands, r0, first, end, w)`` decodes as BF16 bits (the GEMM path's tile decoder, bound by
    _kernels), plus the bias (_bias_values): x^T laid out once (x_pairs), then a task per SUBPANELS panels of
    PANEL rows of W, decoded into a buffer (rows of ``width`` >= the decoder's row) and multiplied on the tiles
    by every PANEL rows of x, panel after panel (x^T's slabs read again from the cache), over K in chunks of
    ``k_chunk`` columns (k_chunk_of: a chunk of x^T and of the task's rows stay in the L2 while all of its
    blocks run; the sums wait in the slot between chunks). Each block's rounding overlaps the next block's
    products (two buffers of sums, or the block's own). With a low-rank branch (``t_bits`` (M, R) and
    ``u_bits`` (R, N) BF16 bits, R > 0), each task also lays out its rows of u^T and each block gets its sums of
    T u on the tiles: the result is bf16(bf16(T u) + bf16(x W^T)) (no bias then).
    ``scratch``: uint8, scratch_layout's total for ``slots`` slots (1, or numba's largest thread count: a task
    takes its thread's slot, ``_SLOT()``), x^T and T^T already in it where ``laid_out`` (_lay_out)."""
    m, k = x_bits.shape
    rp = np.int64(0)  # not the literal 0: scratch_layout and _lay_out_here would compile for it a second time
    if _LOW_RANK:  # noqa: F821 (bound: a constant, so that the other formats' kernels compile none of the branch)
        rp = -(-u_bits.shape[0] // TILE_K) * TILE_K
    kp, mp = -(-k // TILE_K) * TILE_K, -(-m // PANEL) * PANEL
    xt_bytes, tt_bytes, slot_bytes, _ = scratch_layout(m, k, rp, width, slots, k_chunk)
    chunked = k_chunk < kp
    if not laid_out:
        _lay_out_here(x_bits, t_bits, rp, scratch, xt_bytes, ())
    xt = scratch[: mp * kp * 2].view(np.int32).reshape((mp // PANEL, kp // 2, PANEL))
    tt = scratch[xt_bytes : xt_bytes + mp * rp * 2].view(np.int32).reshape((mp // PANEL, rp // 2, PANEL))
    bias32 = _bias_values(bias_bits, bias_kind, n)
    for task in numba.prange(-(-n // (SUBPANELS * PANEL))):
        first = task * SUBPANELS * PANEL
        rows = min(SUBPANELS * PANEL, n - first)
        at = xt_bytes + tt_bytes + _SLOT() * slot_bytes  # noqa: F821 (bound)
        w, c32, words, ut, acc = _task_slot(scratch, at, width, rp, mp if chunked else 0)
        _TILE_ROWS(*operands, first, 0, rows, w)  # noqa: F821 (bound per format)
        if _LOW_RANK and rp:  # noqa: F821 (bound)
            _low_rank_rows(u_bits, first, rows, ut)
        _task_products(w, ut, xt, tt, c32, acc, words, bias32, bias_kind, first, rows, k, k_chunk, out_bits)


@numba.njit(**NJIT_OPTIONS)
def _task_products(w, ut, xt, tt, c32, acc, words, bias32, bias_kind, first, rows, k, k_chunk, out_bits):
    """A task's products on the tiles and their rounding into out_bits, after its ``rows`` rows of W from row
    ``first`` were decoded into ``w`` (and its rows of u^T into ``ut``, R > 0): the half of _amx_gemm that
    is the same for every format, so compiled once, not once per format's kernel (about 0.6 s each). The
    task's slot as _task_slot returns it (``acc``: no blocks where K is not chunked); x^T and T^T in ``xt``
    and ``tt`` (T^T empty: no low-rank branch)."""
    m = out_bits.shape[0]
    kp, mp, rp = xt.shape[1] * 2, xt.shape[0] * PANEL, tt.shape[1] * 2
    chunked = k_chunk < kp
    panels = -(-rows // PANEL)
    _zero_padding(w, rows, k, kp)
    _load_config(_CONFIG)
    blocks = panels * (mp // PANEL)
    for k0 in range(0, kp, k_chunk):  # the blocks' sums go on in acc between chunks; the last one rounds them
        k1 = min(k0 + k_chunk, kp)
        last = k1 == kp
        for b in range(blocks + 1 if last else blocks):
            if b < blocks:  # its products go to the tiles; the previous block is rounded while they run
                p, m0 = b % panels, (b // panels) * PANEL
                sums = acc[b] if chunked else c32[b % 2]
                _multiply_panel(w, p * PANEL, xt, m0, k0, k1, sums, m - m0, k0 > 0)
                if last and rp:
                    _multiply_panel(ut, p * PANEL, tt, m0, 0, rp, c32[2 + b % 2], m - m0, False)
            if last and b > 0:
                p, m0 = (b - 1) % panels, ((b - 1) // panels) * PANEL
                sums = acc[b - 1] if chunked else c32[(b - 1) % 2]
                _round_block(sums, bias32, bias_kind != BIAS_NONE, c32[2 + (b - 1) % 2], rp > 0,
                             first + p * PANEL, min(PANEL, rows - p * PANEL), m0, words, out_bits)
    _release()


@numba.njit(**dict(NJIT_OPTIONS, inline="always"))
def _thread_slot():
    """The task slot of the thread running this iteration of the parallel loop: its id in numba's pool."""
    return numba.get_thread_id()


@numba.njit(**dict(NJIT_OPTIONS, inline="always"))
def _first_slot():
    """The one task slot of the serial loop. (Not numba.get_thread_id(): LLVM may call that ahead of a branch
    meant to skip it, and before numba's threading layer has started it crashes the process.)"""
    return 0


_KERNELS: dict = {}
_LOW_RANK_DECODERS: set = set()  # names of the tile decoders whose kernel carries the low-rank branch


def carry_low_rank(tile_rows) -> None:
    """Have the kernel of the tile decoder ``tile_rows`` carry the low-rank branch (``run``'s ``low_rank``; every
    call of that decoder then uses the one kernel that has it: one compiling). Before its first :func:`run`."""
    _LOW_RANK_DECODERS.add(tile_rows.py_func.__name__)


def _kernels(tile_rows) -> SerialOrParallel:
    """_amx_gemm bound to the tile decoder ``tile_rows`` (a numba function), made once per decoder; the parallel
    loop's tasks take their thread's slot, the serial loop's the first; the low-rank branch where
    :func:`carry_low_rank` asked for it."""
    low_rank = tile_rows.py_func.__name__ in _LOW_RANK_DECODERS
    name = f"_amx_gemm{tile_rows.py_func.__name__}" + ("_low_rank" if low_rank else "")  # numba's cache key
    if name not in _KERNELS:
        _KERNELS[name] = SerialOrParallel(_amx_gemm, name, serial_bound={"_SLOT": _first_slot},
                                          _TILE_ROWS=tile_rows, _SLOT=_thread_slot, _LOW_RANK=low_rank)
    return _KERNELS[name]


# K in chunks in _amx_gemm past CHUNKED_K columns (a task's 128 decoded rows of W then take more than 1 MiB), of
# at most X_CHUNK_BYTES of x^T: a chunk of x^T and of the task's rows stay in a core's L1 / L2 while every block
# of the task runs on them; in one pass a task re-read its decoded rows from the L3 for every 32 rows of x.
# Intel Xeon (480 MiB L3, family 6 model 167), MXFP4 / HiFloat8, time over F.linear's, one pass against chunks of
# 512 / 256 / 128 KiB of x^T: 4096 x 11008 at M = 256 1.41 / 1.45 against 1.07-1.09 / 1.04-1.08 / 0.95 (MXFP4) and
# 1.13-1.18 / 1.11-1.15 / 1.04 (HiFloat8); 12288 x 8192 at M = 512 1.31 / 1.29 against 0.95-1.00 / 0.92-0.94 /
# 0.94 and 0.99-1.04 / 0.97-0.99 / 0.99; M = 16-128 chunks of 128 KiB took 4-19 % less time than one pass; at
# K = 4096 one pass was as fast or faster (4096^2 at M = 512 0.90 against 1.01x): benchmarks/results_weight_only.md,
# 'K in chunks on the AMX tiles'.
CHUNKED_K = 4096
X_CHUNK_BYTES = 128 << 10


def k_chunk_of(m: int, k: int) -> int:
    """Columns of K per chunk of _amx_gemm's products for M rows of x: all of K (rounded up to TILE_K) up to
    CHUNKED_K columns or where x^T takes at most X_CHUNK_BYTES, else the most multiples of TILE_K whose rows of
    x^T do (at least one)."""
    mp, kp = -(-m // PANEL) * PANEL, -(-k // TILE_K) * TILE_K
    if kp <= CHUNKED_K or mp * kp * 2 <= X_CHUNK_BYTES:
        return kp
    return max(TILE_K, X_CHUNK_BYTES // (2 * mp) // TILE_K * TILE_K)


def scratch_bytes(m: int, k: int, width: int, r: int = 0) -> int:
    """Bytes of the scratch :func:`run` uses for M rows of x, K columns, decoded rows of ``width`` words and a
    low-rank branch of rank ``r`` (0: none), whatever numba's thread count (a slot for each of its threads)."""
    return int(scratch_layout(m, k, -(-r // TILE_K) * TILE_K, width, numba.config.NUMBA_NUM_THREADS,
                              k_chunk_of(m, k))[3])


# Products (M N K) below which a call runs on the calling thread.
ONE_THREAD_PRODUCTS = 1 << 23
_NO_LOW_RANK = (np.zeros((0, 0), dtype=np.int16), np.zeros((0, 0), dtype=np.int16))


def run(tile_rows, operands: tuple, x_bits: np.ndarray, n: int, width: int, bias_bits: np.ndarray, bias_kind: int,
        out_bits: np.ndarray, scratch=None, low_rank: tuple = _NO_LOW_RANK, fake_quant=None) -> None:
    """out_bits (M, N) <- x_bits (M, K) times the (N, K) weight that ``tile_rows(*operands, r0, first, end, w)``
    decodes (rows r0 + first .. r0 + end - 1 into rows first .. of ``w``, (rows, width) int16 BF16 bits, columns
    from K on zeros or not written), plus the bias (``bias_bits`` of ``bias_kind``, _bias_values), rounded to
    BF16, NaN canonical; x_bits and out_bits BF16 bit patterns (int16), C-contiguous. ``low_rank``: none, or
    (T (M, R), u (R, N)) BF16 bits, C-contiguous, with BIAS_NONE: out = bf16(bf16(T u) + bf16(x W^T)), T u summed
    on the tiles too. ``fake_quant``: none, or (mask, scale_of, thr, values, scales) of
    lowbit.kernels.cpu.mxfp4.fake_quantizer and scales (M, K/32) uint8: x's MXFP4 fake quant takes x's place
    (laid out straight into x^T; K a multiple of 32) and ``scales`` gets its blocks' scale bytes. In one numba
    call (two with a fake quant), on numba's threads from ONE_THREAD_PRODUCTS on. x^T and the tasks' buffers go
    in the calling thread's scratch buffer, or in ``scratch`` (uint8, at least :func:`scratch_bytes`) where given.
    Only where AVAILABLE; shapes and dtypes checked by the caller (weight_only.run_gemm_path,
    weight_only.WeightOnlyLinear.run_low_rank)."""
    kernel = _kernels(tile_rows)
    (m, k), rp = x_bits.shape, -(-low_rank[1].shape[0] // TILE_K) * TILE_K
    if rp and tile_rows.py_func.__name__ not in _LOW_RANK_DECODERS:
        raise ValueError(f"amx.run: the kernel of {tile_rows.py_func.__name__} has no low-rank branch (carry_low_rank)")
    if rp and bias_kind != BIAS_NONE:  # P + bias could be subnormal, which _tile_sums_as_bf16 would flush
        raise ValueError("amx.run: a low-rank branch takes no bias")
    if fake_quant is not None and k % TILE_K:
        raise ValueError(f"amx.run: x's fake quant needs K a multiple of {TILE_K}, got {k}")
    serial = runs_serially(m * n * (k + rp), ONE_THREAD_PRODUCTS)
    slots = 1 if serial else numba.config.NUMBA_NUM_THREADS
    k_chunk = k_chunk_of(m, k)
    xt_bytes, _, _, nbytes = scratch_layout(m, k, rp, width, slots, k_chunk)
    with scratch_or_thread(scratch, nbytes) as buffer:
        scratch = buffer.numpy()
        args = (operands, x_bits, n, width, bias_bits, bias_kind, *low_rank, scratch, slots, k_chunk)
        laid_out = fake_quant is not None or not serial  # else the serial kernel lays x out itself
        if laid_out:
            lay_out = _LAY_OUT if fake_quant is None else _LAY_OUT_QUANTIZED
            layout_args = (x_bits, low_rank[0], rp, scratch, xt_bytes, () if fake_quant is None else fake_quant)
            if serial:
                lay_out.serial(*layout_args)
            else:
                call_in_chunks(1, lay_out.parallel, *layout_args)
        if serial:
            kernel.serial(*args, laid_out, out_bits)
        else:
            call_in_chunks(1, kernel.parallel, *args, laid_out, out_bits)
