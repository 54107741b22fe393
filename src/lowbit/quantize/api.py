"""The model-level quantization API: quantize -> (calibrate) -> convert, and quantize_ for data-free schemes.

See docs/quantize.md. Everything happens in place on the model; every call returns a QuantizeReport.
"""

from __future__ import annotations

from typing import Any, Mapping, Union

from torch import nn

from lowbit.quantize.config import QuantConfig
from lowbit.quantize.report import QuantizeReport

ConfigLike = Union[Mapping[str, Any], QuantConfig, str, None]


def quantize(model: nn.Module, config: ConfigLike = None, *, amct_compat: bool = False) -> QuantizeReport:
    """Replace each selected layer of ``model`` by its calibration (fake-quant) module, in place."""
    raise NotImplementedError


def convert(model: nn.Module) -> QuantizeReport:
    """Replace every calibration module of ``model`` by its deployable packed module, in place."""
    raise NotImplementedError


def quantize_(model: nn.Module, config: ConfigLike) -> QuantizeReport:
    """quantize + convert in one call for a data-free scheme or config (ValueError if it needs calibration)."""
    raise NotImplementedError
