"""Named quantization schemes: AMCT presets and lowbit's formats as ready configs (docs/quantize.md, "Schemes").

``bits_per_weight`` counts element bits plus per-block scales spread over their block; per-channel or
per-tensor scales (4 bytes per output row or per layer) and SVDQuant's low-rank factors
(16 * rank * (N + K) bits per layer) come on top and are counted exactly in each layer's report.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from lowbit.quantize.config import FrozenMapping


@dataclass(frozen=True)
class Scheme:
    """A named config. ``config``: AMCT's dict schema; ``needs_calibration``: forward passes are needed
    between :func:`lowbit.quantize` and :func:`lowbit.convert` (else :func:`lowbit.quantize_` does it all)."""

    name: str
    config: Mapping[str, Any]
    bits_per_weight: float
    needs_calibration: bool
    description: str


def _cfg(weights: dict, inputs: dict | None, algorithm: Any, skip: tuple[str, ...] = ("lm_head",)) -> dict:
    quant_cfg = {"weights": weights}
    if inputs is not None:
        quant_cfg["inputs"] = inputs
    return {"batch_num": 1, "quant_cfg": quant_cfg, "algorithm": algorithm, "skip_layers": list(skip)}


def _freeze(d: Any) -> Any:
    if isinstance(d, dict):
        return FrozenMapping({k: _freeze(v) for k, v in d.items()})
    if isinstance(d, list):
        return tuple(d)
    return d


def thaw(config: Mapping) -> dict:
    """A plain mutable dict copy of a (frozen) config mapping."""
    return {k: thaw(v) if isinstance(v, Mapping) else list(v) if isinstance(v, tuple) else v
            for k, v in config.items()}


_HIF8 = {"type": "hifloat8", "symmetric": True}
_FP8 = {"type": "float8_e4m3fn", "symmetric": True}
_MXFP8 = {"type": "mxfp8_e4m3fn", "symmetric": True, "strategy": "group"}
_MXFP4_W = {"type": "mxfp4_e2m1", "symmetric": True, "strategy": "group", "group_size": 32}
_MXFP4_A = {"type": "mxfp4_e2m1", "symmetric": True, "strategy": "group"}

_ALL = (
    Scheme("hif8-cast", _cfg({**_HIF8, "strategy": "channel"}, {**_HIF8, "strategy": "tensor"}, "cast"), 8, False,
           "AMCT HIFP8_CAST_CFG: HiF8 weights (max/16 per channel), scaleless HiF8 activation cast"),
    Scheme("hif8-w8a8-minmax", _cfg({**_HIF8, "strategy": "channel"}, {**_HIF8, "strategy": "tensor"}, "minmax"),
           8, True, "HiF8 W8A8, abs-max/16 per channel, calibrated abs-max/16 per-tensor activations (lowbit row)"),
    Scheme("hif8-w8a8-ofmr", _cfg({**_HIF8, "strategy": "tensor"}, {**_HIF8, "strategy": "tensor"}, "ofmr", ()),
           8, True, "AMCT HIFP8_OFMR_CFG: power-of-two scales chosen by output MSE"),
    Scheme("hif8-w8a8-quantile", _cfg({**_HIF8, "strategy": "tensor"}, {**_HIF8, "strategy": "tensor"}, "quantile"),
           8, True, "AMCT HIFP8_QUANTILE_CFG: EMA of per-call activation abs-max"),
    Scheme("hif8-w8a8-smoothquant",
           _cfg({**_HIF8, "strategy": "channel"}, {**_HIF8, "strategy": "tensor"},
                {"smoothquant": {"smooth_strength": 0.5}}),
           8, True, "AMCT HIFP8_SMOOTHQUANT_CFG: SmoothQuant (alpha 0.5) then HiF8 W8A8"),
    Scheme("hif8-wo", _cfg({**_HIF8, "strategy": "channel"}, None, "cast"), 8, False,
           "HiF8 weight-only, max/16 per-channel scale (AMCT cast, weight-only)"),
    Scheme("fp8-w8a8-ofmr", _cfg({**_FP8, "strategy": "tensor"}, {**_FP8, "strategy": "tensor"}, "ofmr"), 8, True,
           "AMCT FP8_OFMR_CFG: float8_e4m3fn W8A8, power-of-two scales by output MSE"),
    Scheme("fp8-wo", _cfg({**_FP8, "strategy": "channel"}, None, "minmax"), 8, False,
           "float8_e4m3fn weight-only, abs-max/448 per channel (lowbit row; the comparison point)"),
    Scheme("mxfp8-w8a8", _cfg({**_MXFP8, "group_size": 32}, _MXFP8, "mxquant"), 8.25, False,
           "AMCT MXFP8_QUANT_CFG: MXFP8 E4M3 weights and activations, E8M0 scale per 32"),
    Scheme("mxfp4-wo", _cfg(_MXFP4_W, None, "mxquant"), 4.25, False,
           "MXFP4 weight-only (AMCT mxquant deploy rounding: 'even' scale, RNE elements)"),
    Scheme("mxfp4-w4a4", _cfg(_MXFP4_W, _MXFP4_A, "mxquant"), 4.25, False,
           "MXFP4 weights and activations (lowbit row)"),
    Scheme("hif4-wo", _cfg({"type": "hifloat4", "symmetric": True, "strategy": "group", "group_size": 64}, None,
                           "minmax"), 4.5, False, "HiFloat4 weight-only, AMCT's 64-element three-level blocks"),
    Scheme("int4-a16w4", _cfg({"type": "int4", "symmetric": True, "strategy": "group", "group_size": 128}, None,
                              "minmax"), 4.125, False,
           "int4 per-group (128) weight-only, run by weight_quant_batch_matmul (16-bit scales)"),
    Scheme("svdquant-r32", _cfg(_MXFP4_W, _MXFP4_A, {"svdquant": {"rank": 32}}), 4.25, False,
           "SVDQuant: rank-32 BF16 branch + MXFP4 residual, MXFP4 activations (svd_quant operator)"),
)

SCHEMES: Mapping[str, Scheme] = MappingProxyType(
    {s.name: Scheme(s.name, _freeze(s.config), s.bits_per_weight, s.needs_calibration, s.description) for s in _ALL}
)


def get_scheme(name: str) -> Scheme:
    """The scheme called ``name``; ValueError listing the known names otherwise."""
    try:
        return SCHEMES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown quantization scheme {name!r}; known: {sorted(SCHEMES)}") from None


# AMCT's default when quantize() gets no config: INT8_MINMAX_WEIGHT_QUANT_CFG.
AMCT_DEFAULT_CONFIG: Mapping[str, Any] = _freeze(
    _cfg({"type": "int8", "symmetric": True, "strategy": "channel"}, None, "minmax"))
