"""Element casts the quantizers share: HiF8 codes of any float tensor, float8_e4m3fn codes.

HiF8 encoding rounds once from the exact input value (FP16/BF16 through the backend-routed public op,
FP32 through the reference encoder, which the public op does not take); this is the NPU's native
``npu_quantize`` path (docs/quantize.md, "Quirks", double rounding).
"""

from __future__ import annotations

import torch

from lowbit.formats import hifloat8 as hif8_reference
from lowbit.formats.mxfp8 import e4m3_codes, e4m3_values
from lowbit.ops.hifloat8 import decode_from_hifloat8, encode_to_hifloat8

__all__ = ["e4m3_codes", "e4m3_values", "hif8_codes", "hif8_values", "hif8_round_trip"]

HIF8_MAX = hif8_reference.MAX_VALUE


def hif8_codes(v: torch.Tensor) -> torch.Tensor:
    """HiF8 codes (uint8, v's shape) of a FP16/BF16/FP32 tensor, one rounding (ties away), saturating."""
    if v.dtype == torch.float32:
        return hif8_reference.encode(v)
    return encode_to_hifloat8(v)


def hif8_values(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Exact values of HiF8 ``codes`` in ``dtype`` (FP16/BF16/FP32)."""
    if dtype == torch.float32:
        return hif8_reference.decode(codes, torch.float32)
    return decode_from_hifloat8(codes, dtype)


def hif8_round_trip(v: torch.Tensor) -> torch.Tensor:
    """HiF8RT: encode then decode, in v's dtype."""
    return hif8_values(hif8_codes(v), v.dtype)
