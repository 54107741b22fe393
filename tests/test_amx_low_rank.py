"""lowbit's AMX kernel with svd_quant's low-rank branch (amx.run's ``low_rank``, WeightOnlyLinear.run_low_rank,
svd_quant's prefill on the tiles): out = bf16(bf16(T u) + bf16(x W^T)), both products summed on the tiles.

Data of small integers make every float32 sum exact in any order, so the results are compared bit for bit with
the same formula in float64 (each rounding to BF16 still happens: sums past 256 are not BF16 values)."""

import os
import subprocess
import sys
from pathlib import Path

import numba
import pytest
import torch

from helpers import bits, force_k_chunk
from lowbit.formats import mxfp4
from lowbit.kernels.cpu import amx
from lowbit.kernels.cpu import mxfp4 as mxfp4_kernels
from lowbit.kernels.cpu import svd_quant as cpu_svd
from lowbit.kernels.cpu import weight_only as cpu
from lowbit.ops import svd_quant as op

pytestmark = pytest.mark.skipif(not amx.AVAILABLE, reason="no AMX-BF16 here (CPU, OS or a generic NUMBA_CPU_NAME)")
BF16_NAN = 0x7FC0


@numba.njit(nogil=True)
def _bf16_rows(values, r0, first, end, w):
    """A tile decoder of plain BF16 rows (``values`` (N, K) int16): rows r0 + first .. r0 + end - 1 into w."""
    for i in range(first, end):
        for c in range(values.shape[1]):
            w[i, c] = values[r0 + i, c]


amx.carry_low_rank(_bf16_rows)


@numba.njit(nogil=True)
def _rows_without_low_rank(values, r0, first, end, w):
    """_bf16_rows again, under a name whose kernel has no low-rank branch."""
    for i in range(first, end):
        for c in range(values.shape[1]):
            w[i, c] = values[r0 + i, c]


def _ints(g, *shape, high=15):
    return torch.randint(-high, high + 1, shape, generator=g).bfloat16()


def _formula(x, w, t, u):
    """bf16(bf16(t u) + bf16(x w^T)) with the products summed exactly (float64) and rounded once to float32."""
    low = (t.double() @ u.double()).float().bfloat16()
    products = (x.double() @ w.double().T).float().bfloat16()
    return (low.float() + products.float()).bfloat16()


def _run(x, w, t, u, scratch=None, decoder=_bf16_rows, bias=None, low_rank=True):
    """amx.run of x (M, K) and the BF16 rows w (N, K) (by ``decoder``) with the low-rank branch (t (M, R),
    u (R, N)) or without it."""
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
    branch = (bits(t).numpy(), bits(u).numpy()) if low_rank else amx._NO_LOW_RANK
    amx.run(decoder, (bits(w).numpy(),), bits(x).numpy(), w.shape[0], cpu._tile_width(x.shape[1]),
            *cpu._bias_bits(bias), bits(out).numpy(), scratch, low_rank=branch)
    return out


def _small_case(seed):
    """(x (8, 32), w (8, 32), t (8, 2), u (2, 8)) of small integers."""
    g = torch.Generator().manual_seed(seed)
    return _ints(g, 8, 32), _ints(g, 8, 32), _ints(g, 8, 2), _ints(g, 2, 8)


def _assert_same(got, want):
    """Equal bits where ``want`` is a number; NaN (the canonical one) exactly where ``want`` is NaN."""
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(bits(got)[~want.isnan()], bits(want)[~want.isnan()])
    assert (bits(got)[got.isnan()] == BF16_NAN).all()


@pytest.mark.parametrize("m, n, k, r", [(5, 40, 64, 32), (16, 32, 32, 1), (17, 100, 96, 40), (33, 130, 64, 8),
                                        (40, 257, 128, 64), (64, 64, 300, 70)])
