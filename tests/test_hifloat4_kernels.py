"""HiFloat4 kernels (numba, Triton under the interpreter) == the reference, bit for bit, zero tolerance."""

import numba
import numpy as np
import pytest
import torch

from helpers import FLOAT_DTYPES, serial_then_parallel
from hypothesis import given
from hypothesis import strategies as st

from lowbit.dtypes import bit_view as bits
from lowbit.formats import hifloat4
from lowbit.kernels.cpu import hifloat4 as cpu_kernels
from lowbit.ops.hifloat4 import probe_input

triton_kernels = pytest.importorskip("lowbit.kernels.triton.hifloat4", reason="triton is not installed")

DTYPES = FLOAT_DTYPES
FAKE_QUANT = {"numba": cpu_kernels.FAKE_QUANT, "triton-interpreter": triton_kernels.FAKE_QUANT}
# log2 of the block scales drawn per dtype: 1e-30 ... 1e30 where the dtype allows it.
SCALE_EXPONENTS = {torch.float32: (-100, 100), torch.bfloat16: (-100, 100), torch.float16: (-24, 15)}


def run_kernel(kernel, x, qdim):
    out = torch.empty_like(x)
    kernel.run(x, qdim, out=out)
    return out


def assert_kernel_equals_reference(kernel, x, qdim):
    out = run_kernel(kernel, x, qdim)
    expected = hifloat4.fake_quant(x, qdim)
    differ = bits(out) != bits(expected)
    assert not differ.any(), (
        f"{int(differ.sum())} of {x.numel()} differ, e.g. input {x[differ][:4].tolist()} -> "
        f"{out[differ][:4].tolist()}, expected {expected[differ][:4].tolist()}"
    )


