"""MXFP4 operators: ``mxfp4_quantize`` and ``mxfp4_dequantize`` (formats.md section 3).

Registered as ``torch.ops.lowbit.mxfp4_quantize`` / ``mxfp4_dequantize`` with fake implementations.
The semantics, layouts and policies are those of :mod:`lowbit.formats.mxfp4` (the reference backend);
the native backends (numba on CPU, Triton on CUDA) are bit-exact with it. No upstream operator exists
with this name (the nearest is torch_npu's ``npu_dynamic_mx_quant``, see
:func:`lowbit.formats.mxfp4.dynamic_mx_quant`), so errors follow Python conventions through
:mod:`lowbit.errors` (DtypeError, ShapeError, DeviceError) and ValueError for bad option names.
"""

from __future__ import annotations

from typing import Optional

import torch

from lowbit import backends
from lowbit.errors import DeviceError, DtypeError, ShapeError
from lowbit.formats import mxfp4

QUANTIZE = "mxfp4_quantize"
DEQUANTIZE = "mxfp4_dequantize"


def _probe() -> torch.Tensor:
    """Self-check input: ties, saturation, signed zeros, zero/NaN/Inf blocks, wide exponents (4 x 64)."""
    ties = torch.tensor(mxfp4.E2M1_MIDPOINTS * 10)[:64]
    spread = torch.linspace(-7.0, 7.0, 64) * torch.exp2(torch.arange(64.0) % 40 - 20)
    special = torch.zeros(64)
    special[1], special[40], special[33] = -0.0, float("nan"), float("inf")
    return torch.stack([ties, spread, special, -ties * 3])


def _check_quantize(fn, device: torch.device) -> None:
    """Native == reference, bit for bit, for every input dtype, scale rule and rounding on the probe."""
    for dtype in mxfp4.INPUT_DTYPES:
        x = _probe().to(dtype)
        for rule in mxfp4.SCALE_RULES:
            for rounding in mxfp4.ROUNDINGS:
                got = fn(x.to(device), 32, rule, rounding, -1)
                want = mxfp4.quantize(x, 32, rule, rounding, -1)
                if not all(torch.equal(g.cpu(), w) for g, w in zip(got, want)):
                    raise RuntimeError(
                        f"native mxfp4 quantize differs from the reference ({dtype}, {rule}, {rounding})"
                    )


