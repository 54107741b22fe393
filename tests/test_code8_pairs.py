"""HiFloat8 and FP8 E4M3 GEMV rows in BF16 pairs (lowbit.kernels.cpu.weight_only: code8_pairs, _code8_pairable;
docs/weight_only.md, 'Summation order' and 'Kernels'): the reference's bits wherever the pairs run, and the rows
they must not take (subnormal x or weights, flushed partial sums, extreme products, NaN codes) left to the
multiply-and-add path."""

import numpy as np
import pytest
import torch

from lowbit.formats import hifloat8
from lowbit.formats import weight_only as reference
from lowbit.kernels.cpu import _weight_only_decode8 as wo_decode8
from lowbit.kernels.cpu import _weight_only_gemv8 as wo_gemv8
from lowbit.kernels.cpu import _weight_only_layout as wo_layout
from lowbit.kernels.cpu import weight_only as cpu
from lowbit.ops import weight_only as ops
from lowbit.ops.library import PreparedCall

pytestmark = pytest.mark.skipif(not wo_decode8.CODE8_PAIRS, reason="no AVX512-BF16 with AVX512-VBMI on this CPU")

FORMATS = {"hifloat8": (ops.HIFLOAT8_LINEAR, cpu.HIFLOAT8_LINEAR, cpu._hifloat8_operands, reference.hifloat8_weight),
           "float8": (ops.FLOAT8_E4M3FN_LINEAR, cpu.FLOAT8_E4M3FN_LINEAR, cpu._float8_operands,
                      reference.float8_e4m3fn_weight)}
ALL_HIF8 = [c for c in range(256) if c != hifloat8.NAN_CODE]  # the infinities included
ALL_E4M3 = [c for c in range(256) if c & 0x7F != 0x7F]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def random_codes(n, k, g, codes):
    table = torch.tensor(codes, dtype=torch.uint8)
    return table[torch.randint(0, len(table), (n, k), generator=g)]


def gemv_sums(fmt, x, codes, scale):
    """The one-call GEMV's rows kernel's float32 sums (M, N) for BF16 x (one_call_gemv: a prepared weight's), with
    x's per-call operands as that call makes them, and whether each row of x may take pairs with the first block
    of W (_code8_pairable)."""
    _, kernel, operands_of, _ = FORMATS[fmt]
    m, k = x.shape
    operands = operands_of(codes, scale, k, torch.bfloat16)
    x_reg = np.empty((m, cpu._padded_k(k)), dtype=np.float32)
    cpu._gather_x(x.view(torch.int16).numpy(), True, kernel.order, x_reg)
    x_operands = kernel.x_operands(x_reg, operands, kernel.x_consts)
    y32 = np.empty((m, codes.shape[0]), dtype=np.float32)
    kernel.one_call_gemv[0](x_reg, *operands, *x_operands, 0, codes.shape[0], y32)
    x_bounds, x_pairs = x_operands
    scale_bits = operands[1].view(np.int32)
    paired = [bool(wo_gemv8._code8_pairable(x_bounds, x_pairs.shape[1], i, scale_bits, 0)) for i in range(m)]
    return torch.from_numpy(y32), paired


def assert_lane_sums(got, want):
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_pairs_give_the_reference_lane_sums_for_every_code(fmt, m):
    """Every code but the NaN one (HiFloat8's infinities too) at random in 13 rows (a block of four rows in pairs,
    the short last block row by row), K = 512: the float32 sums are the reference's bit for bit, every row of x
    summed in pairs (two rows of x together, _code8_pair_sums_two_x; an odd last one alone)."""
    g = gen(1)
    k = 512
    codes = random_codes(13, k, g, ALL_HIF8 if fmt == "hifloat8" else ALL_E4M3)
    scale = torch.rand(13, generator=g) * 1e-2 + 1e-3
    x = torch.randn(m, k, generator=g).bfloat16()
    got, paired = gemv_sums(fmt, x, codes, scale)
    assert all(paired)
    weight = FORMATS[fmt][3](codes, scale, torch.bfloat16).float()
    assert_lane_sums(got, reference.lane_sums(x.float(), weight))


