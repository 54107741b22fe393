"""Saving and loading quantized models: model.safetensors (packed tensors) + quantization.json."""

from __future__ import annotations

import os
from typing import Union

from torch import nn


def save_quantized(model: nn.Module, directory: Union[str, os.PathLike]) -> None:
    """Write ``directory``/model.safetensors and quantization.json atomically."""
    raise NotImplementedError


def load_quantized(directory: Union[str, os.PathLike], model: nn.Module) -> nn.Module:
    """Load a checkpoint written by save_quantized into the skeleton ``model`` (may be on the meta device)."""
    raise NotImplementedError
