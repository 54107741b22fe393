"""Which tensors of a checkpoint a streamed quantization packs, and the packed tensors each layer gets,
decided from the tensors' names, shapes and dtypes alone (docs/quantize_checkpoint.md, "Which tensors").

A layer is packed exactly as :func:`lowbit.quantize_` packs it: a row block of the weight is put in an
``nn.Linear`` inside a holder module at the layer's dotted name, and ``quantize_`` with the scheme replaces
it by its deploy module, whose state_dict holds the packed tensors. The full layer's packed shapes and its
``quantization.json`` entry are extrapolated from two probes of 2 and 4 zero rows: a value that differs
between the probes grows linearly with the row count N; every packed tensor must have one such axis (the
schemes accepted here quantize each output row on its own, so row blocks pack independently).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Optional

import torch
from torch import nn

from lowbit.errors import ShapeError
from lowbit.quantize.api import quantize_, resolve_config
from lowbit.quantize.config import QuantConfig
from lowbit.quantize.modules import QuantizedLinearBase
from lowbit.quantize.schemes import SCHEMES, get_scheme
from lowbit.quantize.selection import select_layers
from lowbit.quantize.shard_io import DTYPE_NAMES, TORCH_DTYPES, TensorEntry

PROBE_ROWS = (2, 4)
WEIGHT_DTYPES = ("F32", "F16", "BF16")
EMBEDDING_NAMES = ("wte", "wpe", "shared")  # GPT-2 and T5 names of embedding tables


def stream_config(scheme: str) -> QuantConfig:
    """The validated config of a scheme that can be streamed; ValueError for an unknown scheme, one that needs
    calibration data, or one whose weight scales span more than one output row (per tensor, SVD)."""
    named = get_scheme(scheme)
    if named.needs_calibration:
        raise ValueError(f"scheme {scheme!r} needs calibration data (forward passes through the model); "
                         "quantize-checkpoint takes data-free schemes only: use lowbit.quantize + convert")
    config, _ = resolve_config(scheme, False)
    if config.weights is None or config.weights.strategy == "tensor" or any(
            a.name == "svdquant" for a in config.algorithms):
        raise ValueError(f"scheme {scheme!r} quantizes a weight as a whole (per-tensor scale or SVD), which "
                         "quantize-checkpoint does not stream: use lowbit.quantize_ + save_quantized")
    return config


def streamable_schemes() -> list[str]:
    """The names of the schemes :func:`stream_config` accepts."""
    names = []
    for name in SCHEMES:
        try:
            stream_config(name)
        except ValueError:
            continue
        names.append(name)
    return names


@dataclass(frozen=True)
class PackedTensor:
    """One packed tensor of a layer: state_dict ``key``, safetensors ``dtype``, full ``shape``, and the
    ``axis`` along which it holds ``per_row`` entries per weight row (a Fraction: int4 packs two rows a byte)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    axis: int
    per_row: Fraction

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=TORCH_DTYPES[self.dtype]).element_size()

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.element_size


@dataclass(frozen=True)
class LayerPlan:
    """A layer to pack: ``weight`` tensor name, N x K, dtype name, its quantization.json entry and packed
    tensors; row blocks must be multiples of ``row_quantum`` rows."""

    name: str
    weight: str
    rows: int
    cols: int
    dtype: str
    meta: dict
    tensors: tuple[PackedTensor, ...]
    row_quantum: int


def holder_with(name: str, layer: nn.Module) -> nn.Module:
    """A module tree with ``layer`` at the dotted path ``name`` (so name-based config rules apply as in the
    model); KeyError (from ``add_module``) for a name that cannot be a module path, such as ``a..b``."""
    root = parent = nn.Module()
    *path, leaf = name.split(".")
    for part in path:
        child = nn.Module()
        parent.add_module(part, child)
        parent = child
    parent.add_module(leaf, layer)
    return root


def linear_of(weight: torch.Tensor, bias: bool) -> nn.Linear:
    """An ``nn.Linear`` whose weight is ``weight`` (N, K) (no copy) and whose bias, if any, is zeros."""
    n, k = weight.shape
    linear = nn.Linear(k, n, bias=bias, device="meta", dtype=weight.dtype)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias:
        linear.bias = nn.Parameter(torch.zeros(n, dtype=weight.dtype, device=weight.device), requires_grad=False)
    return linear


def pack_rows(layer: str, weight: torch.Tensor, scheme: str, bias: bool = False) -> QuantizedLinearBase:
    """The deploy module ``quantize_(model, scheme)`` makes of a layer called ``layer`` with this (N, K) weight."""
    holder = holder_with(layer, linear_of(weight, bias))
    quantize_(holder, scheme)
    module = holder.get_submodule(layer)
    if not isinstance(module, QuantizedLinearBase):
        raise RuntimeError(f"layer {layer!r}: quantize_ did not pack it (got {type(module).__name__})")
    return module