def _check_dequantize(fn, device: torch.device) -> None:
    """Native == reference, bit for bit, for every (scale byte, code byte) pair and output dtype."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(256).reshape(256, 256)
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).unsqueeze(1).repeat(1, 16)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        got = fn(codes.to(device), scales.to(device), dtype, -1).cpu()
        want = mxfp4.dequantize(codes, scales, dtype, -1)
        if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
            raise RuntimeError(f"native mxfp4 dequantize differs from the reference ({dtype})")


QUANTIZE_DISPATCH = backends.register(
    backends.Dispatcher(
        op=QUANTIZE,
        reference=mxfp4.quantize,
        native={
            "cpu": "lowbit.kernels.cpu.mxfp4:quantize",
            "cuda": "lowbit.kernels.triton.mxfp4:quantize",
        },
        self_check=_check_quantize,
    )
)
DEQUANTIZE_DISPATCH = backends.register(
    backends.Dispatcher(
        op=DEQUANTIZE,
        reference=mxfp4.dequantize,
        native={
            "cpu": "lowbit.kernels.cpu.mxfp4:dequantize",
            "cuda": "lowbit.kernels.triton.mxfp4:dequantize",
        },
        self_check=_check_dequantize,
    )
)


@torch.library.custom_op("lowbit::mxfp4_quantize", mutates_args=())
def _quantize_op(
    x: torch.Tensor, block_size: int, scale_rule: str, rounding: str, axis: int, backend: Optional[str] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    mxfp4.quantized_shapes(x, block_size, scale_rule, rounding, axis)
    return QUANTIZE_DISPATCH.select(x.device, backend)(x, block_size, scale_rule, rounding, axis)


@_quantize_op.register_fake
def _(x, block_size, scale_rule, rounding, axis, backend=None):
    codes_shape, scales_shape, _ = mxfp4.quantized_shapes(x, block_size, scale_rule, rounding, axis)
    return x.new_empty(codes_shape, dtype=torch.uint8), x.new_empty(scales_shape, dtype=torch.uint8)


@torch.library.custom_op("lowbit::mxfp4_quantize_out", mutates_args=("codes", "scales"))
def _quantize_out_op(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    block_size: int,
    scale_rule: str,
    rounding: str,
    axis: int,
    backend: Optional[str] = None,
) -> None:
    _validate_quantize_out(x, codes, scales, block_size, scale_rule, rounding, axis)
    fn = QUANTIZE_DISPATCH.select(x.device, backend)
    last = axis % x.dim() == x.dim() - 1
    numba_kernel = x.device.type == "cpu" and fn is not mxfp4.quantize  # the one that takes out=
    if numba_kernel and last and codes.is_contiguous() and scales.is_contiguous():
        fn(x, block_size, scale_rule, rounding, axis, out=(codes, scales))  # no temporaries
        return
    got_codes, got_scales = fn(x, block_size, scale_rule, rounding, axis)
    codes.copy_(got_codes)
    scales.copy_(got_scales)


@_quantize_out_op.register_fake
def _(x, codes, scales, block_size, scale_rule, rounding, axis, backend=None):
    _validate_quantize_out(x, codes, scales, block_size, scale_rule, rounding, axis)


def _validate_quantize_out(x, codes, scales, block_size, scale_rule, rounding, axis):
    codes_shape, scales_shape, _ = mxfp4.quantized_shapes(x, block_size, scale_rule, rounding, axis)
    for name, t, shape in (("codes", codes, codes_shape), ("scales", scales, scales_shape)):
        if t.dtype != torch.uint8:
            raise DtypeError(f"mxfp4_quantize: out {name} must be uint8, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ShapeError(f"mxfp4_quantize: out {name} must have shape {shape}, got {tuple(t.shape)}")
        if t.device != x.device:
            raise DeviceError(f"mxfp4_quantize: out {name} is on {t.device} but x is on {x.device}")


@torch.library.custom_op("lowbit::mxfp4_dequantize", mutates_args=())
def _dequantize_op(
    codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, axis: int, backend: Optional[str] = None
) -> torch.Tensor:
    _validate_dequantize(codes, scales, dtype, axis)
    return DEQUANTIZE_DISPATCH.select(codes.device, backend)(codes, scales, dtype, axis)


@_dequantize_op.register_fake
def _(codes, scales, dtype, axis, backend=None):
    out_shape, _, _ = _validate_dequantize(codes, scales, dtype, axis)
    return codes.new_empty(out_shape, dtype=dtype)


@torch.library.custom_op("lowbit::mxfp4_dequantize_out", mutates_args=("out",))
def _dequantize_out_op(
    codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, axis: int, backend: Optional[str] = None
) -> None:
    _validate_dequantize_out(codes, scales, out, axis)
    fn = DEQUANTIZE_DISPATCH.select(codes.device, backend)
    numba_kernel = codes.device.type == "cpu" and fn is not mxfp4.dequantize  # the one that takes out=
    last = axis % codes.dim() == codes.dim() - 1
    if numba_kernel and last and out.is_contiguous() and out.dtype != torch.float64:
        fn(codes, scales, out.dtype, axis, out=out)  # no temporary
        return
    out.copy_(fn(codes, scales, out.dtype, axis))


@_dequantize_out_op.register_fake
def _(codes, scales, out, axis, backend=None):
    _validate_dequantize_out(codes, scales, out, axis)


def _validate_dequantize_out(codes, scales, out, axis):
    out_shape, _, _ = _validate_dequantize(codes, scales, out.dtype, axis)
    if tuple(out.shape) != out_shape:
        raise ShapeError(f"mxfp4_dequantize: out must have shape {out_shape}, got {tuple(out.shape)}")
    if out.device != codes.device:
        raise DeviceError(f"mxfp4_dequantize: out is on {out.device} but codes are on {codes.device}")


def _validate_dequantize(codes, scales, dtype, axis):
    if codes.device != scales.device:
        raise DeviceError(f"mxfp4_dequantize: codes on {codes.device} but scales on {scales.device}")
    return mxfp4.dequantized_shape(mxfp4.as_uint8(codes), mxfp4.as_uint8(scales), dtype, axis)


def mxfp4_quantize(
    x: torch.Tensor,
    block_size: int = 32,
    scale_rule: str = "floor",
    rounding: str = "ta",
    axis: int = -1,
    *,
    out: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4-quantize ``x`` (FP16/BF16/FP32) in blocks of ``block_size`` along ``axis``.

    Returns ``(codes, scales)`` uint8 on x's device: codes (..., K/2, ...) with element 2i in the low nibble,
    scales (..., K/block_size, ...) E8M0 bytes. ``scale_rule``: floor (OCP, default), nearest, even, ceil,
    rceil; ``rounding``: "ta" (ties away, default) or "rne". Zero block -> scale 0x00; a block with NaN/Inf
    -> scale 0xFF and codes 0. ``out``: optional (codes, scales) uint8 tensors of those shapes on x's device,
    filled and returned (on the CPU with contiguous outputs and the last axis, without temporaries).
    ``backend``: "native", "reference" or "auto". See lowbit.formats.mxfp4.
    """
    if out is None:
        return torch.ops.lowbit.mxfp4_quantize(x, block_size, scale_rule, rounding, axis, backend)
    codes, scales = out
    torch.ops.lowbit.mxfp4_quantize_out(x, codes, scales, block_size, scale_rule, rounding, axis, backend)
    return codes, scales


