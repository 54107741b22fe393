"""Weight-only linear operators: the CPU GEMV equals the reference bit for bit: exhaustively over small
spaces, with fused multiply-adds and BF16 pairs only where they give its bits, for any shape, stride and
thread count."""

import numba
import numpy as np
import pytest
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

import lowbit
from lowbit.formats import hifloat4, hifloat8, mxfp4
from lowbit.formats import weight_only as reference
from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu import amx
from lowbit.kernels.cpu import _weight_only_decode4 as wo_decode4
from lowbit.kernels.cpu import _weight_only_gemv4 as wo_gemv4
from lowbit.kernels.cpu import _weight_only_layout as wo_layout
from lowbit.kernels.cpu import _weight_only_steps as wo_steps
from lowbit.kernels.cpu import weight_only as cpu
from lowbit.kernels.cpu._runtime import run_tasks
from lowbit.ops import weight_only as ops
from lowbit.ops.library import PreparedCall

from weight_only_cases import (CPU_KERNELS, FINITE_HIF8, GEMM_M, OPS, WEIGHTS, assert_bits, bits, dense_weight, gen,
                               hif8_weight, mxfp4_weight, native_equals_reference)


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
def _levels_every_way(words, weights, by_masks, by_multipliers, by_halves):
    for block in range(words.size):
        w0, w1 = simd.f32v_load(weights, 64 * block), simd.f32v_load(weights, 64 * block + 32)
        word = np.uint32(words[block])
        a0, a1 = wo_decode4._hifloat4_levels(w0, w1, word)
        b0, b1 = wo_decode4._hifloat4_levels_by_multipliers(w0, w1, word)
        c0, c1 = wo_decode4._hifloat4_levels_by_halves(w0, w1, word)
        simd.f32v_store(by_masks, 64 * block, a0)
        simd.f32v_store(by_masks, 64 * block + 32, a1)
        simd.f32v_store(by_multipliers, 64 * block, b0)
        simd.f32v_store(by_multipliers, 64 * block + 32, b1)
        simd.f32v_store(by_halves, 64 * block, c0)
        simd.f32v_store(by_halves, 64 * block + 32, c1)


def test_hifloat4_levels_by_multipliers_equal_the_masked_doublings():
    """The AVX2 form of HiFloat4's e2 / e3 levels (a multiply by 1, 2 or 4 per lane from _LEVEL_MULTIPLIERS) and
    the AVX-512 one (_hifloat4_levels_by_halves, 16 lanes at a time) give the doublings under lane masks bit for
    bit, for every e2 byte and every e3 byte in both halves
    (each paired with random others), on weights with zeros of both signs, NaN, Inf and extreme magnitudes."""
    rng = np.random.default_rng(8)
    flags = np.arange(256, dtype=np.uint32)
    words = np.concatenate([rng.integers(0, 256, 256, dtype=np.uint32) | flags << 8 | rng.permutation(flags) << 16
                            | rng.permutation(flags) << 24 for _ in range(3)]).astype(np.uint32).view(np.int32)
    special = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 2.0**-126, 3.0 * 2.0**125, -1.75], dtype=np.float32)
    weights = np.where(rng.random(64 * words.size) < 0.2, rng.choice(special, 64 * words.size),
                       rng.standard_normal(64 * words.size)).astype(np.float32)
    by_masks, by_multipliers, by_halves = np.empty_like(weights), np.empty_like(weights), np.empty_like(weights)
    _levels_every_way(words, weights, by_masks, by_multipliers, by_halves)
    assert np.array_equal(by_masks.view(np.uint32), by_multipliers.view(np.uint32))
    assert np.array_equal(by_masks.view(np.uint32), by_halves.view(np.uint32))


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


@pytest.mark.parametrize("k", [192, 256])
def test_hifloat4_rows_of_minus_zero_weights_sum_as_the_reference(k):
    """The AVX2 step holds -0 weights as +0, the pairs by magnitude index as -0: rows of -0 weights (alone,
    among others, under every level flag, poisoned and extreme scale bytes) times x of either sign or zero,
    with and without a -0 bias, give the reference's bits, by the operator and by a prepared weight (its
    one-call GEMV; K = 256: an even number of blocks, so pairs of steps)."""
    g = gen(61)
    n = 6
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


def test_hifloat4_multiplied_step_decodes_every_block_as_the_flag_doublings():
    """The AVX-512 step off AMD Zen (16-entry float32 tables times each lane's 2^(e2 + e3), the fused step's
    decode there) gives the portable one's weights, bit for bit (_every_block_both_ways), and is the one this
    CPU uses unless it is AMD Zen."""
    if not simd.HAS_AVX512BW:
        pytest.skip("no AVX512-BW on this CPU")
    by_levels, by_flags = _every_block_both_ways(wo_steps._hifloat4_step_multiplied, 6)
    assert np.isnan(by_flags).sum() == 256 * 64
    assert np.array_equal(by_levels.view(np.uint32), by_flags.view(np.uint32))
    expected = wo_steps._hifloat4_step_words if simd.HOST_IS_AMD_ZEN else wo_steps._hifloat4_step_multiplied
    assert wo_steps._hifloat4_step is expected


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


