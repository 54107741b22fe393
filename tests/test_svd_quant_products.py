"""svd_quant's MXFP4 x MXFP4 integer-dot GEMV (decode): its SIMD steps, exactness where it runs, the rows
it leaves to the float32 kernel, tails, threads, and the operator's results through it."""

import math

import numba
import numpy as np
import pytest
import torch

import lowbit.ops.svd_quant as op
from lowbit.formats import mxfp4
from lowbit.formats import svd_quant as ref
from lowbit.kernels.cpu import _block_sums
from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu import svd_quant as cpu_backend
from lowbit.kernels.cpu import weight_only
from lowbit.kernels.cpu._runtime import bound_njit
from lowbit.kernels.cpu.weight_only import MXFP4_LINEAR
from helpers import simd_binary

needs_integer_products = pytest.mark.skipif(not cpu_backend.INTEGER_PRODUCTS,
                                            reason="the integer products need AVX512-VNNI or AVX2")


def gen(seed):
    return torch.Generator().manual_seed(seed)


# ---- SIMD steps -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("lowering", ["portable", "avx512", "avx2"])
def test_shuffle_bytes_every_index_in_every_piece(lowering):
    if lowering == "avx512" and not simd.HAS_AVX512BW or lowering == "avx2" and not simd.HAS_AVX2:
        pytest.skip(f"no {lowering} on this CPU")
    shuffle = {"portable": simd.shuffle_bytes_portable, "avx512": simd.shuffle_bytes_avx512,
               "avx2": simd.shuffle_bytes_avx2}[lowering]
    run = simd_binary(shuffle, simd.i32v_load, simd.i32v_load, simd.i32v_store)
    table = np.random.default_rng(0).integers(0, 256, 128, dtype=np.uint8)
    for shift in (0, 1):
        index = ((np.arange(128) * 5 + shift) % 256).astype(np.uint8)  # top bit set in half of them
        out = np.empty(32, dtype=np.int32)
        run(table.view(np.int32), index.view(np.int32), out)
        piece = np.arange(128) // 16
        want = np.where(index >= 128, 0, table[16 * piece + (index & 15)])
        assert np.array_equal(out.view(np.uint8), want)


@pytest.mark.parametrize("lowering", ["portable", "vnni", "avx2"])
def test_dpbusd_rows_is_the_unsigned_by_signed_dot(lowering):
    if lowering == "vnni" and not simd.HAS_VNNI or lowering == "avx2" and not simd.HAS_AVX2:
        pytest.skip(f"no {lowering} on this CPU")
    dpbusd = {"portable": simd.dpbusd_rows_portable, "vnni": simd.dpbusd_rows_vnni,
              "avx2": simd.dpbusd_rows_avx2}[lowering]

    @numba.njit
    def run(acc, w, a, out):
        simd.i32v_store(out, 0, dpbusd(simd.i32v_load(acc, 0), simd.i32v_load(w, 0), a, 3))

    rng = np.random.default_rng(1)
    acc = rng.integers(-2**20, 2**20, 32, dtype=np.int32)
    w = rng.integers(0, 128 if lowering == "avx2" else 256, 128, dtype=np.uint8)  # AVX2: w bytes <= 127
    w[:4] = 127 if lowering == "avx2" else 255
    a = rng.integers(-128, 128, 131, dtype=np.int8)
    a[3:7] = -128
    out = np.empty(32, dtype=np.int32)
    run(acc, w.view(np.int32), a, out)
    want = acc + (w.astype(np.int64) * a[3:].astype(np.int64)).reshape(32, 4).sum(axis=1)
    assert np.array_equal(out, want)


def test_spread_bytes_and_powers_of_two():
    @numba.njit
    def run(scales, out):
        exponent = simd.spread_bytes4(scales, 1)
        simd.f32v_store(out, 0, simd.f32v_power_of_two(exponent))

    scales = np.array([9, 0, 1, 127, 128, 254, 3, 200, 100, 7], dtype=np.uint8)
    out = np.empty(32, dtype=np.float32)
    run(scales, out)
    fields = np.repeat(scales[1:9].astype(np.int64), 4)
    assert np.array_equal(out, np.where(fields == 0, 0.0, np.exp2(fields - 127.0)).astype(np.float32))