def mxfp4_dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    axis: int = -1,
    *,
    out: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Decode MXFP4 ``(codes, scales)`` (uint8, or float4_e2m1fn_x2 / float8_e8m0fnu views) into ``dtype``.

    The block size is ``2 * codes.shape[axis] / scales.shape[axis]``. Exact for FP32/BF16 (one rounding
    for FP16); a 0xFF scale gives NaN for its block. ``out``: optional tensor of the result shape on the
    codes' device and of ``dtype``, filled and returned. ``backend``: "native", "reference" or "auto".
    """
    codes, scales = mxfp4.as_uint8(codes), mxfp4.as_uint8(scales)
    if out is None:
        return torch.ops.lowbit.mxfp4_dequantize(codes, scales, dtype, axis, backend)
    if out.dtype != dtype:
        raise DtypeError(f"mxfp4_dequantize: dtype={dtype} but out has dtype {out.dtype}")
    torch.ops.lowbit.mxfp4_dequantize_out(codes, scales, out, axis, backend)
    return out


def dynamic_mx_quant(
    x: torch.Tensor, block_size: int = 32, round_mode: str = "round", *, backend: Optional[str] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_npu's ``npu_dynamic_mx_quant`` layout through the backend-routed quantizer.

    Same contract as :func:`lowbit.formats.mxfp4.dynamic_mx_quant` (floor scale; "round" = TA, "rint" =
    RNE; codes (..., L/2), scales (..., ceil(L/64), 2)), computed by ``backend``.
    """
    rounding = mxfp4.DYNAMIC_MX_ROUND_MODES.get(round_mode)
    if rounding is None:
        raise ValueError(f"dynamic_mx_quant: round_mode must be 'round' or 'rint', got {round_mode!r}")
    if block_size != 32:
        raise ValueError(f"dynamic_mx_quant: only block_size 32 is supported, got {block_size}")
    codes, scales = mxfp4_quantize(x, 32, "floor", rounding, -1, backend=backend)
    return codes, mxfp4.scales_to_pairs(scales)