@pytest.mark.parametrize("m, unpaired", [(3, 0), (3, 1), (3, 2), (5, 0), (5, 2), (5, 4)])
def test_a_row_of_x_outside_the_pairs_takes_its_partner_to_multiply_and_add(m, unpaired):
    """M = 3 or 5 where row ``unpaired`` of x holds a subnormal value (no pairs for it): four rows of x together
    in pairs where all four may be, else the pair of rows of x it belongs to by multiply and add and the other
    pairs in pairs; the reference's sums for all, and the HiFloat8 rows holding its NaN code sum to NaN for
    every row of x."""
    g = gen(8)
    k = 256
    codes = random_codes(8, k, g, [c for c in ALL_HIF8 if abs(hifloat8.code_value(c)) < float("inf")])
    codes[4, 17] = codes[5, 200] = hifloat8.NAN_CODE  # the two rows of W of one pair kernel call
    x = torch.randn(m, k, generator=g)
    x[unpaired, 3] = 2.0**-130
    got, paired = gemv_sums("hifloat8", x.bfloat16(), codes, torch.ones(8))
    assert paired == [i != unpaired for i in range(m)]
    assert got[:, 4:6].isnan().all() and not got[:, :4].isnan().any() and not got[:, 6:].isnan().any()
    weight = reference.hifloat8_weight(codes, torch.ones(8), torch.bfloat16).float()
    assert_lane_sums(got, reference.lane_sums(x.bfloat16().float(), weight))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("threads", [1, 2])
def test_a_prepared_weight_on_pairs_equals_the_reference(fmt, threads, monkeypatch):
    """A prepared weight's call (PreparedCall: the one-call GEMV, whose rows take the pairs; M = 1-4; 70
    rows: blocks and a tail) with x holding zeros, a -0 and values across BF16's range, and rows of extreme
    scales: the reference's bits on one thread and two (numba's threads from the smallest weight on)."""
    op = FORMATS[fmt][0]
    g = gen(2)
    k = 256
    codes = random_codes(70, k, g, ALL_HIF8 if fmt == "hifloat8" else ALL_E4M3)
    scale = torch.rand(70, generator=g) + 0.5
    scale[8:12] = 2.0**-100  # weights near the pairs' floor: that block by multiply and add
    scale[20:24] = 2.0**90
    prepared = PreparedCall(op, (codes, scale, None))
    monkeypatch.setattr(cpu, "GEMV_ONE_THREAD_WEIGHTS", 0)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in (1, 2, 3, 4):
            x = (torch.randn(m, k, generator=g) * 2.0 ** torch.randint(-30, 30, (m, k), generator=g)).bfloat16()
            x[:, :5] = torch.tensor([0.0, -0.0, 1.0, -3.5, 2.0**-20])
            got = prepared(x)
            want = op(x, codes, scale, None, backend="reference")
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), m
            got = op(x, codes, scale, None, backend="native")  # the direct call: rows without the pairs
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), m
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("code", [hifloat8.NAN_CODE, 0x00])
def test_a_hifloat8_nan_code_makes_its_row_nan_and_zero_does_not(code):
    """HiFloat8's NaN code (0x80) shares its table look-up with zero: the pairs keep the codes' smallest signed
    byte, and only a row holding 0x80 sums to NaN."""
    g = gen(3)
    codes = random_codes(4, 256, g, [c for c in ALL_HIF8 if abs(hifloat8.code_value(c)) < float("inf")])
    codes[2, 200] = code
    x = torch.randn(1, 256, generator=g).bfloat16()
    got, paired = gemv_sums("hifloat8", x, codes, torch.ones(4))
    assert paired == [True]
    assert got[0].isnan().tolist() == [False, False, code == hifloat8.NAN_CODE, False]
    weight = reference.hifloat8_weight(codes, torch.ones(4), torch.bfloat16).float()
    assert_lane_sums(got, reference.lane_sums(x.float(), weight))