@st.composite
def drawn_inputs(draw, max_other=5):
    """(x, qdim): 1-3 dims, the quant dim 64 * (1..3) long at any position, heavy-tailed values at
    per-block scales drawn over the dtype's range, with zero blocks, -0.0, NaN and +-Inf drawn in."""
    dtype = draw(st.sampled_from(DTYPES))
    ndim = draw(st.integers(1, 3))
    qdim = draw(st.integers(0, ndim - 1))
    shape = [draw(st.integers(1, max_other)) for _ in range(ndim)]
    shape[qdim] = 64 * draw(st.integers(1, 3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    lo, hi = SCALE_EXPONENTS[dtype]
    tail = draw(st.sampled_from([0.0, 1.0, 4.0]))
    moved = [s for i, s in enumerate(shape) if i != qdim] + [shape[qdim]]
    blocks = torch.randn(*moved[:-1], shape[qdim] // 64, 64, generator=g)
    blocks = blocks * torch.exp2(torch.randn(blocks.shape, generator=g) * tail)
    blocks = blocks * torch.exp2(torch.randint(lo, hi + 1, blocks.shape[:-1] + (1,), generator=g).float())
    if draw(st.booleans()):
        blocks = torch.where(torch.rand(blocks.shape[:-1] + (1,), generator=g) < 0.3, 0.0, blocks)
    flat = blocks.reshape(-1)
    for value in draw(st.lists(st.sampled_from([-0.0, float("nan"), float("inf"), float("-inf")]), max_size=3)):
        flat[int(torch.randint(flat.numel(), (1,), generator=g))] = value
    if dtype == torch.float16 and draw(st.booleans()):  # FP16 near its max
        flat[int(torch.randint(flat.numel(), (1,), generator=g))] = 65504.0
    x = blocks.reshape(moved).movedim(-1, qdim).to(dtype).contiguous()
    return x, qdim


@pytest.mark.parametrize("kernel", FAKE_QUANT.values(), ids=FAKE_QUANT.keys())
@given(drawn=drawn_inputs())
def test_kernel_equals_reference_on_drawn_inputs(kernel, drawn):
    x, qdim = drawn
    assert_kernel_equals_reference(kernel, x, qdim)


@pytest.mark.parametrize("kernel", FAKE_QUANT.values(), ids=FAKE_QUANT.keys())
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_probe_input_qdim_first_middle_last(kernel, dtype):
    x = probe_input(dtype)  # worked blocks, zero / NaN / Inf / -0.0 blocks, heavy-tailed rows
    assert_kernel_equals_reference(kernel, x, -1)
    assert_kernel_equals_reference(kernel, x, 1)
    assert_kernel_equals_reference(kernel, x.t().contiguous(), 0)
    assert_kernel_equals_reference(kernel, x.reshape(2, 8, 128).transpose(1, 2).contiguous(), 1)
    assert_kernel_equals_reference(kernel, x.reshape(4, 4, 128).permute(2, 0, 1).contiguous(), 0)


@pytest.mark.parametrize("kernel", FAKE_QUANT.values(), ids=FAKE_QUANT.keys())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_every_bit_pattern(kernel, dtype):
    """All 65 536 FP16 / BF16 bit patterns, in order (neighbours share a block) and shuffled."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).reshape(-1, 64)
    assert_kernel_equals_reference(kernel, x, -1)
    permutation = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))
    assert_kernel_equals_reference(kernel, x.reshape(-1)[permutation].reshape(64, -1), 0)


@pytest.mark.parametrize("kernel", FAKE_QUANT.values(), ids=FAKE_QUANT.keys())
def test_kernel_poisoned_block_changes_nothing_else(kernel):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(128, 6, generator=g).to(torch.bfloat16)
    clean = run_kernel(kernel, x, 0)
    x[70, 2] = float("nan")
    out = run_kernel(kernel, x, 0)
    assert bits(out[64:, 2]).eq(hifloat4.NAN_BITS[torch.bfloat16]).all()
    out[64:, 2] = clean[64:, 2]
    assert torch.equal(bits(out), bits(clean))


@pytest.mark.parametrize("kernel", FAKE_QUANT.values(), ids=FAKE_QUANT.keys())
def test_kernel_tile_edges_when_the_quant_dim_is_not_last(kernel):
    """Column counts around the numba tile width and the Triton tile (blocks per program)."""
    assert cpu_kernels._BLOCKS_PER_TILE == triton_kernels.BLOCKS_PER_TILE == 32
    g = torch.Generator().manual_seed(8)
    for columns in (1, 31, 32, 33, 65):
        x = (torch.randn(2, 128, columns, generator=g) * 1000).to(torch.float32)
        assert_kernel_equals_reference(kernel, x, 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_numba_tiles_transposed_in_registers(dtype):
    """Full tiles (32 columns) go through the register transposes: quant dims of 64 and 128 rows, column counts
    that are a multiple of the tile and that leave a narrower last tile, zero / NaN / Inf / -0.0 and heavy-tailed
    blocks; out of place and in place."""
    g = torch.Generator().manual_seed(9)
    for outer, rows, columns in ((1, 64, 32), (3, 128, 64), (2, 64, 96 + 7)):
        x = torch.randn(outer, rows, columns, generator=g) * torch.exp2(torch.randn(outer, 1, columns, generator=g) * 8)
        flat = x.view(-1)
        flat[torch.randperm(flat.numel(), generator=g)[:8]] = torch.tensor(
            [0.0, -0.0, float("nan"), float("inf"), float("-inf"), -0.0, 1e-30, -3.0])
        x[:, :64, 5] = 0.0
        x = x.to(dtype)
        assert_kernel_equals_reference(cpu_kernels.FAKE_QUANT, x, 1)
        in_place = x.clone()
        cpu_kernels.FAKE_QUANT.run(in_place, 1, out=in_place)
        assert torch.equal(bits(in_place), bits(hifloat4.fake_quant(x, 1)))


@pytest.mark.parametrize("dtype", [np.int16, np.int32])
def test_numba_tile_transpose_keeps_every_bit_pattern(dtype):
    """dst[dst_at + r * dst_stride + c] == src[src_at + c * src_stride + r] for r, c < 32, any bits (NaN patterns
    not made canonical), odd offsets and strides; nothing else in dst written."""
    rng = np.random.default_rng(3)
    info = np.iinfo(dtype)
    src = rng.integers(info.min, info.max, size=40 * 77 + 5, endpoint=True, dtype=dtype)
    src[:64] = np.arange(0x7F80, 0x7FC0).astype(dtype)  # BF16 infinity and NaN payloads
    dst = np.zeros(33 * 45 + 3, dtype=dtype)
    _transpose_32_of(src, 5, 77, dst, 3, 45)
    expected = np.zeros_like(dst)
    for r in range(32):
        expected[3 + r * 45:3 + r * 45 + 32] = src[5 + np.arange(32) * 77 + r]
    assert np.array_equal(dst, expected)


@numba.njit
def _transpose_32_of(src, src_at, src_stride, dst, dst_at, dst_stride):
    cpu_kernels._transpose_32(src, src_at, src_stride, dst, dst_at, dst_stride)


def test_numba_element_code_is_exhaustively_the_reference_rounding():
    """The numba element code (bf16 rounding by a magic add, clamp before rounding) against
    min(floor(4 * bf16(w) + 0.5), 7) for every fp32 w within 2^16 ulps of each code threshold (n - 0.5) / 4
    and of the clamp, plus a spread of values from 0 to 1e30."""
    centers = [np.float32((n - 0.5) / 4) for n in range(1, 8)] + [np.float32(1.75), np.float32(2.0)]
    patterns = [np.arange(-(1 << 16), 1 << 16, dtype=np.int64) + int(c.view(np.uint32)) for c in centers]
    spread = np.float32(np.geomspace(1e-45, 1e30, 20000))
    w = np.concatenate([np.concatenate(patterns).astype(np.uint32).view(np.float32), spread, [np.float32(0)]])
    codes = np.empty_like(w)
    _element_codes(w, codes)
    v = torch.from_numpy(w).to(torch.bfloat16).float()
    expected = torch.floor(4 * v + 0.5).clamp(max=7).numpy()
    assert np.array_equal(codes, expected)


@numba.njit
def _element_codes(w, out):
    for i in range(w.size):
        out[i] = cpu_kernels._code(w[i])


def test_reciprocal_table_is_bf16_of_the_reciprocal():
    for m in range(4):
        expected = torch.tensor(1.0 / (1 + m / 4)).to(torch.bfloat16).float().item()
        assert hifloat4.RECIPROCAL_MANTISSA[m] == cpu_kernels._RECIPROCAL_MANTISSA[m] == expected


# --- pack / unpack kernels ---------------------------------------------------------------------------------

def numba_pack(x):
    scale = torch.empty(x.shape[0], x.shape[1] // 64, 4, dtype=torch.uint8)
    value = torch.empty(x.shape[0], x.shape[1] // 2, dtype=torch.uint8)
    cpu_kernels.PACK.run(x, out=(scale, value))
    return scale, value


def numba_unpack(scale, value, dtype):
    out = torch.empty(scale.shape[0], scale.shape[1] * 64, dtype=dtype)
    cpu_kernels.UNPACK.run(scale, value, dtype, out=out)
    return out


@given(drawn=drawn_inputs(max_other=4))
def test_numba_pack_equals_reference(drawn):
    x, _ = drawn
    x2 = x.reshape(-1, x.shape[-1]) if x.shape[-1] % 64 == 0 else x.reshape(-1, 64)
    scale, value = numba_pack(x2)
    expected = hifloat4.pack(x2)
    assert torch.equal(scale, expected[0]) and torch.equal(value, expected[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_numba_unpack_equals_reference_on_random_bytes(dtype):
    """Arbitrary bytes: every scale byte (0xFF included), every flag pattern, every nibble."""
    g = torch.Generator().manual_seed(9)
    scale = torch.randint(0, 256, (300, 2, 4), generator=g, dtype=torch.int32).to(torch.uint8)
    scale[:256, 0, 0] = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    value = torch.randint(0, 256, (300, 64), generator=g, dtype=torch.int32).to(torch.uint8)
    out = numba_unpack(scale, value, dtype)
    assert torch.equal(bits(out), bits(hifloat4.unpack(scale, value, dtype)))


def test_numba_pack_unpack_round_trip_is_fake_quant():
    for dtype in DTYPES:
        x = probe_input(dtype)
        scale, value = numba_pack(x)
        assert torch.equal(bits(numba_unpack(scale, value, dtype)), bits(hifloat4.fake_quant(x)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_numba_serial_and_parallel_versions_agree(dtype, monkeypatch):
    """Inputs below _ONE_THREAD_BLOCKS run the serial versions on the calling thread, larger ones the parallel
    loops (each forced here on the same 640-block input, on two threads): the same bytes and bits, for pack,
    unpack and fake quant along the last dim and along dim 0 (the tile path)."""
    g = torch.Generator().manual_seed(21)
    x = (torch.randn(128, 320, generator=g) * torch.exp2(torch.randn(128, 1, generator=g) * 8)).to(dtype)
    x[3, 70] = float("nan")

    def run():
        scale, value = numba_pack(x)
        return (scale, value, numba_unpack(scale, value, dtype), run_kernel(cpu_kernels.FAKE_QUANT, x, -1),
                run_kernel(cpu_kernels.FAKE_QUANT, x, 0))

    results = serial_then_parallel(monkeypatch, cpu_kernels, "_ONE_THREAD_BLOCKS", run)
    for serial, parallel in zip(*results):
        assert torch.equal(bits(serial), bits(parallel))
    scale, value = hifloat4.pack(x)
    assert torch.equal(results[0][0], scale) and torch.equal(results[0][1], value)
    assert torch.equal(bits(results[0][2]), bits(hifloat4.unpack(scale, value, dtype)))
    for qdim, got in ((-1, results[0][3]), (0, results[0][4])):
        assert torch.equal(bits(got), bits(hifloat4.fake_quant(x, qdim)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_registers", [True, False], ids=["registers", "per-group loops"])
def test_numba_both_block_paths(in_registers, dtype, monkeypatch):
    """Blocks run in vector registers (_hifloat4_blocks) on CPUs with AVX512-BW or AVX2, in the per-group loops
    elsewhere: each, forced here, equals the reference on every 16-bit pattern, on blocks of scales across the
    dtype's range with zero, NaN and Inf elements, along the last dim and along dim 0 (tiles), serial and
    parallel."""
    monkeypatch.setattr(cpu_kernels, "BLOCKS_IN_REGISTERS", in_registers)
    if dtype != torch.float32:
        x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).reshape(-1, 64)
        assert_kernel_equals_reference(cpu_kernels.FAKE_QUANT, x, -1)
    g = torch.Generator().manual_seed(5)
    lo, hi = SCALE_EXPONENTS[dtype]
    blocks = torch.randn(3000, 64, generator=g) * torch.exp2(torch.randn(3000, 64, generator=g) * 4)
    blocks = blocks * torch.exp2(torch.randint(lo - 30, hi + 28, (3000, 1), generator=g).float())
    blocks[::7] = 0.0
    blocks[5, 3], blocks[11, 60], blocks[12, 0] = float("nan"), float("inf"), float("-inf")
    y = blocks.to(dtype)
    for rows in (y[:40], y):  # below and above _ONE_THREAD_BLOCKS: the serial and the parallel kernel
        assert_kernel_equals_reference(cpu_kernels.FAKE_QUANT, rows, -1)
        assert_kernel_equals_reference(cpu_kernels.FAKE_QUANT, rows.reshape(64, -1), 0)
