"""Smoke check of the weight-only linear layers hifloat8_linear, float8_e4m3fn_linear, mxfp8_linear,
mxfp4_linear and hifloat4_linear (docs/weight_only.md), compared with the reference backend bit for bit.

Per operator and x dtype (BF16, FP16), on a weight of N = 40 rows (CPU generator seeded 2026):

* **decode** cases (the bit-exact path, M <= EXACT_ROWS rows): two K per format, the first not a
  multiple of 64 where the format allows one (the tail of a 64-lane step; HiFloat4's blocks are 64 long),
  the second with a bias in x's dtype; x of shape (1, K) and (1, 3, K), randn values with a 0, a large
  value (1000) and finfo(dtype).tiny in the first row; the weight a randn matrix quantized into the format.
* a **GEMM** case (M = EXACT_ROWS + 2 rows, the larger K, with a bias; the batched kernel where the CPU runs
  one at that M, else the GEMM path, docs/weight_only.md 'Kernels'): integer x in [-4, 4] and a weight
  quantized from multiples of 1/4 in [-4, 4] (each row holding a 4), so every product and partial sum
  is exact in float32 and every summation order gives the reference's bits: bit equality is the
  contract there too (docs/cli.md, "lowbit smoke").

Weights: HiFloat8 codes of the weight over its per-row scale amax / 32768 (float32), FP8 E4M3 codes over
the power of two at or above amax / 448, MXFP8 by lowbit.formats.mxfp8.quantize, MXFP4 by
lowbit.formats.mxfp4.quantize, HiFloat4 by lowbit.formats.hifloat4.pack. The reference is the operator
run with backend "reference" on the CPU copies; the error figures compare with the exact (float64)
product of x and the decoded weight, plus the bias. Extra keys: ``operator``, ``x_shape``, ``bias``
(its dtype or None), ``path`` ("decode" or "gemm").
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from lowbit.backends import Operator
from lowbit.cli.smoke._common import backend_that_ran, case_result, dtype_name
from lowbit.formats import hifloat4, hifloat8, mxfp4, mxfp8
from lowbit.formats.weight_only import EXACT_ROWS
from lowbit.ops.weight_only import (
    FLOAT8_E4M3FN_LINEAR,
    HIFLOAT4_LINEAR,
    HIFLOAT8_LINEAR,
    MXFP4_LINEAR,
    MXFP8_LINEAR,
    float8_e4m3fn_linear,
    hifloat4_linear,
    hifloat8_linear,
    mxfp4_linear,
    mxfp8_linear,
)

NAME = "weight_only"
OPERATORS = (HIFLOAT8_LINEAR, FLOAT8_E4M3FN_LINEAR, MXFP8_LINEAR, MXFP4_LINEAR, HIFLOAT4_LINEAR)
SEED = 2026
N = 40
GEMM_ROWS = EXACT_ROWS + 2
LARGE = 1000.0


def hifloat8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (N, K) uint8, scale (N,) float32) of a float32 weight: each row over its amax / 32768."""
    scale = w.abs().amax(1) / hifloat8.MAX_VALUE
    return hifloat8.encode(w / scale.unsqueeze(1)), scale


