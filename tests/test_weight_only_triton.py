"""Weight-only linear operators' Triton kernels (interpreted on the CPU without CUDA): bit-exact for every M."""

import pytest
import torch

from lowbit.kernels.cpu import weight_only as cpu

from weight_only_cases import OPS, WEIGHTS, assert_bits, gen

triton_kernels = pytest.importorskip("lowbit.kernels.triton.weight_only", reason="triton is not installed")


# --- Triton (interpreted on the CPU): bit-exact for every M ---------------------------------------------------

@pytest.mark.parametrize("fmt", WEIGHTS)
def test_triton_kernel_equals_the_reference(fmt):
    g = gen(8)
    k = 128 - (5 if fmt == "hifloat8" else 0) + (32 if fmt == "mxfp4" else 0)
    weight = WEIGHTS[fmt](17, k, g)  # 17 rows: a second, partly empty program
    x = torch.randn(cpu.GEMV_MAX_M + 2, k, generator=g).half()
    bias = torch.randn(17, generator=g).half()
    want = OPS[fmt](x, *weight, bias, backend="reference")
    got = torch.empty_like(want)
    getattr(triton_kernels, OPS[fmt].name.upper()).run(x, *weight, bias, out=got)
    assert_bits(got, want)


def test_triton_kernel_declares_its_grid_limit():
    x = torch.empty(1, 32, device="meta")
    too_many = torch.empty(16 * 65536, 16, dtype=torch.uint8, device="meta")
    assert "output features" in triton_kernels.MXFP4_LINEAR.supports(x, too_many, too_many[:, :1], None)
    assert triton_kernels.MXFP4_LINEAR.supports(x, too_many[:64], too_many[:64, :1], None) is None