@pytest.mark.parametrize("code", [0x7F, 0xFF, 0x80])
def test_float8_nan_codes_look_up_nan_and_minus_zero_is_zero(code):
    """FP8 E4M3's NaN codes (0x7F, 0xFF) are NaN in its table; 0x80 (-0) is a zero weight, not NaN."""
    g = gen(4)
    codes = random_codes(4, 128, g, ALL_E4M3)
    codes[1, 70] = code
    x = torch.randn(1, 128, generator=g).bfloat16()
    got, paired = gemv_sums("float8", x, codes, torch.ones(4))
    assert paired == [True]
    assert bool(got[0, 1].isnan()) == (code != 0x80)
    weight = reference.float8_e4m3fn_weight(codes, torch.ones(4), torch.bfloat16).float()
    assert_lane_sums(got, reference.lane_sums(x.float(), weight))


def test_a_partial_sum_below_the_normal_range_is_not_flushed():
    """Products 1.5 * 2^-126 and -2^-126 in one lane are normal, their sum 2^-127 is not: vdpbf16ps would flush it
    to zero. Products below 2^-103 keep such a row out of the pairs, so the sum is the reference's 2^-127."""
    codes = torch.zeros(4, 128, dtype=torch.uint8)  # FP8 +0
    codes[:, 0], codes[:, 64] = 0x44, 0x38  # 3.0 and 1.0: elements 0 and 64 share a lane
    scale = torch.full((4,), 2.0**-60)
    x = torch.zeros(1, 128)
    x[0, 0], x[0, 64] = 2.0**-67, -(2.0**-66)
    got, paired = gemv_sums("float8", x.bfloat16(), codes, scale)
    assert paired == [False]
    assert got[0].tolist() == [2.0**-127] * 4
    out = ops.FLOAT8_E4M3FN_LINEAR(x.bfloat16(), codes, scale, None, backend="native")
    assert torch.equal(out, torch.full((1, 4), 2.0**-127).bfloat16())


@pytest.mark.parametrize("case", ["subnormal x", "subnormal weights", "tiny products", "huge products"])
def test_rows_outside_the_pairs_range_take_multiply_and_add(case):
    """x with a subnormal value, weights whose scale makes them subnormal in BF16, products below 2^-103 and
    products that could reach 2^128, each where the other bounds hold: not paired, and the reference's bits
    by the other path."""
    g = gen(5)
    codes = random_codes(4, 128, g, [c for c in ALL_HIF8 if abs(hifloat8.code_value(c)) < float("inf")])
    x = torch.randn(1, 128, generator=g)
    scale = torch.ones(4)
    if case == "subnormal x":  # its products at least 2^-103 (the weights large): only x's own check; the only
        x = torch.zeros(1, 128)  # nonzero x, so that a flushed x shows in every sum
        x[0, 9] = 2.0**-130  # (its exponent bound counts as -149: _x_exponents)
        scale[:] = 2.0**70
        codes[:, 9] = 0x38  # HiFloat8 1.0: a nonzero weight
    elif case == "subnormal weights":  # HiFloat8's smallest magnitude 2^-22 times the scale: 2^-132, products
        scale[:] = 2.0**-110  # of it with x at least 2^-102: only the weights' own check
        x = x.sign() * 2.0**40
    elif case == "tiny products":
        x *= 2.0**-90
    else:
        x *= 2.0**100
        scale[:] = 2.0**20
    x = x.bfloat16()
    got, paired = gemv_sums("hifloat8", x, codes, scale)
    assert paired == [False]
    weight = reference.hifloat8_weight(codes, scale, torch.bfloat16).float()
    assert_lane_sums(got, reference.lane_sums(x.float(), weight))


