"""Reference A16W4 per-group weight-quant matmul (WeightQuantBatchMatmul): MSD and dequant numerics.

Operands (docs/wqbmm.md, section 'Contract'): x (M, K) FP16/BF16; weight (K, N/2) uint8 = packed int4
(docs/wqbmm.md, section 'Int4 layout'); antiquant_scale (K/G, N) in x's dtype; optional antiquant_offset
(K/G, N) in x's dtype; row k of the weight uses scale row k // G. Mathematically
``y = x @ ((W + offset) * scale)``; y (M, N) in x's dtype.

MSD ("multi-stage decomposition", the Ascend kernel's numerics; docs/wqbmm.md, section 'MSD numerics'),
per K-group g and row m, all float32 in exactly this order (no fused multiply-add):

    a_max = max |a|                                 over the row's G values of the group
    t1 = (a / a_max) * F1;  A1 = rint(t1)           rint = round half to even, |Ai| <= 7
    t2 = (t1 - A1) * F2;    A2 = rint(t2)
    t3 = (t2 - A2) * F2;    A3 = rint(t3)
    Yi = sum_k Ai[k] * W[k, n]                      exact integers
    Yi = float32(Yi) + float32(sum_k Ai[k]) * offset[g, n]     (only with an offset: Ai @ (W + offset))
    c  = (Y1 * R1 + Y2 * R2) + Y3 * R3
    acc = acc + (c * scale[g, n]) * a_max           acc starts at +0
    y  = acc rounded (RNE) to x's dtype after the last group

Decisions (docs/wqbmm.md, section 'Decisions'): a_max is per row for every M; a group whose row is all
zeros contributes exactly 0; a NaN or infinity in a row's group makes that row's output NaN; every NaN
output is the canonical positive quiet NaN (FP16 0x7E00, BF16 0x7FC0).

``dequant`` (docs/wqbmm.md, section 'Dequant numerics'): ``w = ((W + offset) * scale)`` in float32 rounded
to x's dtype, then ``y[m, n] = sum_k x[m, k] * w[k, n]`` accumulated in float32 in ascending k (a fixed
order: the same bits for any thread count and on any machine).

F1, F2, R1, R2, R3 are the one definition of the MSD constants; the kernels import them.
"""

from __future__ import annotations

import torch

from lowbit.formats.int4 import unpack_int4
from lowbit.formats.weight_only import order_interval


def _float32(value: torch.Tensor | float) -> float:
    """A float32 value as the Python float that holds it exactly."""
    return float(torch.as_tensor(value, dtype=torch.float32))


_F1 = torch.tensor(7.49, dtype=torch.float32)
_F2 = torch.tensor(14.98, dtype=torch.float32)
F1 = _float32(_F1)  # float32(7.49): A1's scale
F2 = _float32(_F2)  # float32(14.98): A2's and A3's scale
# Reciprocals as float32 computes them (float32 products, then float32(1) / product).
_ONE = torch.tensor(1.0, dtype=torch.float32)
R1 = _float32(_ONE / _F1)
R2 = _float32(_ONE / (_F1 * _F2))
R3 = _float32(_ONE / (_F1 * _F2 * _F2))
_R1, _R2, _R3 = (torch.tensor(r, dtype=torch.float32) for r in (R1, R2, R3))


