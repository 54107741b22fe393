"""Shared cases of the weight-only tests: operators, kernels, weights of each format, bit comparisons."""

import torch

from lowbit.formats import hifloat4, hifloat8, mxfp4, mxfp8
from lowbit.formats import weight_only as reference
from lowbit.kernels.cpu import weight_only as cpu
from lowbit.ops import weight_only as ops


FINITE_HIF8 = [c for c in range(256) if abs(hifloat8.code_value(c)) < float("inf")]  # 253 codes, no NaN/Inf
OPS = {"hifloat8": ops.HIFLOAT8_LINEAR, "float8": ops.FLOAT8_E4M3FN_LINEAR, "mxfp8": ops.MXFP8_LINEAR,
       "mxfp4": ops.MXFP4_LINEAR, "hifloat4": ops.HIFLOAT4_LINEAR}
FINITE_E4M3 = [c for c in range(256) if c & 0x7F != 0x7F]  # 254 codes, no NaN


def bits(t):
    return t.view(torch.int16)


def assert_bits(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    differ = bits(got) != bits(want)
    assert not differ.any(), f"{int(differ.sum())} of {want.numel()} outputs differ, first at {differ.nonzero()[0]}"


def gen(seed):
    return torch.Generator().manual_seed(seed)


def hif8_weight(n, k, g, codes=FINITE_HIF8):
    table = torch.tensor(codes, dtype=torch.uint8)
    return table[torch.randint(0, len(table), (n, k), generator=g)], torch.rand(n, generator=g) + 0.5


def mxfp4_weight(n, k, g):
    return mxfp4.quantize(torch.randn(n, k, generator=g))


def hif4_weight(n, k, g):
    return hifloat4.pack(torch.randn(n, k, generator=g))


def fp8_weight(n, k, g):
    return hif8_weight(n, k, g, FINITE_E4M3)


def mxfp8_weight(n, k, g):
    return mxfp8.quantize(torch.randn(n, k, generator=g) * 10.0 ** torch.randint(-3, 4, (n, 1), generator=g))


WEIGHTS = {"hifloat8": hif8_weight, "float8": fp8_weight, "mxfp8": mxfp8_weight, "mxfp4": mxfp4_weight,
           "hifloat4": hif4_weight}
CPU_KERNELS = {"hifloat8": cpu.HIFLOAT8_LINEAR, "float8": cpu.FLOAT8_E4M3FN_LINEAR, "mxfp8": cpu.MXFP8_LINEAR,
               "mxfp4": cpu.MXFP4_LINEAR, "hifloat4": cpu.HIFLOAT4_LINEAR}


def native_equals_reference(op, *args):
    want = op(*args, backend="reference")
    assert_bits(op(*args, backend="native"), want)
    return want


# BF16 x with GEMV_MAX_M < M <= BATCH_MAX_M runs the batched kernel on AVX512-BF16 CPUs (BATCHED below), the
# GEMM path otherwise; GEMM_M is past both.
BATCHED = cpu.GEMV_MAX_M + 5
GEMM_M = cpu.BATCH_MAX_M + 3


def dense_weight(fmt, weight, dtype):
    """The reference's dense weight of format ``fmt``'s packed tensors ``weight``, for x of ``dtype``."""
    if fmt == "hifloat8":
        return reference.hifloat8_weight(*weight, dtype)
    if fmt == "float8":
        return reference.float8_e4m3fn_weight(*weight, dtype)
    if fmt == "mxfp8":
        return reference.mxfp8_weight(*weight, dtype)
    return {"mxfp4": reference.mxfp4_weight, "hifloat4": reference.hifloat4_weight}[fmt](*weight)
