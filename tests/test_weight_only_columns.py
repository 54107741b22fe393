"""8-bit codes re-encoded by columns (prepared BF16-x HiFloat8 / FP8 weights on AVX2 CPUs, MXFP8's column
tables): the same bits as the table decode."""

import math

import numpy as np
import pytest
import torch

from lowbit.formats import hifloat8, mxfp8
from lowbit.formats import weight_only as reference
from lowbit.kernels.cpu import _code8_columns as columns
from lowbit.kernels.cpu import _weight_only_gemv8 as wo_gemv8
from lowbit.kernels.cpu import _weight_only_layout as wo_layout
from lowbit.kernels.cpu import _weight_only_steps as wo_steps
from lowbit.kernels.cpu import weight_only as cpu
from lowbit.kernels.cpu._runtime import run_tasks
from lowbit.ops import weight_only as ops
from lowbit.ops.library import PreparedCall

from weight_only_cases import FINITE_E4M3, FINITE_HIF8, assert_bits, bits, gen


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
    """A prepared HiFloat4 weight (on AVX2 CPUs: its scale words and value bytes rearranged; on CPUs with the
    BF16 pairs: its magnitude indices and signs beside it, _hifloat4_prepared_operands) of every E6M2 byte
    (0xFF: a poisoned block, NaN row), random and extreme flag patterns (none set, all set), rows of one narrow
    scale range (fused multiply-adds) and of wide ones: its float32 sums equal the reference's lane sums
    (_check_prepared_rows: x specials, non-contiguous x, two threads); at M = 1-4 (GEMV), 9 (batched) and 300
    (GEMM path) it gives the operator's bits for BF16 and FP16 x."""
    g = gen(71)
    n, k = 48, 2048  # 32 blocks a row: _low_byte_range's vector loop reads the prepared words
    scale = torch.randint(0, 256, (n, k // 64, 4), generator=g, dtype=torch.uint8)
    scale[:32, :8, 0] = torch.arange(256, dtype=torch.uint8).reshape(32, 8)[torch.randperm(32, generator=g)]
    scale[32:, :, 0] = torch.randint(0x70, 0x78, (16, k // 64), generator=g, dtype=torch.uint8)
    scale[40, :, 1:], scale[41, :, 1:] = 0x00, 0xFF  # no level flag set; every one
    value = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    if cpu.BYTE_SHUFFLE_NIBBLES:
        words, values, _, _ = cpu.HIFLOAT4_LINEAR.prepare(torch.bfloat16, k, scale, value, None)[0]
        assert words.dtype == np.uint32 and values.shape == value.shape
        low = scale[..., 0].numpy()
        for row in (0, 5, 40):  # the E6M2 range of a row, as the GEMV's choice of the fused path reads it
            got = wo_steps._low_byte_range(words.reshape(-1), row * (k // 64), k // 64)
            assert got == (low[row].min(), low[row].max())
    if cpu._HIFLOAT4_PAIRS:  # the sums below go by magnitude index
        codes, signs = cpu.HIFLOAT4_LINEAR.prepare(torch.bfloat16, k, scale, value, None)[0][2:]
        assert codes.shape == value.shape and signs.shape == (n, k // 32)
    x = torch.randn(3, k, generator=g).bfloat16()
    prepared = PreparedCall(ops.HIFLOAT4_LINEAR, (scale, value, None))
    _check_prepared_rows(prepared, cpu.HIFLOAT4_LINEAR, x, (scale, value), reference.hifloat4_weight(scale, value),
                         monkeypatch)
    for dtype in (torch.bfloat16, torch.float16):
        for m in (1, 2, 3, 4, 9, 300):
            x = torch.randn(m, k, generator=g).to(dtype)
            assert_bits(prepared(x), ops.HIFLOAT4_LINEAR(x, scale, value, None, backend="native"))
