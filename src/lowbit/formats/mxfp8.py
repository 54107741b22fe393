"""MXFP8 (OCP MX, E4M3 elements): the reference quantizer and dequantizer (docs/quantize.md, "MXFP8").

A block of 32 consecutive elements along the last axis shares one E8M0 scale byte ``b`` (value
``2^(b - 127)``); each element is a ``float8_e4m3fn`` code (1 sign, 4 exponent bits with bias 7, 3 mantissa
bits; largest finite 448, no Inf; 0x7F / 0xFF are NaN).

    shared_exp = floor(log2 amax) - 8            (emax of E4M3 is 8), clamped to [-127, 127]
    codes      = e4m3fn(x / 2^shared_exp), round to nearest even, saturating to +-448
    scale byte = shared_exp + 127

``floor(log2 amax)`` comes from the exponent bits (``frexp``), never from a float log2. Policies (as
lowbit's MXFP4): an all-zero block gets byte 0x00 and zero codes; a block holding NaN or +-Inf gets the
NaN scale 0xFF and zero codes, so it dequantizes to NaN. Codes are uint8 (the bit pattern of the
``float8_e4m3fn`` value) of x's shape; scales uint8 of shape (..., K / 32).
"""

from __future__ import annotations

import torch

from lowbit.errors import DtypeError, ShapeError

BLOCK = 32
E4M3_EMAX = 8
E4M3_MAX = 448.0
E8M0_BIAS = 127
NAN_SCALE = 0xFF
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(x: torch.Tensor) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise DtypeError(f"mxfp8 quantize expects float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % BLOCK:
        raise ShapeError(f"mxfp8 quantize needs a last dimension divisible by {BLOCK}, got shape {tuple(x.shape)}")


def e4m3_codes(v: torch.Tensor) -> torch.Tensor:
    """uint8 bit patterns of ``float8_e4m3fn(v)`` with RNE and saturation to +-448 (torch's cast alone gives
    NaN past 464); NaN stays NaN. ``v``: float32."""
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of uint8 ``float8_e4m3fn`` bit patterns (exact)."""
    return codes.view(torch.float8_e4m3fn).to(torch.float32)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8-quantize ``x`` (FP16/BF16/FP32, last dim % 32 == 0) -> (codes uint8 x.shape, scales uint8
    (..., K/32)) on x's device. DtypeError / ShapeError otherwise."""
    _check(x)
    blocks = x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)  # (-1 fails with no rows)
    amax = blocks.abs().amax(dim=-1)
    finite = torch.isfinite(amax)
    _, exponent = torch.frexp(torch.where(finite, amax, 0.0))
    shared = torch.where(amax == 0, -E8M0_BIAS, exponent.to(torch.int32) - 1 - E4M3_EMAX).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = blocks * torch.ldexp(torch.ones_like(amax), -shared)[..., None]
    codes = torch.where(finite[..., None], e4m3_codes(scaled), 0)
    scales = torch.where(finite, shared + E8M0_BIAS, NAN_SCALE).to(torch.uint8)
    return codes.to(torch.uint8).reshape(x.shape), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode (codes, scales) from :func:`quantize` into ``dtype`` (product exact in float32, then one cast)."""
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise DtypeError(f"mxfp8 dequantize expects uint8 codes and scales, got {codes.dtype}, {scales.dtype}")
    if codes.shape[:-1] != scales.shape[:-1] or codes.shape[-1] != BLOCK * scales.shape[-1]:
        raise ShapeError(f"mxfp8 dequantize: codes {tuple(codes.shape)} do not match scales {tuple(scales.shape)}")
    exponent = scales.to(torch.int32) - E8M0_BIAS
    powers = torch.ldexp(torch.ones(exponent.shape, device=codes.device), exponent)
    factor = torch.where(scales == NAN_SCALE, float("nan"), powers)
    values = e4m3_values(codes).reshape(*scales.shape, BLOCK) * factor[..., None]
    return values.reshape(codes.shape).to(dtype)