@pytest.mark.parametrize("threads", ["calling", "numba"])
@pytest.mark.parametrize("k_chunk", [None, 64], ids=["one-pass", "chunks"])
def test_low_rank_is_the_formula_where_sums_are_exact(monkeypatch, m, n, k, r, threads, k_chunk):
    """M, N and R on and off the tiles' blocks (half tiles below 17 rows, several tasks past 128 rows of W, R past
    one tile step), in a scratch full of NaN bits, on the calling thread and on numba's, K in one pass and in
    chunks of 64 columns (amx.k_chunk_of, forced here)."""
    monkeypatch.setattr(amx, "ONE_THREAD_PRODUCTS", 1 << 62 if threads == "calling" else 0)
    if k_chunk is not None:
        force_k_chunk(monkeypatch, m, k_chunk)
    g = torch.Generator().manual_seed(m * n + r)
    x, w, t, u = _ints(g, m, k), _ints(g, n, k), _ints(g, m, r), _ints(g, r, n)
    scratch = torch.full((amx.scratch_bytes(m, k, cpu._tile_width(k), r),), 0xFF, dtype=torch.uint8)
    got = _run(x, w, t, u, scratch)
    want = _formula(x, w, t, u)
    assert bits(got).eq(bits(want)).all()
    assert (want.float() != (t.double() @ u.double() + x.double() @ w.double().T).float()).any()  # roundings ran


def test_special_values_reach_their_rows_and_columns():
    """NaN in T, x or W, Inf in u (NaN where it meets a zero of T) and both infinities: IEEE's results, NaN
    canonical."""
    g = torch.Generator().manual_seed(1)
    m, n, k, r = 20, 48, 64, 16
    x, w, t, u = _ints(g, m, k), _ints(g, n, k), _ints(g, m, r), _ints(g, r, n)
    t[1, 3] = float("nan")
    x[4, 10] = float("nan")
    w[7, 0] = float("nan")
    u[2, 5], u[3, 5] = float("inf"), float("inf")
    t[6, 2] = 0
    u[2, 9], u[3, 9] = float("inf"), float("-inf")
    got, want = _run(x, w, t, u), _formula(x, w, t, u)
    assert want.isnan().any() and want.isinf().any()
    _assert_same(got, want)


def test_overflow_to_infinity_in_each_rounding():
    """T u and x W^T past the float32 range, and a final add of two finite BF16 values past it: Inf, as the
    formula's (row 0: T u overflows; row 1: x W^T; row 2, column 1: the add)."""
    big = 1.5 * 2.0**127
    x, w = torch.zeros(3, 32).bfloat16(), torch.zeros(2, 32).bfloat16()
    x[1, :2], x[2, 0], w[:, :2] = big, big, 1.0
    t = torch.tensor([[big, big], [0.0, 0.0], [big, 0.0]]).bfloat16()
    u = torch.tensor([[2.0, 1.0], [2.0, 1.0]]).bfloat16()
    got, want = _run(x, w, t, u), _formula(x, w, t, u)
    assert want.isinf().all() and not torch.isinf((x.double() @ w.double().T)[2]).any()
    _assert_same(got, want)


def test_tile_sums_are_never_subnormal():
    """The tiles flush a subnormal float32 sum to zero (as torch's GEMM on them does), which the kernel's rounding
    of each sum by vcvtne2ps2bf16 relies on; the final add keeps a subnormal result, rounded exactly. Row 0:
    T u = 2^-127 (subnormal: 0), x W^T = 0; row 1: T u = 2^-126 (1 + 2^-7), x W^T = -2^-126, their sum 2^-133."""
    tiny = 2.0**-63
    t = torch.tensor([[tiny / 2], [tiny * (1 + 2.0**-7)]]).bfloat16()
    u = torch.tensor([[tiny]]).bfloat16()
    x, w = torch.zeros(2, 32).bfloat16(), torch.zeros(1, 32).bfloat16()
    x[1, 0], w[0, 0] = -tiny, tiny
    got = _run(x, w, t, u)
    assert bits(got[0, 0]) == 0
    assert got[1, 0].item() == 2.0**-133


