"""The one place evaluation and the CLI call the model-level quantization API (``lowbit.quantize`` & co)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from torch import nn

import lowbit


def names() -> list[str]:
    """Every named scheme, in the library's order."""
    return list(lowbit.SCHEMES)


def check_names(schemes: list[str]) -> None:
    """ValueError naming the unknown ones (and listing the known) if any name is not a scheme; also if empty."""
    if not schemes:
        raise ValueError(f"no scheme given; known: {','.join(lowbit.SCHEMES)}")
    unknown = [s for s in schemes if s not in lowbit.SCHEMES]
    if unknown:
        raise ValueError(f"unknown scheme(s) {','.join(unknown)}; known: {','.join(lowbit.SCHEMES)}")


def bits_per_weight(scheme: str) -> float:
    """The scheme's nominal bits per weight (element bits plus block scales)."""
    return float(lowbit.SCHEMES[scheme].bits_per_weight)


def needs_calibration(scheme: str) -> bool:
    return bool(lowbit.SCHEMES[scheme].needs_calibration)


@dataclass(frozen=True)
class Calibration:
    """``run(model)`` makes ``passes`` forward passes over the calibration data (lowbit.evaluation.run.calibrator)."""

    run: Callable[[nn.Module], None]
    passes: int

    def __call__(self, model: nn.Module) -> None:
        self.run(model)


def quantize_model(model: nn.Module, *, scheme: str | None = None, config: Mapping[str, Any] | None = None,
                   calibrate: Callable[[nn.Module], None] | None = None, amct_compat: bool = False,
                   progress: Callable[[str], object] | None = None) -> lowbit.QuantizeReport:
    """Quantize ``model`` in place with a named ``scheme`` or an AMCT-schema ``config`` (exactly one).

    A data-free scheme goes through :func:`lowbit.quantize_`; otherwise :func:`lowbit.quantize`, then
    ``calibrate(model)`` (forward passes; required, ValueError if None), then :func:`lowbit.convert`. A named
    scheme calibrated by a :class:`Calibration` takes its ``passes`` as ``batch_num``, so every pass counts (the
    schemes' own batch_num is 1: only the first pass did); a config keeps its own. A config is always
    calibrated when ``calibrate`` is given. Returns the per-layer report of every candidate layer
    (skipped ones from the quantize stage, converted ones from convert). ``progress(layer name)`` as each
    layer is packed. Errors of the API propagate.
    """
    if (scheme is None) == (config is None):
        raise ValueError("give exactly one of scheme and config")
    if scheme is not None and not needs_calibration(scheme) and not amct_compat:
        return lowbit.quantize_(model, scheme, progress=progress)
    if scheme is not None and calibrate is None:
        raise ValueError(f"scheme {scheme} needs calibration data")
    if scheme is not None and isinstance(calibrate, Calibration):
        config = {**lowbit.SCHEMES[scheme].config, "batch_num": calibrate.passes}
    first = lowbit.quantize(model, config if config is not None else scheme, amct_compat=amct_compat)
    if calibrate is not None:
        calibrate(model)
    converted = lowbit.convert(model, progress=progress)
    return lowbit.QuantizeReport("convert", scheme or "", amct_compat, {**first.layers, **converted.layers})


def save(model: nn.Module, directory: str | os.PathLike) -> None:
    """:func:`lowbit.save_quantized`."""
    lowbit.save_quantized(model, directory)


def directory_bytes(directory: str | os.PathLike) -> int:
    """Total size in bytes of the files under ``directory`` (a checkpoint)."""
    return sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())


def load(directory: str | os.PathLike, skeleton: nn.Module) -> nn.Module:
    """:func:`lowbit.load_quantized` into ``skeleton`` (which may be on the meta device)."""
    return lowbit.load_quantized(directory, skeleton)


def float_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (tied weights share one)."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += tensor.untyped_storage().nbytes()
    return total
