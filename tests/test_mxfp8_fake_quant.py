"""The numba MXFP8 fake quantizer (W8A8 MXFP8 activations): the reference's bits for every 16-bit value, wide
FP32 inputs, special blocks, strides and threads; its errors; the activation path that uses it."""

import numba
import pytest
import torch

from lowbit import use_backend
from lowbit.errors import DeviceError, DtypeError, ShapeError
from lowbit.formats import mxfp8
from lowbit.kernels.cpu import mxfp8 as kernel
from lowbit.quantize.activations import fake_quant_input


def reference(x):
    return mxfp8.dequantize(*mxfp8.quantize(x), x.dtype)


def bits(t):
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("partner", [1.0, 100.0, 1e-3, 30000.0, 2.0**-20, 0.0])
def test_every_16_bit_value_next_to_a_block_maximum(dtype, partner):
    """Every bit pattern of the dtype (NaN and Inf included) in blocks whose last element is ``partner``:
    every scale the pattern can meet as the block's largest or a smaller element; by fake_quantize and by its
    one-call form given the tensors' addresses (fake_quantize_small)."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).reshape(-1, 32).clone()
    x[:, 31] = partner
    want = bits(reference(x))
    assert x.numel() <= kernel.ONE_THREAD_ELEMENTS  # the one-call form's size (a deploy layer's fast path)
    assert torch.equal(bits(kernel.fake_quantize_small(x)), want)  # first: no freed result under its output
    assert torch.equal(bits(kernel.fake_quantize(x)), want)


def test_float32_over_the_whole_exponent_range():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 64, generator=g) * torch.exp2(torch.randint(-149, 128, (512, 64), generator=g).float())
    x[0, :32] = 0.0
    x[1, :32] = -0.0
    x[2, 5] = float("nan")
    x[3, 7] = float("-inf")
    x[4] = torch.ldexp(torch.ones(64), torch.arange(-149, -85))  # subnormal and tiny normal blocks
    assert torch.equal(bits(kernel.fake_quantize(x)), bits(reference(x)))


def test_strided_input_and_thread_counts_give_the_same_bits():
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(96, 4096, generator=g) * 50).to(torch.bfloat16)
    want = bits(reference(x))
    previous = numba.get_num_threads()
    try:
        for threads in (1, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(threads)
            assert torch.equal(bits(kernel.fake_quantize(x)), want)
    finally:
        numba.set_num_threads(previous)
    wide = torch.zeros(96, 8192, dtype=torch.bfloat16)
    wide[:, ::2] = x
    assert torch.equal(bits(kernel.fake_quantize(wide[:, ::2])), want)


def test_errors_name_the_problem():
    with pytest.raises(DtypeError, match="int32"):
        kernel.fake_quantize(torch.zeros(2, 32, dtype=torch.int32))
    with pytest.raises(ShapeError, match="divisible by 32"):
        kernel.fake_quantize(torch.zeros(2, 33))
    with pytest.raises(ShapeError, match="divisible by 32"):
        kernel.fake_quantize(torch.tensor(1.0))
    with pytest.raises(DeviceError, match="meta"):
        kernel.fake_quantize(torch.zeros(2, 32, device="meta"))
    assert kernel.fake_quantize(torch.zeros(0, 32)).shape == (0, 32)


def test_activation_fake_quant_uses_it_with_the_reference_bits():
    x = (torch.randn(3, 5, 64) * 7).to(torch.bfloat16)
    x[0, 0, 3] = float("inf")
    fast = fake_quant_input(x, "mxfp8")
    with use_backend("reference"):
        slow = fake_quant_input(x, "mxfp8")
    assert torch.equal(bits(fast), bits(slow)) and torch.equal(bits(fast), bits(reference(x)))


@pytest.mark.parametrize("in_registers", [True, False], ids=["registers", "per-block arrays"])
def test_both_kernels_every_16_bit_value_and_float32_range(in_registers, monkeypatch):
    """The kernel with each block in one register (CPUs with AVX512-BW) and the one with per-block arrays
    (elsewhere), each forced: every FP16 / BF16 pattern next to small, unit and large block maxima, and FP32
    blocks over the whole exponent range with zero, NaN and Inf blocks, on the calling thread (8 rows) and in
    the parallel loop (1024 rows: ONE_THREAD_ELEMENTS and more)."""
    if in_registers and not kernel.HAS_AVX512BW:
        pytest.skip("the kernel with blocks in registers needs AVX512-BW")
    monkeypatch.setattr(kernel, "_FAKE_QUANTIZE",
                        kernel._fake_quantize_in_registers if in_registers else kernel._fake_quantize)
    for dtype in (torch.bfloat16, torch.float16):
        for partner in (2.0**-20, 1.0, 30000.0):
            x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).reshape(-1, 32).clone()
            x[:, 31] = partner
            assert torch.equal(bits(kernel.fake_quantize(x)), bits(reference(x)))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1024, 64, generator=g) * torch.exp2(torch.randint(-149, 128, (1024, 1), generator=g).float())
    assert x[:8].numel() < kernel.ONE_THREAD_ELEMENTS <= x.numel()
    x[0, :32] = 0.0
    x[2, 5] = float("nan")
    x[3, 7] = float("-inf")
    for rows in (x[:8], x):
        assert torch.equal(bits(kernel.fake_quantize(rows)), bits(reference(rows)))
