"""Per-layer calibrators: collect statistics during forward passes, then produce the layer's scales.

One class per algorithm (docs/quantize.md, "Algorithms"). A calibrator is built from the layer's weight
and :class:`~lowbit.quantize.config.LayerConfig`; ``needs_data`` says whether :meth:`observe` must be
called (``batch_num`` times) before :meth:`finalize`. Everything runs under ``torch.no_grad``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from lowbit.quantize import algorithms as alg
from lowbit.errors import ShapeError
from lowbit.quantize.activations import STATIC_KINDS, act_kind, fake_quant_input
from lowbit.quantize.config import LayerConfig
from lowbit.quantize.layer_ops import channel_axis, run_layer
from lowbit.quantize.weight_formats import WEIGHT_FORMATS, fake_quant_weight


@dataclass(frozen=True)
class QuantParams:
    """A calibrated layer's parameters: weight scale/offset (float32 / int32; None for formats with their own
    block scales), SmoothQuant factor ``smooth`` [K], static activation scale ``act_scale`` float32 [1]."""

    weight_scale: Optional[torch.Tensor] = None
    weight_offset: Optional[torch.Tensor] = None
    smooth: Optional[torch.Tensor] = None
    act_scale: Optional[torch.Tensor] = None


def layer_act_kind(cfg: LayerConfig) -> str:
    """The activation kind of the deploy module (lowbit.quantize.activations)."""
    return act_kind(cfg.inputs.type, cfg.inputs.strategy, cfg.inputs.dynamic, cfg.algorithm.name)


def fake_act_kind(cfg: LayerConfig) -> str:
    """The activation kind of the fake-quant path: as deploy, except AMCT's static per-position scales for
    Quantile with a non-dynamic ``token`` strategy in compat mode (deploy is dynamic per token there)."""
    inputs = cfg.inputs
    if cfg.amct_compat and cfg.algorithm.name == "quantile" and inputs.strategy == "token" and not inputs.dynamic:
        return "hif8_position"
    return layer_act_kind(cfg)


def minmax_weight_scale(w: torch.Tensor, cfg: LayerConfig) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """MinMax weight scale/offset at the configured granularity; (None, None) for self-scaled formats."""
    spec = cfg.weights
    if not WEIGHT_FORMATS[spec.type].scaled:
        return None, None
    vmax, vmin = alg.weight_range(w, spec.strategy, spec.group_size)
    return alg.calculate_scale_offset(vmax, vmin, spec.symmetric, spec.type)


class Calibrator:
    """Base: data-free, weight scale by MinMax. Subclasses override what they change."""

    needs_data = False

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], cfg: LayerConfig, geometry: dict):
        self.weight, self.bias, self.cfg = weight.detach(), None if bias is None else bias.detach(), cfg
        self.geometry = geometry
        self.kind = fake_act_kind(cfg)
        self.weight_params = self.initial_weight_params()  # at quantize() time, as AMCT (errors surface there)

    def initial_weight_params(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Weight (scale, offset) computable without data: MinMax's."""
        return minmax_weight_scale(self.weight, self.cfg)

    def observe(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Record one calibration call (input x, float output y)."""

    def finalize(self) -> QuantParams:
        return QuantParams(*self.weight_params)


class MinMaxCalibrator(Calibrator):
    """MinMax: weights at construction; static activations by running signed max/min over the calls."""

    def __init__(self, weight, bias, cfg, geometry):
        super().__init__(weight, bias, cfg, geometry)
        self.needs_data = self.kind in STATIC_KINDS
        self.vmax = self.vmin = None

    def observe(self, x, y):
        bmax, bmin = x.max().to(torch.float32).reshape(1), x.min().to(torch.float32).reshape(1)
        self.vmax = bmax if self.vmax is None else torch.maximum(self.vmax, bmax)
        self.vmin = bmin if self.vmin is None else torch.minimum(self.vmin, bmin)

    def finalize(self):
        if not self.needs_data:
            return super().finalize()
        act_scale, _ = alg.calculate_scale_offset(self.vmax, self.vmin, True, self.cfg.inputs.type)
        return QuantParams(*self.weight_params, act_scale=act_scale)


class CastCalibrator(Calibrator):
    """Cast: HiF8 weight scale max/16 (signed max in compat), process_scale; scaleless activations."""

    def initial_weight_params(self):
        compat = self.cfg.amct_compat
        return alg.hif8_max_scale(self.weight, self.cfg.weights.strategy, signed_max=compat, guard=True), None


class QuantileCalibrator(Calibrator):
    """Quantile: HiF8 weight scale max/16 (compat: signed, unguarded); static activations: EMA of abs-max / 16."""

    def __init__(self, weight, bias, cfg, geometry):
        super().__init__(weight, bias, cfg, geometry)
        self.needs_data = self.kind in STATIC_KINDS + ("hif8_position",)
        self.ema = None

    def observe(self, x, y):
        if self.kind != "hif8_position":
            self.ema = alg.ema_update(self.ema, x.detach().abs().max().reshape(1))
            return
        if x.dim() < 2:
            raise ShapeError(
                f"{self.cfg.name}: static per-position scales need inputs (..., S, K), got {tuple(x.shape)}")
        others = [d for d in range(x.dim()) if d != x.dim() - 2]
        batch_max = x.detach().abs().amax(dim=others).reshape(-1, 1)  # (S, 1): one value per position
        if self.ema is not None and self.ema.shape != batch_max.shape:
            raise ShapeError(f"{self.cfg.name}: every calibration call must have the same sequence length "
                             f"(AMCT's static per-position scales), got {batch_max.shape[0]} after {self.ema.shape[0]}")
        self.ema = alg.ema_update(self.ema, batch_max)

    def initial_weight_params(self):
        compat = self.cfg.amct_compat
        return alg.hif8_max_scale(self.weight, self.cfg.weights.strategy, signed_max=compat, guard=not compat), None

    def finalize(self):
        compat = self.cfg.amct_compat
        scale = self.weight_params[0]
        if not self.needs_data:
            return QuantParams(scale)
        act_scale = self.ema / alg.FLOAT_SCOPE["hifloat8"]
        if compat and bool((act_scale == 0).any()):
            raise ValueError(f"{self.cfg.name}: quantile activation scale is 0 (all calibration inputs were zero); "
                             "AMCT would divide by it (use amct_compat=False for the guarded scale 1.0)")
        return QuantParams(scale, act_scale=act_scale if compat else alg.process_scale(act_scale)[0])


class WeightsFromDataCalibrator(Calibrator):
    """Base of the algorithms whose weight scales also come from the calibration data."""

    needs_data = True

    def initial_weight_params(self):
        return None, None


class OfmrCalibrator(WeightsFromDataCalibrator):
    """OFMR: for each candidate 2^e, output MSE with fake-quantized weights (per channel for ``channel``) and,
    separately, with fake-quantized activations; argmin at the last calibration call."""

    def __init__(self, weight, bias, cfg, geometry):
        super().__init__(weight, bias, cfg, geometry)
        self.w_losses = self.d_losses = None

    def observe(self, x, y):
        axis = channel_axis(self.geometry) if self.cfg.weights.strategy == "channel" else None
        w_losses, d_losses = [], []
        for e in alg.OFMR_EXPONENTS:
            s = torch.tensor([2.0**e], device=self.weight.device)
            w_fq = fake_quant_weight(self.cfg.weights.type, self.weight, s)
            w_losses.append(alg.ofmr_mse(y, run_layer(self.geometry, x, w_fq, self.bias), axis))
            if self.kind != "none":
                x_fq = fake_quant_input(x, self.kind, s)
                d_losses.append(alg.ofmr_mse(y, run_layer(self.geometry, x_fq, self.weight, self.bias), None))
        w_losses = torch.stack(w_losses)
        self.w_losses = w_losses if self.w_losses is None else self.w_losses + w_losses
        if d_losses:
            d_losses = torch.stack(d_losses)
            self.d_losses = d_losses if self.d_losses is None else self.d_losses + d_losses

    def finalize(self):
        act_scale = None if self.d_losses is None else alg.ofmr_pick(self.d_losses)
        return QuantParams(alg.ofmr_pick(self.w_losses), act_scale=act_scale)


class SmoothQuantCalibrator(WeightsFromDataCalibrator):
    """SmoothQuant: running per-input-channel max/min of x; sigma, then scales of W * sigma and x / sigma."""

    def __init__(self, weight, bias, cfg, geometry):
        super().__init__(weight, bias, cfg, geometry)
        self.vmax = self.vmin = None

    def observe(self, x, y):
        flat = x.detach().reshape(-1, x.shape[-1])
        if not self.cfg.amct_compat:
            flat = flat.to(torch.float32)
        bmax, bmin = flat.amax(dim=0), flat.amin(dim=0)
        self.vmax = bmax if self.vmax is None else torch.maximum(self.vmax, bmax)
        self.vmin = bmin if self.vmin is None else torch.minimum(self.vmin, bmin)

    def finalize(self):
        cfg = self.cfg
        sigma = alg.smooth_factor(self.vmax, self.vmin, self.weight, cfg.algorithm.options["smooth_strength"],
                                  cfg.amct_compat)
        smoothed = smoothed_weight(self.weight, sigma)
        scale, offset = minmax_weight_scale(smoothed, cfg)
        act_scale = None
        if self.kind in STATIC_KINDS:
            act_max, act_min = (self.vmax / sigma).max().reshape(1), (self.vmin / sigma).min().reshape(1)
            act_scale, _ = alg.calculate_scale_offset(act_max, act_min, True, cfg.inputs.type)
        return QuantParams(scale, offset, smooth=sigma, act_scale=act_scale)


def smoothed_weight(weight: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """``W * sigma`` (columns scaled), in sigma's dtype when it is wider than W's."""
    return weight.detach().to(torch.promote_types(weight.dtype, sigma.dtype)) * sigma


CALIBRATORS = {
    "minmax": MinMaxCalibrator,
    "cast": CastCalibrator,
    "quantile": QuantileCalibrator,
    "ofmr": OfmrCalibrator,
    "smoothquant": SmoothQuantCalibrator,
    "mxquant": Calibrator,
    "svdquant": Calibrator,
}


def make_calibrator(weight: torch.Tensor, bias: Optional[torch.Tensor], cfg: LayerConfig,
                    geometry: dict) -> Calibrator:
    """The calibrator of ``cfg.algorithm`` for this layer (``geometry``: lowbit.quantize.layer_ops)."""
    return CALIBRATORS[cfg.algorithm.name](weight, bias, cfg, geometry)