needs_block_sums = pytest.mark.skipif(not (simd.HAS_AVX2 and simd.NARROW == _block_sums.BLOCKS),
                                      reason="the block sums need AVX2 with 8-lane F32N (no AVX-512)")


@numba.njit
def _block_sums_of(codes, low, high, x0, start, b0, out):
    table = simd.i32v_load(cpu_backend._WEIGHT_BYTES, 0)
    simd.f32n_store(out, 0, _block_sums.block_sums(table, simd.i32v_load(codes, 0), low, high, x0, start, b0))


@needs_block_sums
def test_block_sums_are_each_blocks_exact_dot():
    """Each of the 8 blocks: start + sum over its 32 elements of (2 cw + 12)(2 cx), in block order, for random
    code bytes, the largest sums of either sign (every weight 6, every activation +-6: 32 * 288 = 9216 before
    the start) and mixed extremes; the activation bytes read at an offset x0, the starts at b0."""
    rng = np.random.default_rng(11)
    weight_bytes = cpu_backend._WEIGHT_BYTES[:16].astype(np.int64)  # code -> 2 cw + 12
    cases = [(rng.integers(0, 256, 128, dtype=np.uint8), rng.integers(-12, 13, (2, 128), dtype=np.int8))
             for _ in range(50)]
    for sign in (1, -1):
        cases.append((np.full(128, 0x77, dtype=np.uint8), np.full((2, 128), 12 * sign, dtype=np.int8)))
    mixed = np.where(np.arange(128) % 3 == 0, 0xFF, 0x77).astype(np.uint8)  # -6 and 6
    cases.append((mixed, np.where(np.arange(128) % 2 == 0, 12, -12).astype(np.int8)[None].repeat(2, 0)))
    for codes, (x_even, x_odd) in cases:
        x0, b0 = rng.integers(0, 40, 2)
        low, high = (np.concatenate([np.zeros(x0, np.int8), x, np.ones(3, np.int8)]) for x in (x_even, x_odd))
        start = rng.integers(-5000, 5000, b0 + 8, dtype=np.int32)
        out = np.empty(8, dtype=np.float32)
        _block_sums_of(codes.view(np.int32), low, high, x0, start, b0, out)
        products = (weight_bytes[codes & 15] * x_even.astype(np.int64)
                    + weight_bytes[codes >> 4] * x_odd.astype(np.int64))
        want = start[b0:].astype(np.int64) + products.reshape(8, 16).sum(axis=1)
        assert np.array_equal(out, want.astype(np.float32))


@numba.njit
def _block_powers_of(scale_codes, s0, count, field, b0, out, first):
    if first:
        simd.f32n_store(out, 0, _block_sums.block_powers_first(scale_codes, s0, count, field, b0))
    else:
        simd.f32n_store(out, 0, _block_sums.block_powers(scale_codes, s0, field, b0))


@needs_block_sums
@pytest.mark.parametrize("count", [None, 0, 1, 5, 8])
def test_block_powers_of_the_scale_bytes_and_fields(count):
    """2 ** (scale byte + field - 127) per block, for scale bytes over their range and fields that bring the
    sum to 0..254 (0: +0.0); the masked form takes the bytes past ``count`` as 0 (the byte after the 8 is
    0xFF)."""
    scale_codes = np.array([200, 0, 1, 127, 128, 254, 3, 200, 100, 0xFF], dtype=np.uint8)
    field = np.array([9, 0, 0, 0, 126, 0, 5, 54, 1, 77], dtype=np.int32)
    out = np.zeros(8, dtype=np.float32)
    _block_powers_of(scale_codes, 1, 0 if count is None else count, field, 1, out, count is not None)
    taken = np.where(np.arange(8) < (8 if count is None else count), scale_codes[1:9], 0)
    exponent = taken.astype(np.int64) + field[1:9]
    if count is None:
        assert exponent.min() == 0 and exponent.max() == 254  # +0.0 and the largest power
    assert np.array_equal(out, np.where(exponent == 0, 0.0, np.exp2(exponent - 127.0)).astype(np.float32))


