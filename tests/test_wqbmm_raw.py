"""The CPU kernel's raw-weight path (preload, M <= RAW_MAX_ROWS = 16, a raw (K, N/2) weight read as it is, no
repack) equals the reference and the tiled paths bit for bit (docs/wqbmm.md, section 'CPU kernel')."""

import numba
import numpy as np
import pytest
import torch

from helpers import bits, serial_then_parallel, wqbmm_spread_operands
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbit.formats import wqbmm as ref
from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu import wqbmm as cpu
from lowbit.ops import wqbmm as wq

# N: one padded tile, N not a multiple of 32 / 64, several column blocks with a partial last one.
N_VALUES = [2, 34, 64, 130, 2 * cpu.RAW_BLOCK_N + 66]


def _run(x, weight, scale, offset, g, template, prepacked=False):
    m, k = x.shape
    n = scale.shape[1]
    out = torch.empty(m, n, dtype=x.dtype)
    workspace = torch.empty(cpu.MATMUL.workspace_nbytes(m, k, n, g, template, prepacked), dtype=torch.uint8)
    w = cpu.MATMUL.pack_weight(weight, g) if prepacked else weight
    cpu.MATMUL.run(x, w, scale, offset, g, "msd", template, workspace, prepacked, out=out)
    return bits(out)


def _operands(seed, m, k, n, g, dtype, with_offset, specials):
    x, weight, scale, offset = wqbmm_spread_operands(torch.Generator().manual_seed(seed), m, k, n, g, dtype,
                                                     with_offset)
    if specials:
        fmax = torch.finfo(dtype).max
        x[m - 1, :g] = 0  # an all-zero group
        x[0, k - 1] = fmax
        if m > 1:
            x[1, 0] = float("nan")
        if m > 2:
            x[2, k // 2] = -float("inf")
        scale[0, n - 1] = -fmax
        scale[-1, 0] = torch.finfo(dtype).tiny
    return x, weight, scale, offset


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), m=st.sampled_from([1, 2, 3, 4, 5, 16, 17]), g=st.sampled_from([32, 64, 96, 128, 288]),
       groups=st.integers(1, 2), n=st.sampled_from(N_VALUES), bf16=st.booleans(), with_offset=st.booleans(),
       specials=st.booleans(), threads=st.sampled_from([1, 2]), streamed=st.booleans())
def test_raw_path_equals_reference_and_tiled_paths(seed, m, g, groups, n, bf16, with_offset, specials, threads,
                                                   streamed):
    """M = 1..5 and 16 (17: past RAW_MAX_ROWS, the tiled path), G = 32..288 (288 > RAW_SPAN_K: two int16 spans per
    group), K = G or 2G, N not a multiple of 32 and across column blocks, FP16/BF16, offsets present or
    absent, zero groups, NaN/Inf/extreme activations and scales, 1 and 2 threads, both orders of the rows
    (RAW_ROWS_STREAMED)."""
    dtype = torch.bfloat16 if bf16 else torch.float16
    x, weight, scale, offset = _operands(seed, m, groups * g, n, g, dtype, with_offset, specials)
    expected = bits(ref.wqbmm_msd(x, weight, scale, offset, g))
    before, order = torch.get_num_threads(), cpu.RAW_ROWS_STREAMED
    torch.set_num_threads(threads)
    cpu.RAW_ROWS_STREAMED = streamed  # hypothesis runs examples without function-scoped fixtures
    try:
        raw = _run(x, weight, scale, offset, g, "preload")
        tiled = _run(x, weight, scale, offset, g, "preload", prepacked=True)
        basic = _run(x, weight, scale, offset, g, "basic")
    finally:
        torch.set_num_threads(before)
        cpu.RAW_ROWS_STREAMED = order
    assert torch.equal(raw, expected)
    assert torch.equal(raw, tiled) and torch.equal(raw, basic)


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_sample_sized_row_is_bit_exact_on_two_threads(m, streamed, monkeypatch):
    """A wide problem (several column blocks per thread, the sample's G) against the reference, the rows
    streamed or walked down the columns."""
    monkeypatch.setattr(cpu, "RAW_ROWS_STREAMED", streamed)
    x, weight, scale, offset = _operands(m, m, 256, 3 * cpu.RAW_BLOCK_N, 128, torch.float16, m % 2 == 0, True)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        raw = _run(x, weight, scale, offset, 128, "preload")
    finally:
        torch.set_num_threads(before)
    assert torch.equal(raw, bits(ref.wqbmm_msd(x, weight, scale, offset, 128)))