def test_a_kernel_without_the_branch_refuses_a_low_rank():
    x, w, t, u = _small_case(3)
    with pytest.raises(ValueError, match="_rows_without_low_rank has no low-rank branch"):
        _run(x, w, t, u, decoder=_rows_without_low_rank)
    got = _run(x, w, t, u, decoder=_rows_without_low_rank, low_rank=False)
    assert torch.equal(got, (x.double() @ w.double().T).float().bfloat16())


def test_run_low_rank_checks_its_operands():
    g = torch.Generator().manual_seed(2)
    codes, scales = mxfp4.quantize(torch.randn(40, 64, generator=g))
    x, t, u = _ints(g, 8, 64), _ints(g, 8, 4), _ints(g, 4, 40)
    out = torch.empty(8, 40, dtype=torch.bfloat16)
    cpu.MXFP4_LINEAR.run_low_rank(x, codes, scales, t, u, out=out)
    for bad_t, bad_u, bad_out, words in [(t.float(), u, out, "t (8, 4) torch.float32"),
                                         (t, u[:, :39], out, "u (4, 39)"),
                                         (t, u.T.contiguous().T, out, "C-contiguous"),
                                         (t[:7], u, out, "t (7, 4)"),
                                         (t, u, torch.empty(8, 39, dtype=torch.bfloat16), "(M, N)")]:
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            cpu.MXFP4_LINEAR.run_low_rank(x, codes, scales, bad_t, bad_u, out=bad_out)
    for bad_x, bad_t, bad_out, words in [(x[0], t, out, "x must be a 2-D CPU tensor"),
                                         (x, t.to("meta"), out, "t must be a 2-D CPU tensor, got .* on meta"),
                                         (x, t, out.reshape(-1), "out must be a 2-D CPU tensor")]:
        with pytest.raises(ValueError, match=words):
            cpu.MXFP4_LINEAR.run_low_rank(bad_x, codes, scales, bad_t, u, out=bad_out)
    many = _ints(g, cpu.AMX_MAX_M + 1, 64)
    with pytest.raises(RuntimeError, match="does not take x"):
        cpu.MXFP4_LINEAR.run_low_rank(many, codes, scales, _ints(g, many.shape[0], 4), u,
                                      out=torch.empty(many.shape[0], 40, dtype=torch.bfloat16))


def _exact_svd_inputs(m, n, k, r, seed):
    """svd_quant inputs whose quantized activation is x itself (E2M1 values, each block's largest magnitude 6:
    scale 2^0) and whose products and low-rank sums are exact in float32."""
    g = torch.Generator().manual_seed(seed)
    values = mxfp4.dequantize(torch.arange(16, dtype=torch.uint8).repeat(8).view(8, 16), torch.full((8, 1), 127,
                                                                                                   dtype=torch.uint8))
    levels = values.reshape(-1).unique()
    x = levels[torch.randint(0, len(levels), (m, k), generator=g)].bfloat16()
    x[:, ::32] = 6
    w, s = mxfp4.dynamic_mx_quant(_ints(g, n, k, high=6), 32, "round")
    return x, w, s, _ints(g, k, r, high=3), _ints(g, r, n, high=3)


