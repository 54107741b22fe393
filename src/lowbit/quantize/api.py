"""The model-level quantization API: quantize -> (calibrate) -> convert, and quantize_ for data-free schemes.

Everything happens in place on the model and returns a :class:`QuantizeReport`. Each call validates the
whole config and every selected layer (and builds every replacement module) before it replaces anything,
so on any error the model is unchanged. See docs/quantize.md.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Union

from torch import nn

from lowbit.errors import DeviceError, with_context
from lowbit.quantize.config import QuantConfig
from lowbit.quantize.modules import CalibrationModule, QuantizedLinearBase, replace_layer
from lowbit.quantize.report import LayerReport, QuantizeReport
from lowbit.quantize.schemes import AMCT_DEFAULT_CONFIG, get_scheme, thaw
from lowbit.quantize.selection import select_layers, unreplaceable_reason, weight_nbytes

ConfigLike = Union[Mapping[str, Any], QuantConfig, str, None]


def _check_model(func: str, model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"Func {func} argument model must be torch.nn.Module, got {type(model).__name__}")


def resolve_config(config: ConfigLike, amct_compat: bool) -> tuple[QuantConfig, str]:
    """(validated QuantConfig, scheme name or "") from a dict, a scheme name, a QuantConfig or None
    (AMCT's default, INT8 MinMax weight-only)."""
    if isinstance(config, QuantConfig):
        if amct_compat and not config.amct_compat:
            raise ValueError("amct_compat=True but the QuantConfig was built with amct_compat=False")
        return config, ""
    if isinstance(config, str):
        scheme = get_scheme(config)
        return QuantConfig.from_dict(thaw(scheme.config), amct_compat=amct_compat), scheme.name
    if config is None:
        return QuantConfig.from_dict(thaw(AMCT_DEFAULT_CONFIG), amct_compat=amct_compat), ""
    return QuantConfig.from_dict(config, amct_compat=amct_compat), ""


def _calibration_module(name: str, layer: nn.Module, layer_cfg) -> CalibrationModule:
    try:
        return CalibrationModule(name, layer, layer_cfg)
    except (ValueError, TypeError, RuntimeError) as exc:  # say which layer: a model has hundreds
        raise with_context(f"layer {name!r}", exc) from exc


def _prepare(model: nn.Module, config: ConfigLike, amct_compat: bool, stage: str):
    cfg, scheme = resolve_config(config, amct_compat)
    selection = select_layers(model, cfg, scheme)
    on_meta = [name for name, layer, _ in selection.chosen if layer.weight.device.type == "meta"]
    if on_meta:
        raise DeviceError(f"{stage}: layers on the meta device hold no weights to quantize: {on_meta}; "
                          "materialize them first (lowbit.load_quantized loads a quantized checkpoint into such a "
                          "skeleton)")
    modules = [(name, _calibration_module(name, layer, layer_cfg), layer)
               for name, layer, layer_cfg in selection.chosen]
    report = QuantizeReport(stage, scheme, cfg.amct_compat)
    return modules, selection, report


def quantize(model: nn.Module, config: ConfigLike = None, *, amct_compat: bool = False) -> QuantizeReport:
    """Replace each selected layer of ``model`` by its calibration module (:class:`CalibrationModule`), in place.

    ``config``: AMCT's dict, a scheme name from ``SCHEMES``, a :class:`QuantConfig`, or None (AMCT's default
    INT8 MinMax weight-only preset). ``amct_compat``: reproduce AMCT bit for bit, quirks included. Then run
    ordinary forward passes (``batch_num`` calls per layer for data-dependent algorithms) and call
    :func:`convert`. Errors (model unchanged): TypeError, ValueError (config, unknown scheme, unsupported
    combination), ShapeError (a layer the format cannot represent)."""
    _check_model("quantize", model)
    modules, selection, report = _prepare(model, config, amct_compat, "quantize")
    for name, module, linear in modules:
        replace_layer(model, name, module)
        status = "quantized" if module.calibrated else "calibrating"
        report.add(LayerReport(name, type(linear).__name__, status, module.layer_config.describe(),
                               bytes_before=weight_nbytes(linear)))
    for skipped in selection.skipped:
        report.add(skipped)
    return report


def _deploy_modules(pending, progress: Optional[Callable[[str], object]]) -> list:
    """(name, calibration module, deploy module) for each (name, calibration module); ``progress(name)``
    after each layer is packed (the slow step: a command's progress bar)."""
    deployed = []
    for name, calib in pending:
        try:
            deployed.append((name, calib, calib.to_deploy()))
        except (ValueError, TypeError, RuntimeError) as exc:  # say which layer: a model has hundreds
            raise with_context(f"layer {name!r}", exc) from exc
        if progress is not None:
            progress(name)
    return deployed


def convert(model: nn.Module, *, progress: Optional[Callable[[str], object]] = None) -> QuantizeReport:
    """Replace every calibration module of ``model`` by its deployable packed module, in place.

    RuntimeError naming every layer that is not calibrated yet (fewer forward calls than ``batch_num``), or
    that got hooks a deploy module cannot keep since quantize (selection.unreplaceable_reason); the model is
    then unchanged. ``progress(layer name)`` is called as each layer is packed."""
    _check_model("convert", model)
    pending = [(n, m) for n, m in model.named_modules() if isinstance(m, CalibrationModule)]
    missing = [f"{n} ({m.calls}/{m.layer_config.batch_num} calls)" for n, m in pending if not m.calibrated]
    if missing:
        raise RuntimeError(f"convert: layers not calibrated yet (run forward passes first): {', '.join(missing)}")
    reasons = {n: unreplaceable_reason(m) for n, m in pending}
    unreplaceable = [f"{n} ({reason})" for n, reason in reasons.items() if reason is not None]
    if unreplaceable:  # hooks added since quantize
        raise RuntimeError(f"convert: layers a deploy module cannot replace: {', '.join(unreplaceable)}")
    deployed = _deploy_modules(pending, progress)
    schemes = {m.layer_config.scheme for _, m in pending}  # the scheme quantize was given, if one named it
    report = QuantizeReport("convert", schemes.pop() if len(schemes) == 1 else "",
                            any(m.layer_config.amct_compat for _, m in pending))
    for name, calib, deploy in deployed:
        replace_layer(model, name, deploy)
        report.add(_deployed_report(name, calib, deploy))
    return report


def _deployed_report(name: str, calib: CalibrationModule, deploy: QuantizedLinearBase) -> LayerReport:
    return LayerReport(name, calib.layer_type, "converted", calib.layer_config.describe(),
                       bytes_before=weight_nbytes(calib), bytes_after=deploy.packed_nbytes())


def quantize_(model: nn.Module, config: ConfigLike, *,
              progress: Optional[Callable[[str], object]] = None) -> QuantizeReport:
    """quantize + convert in one call for a data-free scheme or config (in place).

    ValueError (model unchanged) if any selected layer needs calibration data; otherwise as :func:`quantize`.
    ``progress(layer name)`` is called as each layer is packed."""
    _check_model("quantize_", model)
    modules, selection, report = _prepare(model, config, False, "quantize_")
    needs = [name for name, module, _ in modules if not module.calibrated]
    if needs:
        raise ValueError(f"quantize_: this config needs calibration data (layers {needs}); use quantize(), run "
                         "forward passes, then convert()")
    deployed = _deploy_modules([(name, module) for name, module, _ in modules], progress)
    for name, calib, deploy in deployed:
        replace_layer(model, name, deploy)
        report.add(_deployed_report(name, calib, deploy))
    for skipped in selection.skipped:
        report.add(skipped)
    return report
