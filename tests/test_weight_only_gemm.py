"""Weight-only linear operators past the GEMV's rows: the batched kernel, the GEMM path and lowbit's AMX
kernel stay within the interval of any summation order (docs/weight_only.md, 'Tolerance of the GEMM path')."""

import subprocess
import sys

import numba
import numpy as np
import pytest
import torch

import lowbit
from lowbit.formats import weight_only as reference
from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu import amx
from lowbit.kernels.cpu import _weight_only_batched as wo_batched
from lowbit.kernels.cpu import weight_only as cpu
from lowbit.kernels.cpu import memory
from lowbit.kernels.cpu.memory import thread_scratch

from helpers import force_k_chunk, needs_two_numba_threads
from weight_only_cases import (BATCHED, CPU_KERNELS, GEMM_M, OPS, WEIGHTS, assert_bits, bits, dense_weight, gen,
                               hif8_weight, mxfp4_weight)


# --- the batched kernel and the GEMM path (M > GEMV_MAX_M): within the interval of any summation order -----

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
    lo, hi = reference.gemm_interval(x, dense_weight(fmt, weight, dtype), bias)
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
    dense = dense_weight(fmt, weight, dtype)
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
    dense = dense_weight(fmt, weight, x.dtype)
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
    rows, N below one panel; blocks of x with at most 16 rows take half the tiles, 18 rows all), K with a short
    last tile row (HiFloat8, FP8: 319) or an odd 32-block; NaN / Inf
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
    dense = dense_weight(fmt, weight, torch.bfloat16)
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
@pytest.mark.parametrize("fmt", ["mxfp4", "hifloat8"])
@pytest.mark.parametrize("m", [cpu.GEMV_MAX_M + 1, 45, 70])
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("products", [1 << 62, 0], ids=["calling", "numba"])
def test_amx_kernel_in_chunks_of_k_gives_the_one_pass_bits(monkeypatch, fmt, m, bias_dtype, products):
    """K in chunks (amx.k_chunk_of; forced here below CHUNKED_K) of one tile row, of two, and of three (which
    do not divide K; HiFloat8's K = 319 ends in a short tile row): the one pass's bits, NaN / Inf / -0 / BF16
    subnormals in a non-contiguous x and NaN weights included, rows of x on and off the half-tile blocks, in the
    scratch as earlier calls left it, on the calling thread and on numba's."""
    monkeypatch.setattr(amx, "ONE_THREAD_PRODUCTS", products)
    g = gen(m + len(fmt))
    k = {"hifloat8": 319, "mxfp4": 352}[fmt]
    weight = WEIGHTS[fmt](300, k, g)
    if fmt == "hifloat8":
        weight[0][5, 7] = 0x80
    else:
        weight[1][5, 2] = 0xFF
    x = torch.randn(m, 2 * k, generator=g).bfloat16()[:, ::2]
    x[1, 100], x[m - 1, 3], x[2, 200:232], x[0, :8] = float("nan"), float("inf"), -0.0, 2.0**-130
    bias = None if bias_dtype is None else torch.randn(300, generator=g).to(bias_dtype)
    want = OPS[fmt](x, *weight, bias, backend="native")
    assert amx.k_chunk_of(m, k) >= k
    for k_chunk in (32, 64, 96):
        force_k_chunk(monkeypatch, m, k_chunk)
        calls = _counting_amx(monkeypatch)
        assert_bits(OPS[fmt](x, *weight, bias, backend="native"), want)
        assert calls == [1]


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