# ---- the GEMV -----------------------------------------------------------------------------------------


def quantized(rows, k, g, spread=0):
    """Uniform data with per-element exponents spread by up to 2^spread, MXFP4-quantized as svd_quant's
    activation: (codes, scales, exact float64 values)."""
    values = (torch.rand(rows, k, generator=g, dtype=torch.float64) * 20 - 10)
    if spread:
        values = values * torch.exp2(torch.randint(-spread, spread + 1, (rows, k), generator=g).double())
    codes, scales = ref.quantize_activation(values.to(torch.bfloat16))
    return codes, scales, mxfp4.dequantize(codes, scales, torch.float64)


def run_gemv(x_codes, x_scales, w_codes, w_scales, serial=False):
    """(y32, fallback flags) of cpu_backend.product_gemv (its parallel loop, or its serial version)."""
    k = 2 * x_codes.shape[1]
    kp = -(-k // cpu_backend.STEP) * cpu_backend.STEP
    operands = cpu_backend.activation_operands(x_codes.numpy(), x_scales.numpy(), kp)
    y32 = np.full((x_codes.shape[0], w_codes.shape[0]), np.nan, dtype=np.float32)
    fallback = np.zeros(w_codes.shape[0], dtype=np.uint8)
    count = cpu_backend.product_gemv(*operands, w_codes.contiguous().numpy(), w_scales.contiguous().numpy(), y32,
                                     fallback, serial=serial)
    assert count == fallback.sum()
    return torch.from_numpy(y32).double(), fallback.astype(bool)


@pytest.mark.parametrize("m, k", [(1, 32), (3, 96), (4, 2080)])
def test_quantized_operands_are_the_quantizer_codes_and_their_operands(m, k):
    x = (torch.randn(m, k, generator=gen(k)) * 9).to(torch.bfloat16)
    x[0, 1] = float("nan")
    pairs = x.view(torch.int32).reshape(-1).numpy().view(np.uint32)
    kp = -(-k // cpu_backend.STEP) * cpu_backend.STEP
    *operands, codes, scales = cpu_backend.quantized_operands(pairs, m, kp, *cpu_backend._BF16_QUANTIZER)
    want_codes, want_scales = ref.quantize_activation(x)
    assert torch.equal(torch.from_numpy(codes), want_codes) and torch.equal(torch.from_numpy(scales), want_scales)
    for got, want in zip(operands, cpu_backend.activation_operands(want_codes.numpy(), want_scales.numpy(), kp)):
        assert np.array_equal(got, want)


@needs_integer_products
@pytest.mark.parametrize("m, n, k", [(1, 1, 32), (1, 13, 96), (2, 9, 256), (3, 17, 288), (4, 40, 544), (1, 24, 2080)])
def test_exact_when_the_sums_are_exact(m, n, k):
    """Inputs whose float32 sums are all exact (few significant bits, one exponent range): the same values
    as the float64 product, at every tail length of K."""
    g = gen(k)
    x_codes, x_scales, x = quantized(m, k, g)
    w_codes, w_scales, w = quantized(n, k, g)
    y, fallback = run_gemv(x_codes, x_scales, w_codes, w_scales)
    assert not fallback.any()
    assert torch.equal(y, x @ w.T)


@needs_integer_products
@pytest.mark.parametrize("k", [96, 288])
def test_a_short_last_step_reads_nothing_of_the_next_row(k):
    """K not a multiple of the 256-element step: a row's last step reads only its own code and scale bytes
    (masked loads). The next row here has NaN scale bytes (0xFF) and codes of 0xFF: read as part of row 0's
    last step, they would turn its zero products into NaN."""
    g = gen(300 + k)
    x_codes, x_scales, x = quantized(1, k, g)
    w_codes, w_scales, w = quantized(2, k, g)
    w_codes[1], w_scales[1] = 0xFF, 0xFF  # row 1 falls back; row 0 is computed by the integer GEMV
    y, fallback = run_gemv(x_codes, x_scales, w_codes, w_scales)
    assert fallback.tolist() == [False, True]
    assert torch.equal(y[:, 0], (x @ w[:1].T)[:, 0])


@needs_integer_products
@pytest.mark.parametrize("seed", range(4))
def test_within_the_summation_bound_for_wide_exponents(seed):
    """Values spread over 2^-30 .. 2^30: only the float32 summation order may differ from the exact product,
    |y - P| <= (K/8) 2^-24 sum |products|."""
    g = gen(100 + seed)
    m, n, k = 1 + seed % 4, 31, 1024 + 32 * seed
    x_codes, x_scales, x = quantized(m, k, g, spread=30)
    w_codes, w_scales, w = quantized(n, k, g, spread=30)
    y, fallback = run_gemv(x_codes, x_scales, w_codes, w_scales)
    assert not fallback.any()
    exact = x @ w.T
    assert ((y - exact).abs() <= k / 8 * 2.0**-24 * (x.abs() @ w.abs().T)).all()


@needs_integer_products
def test_rows_outside_the_safe_range_are_left_to_the_float_kernel():
    """NaN blocks (0xFF), weights that overflow (0xFD: 6 * 2^126), scales too small for normal products, and
    sums that could overflow are flagged; the other rows are computed; a NaN/Inf block of x flags every row."""
    g = gen(7)
    k = 64
    x_codes, x_scales, _ = quantized(1, k, g)
    w_codes, w_scales, _ = quantized(6, k, g)
    w_codes[:] = 0x22  # every element 1.0: no zero block
    x_codes[:] = 0x22
    x_scales[:] = 100  # 2^-27
    w_scales[0, 1] = 0xFF  # NaN block
    w_scales[1, 0] = 253  # 6 * 2^126 overflows float32
    w_scales[2, 0] = 252  # the largest finite weights
    w_scales[3, 0] = 29  # 2^(-27 + 29 - 127 - 2) = 2^-127: below the normal range
    w_scales[4, 0] = 30  # 2^-126, the smallest normal power of two
    _, fallback = run_gemv(x_codes, x_scales, w_codes, w_scales)
    assert fallback.tolist() == [True, True, False, True, False, False]
    big = torch.full_like(x_scales, 200)  # with weight byte 252 a sum could overflow, with about 128 not
    _, fallback = run_gemv(x_codes, big, w_codes, w_scales)
    assert fallback[2] and not fallback[4] and not fallback[5]
    nan_block = x_scales.clone()
    nan_block[0, 1] = 0xFF
    _, fallback = run_gemv(x_codes, nan_block, w_codes, w_scales)
    assert fallback.all()


@needs_integer_products
def test_zero_activation_needs_only_finite_weights():
    g = gen(8)
    w_codes, w_scales, w = quantized(3, 96, g)
    w_scales[0, 2] = 0  # tiny, but x is zero: every product is zero
    w_scales[1, 0] = 0xFF
    zeros = torch.zeros(1, 96, dtype=torch.bfloat16)
    x_codes, x_scales = ref.quantize_activation(zeros)
    y, fallback = run_gemv(x_codes, x_scales, w_codes, w_scales)
    assert fallback.tolist() == [False, True, False]
    assert (y[0, [0, 2]] == 0).all()


@needs_integer_products
def test_thread_count_does_not_change_the_bits():
    """The serial version, and the parallel loop on one thread and on all: the same bits."""
    g = gen(9)
    x_codes, x_scales, _ = quantized(2, 512, g, spread=20)
    w_codes, w_scales, _ = quantized(300, 512, g, spread=20)
    previous = numba.get_num_threads()
    try:
        serial, _ = run_gemv(x_codes, x_scales, w_codes, w_scales, serial=True)
        numba.set_num_threads(1)
        one, _ = run_gemv(x_codes, x_scales, w_codes, w_scales)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        many, _ = run_gemv(x_codes, x_scales, w_codes, w_scales)
    finally:
        numba.set_num_threads(previous)
    assert torch.equal(serial, one) and torch.equal(one, many)


@pytest.mark.skipif(not cpu_backend.BLOCK_SUMS, reason="compares the lane path with the block sums on one CPU")
@pytest.mark.parametrize("spread", [0, 30])
def test_lane_path_agrees_with_the_block_sums(spread):
    """The 32-lane step (vpmaddubsw then vpmaddwd per 4 elements, each lane scaled: what AVX-512 CPUs without
    VNNI run) compiled here beside the block sums: the same rows left to the float32 kernel, the exact products
    where every sum is exact, both within the summation bound where exponents spread over 2^-30 .. 2^30."""
    lanes = {"_LANE_ELEMENTS": 8, "_BLOCK_LANES": 4}
    lane_operands = bound_njit(cpu_backend.activation_operands.py_func, "activation_operands_by_lanes", **lanes)
    lane_gemv = bound_njit(cpu_backend.product_gemv.serial.py_func, "product_gemv_by_lanes", **lanes,
                           _zero_sums=simd.f32v_zero, _step=cpu_backend._lane_step,
                           _last_step=cpu_backend._last_lane_step)
    g = gen(21 + spread)
    m, n, k = 2, 37, 1056
    x_codes, x_scales, x = quantized(m, k, g, spread)
    w_codes, w_scales, w = quantized(n, k, g, spread)
    w_scales[3, 5] = 0xFF  # a flagged row
    y_blocks, flagged = run_gemv(x_codes, x_scales, w_codes, w_scales)
    kp = -(-k // cpu_backend.STEP) * cpu_backend.STEP
    y_lanes = np.full((m, n), np.nan, dtype=np.float32)
    fallback = np.zeros(n, dtype=np.uint8)
    lane_gemv(*lane_operands(x_codes.numpy(), x_scales.numpy(), kp), w_codes.numpy(), w_scales.numpy(), y_lanes,
              fallback)
    assert np.array_equal(fallback.astype(bool), flagged) and flagged.sum() == 1
    computed = torch.from_numpy(~flagged)
    exact, bound = x @ w.T, k / 8 * 2.0**-24 * (x.abs() @ w.abs().T)
    for y in (y_blocks, torch.from_numpy(y_lanes).double()):
        if spread == 0:
            assert torch.equal(y[:, computed], exact[:, computed])
        assert ((y - exact).abs()[:, computed] <= bound[:, computed]).all()


# ---- svd_quant through it -------------------------------------------------------------------------------


@needs_integer_products
@pytest.mark.parametrize("m, n, k", [(1, 40, 96), (2, 33, 288), (4, 64, 2080)])
def test_svd_quant_decode_with_flagged_rows_agrees_with_the_reference(m, n, k):
    """Integer rows and float32 rows in one call: bf16(P) of each row as the float32 weight-only kernel
    computes it, within the operator's tolerance of the reference."""
    x, w, s, d, u = op.probe_inputs(m, n, k, 8, seed=k)
    pairs = s.clone().view(n, -1)
    pairs[3, 0] = 0xFF  # a NaN block: a flagged row
    pairs[5, 0] = 1  # tiny: flagged
    s = pairs.view_as(s)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    cpu_backend.SVD_QUANT.run(x, w, s, d, u, out=out)
    want = ref.svd_quant(x, w, s, d, u)
    assert op.agrees(out, want)
    assert out[:, 3].isnan().all()
    x_deq = mxfp4.dequantize(*ref.quantize_activation(x), torch.bfloat16)
    product = torch.empty(m, 1, dtype=torch.bfloat16)
    MXFP4_LINEAR.run(x_deq, w[5:6], ref.weight_scales(s, k)[5:6].contiguous(), None, out=product)
    assert torch.equal(out[:, 5], product[:, 0] + ((x @ d) @ u)[:, 5])


@needs_integer_products
@pytest.mark.parametrize("case", ["plain", "flagged row", "NaN in x", "Inf in d"])
def test_decode_forms_give_the_same_bits(monkeypatch, case):
    """The decode by product_gemv's serial form, its parallel loop on one thread and on numba's threads (each
    picked by the weight-count thresholds), each in one numba call (a prepared weight) and as three (the
    operator's direct call): the same bits, with and without rows left to the float32 kernel (a NaN weight
    block; every row for a NaN in x) and with the low-rank branch left to torch (an Inf in d)."""
    m, n, k = 2, 300, 544
    x, w, s, d, u = op.probe_inputs(m, n, k, 8, seed=12)
    if case == "flagged row":
        s.view(n, -1)[7, 0] = 0xFF
    elif case == "NaN in x":
        x[1, 5] = float("nan")
    elif case == "Inf in d":
        d[3, 2] = float("inf")
    prepared = cpu_backend.SVD_QUANT.prepare(x.dtype, k, w, s, d, u)
    outs = []
    for serial_below, one_thread_below in ((1 << 40, 1 << 40), (0, 1 << 40), (0, 0)):
        monkeypatch.setattr(cpu_backend, "_PRODUCT_SERIAL_WEIGHTS", serial_below)
        monkeypatch.setattr(cpu_backend, "_PRODUCT_ONE_THREAD_WEIGHTS", one_thread_below)
        for one_call in (False, True):
            out = torch.empty(m, n, dtype=torch.bfloat16)
            if one_call:
                cpu_backend.SVD_QUANT.run_prepared(x, prepared, out=out)
            else:
                cpu_backend.SVD_QUANT.run(x, w, s, d, u, out=out)
            outs.append(out)
    assert op.agrees(outs[0], ref.svd_quant(x, w, s, d, u))
    assert outs[0][:, 7].isnan().all() == (case == "flagged row") and outs[0][1].isnan().all() == (case == "NaN in x")
    assert all(torch.equal(o.view(torch.int16), outs[0].view(torch.int16)) for o in outs[1:])


# ---- the low-rank branch and the final add at decode -------------------------------------------------


def low_rank_call(x, d, u, products):
    """(returned flag, out) of add_low_rank on BF16 tensors, P = ``products`` (BF16 values as float32); out
    starts as a copy of ``products``."""
    out = products.clone()
    ok = cpu_backend.add_low_rank(x.view(torch.int16).numpy(), d.view(torch.int16).numpy(),
                                  u.view(torch.int16).numpy(), products.float().numpy(), out.view(torch.int16).numpy())
    return ok, out


@pytest.mark.parametrize("m, k, r, n", [(1, 64, 8, 40), (2, 96, 32, 33), (4, 2048, 40, 70), (3, 32, 1, 1)])
def test_low_rank_is_the_bf16_matmuls_where_their_sums_are_exact(m, k, r, n):
    """Small integers: every float32 sum is exact in any order, so the result is torch's, bit for bit
    (T and L each rounded to BF16, then bf16(L + P)), at every column tail."""
    g = gen(k + r)

    def ints(*shape, bound=3):
        return torch.randint(-bound, bound + 1, shape, generator=g).to(torch.bfloat16)

    x, d, u, products = ints(m, k), ints(k, r), ints(r, n), ints(m, n, bound=100)
    ok, out = low_rank_call(x, d, u, products)
    assert ok
    assert torch.equal(out, products + (x @ d) @ u)


def test_low_rank_agrees_with_torch_on_random_data():
    g = gen(3)
    x, d, u = (torch.randn(*shape, generator=g).to(torch.bfloat16) for shape in ((2, 512), (512, 32), (32, 96)))
    products = torch.randn(2, 96, generator=g).to(torch.bfloat16)
    ok, out = low_rank_call(x, d, u, products)
    assert ok
    assert op.agrees(out, products + (x @ d) @ u)


@pytest.mark.parametrize("where", ["x", "d", "u"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 3e38])
def test_low_rank_leaves_non_finite_or_overflowing_inputs_to_torch(where, value):
    """NaN/Inf inputs, or sums that could overflow (where the order of the sums decides the result): the
    kernel declines and leaves out unchanged."""
    g = gen(4)
    tensors = {"x": torch.randn(1, 64, generator=g), "d": torch.randn(64, 8, generator=g),
               "u": torch.randn(8, 16, generator=g)}
    tensors = {name: t.to(torch.bfloat16) for name, t in tensors.items()}
    tensors[where][0, 1] = value
    products = torch.randn(1, 16, generator=g).to(torch.bfloat16)
    ok, out = low_rank_call(tensors["x"], tensors["d"], tensors["u"], products)
    assert not ok and torch.equal(out, products)


@pytest.mark.parametrize("where, scale", [("x", 1e-39), ("d", 1e-39), ("u", 1e-39), ("x", 1e-20), ("u", 1e-37)])
def test_low_rank_leaves_subnormal_values_and_products_to_torch(where, scale):
    """Subnormal inputs (1e-39), or products that can be subnormal (x d with x ~ d ~ 1e-20; T u with
    u ~ 1e-37): torch's BF16 GEMM treats those as zero for some shapes, so the kernel declines."""
    g = gen(5)
    tensors = {"x": torch.randn(1, 64, generator=g), "d": torch.randn(64, 8, generator=g),
               "u": torch.randn(8, 16, generator=g)}
    if scale == 1e-20:
        tensors["d"] *= scale
    tensors[where] *= scale
    tensors = {name: t.to(torch.bfloat16) for name, t in tensors.items()}
    products = torch.randn(1, 16, generator=g).to(torch.bfloat16)
    ok, out = low_rank_call(tensors["x"], tensors["d"], tensors["u"], products)
    assert not ok and torch.equal(out, products)


def test_low_rank_of_rank_zero_is_zero():
    g = gen(6)
    x, d, u = torch.randn(2, 64, generator=g).to(torch.bfloat16), torch.empty(64, 0, dtype=torch.bfloat16), \
        torch.empty(0, 9, dtype=torch.bfloat16)
    products = torch.randn(2, 9, generator=g).to(torch.bfloat16)
    ok, out = low_rank_call(x, d, u, products)
    assert ok and torch.equal(out, products + (x @ d) @ u)


@pytest.mark.parametrize("case", ["subnormal d", "subnormal products", "rank 0"])
def test_svd_quant_decode_low_rank_edge_cases_match_the_reference(case):
    """The operator at decode against the reference where torch's GEMM may flush subnormals (K = 2080, two
    rows: a shape where it does on CPUs with AVX512-BF16), and with R = 0."""
    m, n, k, r = 2, 8, 2080, 0 if case == "rank 0" else 8
    x, w, s, d, u = op.probe_inputs(m, n, k, r, seed=7)
    if case == "subnormal d":
        d, u = torch.full_like(d, 1e-39), torch.full_like(u, 3e38)
    elif case == "subnormal products":
        x, d, u = (x * 1e-21).to(torch.bfloat16), torch.full_like(d, 1e-20), torch.full_like(u, 3e38)
    got = op.svd_quant(x, w, s, d, u, backend="native")
    assert torch.equal(got, op.svd_quant(x, w, s, d, u, backend="reference"))


@pytest.mark.parametrize("tile_bytes", [1, 3 * 2 * 128, 1 << 30])  # one row, 3 rows (a short last tile), all
def test_prefill_tiles_of_the_dequantized_weight(monkeypatch, tile_bytes):
    monkeypatch.setattr(weight_only, "GEMM_TILE_BYTES", tile_bytes)
    x, w, s, d, u = op.probe_inputs(9, 10, 96, 8, seed=5)
    out = torch.empty(9, 10, dtype=torch.bfloat16)
    cpu_backend.SVD_QUANT.run(x, w, s, d, u, out=out)
    assert op.agrees(out, ref.svd_quant(x, w, s, d, u))


@pytest.mark.parametrize("where", ["x", "w"])
def test_prefill_with_subnormal_dequantized_values_multiplies_in_float32(where):
    """Blocks whose values are BF16 subnormals (scale byte 0) times large values of the other operand: torch's
    BF16 GEMM would treat them as zero, the reference (float32) keeps their normal products."""
    m, n, k = 8, 16, 256
    x = torch.full((m, k), 1.0, dtype=torch.bfloat16)
    w = torch.full((n, k // 2), 0x22, dtype=torch.uint8)  # every element 1.0
    s = torch.full((n, k // 64, 2), 250, dtype=torch.uint8)
    if where == "x":
        x[:, :32] = 2.0**-127  # its block's scale byte is 0, the weights' 250
        x[:, 32:] = 0
    else:
        s[:, 0, 0] = 0  # weight block 0 at 2^-127, x block 0 large
        x[:, :32] = 2.0**120
        x[:, 32:] = 0
    d, u = torch.zeros(k, 4, dtype=torch.bfloat16), torch.zeros(4, n, dtype=torch.bfloat16)
    want = ref.svd_quant(x, w, s, d, u)
    assert (want != 0).all()
    out = torch.empty(m, n, dtype=torch.bfloat16)
    cpu_backend.SVD_QUANT.run(x, w, s, d, u, out=out)
    assert op.agrees(out, want)


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 1000, 180224])
def test_smallest_byte_wherever_it_lies(size):
    """The scan of scale bytes finds the minimum at every position class (vector body and tail), 255 for none."""
    rng = np.random.default_rng(size)
    data = rng.integers(2, 256, size, dtype=np.uint8)
    assert cpu_backend._smallest_byte(data) == (data.min() if size else 255)
    for at in {0, size // 2, size - 1} if size else ():
        low = data.copy()
        low[at] = 1
        assert cpu_backend._smallest_byte(low) == 1


def test_zero_blocks_with_small_scales_keep_the_bf16_gemm():
    codes = torch.zeros(3, 64, dtype=torch.uint8)
    scales = torch.zeros(3, 4, dtype=torch.uint8)
    assert not cpu_backend._has_subnormal_values(codes, scales)
    codes[1, 20] = 0x08  # -0.0: still no nonzero value
    assert not cpu_backend._has_subnormal_values(codes, scales)
    codes[1, 20] = 0x10  # element 41 = 0.5 * 2^-127
    assert cpu_backend._has_subnormal_values(codes, scales)


def magnitude_range_by_numpy(bits):
    """_magnitude_range's contract computed with numpy: (smallest exponent field of the nonzero magnitudes,
    255 if none; largest magnitude as a float, inf if NaN/Inf)."""
    magnitudes = bits.view(np.uint16).astype(np.int64) & 0x7FFF
    largest = int(magnitudes.max(initial=0))
    nonzero = magnitudes[magnitudes != 0]
    smallest = 255 if nonzero.size == 0 else int(nonzero.min()) >> 7
    if largest >= 0x7F80:
        return smallest, math.inf
    return smallest, float(torch.tensor([largest], dtype=torch.int16).view(torch.bfloat16))


@pytest.mark.parametrize("size", [0, 1, 31, 32, 33, 64, 100, 4096 + 17])
@pytest.mark.parametrize("kind", ["random", "zeros", "negative zeros", "subnormals", "one inf", "one nan"])
def test_magnitude_range_of_every_kind_of_pattern(size, kind):
    """The vector scan (LANES patterns per step, then the tail) against numpy, for lengths around the vector
    width and patterns of every class: the smallest nonzero and the largest magnitude may sit anywhere."""
    rng = np.random.default_rng(size)
    bits = rng.integers(0, 1 << 16, size).astype(np.uint16)
    if kind in ("zeros", "negative zeros"):
        bits[:] = 0 if kind == "zeros" else 0x8000
    elif kind == "subnormals":
        bits &= 0x807F
    elif size:
        bits &= 0xBFFF  # finite, so that the one NaN or Inf decides
        bits[rng.integers(size)] = 0x7F80 if kind == "one inf" else 0xFFC1
    bits = bits.view(np.int16)
    assert cpu_backend._magnitude_range(bits) == magnitude_range_by_numpy(bits)
