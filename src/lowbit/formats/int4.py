"""Signed INT4 weights: nibble packing and per-group quantization (docs/wqbmm.md, sections 'Int4 layout'
and 'Int4 weight quantization').

Packing: a row-major (K, N) int4 matrix (values -8..7, held in int8) becomes (K, N/2) uint8. Byte j of row
k holds column 2j in the LOW nibble (bits 0-3) and column 2j+1 in the HIGH nibble (bits 4-7), each as a
two's-complement nibble (-1 -> 0xF): ``(w[:, 1::2].astype(uint8) << 4) + (w[:, 0::2].astype(uint8) & 0x0F)``,
torchao's low-nibble-first order.

Per-group quantization (AMCT's INT4 weight quantization), per output column n and K-group g
(rows k with k // group_size == g), float32 math:

* symmetric: ``bound = max(|max(W_g, 0)|, |min(W_g, 0)|)``, ``scale = bound / (7 + [|max| < |min|])``,
  no offset;
* asymmetric: ``scale = (wmax - wmin) / 15``, ``offset = round_half_even(-8 - wmin / scale)`` (-8 when
  wmax == wmin);
* a scale below 1.192092896e-7 becomes 1.0 (and its offset -8);
* ``W_q = clamp(round_half_even(W / scale + offset), -8, 7)``; dequantization is ``(W_q - offset) * scale``;
* a non-finite weight, or a scale that overflows the scale dtype (|W| beyond about 7 * 65504 for FP16),
  raises ValueError naming the group and column: never an Inf scale.

The operator (CANN V2) is fed ``antiquant_offset = -offset`` so that ``y = x @ ((W_q + antiquant_offset) *
antiquant_scale)``; :func:`quantize_int4_per_group` returns that antiquant form directly.
"""

from __future__ import annotations

import torch

from lowbit.errors import DtypeError, ShapeError, check_int

INT4_MIN, INT4_MAX = -8, 7
_MIN_SCALE = 1.192092896e-7


def pack_int4(w_int4: torch.Tensor) -> torch.Tensor:
    """Pack (..., N) int8 values in [-8, 7] into (..., N/2) uint8, column 2j in the low nibble of byte j.

    Raises DtypeError for a non-int8 input, ShapeError for an odd last dimension, ValueError for a value
    outside [-8, 7].
    """
    if w_int4.dtype != torch.int8:
        raise DtypeError(f"pack_int4 expects int8 values in [-8, 7], got dtype {w_int4.dtype}")
    if w_int4.dim() == 0 or w_int4.shape[-1] % 2:
        raise ShapeError(f"pack_int4 needs an even last dimension, got shape {tuple(w_int4.shape)}")
    if w_int4.numel() and (w_int4.min() < INT4_MIN or w_int4.max() > INT4_MAX):
        raise ValueError("pack_int4: values must lie in [-8, 7]")
    nibbles = w_int4.to(torch.uint8) & 0x0F
    return (nibbles[..., 1::2] << 4) | nibbles[..., 0::2]


def unpack_int4(packed_u4x2: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: (..., N/2) uint8 -> (..., N) int8 values in [-8, 7]."""
    if packed_u4x2.dtype != torch.uint8:
        raise DtypeError(f"unpack_int4 expects uint8 packed nibbles, got dtype {packed_u4x2.dtype}")
    low = (packed_u4x2 & 0x0F).to(torch.int8)
    high = (packed_u4x2 >> 4).to(torch.int8)
    pairs = torch.stack((low, high), dim=-1).flatten(-2)
    return pairs - ((pairs & 0x08) << 1)  # two's complement nibble: 8..15 -> -8..-1


def quantize_int4_per_group(
    weight: torch.Tensor, group_size: int, *, dtype: torch.dtype = torch.float16, symmetric: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize a dense (K, N) weight to INT4 per (K-group, column).

    Returns ``(packed (K, N/2) uint8, antiquant_scale (K/G, N) dtype, antiquant_offset (K/G, N) dtype or
    None)`` such that ``((unpack_int4(packed) + antiquant_offset) * antiquant_scale)`` row k with group
    k // G approximates ``weight``. ``dtype`` is FP16 or BF16 (the activation dtype of the matmul).
    Raises ShapeError when the weight is not 2-D, K % group_size != 0 or N is odd (TypeError for a
    non-int group_size), DtypeError for another ``dtype``, ValueError for a non-finite weight or a scale
    that is not finite in ``dtype`` (the message names the K-group and column).
    """
    if weight.dim() != 2:
        raise ShapeError(f"weight must be (K, N), got shape {tuple(weight.shape)}")
    k, n = weight.shape
    check_int("group_size", group_size)
    if group_size <= 0 or k % group_size or n % 2:
        raise ShapeError(f"need K % group_size == 0 and even N, got (K, N) = ({k}, {n}), group_size {group_size}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise DtypeError(f"scale dtype must be float16 or bfloat16, got {dtype}")
    w = weight.to(torch.float32).reshape(k // group_size, group_size, n)
    _check_finite("weight (as float32)", w.isfinite().all(dim=1), w.abs().amax(dim=1))
    w_max = w.amax(dim=1).clamp(min=0)
    w_min = w.amin(dim=1).clamp(max=0)
    if symmetric:
        negative_wider = (w_max.abs() < w_min.abs()).to(torch.float32)
        scale = torch.maximum(w_max.abs(), w_min.abs()) / (7 + negative_wider)
        offset = torch.zeros_like(scale)
    else:
        scale = (w_max - w_min) / 15
        offset = torch.where(w_max == w_min, -8.0, torch.round(-8 - w_min / scale))
    tiny = scale < _MIN_SCALE
    scale = torch.where(tiny, 1.0, scale)
    offset = torch.where(tiny & (not symmetric), -8.0, offset)
    w_q = torch.clamp(torch.round(w / scale[:, None, :] + offset[:, None, :]), INT4_MIN, INT4_MAX)
    packed = pack_int4(w_q.to(torch.int8).reshape(k, n))
    antiquant_scale = scale.to(dtype)
    _check_finite(f"{dtype} scale", antiquant_scale.isfinite(), scale)
    antiquant_offset = None if symmetric else (-offset).to(dtype)
    return packed, antiquant_scale, antiquant_offset


def _check_finite(what: str, finite: torch.Tensor, values: torch.Tensor) -> None:
    """ValueError naming the first (K-group, column) where ``finite`` (K/G, N) is False."""
    if not bool(finite.all()):
        group, column = (int(i) for i in (~finite).nonzero()[0])
        raise ValueError(
            f"quantize_int4_per_group: the {what} of K-group {group}, column {column} is not finite "
            f"(float32 value {float(values[group, column])}); scale the weight down or use another dtype"
        )