def _grow(a: Any, b: Any, rows: int, where: str) -> Any:
    """The value for ``rows`` rows from its values ``a`` at PROBE_ROWS[0] and ``b`` at PROBE_ROWS[1] rows."""
    if a == b:
        return a
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return {k: _grow(a[k], b[k], rows, f"{where}.{k}") for k in a}
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [_grow(x, y, rows, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b))]
    r1, r2 = PROBE_ROWS
    if all(isinstance(v, int) and not isinstance(v, bool) for v in (a, b)) and Fraction(a, r1) == Fraction(b, r2):
        value = Fraction(a, r1) * rows
        if value.denominator == 1:
            return int(value)
    raise RuntimeError(f"{where}: {a!r} for {r1} rows and {b!r} for {r2} rows do not scale to {rows} rows")


def _packed_tensors(probes: list[QuantizedLinearBase], rows: int, layer: str) -> tuple[PackedTensor, ...]:
    states = [{k: v for k, v in p.state_dict().items() if k != "bias"} for p in probes]
    out = []
    for key, small in states[0].items():
        large = states[1][key]
        axes = [i for i, (x, y) in enumerate(zip(small.shape, large.shape)) if x != y]
        if len(axes) != 1 or small.dim() != large.dim():
            raise RuntimeError(f"layer {layer!r}: packed tensor {key!r} does not grow along one axis with the rows "
                               f"({tuple(small.shape)} vs {tuple(large.shape)}); it cannot be streamed")
        shape = _grow(list(small.shape), list(large.shape), rows, f"{layer}.{key}")
        per_row = Fraction(small.shape[axes[0]], PROBE_ROWS[0])
        out.append(PackedTensor(key, DTYPE_NAMES[small.dtype], tuple(shape), axes[0], per_row))
    return tuple(out)


class Planner:
    """Decides, tensor by tensor, what a streamed quantization with ``scheme`` does (see the module doc).
    ``skip``: substrings of layer names to leave unquantized (on top of embeddings and the scheme's list).
    ValueError from :func:`stream_config` for a scheme that cannot be streamed."""

    def __init__(self, scheme: str, skip: tuple[str, ...] = ()):
        self.scheme, self.config, self.skip = scheme, stream_config(scheme), tuple(skip)
        self._probes: dict[tuple, list[QuantizedLinearBase]] = {}

    def reason_to_copy(self, name: str, entry: TensorEntry, has_bias: bool) -> Optional[str]:
        """Why the tensor ``name`` is copied as is (None: it is a weight to pack)."""
        layer, _, leaf = name.rpartition(".")
        if leaf != "weight" or len(entry.shape) != 2:
            return "not a 2-D .weight"
        if entry.dtype not in WEIGHT_DTYPES:
            return f"dtype {entry.dtype} is not F32, F16 or BF16"
        if 0 in entry.shape:
            return "empty"
        parts = layer.split(".")
        if any("embed" in p for p in parts) or parts[-1] in EMBEDDING_NAMES:
            return "an embedding table"
        hit = next((s for s in self.skip if s in layer), None)
        if hit is not None:
            return f"matched --skip {hit!r}"
        n, k = entry.shape
        try:
            stub = holder_with(layer, nn.Linear(k, n, bias=has_bias, device="meta", dtype=TORCH_DTYPES[entry.dtype]))
        except (KeyError, TypeError):
            return "its name is not a module path"
        try:
            selection = select_layers(stub, self.config)
        except ShapeError as exc:
            return str(exc)
        if not selection.chosen:
            return selection.skipped[0].reason if selection.skipped else "not selected by the scheme"
        return None

    def plan_layer(self, name: str, entry: TensorEntry, has_bias: bool) -> LayerPlan:
        """The packed layout of the weight ``name`` (for which :meth:`reason_to_copy` is None)."""
        layer = name.rpartition(".")[0]
        n, k = entry.shape
        probes = self._probe(layer, k, entry.dtype, has_bias)
        tensors = _packed_tensors(probes, n, layer)
        meta = _grow(probes[0].quant_meta(), probes[1].quant_meta(), n, layer)
        quantum = math.lcm(*(t.per_row.denominator for t in tensors))  # N is a multiple (_grow checked it)
        return LayerPlan(layer, name, n, k, entry.dtype, meta, tensors, quantum)

    def _probe(self, layer: str, k: int, dtype: str, has_bias: bool) -> list[QuantizedLinearBase]:
        weights, inputs = self.config.resolve(layer)
        key = (weights, inputs, k, dtype, has_bias)
        if key not in self._probes:
            torch_dtype = TORCH_DTYPES[dtype]
            self._probes[key] = [pack_rows(layer, torch.zeros(r, k, dtype=torch_dtype), self.scheme, has_bias)
                                 for r in PROBE_ROWS]
        return self._probes[key]
