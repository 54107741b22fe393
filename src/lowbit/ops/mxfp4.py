"""MXFP4 operators: ``mxfp4_quantize``, ``mxfp4_dequantize`` and ``dynamic_mx_quant`` (docs/mxfp4.md).

Registered as ``torch.ops.lowbit.mxfp4_quantize`` / ``mxfp4_dequantize`` and their ``*_out`` variants
(see lowbit.ops.library), with fake implementations, so they work under torch.compile. The semantics,
layouts and policies are those of :mod:`lowbit.formats.mxfp4` (the reference kernel); the native kernels
(numba on CPU, Triton on CUDA) are bit-exact with it. No upstream operator has these names (the nearest is
torch_npu's ``npu_dynamic_mx_quant``, see :func:`dynamic_mx_quant`), so errors follow Python conventions
through :mod:`lowbit.errors`:

* DtypeError: an input dtype other than FP16/BF16/FP32, codes or scales not uint8 (or torch's
  float4_e2m1fn_x2 / float8_e8m0fnu views), an output dtype other than FP16/BF16/FP32/FP64;
* ShapeError: a 0-d input, an axis out of range, a block size that is odd, < 2 or does not divide the
  axis, codes and scales that do not fit (docs/mxfp4.md, section 'Operators');
* TypeError: ``block_size`` or ``axis`` not an int (bools and floats too); ValueError: an unknown
  ``scale_rule`` / ``rounding`` / ``round_mode`` (the message lists the allowed names);
* DeviceError: codes and scales (or out) on different devices.

``out=``: tensors of the output dtypes and shapes on the inputs' device; any strides, and they may share
memory with the inputs (computed through a temporary then). ``backend=``: "native", "reference" or
"auto" (default: the process default); see lowbit.backends.
"""

from __future__ import annotations

from typing import Optional

import torch

from lowbit import kernels
from lowbit.backends import Kernel, TensorSpec
from lowbit.errors import DtypeError, check_int
from lowbit.formats import mxfp4
from lowbit.ops.library import call, define

KERNEL_OUTPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # FP64 comes from the reference


def _quantize_outputs(x: torch.Tensor, block_size: int, scale_rule: str, rounding: str,
                      axis: int) -> tuple[TensorSpec, TensorSpec]:
    codes_shape, scales_shape, _ = mxfp4.quantized_shapes(x, block_size, scale_rule, rounding, axis)
    return TensorSpec(codes_shape, torch.uint8), TensorSpec(scales_shape, torch.uint8)


def _dequantize_outputs(codes: torch.Tensor, scales: torch.Tensor, dtype: Optional[torch.dtype],
                        axis: int) -> tuple[TensorSpec]:
    dtype = torch.bfloat16 if dtype is None else dtype
    out_shape, _, _ = mxfp4.dequantized_shape(codes, scales, dtype, axis)
    return (TensorSpec(out_shape, dtype),)


class _ReferenceQuantize(Kernel):
    def run(self, x, block_size, scale_rule, rounding, axis, *, out) -> None:
        codes, scales = mxfp4.quantize(x, block_size, scale_rule, rounding, axis)
        out[0].copy_(codes)
        out[1].copy_(scales)


class _ReferenceDequantize(Kernel):
    def run(self, codes, scales, dtype, axis, *, out) -> None:
        out.copy_(mxfp4.dequantize(codes, scales, out.dtype, axis))


def _probe_rows(dtype: torch.dtype) -> torch.Tensor:
    """(8, 64) ``dtype``: ties and their neighbours at three scales, a block with -0.0, NaN and -Inf, a
    zero block, dtype max / tiny / subnormal blocks, an all-subnormal row, and the negated ties."""
    finfo = torch.finfo(dtype)
    ties = torch.tensor(mxfp4.E2M1_MIDPOINTS * 10, dtype=torch.float64)[:63]
    rows = [torch.cat([torch.tensor([4.0 * 2.0**e]), ties * 2.0**e]) for e in (-3, 0, 9)]
    special = torch.zeros(64, dtype=torch.float64)
    special[1], special[33], special[40] = -0.0, float("nan"), float("-inf")
    extremes = torch.tensor([finfo.max, -finfo.max, finfo.tiny, finfo.smallest_normal / 8] * 16, dtype=torch.float64)
    rows += [special, extremes, torch.full((64,), finfo.tiny / 4, dtype=torch.float64)]
    x = torch.stack(rows).to(dtype)
    return torch.cat([x, torch.nextafter(x, torch.full_like(x, float("inf"))), -x[:2]])