def msd_decompose(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split one group of float32 activations (M, G) into (A1, A2, A3, a_max).

    A1..A3 are float32 integers in [-7, 7] (NaN where the input is not finite), a_max is (M, 1) float32.
    Rows with a_max = 0 get A = 0 (instead of 0/0).
    """
    a_max = a.abs().amax(dim=1, keepdim=True)
    t1 = torch.where(a_max == 0, 0.0, a / a_max * _F1)
    a1 = torch.round(t1)
    t2 = (t1 - a1) * _F2
    a2 = torch.round(t2)
    t3 = (t2 - a2) * _F2
    a3 = torch.round(t3)
    return a1, a2, a3, a_max


def canonicalize_nan(acc: torch.Tensor) -> torch.Tensor:
    """Replace every NaN by the canonical positive quiet NaN."""
    return torch.where(torch.isnan(acc), torch.tensor(float("nan"), dtype=acc.dtype), acc)


def wqbmm_msd(x: torch.Tensor, weight: torch.Tensor, antiquant_scale: torch.Tensor,
               antiquant_offset: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """MSD matmul of x (M, K) with the packed (K, N/2) weight; returns (M, N) in x's dtype.

    Inputs are assumed validated (lowbit.ops.wqbmm does it). Runs on x's device.
    """
    w = unpack_int4(weight).to(torch.float32)  # (K, N), exact small integers
    x32 = x.to(torch.float32)
    scale32 = antiquant_scale.to(torch.float32)
    acc = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
    for g in range(x.shape[1] // group_size):
        rows = slice(g * group_size, (g + 1) * group_size)
        a1, a2, a3, a_max = msd_decompose(x32[:, rows])
        # |Ai @ W| <= G * 7 * 8 < 2**24: float32 matmuls of these integers are exact in any order.
        y1, y2, y3 = (ai @ w[rows] for ai in (a1, a2, a3))
        if antiquant_offset is not None:
            offset32 = antiquant_offset[g].to(torch.float32)
            y1, y2, y3 = (y + ai.sum(dim=1, keepdim=True) * offset32 for y, ai in ((y1, a1), (y2, a2), (y3, a3)))
        c = y1 * _R1 + y2 * _R2 + y3 * _R3
        term = (c * scale32[g]) * a_max
        acc = acc + torch.where(a_max == 0, 0.0, term)
    return canonicalize_nan(acc).to(x.dtype)


def dequantize_weight(
    weight: torch.Tensor, antiquant_scale: torch.Tensor, antiquant_offset: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    """(K, N) dense weight ``(W + offset) * scale`` computed in float32, rounded to the scale's dtype."""
    w = unpack_int4(weight).to(torch.float32)
    if antiquant_offset is not None:
        w = w + antiquant_offset.to(torch.float32).repeat_interleave(group_size, dim=0)
    return (w * antiquant_scale.to(torch.float32).repeat_interleave(group_size, dim=0)).to(antiquant_scale.dtype)


def _dequant_sums(x: torch.Tensor, w32: torch.Tensor) -> torch.Tensor:
    """(M, N) float32: products of x (M, K) and the dequantized w32 (K, N) summed in ascending k."""
    x32 = x.to(torch.float32)
    acc = torch.zeros(x.shape[0], w32.shape[1], dtype=torch.float32, device=x.device)
    for k in range(x.shape[1]):  # elementwise mul, then add: never fused, never reordered
        acc.add_(x32[:, k : k + 1] * w32[k])
    return acc


def wqbmm_dequant(x: torch.Tensor, weight: torch.Tensor, antiquant_scale: torch.Tensor,
                  antiquant_offset: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """``x @ dequantize_weight(...)``: float32 products summed in ascending k (one fixed order, so the
    bits do not depend on the thread count or the machine); (M, N) in x's dtype."""
    w32 = dequantize_weight(weight, antiquant_scale, antiquant_offset, group_size).to(torch.float32)
    return canonicalize_nan(_dequant_sums(x, w32)).to(x.dtype)


def dequant_interval(x: torch.Tensor, weight: torch.Tensor, antiquant_scale: torch.Tensor,
                     antiquant_offset: torch.Tensor | None, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi), (M, N) in x's dtype: where any float32 summation of the dequant products (any order, with
    or without fused multiply-adds or flushed subnormals) rounded once to x's dtype lies, around
    :func:`wqbmm_dequant` (a term passes through at most K rounded operations there). Meaningful where the
    absolute products sum to a finite value below the FP32 range (docs/wqbmm.md, 'Dequant numerics')."""
    w32 = dequantize_weight(weight, antiquant_scale, antiquant_offset, group_size).to(torch.float32)
    x64, w64 = x.to(torch.float64), w32.to(torch.float64)
    r = _dequant_sums(x, w32).to(torch.float64)
    s = x64.abs() @ w64.abs()
    flushed = x64.abs().sum(-1, keepdim=True) + w64.abs().sum(0) + (x.shape[-1] + 2)
    return order_interval(r, s, flushed, x.shape[-1], x.shape[-1], x.dtype)
