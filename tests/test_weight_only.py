"""Weight-only linear operators: every kernel equals the reference bit for bit (CPU GEMV, Triton), the CPU
GEMM path stays within the derived interval, the SIMD building blocks in both lowerings, and errors."""

import math
import subprocess
import sys

import numba
import numpy as np
import pytest
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

import lowbit
from lowbit.errors import DeviceError, DtypeError, ShapeError
from lowbit.formats import hifloat4, hifloat8, mxfp4, mxfp8
from lowbit.formats import weight_only as reference
from lowbit.kernels.cpu import _code8_columns as columns
from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu import amx
from lowbit.kernels.cpu import _weight_only_batched as wo_batched
from lowbit.kernels.cpu import _weight_only_decode4 as wo_decode4
from lowbit.kernels.cpu import _weight_only_decode8 as wo_decode8
from lowbit.kernels.cpu import _weight_only_gemv4 as wo_gemv4
from lowbit.kernels.cpu import _weight_only_gemv8 as wo_gemv8
from lowbit.kernels.cpu import _weight_only_layout as wo_layout
from lowbit.kernels.cpu import _weight_only_steps as wo_steps
from lowbit.kernels.cpu import weight_only as cpu
from lowbit.kernels.cpu._runtime import run_tasks
from lowbit.kernels.cpu import memory
from lowbit.kernels.cpu.memory import thread_scratch
from lowbit.ops import weight_only as ops
from lowbit.ops import library
from lowbit.ops.library import PreparedCall
from helpers import needs_two_numba_threads, simd_binary

triton_kernels = pytest.importorskip("lowbit.kernels.triton.weight_only", reason="triton is not installed")

FINITE_HIF8 = [c for c in range(256) if abs(hifloat8.code_value(c)) < float("inf")]  # 253 codes, no NaN/Inf
OPS = {"hifloat8": ops.HIFLOAT8_LINEAR, "float8": ops.FLOAT8_E4M3FN_LINEAR, "mxfp8": ops.MXFP8_LINEAR,
       "mxfp4": ops.MXFP4_LINEAR, "hifloat4": ops.HIFLOAT4_LINEAR}
FINITE_E4M3 = [c for c in range(256) if c & 0x7F != 0x7F]  # 254 codes, no NaN


def bits(t):
    return t.view(torch.int16)


def assert_bits(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    differ = bits(got) != bits(want)
    assert not differ.any(), f"{int(differ.sum())} of {want.numel()} outputs differ, first at {differ.nonzero()[0]}"


def gen(seed):
    return torch.Generator().manual_seed(seed)


def hif8_weight(n, k, g, codes=FINITE_HIF8):
    table = torch.tensor(codes, dtype=torch.uint8)
    return table[torch.randint(0, len(table), (n, k), generator=g)], torch.rand(n, generator=g) + 0.5


def mxfp4_weight(n, k, g):
    return mxfp4.quantize(torch.randn(n, k, generator=g))


def hif4_weight(n, k, g):
    return hifloat4.pack(torch.randn(n, k, generator=g))


def fp8_weight(n, k, g):
    return hif8_weight(n, k, g, FINITE_E4M3)


def mxfp8_weight(n, k, g):
    return mxfp8.quantize(torch.randn(n, k, generator=g) * 10.0 ** torch.randint(-3, 4, (n, 1), generator=g))


WEIGHTS = {"hifloat8": hif8_weight, "float8": fp8_weight, "mxfp8": mxfp8_weight, "mxfp4": mxfp4_weight,
           "hifloat4": hif4_weight}
CPU_KERNELS = {"hifloat8": cpu.HIFLOAT8_LINEAR, "float8": cpu.FLOAT8_E4M3FN_LINEAR, "mxfp8": cpu.MXFP8_LINEAR,
               "mxfp4": cpu.MXFP4_LINEAR, "hifloat4": cpu.HIFLOAT4_LINEAR}


def native_equals_reference(op, *args):
    want = op(*args, backend="reference")
    assert_bits(op(*args, backend="native"), want)
    return want


# --- exhaustive over small spaces -------------------------------------------------------------------------

@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_hifloat8_every_finite_code_and_a_k_tail(m):
    g = gen(m)
    codes = torch.stack([torch.tensor(FINITE_HIF8, dtype=torch.uint8)[torch.randperm(253, generator=g)]
                         for _ in range(9)])  # K = 253: three 64-lane steps and a tail of 61
    scale = torch.rand(9, generator=g) * 4
    x = torch.randn(m, 253, generator=g).bfloat16()
    native_equals_reference(ops.HIFLOAT8_LINEAR, x, codes, scale, None)
    native_equals_reference(ops.HIFLOAT8_LINEAR, x.half(), codes, scale / 1024, torch.randn(9, generator=g))


def test_hifloat8_specials_nan_inf_codes_and_scales():
    g = gen(1)
    codes, _ = hif8_weight(8, 130, g)
    codes[0, 7], codes[1, 100], codes[2, 129], codes[3, 64] = 0x80, 0x6F, 0xEF, 0x6F
    codes[3, 65] = 0xEF  # +Inf and -Inf in one row: NaN
    scale = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, float("inf"), float("nan"), 2.0**-126])
    x = torch.randn(3, 130, generator=g).half()
    x[1, 100], x[2, :] = 0.0, 0.0  # Inf weight times 0: NaN; a zero row
    want = native_equals_reference(ops.HIFLOAT8_LINEAR, x, codes, scale, None)
    assert want[0, 0].isnan() and want[0, 1].isinf() and want[1, 1].isnan() and want[0, 3].isnan()
    assert want[0, 4] == 0 and want[0, 5].isnan()  # scale 0 -> zero weights; scale Inf -> Inf * 0 codes
    nan = bits(want[want.isnan()])
    assert (nan == reference.NAN_BITS[torch.float16]).all()  # canonical NaN


