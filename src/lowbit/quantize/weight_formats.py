"""Packed weight storage per element format: encode a (N, K) weight into named tensors, decode them back.

``decode(encode(w, ...), dtype)`` is the fake-quantized weight; deploy modules store the encoded tensors
and decode (or feed an operator) at run time, so fake quant and deploy see the same weight bit for bit.
Layouts: docs/quantize.md, "Packed layouts".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from lowbit.formats import mxfp8
from lowbit.formats.int4 import pack_int4
from lowbit.formats.wqbmm import dequantize_weight
from lowbit.ops.hifloat4 import hifloat4_pack, hifloat4_unpack
from lowbit.ops.mxfp4 import mxfp4_dequantize, mxfp4_quantize
from lowbit.quantize.elements import e4m3_codes, e4m3_values, hif8_codes, hif8_values

Tensors = dict[str, torch.Tensor]

# MXFP4 weights as AMCT's deploy quantizes them: 'even' shared exponent (bump above 1.75), RNE elements.
MXFP4_WEIGHT_RULE = ("even", "rne")


def _column(scale: torch.Tensor) -> torch.Tensor:
    return scale.reshape(-1, 1)


def _hif8_encode(w: torch.Tensor, scale: torch.Tensor, offset, group_size, compute_dtype) -> Tensors:
    return {"codes": hif8_codes(w.to(torch.float32) / _column(scale)), "scale": scale.to(torch.float32)}


def _hif8_decode(t: Tensors, dtype: torch.dtype, group_size) -> torch.Tensor:
    # AMCT fake quant: HiF8RT(W / s) in W's dtype, times s cast to W's dtype (product in W's dtype).
    return hif8_values(t["codes"], dtype) * _column(t["scale"]).to(dtype)


def _fp8_encode(w, scale, offset, group_size, compute_dtype) -> Tensors:
    return {"codes": e4m3_codes(w.to(torch.float32) / _column(scale)), "scale": scale.to(torch.float32)}


def _fp8_decode(t: Tensors, dtype, group_size) -> torch.Tensor:
    return (e4m3_values(t["codes"]) * _column(t["scale"])).to(dtype)


def _int8_encode(w, scale, offset, group_size, compute_dtype) -> Tensors:
    off = 0 if offset is None else _column(offset).to(torch.float32)
    q = torch.clamp(torch.round(w.to(torch.float32) / _column(scale) + off), -128, 127).to(torch.int8)
    out = {"codes": q, "scale": scale.to(torch.float32)}
    if offset is not None:
        out["offset"] = offset.to(torch.int32)
    return out


def _int8_decode(t: Tensors, dtype, group_size) -> torch.Tensor:
    q = t["codes"].to(torch.float32)
    if "offset" in t:
        q = q - _column(t["offset"]).to(torch.float32)
    return (q * _column(t["scale"])).to(dtype)


def _int4_encode(w, scale, offset, group_size, compute_dtype) -> Tensors:
    """(N, K) -> weight (K, N/2) packed int4, antiquant_scale (K/g, N) [, antiquant_offset] in compute_dtype."""
    n, k = w.shape
    s = scale.reshape(n, k // group_size, 1)
    o = 0 if offset is None else offset.reshape(n, k // group_size, 1).to(torch.float32)
    q = torch.clamp(torch.round(w.to(torch.float32).reshape(n, -1, group_size) / s + o), -8, 7)
    out = {"weight": pack_int4(q.reshape(n, k).T.contiguous().to(torch.int8)),
           "antiquant_scale": scale.reshape(n, -1).T.contiguous().to(compute_dtype)}
    if offset is not None:
        out["antiquant_offset"] = (-offset.reshape(n, -1).T).contiguous().to(compute_dtype)
    return out


def _int4_decode(t: Tensors, dtype, group_size) -> torch.Tensor:
    dense = dequantize_weight(t["weight"], t["antiquant_scale"], t.get("antiquant_offset"), group_size)
    return dense.T.to(dtype)


def _mxfp8_encode(w, scale, offset, group_size, compute_dtype) -> Tensors:
    codes, scales = mxfp8.quantize(w)
    return {"codes": codes, "scales": scales}


def _mxfp8_decode(t: Tensors, dtype, group_size) -> torch.Tensor:
    return mxfp8.dequantize(t["codes"], t["scales"], dtype)


def _mxfp4_encode(w, scale, offset, group_size, compute_dtype) -> Tensors:
    codes, scales = mxfp4_quantize(w, 32, *MXFP4_WEIGHT_RULE)
    return {"codes": codes, "scales": scales}


def _mxfp4_decode(t: Tensors, dtype, group_size) -> torch.Tensor:
    return mxfp4_dequantize(t["codes"], t["scales"], dtype)


def _hif4_encode(w, scale, offset, group_size, compute_dtype) -> Tensors:
    block_scale, value = hifloat4_pack(w.contiguous())
    return {"block_scale": block_scale, "value": value}


def _hif4_decode(t: Tensors, dtype, group_size) -> torch.Tensor:
    return hifloat4_unpack(t["block_scale"], t["value"], dtype)


@dataclass(frozen=True)
class WeightFormat:
    """One element format. ``scaled``: encode takes an algorithm-computed scale (and offset);
    otherwise the format computes its own block scales."""

    name: str
    scaled: bool
    encode: Callable[[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[int], torch.dtype],
                     Tensors]
    decode: Callable[[Tensors, torch.dtype, Optional[int]], torch.Tensor]


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    f.name: f for f in (
        WeightFormat("hifloat8", True, _hif8_encode, _hif8_decode),
        WeightFormat("float8_e4m3fn", True, _fp8_encode, _fp8_decode),
        WeightFormat("int8", True, _int8_encode, _int8_decode),
        WeightFormat("int4", True, _int4_encode, _int4_decode),
        WeightFormat("mxfp8_e4m3fn", False, _mxfp8_encode, _mxfp8_decode),
        WeightFormat("mxfp4_e2m1", False, _mxfp4_encode, _mxfp4_decode),
        WeightFormat("hifloat4", False, _hif4_encode, _hif4_decode),
    )
}


def fake_quant_weight(fmt: str, w: torch.Tensor, scale=None, offset=None, group_size=None,
                      compute_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``decode(encode(w))`` in w's dtype and shape (the fake-quantized weight); ``w`` (N, ...) is quantized
    as an (N, -1) matrix."""
    f = WEIGHT_FORMATS[fmt]
    rows = w.reshape(w.shape[0], -1)
    dense = f.decode(f.encode(rows, scale, offset, group_size, compute_dtype or w.dtype), w.dtype, group_size)
    return dense.reshape(w.shape)
