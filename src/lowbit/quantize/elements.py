"""Element casts the quantizers share: HiF8 codes of any float tensor, float8_e4m3fn codes.

HiF8 encoding rounds once from the exact input value, through the backend-routed public op (FP16/BF16
only). An FP32 value is first narrowed to BF16 with round-to-odd (truncate, then set the last bit if any
dropped bit was set): BF16 keeps 7 fraction bits, at least 4 more than any HiF8 grid, so the narrowed value
lies on the same side of every HiF8 rounding midpoint as the original and is a midpoint only when the
original is; the HiF8 code is therefore that of the exact FP32 value (one rounding, the NPU's native
``npu_quantize``; docs/quantize.md, "Quirks", double rounding). NaN stays NaN (its sticky bit), Inf stays Inf.
"""

from __future__ import annotations

import torch

from lowbit.formats import hifloat8 as hif8_reference
from lowbit.formats.mxfp8 import e4m3_codes, e4m3_values
from lowbit.ops import hifloat8 as hifloat8_ops
from lowbit.ops.library import run_direct

__all__ = ["e4m3_codes", "e4m3_values", "hif8_codes", "hif8_values", "hif8_round_trip"]

HIF8_MAX = hif8_reference.MAX_VALUE


def bf16_round_to_odd(v: torch.Tensor) -> torch.Tensor:
    """FP32 -> BF16 keeping the dropped bits as a sticky last bit (see the module docstring)."""
    bits = v.contiguous().view(torch.int32)
    high = (bits >> 16) | ((bits & 0xFFFF) != 0).to(torch.int32)
    return high.to(torch.int16).view(torch.bfloat16)


def hif8_codes(v: torch.Tensor) -> torch.Tensor:
    """HiF8 codes (uint8, v's shape) of a FP16/BF16/FP32 tensor, one rounding (ties away), saturating."""
    if v.dtype == torch.float32:
        v = bf16_round_to_odd(v)
    codes = None
    if v.dtype in hifloat8_ops.ENCODE_INPUT_DTYPES:  # the operator's kernel, without its dispatch where it may
        codes = run_direct(hifloat8_ops.ENCODE, (v,), v.shape, torch.uint8)
    return hifloat8_ops.encode_to_hifloat8(v) if codes is None else codes


def hif8_values(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Exact values of HiF8 ``codes`` in ``dtype`` (FP16/BF16/FP32)."""
    if dtype == torch.float32:
        return hif8_reference.decode(codes, torch.float32)
    values = None
    if dtype in hifloat8_ops.DECODE_OUTPUT_DTYPES and isinstance(codes, torch.Tensor) and codes.dtype == torch.uint8:
        values = run_direct(hifloat8_ops.DECODE, (codes, dtype), codes.shape, dtype)
    return hifloat8_ops.decode_from_hifloat8(codes, dtype) if values is None else values


def hif8_round_trip(v: torch.Tensor) -> torch.Tensor:
    """HiF8RT: encode then decode, in v's dtype."""
    return hif8_values(hif8_codes(v), v.dtype)
