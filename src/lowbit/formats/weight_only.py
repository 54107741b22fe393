"""Weight-only linear layers: the reference numerics (docs/weight_only.md).

``y = x @ W.T + bias`` with a quantized weight W (N, K) that is never materialized in full precision by the
fast kernels. The reference here is the definition every kernel follows (docs/weight_only.md, sections
'Weights' and 'Summation order'):

1. **Weight**: each format's weight decoded to float32 (HiFloat8: dequantized in x's dtype, as AMCT's
   fake quant and an NPU's antiquant do: the code's value in x's dtype times the row scale rounded to x's
   dtype, the product rounded to x's dtype; FP8 E4M3: the code's value times the FP32 row scale in
   float32, then rounded to x's dtype, as fake quant does; MXFP8: the E4M3 value times the block's E8M0
   scale in float32, then rounded to x's dtype; MXFP4: E2M1 value times the E8M0 scale, exact except that a
   product beyond FP32's range is +-Inf; HiFloat4: exact). A NaN code or NaN scale gives NaN.
2. **Products**: ``p = fl32(x_k * w_k)`` with x widened exactly to float32.
3. **Sum**: 64 lanes; lane ``j`` adds the products of ``k = j, j + 64, j + 128, ...`` in order, starting
   from +0.0 (a K that is not a multiple of 64 leaves the last lanes short: they add nothing). Then the
   64 lane sums are folded pairwise: ``lane[i] += lane[i + h]`` for ``i < h``, h = 32, 16, 8, 4, 2, 1.
4. **Output**: ``fl32(sum + bias)`` (bias widened exactly to float32), rounded once (to nearest, ties to
   even) to x's dtype; a NaN output is the dtype's canonical quiet NaN (BF16 0x7FC0, FP16 0x7E00).

:func:`gemm_interval` is the tolerance of kernels that sum in another order (the tiled-GEMM path of
batches of more than ``EXACT_ROWS`` rows): docs/weight_only.md, section 'Tolerance of the GEMM path';
:func:`meets_contract` checks a kernel's result against both.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from lowbit.dtypes import QUIET_NAN_BITS, bit_view
from lowbit.formats import hifloat4, hifloat8, mxfp4, mxfp8

LANES = 64  # summation lanes along K
EXACT_ROWS = 4  # every kernel gives the reference's bits for x with up to this many rows (decoding)
NAN_BITS = QUIET_NAN_BITS  # the canonical NaN of each output dtype
_FP32_UNIT_ROUNDOFF = 2.0**-24
_FP32_MIN_SUBNORMAL = 2.0**-149
_FP32_MIN_NORMAL = 2.0**-126


def hifloat8_weight(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(N, K) float32 weight of HiFloat8 ``codes`` (N, K) uint8 and per-row ``scale`` (N,) float32, dequantized
    in ``dtype`` (x's: FP16 or BF16): ``decode(code, dtype) * scale.to(dtype)`` rounded to dtype, as float32
    (each factor has at most 11 significant bits, so the float32 product is exact and rounds once)."""
    return (hifloat8.decode(codes, dtype) * scale.to(dtype).unsqueeze(-1)).to(torch.float32)