def hifloat8_dense(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The (N, K) float32 weight that HiFloat8 ``codes`` and ``scale`` stand for."""
    return hifloat8.decode(codes, torch.float32) * scale.unsqueeze(1)


def float8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (N, K) uint8 float8_e4m3fn, scale (N,) float32) of a float32 weight: each row over the power of
    two at or above amax / 448 (so the GEMM case's weights stay multiples of 1/4)."""
    scale = torch.exp2(torch.ceil(torch.log2(w.abs().amax(1) / mxfp8.E4M3_MAX)))
    return mxfp8.e4m3_codes(w / scale.unsqueeze(1)), scale


def float8_dense(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The (N, K) float32 weight that FP8 E4M3 ``codes`` and ``scale`` stand for."""
    return mxfp8.e4m3_values(codes) * scale.unsqueeze(1)


def mxfp8_dense(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The (N, K) float32 weight of MXFP8 ``codes`` and ``scales``."""
    return mxfp8.dequantize(codes, scales, torch.float32)


def mxfp4_dense(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The (N, K) float32 weight of MXFP4 ``codes`` and ``scales``."""
    return mxfp4.dequantize(codes, scales, torch.float32)


def hifloat4_dense(scale: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The (N, K) float32 weight of packed HiFloat4 ``scale`` and ``value``."""
    return hifloat4.unpack(scale, value, torch.float32)


def formats() -> tuple[tuple[Callable, Operator, tuple[int, int], Callable, Callable], ...]:
    """Per operator: (its public function, its Operator, the two K of the decode cases, quantize: float32
    (N, K) -> its two weight tensors, dense: those tensors -> the (N, K) float32 weight)."""
    return (
        (hifloat8_linear, HIFLOAT8_LINEAR, (100, 128), hifloat8_weight, hifloat8_dense),
        (float8_e4m3fn_linear, FLOAT8_E4M3FN_LINEAR, (100, 128), float8_weight, float8_dense),
        (mxfp8_linear, MXFP8_LINEAR, (96, 128), mxfp8.quantize, mxfp8_dense),
        (mxfp4_linear, MXFP4_LINEAR, (96, 128), mxfp4.quantize, mxfp4_dense),
        (hifloat4_linear, HIFLOAT4_LINEAR, (128, 192), hifloat4.pack, hifloat4_dense),
    )


def decode_x(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """randn x of ``shape`` in ``dtype``; its first row starts with 0, LARGE and finfo(dtype).tiny."""
    x = torch.randn(shape, generator=generator)
    x.view(-1, shape[-1])[0, :3] = torch.tensor([0.0, LARGE, torch.finfo(dtype).tiny])
    return x.to(dtype)


def gemm_operands(k: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(x (GEMM_ROWS, K) float32 of integers in [-4, 4], weight (N, K) float32 of multiples of 1/4 in
    [-4, 4] whose rows start with 4) of the GEMM case: exact sums in any order."""
    x = torch.randint(-4, 5, (GEMM_ROWS, k), generator=generator).float()
    w = torch.randint(-16, 17, (N, k), generator=generator).float() / 4
    w[:, 0] = 4.0
    return x, w


def _case(function: Callable, op: Operator, dense: Callable, backend: str, device: torch.device,
          x: torch.Tensor, weight: tuple, bias: Optional[torch.Tensor], path: str) -> dict:
    """Run ``function`` on the device and ``op``'s reference backend on the CPU; one result."""
    want = op(x, *weight, bias, backend="reference")
    on_device = [t.to(device) if t is not None else None for t in (x, *weight, bias)]
    y = function(*on_device, backend=backend)
    exact = x.double() @ dense(*weight).double().T
    return case_result(
        backend=backend_that_ran(op.name),
        input_dtype=x.dtype,
        output=y,
        reference=want,
        expected_shape=(*x.shape[:-1], N),
        expected_dtype=x.dtype,
        expected_device=device,
        error_target=exact if bias is None else exact + bias.double(),
        operator=op.name,
        x_shape=list(x.shape),
        bias=None if bias is None else dtype_name(bias.dtype),
        path=path,
    )


def run(backend: str, device: torch.device) -> list[dict]:
    """One result per (operator, x dtype, case): 4 decode cases and 1 GEMM case each."""
    results = []
    for function, op, ks, quantize, dense in formats():
        generator = torch.Generator().manual_seed(SEED)
        for dtype in (torch.bfloat16, torch.float16):
            for k, with_bias in zip(ks, (False, True)):
                weight = quantize(torch.randn(N, k, generator=generator))
                bias = torch.randn(N, generator=generator).to(dtype) if with_bias else None
                for shape in ((1, k), (1, 3, k)):
                    x = decode_x(shape, dtype, generator)
                    results.append(_case(function, op, dense, backend, device, x, weight, bias, "decode"))
            x, w = gemm_operands(ks[1], generator)
            bias = torch.randint(-4, 5, (N,), generator=generator).to(dtype)
            results.append(_case(function, op, dense, backend, device, x.to(dtype), quantize(w), bias, "gemm"))
    return results
