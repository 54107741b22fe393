"""Scale computations of AMCT's algorithms (docs/quantize.md, "Algorithms"): pure functions on tensors.

``amct_compat=True`` arguments reproduce AMCT's numbers, quirks included; the default fixes the quirks
listed in docs/quantize.md, "Quirks". All scales are float32; no function returns a NaN or Inf scale
(a degenerate channel gets the documented finite scale 1.0, or an error in compat mode where AMCT
itself would produce NaN).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

FLT_EPSILON = 1.192092896e-7
# Symmetric float "scope": the value the abs-max is mapped to (AMCT). HiF8: 16 = 2^4, the top of the
# 3-mantissa-bit band; E4M3: its largest finite value; E2M1: 6.
FLOAT_SCOPE = {"hifloat8": 16.0, "float8_e4m3fn": 448.0, "float4_e2m1": 6.0}
INT_BITS = {"int8": 8, "int4": 4}
HIF8_DYNAMIC_TARGET = 15.0  # npu_dynamic_quant(..., hifloat8, dst_type_max=15): per-token abs-max / 15
OFMR_EXPONENTS = tuple(range(-5, 6))  # candidate scales 2^e
QUANTILE_DECAY = 0.99  # weight of the history in the EMA of per-call abs-maxima


def process_scale(scale: torch.Tensor, offset: Optional[torch.Tensor] = None,
                  bits: Optional[int] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """AMCT's scale sanitising: ``s < FLT_EPSILON`` (also negative) -> 1.0, and its offset -> -2^(bits-1).

    RuntimeError if a scale, its reciprocal or an offset is not finite (NaN input); not checked on the meta
    device (a checkpoint's dry run: lowbit.quantize.checkpoint), which holds no values."""
    tiny = scale < FLT_EPSILON
    scale = torch.where(tiny, torch.ones_like(scale), scale)
    if offset is not None:
        offset = torch.where(tiny, torch.full_like(offset, -(2 ** (bits - 1))), offset)
    if scale.is_meta:
        return scale, offset
    if not bool(torch.isfinite(scale).all() and torch.isfinite(1 / scale).all()):
        raise RuntimeError(f"quantization scale is not finite: {scale.flatten()[:8].tolist()}")
    if offset is not None and not bool(torch.isfinite(offset).all()):
        raise RuntimeError("quantization offset is not finite")
    return scale, offset


def calculate_scale_offset(vmax: torch.Tensor, vmin: torch.Tensor, symmetric: bool,
                           dtype_name: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """AMCT's ``calculate_scale_offset``: scale (float32) and offset (int32, asymmetric integers only).

    Symmetric: ``s = max(|max|, |min|) / scope``, scope 16 (HiF8), 448 (E4M3), 6 (E2M1) or for integers
    ``2^(b-1) - 1 + [|max| < |min|]``. Asymmetric (integers): ``s = (M - m) / (2^b - 1)`` with
    ``M = max(max, 0)``, ``m = min(min, 0)``, ``o = round_half_even(-ceil((2^b - 1) / 2) - m / s)``."""
    vmax, vmin = vmax.to(torch.float32), vmin.to(torch.float32)
    bits = INT_BITS.get(dtype_name)
    if symmetric:
        bound = torch.maximum(vmax.abs(), vmin.abs())
        if bits is None:
            scope = FLOAT_SCOPE[dtype_name]
        else:
            scope = 2 ** (bits - 1) - 1 + (vmax.abs() < vmin.abs()).to(torch.float32)
        scale, _ = process_scale(bound / scope)
        return scale, None
    levels = 2**bits - 1
    hi, lo = vmax.clamp(min=0), vmin.clamp(max=0)
    scale = (hi - lo) / levels
    base = -math.ceil(levels / 2)
    with torch.no_grad():
        offset = torch.where(hi == lo, torch.full_like(scale, base), base - lo / scale)
    scale, offset = process_scale(scale, offset, bits)
    return scale, torch.round(offset).to(torch.int32)


def weight_range(w: torch.Tensor, strategy: str, group_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed (max, min) of a (N, K) weight per tensor ``[1]``, per output row ``[N]`` or per K-group
    ``[N, K/g]`` (K divisible by g), float32."""
    w = w.detach().to(torch.float32)
    if strategy == "tensor":
        return w.max().reshape(1), w.min().reshape(1)
    if strategy == "channel":
        return w.amax(dim=1), w.amin(dim=1)
    groups = w.reshape(w.shape[0], -1, group_size)
    return groups.amax(dim=-1), groups.amin(dim=-1)


def hif8_max_scale(w: torch.Tensor, strategy: str, *, signed_max: bool, guard: bool) -> torch.Tensor:
    """HiF8 weight scale ``max / 16`` per tensor ``[1]`` or row ``[N]`` (Cast, Quantile).

    ``signed_max``: AMCT's signed ``max(W)`` (quirk), else ``max|W|``. ``guard``: apply process_scale (Cast;
    the default everywhere); without it (AMCT Quantile) a zero or NaN scale raises ValueError instead of
    silently producing NaN weights."""
    vmax, vmin = weight_range(w, strategy)
    top = vmax if signed_max else torch.maximum(vmax.abs(), vmin.abs())
    scale = top / FLOAT_SCOPE["hifloat8"]
    if guard:
        return process_scale(scale)[0]
    if bool((scale == 0).any() or torch.isnan(scale).any()):
        raise ValueError("quantile weight scale is zero or NaN for an all-zero (or NaN) channel; AMCT would "
                         "produce NaN weights here (use amct_compat=False for the guarded scale 1.0)")
    return scale


def ofmr_mse(y: torch.Tensor, y_hat: torch.Tensor, channel_axis: Optional[int]) -> torch.Tensor:
    """OFMR loss: ``sum((y - y_hat)^2)`` in float64 divided by ``numel(y)``, per output channel (along
    ``channel_axis``, shape [C]) or one value (``channel_axis`` None, shape [1]); returned as float32."""
    sq = (y.to(torch.float64) - y_hat.to(torch.float64)).pow(2)
    if channel_axis is None:
        total = sq.sum().reshape(1)
    else:
        sq = sq.movedim(channel_axis, -1)
        total = sq.reshape(-1, sq.shape[-1]).sum(dim=0)
    return (total / y.numel()).to(torch.float32)


def ofmr_pick(losses: torch.Tensor) -> torch.Tensor:
    """Scale ``2^e*`` from accumulated losses ``[len(OFMR_EXPONENTS), C]``: NaN counts as +Inf, ties go to the
    smaller exponent; RuntimeError if a channel has no finite loss. Returns float32 ``[C]``."""
    losses = torch.where(torch.isnan(losses), torch.full_like(losses, math.inf), losses)
    best, index = losses.min(dim=0)
    if not bool(torch.isfinite(best).all()):
        raise RuntimeError("ofmr: every candidate scale gave a non-finite output error")
    exponents = torch.tensor(OFMR_EXPONENTS, dtype=torch.float32, device=losses.device)[index]
    return torch.exp2(exponents)


def ema_update(previous: Optional[torch.Tensor], batch_max: torch.Tensor) -> torch.Tensor:
    """Quantile's running statistic: the first call's abs-max, then ``0.99 * previous + 0.01 * batch``."""
    batch_max = batch_max.to(torch.float32)
    if previous is None:
        return batch_max
    return QUANTILE_DECAY * previous + (1 - QUANTILE_DECAY) * batch_max


def smooth_factor(act_max: torch.Tensor, act_min: torch.Tensor, w: torch.Tensor, alpha: float,
                  amct_compat: bool) -> torch.Tensor:
    """SmoothQuant ``sigma_j = a_j^alpha / w_j^(1 - alpha)``, ``a_j = max(|max_j|, |min_j|)`` over the
    calibration tokens, ``w_j = max_i |W_ij|``; shape [K].

    compat: computed in the weight dtype and reset to 1 where below that dtype's eps or not finite (AMCT).
    Default: float32, reset to 1 only where not finite or <= 0."""
    dtype = w.dtype if amct_compat else torch.float32
    a = torch.maximum(act_max.abs(), act_min.abs()).to(dtype)
    wmax = w.detach().abs().amax(dim=0).to(dtype)
    sigma = a.pow(alpha) / wmax.pow(1 - alpha)
    bad = ~torch.isfinite(sigma)
    bad |= sigma < torch.finfo(dtype).eps if amct_compat else sigma <= 0
    return torch.where(bad, torch.ones_like(sigma), sigma)


def dynamic_token_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-token HiF8 scale ``max|x| / 15`` over the last axis (keepdim), float32, process_scale'd."""
    return process_scale(x.detach().abs().amax(dim=-1, keepdim=True).to(torch.float32) / HIF8_DYNAMIC_TARGET)[0]