def float8_e4m3fn_weight(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(N, K) float32 weight of FP8 E4M3 ``codes`` (N, K) uint8 (float8_e4m3fn bit patterns; 0x7F / 0xFF NaN)
    and per-row ``scale`` (N,) float32, dequantized in ``dtype`` as fake quant does: the exact code value
    times the scale in float32 (one rounding), then rounded to dtype."""
    return (mxfp8.e4m3_values(codes) * scale.unsqueeze(-1)).to(dtype).to(torch.float32)


def mxfp8_weight(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(N, K) float32 weight of MXFP8 ``codes`` (N, K) uint8 E4M3 and E8M0 ``scales`` (N, K/32) uint8 (0xFF:
    NaN), dequantized in ``dtype`` as lowbit.formats.mxfp8.dequantize does (the float32 product, then one
    rounding to dtype)."""
    return mxfp8.dequantize(codes, scales, dtype).to(torch.float32)


def mxfp4_weight(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(N, K) float32 weight of MXFP4 ``codes`` (N, K/2) and E8M0 ``scales`` (N, K/32), both uint8."""
    return mxfp4.dequantize(codes, scales, torch.float32, axis=-1)


def hifloat4_weight(scale: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """(N, K) float32 weight of AMCT-packed HiFloat4 ``scale`` (N, K/64, 4) and ``value`` (N, K/2)."""
    return hifloat4.unpack(scale, value, torch.float32)


def e8m0_scales() -> torch.Tensor:
    """(256,) float32: the value 2^(b - 127) of every E8M0 byte b (byte 0: 2^-127, subnormal; 0xFF: NaN)."""
    scales = torch.exp2(torch.arange(256, dtype=torch.float64) - mxfp4.E8M0_BIAS).to(torch.float32)
    scales[mxfp4.E8M0_NAN] = math.nan
    return scales


def e6m2_scales() -> torch.Tensor:
    """(256,) float32: the HiFloat4 block scale of every E6M2 byte (0xFF, a poisoned block: NaN)."""
    scales = hifloat4.scale_value(torch.arange(256, dtype=torch.int32).clamp(max=254))
    scales[hifloat4.POISON_BYTE] = math.nan
    return scales


def hifloat4_quarters() -> torch.Tensor:
    """(16,) float32: the HiFloat4 element of every nibble ``sign << 3 | c``, (-1)^sign * c / 4 (8: -0.0)."""
    quarters = torch.arange(8, dtype=torch.float32) / 4
    return torch.cat([quarters, -quarters])


def lane_sums(x32: torch.Tensor, w32: torch.Tensor) -> torch.Tensor:
    """(M, N) float32 sums of ``x32`` (M, K) times ``w32`` (N, K), both float32, in the lane order."""
    m, k = x32.shape
    steps = -(-k // LANES)
    pad = steps * LANES - k
    x32 = torch.nn.functional.pad(x32, (0, pad))
    w32 = torch.nn.functional.pad(w32, (0, pad))  # padded products are +0 * +0: adding them changes nothing
    acc = torch.zeros(m, w32.shape[0], LANES, dtype=torch.float32, device=x32.device)
    for t in range(steps):
        lanes = slice(t * LANES, (t + 1) * LANES)
        acc = acc + x32[:, None, lanes] * w32[None, :, lanes]
    width = LANES
    while width > 1:
        width //= 2
        acc = acc[..., :width] + acc[..., width:]
    return acc[..., 0]


def canonical_nan(dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 0-d canonical quiet NaN of ``dtype`` (BF16 or FP16)."""
    return torch.tensor(NAN_BITS[dtype], dtype=torch.int16, device=device).view(dtype)


def finish(y32: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Step 4: ``fl32(y32 + bias)`` rounded once to ``dtype``, NaN made canonical (a new tensor)."""
    if bias is not None:
        y32 = y32 + bias.to(torch.float32)
    return torch.where(y32.isnan(), canonical_nan(dtype, y32.device), y32.to(dtype))


def linear(x: torch.Tensor, w32: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The reference: x (..., K) FP16/BF16, w32 (N, K) float32, bias (N,) or None -> (..., N) in x's dtype."""
    k = x.shape[-1]
    y32 = lane_sums(x.reshape(-1, k).to(torch.float32), w32)
    return finish(y32, bias, x.dtype).reshape(*x.shape[:-1], w32.shape[0])


def gemm_interval(
    x: torch.Tensor, w32: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi), each (..., N) in x's dtype: every float32 summation of the products (any order, with or
    without fused multiply-adds, with or without flushing subnormals to zero) followed by one rounding to
    x's dtype gives a result in [lo, hi].

    With ``S = sum_k |x_k w_k| + |bias|`` (float64) and ``r`` the reference's float32 ``sum + bias``, any
    other such ``r'`` satisfies ``|r' - r| <= delta`` with ``delta = (gamma(K + 1) + gamma(ceil(K/64) + 7))
    * S + K * 2^-149 + 2^-126 * (sum_k |x_k| + sum_k |w_k| + K + 2)`` (gamma(n) = n u / (1 - n u),
    u = 2^-24), and rounding is monotone. Only meaningful where S is finite and below the FP32 range
    (docs/weight_only.md, 'Tolerance of the GEMM path').
    """
    k = x.shape[-1]
    x64 = x.reshape(-1, k).to(torch.float64)
    w64 = w32.to(torch.float64)
    s = x64.abs() @ w64.abs().T
    r = lane_sums(x64.to(torch.float32), w32).to(torch.float64)
    if bias is not None:
        b64 = bias.to(torch.float64)
        s = s + b64.abs()
        r = (r.to(torch.float32) + bias.to(torch.float32)).to(torch.float64)
    flushed = x64.abs().sum(-1, keepdim=True) + w64.abs().sum(-1) + (k + 2)
    lo, hi = order_interval(r, s, flushed, k, math.ceil(k / LANES) + 7, x.dtype)
    shape = (*x.shape[:-1], w32.shape[0])
    return lo.reshape(shape), hi.reshape(shape)


def order_interval(r: torch.Tensor, s: torch.Tensor, flushed: torch.Tensor, k: int, reference_terms: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) in ``dtype``: the bounds of every float32 summation of K products and a bias (any order)
    rounded once to ``dtype``, given a reference order's float32 result ``r``, ``S`` = the sum of the
    absolute products and bias ``s``, ``flushed`` = sum |x| + sum |w| + K + 2 (all float64), and the number
    of rounded operations a term passes through in the reference order (``reference_terms``)."""
    delta = ((_gamma(k + 1) + _gamma(reference_terms)) * s + k * _FP32_MIN_SUBNORMAL
             + _FP32_MIN_NORMAL * flushed)
    lo, hi = (finish(edge.to(torch.float32), None, dtype) for edge in (r - delta, r + delta))
    return lo, hi


def meets_contract(y: torch.Tensor, want: torch.Tensor, x: torch.Tensor, w32: torch.Tensor,
                   bias: Optional[torch.Tensor] = None) -> bool:
    """Whether a kernel's ``y`` meets the contract, given the reference's ``want`` for x, the float32 weight
    w32 and bias: the same bits for x with up to EXACT_ROWS rows; above that, every element inside
    :func:`gemm_interval`, or NaN where ``want`` is. Where the absolute products sum beyond the float32
    range (or hold Inf / NaN) the order decides whether an intermediate overflows: any result is allowed
    there."""
    if y.dtype == want.dtype and y.shape == want.shape and torch.equal(
            bit_view(y.contiguous()), bit_view(want.contiguous())):
        return True
    k = x.shape[-1]
    if x.numel() // max(k, 1) <= EXACT_ROWS or y.shape != want.shape:
        return False
    lo, hi = (t.to(torch.float32) for t in gemm_interval(x, w32, bias))
    s = x.reshape(-1, k).to(torch.float64).abs() @ w32.to(torch.float64).abs().T
    if bias is not None:
        s = s + bias.to(torch.float64).abs()
    unbounded = (~torch.isfinite(s) | (s > torch.finfo(torch.float32).max)).reshape(lo.shape)
    y32 = y.to(torch.float32)
    inside = (y32 >= lo) & (y32 <= hi)
    both_nan = y32.isnan() & want.to(torch.float32).isnan()
    return bool((inside | both_nan | unbounded).all())


def _gamma(n: int) -> float:
    u = _FP32_UNIT_ROUNDOFF
    return n * u / (1 - n * u)