def test_raw_path_is_chosen_for_small_m_preload_with_a_raw_weight_and_needs_no_repack_room():
    k, n, g = 8192, 12288, 128
    for m in range(1, cpu.RAW_MAX_ROWS + 1):
        assert cpu.reads_raw_weight(m, "preload", False)
        layout = cpu.WorkspaceLayout.build(m, k, n, g, "preload")
        assert layout.raw and "tiles" not in layout.offsets
        assert cpu.MATMUL.workspace_nbytes(m, k, n, g, "preload", False) == layout.nbytes < cpu.tiles_nbytes(k, n) // 8
    assert not cpu.reads_raw_weight(cpu.RAW_MAX_ROWS + 1, "preload", False)
    assert not cpu.reads_raw_weight(1, "basic", False)
    assert not cpu.reads_raw_weight(1, "preload", True)
    assert cpu.MATMUL.workspace_nbytes(cpu.RAW_MAX_ROWS + 1, k, n, g, "preload", False) > cpu.tiles_nbytes(k, n)


def test_one_shot_op_and_plan_take_the_raw_path():
    x, weight, scale, _ = _operands(3, 1, 256, 100, 128, torch.bfloat16, False, False)
    expected = ref.wqbmm_msd(x, weight, scale, None, 128)
    assert torch.equal(bits(wq.weight_quant_batch_matmul(x, weight, scale, backend="native")), bits(expected))
    plan = wq.plan_weight_quant_batch_matmul(1, 256, 100, dtype=torch.bfloat16, backend="native")
    assert plan.workspace_nbytes == cpu.MATMUL.workspace_nbytes(1, 256, 100, 128, "preload", False)
    assert torch.equal(bits(plan.run(x, weight, scale)), bits(expected))


def test_probes_cover_the_raw_and_the_tiled_preload_paths():
    preload = [p for p in wq.MATMUL.probes() if p[6] == "preload"]
    raw = [p for p in preload if cpu.reads_raw_weight(p[0].shape[0], "preload", False)]
    assert raw and len(raw) < len(preload)
    assert any(p[2].shape[1] % 32 for p in raw) and any(p[3] is not None for p in raw)
    assert {p[0].dtype for p in raw} == {torch.float16, torch.bfloat16}


def _pairs_and_madd_with(maddubs):
    """A kernel: maddubs(0, nibble pairs of w at ``index`` / ``index + stride``, the int16 word ``word[0]``),
    returned through the column-order zip as 2 * LANES int32 (each lane twice)."""

    @numba.njit
    def run(w, index, stride, word, high):
        out = np.empty(2 * simd.LANES, np.int32)
        pairs = simd.u4p_high(w, index, stride) if high else simd.u4p_low(w, index, stride)
        sums = maddubs(simd.i16v_zero(), pairs, word, 0)
        simd.i32v_store(out, 0, simd.i16v_zip_first(sums, sums))
        simd.i32v_store(out, simd.LANES, simd.i16v_zip_second(sums, sums))
        return out

    return run


_MADD = {"this CPU": _pairs_and_madd_with(simd.i16v_maddubs), "portable": _pairs_and_madd_with(simd.i16v_maddubs_portable)}


@pytest.mark.parametrize("lowering", sorted(_MADD))
@pytest.mark.parametrize("high", [False, True])
def test_nibble_pairs_and_maddubs_agree_with_numpy(high, lowering):
    """u = W + 8 of two rows' nibbles (every byte value in both rows), times two int8 activations read as one
    int16 word (extremes included), through the lowering this CPU uses and the portable one (what CPUs
    without AVX512-BW run), back through the column-order zip."""
    rng = np.random.default_rng(1)
    w = np.concatenate([np.arange(256, dtype=np.uint8), rng.integers(0, 256, 300, dtype=np.uint8)])
    stride = 256 + 5
    u = (((w >> 4) if high else (w & 15)) ^ 8).astype(np.int64)
    for index in range(0, 256 - simd.LANES + 1, simd.LANES):
        for a0, a1 in [(7, -7), (-8, 7), (-128, 127), (0, 1), (127, -128)]:
            word = np.array([a0, a1], dtype=np.int8).view(np.int16)
            row0, row1 = u[index : index + simd.LANES], u[index + stride : index + stride + simd.LANES]
            expected = np.repeat(a0 * row0 + a1 * row1, 2)
            assert np.array_equal(_MADD[lowering](w, index, stride, word, high), expected)


@pytest.mark.parametrize("template, prepacked", [("preload", False), ("preload", True), ("basic", False)])
@pytest.mark.parametrize("m", [1, 5])
def test_serial_and_parallel_versions_agree(template, prepacked, m, monkeypatch):
    """Calls below _ONE_THREAD_WORK run the kernels' serial versions (the weight packing too), larger ones their
    parallel loops (each forced here on the same problem, on two threads): the same bits, the reference's."""
    x, weight, scale, offset = _operands(40 + m, m, 256, 2 * cpu.RAW_BLOCK_N + 66, 64, torch.bfloat16, True, True)
    results = serial_then_parallel(monkeypatch, cpu, "_ONE_THREAD_WORK",
                                   lambda: _run(x, weight, scale, offset, 64, template, prepacked))
    assert torch.equal(results[0], results[1])
    assert torch.equal(results[0], bits(ref.wqbmm_msd(x, weight, scale, offset, 64)))