@pytest.mark.parametrize("m, n, k, r", [(cpu.GEMV_MAX_M + 1, 72, 64, 32), (40, 130, 128, 8), (96, 64, 96, 64)])
def test_svd_quant_prefill_on_the_tiles_is_the_formula(monkeypatch, m, n, k, r):
    """svd_quant's prefill rows go to run_low_rank and give bf16(bf16(T u) + bf16(P)), T = bf16(x d), bit for bit
    where the sums are exact; so do the decode rows of the same data."""
    calls = []
    original = cpu.WeightOnlyLinear.run_low_rank
    monkeypatch.setattr(cpu.WeightOnlyLinear, "run_low_rank", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    x, w, s, d, u = _exact_svd_inputs(m, n, k, r, seed=m + n)
    got = op.svd_quant(x, w, s, d, u, backend="native")
    assert calls == [1]
    w_values = mxfp4.dequantize(w, cpu_svd.weight_scales(s, k), torch.float64)
    products = (x.double() @ w_values.T).float().bfloat16()
    low = ((x.double() @ d.double()).float().bfloat16().double() @ u.double()).float().bfloat16()
    want = (low.float() + products.float()).bfloat16()
    assert bits(got).eq(bits(want)).all()
    assert torch.equal(op.svd_quant(x[:1], w, s, d, u, backend="native"), got[:1])


def test_svd_quant_beyond_the_tiles_rows_keeps_torch_matmuls(monkeypatch):
    """Past _amx_max_m rows the prefill takes the weight-only kernel and torch's low-rank matmuls, as before."""
    monkeypatch.setattr(cpu, "AMX_MAX_M", 32)
    monkeypatch.setattr(cpu.WeightOnlyLinear, "run_low_rank", lambda *a, **kw: pytest.fail("ran on the tiles"))
    x, w, s, d, u = _exact_svd_inputs(33, 40, 64, 8, seed=3)
    op.svd_quant(x, w, s, d, u, backend="native")


def test_a_bias_with_a_low_rank_is_refused():
    """P + bias could be a subnormal, which the branch's rounding of each tile sum would flush."""
    x, w, t, u = _small_case(4)
    with pytest.raises(ValueError, match="no bias"):
        _run(x, w, t, u, bias=torch.ones(8, dtype=torch.bfloat16))


@pytest.mark.parametrize("scratch", [torch.zeros(100, dtype=torch.uint8), torch.zeros(1 << 20, dtype=torch.int16),
                                     torch.zeros(2, 1 << 20, dtype=torch.uint8)])
def test_a_scratch_that_does_not_fit_is_refused(scratch):
    x, w, t, u = _small_case(5)
    with pytest.raises(ValueError, match="bytes needed"):
        _run(x, w, t, u, scratch)


_TWO_PROCESSES = """
import sys, numba, numpy as np, torch
from lowbit.kernels.cpu import amx, weight_only as cpu

@numba.njit(nogil=True, cache=True)
def rows_for_the_cache_test(values, r0, first, end, w):
    for i in range(first, end):
        for c in range(values.shape[1]):
            w[i, c] = values[r0 + i, c]

def words(t):
    return t.view(torch.int16).numpy()

x, w = torch.ones(8, 32).bfloat16(), torch.zeros(8, 32).bfloat16()
t, u = torch.ones(8, 1).bfloat16(), torch.full((1, 8), 2.0).bfloat16()
out = torch.empty(8, 8, dtype=torch.bfloat16)
if sys.argv[1] == "branch":
    amx.carry_low_rank(rows_for_the_cache_test)
    amx.run(rows_for_the_cache_test, (words(w),), words(x), 8, 40, *cpu._bias_bits(None), words(out),
            low_rank=(words(t), words(u)))
    assert out.eq(2).all(), out
else:
    amx.run(rows_for_the_cache_test, (words(w),), words(x), 8, 40, *cpu._bias_bits(None), words(out))
    assert out.eq(0).all(), out
"""


def test_a_cached_kernel_without_the_branch_is_not_taken_for_one_with_it(tmp_path):
    """A process that compiled (and cached) a decoder's kernel without the branch, then one that asks for the
    branch: the second compiles its own kernel (its name says so), not the cached one without T u."""
    script = tmp_path / "cache_case.py"
    script.write_text(_TWO_PROCESSES)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba_cache"),
           "PYTHONPATH": os.pathsep.join([str(Path(amx.__file__).parents[3]), os.environ.get("PYTHONPATH", "")])}
    for case in ("plain", "branch"):
        done = subprocess.run([sys.executable, str(script), case], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("r, on_tiles", [(8, True), (32, True), (64, True), (40, False), (100, False)])
def test_svd_quant_prefill_low_rank_is_torchs(monkeypatch, r, on_tiles):
    """On random upstream-style data (U(-10, 10): sums not exact) the prefill's L is torch's ``(x @ d) @ u`` bit
    for bit, as the upstream check compares against: on the tiles for R up to 32 or a multiple of 32 (where
    oneDNN sums in the tiles' order), torch's matmuls for other R."""
    calls = []
    original = cpu.WeightOnlyLinear.run_low_rank
    monkeypatch.setattr(cpu.WeightOnlyLinear, "run_low_rank", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    x, w, s, d, u = op.probe_inputs(100, 300, 512, r, seed=r)
    got = op.svd_quant(x, w, s, d, u, backend="native")
    assert calls == ([1] if on_tiles else [])
    x_deq = mxfp4.dequantize(*mxfp4.quantize(x, 32, "floor", "ta"), torch.bfloat16)
    products = torch.empty(100, 300, dtype=torch.bfloat16)
    cpu.MXFP4_LINEAR.run(x_deq, w, cpu_svd.weight_scales(s, 512), None, out=products)
    assert bits(got).eq(bits(products + (x @ d) @ u)).all()


@pytest.mark.parametrize("m, n, k, r", [(5, 40, 64, 32), (17, 100, 96, 8), (40, 257, 2048, 32), (100, 64, 32, 64),
                                        (256, 300, 512, 16)])
@pytest.mark.parametrize("threads", ["calling", "numba"])
def test_fake_quant_laid_out_on_the_way_is_the_fake_quant_then_the_kernel(monkeypatch, m, n, k, r, threads):
    """run_low_rank with x_scales: x's MXFP4 fake quant laid out straight into the tiles' operand gives the bits
    and scale bytes of the fake quant written out first (mxfp4.fake_quantize_into) and then multiplied; NaN and
    Inf blocks too, 16-row groups and the rows past them, on the calling thread and on numba's."""
    monkeypatch.setattr(amx, "ONE_THREAD_PRODUCTS", 1 << 62 if threads == "calling" else 0)
    x, w, s, d, u = op.probe_inputs(m, n, k, r, seed=m + k)
    x[0, 3], x[m - 1, k - 1] = float("nan"), float("-inf")
    scales, t = cpu_svd.weight_scales(s, k).contiguous(), x @ d
    want_scales, x_deq = torch.empty(m, k // 32, dtype=torch.uint8), torch.empty_like(x)
    mxfp4_kernels.fake_quantize_into(x, 32, "floor", "ta", want_scales, x_deq)
    want = torch.empty(m, n, dtype=torch.bfloat16)
    cpu.MXFP4_LINEAR.run_low_rank(x_deq, w, scales, t, u, out=want)
    got, x_scales = torch.empty_like(want), torch.full((m, k // 32), 7, dtype=torch.uint8)
    cpu.MXFP4_LINEAR.run_low_rank(x, w, scales, t, u, out=got, x_scales=x_scales)
    assert torch.equal(x_scales, want_scales)
    assert bits(got).eq(bits(want)).all()


def test_fake_quant_scales_are_checked():
    x, w, s, d, u = op.probe_inputs(8, 40, 64, 4)
    scales, t = cpu_svd.weight_scales(s, 64).contiguous(), x @ d
    out = torch.empty(8, 40, dtype=torch.bfloat16)
    for bad in (torch.empty(8, 3, dtype=torch.uint8), torch.empty(8, 2, dtype=torch.int8),
                torch.empty(2, 8, dtype=torch.uint8).T, torch.empty(16, dtype=torch.uint8)):
        with pytest.raises(ValueError, match="x_scales"):
            cpu.MXFP4_LINEAR.run_low_rank(x, w, scales, t, u, out=out, x_scales=bad)
