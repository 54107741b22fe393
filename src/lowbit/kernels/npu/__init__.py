"""Thin adapters to Ascend vendor paths (torch_npu, amct_ops); import-guarded, unverified off an NPU."""

from __future__ import annotations

import importlib
from typing import Callable

import torch

from lowbit.errors import BackendUnavailable


def amct_operator(module: str, name: str, missing: str = "") -> Callable:
    """``torch.ops.amct.<name>`` after importing ``module`` (the amct_ops module whose shared library
    registers it); BackendUnavailable if the import fails or the operator is not there (``missing``: why
    it may be absent)."""
    try:
        importlib.import_module(module)
    except (ImportError, OSError) as exc:
        raise BackendUnavailable(f"{module} is not importable: {exc}") from exc
    if not hasattr(torch.ops.amct, name):
        raise BackendUnavailable(f"amct_ops has no {name} operator{' (' + missing + ')' if missing else ''}")
    return getattr(torch.ops.amct, name)