def _quantize_probes():
    """Every input dtype x scale rule x rounding on the edge rows (blocks of 32), then the kernels' other
    paths: blocks of 2, 6 (not a power of two) and 64, another axis, and more blocks than one CPU task."""
    for dtype in mxfp4.INPUT_DTYPES:
        rows = _probe_rows(dtype)
        for rule in mxfp4.SCALE_RULES:
            for rounding in mxfp4.ROUNDINGS:
                yield rows, 32, rule, rounding, -1
    spread = torch.linspace(-7.0, 7.0, 96) * torch.exp2(torch.arange(96.0) % 40 - 20)
    yield spread.reshape(8, 12), 6, "nearest", "ta", -1
    yield spread.reshape(2, 48).to(torch.float16), 2, "rceil", "rne", -1
    yield spread.reshape(3, 32).T.contiguous().to(torch.bfloat16), 16, "even", "ta", 0
    yield _probe_rows(torch.bfloat16).repeat(1, 2), 64, "ceil", "rne", -1
    yield spread.repeat(90).reshape(1, -1).to(torch.bfloat16), 32, "floor", "ta", -1  # 270 blocks


def _dequantize_probes():
    """Every (scale byte, code byte) pair into every kernel output dtype, a quarter of the scale bytes per
    probe (32768 elements: the CPU kernel's serial form, so that a self-check compiles no parallel loop);
    another axis and block size."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(256).reshape(256, 256)
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).unsqueeze(1).repeat(1, 16)
    for dtype in KERNEL_OUTPUT_DTYPES:
        for first in range(0, 256, 64):
            yield codes[first : first + 64], scales[first : first + 64], dtype, -1
    varied = (torch.arange(20, dtype=torch.int32) * 13 % 256).to(torch.uint8).reshape(4, 5)
    yield codes[100:105, :24].T.contiguous(), varied, torch.float32, 0  # blocks of 12 along axis 0


QUANTIZE = define("mxfp4_quantize", "Tensor x, int block_size=32, str scale_rule='floor', str rounding='ta', "
                  "int axis=-1", _quantize_outputs, _ReferenceQuantize(), _quantize_probes,
                  kernels.native("mxfp4", "QUANTIZE", ("cpu", "cuda")), output_names=("codes", "scales"))
DEQUANTIZE = define("mxfp4_dequantize", "Tensor codes, Tensor scales, ScalarType? dtype=None, int axis=-1",
                    _dequantize_outputs, _ReferenceDequantize(), _dequantize_probes,
                    kernels.native("mxfp4", "DEQUANTIZE", ("cpu", "cuda")))


def mxfp4_quantize(x: torch.Tensor, block_size: int = 32, scale_rule: str = "floor", rounding: str = "ta",
                   axis: int = -1, *, out: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                   backend: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4-quantize ``x`` (FP16/BF16/FP32) in blocks of ``block_size`` along ``axis``.

    Returns ``(codes, scales)`` uint8 on x's device: codes (..., K/2, ...) with element 2i in the low
    nibble, scales (..., K/block_size, ...) E8M0 bytes. ``scale_rule``: floor (OCP, default), nearest, even,
    ceil, rceil; ``rounding``: "ta" (ties away, default) or "rne". Zero block -> scale 0x00; a block with
    NaN/Inf -> scale 0xFF and codes 0. ``out``: optional tuple (codes, scales) of uint8 tensors of those
    shapes on x's device, filled and returned. Errors: see the module docstring.
    """
    mxfp4.check_options(block_size, scale_rule, rounding, axis)
    return call(QUANTIZE, (x, block_size, scale_rule, rounding, axis), out, backend)


def mxfp4_dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    dtype: Optional[torch.dtype] = None,
    axis: int = -1,
    *,
    out: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Decode MXFP4 ``(codes, scales)`` (uint8, or float4_e2m1fn_x2 / float8_e8m0fnu views) into ``dtype``
    (None: ``out``'s dtype, else BF16).

    The block size is ``2 * codes.shape[axis] / scales.shape[axis]``. Exact for FP32/BF16/FP64 (one RNE
    rounding for FP16); a 0xFF scale gives NaN for its block. ``out``: optional tensor of the result shape
    and dtype on the codes' device, filled and returned. Errors: see the module docstring.
    """
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise DtypeError(f"mxfp4_dequantize: dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
    if out is not None and dtype is None and isinstance(out, torch.Tensor):
        dtype = out.dtype
    check_int("axis", axis)
    return call(DEQUANTIZE, (mxfp4.byte_view(codes), mxfp4.byte_view(scales), dtype, axis), out, backend)


def dynamic_mx_quant(
    x: torch.Tensor, block_size: int = 32, round_mode: str = "round", *, backend: Optional[str] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_npu's ``npu_dynamic_mx_quant`` layout through :func:`mxfp4_quantize`.

    Same contract as :func:`lowbit.formats.mxfp4.dynamic_mx_quant` (floor scale; "round" = TA, "rint" =
    RNE; codes (..., L/2), scales (..., ceil(L/64), 2); docs/mxfp4.md, section 'Layouts'), computed by
    ``backend``. ValueError for another round_mode, ShapeError for a block_size other than 32.
    """
    rounding = mxfp4.dynamic_mx_rounding(block_size, round_mode)
    codes, scales = mxfp4_quantize(x, 32, "floor", rounding, -1, backend=backend)
    return codes, mxfp4.scales_to_pairs(scales)
