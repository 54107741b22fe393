"""numba (and Triton-interpreter) WeightQuantBatchMatmul kernels equal the reference bit for bit."""

import numba
import numpy as np
import pytest
import torch

from helpers import bits, wqbmm_spread_operands
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbit.formats import wqbmm as ref
from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu import wqbmm as cpu

TEMPLATES = ("basic", "preload")


def run_kernel(kernel, x, weight, scale, offset, g, template, prepacked=False):
    """The kernel object's run with its own workspace: the raw weight (the CPU kernel repacks it into the
    workspace), or with ``prepacked`` the result of the kernel's pack_weight."""
    m, k = x.shape
    n = scale.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    nbytes = kernel.workspace_nbytes(m, k, n, g, template, prepacked)
    workspace = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    w = kernel.pack_weight(weight, g) if prepacked else weight
    kernel.run(x, w, scale, offset, g, "msd", template, workspace, prepacked, out=out)
    return out.cpu()


def run_cpu(x, weight, scale, offset, g, template, prepacked=False):
    return run_kernel(cpu.MATMUL, x, weight, scale, offset, g, template, prepacked)


def _draw_inputs(data, m, k, n, g, dtype, with_offset, edges):
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    x, weight, scale, offset = wqbmm_spread_operands(torch.Generator().manual_seed(seed), m, k, n, g, dtype,
                                                     with_offset)
    if edges:
        fmax = torch.finfo(dtype).max
        specials = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), fmax, -fmax, torch.finfo(dtype).tiny / 4]
        for _ in range(data.draw(st.integers(1, 6), label="n_edges")):
            r, c = data.draw(st.integers(0, m - 1)), data.draw(st.integers(0, k - 1))
            x[r, c] = data.draw(st.sampled_from(specials))
        if data.draw(st.booleans(), label="zero group"):
            r, gi = data.draw(st.integers(0, m - 1)), data.draw(st.integers(0, k // g - 1))
            x[r, gi * g : (gi + 1) * g] = 0
        if data.draw(st.booleans(), label="special scale"):
            gi, col = data.draw(st.integers(0, k // g - 1)), data.draw(st.integers(0, n - 1))
            scale[gi, col] = data.draw(st.sampled_from(specials))
    return x, weight, scale, offset


@given(data=st.data(), m=st.integers(1, 64), groups=st.integers(1, 3), g=st.sampled_from([32, 64, 128, 256]),
       n=st.sampled_from([2, 30, 64, 130, 256]), bf16=st.booleans(), with_offset=st.booleans(), edges=st.booleans())
def test_cpu_kernels_equal_reference(data, m, groups, g, n, bf16, with_offset, edges):
    dtype = torch.bfloat16 if bf16 else torch.float16
    x, weight, scale, offset = _draw_inputs(data, m, groups * g, n, g, dtype, with_offset, edges)
    expected = bits(ref.wqbmm_msd(x, weight, scale, offset, g))
    for template in TEMPLATES:
        assert torch.equal(bits(run_cpu(x, weight, scale, offset, g, template)), expected), template
    prepacked = run_cpu(x, weight, scale, offset, g, data.draw(st.sampled_from(TEMPLATES)), prepacked=True)
    assert torch.equal(bits(prepacked), expected)


def test_parallel_preprocess_path_equals_reference():
    """Inputs above the serial pre-process threshold take the parallel pre-process."""
    gen = torch.Generator().manual_seed(7)
    m, k, n, g = 40, 2048, 64, 128
    assert m * k > cpu._SERIAL_PREPROCESS_MAX
    x = torch.randn(m, k, generator=gen).half()
    weight = torch.randint(0, 256, (k, n // 2), generator=gen, dtype=torch.uint8)
    scale = torch.rand(k // g, n, generator=gen).half()
    expected = bits(ref.wqbmm_msd(x, weight, scale, None, g))
    for template in TEMPLATES:
        assert torch.equal(bits(run_cpu(x, weight, scale, None, g, template)), expected)


def test_kernel_reads_the_current_weight_every_call():
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 64, generator=gen).half()
    weight = torch.randint(0, 256, (64, 32), generator=gen, dtype=torch.uint8)
    scale = torch.rand(2, 64, generator=gen).half()
    first = run_cpu(x, weight, scale, None, 32, "preload")
    assert torch.equal(first, ref.wqbmm_msd(x, weight, scale, None, 32))
    weight.data.bitwise_xor_(0x11)  # an in-place change torch's version counter does not see
    expected = bits(ref.wqbmm_msd(x, weight, scale, None, 32))
    assert torch.equal(bits(run_cpu(x, weight, scale, None, 32, "preload")), expected)


def _dot_with(dpbusd):
    """A kernel applying ``dpbusd`` to one 4 * LANES-byte tile and each int32 of a_words."""

    @numba.njit
    def dot(w_bytes, a_words):
        out = np.empty((a_words.size, simd.LANES), np.int32)
        for i in range(a_words.size):
            simd.i32v_store(out[i], 0, dpbusd(simd.i32v_zero(), simd.i32v_load(w_bytes, 0), a_words, i))
        return out

    return dot


@pytest.mark.parametrize("lowering", ["portable", "vnni", "avx2"])
def test_dpbusd_lowerings_agree_with_numpy(lowering):
    """The dpbusd lowerings (AVX512-VNNI, AVX2, portable) on extreme bytes: w up to 255, or up to 127 for the
    AVX2 one (its contract: vpmaddubsw's int16 pair sums must not saturate)."""
    if lowering == "vnni" and not simd.HAS_VNNI or lowering == "avx2" and not simd.HAS_AVX2:
        pytest.skip(f"this CPU has no {lowering}")
    rng = np.random.default_rng(0)
    top = 127 if lowering == "avx2" else 255
    w = rng.integers(0, top + 1, 4 * simd.LANES, dtype=np.uint8)
    w[:8] = top
    a = rng.integers(-128, 128, (33, 4), dtype=np.int8)
    a[0] = -128
    dot = _dot_with({"portable": simd.dpbusd_portable, "vnni": simd.dpbusd_vnni, "avx2": simd.dpbusd_avx2}[lowering])
    expected = np.einsum("lj,ij->il", w.reshape(simd.LANES, 4).astype(np.int64), a.astype(np.int64))
    assert np.array_equal(dot(w, a.reshape(-1).view(np.int32)), expected)


@pytest.mark.parametrize("strided", [False, True])
def test_pack_weight_layout(strided):
    """tiles[nb, g, p, lane, j] = u[k0 + j, col] | u[k0 + 4 + j, col] << 4 with u = W + 8 (padding: 8)."""
    k, n, g, lanes = 64, 70, 32, cpu.TILE_N
    w = torch.randint(-8, 8, (k, n), dtype=torch.int8)
    from lowbit.formats.int4 import pack_int4

    packed = pack_int4(w)
    if strided:  # a non-contiguous view holding the same bytes
        packed = torch.stack([packed, torch.zeros_like(packed)], dim=-1)[..., 0]
    npad = cpu.padded_n(n)
    tiles = cpu.MATMUL.pack_weight(packed, g)
    assert tiles.numel() == cpu.tiles_nbytes(k, n) == k * npad // 2
    u = torch.full((k, npad), 8, dtype=torch.int32)
    u[:, :n] = w.to(torch.int32) + 8
    # k = gi*G + 8p + 4h + j, col = lanes*nb + lane -> (nb, gi, p, lane, j, h)
    u = u.reshape(k // g, g // 8, 2, 4, npad // lanes, lanes).permute(4, 0, 1, 5, 3, 2)
    expected = (u[..., 0] | (u[..., 1] << 4)).reshape(-1)
    assert torch.equal(tiles.to(torch.int32), expected)
    spot = tiles.reshape(npad // lanes, k // g, g // 8, lanes, 4)[1, 1, 3, 5, 3]  # one entry by hand
    k0, col = 1 * g + 8 * 3, lanes * 1 + 5
    assert int(spot) == (int(w[k0 + 3, col]) + 8) | (int(w[k0 + 4 + 3, col]) + 8) << 4


triton_wqbmm = pytest.importorskip("lowbit.kernels.triton.wqbmm", reason="triton is not installed")


@settings(max_examples=6)
@given(data=st.data(), m=st.integers(1, 20), g=st.sampled_from([32, 64, 128]), n=st.sampled_from([2, 34, 64, 130]),
       bf16=st.booleans(), with_offset=st.booleans(), edges=st.booleans())
def test_triton_kernels_equal_reference(data, m, g, n, bf16, with_offset, edges):
    dtype = torch.bfloat16 if bf16 else torch.float16
    x, weight, scale, offset = _draw_inputs(data, m, 2 * g, n, g, dtype, with_offset, edges)
    expected = bits(ref.wqbmm_msd(x, weight, scale, offset, g))
    for template in TEMPLATES:
        assert torch.equal(bits(run_kernel(triton_wqbmm.MATMUL, x, weight, scale, offset, g, template)), expected)
    assert torch.equal(bits(run_kernel(triton_wqbmm.MATMUL, x, weight, scale, offset, g, "preload", True)), expected)


@numba.njit
def _widen_all(bits, is_bf16):
    out = np.empty(bits.size, np.float32)
    for i in range(0, bits.size, simd.LANES):
        value = simd.bf16v_load(bits, i) if is_bf16 else simd.f16v_load(bits, i)
        simd.f32v_store(out, i, value)
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_loads_widen_every_pattern_exactly(dtype):
    """The scale/offset loads: all 65536 FP16 and BF16 bit patterns against torch's conversion."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    widened = _widen_all(bits.numpy(), dtype == torch.bfloat16)
    assert np.array_equal(widened.view(np.int32), bits.view(dtype).float().numpy().view(np.int32))
