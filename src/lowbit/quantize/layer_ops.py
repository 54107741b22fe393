"""What a quantized layer computes, by layer type (Linear or Conv2d), as a JSON-able "geometry" dict.

``geometry``: ``{"type": "Linear", "weight_shape": [N, K]}`` or ``{"type": "Conv2d", "weight_shape":
[Cout, Cin/groups, kh, kw], "stride", "padding", "dilation", "groups"}``. Weights are quantized as (N, -1)
matrices (one row per output channel) and reshaped back to ``weight_shape``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.errors import DeviceError, DtypeError, ShapeError

_CONV_FIELDS = ("stride", "padding", "dilation", "groups")


def layer_geometry(module: nn.Module) -> dict:
    """The geometry of an ``nn.Linear`` or ``nn.Conv2d`` (padding_mode zeros)."""
    geometry = {"type": "Conv2d" if isinstance(module, nn.Conv2d) else "Linear",
                "weight_shape": list(module.weight.shape)}
    if geometry["type"] == "Conv2d":
        for field in _CONV_FIELDS:
            value = getattr(module, field)
            geometry[field] = list(value) if isinstance(value, tuple) else value
    return geometry


def channel_axis(geometry: dict) -> int:
    """Axis of the output channels in the layer's output: -1 (Linear), -3 (Conv2d, NCHW or CHW)."""
    return -3 if geometry["type"] == "Conv2d" else -1


def run_layer(geometry: dict, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear`` or ``F.conv2d`` with the layer's parameters."""
    if geometry["type"] == "Linear":
        return F.linear(x, weight, bias)
    padding = geometry["padding"]
    return F.conv2d(x, weight, bias, tuple(geometry["stride"]), padding if isinstance(padding, str) else tuple(padding),
                    tuple(geometry["dilation"]), geometry["groups"])


def check_layer_input(name: str, geometry: dict, x: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
    """ShapeError / DtypeError / DeviceError naming the layer for an input of the wrong channel count, dtype or
    device (``device``: the layer's tensors')."""
    shape = geometry["weight_shape"]
    if geometry["type"] == "Linear":
        if x.dim() == 0 or x.shape[-1] != shape[1]:
            raise ShapeError(f"layer {name!r}: input must be (..., {shape[1]}), got shape {tuple(x.shape)}")
    else:
        channels = shape[1] * geometry["groups"]
        if x.dim() not in (3, 4) or x.shape[-3] != channels:
            raise ShapeError(f"layer {name!r}: input must be (N, {channels}, H, W) or ({channels}, H, W), "
                             f"got shape {tuple(x.shape)}")
    if x.dtype != dtype:
        raise DtypeError(f"layer {name!r}: input dtype {x.dtype} does not match the weight dtype {dtype}")
    if x.device != device:
        raise DeviceError(f"layer {name!r}: input is on {x.device} but the layer's tensors are on {device}")


def geometry_mismatch(geometry: dict, module: nn.Module, has_bias: bool) -> Optional[str]:
    """None if ``module`` (from a model skeleton) has this geometry and bias presence, else a description."""
    if not isinstance(module, (nn.Linear, nn.Conv2d)):
        return f"is {type(module).__name__}, not {geometry['type']}"
    actual = layer_geometry(module)
    if actual != geometry or (module.bias is not None) != has_bias:
        return f"is {actual} with bias={module.bias is not None}, the checkpoint has {geometry} with bias={has_bias}"
    return None