@pytest.mark.parametrize("k", [32, 96, 320])
def test_mxfp4_every_code_under_every_scale_byte(k):
    g = gen(k)
    every_code = torch.arange(16, dtype=torch.uint8).repeat(k // 16)
    row = every_code[0::2] | every_code[1::2] << 4  # codes 0..15 in every 32-block
    codes = row[torch.randperm(k // 2, generator=g)].repeat(256, 1)
    scales = torch.arange(256, dtype=torch.uint8).unsqueeze(1).repeat(1, k // 32)
    for m, dtype in ((1, torch.bfloat16), (3, torch.float16)):
        x = torch.randn(m, k, generator=g).to(dtype)
        native_equals_reference(ops.MXFP4_LINEAR, x, codes, scales, None)


def test_mxfp4_zero_blocks_and_nan_scales():
    g = gen(2)
    codes, scales = mxfp4_weight(5, 128, g)
    codes[0, :16], codes[1, 16:32], codes[2, :] = 0x00, 0x88, 0x88  # +0 and -0 blocks
    scales[2, :], scales[3, 2] = 0x00, 0xFF
    x = torch.randn(2, 128, generator=g).bfloat16()
    want = native_equals_reference(ops.MXFP4_LINEAR, x, codes, scales, torch.randn(5, generator=g).bfloat16())
    assert want[:, 3].isnan().all() and not want[:, :3].isnan().any()


def test_hifloat4_every_scale_byte_and_flag_pattern():
    g = gen(3)
    scale = torch.randint(0, 256, (16, 16, 4), generator=g, dtype=torch.uint8)
    scale[..., 0] = torch.arange(256, dtype=torch.uint8).reshape(16, 16)  # 0xFF: a poisoned block
    scale[0, :, 1] = torch.arange(16, dtype=torch.uint8) * 17  # e2 patterns
    scale[1, :, 2] = torch.arange(16, dtype=torch.uint8) * 16 + 15  # e3 patterns
    value = torch.randint(0, 256, (16, 512), generator=g, dtype=torch.uint8)
    for m in (1, 4):
        native_equals_reference(ops.HIFLOAT4_LINEAR, torch.randn(m, 1024, generator=g).half(), scale, value, None)


@numba.njit
def _hifloat4_steps(step, words, value, out):
    for block in range(words.size):
        w0, w1 = step(words, value, block)
        simd.f32v_store(out, 64 * block, w0)
        simd.f32v_store(out, 64 * block + 32, w1)


@numba.njit
def _levels_both_ways(words, weights, by_masks, by_multipliers):
    for block in range(words.size):
        w0, w1 = simd.f32v_load(weights, 64 * block), simd.f32v_load(weights, 64 * block + 32)
        word = np.uint32(words[block])
        a0, a1 = wo_decode4._hifloat4_levels(w0, w1, word)
        b0, b1 = wo_decode4._hifloat4_levels_by_multipliers(w0, w1, word)
        simd.f32v_store(by_masks, 64 * block, a0)
        simd.f32v_store(by_masks, 64 * block + 32, a1)
        simd.f32v_store(by_multipliers, 64 * block, b0)
        simd.f32v_store(by_multipliers, 64 * block + 32, b1)


def test_hifloat4_levels_by_multipliers_equal_the_masked_doublings():
    """The AVX2 form of HiFloat4's e2 / e3 levels (a multiply by 1, 2 or 4 per lane from _LEVEL_MULTIPLIERS)
    gives the doublings under lane masks bit for bit, for every e2 byte and every e3 byte in both halves
    (each paired with random others), on weights with zeros of both signs, NaN, Inf and extreme magnitudes."""
    rng = np.random.default_rng(8)
    flags = np.arange(256, dtype=np.uint32)
    words = np.concatenate([rng.integers(0, 256, 256, dtype=np.uint32) | flags << 8 | rng.permutation(flags) << 16
                            | rng.permutation(flags) << 24 for _ in range(3)]).astype(np.uint32).view(np.int32)
    special = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 2.0**-126, 3.0 * 2.0**125, -1.75], dtype=np.float32)
    weights = np.where(rng.random(64 * words.size) < 0.2, rng.choice(special, 64 * words.size),
                       rng.standard_normal(64 * words.size)).astype(np.float32)
    by_masks, by_multipliers = np.empty_like(weights), np.empty_like(weights)
    _levels_both_ways(words, weights, by_masks, by_multipliers)
    assert np.array_equal(by_masks.view(np.uint32), by_multipliers.view(np.uint32))


def _scale_words(rng, e6m2_bytes):
    """HiFloat4 scale words (int32): each E6M2 byte below ``e6m2_bytes`` under every e2 byte and every e3 byte
    of both halves (each flag byte a permutation of 0..255)."""
    flags = np.arange(256, dtype=np.uint32)
    return np.concatenate([b | rng.permutation(flags) << 8 | rng.permutation(flags) << 16
                           | rng.permutation(flags) << 24 for b in range(e6m2_bytes)]).astype(np.uint32).view(np.int32)


def _every_block_both_ways(step, seed, prepared=False):
    """The 64 weights of every block decoded by ``step`` and by the portable decode (float32 tables, then
    the e2 / e3 doublings), each in its register order: every E6M2 byte (the poisoned 0xFF included) under
    every e2 byte and every e3 byte in both halves, with random value bytes (every nibble, both signs).
    ``prepared``: ``step`` gets them as _hifloat4_prepared_operands makes them on AVX2 CPUs."""
    rng = np.random.default_rng(seed)
    words = _scale_words(rng, 256)
    value = rng.integers(0, 256, 32 * words.size, dtype=np.uint8)
    got, by_flags = (np.empty(64 * words.size, dtype=np.float32) for _ in range(2))
    if prepared:
        step_value = np.empty_like(value)
        cpu._hifloat4_prepare_values(value, step_value)
        step_words = cpu._hifloat4_prepared_words(words)
        assert step_words.dtype == np.uint32 and not np.array_equal(step_value, value)
        _hifloat4_steps(step, step_words, step_value, got)
    else:
        _hifloat4_steps(step, words, value, got)
    _hifloat4_steps(wo_steps._hifloat4_step_flags, words, value, by_flags)
    return got, by_flags


@pytest.mark.skipif(not cpu.BYTE_SHUFFLE_NIBBLES, reason="the byte-shuffle step is the AVX2 (no AVX-512) one")
@pytest.mark.parametrize("layout", ["packed", "prepared"])
def test_hifloat4_byte_shuffle_step_decodes_every_block_as_the_flag_doublings(layout):
    """The AVX2 decode (BF16 bytes of four times the weight by vpshufb, then 2 - e2 - e3 off each exponent)
    gives the portable one's weights, bit for bit, in HIFLOAT4_ORDER (_every_block_both_ways), but for -0,
    which it gives as +0 (no lane sum changes: docs/weight_only.md, 'CPUs without AVX-512'); so it does from
    a prepared weight's rearranged scale words (uint32: row indices, poisoned blocks' flags all set) and value
    bytes."""
    shuffled, by_flags = _every_block_both_ways(wo_steps._hifloat4_step_shuffled, 10, layout == "prepared")
    want = by_flags.reshape(-1, 64)[:, np.argsort(wo_layout.NIBBLE_ORDER)][:, wo_layout.HIFLOAT4_ORDER].reshape(-1)
    assert (want.view(np.uint32) == 0x80000000).sum() > 200_000  # every block's -0 nibbles
    want[want == 0] = 0.0
    assert np.isnan(want).sum() == 256 * 64  # the 256 blocks of the poisoned byte, all of their weights
    assert np.array_equal(np.isnan(shuffled), np.isnan(want))  # (NaN signs: canonical in the output)
    finite = ~np.isnan(shuffled)
    assert np.array_equal(shuffled[finite].view(np.uint32), want[finite].view(np.uint32))


def _float32_lanes_kernel():
    """A new jitted ``run(words, out)``: out (16 uint32) <- wo_decode4._float32_lanes of words (16 int16), compiled on
    its first call with simd.HOST_IS_AMD_ZEN as it is then (not cached)."""

    @intrinsic
    def float32_lanes(typingctx, words, out):
        def codegen(context, builder, sig, args):
            i64 = ir.IntType(64)
            raw = builder.load(simd._element_ptr(context, builder, sig.args[0], args[0], ir.Constant(i64, 0),
                                                 wo_decode4._V16x16), align=1)
            for at, lanes in zip((0, 8), wo_decode4._float32_lanes(builder, raw)):
                builder.store(lanes, simd._element_ptr(context, builder, sig.args[1], args[1],
                                                       ir.Constant(i64, at), wo_decode4._V8x32), align=1)
            return context.get_dummy_value()

        return types.none(words, out), codegen

    @numba.njit
    def run(words, out):
        float32_lanes(words, out)

    return run


@pytest.mark.skipif(not simd.HAS_AVX2, reason="vpmulld needs AVX2")
@pytest.mark.parametrize("zen", [True, False])
def test_float32_lanes_by_multiply_and_by_shift(zen, monkeypatch):
    """_float32_lanes gives the float32 bits of BF16 words (even words, then odd) both ways: by vpmulld (AMD
    Zen) and by a shift (other CPUs), whichever this CPU compiles, for words with every bit pattern class."""
    monkeypatch.setattr(simd, "HOST_IS_AMD_ZEN", zen)
    rng = np.random.default_rng(4)
    for words in (rng.integers(-(1 << 15), 1 << 15, 16, dtype=np.int16),
                  np.array([0, -1, -32768, 32767, 1, 0x7FC0, -128, 0x3F80] * 2, dtype=np.int16)):
        out = np.empty(16, dtype=np.uint32)
        _float32_lanes_kernel()(words, out)
        bits = words.view(np.uint16).astype(np.uint32)
        assert np.array_equal(out, np.concatenate([bits[0::2] << 16, bits[1::2] << 16]))


def test_hifloat4_rows_of_minus_zero_weights_sum_as_the_reference():
    """The AVX2 step holds -0 weights as +0: rows of -0 weights (alone, among others, under every level
    flag, poisoned and extreme scale bytes) times x of either sign or zero, with and without a -0 bias, give
    the reference's bits, by the operator and by a prepared weight (its one-call GEMV)."""
    g = gen(61)
    n, k = 6, 192
    value = torch.full((n, k // 2), 0x88, dtype=torch.uint8)  # both nibbles: sign, c = 0
    value[1, ::3] = 0x3B  # +0.75 and -0.75 (times the levels)
    value[2] = torch.randint(0, 256, (k // 2,), generator=g, dtype=torch.uint8)
    scale = torch.randint(0, 256, (n, k // 64, 4), generator=g, dtype=torch.uint8)
    scale[:, :, 0] = torch.tensor([0x00, 0x7C, 0xFE, 0x20, 0xFF, 0x90]).unsqueeze(1)  # 0xFF: poisoned
    for x in (torch.rand(2, k, generator=g) + 1, -torch.rand(2, k, generator=g) - 1, torch.zeros(2, k)):
        for dtype in (torch.bfloat16, torch.float16):
            for bias in (None, torch.full((n,), -0.0, dtype=dtype)):
                want = ops.HIFLOAT4_LINEAR(x.to(dtype), scale, value, bias, backend="reference")
                assert_bits(ops.HIFLOAT4_LINEAR(x.to(dtype), scale, value, bias, backend="native"), want)
                assert_bits(PreparedCall(ops.HIFLOAT4_LINEAR, (scale, value, bias))(x.to(dtype)), want)


def test_hifloat4_word_tables_decode_every_block_as_the_flag_doublings():
    """The AVX512-BW decode (64-word tables, one look-up per weight) gives the portable one's weights, bit for
    bit (_every_block_both_ways)."""
    if not simd.HAS_AVX512BW:
        pytest.skip("no AVX512-BW on this CPU")
    by_words, by_flags = _every_block_both_ways(wo_steps._hifloat4_step_words, 5)
    assert np.isnan(by_flags).sum() == 256 * 64  # the 256 blocks of the poisoned byte, all of their weights
    assert np.array_equal(by_words.view(np.uint32), by_flags.view(np.uint32))


@numba.njit
def _pair_steps(pair_step, scales, codes, steps, out):
    """Pair steps 0 .. steps - 1 of a flat row through ``pair_step`` (the format's, no prefetch); each step's
    two I32V stored one after the other."""
    operands = (scales, codes, np.uint64(0))
    for t in range(steps):
        low, high = pair_step(operands, 0, 0, t)
        simd.i32v_store(out, 64 * t, low)
        simd.i32v_store(out, 64 * t + 32, high)


def _expected_pairs(weights, steps):
    """The dwords a pair step holds (PAIR_ORDER): weights (2 * steps, 64) float32 BF16 values, the first step's
    weight in the high word and the second's in the low word."""
    bits = (torch.from_numpy(np.ascontiguousarray(weights)).view(torch.int32) >> 16) & 0xFFFF
    first, second = bits.view(steps, 2, 64)[:, 0], bits.view(steps, 2, 64)[:, 1]
    order = torch.tensor(cpu.PAIR_ORDER)
    return ((first[:, order] << 16) | second[:, order]).reshape(-1)


@pytest.mark.skipif(not cpu._HIFLOAT4_PAIRS, reason="HiFloat4's BF16 pairs need AVX512-BF16 and BITALG")
def test_hifloat4_pairs_decode_every_block_as_the_flag_doublings():
    """hifloat4_pairs gives, as BF16 words, the weights of the portable decode (float32 tables, then the e2 / e3
    doublings), in pair order, for every E6M2 byte but the poisoned 0xFF under every e2 byte and every e3 byte in
    both halves, with random value bytes (every nibble, so both signs of every magnitude)."""
    rng = np.random.default_rng(6)
    words = _scale_words(rng, 255)
    value = rng.integers(0, 256, 32 * words.size, dtype=np.uint8)
    by_flags = np.empty(64 * words.size, dtype=np.float32)
    _hifloat4_steps(wo_steps._hifloat4_step_flags, words, value, by_flags)
    weights = by_flags.reshape(-1, 64)[:, np.argsort(wo_layout.NIBBLE_ORDER)]  # element order
    got = np.empty(32 * words.size, dtype=np.int32)  # 64 dwords per pair step of two blocks
    _pair_steps(wo_gemv4._hifloat4_pair_step, words, value, words.size // 2, got)
    assert torch.equal(torch.from_numpy(got), _expected_pairs(weights, words.size // 2))


@pytest.mark.skipif(not simd.HAS_AVX512BF16, reason="the BF16 pairs need AVX512-BF16")
def test_mxfp4_pairs_give_every_code_under_every_normal_scale_byte():
    """mxfp4_pairs gives the reference's MXFP4 weights as BF16 words in pair order, for every code in every
    block of four consecutive ones, under every E8M0 byte whose weights are normal float32 values (2..254;
    the pairs never see the others: _paired_bytes)."""
    rng = np.random.default_rng(7)
    scales = np.repeat(np.arange(2, 255, dtype=np.uint8), 4)
    scales = np.concatenate([scales, rng.permutation(scales)])
    codes = np.stack([rng.permutation(np.arange(256, dtype=np.uint8))[:16] for _ in range(scales.size)]).reshape(-1)
    weights = reference.mxfp4_weight(torch.from_numpy(codes).view(-1, 16), torch.from_numpy(scales).view(-1, 1))
    assert torch.equal(weights.bfloat16().float(), weights)  # BF16 values
    got = np.empty(16 * scales.size, dtype=np.int32)  # 64 dwords per pair step of four blocks
    _pair_steps(wo_gemv4._mxfp4_pair_step, scales, codes, scales.size // 4, got)
    assert torch.equal(torch.from_numpy(got), _expected_pairs(weights.reshape(-1, 64).numpy(), scales.size // 4))


@numba.njit
def _shuffled_steps(codes, scales, steps, out):
    """Steps 0 .. steps - 1 of a flat row through mxfp4_bf16_step; each step's two F32V one after the other."""
    for t in range(steps):
        b = np.uint64(2 * t)
        w0, w1 = wo_decode4.mxfp4_bf16_step(codes, np.uint64(16) * b, scales, b)
        simd.f32v_store(out, 64 * t, w0)
        simd.f32v_store(out, 64 * t + 32, w1)


@pytest.mark.skipif(not cpu.BYTE_SHUFFLE_NIBBLES, reason="the byte-shuffle step is the AVX2 (no AVX-512) MXFP4 step")
def test_mxfp4_byte_shuffle_step_gives_every_code_under_every_scale_byte():
    """mxfp4_bf16_step gives the reference's MXFP4 weights, bit for bit, in FOUR_BIT_ORDER, for every code in
    either block of a step under every E8M0 byte (the subnormal weights of bytes 0 and 1, Inf, NaN)."""
    rng = np.random.default_rng(8)
    scales = np.arange(256, dtype=np.uint8)
    scales = np.concatenate([scales, rng.permutation(scales)])  # 2 x 256 blocks: 256 steps
    codes = np.stack([rng.permutation(np.arange(256, dtype=np.uint8))[:16] for _ in range(scales.size)]).reshape(-1)
    weights = reference.mxfp4_weight(torch.from_numpy(codes).view(-1, 16), torch.from_numpy(scales).view(-1, 1))
    got = np.empty(32 * scales.size, dtype=np.float32)
    _shuffled_steps(codes, scales, scales.size // 2, got)
    want = weights.reshape(-1, 64)[:, torch.tensor(wo_layout.FOUR_BIT_ORDER)].reshape(-1)
    assert torch.equal(torch.from_numpy(got).view(torch.int32), want.contiguous().view(torch.int32))


def test_mxfp4_rows_of_subnormal_normal_and_nan_weights():
    """Rows with subnormal weights (scale bytes 0 and 1), normal ones, NaN and overflowing products beside
    each other, several steps and an odd last block, rows of x that fuse and one that does not."""
    g = gen(9)
    codes, scales = mxfp4_weight(12, 352, g)
    scales[0, 3], scales[1, :], scales[2, 10], scales[3, 0], scales[8, 2] = 1, 0, 2, 0xFF, 250
    scales[4:8] = torch.randint(1, 4, (4, 11), generator=g, dtype=torch.uint8)
    x = torch.randn(3, 352, generator=g)
    x[1, 5] = 60000.0  # times row 8's large weights: beyond float32's range, so that row multiplies and adds
    for dtype in (torch.bfloat16, torch.float16):
        native_equals_reference(ops.MXFP4_LINEAR, x.to(dtype), codes, scales, None)


def test_hifloat4_packed_weights_with_poisoned_and_zero_blocks():
    g = gen(4)
    w = torch.randn(6, 192, generator=g) * 100
    w[0, 70] = float("nan")
    w[1, 128:] = 0.0
    w[2] = 1e-30
    want = native_equals_reference(ops.HIFLOAT4_LINEAR, torch.randn(3, 192, generator=g).bfloat16(),
                                   *hifloat4.pack(w), torch.randn(6, generator=g))
    assert want[:, 0].isnan().all() and not want[:, 1:].isnan().any()


# --- fused multiply-adds only where every product is exact (docs/weight_only.md, 'Summation order') ----------

def hif8_quantize(w):
    scale = w.abs().amax(1) / 16
    return lowbit.encode_to_hifloat8((w / scale[:, None]).bfloat16()), scale


FUSING = {  # format: (operator, quantize a float32 (N, K) weight, its float32 weight for BF16 x)
    # HiFloat8 rows are never fused (docs/weight_only.md): the tests hold for it all the same
    "hifloat8": (ops.HIFLOAT8_LINEAR, hif8_quantize, lambda t: reference.hifloat8_weight(*t, torch.bfloat16)),
    "mxfp4": (ops.MXFP4_LINEAR, mxfp4.quantize, lambda t: reference.mxfp4_weight(*t)),
    "hifloat4": (ops.HIFLOAT4_LINEAR, hifloat4.pack, lambda t: reference.hifloat4_weight(*t)),
}


def gemv_lane_sums(fmt, x, weight):
    """The CPU GEMV's float32 sums (before the rounding to x's dtype) of x (M, K), K a multiple of 64."""
    kernel = {"hifloat8": cpu.HIFLOAT8_LINEAR, "mxfp4": cpu.MXFP4_LINEAR, "hifloat4": cpu.HIFLOAT4_LINEAR}[fmt]
    m, k = x.shape
    y32 = torch.empty(m, weight[0].shape[0])
    kernel.gemv_sums(wo_layout._reorder(x.float(), *kernel.split).numpy(), kernel._operands(*weight, k, x.dtype),
                     y32.numpy(), serial=False)
    return y32


@pytest.mark.parametrize("fmt", FUSING)
def test_products_below_the_normal_range_are_rounded_before_the_sum(fmt):
    g = gen(5)
    _, quantize, weight_of = FUSING[fmt]
    weight = quantize(torch.randn(16, 512, generator=g) * 2.0**-40)
    x = (torch.randn(3, 512, generator=g) * 2.0**-102).bfloat16()
    x[:, :64] *= 2.0**20  # lane sums in the normal range, then subnormal products added to them
    x[2, :] *= 2.0**40  # a row with only exact products
    w32 = weight_of(weight)
    exact = x[0].double() * w32.double()
    assert ((x[0].float() * w32).double() != exact).any()  # setup: some products are inexact
    got = gemv_lane_sums(fmt, x, weight)
    want = reference.lane_sums(x.float(), w32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("fmt, k", [(fmt, k) for fmt in FUSING for k in (128, 192)] + [("mxfp4", 160), ("hifloat8", 160)])
def test_blocks_of_rows_with_some_rows_not_fused(fmt, k):
    """The GEMV sums rows wo_steps.ROW_BLOCK at a time; a block with a row that must not be fused goes row by row.
    21 rows: blocks in both 8-row tasks, a short third task. Rows 2 and 9 hold +-2^17, whose products with x
    row 1 overflow float32: Inf as the reference sums them, finite if fused (see the test below); with the
    other x rows their blocks are fused. K = 160: no row blocks (an odd number of MXFP4 blocks, a short
    8-bit step)."""
    g = gen(k)
    op, quantize, weight_of = FUSING[fmt]
    w = torch.randn(21, k, generator=g)
    w[[2, 9]] = 0.0
    w[[2, 9], 0], w[[2, 9], 64] = -(2.0**17), 2.0**17
    weight = quantize(w)
    v = float(weight_of(weight)[2, 64])
    x = torch.randn(4, k, generator=g)
    x[1, 64] = 2.0 ** (128 - np.floor(np.log2(v)))
    x[1, 0] = x[1, 64] / 2
    x = x.bfloat16()
    w32 = weight_of(weight)
    want = reference.lane_sums(x.float(), w32)
    assert want[1, [2, 9]].isinf().all() and want.isfinite().sum() == want.numel() - 2
    for m in (1, 2, 4):
        if k % 64 == 0:
            got = gemv_lane_sums(fmt, x[:m], weight)
            assert torch.equal(got.view(torch.int32), want[:m].view(torch.int32))
        native_equals_reference(op, x[:m], *weight, None)


@pytest.mark.parametrize("fmt", FUSING)
def test_a_product_beyond_the_float32_range_overflows_before_the_sum(fmt):
    op, quantize, weight_of = FUSING[fmt]
    w = torch.zeros(2, 128)
    w[:, 0], w[:, 64] = -(2.0**17), 2.0**17
    weight = quantize(w)
    v = float(weight_of(weight)[0, 64])
    x = torch.zeros(1, 128)
    x[0, 64] = 2.0 ** (128 - np.floor(np.log2(v)))  # x * v in [2^128, 2^129): Inf as a float32 product
    x[0, 0] = x[0, 64] / 2  # lane 0: -x v / 2 (finite), then Inf; fused, it would end at x v / 2 (finite)
    want = native_equals_reference(op, x.bfloat16(), *weight, None)
    assert want.isinf().all()


# --- BF16 pairs: two steps per vdpbf16ps, only where nothing is flushed (docs/weight_only.md) --------------

needs_bf16 = pytest.mark.skipif(not simd.HAS_AVX512BF16, reason="the BF16 pairs need AVX512-BF16")
# the kernels that pair on this CPU (HiFloat4's pairs also need AVX512-BITALG)
PAIRING = {name: kernel for name, kernel in (("mxfp4", cpu.MXFP4_LINEAR), ("hifloat4", cpu.HIFLOAT4_LINEAR))
           if kernel.pair_sources is not None}


def pair_and_fuse_tables(fmt, x):
    """The GEMV's (fused, paired) (M, 256) tables for x (M, K), K a multiple of 64."""
    kernel = PAIRING[fmt]
    x_reg = wo_layout._reorder(x.float(), *kernel.split).numpy()
    x_pairs = np.empty((x.shape[0], -(-x_reg.shape[1] // wo_steps.PAIR_LANES) * wo_steps.PAIR_LANES), dtype=np.int16)
    return wo_steps._exact_bytes(x_reg, kernel.exponents, kernel.pair_sources, x_pairs)


def row_bytes(fmt, weight):
    """The scale bytes (0..255) that the rows of a packed weight use."""
    scales = weight[1] if fmt == "mxfp4" else weight[0]
    return scales.reshape(-1).unique().long()


@needs_bf16
@pytest.mark.parametrize("fmt", PAIRING)
@pytest.mark.parametrize("m, dtype", [(1, torch.bfloat16), (2, torch.bfloat16), (3, torch.bfloat16),
                                      (2, torch.float16)])
def test_bf16_pairs_give_the_reference_lane_sums(fmt, m, dtype):
    """Rows of x that are BF16 values are summed in BF16 pairs (asserted), with Inf, -0 and NaN in x, and equal
    the reference lane by lane; K = 1152 (MXFP4: 36 blocks, HiFloat4: 18); 3 rows of x: a pair of them and a
    single one; FP16 x whose values are all BF16 values is paired too. Row 5 of W has a NaN block (scale
    byte 0xFF: MXFP4 takes it for the largest scale, so that block of four rows goes row by row; a poisoned
    HiFloat4 block is paired, its weights NaN)."""
    g = gen(40 + m)
    _, quantize, weight_of = FUSING[fmt]
    w = torch.randn(13, 1152, generator=g)
    w[5, 200] = float("nan")  # a NaN block (MXFP4: NaN scale; HiFloat4: poisoned)
    weight = quantize(w)
    x = torch.randn(m, 1152, generator=g).bfloat16().to(dtype)
    x[0, 7], x[0, 8], x[-1, 900] = float("inf"), -0.0, float("nan")
    _, paired = pair_and_fuse_tables(fmt, x)
    used = row_bytes(fmt, weight)
    assert paired[:, used[used != 0xFF]].all()  # setup
    got = gemv_lane_sums(fmt, x, weight)
    want = reference.lane_sums(x.float(), weight_of(weight))
    nan = want.isnan()  # a NaN's sign and payload depend on the order of the operations: the outputs' are canonical
    assert nan.any() and torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
    native_equals_reference(OPS[fmt], x, *weight, None)


@needs_bf16
@pytest.mark.parametrize("fmt", PAIRING)
def test_self_check_probes_run_the_bf16_pairs(fmt):
    """The operator's self-check (its probes) includes a case summed in BF16 pairs, so that a CPU whose
    vdpbf16ps added in another order would fail it: one row of x paired with blocks of four weight rows
    and an even number of steps; that probe's result is the reference's."""
    op = OPS[fmt]
    covered = False
    for x, *weight, bias in op.probes():
        steps = x.shape[-1] // cpu.LANES
        if x.dtype != torch.bfloat16 or x.shape[0] != 1 or weight[0].shape[0] < wo_steps.ROW_BLOCK or steps % 2:
            continue
        _, paired = pair_and_fuse_tables(fmt, x)
        if paired[0, row_bytes(fmt, weight)].all():
            native_equals_reference(op, x, *weight, bias)
            covered = True
    assert covered


@needs_bf16
def test_bf16_pairs_not_where_a_partial_sum_would_be_subnormal():
    """MXFP4 weights of 16 (smallest weight of their scale: 2) and x = (1 + 2^-7) 2^-126, -2^-126: both
    products are exact and at least 2^-126, so the row may fuse, but their sum 2^-129 is subnormal, which
    vdpbf16ps would flush to zero: the row must not be paired (products below 2^-103), and the result is the
    reference's 2^-129, not 0."""
    weight = mxfp4.quantize(torch.full((4, 128), 16.0))
    assert (reference.mxfp4_weight(*weight) == 16.0).all()
    x = torch.zeros(1, 128)
    x[0, 0], x[0, 64] = (1 + 2.0**-7) * 2.0**-126, -(2.0**-126)
    x = x.bfloat16()
    fused, paired = pair_and_fuse_tables("mxfp4", x)
    used = row_bytes("mxfp4", weight)
    assert fused[0, used].all() and not paired[0, used].any()
    want = native_equals_reference(ops.MXFP4_LINEAR, x, *weight, None)
    assert (want.float() == 2.0**-129).all()


@needs_bf16
@pytest.mark.parametrize("fmt", PAIRING)
def test_bf16_pairs_not_for_a_row_with_a_subnormal_x(fmt):
    """vdpbf16ps flushes a subnormal BF16 x to zero: a row holding one is never paired. MXFP4 weights of 2^50:
    x = 2^-130 gives the product 2^-80, which every other check lets through."""
    value = 2.0**50 if fmt == "mxfp4" else 1.0
    _, quantize, weight_of = FUSING[fmt]
    weight = quantize(torch.full((4, 128), value))
    x = torch.zeros(2, 128)
    x[:, 0] = 2.0**-130
    x[1, 1] = 1.0
    x = x.bfloat16()
    assert x.float()[0, 0] == 2.0**-130
    _, paired = pair_and_fuse_tables(fmt, x)
    assert not paired.any()
    got = gemv_lane_sums(fmt, x, weight)
    want = reference.lane_sums(x.float(), weight_of(weight))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)) and (want[0] != 0).all()


@needs_bf16
def test_bf16_pairs_not_for_subnormal_weights():
    """vdpbf16ps flushes a subnormal BF16 weight to zero: MXFP4 weights of 2^-128 (scale byte 0) are never
    paired, though their products with x = 2^30 (2^-98) pass the product bounds."""
    weight = mxfp4.quantize(torch.full((4, 128), 2.0**-128))
    assert (reference.mxfp4_weight(*weight) == 2.0**-128).all()
    x = torch.zeros(1, 128)
    x[0, :2] = 2.0**30
    x = x.bfloat16()
    _, paired = pair_and_fuse_tables("mxfp4", x)
    assert not paired[0, 0]
    want = native_equals_reference(ops.MXFP4_LINEAR, x, *weight, None)
    assert (want.float() == 2.0**-97).all()


def test_bf16_pair_orders_pair_each_element_with_itself_one_step_on():
    """_pair_sources: word 2i + 1 of a pair step (added first) is element e of the first step and word 2i
    the same element of the second, for each format's order; every element of both steps is used once."""
    orders = ((cpu.MXFP4_LINEAR, cpu.PAIR_ORDER), (cpu.HIFLOAT4_LINEAR, cpu.PAIR_ORDER))
    for kernel, pair_order in orders:
        assert sorted(pair_order) == list(range(cpu.LANES))
        sources = cpu._pair_sources(cpu._order(*kernel.split), pair_order)
        assert sorted(sources.tolist()) == list(range(wo_steps.PAIR_LANES))
        elements = [int(kernel.order[s % cpu.LANES]) + cpu.LANES * (s // cpu.LANES) for s in sources.tolist()]
        assert elements[1::2] == pair_order and elements[0::2] == [e + cpu.LANES for e in pair_order]


# --- shapes, strides, threads -------------------------------------------------------------------------------

K_SIZES = {"hifloat8": (1, 61, 189), "float8": (1, 61, 189), "mxfp8": (32, 96, 128), "mxfp4": (32, 96, 128),
           "hifloat4": (64, 128, 192)}


@pytest.mark.parametrize("fmt", WEIGHTS)
@pytest.mark.parametrize("size", [0, 1, 2])
def test_odd_sizes_and_non_contiguous_x(fmt, size):
    n, k = (1, 33, 7)[size], K_SIZES[fmt][size]
    g = gen(size)
    weight = WEIGHTS[fmt](n, k, g)
    for m in (1, 2, 3, 4):  # the bit-exact GEMV path
        x = torch.randn(m, 2 * k, generator=g).bfloat16()[:, ::2]
        assert x.numel() == 1 or not x.is_contiguous()
        native_equals_reference(OPS[fmt], x, *weight, None)


@pytest.mark.parametrize("fmt", FUSING)
def test_rows_of_x_in_pairs_with_one_that_may_not_fuse(fmt):
    """Four rows of x, the second of them tiny (its products with W are not exact, so it may not use fused
    multiply-adds): rows 0 and 1 go one at a time, rows 2 and 3 as a pair (each step of W decoded once for
    both, where the format does that); every lane sum is the reference's, bit for bit."""
    g = gen(16)
    _, quantize, weight_of = FUSING[fmt]
    weight = quantize(torch.randn(12, 512, generator=g))
    x = torch.randn(4, 512, generator=g).bfloat16()
    x[1] *= 2.0**-128  # products below float32's normal range
    got = gemv_lane_sums(fmt, x, weight)
    want = reference.lane_sums(x.float(), weight_of(weight))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("fmt", WEIGHTS)
@pytest.mark.parametrize("m", [1, 3, 9])
def test_result_does_not_depend_on_the_thread_count(fmt, m, monkeypatch):
    """One thread runs the GEMV's rows on the calling thread, two the parallel loop (forced here for a
    small weight): the same bits; so do the batched kernel's tasks and, on AMX CPUs, the AMX kernel's (m = 9,
    BF16)."""
    monkeypatch.setattr(cpu, "GEMV_ONE_THREAD_WEIGHTS", 0)
    monkeypatch.setattr(amx, "ONE_THREAD_PRODUCTS", 0)
    g = gen(m)
    weight = WEIGHTS[fmt](67, 256, g)
    x = torch.randn(m, 256, generator=g).bfloat16()
    previous = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(OPS[fmt](x, *weight, None, backend="native"))
            assert numba.get_num_threads() == min(threads, numba.config.NUMBA_NUM_THREADS)
    finally:
        torch.set_num_threads(previous)
    assert_bits(results[0], results[1])


@pytest.mark.parametrize("fmt", WEIGHTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_tile_decode_does_not_depend_on_the_thread_count(fmt, dtype):
    """The GEMM path's tiles (rows 5 .. 71 of W) decoded on the calling thread and in the parallel loop on two
    threads: the same bits."""
    kernel = CPU_KERNELS[fmt]
    weight = WEIGHTS[fmt](72, 256, gen(17))
    operands = kernel._operands(*weight, 256, torch.bfloat16 if dtype == torch.bfloat16 else torch.float16)
    tiles = [torch.zeros(67, 256, dtype=dtype) for _ in range(2)]
    previous = numba.get_num_threads()
    try:
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        for tile, serial in zip(tiles, (True, False)):
            cpu.run_tasks(kernel.tile, (*operands, 5), 67, cpu.as_numpy(tile), serial)
    finally:
        numba.set_num_threads(previous)
    assert_bits(tiles[0], tiles[1])
    assert tiles[0].abs().sum() > 0


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("k", [64, 96, 352, 2048])
def test_block_scaled_bf16_tile_for_every_scale_byte(fmt, k):
    """The GEMM path's BF16 tile of MXFP4 / MXFP8 rows (look-ups of BF16 words where the CPU has AVX512-VBMI;
    MXFP8 blocks whose scale byte lies outside _MXFP8_EXACT_BYTES_BF16 by the rounding float32 steps) holds
    the reference's weights bit for bit, for every scale byte (subnormal and rounded weights of the small
    ones, NaN for 0xFF) and random codes (NaN, zeros of both signs), an odd number of blocks included."""
    g = gen(21)
    blocks = k // 32
    scales = torch.arange(256 * blocks, dtype=torch.int64).remainder(256).to(torch.uint8)
    n = -(-scales.numel() // blocks)
    scales = torch.cat([scales, torch.zeros(n * blocks - scales.numel(), dtype=torch.uint8)]).view(n, blocks)
    code_bytes = k // 2 if fmt == "mxfp4" else k
    codes = torch.randint(0, 256, (n, code_bytes), generator=g, dtype=torch.int64).to(torch.uint8)
    kernel = cpu.MXFP4_LINEAR if fmt == "mxfp4" else cpu.MXFP8_LINEAR
    operands = kernel._operands(codes, scales, k, torch.bfloat16)
    tile = torch.full((n, cpu._padded_k(k)), 7.0, dtype=torch.bfloat16)
    run_tasks(kernel.tile, (*operands, 0), n, cpu.as_numpy(tile), True)
    want = _dense(fmt, (codes, scales), torch.bfloat16).bfloat16()
    nan = want.isnan()
    assert torch.equal(tile[:, :k].isnan(), nan) and nan.any()
    assert_bits(torch.where(nan, 0, tile[:, :k]), torch.where(nan, 0, want))


@pytest.mark.parametrize("fmt", WEIGHTS)
@pytest.mark.parametrize("k", [320, 352, 4096])
def test_bf16_tile_is_the_reference_weight(fmt, k):
    """Every format's GEMM-path tile for BF16 x (BF16 words) holds the reference's weights in BF16 bit for
    bit (HiFloat8 and FP8 stored as their tables' 16-bit patterns on AVX512-VBMI CPUs; short last steps;
    NaN, zero and extreme codes; HiFloat4 from random bytes)."""
    if k == 352 and fmt == "hifloat4":  # HiFloat4 rows are whole blocks of 64
        k = 384
    k = k - 1 if fmt in ("hifloat8", "float8") and k != 4096 else k
    g = gen(24)
    weight = WEIGHTS[fmt](24, k, g)
    if fmt in ("hifloat8", "float8"):  # NaN codes (HiFloat8 0x80; FP8 0x7F, 0xFF), zeros of both signs, extremes
        weight[0][1, :6] = torch.tensor([hifloat8.NAN_CODE, 0, 0x80, 0x7F, 0xFF, 0x7E], dtype=torch.uint8)
    if fmt == "hifloat4":  # every byte random: any E6M2 scale (0xFF: NaN), any e2 / e3 flags, any nibbles
        weight = tuple(torch.randint(0, 256, t.shape, generator=g, dtype=torch.int64).to(torch.uint8) for t in weight)
        weight[0][0, 0, 0] = 0xFF  # a NaN block
    kernel = CPU_KERNELS[fmt]
    operands = kernel._operands(*weight, k, torch.bfloat16)
    tile = torch.full((24, cpu._padded_k(k)), 7.0, dtype=torch.bfloat16)
    run_tasks(kernel.tile, (*operands, 0), 24, cpu.as_numpy(tile), True)
    want = _dense(fmt, weight, torch.bfloat16).bfloat16()
    nan = want.isnan()
    assert torch.equal(tile[:, :k].isnan(), nan)
    assert_bits(torch.where(nan, 0, tile[:, :k]), torch.where(nan, 0, want))


@pytest.mark.parametrize("serial", [True, False])
@pytest.mark.parametrize("size", [0, 1, 65535, 3 * 65536 + 5])
def test_canonical_nans_of_every_pattern(serial, size):
    """The GEMM path's NaN pass, on the calling thread or in tasks of _CANONICAL_TASK_WORDS (a short last one):
    every BF16 pattern, repeated, in place; only NaNs change, each to the canonical NaN."""
    bits = np.resize(np.arange(-(1 << 15), 1 << 15, dtype=np.int16), size)
    want = np.where((bits & 0x7FFF) > 0x7F80, np.int16(reference.NAN_BITS[torch.bfloat16]), bits)
    cpu._CANONICAL_NANS(bits, serial=serial)
    assert np.array_equal(bits, want)


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("n, m", [(0, 5), (1, 1), (31, 33), (32, 32), (64, 96), (100, 37), (33, 1)])
def test_transpose_bf16_with_canonical_nan(n, m, offset):
    """transpose_bf16: every word moved (blocks of 32 x 32 in registers, with non-temporal stores where dst's
    rows start on cache lines: N a multiple of 32 at offset 0; the edges word by word), every NaN pattern
    (either sign, any payload) made the canonical one, Inf and the rest kept."""
    g = gen(22)
    src = torch.randint(-32768, 32768, (n, m), generator=g, dtype=torch.int32).to(torch.int16)
    special = torch.tensor([0x7F81, -1, 0x7F80, -128], dtype=torch.int16)  # NaN, NaN, +Inf, -Inf
    src.view(-1)[: special.numel()] = special[: src.numel()]  # in a block where there is one
    if src.numel():
        src[-1, -1] = 0x7FFF  # NaN on an edge
    dst = torch.full((m * n + 32,), 3, dtype=torch.int16)[offset : offset + m * n].view(m, n)
    assert dst.data_ptr() % 64 == 2 * offset or not dst.numel()
    cpu.transpose_bf16(src.numpy(), dst.numpy())
    want = src.t().clone()
    want[(want & 0x7FFF) > 0x7F80] = reference.NAN_BITS[torch.bfloat16]
    assert torch.equal(dst, want)


@pytest.mark.parametrize("path", ["transposed", "past the size limit", "F.linear's"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_gemm_path_orientation(monkeypatch, path, with_bias):
    """BF16 x, one tile: where TRANSPOSED_GEMM (AMX-BF16 CPUs) and the (M, N) result is within
    TRANSPOSED_GEMM_BYTES, the result is torch's y^T = W x^T (a bias as a column, before the one rounding)
    transposed; else F.linear's, bit for bit (the two orders agree at this size on the CPUs measured, so
    which path ran is seen from its transpose call)."""
    monkeypatch.setattr(cpu, "AMX_GEMM", False)  # torch's GEMM on decoded tiles
    transposes, transpose = [], cpu.transpose_bf16
    monkeypatch.setattr(cpu, "transpose_bf16", lambda src, dst: transposes.append(transpose(src, dst)))
    monkeypatch.setattr(cpu, "BF16_GEMM", True)
    monkeypatch.setattr(cpu, "TRANSPOSED_GEMM", path != "F.linear's")
    monkeypatch.setattr(cpu, "TRANSPOSED_MIN_SIDE", 0)
    if path == "past the size limit":
        monkeypatch.setattr(cpu, "TRANSPOSED_GEMM_BYTES", GEMM_M * 48 * 2 - 2)
    g = gen(23)
    codes, scales = mxfp4_weight(48, 2048, g)
    codes[3, :8] = 0x99  # with scale byte 0xFF below: NaN, canonical in the result
    scales[3, 0] = 0xFF
    x = torch.randn(GEMM_M, 2048, generator=g).bfloat16()
    bias = torch.randn(48, generator=g).bfloat16() if with_bias else None
    w = reference.mxfp4_weight(codes, scales).bfloat16()
    transposed = (torch.mm(w, x.t()) if bias is None else torch.addmm(bias[:, None], w, x.t())).t()
    direct = torch.nn.functional.linear(x, w, bias)
    got = lowbit.mxfp4_linear(x, codes, scales, bias, backend="native")
    assert (bits(got[:, 3]) == reference.NAN_BITS[torch.bfloat16]).all()
    finite = torch.ones(48, dtype=torch.bool)
    finite[3] = False
    want = transposed if path == "transposed" else direct
    assert_bits(got[:, finite], want[:, finite].contiguous())
    assert len(transposes) == (path == "transposed")


@pytest.mark.parametrize("m, n, k, transposed", [(35, 64, 128, True), (35, 48, 128, False), (35, 64, 32, False),
                                                 (45, 64, 128, False), (45, 64, 256, True)])
def test_gemm_orientation_follows_the_weights_shape(monkeypatch, m, n, k, transposed):
    """The transposed GEMM only where N and K are both at least TRANSPOSED_MIN_SIDE, and past TRANSPOSED_MAX_M rows
    of x only where K is at least TRANSPOSED_LONG_K (the limits scaled down here); either way the interval."""
    monkeypatch.setattr(cpu, "AMX_GEMM", False)  # torch's GEMM on decoded tiles
    transposes, transpose = [], cpu.transpose_bf16
    monkeypatch.setattr(cpu, "transpose_bf16", lambda src, dst: transposes.append(transpose(src, dst)))
    for name, value in (("BF16_GEMM", True), ("TRANSPOSED_GEMM", True), ("TRANSPOSED_MIN_SIDE", 64),
                        ("TRANSPOSED_MAX_M", 40), ("TRANSPOSED_LONG_K", 256), ("BATCH_MAX_M", cpu.GEMV_MAX_M)):
        monkeypatch.setattr(cpu, name, value)
    g = gen(29)
    codes, scales = mxfp4_weight(n, k, g)
    x = torch.randn(m, k, generator=g).bfloat16()
    got = lowbit.mxfp4_linear(x, codes, scales, backend="native")
    lo, hi = reference.gemm_interval(x, reference.mxfp4_weight(codes, scales), None)
    assert ((lo.float() <= got.float()) & (got.float() <= hi.float())).all()
    assert len(transposes) == transposed


# --- the batched kernel and the GEMM path (M > GEMV_MAX_M): within the interval of any summation order -----
# BF16 x with GEMV_MAX_M < M <= BATCH_MAX_M runs the batched kernel on AVX512-BF16 CPUs (BATCHED below), the
# GEMM path otherwise; GEMM_M is past both.
BATCHED = cpu.GEMV_MAX_M + 5
GEMM_M = cpu.BATCH_MAX_M + 3

def _dense(fmt, weight, dtype):
    if fmt == "hifloat8":
        return reference.hifloat8_weight(*weight, dtype)
    if fmt == "float8":
        return reference.float8_e4m3fn_weight(*weight, dtype)
    if fmt == "mxfp8":
        return reference.mxfp8_weight(*weight, dtype)
    return {"mxfp4": reference.mxfp4_weight, "hifloat4": reference.hifloat4_weight}[fmt](*weight)


@pytest.mark.parametrize("fmt", WEIGHTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias_dtype", [None, "x", torch.float32])
@pytest.mark.parametrize("m", [BATCHED, GEMM_M])
@pytest.mark.parametrize("bf16_gemm", [True, False])
def test_gemm_path_within_the_order_interval(monkeypatch, fmt, dtype, bias_dtype, m, bf16_gemm):
    """float32 GEMM, (BF16 x, bias None or BF16, where BF16_GEMM) torch's BF16 GEMM, and the batched kernel
    (BF16 x)."""
    monkeypatch.setattr(cpu, "BF16_GEMM", bf16_gemm)
    g = gen(5)
    n, k = 40, {"hifloat8": 319, "float8": 319, "mxfp8": 352, "mxfp4": 352, "hifloat4": 320}[fmt]
    weight = WEIGHTS[fmt](n, k, g)
    x = torch.randn(m, k, generator=g).to(dtype)
    x[0, :8] = 2.0**-130  # BF16 subnormals (flushed by a BF16 GEMM), FP16 zeros
    bias = None if bias_dtype is None else torch.randn(n, generator=g).to(dtype if bias_dtype == "x" else bias_dtype)
    got = OPS[fmt](x, *weight, bias, backend="native").float()
    lo, hi = reference.gemm_interval(x, _dense(fmt, weight, dtype), bias)
    assert ((lo.float() <= got) & (got <= hi.float())).all()


def test_torch_adds_a_bf16_bias_before_its_one_rounding():
    """What the BF16 GEMM path relies on: F.linear(x, W, b) in BF16 gives the bits of b as one more column of
    W (and of x, ones): the bias joins the float32 sums, then one rounding."""
    g = gen(14)
    x, w = torch.randn(37, 4096, generator=g).bfloat16(), torch.randn(300, 4096, generator=g).bfloat16()
    b = (torch.randn(300, generator=g) * 30).bfloat16()
    ones = torch.ones(37, 1, dtype=torch.bfloat16)
    extended = torch.nn.functional.linear(torch.cat([x, ones], 1), torch.cat([w, b[:, None]], 1))
    assert torch.equal(torch.nn.functional.linear(x, w, b), extended)
    assert not torch.equal(torch.nn.functional.linear(x, w) + b, extended)  # two roundings differ


@pytest.mark.parametrize("dtype, transposed", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, False)])
def test_gemm_path_in_several_tiles(monkeypatch, dtype, transposed):
    """Tiles of 3 float32 or 6 BF16 rows (a short last one), each with its own GEMM into a column slice of out
    (or, transposed, into rows of y^T, then transposed); NaN canonical."""
    monkeypatch.setattr(cpu, "AMX_GEMM", False)  # torch's GEMM on decoded tiles
    monkeypatch.setattr(cpu, "GEMM_TILE_BYTES", 3 * 4 * 384)
    monkeypatch.setattr(cpu, "TRANSPOSED_GEMM", transposed)
    monkeypatch.setattr(cpu, "TRANSPOSED_MIN_SIDE", 0)
    if transposed:
        monkeypatch.setattr(cpu, "BF16_GEMM", True)
    tiles = []
    monkeypatch.setattr(cpu.MXFP4_LINEAR, "tile", tuple(lambda *args, run=run: tiles.append(args[-2]) or run(*args)
                                                        for run in cpu.MXFP4_LINEAR.tile))
    g = gen(13)
    codes, scales = mxfp4_weight(11, 352, g)
    scales[4, 2] = 0xFF  # a NaN block: row 4 of the output is NaN
    x = torch.randn(GEMM_M, 352, generator=g).to(dtype)
    bias = torch.randn(11, generator=g).to(dtype)
    got = lowbit.mxfp4_linear(x, codes, scales, bias, backend="native")
    lo, hi = reference.gemm_interval(x, reference.mxfp4_weight(codes, scales), bias)
    finite = torch.ones(11, dtype=torch.bool)
    finite[4] = False
    assert ((lo.float() <= got.float()) & (got.float() <= hi.float()))[:, finite].all()
    assert (bits(got[:, 4]) == reference.NAN_BITS[dtype]).all()
    assert len(tiles) >= 2


def test_gemm_path_ignores_what_the_scratch_buffer_held(monkeypatch):
    """The tiles are decoded into the thread's scratch buffer, kept between calls: columns past K (K = 352
    is padded to 384) and rows left over from a larger earlier tile must not reach the result."""
    monkeypatch.setattr(cpu, "BF16_GEMM", True)  # BF16 tiles, on any CPU
    g = gen(16)
    codes, scales = mxfp4_weight(40, 352, g)
    x = torch.randn(GEMM_M, 352, generator=g).bfloat16()
    want = torch.nn.functional.linear(x, reference.mxfp4_weight(codes, scales).bfloat16())
    with thread_scratch(1 << 20) as scratch:
        scratch.fill_(0xFF)  # NaN in BF16 and in float32 everywhere
    assert_bits(lowbit.mxfp4_linear(x, codes, scales, backend="native"), want)


@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_path_in_one_tile_is_f_linear_of_the_decoded_weight(monkeypatch, with_bias):
    """BF16 x and a weight that fits one tile: torch's GEMM writes straight into out (mm / addmm, what
    F.linear runs), so the result is F.linear's on the decoded BF16 weight, bit for bit."""
    monkeypatch.setattr(cpu, "BF16_GEMM", True)  # the BF16 GEMM, on any CPU
    g = gen(15)
    codes, scales = mxfp4_weight(40, 352, g)
    x = torch.randn(GEMM_M, 352, generator=g).bfloat16()
    bias = torch.randn(40, generator=g).bfloat16() if with_bias else None
    got = lowbit.mxfp4_linear(x, codes, scales, bias, backend="native")
    want = torch.nn.functional.linear(x, reference.mxfp4_weight(codes, scales).bfloat16(), bias)
    assert_bits(got, want)


@pytest.mark.parametrize("m", [BATCHED, GEMM_M])
def test_gemm_path_with_subnormal_mxfp4_weights(m):
    g = gen(12)
    codes, scales = mxfp4_weight(24, 128, g)
    scales[:8] = 0  # 2^-127: subnormal weights
    x = (torch.randn(m, 128, generator=g) * 2.0**100).bfloat16()
    got = lowbit.mxfp4_linear(x, codes, scales, backend="native").float()
    lo, hi = reference.gemm_interval(x, reference.mxfp4_weight(codes, scales))
    assert ((lo.float() <= got) & (got <= hi.float())).all()


def test_gemm_interval_contains_the_reference_and_excludes_an_ulp_away():
    g = gen(6)
    x = torch.randn(3, 256, generator=g).bfloat16()
    w32 = reference.mxfp4_weight(*mxfp4_weight(8, 256, g))
    want = reference.linear(x, w32)
    lo, hi = reference.gemm_interval(x, w32)
    assert ((lo.float() <= want.float()) & (want.float() <= hi.float())).all()
    far = (bits(hi).int() + 8 * torch.where(hi.float() >= 0, 1, -1)).to(torch.int16).view(torch.bfloat16)
    assert not ((lo.float() <= far.float()) & (far.float() <= hi.float())).any()
    assert ((bits(hi).int() - bits(lo).int()).abs() <= 1).float().mean() > 0.9


@pytest.mark.parametrize("m", [cpu.GEMV_MAX_M + 1, GEMM_M])
def test_gemm_path_keeps_nan_and_inf(m):
    g = gen(7)
    codes, scale = hif8_weight(6, 96, g)
    codes[0, 3], codes[1, 5] = 0x80, 0x6F
    got = lowbit.hifloat8_linear(torch.randn(m, 96, generator=g).bfloat16(), codes, scale, backend="native")
    assert got[:, 0].isnan().all() and got[:, 1].isinf().all() and got[:, 2:].isfinite().all()


BATCHED_DTYPES = [torch.bfloat16] + ([] if cpu.BATCH_IN_BF16 else [torch.float16])


@pytest.mark.parametrize("fmt", WEIGHTS)
@pytest.mark.parametrize("m", [cpu.GEMV_MAX_M + 1, 6, cpu.BATCH_MAX_M])
@pytest.mark.parametrize("dtype", BATCHED_DTYPES)
def test_batched_kernel_within_the_order_interval(fmt, m, dtype, monkeypatch):
    """GEMV_MAX_M < M <= BATCH_MAX_M (BF16 x where the products are BF16 dot products, FP16 x too where they
    are float32 FMAs): the batched kernel runs (odd and even M; N = 131: several tasks and a last block of 3
    rows, an odd one; K with a short last step or an odd 32-block; a chunk boundary of K inside a row), with
    NaN / Inf weights, a non-contiguous x with Inf / NaN, -0 and BF16 subnormals (flushed by vdpbf16ps), a
    bias in x's dtype; every output within the interval or NaN where the reference is; NaN canonical."""
    monkeypatch.setattr(cpu, "AMX_GEMM", False)  # (which replaces it on AMX CPUs)
    calls = []
    kernel = CPU_KERNELS[fmt]
    monkeypatch.setattr(kernel, "batched", tuple(lambda *args, run=run: calls.append(1) or run(*args)
                                                 for run in kernel.batched))  # (serial, parallel)
    g = gen(40 + m)
    k = wo_batched._BATCH_CHUNK + {"hifloat8": 319, "float8": 319, "mxfp8": 352, "mxfp4": 352, "hifloat4": 320}[fmt]
    weight = WEIGHTS[fmt](131, k, g)
    if fmt in ("hifloat8", "float8"):
        weight[0][5, 7], weight[0][9, 0] = (0x80, 0x6F) if fmt == "hifloat8" else (0x7F, 0x7E)
    elif fmt in ("mxfp8", "mxfp4"):
        weight[1][5, 2] = 0xFF  # a NaN block
    x = torch.randn(m, 2 * k, generator=g).to(dtype)[:, ::2]
    x[0, :8] = 2.0**-130  # BF16 subnormals, FP16 zeros
    x[m - 1, 3] = float("inf")
    x[1, 100] = float("nan")
    x[2, 200:232] = -0.0
    assert not x.is_contiguous()
    bias = torch.randn(131, generator=g).to(dtype)
    got = OPS[fmt](x, *weight, bias, backend="native")
    assert calls == [1]
    dense = _dense(fmt, weight, dtype)
    want = reference.linear(x, dense, bias)
    assert reference.meets_contract(got, want, x, dense, bias)
    assert (bits(got)[got.isnan()] == reference.NAN_BITS[dtype]).all()


@needs_two_numba_threads
@pytest.mark.parametrize("fmt", ["mxfp4", "hifloat8"])
def test_batched_kernel_gives_the_same_bits_on_any_thread_count(fmt):
    """Each output's sums come from one task whatever thread runs it: the parallel loop on two threads gives
    the serial kernel's bits (N = 131: tasks of 64, 64 and 3 rows)."""
    g = gen(3)
    k = 2 * wo_batched._BATCH_CHUNK + 64
    weight = WEIGHTS[fmt](131, k, g)
    x = torch.randn(cpu.GEMV_MAX_M + 3, k, generator=g).bfloat16()
    kernel = {"mxfp4": cpu.MXFP4_LINEAR, "hifloat8": cpu.HIFLOAT8_LINEAR}[fmt]
    operands = kernel.prepare(x.dtype, k, *weight, None)[0]
    outs = [torch.empty(x.shape[0], 131, dtype=x.dtype) for _ in range(2)]
    previous = numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        for out, serial in zip(outs, (True, False)):
            kernel._run_batched(x, operands, None, out, serial)
    finally:
        numba.set_num_threads(previous)
    assert_bits(outs[0], outs[1])
    dense = _dense(fmt, weight, x.dtype)
    assert reference.meets_contract(outs[0], reference.linear(x, dense), x, dense)


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("n, m, batched", [(64, 32, True), (2048, 5, False), (2048, 12, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rows_of_x_choose_the_batched_kernel_or_the_gemm_path(monkeypatch, amx, n, m, batched, dtype):
    """x with 5-32 rows runs the batched kernel (BF16 x only where its products are BF16 dot products),
    except on CPUs with AMX-BF16 for weights of at least AMX_GEMM_WEIGHTS (here 2048 x 1024), which take
    torch's AMX GEMM on decoded tiles from M = 5 on."""
    monkeypatch.setattr(cpu, "AMX_GEMM", False)  # lowbit's AMX kernel: the next test
    monkeypatch.setattr(simd, "HAS_AMX_BF16", amx)
    paths = []
    kernel = cpu.MXFP4_LINEAR
    for name in ("batched", "tile"):
        monkeypatch.setattr(kernel, name, tuple(lambda *args, run=run, name=name: paths.append(name) or run(*args)
                                                for run in getattr(kernel, name)))
    k = cpu.AMX_GEMM_WEIGHTS // 2048
    g = gen(n + m)
    x = torch.randn(m, k, generator=g).to(dtype)
    lowbit.mxfp4_linear(x, *mxfp4_weight(n, k, g), backend="native")
    runs_batched = (batched or not amx) and (dtype == torch.bfloat16 or not cpu.BATCH_IN_BF16)
    assert set(paths) == {"batched" if runs_batched else "tile"}


# --- lowbit's AMX kernel (CPUs with AMX-BF16): BF16 x, within the interval -------------------------------------

needs_amx = pytest.mark.skipif(not amx.AVAILABLE, reason="no AMX-BF16 here (CPU, OS or a generic NUMBA_CPU_NAME)")


def _counting_amx(monkeypatch) -> list:
    """amx.run counted: the list gets a 1 per call."""
    calls, run = [], amx.run
    monkeypatch.setattr(amx, "run", lambda *args: calls.append(1) or run(*args))
    return calls


@needs_amx
@pytest.mark.parametrize("fmt", WEIGHTS)
@pytest.mark.parametrize("m, n", [(cpu.GEMV_MAX_M + 1, 131), (18, 40), (32, 67), (33, 160), (70, 29)])
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32])
def test_amx_kernel_within_the_order_interval(monkeypatch, fmt, m, n, bias_dtype):
    """BF16 x of GEMV_MAX_M + 1 .. rows on the tiles: M and N on and off the 32-row blocks (a last task of 3
    rows, N below one panel; blocks of x with at most 16 rows take half the tiles, 18 rows all), K with a short last tile row (HiFloat8, FP8: 319) or an odd 32-block; NaN / Inf
    weights, a non-contiguous x with Inf / NaN, -0 and BF16 subnormals (flushed by the tiles), every bias kind;
    each output within the interval or NaN where the reference is; NaN canonical."""
    calls = _counting_amx(monkeypatch)
    g = gen(m + n)
    k = {"hifloat8": 319, "float8": 319, "mxfp8": 352, "mxfp4": 352, "hifloat4": 320}[fmt]
    weight = WEIGHTS[fmt](n, k, g)
    if fmt in ("hifloat8", "float8"):
        weight[0][5, 7], weight[0][9, 0] = (0x80, 0x6F) if fmt == "hifloat8" else (0x7F, 0x7E)
    elif fmt in ("mxfp8", "mxfp4"):
        weight[1][5, 2] = 0xFF  # a NaN block
    x = torch.randn(m, 2 * k, generator=g).bfloat16()[:, ::2]
    x[0, :8] = 2.0**-130  # BF16 subnormals
    x[m - 1, 3] = float("inf")
    x[1, 100] = float("nan")
    x[2, 200:232] = -0.0
    bias = None if bias_dtype is None else torch.randn(n, generator=g).to(bias_dtype)
    got = OPS[fmt](x, *weight, bias, backend="native")
    assert calls == [1]
    dense = _dense(fmt, weight, torch.bfloat16)
    want = reference.linear(x, dense, bias)
    assert reference.meets_contract(got, want, x, dense, bias)
    assert (bits(got)[got.isnan()] == reference.NAN_BITS[torch.bfloat16]).all()
    assert got.isnan().any() and not got.isnan().all()


@needs_amx
@needs_two_numba_threads
@pytest.mark.parametrize("fmt", ["mxfp4", "hifloat8"])
def test_amx_kernel_gives_the_same_bits_on_any_thread_count(monkeypatch, fmt):
    """Each output's sums come from one task whatever thread runs it: numba's threads (ONE_THREAD_PRODUCTS 0)
    give the calling thread's bits (N = 300: three tasks of 128, 128 and 44 rows)."""
    g = gen(5)
    weight = WEIGHTS[fmt](300, 512, g)
    x = torch.randn(45, 512, generator=g).bfloat16()
    outs = []
    for products in (1 << 62, 0):
        monkeypatch.setattr(amx, "ONE_THREAD_PRODUCTS", products)
        outs.append(OPS[fmt](x, *weight, None, backend="native"))
    assert_bits(outs[0], outs[1])


@needs_amx
@pytest.mark.parametrize("m", [cpu.GEMV_MAX_M + 1, 70])
def test_amx_kernel_runs_in_a_given_scratch(monkeypatch, m):
    """run_gemm_path with a caller's scratch of gemm_scratch_nbytes (a plan's workspace): the AMX kernel keeps x^T
    and its tasks' buffers there (the thread's scratch untouched, on numba's threads too), the same bits."""
    g = gen(m)
    codes, scales = mxfp4_weight(300, 256, g)
    x = torch.randn(m, 256, generator=g).bfloat16()
    operands = cpu.MXFP4_LINEAR._operands(codes, scales, 256, torch.bfloat16)
    want = torch.empty(m, 300, dtype=torch.bfloat16)
    cpu.run_gemm_path(cpu.MXFP4_LINEAR.tile, operands, x, None, want)
    monkeypatch.setattr(memory, "thread_scratch", lambda nbytes: pytest.fail("took the thread's scratch"))
    scratch = torch.full((cpu.gemm_scratch_nbytes(m, 300, 256, torch.bfloat16),), 0xFF, dtype=torch.uint8)
    for products in (1 << 62, 0):  # the calling thread, then numba's
        monkeypatch.setattr(amx, "ONE_THREAD_PRODUCTS", products)
        got = torch.empty_like(want)
        cpu.run_gemm_path(cpu.MXFP4_LINEAR.tile, operands, x, None, got, scratch=scratch)
        assert_bits(got, want)


_FIRST_CALL = """
import torch, lowbit
x = torch.ones(32, 64, dtype=torch.bfloat16)
y = lowbit.mxfp4_linear(x, *lowbit.mxfp4_quantize(torch.ones(64, 64)), backend="native")
assert y.eq(64).all(), y
"""


@needs_amx
def test_amx_kernel_as_a_process_first_numba_call():
    """A process whose first numba kernel is the AMX kernel's serial loop (numba's threading layer not started),
    compiled and then loaded from numba's cache: no crash (the parallel loop's slot, numba.get_thread_id, once
    reached the serial loop, where LLVM called it ahead of the branch that skipped it)."""
    for _ in range(2):
        result = subprocess.run([sys.executable, "-c", _FIRST_CALL], capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-2000:]


@needs_amx
@pytest.mark.parametrize("m, k", [(1, 1), (5, 31), (16, 32), (17, 33), (33, 64), (48, 100), (64, 96)])
def test_x_pairs_is_x_transposed_in_pairs(m, k):
    """x^T for the tiles, in slabs of 32 rows of x: slab s row i holds the pairs (x[r, 2i], x[r, 2i + 1]) of rows
    r = 32 s .. 32 s + 31, zeros past M and K (the 16 x 16 blocks of pairs in registers, the edges one by one)."""
    x = torch.randint(-(1 << 15), 1 << 15, (m, k), generator=gen(m * k), dtype=torch.int16)
    kp, mp = -(-k // amx.TILE_K) * amx.TILE_K, -(-m // amx.PANEL) * amx.PANEL
    padded = torch.zeros(mp, kp, dtype=torch.int16)
    padded[:m, :k] = x
    want = padded.view(mp // 32, 32, kp // 2, 2).transpose(1, 2).reshape(mp // 32, kp // 2, 64)
    got = np.full((mp // 32, kp // 2, 32), -1, dtype=np.int32)  # what a reused buffer held before
    amx.x_pairs(x.numpy(), got)
    assert torch.equal(torch.from_numpy(got.view(np.int16)), want)


@numba.njit(nogil=True)
def _nan_padded_rows_for_amx_test(values, r0, first, end, w):
    """A tile decoder that writes NaN past the weight's K = values.shape[1] columns (the contract allows only
    zeros there, or nothing): the AMX kernel must not let them reach a sum."""
    for i in range(first, end):
        for c in range(w.shape[1]):
            w[i, c] = values[r0 + i, c] if c < values.shape[1] else np.int16(0x7FC1)


@needs_amx
def test_amx_kernel_zeroes_the_columns_past_k():
    """Columns K .. of a decoded row (K = 40 here: 24 of the second tile row's 32) set to 0 before the products:
    a decoder's NaN there changes no output."""
    g = gen(9)
    w = torch.randn(48, 40, generator=g).bfloat16()
    x = torch.randn(7, 40, generator=g).bfloat16()
    out = torch.empty(7, 48, dtype=torch.bfloat16)
    amx.run(_nan_padded_rows_for_amx_test, (bits(w).numpy(),), bits(x).numpy(), 48, 96, *cpu._bias_bits(None),
            bits(out).numpy())
    assert not out.isnan().any()
    assert reference.meets_contract(out, reference.linear(x, w), x, w)


@needs_amx
@pytest.mark.parametrize("m, k, dtype, on_tiles", [
    (cpu.GEMV_MAX_M + 1, 256, torch.bfloat16, True), (cpu.AMX_MAX_M, 256, torch.bfloat16, True),
    (cpu.AMX_MAX_M + 1, 64, torch.bfloat16, False), (64, cpu.AMX_X_BYTES // 128, torch.bfloat16, True),
    (65, cpu.AMX_X_BYTES // 128, torch.bfloat16, False), (32, 256, torch.float16, False)])
def test_rows_of_x_choose_the_amx_kernel(monkeypatch, m, k, dtype, on_tiles):
    """BF16 x from GEMV_MAX_M + 1 rows up to AMX_MAX_M whose x^T (M and K padded to the tiles) fits AMX_X_BYTES
    runs lowbit's AMX kernel (never the batched kernel); beyond either, and for FP16 x, the other paths."""
    calls = _counting_amx(monkeypatch)
    g = gen(m + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    lowbit.mxfp4_linear(x, *mxfp4_weight(64, k, g), backend="native")
    assert calls == ([1] if on_tiles else [])


# --- Triton (interpreted on the CPU): bit-exact for every M ---------------------------------------------------

@pytest.mark.parametrize("fmt", WEIGHTS)
def test_triton_kernel_equals_the_reference(fmt):
    g = gen(8)
    k = 128 - (5 if fmt == "hifloat8" else 0) + (32 if fmt == "mxfp4" else 0)
    weight = WEIGHTS[fmt](17, k, g)  # 17 rows: a second, partly empty program
    x = torch.randn(cpu.GEMV_MAX_M + 2, k, generator=g).half()
    bias = torch.randn(17, generator=g).half()
    want = OPS[fmt](x, *weight, bias, backend="reference")
    got = torch.empty_like(want)
    getattr(triton_kernels, OPS[fmt].name.upper()).run(x, *weight, bias, out=got)
    assert_bits(got, want)


# --- SIMD building blocks, both lowerings -------------------------------------------------------------------

@numba.njit
def _decode_row(magnitudes, scale, bf16, nan_code, table, codes, out):
    wo_decode8._fill_row_table(magnitudes, scale, bf16, nan_code, table)
    for start in range(0, codes.size, 64):
        w0, w1 = wo_decode8.code8_decode(codes, start, table, nan_code)
        simd.f32v_store(out, start, w0)
        simd.f32v_store(out, start + 32, w1)


def skip_without_the_instructions_of(kind, dtype):
    if kind == "bytes" and not simd.BYTE_TABLES:
        pytest.skip("neither AVX512-VBMI nor AVX2 on this CPU")
    if kind == "words" and not simd.HAS_AVX512BW:
        pytest.skip("no AVX512-BW on this CPU")


CODE8 = {"hifloat8": (cpu._hifloat8_operands, reference.hifloat8_weight),
         "float8": (cpu._float8_operands, reference.float8_e4m3fn_weight)}


@pytest.mark.parametrize("fmt", CODE8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["bytes", "words", "values"])
@pytest.mark.parametrize("scale", [1.0, -0.3, 3e-39, 1e-6, 7e4, 1e30, 0.0, -0.0, float("inf"), float("nan")])
def test_row_table_decodes_every_8bit_code(fmt, dtype, kind, scale):
    skip_without_the_instructions_of(kind, dtype)
    operands, weight = CODE8[fmt]
    codes = torch.arange(256, dtype=torch.uint8).reshape(1, 256)
    _, scale_x, bf16, magnitudes, nan_code, table_like, *_ = operands(codes, torch.tensor([scale]), 256, dtype, kind)
    out = np.empty(256, dtype=np.float32)
    _decode_row(magnitudes, scale_x[0], bf16, nan_code, np.empty_like(table_like), codes.numpy().reshape(-1), out)
    order = np.array(wo_layout.CODE8_ORDER)
    logical = np.empty_like(out)
    for start in range(0, 256, 64):
        logical[start + order] = out[start : start + 64]
    want = weight(codes, torch.tensor([scale]), dtype)[0].numpy()
    assert np.array_equal(np.isnan(logical), np.isnan(want))
    finite = ~np.isnan(want)
    assert np.array_equal(logical[finite].view(np.int32), want[finite].view(np.int32))  # signed zeros too


@pytest.mark.parametrize("fmt", CODE8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["words", "values"])
@pytest.mark.parametrize("k", [189, 192])
def test_8bit_gemv_with_other_tables_equals_the_reference(fmt, dtype, kind, k):
    """The table kinds of CPUs without AVX512-VBMI (or BW), on this one: codes, M up to 4, a K tail (rows
    one by one) or none (blocks of wo_steps.ROW_BLOCK rows, 23 rows: a short last block)."""
    skip_without_the_instructions_of(kind, dtype)
    g = gen(13)
    operands, weight = CODE8[fmt]
    codes, scale = hif8_weight(23, k, g, FINITE_HIF8 if fmt == "hifloat8" else FINITE_E4M3)
    x = torch.randn(3, k, generator=g).to(dtype)
    x_reg = torch.zeros(3, 192)
    x_reg[:, :k] = x.float()
    y32 = torch.empty(3, 23)
    x_reg = wo_layout._reorder(x_reg, *cpu.CODE8_SPLIT).numpy()
    weight_operands = operands(codes, scale, k, dtype, kind)
    kernel = cpu.HIFLOAT8_LINEAR
    cpu._code8_gemv(x_reg, *weight_operands, *kernel.x_operands(x_reg, weight_operands, kernel.x_consts), y32.numpy())
    want = reference.lane_sums(x.float(), weight(codes, scale, dtype))
    assert torch.equal(y32.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["bytes", "words", "values"])
def test_mxfp8_every_code_under_every_scale_byte(dtype, kind):
    skip_without_the_instructions_of(kind, torch.bfloat16)  # FP16 x uses the BF16 tables of E4M3 values
    g = gen(14)
    codes = torch.arange(256, dtype=torch.uint8).repeat(32, 3)[:, :736].contiguous()  # K = 736: a one-block last step
    scales = torch.arange(256, dtype=torch.uint8).repeat(3)[torch.randperm(768, generator=g)][: 32 * 23].reshape(32, 23)
    x = torch.randn(2, 736, generator=g).to(dtype)
    x_reg = torch.zeros(2, 768)
    x_reg[:, :736] = x.float()
    y32 = torch.empty(2, 32)
    x_reg = wo_layout._reorder(x_reg, *cpu.CODE8_SPLIT).numpy()
    operands = cpu._mxfp8_operands(codes, scales, 736, dtype, kind)
    cpu._mxfp8_gemv(x_reg, *operands, *cpu._x_bounds_operands(x_reg, operands, ()), y32.numpy())
    want = reference.lane_sums(x.float(), reference.mxfp8_weight(codes, scales, dtype))
    assert torch.equal(y32.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(y32[finite].view(torch.int32), want[finite].view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mxfp8_rows_at_the_edges_of_the_exact_scale_range(dtype):
    """Rows whose scale bytes all lie in the range where the weights need no rounding to x's dtype (the
    kernel skips the rounding there), at both ends of it and one byte past each end, every finite code in each.
    Rows 0-3 are a block of exact rows (summed together), rows 4-7 a block of rows past the range (one by one,
    rounded), row 8 a last row on its own."""
    low, high = wo_steps._MXFP8_EXACT_BYTES_BF16 if dtype == torch.bfloat16 else wo_steps._MXFP8_EXACT_BYTES_F16
    row_scales = [(low, high), (low, low), (high, high), (high, low), (low - 1, high), (low, high + 1),
                  (low - 1, low - 1), (high + 1, high + 1), (low, high)]
    codes = torch.tensor(FINITE_E4M3 + [0, 0], dtype=torch.uint8).repeat(len(row_scales), 1)  # K = 256, no NaN
    scales = torch.tensor([[a, b] * 4 for a, b in row_scales], dtype=torch.uint8)
    x = (torch.rand(3, 256, generator=gen(15)) * 2.0**-12).to(dtype)  # small: a rounding to Inf would show
    for m in (1, 3):
        native_equals_reference(OPS["mxfp8"], x[:m], codes, scales, None)
        for order in ([4, 0, 1, 2, 3, 5, 6, 7, 8], [0, 1, 2, 5, 3, 4, 6, 7, 8]):  # a past-range row first or
            native_equals_reference(OPS["mxfp8"], x[:m], codes[order], scales[order], None)  # last in a block


def _every_lookup16_index(lookup, table, form=None):
    """Run ``lookup`` (a lookup16 intrinsic) on 32-lane ``table`` (or on ``form``, the table as the lookup
    reads it) with every index in every lane, high bits set or not, against table[16 * piece + (index & 15)]."""
    run = simd_binary(lookup, simd.f32v_load, simd.i32v_load, simd.f32v_store)
    form = table if form is None else form
    piece = np.arange(32) // 16
    for shift in range(16):  # each lane takes every index once
        for high_bits in (0, 0x30, 0xFFFFFF00):  # bits above the low 4 are ignored
            index = ((np.arange(32) * 7 + shift) % 16 | high_bits).astype(np.uint32).view(np.int32)
            out = np.empty(32, dtype=np.float32)
            run(form, index, out)
            assert np.array_equal(out.view(np.uint32), table[16 * piece + (index & 15)].view(np.uint32))


@pytest.mark.parametrize("lowering", ["portable", "avx512"])
def test_lookup16_every_index_in_every_lane(lowering):
    if lowering == "avx512" and not simd.HAS_AVX512F:
        pytest.skip("no AVX-512 on this CPU")
    _every_lookup16_index(simd.lookup16_avx512 if lowering == "avx512" else simd.lookup16_portable,
                          np.arange(32, dtype=np.float32) * 0.5 - 3)


@pytest.mark.parametrize("lowering", ["chosen", "avx2"])
def test_lookup16_signed_every_index_in_every_lane(lowering):
    """lookup16_signed (and its AVX2 form) on tables whose entries 8-15 are 0-7 with the sign bit set."""
    if lowering == "avx2" and not simd.HAS_AVX2:
        pytest.skip("no AVX2 on this CPU")
    entries = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 2.0**-130, 6.0e30, 0.0, 7.0, 0.25, 1e-3, 3.0, 5.0, 9.0, 2.0**100],
                       dtype=np.float32).reshape(2, 8)
    table = np.concatenate([entries, -entries], axis=1).reshape(-1)  # -0.0 at 8 and 24
    assert wo_layout._sign_symmetric(table)
    if lowering == "avx2":
        _every_lookup16_index(simd.lookup16_signed_avx2, table, simd.signed_tables_avx2(table))
    else:
        _every_lookup16_index(simd.lookup16_signed, table, simd.signed_tables(table))


@numba.njit
def _telescope_in_place(table):
    simd.telescope_byte_tables(table)


def test_telescoped_byte_tables_undo_by_prefix_xor():
    """Both telescoped forms (numpy, and in place in registers) are chunk i XOR chunk i - 1 per 128-byte
    table, so XOR-ing chunks 0..i gives chunk i back."""
    table = np.random.default_rng(3).integers(0, 256, 256, dtype=np.uint8)
    in_place = table.copy()
    _telescope_in_place(in_place)
    assert np.array_equal(in_place, simd.telescoped(table))
    chunks = in_place.reshape(2, 8, 16)
    assert np.array_equal(np.bitwise_xor.accumulate(chunks, axis=1).reshape(-1), table)
    assert not np.array_equal(in_place, table)


def test_flat_is_a_view_of_every_element_in_order():
    @numba.njit
    def through_flat(a, i, value):
        view = simd.flat(a)
        view[i] = value
        return view.size, view.sum()

    for shape in ((3, 4), (2, 3, 5), (7,)):
        a = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        size, total = through_flat(a, a.size - 1, -1.0)
        assert size == a.size and a.reshape(-1)[-1] == -1.0 and total == a.sum()

    @numba.njit
    def flat_size(a):
        return simd.flat(a).size

    assert flat_size(np.zeros((4, 0), dtype=np.float32)) == 0


def test_double_where_doubles_the_lanes_of_the_set_bits():
    @numba.njit
    def run(values, mask, out):
        simd.f32v_store(out, 0, simd.f32v_double_where(simd.f32v_load(values, 0), mask))

    values = (np.arange(32, dtype=np.float32) - 7) * 0.75
    values[3], values[4] = np.inf, np.nan
    for mask in (0, 1, 0x80000000, 0xA5A55A5A, 0xFFFFFFFF):
        out = np.empty(32, dtype=np.float32)
        run(values, np.uint32(mask), out)
        chosen = np.array([(mask >> i) & 1 for i in range(32)], dtype=bool)
        assert np.array_equal(out, np.where(chosen, values * 2, values), equal_nan=True)


def test_sum_tree_folds_in_the_reference_order():
    @numba.njit
    def tree(values):
        return simd.f32v_sum_tree(simd.f32v_load(values, 0))

    g = gen(9)
    for _ in range(20):
        values = (torch.randn(32, generator=g) * torch.exp2(torch.randint(-20, 20, (32,), generator=g))).numpy()
        acc = torch.from_numpy(values)
        while acc.numel() > 1:
            acc = acc[: acc.numel() // 2] + acc[acc.numel() // 2 :]
        assert np.float32(tree(values)).view(np.int32) == acc.numpy().view(np.int32)[0]


@pytest.mark.parametrize("split", [wo_layout.CODE8_BLOCK_SPLIT, wo_layout.CODE8_HALVES_SPLIT, wo_layout.NIBBLE_SPLIT,
                                   wo_layout.BYTE_SHUFFLE_SPLIT, wo_layout.HIFLOAT4_SHUFFLE_SPLIT])
def test_every_register_order_folds_as_the_reference(split):
    """A row's 64 lanes kept in a register order fold, level by level where they lie, to the bits of the
    reference's fold of the logical lanes (lane i + lane i + 32, then halves)."""
    order = cpu._order(*split)
    fold = wo_layout._make_fold(order)

    @numba.njit
    def run(lanes):
        return fold(simd.f32v_load(lanes, 0), simd.f32v_load(lanes, 32))

    g = gen(10)
    for _ in range(20):
        logical = torch.randn(64, generator=g) * torch.exp2(torch.randint(-24, 24, (64,), generator=g).float())
        acc = logical
        while acc.numel() > 1:
            acc = acc[: acc.numel() // 2] + acc[acc.numel() // 2 :]
        kept = logical[order].numpy()  # register lane l holds element order[l]
        assert np.float32(run(kept)).view(np.int32) == acc.numpy().view(np.int32)[0]


# --- HiFloat8 codes re-encoded by columns (prepared BF16-x weights on AVX2 CPUs) -------------------------------

COLUMN_HIF8 = [c for c in FINITE_HIF8 if not 1 <= c & 0x7F <= 7]  # 239 codes: no NaN, Inf or subnormal code
COLUMN_E4M3 = [c for c in FINITE_E4M3 if c & 0x7F not in (1, 2, 3)]  # 248 codes: no NaN or the 3 smallest
COLUMN_CODES = {"hifloat8": columns.HIFLOAT8, "float8_e4m3fn": columns.FLOAT8_E4M3}
COLUMN_FORMATS = {  # format: (its codes the column decode takes, its operator, its BF16-x weight, its kernel)
    "hifloat8": (COLUMN_HIF8, ops.HIFLOAT8_LINEAR, reference.hifloat8_weight, cpu.HIFLOAT8_LINEAR),
    "float8_e4m3fn": (COLUMN_E4M3, ops.FLOAT8_E4M3FN_LINEAR, reference.float8_e4m3fn_weight,
                      cpu.FLOAT8_E4M3FN_LINEAR),
}


def _column_tables(fmt: str, codes: torch.Tensor, scale: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(fast, tables) of encode_rows for ``codes`` (N, K) with float32 ``scale`` (N,)."""
    n, k = codes.shape
    encoded, fast, tables = np.empty((n, k), np.uint8), np.empty(n, np.uint8), np.empty((n, 32), np.uint8)
    slow_blocks = np.empty((n, -(-k // columns.BLOCK)), np.uint8)
    COLUMN_CODES[fmt].encode_rows(codes.numpy(), scale.numpy(), encoded, fast, tables, slow_blocks)
    assert not slow_blocks.any()  # only codes the columns take
    return fast, tables


@pytest.mark.parametrize("fmt", ["hifloat8", "float8_e4m3fn"])
def test_code8_columns_encoding_is_a_bijection_that_keeps_the_sign_bit(fmt):
    code = COLUMN_CODES[fmt]
    encode = code.encode
    if fmt == "hifloat8":
        assert sorted(encode.tolist()) == list(range(256))
    else:  # FP8's -0 is re-encoded as +0; 0x80 | ZERO_CODE is no code's
        assert encode[0x80] == columns.ZERO_CODE
        assert sorted(encode.tolist()) == sorted([*(set(range(256)) - {0x80 | columns.ZERO_CODE}), columns.ZERO_CODE])
    for c in range(1, 256):
        if c != 0x80:  # HiFloat8's NaN 0x80 takes -0's slot; FP8's -0 is +0
            assert encode[c] & 0x80 == c & 0x80 and encode[c] & 0x7F == encode[c ^ 0x80] & 0x7F
    assert encode[0] == columns.ZERO_CODE
    assert code.encoded_nan == (0x80 | columns.ZERO_CODE if fmt == "hifloat8" else encode[0x7F])
    magnitudes = np.arange(128, dtype=np.float32)
    assert (code.encoded_magnitudes(magnitudes)[encode[:128] & 0x7F] == magnitudes).all()
    slow = [c for c in range(256) if code.slow_codes[c]]
    assert slow == ([*range(1, 8), 0x6F, 0x80, *range(0x81, 0x88), 0xEF] if fmt == "hifloat8" else
                    [1, 2, 3, 0x7F, 0x81, 0x82, 0x83, 0xFF])
    assert sorted(set(range(256)) - set(slow)) == sorted(COLUMN_FORMATS[fmt][0])


@pytest.mark.parametrize("fmt", list(COLUMN_FORMATS))
@pytest.mark.parametrize("scale", [1.0, 2.0**-110, 2.0**110, 0.0078125 * 1.4921875, 3.0e-5, 1.9921875 * 2.0**109,
                                   0.70710677, 1.2345678e30, 2.0**-110 * 1.0000001])
def test_code8_column_table_gives_every_code_its_bf16_weight(fmt, scale):
    """T[j] + (o << 7) + (sign << 15) (mod 2^16) of every code the column decode takes is the bits of its
    BF16 weight (HiFloat8: bf16(value * bf16(scale)); FP8: bf16(fl32(value * scale)), the float32 product
    rounded twice), at scales across the fast range, zero's slot aside (looked up as 0; FP8's -0 as +0)."""
    fast_codes, _, weight, _ = COLUMN_FORMATS[fmt]
    s = torch.tensor([scale], dtype=torch.float32)
    if fmt == "hifloat8":
        s = s.bfloat16().float()
    codes = torch.tensor(fast_codes, dtype=torch.uint8)
    fast, tables = _column_tables(fmt, codes[None], s)
    assert fast.tolist() == [1]
    code, table = COLUMN_CODES[fmt], tables[0]
    want = bits(weight(codes[None], s, torch.bfloat16).bfloat16()[0])
    for c, w in zip(fast_codes, want.tolist()):
        r = int(code.encode[c])
        j, h = r & 0x0F, r >> 4
        base = 0 if r == columns.ZERO_CODE else int(table[j]) | int(table[16 + j]) << 8
        addend = int(columns.ADDENDS[h]) | int(columns.ADDENDS[16 + h]) << 8
        assert (base + addend) & 0xFFFF == (0 if c == 0x80 else w & 0xFFFF), hex(c)


SLOW_ROWS = {  # format: (row, column, code) of three rows with a code the column decode leaves to the table
    "hifloat8": ((8, 5, 0x03), (9, 17, hifloat8.NAN_CODE), (10, 200, 0xEF)),
    "float8_e4m3fn": ((8, 5, 0x02), (9, 17, 0x7F), (10, 200, 0x83)),
}


@pytest.mark.parametrize("fmt", list(COLUMN_FORMATS))
@pytest.mark.parametrize("m", [1, 2, 4])
def test_code8_prepared_rows_by_columns_equal_the_reference(fmt, m, monkeypatch):
    """A prepared HiFloat8 or FP8 weight (PreparedCall, BF16 x): every code the column decode takes in every
    row, at scales across its range, equals the reference bit for bit; rows with a slow code (NaN, Inf,
    subnormal ones) are decoded by columns but for those codes' blocks of 32, rows with a scale outside
    [2^-110, 2^110] (zero, negative, tiny, huge) by the table; x with NaN, Inf and -0; one thread and the
    parallel loop."""
    fast_codes, op, weight, kernel = COLUMN_FORMATS[fmt]
    g = gen(40 + m)
    k = 256
    row_codes = torch.tensor(fast_codes + [0] * (k - len(fast_codes)), dtype=torch.uint8)
    codes = torch.stack([row_codes[torch.randperm(k, generator=g)] for _ in range(14)])
    for row, column, code in SLOW_ROWS[fmt]:
        codes[row, column] = code
    scale = torch.tensor([1.0, 2.0**-110, 2.0**110, 3e-5, 0.7, 1e-3, 5.0, 2.0**-60, 0.5, 0.5, 0.5,
                          2.0**-112, 0.0, -0.25])
    fast = [1] * 8 + [2] * 3 + [0] * 3
    x = torch.randn(m, k, generator=g).bfloat16()
    prepared = PreparedCall(op, (codes, scale, None))
    want = op(x, codes, scale, None, backend="reference")
    assert_bits(prepared(x), want)
    if cpu.CODE8_COLUMNS:  # the rows above went by columns, the slow codes' blocks (columns 0-31, 192-223) aside
        operands = prepared._prepared[(torch.bfloat16, k)][0]
        assert operands[7].tolist() == fast
        assert np.argwhere(operands[8]).tolist() == [[8, 0], [9, 0], [10, 6]]
    _check_prepared_rows(prepared, kernel, x, (codes, scale), weight(codes, scale, torch.bfloat16), monkeypatch)


def _prepared_sums(kernel, x, weight):
    """The GEMV's float32 sums (M, N) for BF16 ``x`` (M, K) with the operands of ``weight`` (a tuple of
    tensors) prepared for BF16 x, on the calling thread."""
    y32 = torch.empty(x.shape[0], weight[0].shape[0])
    operands = kernel.prepare(torch.bfloat16, x.shape[1], *weight, None)[0]
    kernel.gemv_sums(wo_layout._reorder(x.float(), *kernel.split).numpy(), operands, y32.numpy(), serial=True)
    return y32


def _two_values(k, x0, x1):
    """(1, k) BF16 zeros but x0 at column 0 and x1 at column 64 (the same lane of two steps)."""
    x = torch.zeros(1, k)
    x[0, 0], x[0, 64] = x0, x1
    x = x.bfloat16()
    assert x.float()[0, 0] == x0 and x.float()[0, 64] == x1
    return x


def _check_prepared_rows(prepared, kernel, x, weight, dense, monkeypatch):
    """A prepared weight's float32 sums for BF16 ``x`` (before their rounding to BF16, which would hide a small
    error in one weight) equal the reference's lane sums with its ``dense`` (N, K) float32 weights; with NaN,
    Inf, -0 and a subnormal in x, a non-contiguous x and the parallel loop on two threads, ``prepared``
    (its PreparedCall on ``weight``, a tuple of tensors) gives the reference's bits."""
    op = prepared.op
    y32 = _prepared_sums(kernel, x, weight)
    want32 = reference.lane_sums(x.float(), dense)
    assert torch.equal(y32.isnan(), want32.isnan())
    assert torch.equal(y32.nan_to_num().view(torch.int32), want32.nan_to_num().view(torch.int32))
    x = x.clone()
    x[0, 3], x[-1, 100], x[-1, 7], x[-1, 11] = float("nan"), float("inf"), -0.0, 2.0**-130  # and a subnormal
    strided = torch.stack([x, -x], dim=-1)[..., 0]  # a non-contiguous x
    assert not strided.is_contiguous()
    assert_bits(prepared(strided), op(x, *weight, None, backend="reference"))
    monkeypatch.setattr(cpu, "GEMV_ONE_THREAD_WEIGHTS", 0)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert_bits(prepared(x), op(x, *weight, None, backend="reference"))
    finally:
        torch.set_num_threads(previous)


def test_float8_prepared_rows_by_columns_sum_minus_zero_weights_as_the_reference():
    """FP8's -0 (0x80) is re-encoded as +0: rows of -0 weights (alone, and among others) times x of both signs
    give the reference's bits, with and without a -0 bias; so do the table decode's rows."""
    k = 128
    codes = torch.full((3, k), 0x80, dtype=torch.uint8)
    codes[1, ::2] = 0x38  # 1.0
    codes[2, 5] = 0x01  # a slow code: the table decode
    scale = torch.tensor([1.0, 0.5, 2.0])
    for x in (torch.rand(2, k).bfloat16() + 1, -torch.rand(2, k).bfloat16() - 1, torch.zeros(2, k).bfloat16()):
        for bias in (None, torch.tensor([-0.0, -0.0, -0.0]).bfloat16()):
            prepared = PreparedCall(ops.FLOAT8_E4M3FN_LINEAR, (codes, scale, bias))
            assert_bits(prepared(x), ops.FLOAT8_E4M3FN_LINEAR(x, codes, scale, bias, backend="reference"))
            if cpu.CODE8_COLUMNS:
                assert prepared._prepared[(torch.bfloat16, k)][0][7].tolist() == [1, 1, 2]


def test_x_exponents_are_the_bounds_of_the_finite_nonzero_values():
    """_x_exponents (vector lanes, then a scalar tail) against numpy: floor(log2 |x|) of finite nonzero
    values, subnormals at -149; NaN, +-Inf, +-0 ignored; none left: (_NO_EXPONENT, -_NO_EXPONENT)."""
    rng = np.random.default_rng(5)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -3e-42, 2.0**-126, -(2.0**127) * 1.5,
                         3.4e38], dtype=np.float32)
    for count in (0, 1, 31, 32, 33, 64, 95, 200):
        for case in range(4):
            x = (rng.standard_normal(count + 7) * 2.0 ** rng.integers(-140, 120, count + 7)).astype(np.float32)
            if case == 1:
                x[rng.integers(0, count + 7, 5)] = rng.choice(specials, 5)
            elif case == 2:
                x[:] = rng.choice(specials[:5], count + 7)  # nothing finite and nonzero
            elif case == 3:
                x[:] = 0.0
                x[min(count, 35)] = -1e-40  # a subnormal alone (past the vector lanes where count > 32)
            part = x[3 : 3 + count].astype(np.float64)
            part = np.abs(part[np.isfinite(part) & (part != 0)])
            exps = np.where(part < 2.0**-126, -149, np.floor(np.log2(part)))
            none = (wo_layout._NO_EXPONENT, -wo_layout._NO_EXPONENT)
            want = (int(exps.min()), int(exps.max())) if part.size else none
            assert wo_steps._x_exponents(x, 3, count) == want, (count, case)


@pytest.mark.parametrize("fmt", list(COLUMN_FORMATS))
@pytest.mark.parametrize("scale", [2.0**-110, 3.0e-5, 1.0, 1.9921875, 1.9921875 * 2.0**109, 2.0**110])
def test_code8_column_weight_exponents_lie_in_the_fused_bounds(fmt, scale):
    """floor(log2 |w|) - floor(log2 s) of every nonzero weight a fast row of scale s can hold lies in
    [_COLUMN_LOW, _COLUMN_HIGH], the bounds _columns_fused takes (both formats' at once); the format's own
    bounds (fast_exponents) are reached, the high one up to one above (a product rounded up to the next
    binade)."""
    fast_codes, _, weight, _ = COLUMN_FORMATS[fmt]
    s = torch.tensor([scale * (1.0 if fmt == "hifloat8" else 1.2345678)], dtype=torch.float32)  # FP8: any float32
    s = s.bfloat16().float() if fmt == "hifloat8" else s
    codes = torch.tensor([c for c in fast_codes if c & 0x7F], dtype=torch.uint8)
    w = weight(codes[None], s, torch.bfloat16)[0].double().abs()
    relative = torch.floor(torch.log2(w)) - math.floor(math.log2(s.item()))
    low, high = COLUMN_CODES[fmt].fast_exponents
    assert relative.min().item() == low and relative.max().item() in (high, high + 1)
    assert wo_gemv8._COLUMN_LOW <= low and high + 1 <= wo_gemv8._COLUMN_HIGH


def test_columns_fused_only_where_every_product_is_exact():
    """_columns_fused's bounds: every nonzero |x w| in [2^-126, 2^128) (x exponents (low, high), the row's
    scales' exponents from e_low to e_high: one for HiFloat8 / FP8, MXFP8's blocks' range; the weights'
    lowest exponent relative to the scale: the columns' or every code's)."""
    high = wo_gemv8._COLUMN_HIGH
    assert wo_gemv8._CODE8_LOW < wo_gemv8._COLUMN_LOW
    for low in (wo_gemv8._COLUMN_LOW, wo_gemv8._CODE8_LOW):
        for e_low, e_high in ((-110, -110), (-3, -3), (0, 0), (7, 7), (110, 110), (-20, 5), (-110, 110)):
            x_low, x_high = -126 - e_low - low, 126 - e_high - high  # the smallest |x w| 2^-126, the largest < 2^128
            for bounds, want in (((x_low, x_high), True), ((x_low - 1, x_high), False), ((x_low, x_high + 1), False)):
                assert wo_gemv8._columns_fused(np.array([bounds], dtype=np.int64), 0, e_low, e_high, low) == want
    assert wo_gemv8._columns_fused(np.array([[-10, 10]], dtype=np.int64), 0, 0, 0, wo_gemv8._COLUMN_LOW)
    for e in (-126, -110, -1, 0, 5, 127):
        for mantissa in (1.0, 1.5, 1.9921875):
            assert wo_gemv8._scale_exponent(np.float32(mantissa * 2.0**e)) == e


@pytest.mark.parametrize("case", ["overflow", "subnormal tie"])
def test_hifloat8_prepared_rows_by_columns_where_a_fused_multiply_add_would_differ(case):
    """Products at the ends of float32's range, where fma(x, w, acc) and acc + x * w differ: a product that
    overflows after a large negative one (finite by fma, Inf by the reference), or a subnormal product of
    half a unit after one unit (2 units by fma, 1 by the reference's tie to even). The column rows take the
    multiply and the add there, with the reference's bits."""
    k = 128
    if case == "overflow":
        s, w0, w1, x0, x1 = 1.0, 1.0, 4.0, -(2.0**127), 1.25 * 2.0**126
    else:
        s, w0, w1, x0, x1 = 2.0**-110, 2.0**-15, 2.0**-15, 2.0**-24, 2.0**-25
    codes = torch.zeros(2, k, dtype=torch.uint8)
    codes[:, 0], codes[:, 64] = hifloat8.encode(torch.tensor([w0, w1]))
    codes[1, 1:64] = hifloat8.encode(torch.full((63,), 1.5))  # products with x's zeros
    assert all(c in COLUMN_HIF8 for c in codes.unique().tolist())
    scale = torch.tensor([s, s])
    x = _two_values(k, x0, x1)
    kernel = cpu.HIFLOAT8_LINEAR
    operands = kernel.prepare(torch.bfloat16, k, codes, scale, None)[0]
    y32 = _prepared_sums(kernel, x, (codes, scale))
    want = reference.lane_sums(x.float(), reference.hifloat8_weight(codes, scale, torch.bfloat16))
    fused = torch.tensor([x0 * w0 * s + x1 * w1 * s] * 2, dtype=torch.float64).float()  # one rounding
    assert not torch.equal(want[0, :1], fused[:1])  # the case is one where the two differ
    assert torch.equal(y32.view(torch.int32), want.view(torch.int32))
    if cpu.CODE8_COLUMNS:
        assert operands[7].tolist() == [1, 1]


def test_hifloat8_prepared_weight_with_a_k_tail_keeps_the_table():
    """K not a multiple of 64: nothing is re-encoded (no fast rows), the results are the reference's."""
    g = gen(45)
    k = 200
    codes = torch.tensor(COLUMN_HIF8, dtype=torch.uint8)[torch.randint(0, len(COLUMN_HIF8), (9, k), generator=g)]
    scale = torch.rand(9, generator=g) + 0.5
    prepared = PreparedCall(ops.HIFLOAT8_LINEAR, (codes, scale, None))
    x = torch.randn(3, k, generator=g).bfloat16()
    assert_bits(prepared(x), ops.HIFLOAT8_LINEAR(x, codes, scale, None, backend="reference"))
    assert prepared._prepared[(torch.bfloat16, k)][0][7].size == 0


@pytest.mark.parametrize("fmt", list(COLUMN_FORMATS))
def test_code8_prepared_batched_rows_by_columns_equal_the_operator(fmt):
    """5-64 rows of x (the batched kernel): a prepared HiFloat8 or FP8 weight's rows decoded by columns give
    the operator's float32 sums, bit for bit, and its outputs (rows with a slow code or scale take the
    table)."""
    fast_codes, op, _, kernel = COLUMN_FORMATS[fmt]
    g = gen(50)
    k, n = 256, 70
    row_codes = torch.tensor(fast_codes + [0] * (k - len(fast_codes)), dtype=torch.uint8)
    codes = torch.stack([row_codes[torch.randperm(k, generator=g)] for _ in range(n)])
    for row, column, code in SLOW_ROWS[fmt]:
        codes[row + 30, column] = code
    scale = torch.rand(n, generator=g) * 2.0 ** torch.randint(-60, 60, (n,), generator=g).float()
    scale[7], scale[8] = 2.0**-115, 0.0
    prepared_operands = kernel.prepare(torch.bfloat16, k, codes, scale, None)[0]
    operator_operands = kernel._operands(codes, scale, k, torch.bfloat16)
    for m in (5, 8, 33):
        x = torch.randn(m, k, generator=g).bfloat16()
        if cpu.BATCH_IN_BF16:
            x_reg = np.empty((m, k), dtype=np.int16)
            cpu._gather_x_bits(x.view(torch.int16).numpy(), kernel.order, x_reg)
        else:
            x_reg = wo_layout._reorder(x.float(), *kernel.split).numpy()
        sums = []
        for operands in (prepared_operands, operator_operands):
            y32 = torch.empty(m, n)
            run_tasks(kernel.batched, (x_reg, *operands), n, y32.numpy(), True)
            sums.append(y32)
        assert torch.equal(sums[0].isnan(), sums[1].isnan())
        assert torch.equal(sums[0].nan_to_num().view(torch.int32), sums[1].nan_to_num().view(torch.int32))
        prepared = PreparedCall(op, (codes, scale, None))
        assert_bits(prepared(x), op(x, codes, scale, None))


# --- MXFP8 codes by columns: FP8's re-encoding, a column table per E8M0 byte ----------------------------------

def test_mxfp8_column_tables_give_every_code_its_bf16_weight_under_every_scale_byte():
    """T_b[j] + (o << 7) + (sign << 15) (mod 2^16) of every code the columns take, under every E8M0 byte b of
    the column range, is the bits of the reference's BF16 weight (E4M3 value times 2^(b - 127), one
    rounding); FP8's -0 is +0; bytes outside the range have zero tables (no fast row holds them)."""
    table, tables = cpu._mxfp8_column_operands()
    low, high = cpu._MXFP8_COLUMN_BYTES
    assert wo_steps._MXFP8_EXACT_BYTES_BF16[0] <= low and high <= wo_steps._MXFP8_EXACT_BYTES_BF16[1]
    assert not tables[:low].any() and not tables[high + 1 :].any()
    codes = torch.tensor(COLUMN_E4M3, dtype=torch.uint8)
    r = torch.from_numpy(columns.FLOAT8_E4M3.encode[codes.numpy()].astype(np.int64))
    j, h = r & 0x0F, r >> 4
    addends = columns.ADDENDS.astype(np.int64)
    addend = torch.from_numpy(addends[h.numpy()] | addends[16 + h.numpy()] << 8)
    for b in range(low, high + 1):
        t = torch.from_numpy(tables[b].astype(np.int64))
        base = torch.where(r == columns.ZERO_CODE, 0, t[j] | t[16 + j] << 8)
        scales = torch.full((1, len(COLUMN_E4M3) // 32 + 1), b, dtype=torch.uint8)
        padded = torch.cat([codes, torch.zeros(32 - len(COLUMN_E4M3) % 32, dtype=torch.uint8)])
        want = bits(reference.mxfp8_weight(padded[None], scales, torch.bfloat16).bfloat16()[0, : len(COLUMN_E4M3)])
        want = torch.where(codes == 0x80, 0, want.long() & 0xFFFF)
        assert torch.equal((base + addend) & 0xFFFF, want), b


def _mxfp8_column_weight(g, n, k, byte_range):
    """(codes, scales) (n, k): every code the columns take in each row (shuffled, zeros after), the scale bytes
    drawn from ``byte_range``."""
    row_codes = torch.tensor(COLUMN_E4M3 + [0] * (k - len(COLUMN_E4M3)), dtype=torch.uint8)
    codes = torch.stack([row_codes[torch.randperm(k, generator=g)] for _ in range(n)])
    scales = torch.randint(byte_range[0], byte_range[1] + 1, (n, k // 32), generator=g, dtype=torch.int64)
    return codes, scales.to(torch.uint8)


@pytest.mark.parametrize("m", [1, 2, 4])
def test_mxfp8_prepared_rows_by_columns_equal_the_reference(m, monkeypatch):
    """A prepared MXFP8 weight (PreparedCall, BF16 x): every code the columns take in every row, under scale
    bytes across the column range (both ends), equals the reference bit for bit, float32 sums too; rows with
    a slow code (the three smallest subnormals, NaN; one or several, in the first, a middle and the last
    block, in either half of a step) take the table decode in those blocks; rows with a scale byte outside
    the range (just outside, in the exact range; far outside; NaN 0xFF) take the table decode of the
    re-encoded codes; x with NaN, Inf, -0 and a subnormal, strided; one thread and the parallel loop."""
    g = gen(60 + m)
    k = 256
    low, high = cpu._MXFP8_COLUMN_BYTES
    codes, scales = _mxfp8_column_weight(g, 16, k, (100, 140))
    scales[0], scales[1], scales[2] = low, high, torch.tensor([low, high] * 4)
    scales[3] = torch.tensor([low, low + 1, 120, 130, high - 1, high, 127, 127])
    codes[8, 5], codes[9, 17], codes[10, 200], codes[11, 30] = 0x02, 0x7F, 0x83, 0xFF
    codes[8, 40], codes[8, 255], codes[10, 0], codes[10, 31], codes[10, 100] = 0x01, 0x81, 0x03, 0x82, 0x01
    scales[12, 3], scales[13, 0], scales[14, 7], scales[15, 2] = low - 1, high + 1, 3, 0xFF
    fast = [1] * 8 + [2] * 4 + [0] * 4
    x = torch.randn(m, k, generator=g).bfloat16()
    op, kernel = ops.MXFP8_LINEAR, cpu.MXFP8_LINEAR
    prepared = PreparedCall(op, (codes, scales, None))
    assert_bits(prepared(x), op(x, codes, scales, None, backend="reference"))
    operands = kernel.prepare(torch.bfloat16, k, codes, scales, None)[0]
    if cpu.CODE8_COLUMNS:  # the rows above went by columns
        assert operands[4].tolist() == fast
        assert np.argwhere(operands[5][8:12]).tolist() == [[0, 0], [0, 1], [0, 7], [1, 0], [2, 0], [2, 3], [2, 6],
                                                           [3, 0]]
    dense = reference.mxfp8_weight(codes, scales, torch.bfloat16)
    _check_prepared_rows(prepared, kernel, x, (codes, scales), dense, monkeypatch)


@pytest.mark.parametrize("x_exponent", [-120, -100, 0, 12, 17, 30])
def test_mxfp8_prepared_rows_by_columns_at_the_ends_of_float32(x_exponent):
    """Rows by columns under the column range's end bytes with x far from 1: products near float32's
    smallest normal (the multiply and the add, rounding as the reference's) and past its largest (Inf, NaN
    where Inf meets -Inf) take the reference's bits, by fused multiply-adds only where every product is
    exact."""
    g = gen(70)
    k = 256
    low, high = cpu._MXFP8_COLUMN_BYTES
    codes, scales = _mxfp8_column_weight(g, 6, k, (low, low + 3))
    scales[3:] = torch.randint(high - 3, high + 1, (3, k // 32), generator=g).to(torch.uint8)
    x = (torch.randn(2, k, generator=g) * 2.0**x_exponent).bfloat16()
    prepared = PreparedCall(ops.MXFP8_LINEAR, (codes, scales, None))
    if cpu.CODE8_COLUMNS:
        assert cpu.MXFP8_LINEAR.prepare(torch.bfloat16, k, codes, scales, None)[0][4].tolist() == [1] * 6
    assert_bits(prepared(x), ops.MXFP8_LINEAR(x, codes, scales, None, backend="reference"))
    y32 = _prepared_sums(cpu.MXFP8_LINEAR, x, (codes, scales))
    want32 = reference.lane_sums(x.float(), reference.mxfp8_weight(codes, scales, torch.bfloat16))
    assert torch.equal(y32.isnan(), want32.isnan())
    assert torch.equal(y32.nan_to_num().view(torch.int32), want32.nan_to_num().view(torch.int32))


@pytest.mark.parametrize("case", ["overflow", "subnormal tie"])
def test_mxfp8_prepared_rows_by_columns_where_a_fused_multiply_add_would_differ(case):
    """A row by columns whose blocks' scales span the column range (2^-110 and 2^110 side by side), with
    products at the ends of float32's range in one lane, where fma(x, w, acc) and acc + x * w differ: one
    that overflows after a large negative one under the large scale (finite by fma, Inf by the reference),
    or a subnormal product of half a unit after one unit under the small scale (2 units by fma, 1 by the
    reference's tie to even). The fused bound takes the row's smallest scale below and its largest above."""
    k = 256
    low, high = cpu._MXFP8_COLUMN_BYTES
    if case == "overflow":
        byte, w0, w1, x0, x1 = high, 1.0, 4.0, -(2.0**17), 1.25 * 2.0**16  # products -2^127, 1.25 * 2^128
    else:
        byte, w0, w1, x0, x1 = low, 2.0**-7, 2.0**-7, 2.0**-32, 2.0**-33  # products 2^-149, 2^-150 (scale 2^-110)
    codes = torch.zeros(1, k, dtype=torch.uint8)
    codes[0, 0], codes[0, 64] = mxfp8.e4m3_codes(torch.tensor([w0, w1]))
    codes[0, 128:192] = mxfp8.e4m3_codes(torch.full((64,), 1.5))  # products with x's zeros
    scales = torch.full((1, k // 32), 127, dtype=torch.uint8)
    scales[0, 0] = scales[0, 2] = byte  # the blocks of columns 0 and 64
    scales[0, 4] = low if case == "overflow" else high  # the other end of the range
    assert all(c in COLUMN_E4M3 for c in codes.unique().tolist())
    x = _two_values(k, x0, x1)
    kernel = cpu.MXFP8_LINEAR
    operands = kernel.prepare(torch.bfloat16, k, codes, scales, None)[0]
    y32 = _prepared_sums(kernel, x, (codes, scales))
    w = reference.mxfp8_weight(codes, scales, torch.bfloat16)
    want = reference.lane_sums(x.float(), w)
    fused = torch.tensor([x0 * w[0, 0].item() + x1 * w[0, 64].item()], dtype=torch.float64).float()  # one rounding
    assert not torch.equal(want[0], fused)  # the case is one where the two differ
    assert torch.equal(y32.view(torch.int32), want.view(torch.int32))
    if cpu.CODE8_COLUMNS:
        assert operands[4].tolist() == [1]


def test_mxfp8_prepared_rows_by_columns_sum_minus_zero_weights_as_the_reference():
    """E4M3's -0 (0x80) is re-encoded as +0: rows of -0 weights (alone, among others, with a slow code) times x
    of both signs and zeros give the reference's bits, with and without a -0 bias, at M = 1 (the GEMV) and
    M = 300 (the GEMM path on decoded tiles)."""
    k = 128
    codes = torch.full((3, k), 0x80, dtype=torch.uint8)
    codes[1, ::2] = 0x38  # 1.0
    codes[2, 5] = 0x01  # a slow code: the table decode of its block
    scales = torch.full((3, k // 32), 120, dtype=torch.uint8)
    for m in (1, 300):
        for x in (torch.rand(m, k).bfloat16() + 1, -torch.rand(m, k).bfloat16() - 1, torch.zeros(m, k).bfloat16()):
            for bias in (None, torch.tensor([-0.0, -0.0, -0.0]).bfloat16()):
                prepared = PreparedCall(ops.MXFP8_LINEAR, (codes, scales, bias))
                assert_bits(prepared(x), ops.MXFP8_LINEAR(x, codes, scales, bias, backend="reference"))
                if cpu.CODE8_COLUMNS:
                    assert prepared._prepared[(torch.bfloat16, k)][0][4].tolist() == [1, 1, 2]


def test_mxfp8_prepared_batched_and_gemm_rows_equal_the_operator():
    """5-64 rows of x (the batched kernel) and 300 (the GEMM path): a prepared MXFP8 weight (codes re-encoded
    where CODE8_COLUMNS, decoded there by the re-encoded table) gives the operator's outputs, bit for bit;
    FP16 x keeps the operator's operands."""
    g = gen(75)
    k, n = 256, 70
    codes, scales = _mxfp8_column_weight(g, n, k, (90, 150))
    codes[40, 9], scales[41, 2] = 0x01, 250
    for dtype in (torch.bfloat16, torch.float16):
        prepared = PreparedCall(ops.MXFP8_LINEAR, (codes, scales, None))
        for m in (1, 5, 33, 300):
            x = torch.randn(m, k, generator=g).to(dtype)
            assert_bits(prepared(x), ops.MXFP8_LINEAR(x, codes, scales, None, backend="native"))


def test_hifloat4_prepared_rows_sum_as_the_reference(monkeypatch):
    """A prepared HiFloat4 weight (on AVX2 CPUs: its scale words and value bytes rearranged,
    _hifloat4_prepared_operands) of every E6M2 byte (0xFF: a poisoned block, NaN row), random and extreme
    flag patterns (none set, all set), rows of one narrow scale range (fused multiply-adds) and of wide ones:
    its float32 sums equal the reference's lane sums (_check_prepared_rows: x specials, non-contiguous x, two
    threads); at M = 1, 2 (GEMV), 9 (batched) and 300 (GEMM path) it gives the operator's bits for BF16 and
    FP16 x."""
    g = gen(71)
    n, k = 48, 2048  # 32 blocks a row: _low_byte_range's vector loop reads the prepared words
    scale = torch.randint(0, 256, (n, k // 64, 4), generator=g, dtype=torch.uint8)
    scale[:32, :8, 0] = torch.arange(256, dtype=torch.uint8).reshape(32, 8)[torch.randperm(32, generator=g)]
    scale[32:, :, 0] = torch.randint(0x70, 0x78, (16, k // 64), generator=g, dtype=torch.uint8)
    scale[40, :, 1:], scale[41, :, 1:] = 0x00, 0xFF  # no level flag set; every one
    value = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    if cpu.BYTE_SHUFFLE_NIBBLES:
        words, values = cpu.HIFLOAT4_LINEAR.prepare(torch.bfloat16, k, scale, value, None)[0]
        assert words.dtype == np.uint32 and values.shape == value.shape
        low = scale[..., 0].numpy()
        for row in (0, 5, 40):  # the E6M2 range of a row, as the GEMV's choice of the fused path reads it
            got = wo_steps._low_byte_range(words.reshape(-1), row * (k // 64), k // 64)
            assert got == (low[row].min(), low[row].max())
    x = torch.randn(3, k, generator=g).bfloat16()
    prepared = PreparedCall(ops.HIFLOAT4_LINEAR, (scale, value, None))
    _check_prepared_rows(prepared, cpu.HIFLOAT4_LINEAR, x, (scale, value), reference.hifloat4_weight(scale, value),
                         monkeypatch)
    for dtype in (torch.bfloat16, torch.float16):
        for m in (1, 2, 9, 300):
            x = torch.randn(m, k, generator=g).to(dtype)
            assert_bits(prepared(x), ops.HIFLOAT4_LINEAR(x, scale, value, None, backend="native"))


# --- the prepared call of a fixed weight ----------------------------------------------------------------------

@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", WEIGHTS)
def test_prepared_call_equals_the_operator(fmt, threads, monkeypatch):
    """PreparedCall(op, (*weight, bias))(x) is op(x, *weight, bias), bit for bit, on every path (GEMV: its one
    numba call against the operator's three, on the calling thread and on two; batched, GEMM), both x dtypes
    and every bias kind, with the kernel's operands made once per x dtype."""
    monkeypatch.setattr(cpu, "GEMV_ONE_THREAD_WEIGHTS", 0)  # a small weight on numba's threads where threads = 2
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_prepared_call_equals_the_operator(fmt)
    finally:
        torch.set_num_threads(previous)


def _check_prepared_call_equals_the_operator(fmt):
    g = gen(11)
    weight = WEIGHTS[fmt](40, 128, g)
    for bias_dtype in (None, torch.bfloat16, torch.float16, torch.float32):
        bias = None if bias_dtype is None else torch.randn(40, generator=g).to(bias_dtype)
        prepared = PreparedCall(OPS[fmt], (*weight, bias))
        for dtype in (torch.bfloat16, torch.float16):
            if bias is not None and bias.dtype not in (dtype, torch.float32):
                continue
            for m in (1, 3, 9, 40):
                x = torch.randn(2, m, 128, generator=g).to(dtype)
                got = prepared(x)
                assert_bits(got, OPS[fmt](x, *weight, bias))
                assert not got.requires_grad  # grad mode is on: nothing of a plain call records a graph
                with torch.inference_mode():
                    x_inference = x.clone()
                assert_bits(prepared(x_inference), got)
        assert len(prepared._prepared) == (2 if bias_dtype in (None, torch.float32) else 1)


def test_prepared_call_takes_the_operator_path_where_the_call_is_not_plain():
    """x requiring grad, a non-contiguous x, a bad dtype or shape, the reference backend, an empty x: the
    operator's results and errors."""
    g = gen(12)
    weight = hif4_weight(24, 128, g)
    prepared = PreparedCall(ops.HIFLOAT4_LINEAR, (*weight, None))
    x = torch.randn(3, 256, generator=g).bfloat16()[:, ::2]
    want = ops.HIFLOAT4_LINEAR(x, *weight, None)
    assert_bits(prepared(x), want)
    assert_bits(prepared(x.clone().requires_grad_()), want)
    with lowbit.use_backend("reference"):
        assert_bits(prepared(x), want)
        assert lowbit.last_backend("hifloat4_linear") == "reference"
    assert_bits(prepared(x), want) and lowbit.last_backend("hifloat4_linear") == "native"
    assert prepared(x[:0]).shape == (0, 24)
    with pytest.raises(DtypeError, match="float16 or bfloat16"):
        prepared(x.float())
    with pytest.raises(ShapeError, match="K = 128"):
        prepared(x[:, :64])
    with pytest.raises(ShapeError, match="bias"):
        PreparedCall(ops.HIFLOAT4_LINEAR, (*weight, torch.zeros(5, dtype=torch.bfloat16)))(x)


def test_prepared_call_keeps_a_bounded_plan_per_kind_of_x():
    """One plan (checks, kernel choice) per x dtype, shape and backend, reused; many shapes (prefill lengths)
    do not grow them past library._MAX_PLANS; every call still gives the operator's bits."""
    g = gen(14)
    weight = hif4_weight(24, 128, g)
    prepared = PreparedCall(ops.HIFLOAT4_LINEAR, (*weight, None))
    x = torch.randn(2, 128, generator=g).bfloat16()
    prepared(x)
    prepared(x.clone())
    assert len(prepared._plans) == 1
    for m in range(1, library._MAX_PLANS + 8):
        x = torch.randn(m, 128, generator=g).bfloat16()
        assert_bits(prepared(x), ops.HIFLOAT4_LINEAR(x, *weight, None))
        assert len(prepared._plans) <= library._MAX_PLANS


def test_prepared_call_copies_a_non_contiguous_weight():
    g = gen(13)
    scale, value = hif4_weight(24, 128, g)
    wide = torch.zeros(24, 128, dtype=torch.uint8)
    wide[:, ::2] = value  # a strided view of the same values
    prepared = PreparedCall(ops.HIFLOAT4_LINEAR, (scale, wide[:, ::2], None))
    assert prepared.fixed[1].is_contiguous()
    x = torch.randn(1, 128, generator=g).bfloat16()
    assert_bits(prepared(x), ops.HIFLOAT4_LINEAR(x, scale, value, None))


# --- contracts and errors -------------------------------------------------------------------------------------

def test_public_functions_shapes_out_and_backend():
    g = gen(10)
    codes, scales = mxfp4_weight(24, 64, g)
    x = torch.randn(2, 3, 64, generator=g).bfloat16()
    y = lowbit.mxfp4_linear(x, codes, scales)
    assert y.shape == (2, 3, 24) and y.dtype == torch.bfloat16
    assert lowbit.last_backend("mxfp4_linear") in ("native", "reference")
    out = torch.empty(2, 3, 24, dtype=torch.bfloat16)
    assert lowbit.mxfp4_linear(x, codes, scales, out=out, backend="native") is out
    assert_bits(out, lowbit.mxfp4_linear(x, codes, scales, backend="reference"))
    assert lowbit.last_backend("mxfp4_linear") == "reference"


def test_reference_is_the_documented_sum():
    """A hand-computed case: 64 lanes, lane j sums k = j, j + 64; then the pairwise fold."""
    k = 128
    x = torch.zeros(1, k, dtype=torch.bfloat16)
    x[0, 0], x[0, 64], x[0, 32] = 2.0**24, 1.0, 1.0  # lane 0: 2^24 + 1 -> 2^24 (ties to even); lane 32: 1
    codes = torch.full((1, k), 0x08, dtype=torch.uint8)  # 1.0
    y32 = reference.lane_sums(x.float(), reference.hifloat8_weight(codes, torch.ones(1), torch.bfloat16))
    assert y32.item() == 2.0**24  # then 2^24 + 1 (lane 32 folded into lane 0) -> 2^24
    assert_bits(lowbit.hifloat8_linear(x, codes, torch.ones(1), backend="native"),
                torch.tensor([[2.0**24]], dtype=torch.bfloat16))


@pytest.mark.parametrize("call, error, match", [
    (lambda x, c, s: lowbit.hifloat8_linear(x.float(), c, s), DtypeError, "x must be float16 or bfloat16"),
    (lambda x, c, s: lowbit.hifloat8_linear(x, c.to(torch.int8), s), DtypeError, "codes must be uint8"),
    (lambda x, c, s: lowbit.hifloat8_linear(x, c, s.half()), DtypeError, "scale must be a float32"),
    (lambda x, c, s: lowbit.hifloat8_linear(x, c, s[:3]), ShapeError, "scale must have shape"),
    (lambda x, c, s: lowbit.hifloat8_linear(x[:, :10], c, s), ShapeError, "K = 64"),
    (lambda x, c, s: lowbit.hifloat8_linear(x, c[0], s), ShapeError, "codes must be"),
    (lambda x, c, s: lowbit.hifloat8_linear(x, c, s, torch.zeros(5)), ShapeError, "bias must have shape"),
    (lambda x, c, s: lowbit.hifloat8_linear(x, c, s, torch.zeros(8, dtype=torch.float64)), DtypeError, "bias"),
    (lambda x, c, s: lowbit.hifloat8_linear(x.to("meta"), c, s), DeviceError, "one device"),
    (lambda x, c, s: lowbit.mxfp4_linear(x[:, :48], c[:, :24], c[:, :1]), ShapeError, "multiple of 32"),
    (lambda x, c, s: lowbit.mxfp4_linear(x, c[:, :32], c[:, :3]), ShapeError, "scales"),
    (lambda x, c, s: lowbit.hifloat4_linear(x, c.reshape(8, 16, 4), c[:, :32]), ShapeError, "K/64"),
    (lambda x, c, s: lowbit.hifloat4_linear(x, c.reshape(8, 1, 64), c[:, :32]), ShapeError, "K/64, 4"),
    (lambda x, c, s: lowbit.hifloat4_linear(x, c.view(torch.int8).reshape(8, 1, 64)[..., :4], c[:, :32]),
     DtypeError, "scale must be uint8"),
])
def test_bad_arguments_raise_typed_errors(call, error, match):
    g = gen(11)
    x = torch.randn(2, 64, generator=g).bfloat16()
    codes, scale = hif8_weight(8, 64, g)
    with pytest.raises(error, match=match):
        call(x, codes, scale)


def test_triton_kernel_declares_its_grid_limit():
    x = torch.empty(1, 32, device="meta")
    too_many = torch.empty(16 * 65536, 16, dtype=torch.uint8, device="meta")
    assert "output features" in triton_kernels.MXFP4_LINEAR.supports(x, too_many, too_many[:, :1], None)
    assert triton_kernels.MXFP4_LINEAR.supports(x, too_many[:64], too_many[:64, :1], None) is None


def test_the_contract_is_exact_for_few_rows_and_the_interval_above():
    g = torch.Generator().manual_seed(5)
    w32 = torch.randn(8, 128, generator=g)
    for rows, exact_only in ((reference.EXACT_ROWS, True), (reference.EXACT_ROWS + 1, False)):
        x = torch.randn(rows, 128, generator=g).bfloat16()
        want = reference.linear(x, w32)
        lo, hi = reference.gemm_interval(x, w32)
        assert reference.meets_contract(want, want, x, w32)
        nudged = torch.where(want == hi, lo, hi)  # another value inside the interval, where it has two
        assert reference.meets_contract(nudged, want, x, w32) is (not exact_only or bool(torch.equal(nudged, want)))
        outside = (hi.float() * 2 + 1).bfloat16()
        assert not reference.meets_contract(outside, want, x, w32)