@numba.njit
def _indexed_pair_steps(words, codes, signs, steps, out):
    """_pair_steps through _hifloat4_indexed_pair_step (operands of _hifloat4_indexed_operands)."""
    operands = (words, codes, signs, np.uint64(0))
    for t in range(steps):
        low, high = wo_gemv4._hifloat4_indexed_pair_step(operands, 0, 0, t)
        simd.i32v_store(out, 64 * t, low)
        simd.i32v_store(out, 64 * t + 32, high)


@pytest.mark.skipif(not cpu._HIFLOAT4_PAIRS, reason="HiFloat4's BF16 pairs need AVX512-BF16 and BITALG")
def test_hifloat4_indexed_pairs_equal_the_in_place_pairs():
    """A weight prepared for the pairs by magnitude index (_hifloat4_indexed_operands) gives the dwords of the
    in-place pairs of the packed weight bit for bit (tested above against the portable decode), for every E6M2
    byte (the poisoned 0xFF too: NaN words with their nibble's sign) under every e2 byte and every e3 byte in
    both halves, with random value bytes; the magnitudes are the 16 values of c * 2^(e2 + e3)."""
    assert sorted({c << (e2 + e3) for c in range(8) for e2 in (0, 1) for e3 in (0, 1)}) == \
        wo_decode4.INDEXED_MAGNITUDES.tolist()
    rng = np.random.default_rng(8)
    words = _scale_words(rng, 256)
    value = rng.integers(0, 256, 32 * words.size, dtype=np.uint8)
    codes = np.empty((1, value.size), dtype=np.uint8)
    signs = np.empty((1, 2 * words.size), dtype=np.uint32)
    wo_decode4._hifloat4_indexed_operands(words.reshape(1, -1), value.reshape(1, -1), codes, signs)
    want, got = (np.empty(32 * words.size, dtype=np.int32) for _ in range(2))
    _pair_steps(wo_gemv4._hifloat4_pair_step, words, value, words.size // 2, want)
    _indexed_pair_steps(words, codes.reshape(-1), signs.reshape(-1), words.size // 2, got)
    assert np.array_equal(got, want)


def test_hifloat4_indexed_operands_need_pairs_of_blocks():
    """_hifloat4_indexed_operands names the shapes it cannot pair (an odd number of blocks, a mismatch)."""
    words, value = np.zeros((2, 3), dtype=np.int32), np.zeros((2, 96), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"words \(2, 3\)"):
        wo_decode4._hifloat4_indexed_operands(words, value, np.empty_like(value), np.empty((2, 6), dtype=np.uint32))
    with pytest.raises(ValueError, match="signs"):
        wo_decode4._hifloat4_indexed_operands(words[:, :2], value[:, :64], np.empty((2, 64), dtype=np.uint8),
                                              np.empty((2, 3), dtype=np.uint32))


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


def pair_and_fuse_tables(fmt, x, x_pairs=None):
    """The GEMV's (fused, paired) (M, 256) tables for x (M, K), K a multiple of 64; x's BF16 pairs into
    ``x_pairs`` where given (see pairs_of_x)."""
    kernel = PAIRING[fmt]
    x_reg = wo_layout._reorder(x.float(), *kernel.split).numpy()
    x_pairs = pairs_of_x(x) if x_pairs is None else x_pairs
    return wo_steps._exact_bytes(x_reg, kernel.exponents, kernel.pair_sources, x_pairs)


def pairs_of_x(x):
    """An empty array for the BF16 pairs of x (M, K)."""
    return np.empty((x.shape[0], -(-x.shape[1] // wo_steps.PAIR_LANES) * wo_steps.PAIR_LANES), dtype=np.int16)


def row_bytes(fmt, weight):
    """The scale bytes (0..255) that the rows of a packed weight use."""
    scales = weight[1] if fmt == "mxfp4" else weight[0]
    return scales.reshape(-1).unique().long()


@needs_bf16
@pytest.mark.parametrize("fmt", PAIRING)
@pytest.mark.parametrize("m, dtype", [(1, torch.bfloat16), (2, torch.bfloat16), (3, torch.bfloat16),
                                      (4, torch.bfloat16), (2, torch.float16)])
def test_bf16_pairs_give_the_reference_lane_sums(fmt, m, dtype):
    """Rows of x that are BF16 values may be summed in BF16 pairs (asserted; a lone row of x with MXFP4 weights
    is, on AMD Zen only), with Inf, -0 and NaN in x, and equal the reference lane by lane; K = 1152 (MXFP4: 36
    blocks, HiFloat4: 18); 2-4 rows of x: taken together where
    the format's kernels do (MXFP4; HiFloat4 in place takes its rows of x by fused pairs); FP16 x whose values
    are all BF16 values is paired too. Row 5 of W has a NaN block (scale byte 0xFF: MXFP4 takes it for the
    largest scale, so that block of four rows goes row by row; a poisoned HiFloat4 block is paired, its
    weights NaN)."""
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
    """The operator's self-check (its probes) includes a case summed in BF16 pairs on this CPU, so that a CPU
    whose vdpbf16ps added in another order would fail it: one row of x (MXFP4 off AMD Zen, which sums up to three
    rows with fused multiply-adds: four) paired with blocks of four weight rows and an even number of steps;
    that probe's result is the reference's."""
    op = OPS[fmt]
    rows = wo_gemv4._MXFP4_FUSED_X_ROWS + 1 if fmt == "mxfp4" else 1
    covered = False
    for x, *weight, bias in op.probes():
        steps = x.shape[-1] // cpu.LANES
        if (x.dtype != torch.bfloat16 or x.shape[0] != rows or weight[0].shape[0] < wo_steps.ROW_BLOCK
                or steps == 0 or steps % 2):
            continue
        _, paired = pair_and_fuse_tables(fmt, x)
        if paired[:, row_bytes(fmt, weight)].all():
            native_equals_reference(op, x, *weight, bias)
            covered = True
    assert covered


@numba.njit
def _mxfp4_one_x_pair_sums(x_pairs, scales, codes):
    """_mxfp4_pair_sums_bf16 on the four rows of (scales, codes) and row 0 of x_pairs."""
    blocks = scales.shape[1]
    operands = (scales.ravel(), codes.ravel(), np.uint64(0))
    starts = (0, blocks, 2 * blocks, 3 * blocks)
    return wo_gemv4._mxfp4_pair_sums_bf16(x_pairs.ravel(), 0, blocks // 4, operands, (), starts)


@numba.njit
def _mxfp4_fused_sums(x_reg, x_rows, scales, codes):
    """_mxfp4_fused_sums_x on the four rows of (scales, codes) and rows 1 .. x_rows of x_reg (row 0 left out)."""
    blocks = scales.shape[1]
    kp = x_reg.shape[1]
    y32 = np.full((x_reg.shape[0], 4), np.float32(-1.0))
    operands = (scales.ravel(), codes.ravel(), np.uint64(0))
    xs = (kp, 2 * kp, x_rows * kp)
    wo_gemv4._mxfp4_fused_sums_x(x_reg.ravel(), xs, x_rows, blocks // 2, operands,
                                 (0, blocks, 2 * blocks, 3 * blocks), y32, 1, 0)
    return y32


@pytest.mark.skipif(not wo_steps.BLOCK_ROWS, reason="blocks of rows need AVX-512")
@pytest.mark.parametrize("x_rows", [2, 3])
def test_mxfp4_fused_rows_of_x_equal_the_reference(x_rows):
    """The MXFP4 kernel of two or three rows of x with fused multiply-adds (each step decoded once for all), which
    AMD Zen CPUs never run, called directly on every CPU with blocks of rows: rows 1 .. x_rows of x with -0 against
    four rows of W, the reference's sums bit for bit, and the rows of y around them untouched."""
    g = gen(44 + x_rows)
    weight = mxfp4.quantize(torch.randn(4, 1024, generator=g))
    x = torch.randn(x_rows + 2, 1024, generator=g).bfloat16()
    x[1, 700], x[x_rows, 5] = -0.0, -0.0
    codes, scales = (t.numpy() for t in weight)
    x_reg = wo_layout._reorder(x.float(), *cpu.MXFP4_LINEAR.split).numpy()
    got = torch.from_numpy(_mxfp4_fused_sums(x_reg, x_rows, scales, codes))
    want = reference.lane_sums(x.float(), reference.mxfp4_weight(*weight))
    assert torch.equal(got[1:x_rows + 1].view(torch.int32), want[1:x_rows + 1].view(torch.int32))
    assert (got[0] == -1).all() and (got[x_rows + 1:] == -1).all()


@needs_bf16
def test_mxfp4_one_x_pair_sums_equal_the_reference():
    """The one-row MXFP4 pair kernel, which only AMD Zen CPUs run (others sum one row with fused multiply-adds),
    called directly on every CPU with the BF16 pairs: a row of x with -0 against four rows of W, the reference's
    sums bit for bit."""
    g = gen(43)
    weight = mxfp4.quantize(torch.randn(4, 1024, generator=g))
    x = torch.randn(1, 1024, generator=g).bfloat16()
    x[0, 700] = -0.0
    x_pairs = pairs_of_x(x)
    _, paired = pair_and_fuse_tables("mxfp4", x, x_pairs)
    assert paired[0, row_bytes("mxfp4", weight)].all()  # setup
    codes, scales = (t.numpy() for t in weight)
    got = torch.tensor(_mxfp4_one_x_pair_sums(x_pairs, scales, codes)).unsqueeze(0)
    want = reference.lane_sums(x.float(), reference.mxfp4_weight(*weight))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


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
    want = dense_weight(fmt, (codes, scales), torch.bfloat16).bfloat16()
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
    want = dense_weight(fmt, weight, torch.bfloat16).bfloat16()
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