@pytest.mark.parametrize("k", [192, 320])
def test_k_not_a_multiple_of_a_pair_step_makes_no_pairs(k):
    g = gen(6)
    codes = random_codes(8, k, g, ALL_E4M3)
    x = torch.randn(1, k, generator=g).bfloat16()
    got, paired = gemv_sums("float8", x, codes, torch.ones(8))
    assert paired == [False]
    weight = reference.float8_e4m3fn_weight(codes, torch.ones(8), torch.bfloat16).float()
    assert_lane_sums(got, reference.lane_sums(x.float(), weight))


def test_fp16_x_makes_no_pairs():
    """FP16 x looks its weights up in FP16 byte tables: no pairs made (x_pairs without columns)."""
    g = gen(7)
    codes = random_codes(4, 128, g, ALL_E4M3)
    operands = cpu._float8_operands(codes, torch.ones(4), 128, torch.float16)
    x_reg = np.zeros((1, 128), dtype=np.float32)
    kernel = cpu.FLOAT8_E4M3FN_LINEAR
    assert kernel.x_operands(x_reg, operands, kernel.x_consts)[1].shape == (1, 0)


def test_the_pair_order_folds_as_the_reference():
    """CODE8_PAIR_ORDER is a permutation of a step's 64 elements, and x's pair sources put element e of step
    t + 1 in the even word and of step t in the odd word of lane e's pair (_pair_sources)."""
    assert sorted(cpu.CODE8_PAIR_ORDER) == list(range(64))
    sources = cpu._pair_sources(wo_layout.CODE8_ORDER, cpu.CODE8_PAIR_ORDER)
    for register in range(2):
        for lane in range(32):
            element = cpu.CODE8_PAIR_ORDER[32 * register + lane]
            even, odd = sources[64 * register + 2 * lane], sources[64 * register + 2 * lane + 1]
            assert (even - 64, odd) == (wo_layout.CODE8_ORDER.index(element),) * 2


def test_the_direct_call_compiles_no_pairs():
    """The operator's direct call (as in ``lowbit smoke``) runs rows without the pairs' code and makes no x pairs
    (compile time of a first call); the one call of a prepared weight runs the paired rows."""
    for kernel in (cpu.HIFLOAT8_LINEAR, cpu.FLOAT8_E4M3FN_LINEAR):
        assert kernel.gemv[0] is cpu._code8_rows and kernel.one_call_gemv[0] is cpu._code8_rows_paired
        operands = cpu._float8_operands(torch.zeros(4, 128, dtype=torch.uint8), torch.ones(4), 128, torch.bfloat16)
        x_reg = np.zeros((1, 128), dtype=np.float32)
        assert kernel.direct_x_operands(x_reg, operands, kernel.x_consts)[1].shape == (1, 0)
        assert kernel.x_operands(x_reg, operands, kernel.x_consts)[1].shape == (1, 128)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_lone_row_with_nan_inf_and_a_strided_x_on_pairs(fmt):
    """A prepared weight's lone row of x holding NaN, +-Inf, -0 and +-2^100 (no subnormal, no product that could
    overflow: the row stays in the pairs), given as a non-contiguous view: the reference's bits (canonical NaN
    where a NaN or Inf times zero meets the sums)."""
    op = FORMATS[fmt][0]
    g = gen(8)
    k = 256
    codes = random_codes(8, k, g, ALL_HIF8 if fmt == "hifloat8" else ALL_E4M3)
    codes[5] = 0x00  # a row of zeros: Inf times 0 is NaN there
    scale = torch.rand(8, generator=g) * 1e-3 + 1e-4
    x = torch.randn(1, k, generator=g)
    x[0, :6] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 2.0**100, -(2.0**100)])
    for nan in (float("nan"), 0.0):  # with the NaN; then the infinities and extremes alone
        row = x.clone()
        row[0, 0] = nan
        row = row.bfloat16()
        strided = torch.stack([row, -row], dim=-1)[..., 0]
        assert not strided.is_contiguous()
        assert gemv_sums(fmt, row, codes, scale)[1] == [True]
        got = PreparedCall(op, (codes, scale, None))(strided)
        want = op(strided.contiguous(), codes, scale, None, backend="reference")
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
