"""Which layers a config quantizes, with which resolved config, and why the others are skipped.

:func:`select_layers` validates everything (combinations, what lowbit implements, shapes) and raises
before anything is changed; it never mutates the model. Rules: docs/quantize.md, "Layer selection".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.nn.utils import parametrize

from lowbit.errors import ShapeError
from lowbit.quantize.combinations import FLOAT_DTYPES, check_combination, comb_name, select_algorithm, table
from lowbit.quantize.config import AlgorithmSpec, InputSpec, LayerConfig, QuantConfig, WeightSpec
from lowbit.quantize.modules import CalibrationModule, QuantizedLinearBase
from lowbit.quantize.report import LayerReport
from lowbit.quantize.weight_formats import WEIGHT_FORMATS

IMPLEMENTED_ALGORITHMS = ("minmax", "smoothquant", "mxquant", "ofmr", "cast", "quantile", "svdquant")
IMPLEMENTED_INPUT_TYPES = ("hifloat8", "float8_e4m3fn", "mxfp8_e4m3fn", "mxfp4_e2m1")


@dataclass(frozen=True)
class Selection:
    """``chosen``: (name, module, LayerConfig) per layer to quantize; ``skipped``: reports with reasons."""

    chosen: tuple[tuple[str, nn.Linear, LayerConfig], ...]
    skipped: tuple[LayerReport, ...]


def check_implemented(weights: WeightSpec, inputs: InputSpec, algorithm: AlgorithmSpec, where: str) -> None:
    """ValueError for a valid AMCT combination that lowbit does not execute."""
    if algorithm.name not in IMPLEMENTED_ALGORITHMS:
        raise ValueError(f"{where}: lowbit does not implement algorithm {algorithm.name!r} "
                         f"(implemented: {list(IMPLEMENTED_ALGORITHMS)})")
    if weights.type not in WEIGHT_FORMATS:
        raise ValueError(f"{where}: lowbit does not implement {weights.type} weights "
                         f"(implemented: {list(WEIGHT_FORMATS)})")
    if weights.type == "int4" and weights.strategy != "group":
        raise ValueError(f"{where}: lowbit runs int4 weights per group only (weight_quant_batch_matmul), "
                         f"got strategy {weights.strategy!r}")
    if weights.type == "int8" and weights.strategy == "group":
        raise ValueError(f"{where}: lowbit does not implement per-group int8 weights")
    if inputs.enabled and inputs.type not in IMPLEMENTED_INPUT_TYPES:
        raise ValueError(f"{where}: lowbit does not implement {inputs.type} activation quantization "
                         f"(implemented: {list(IMPLEMENTED_INPUT_TYPES)})")


def check_shape(name: str, linear: nn.Linear, cfg: LayerConfig) -> None:
    """ShapeError naming the layer when the format cannot represent its (N, K)."""
    n, k = linear.out_features, linear.in_features
    spec = cfg.weights
    if spec.group_size is not None and k % spec.group_size:
        raise ShapeError(f"layer {name!r}: group size {spec.group_size} does not divide K = {k}")
    # Block formats (MX, HiF4) are configured with their block as group size, so this covers them too.
    if spec.type == "int4" and n % 2:
        raise ShapeError(f"layer {name!r}: int4 weights pack two columns per byte, N = {n} is odd")
    if cfg.algorithm.name == "svdquant":
        rank = cfg.algorithm.options.get("rank", 32)
        if rank > min(n, k):
            raise ShapeError(f"layer {name!r}: svdquant rank {rank} exceeds min(N, K) = {min(n, k)}")


def amct_skip_reason(layer: nn.Module, weights: WeightSpec, inputs: InputSpec) -> Optional[str]:
    """AMCT's silent per-layer skips (NPU limits, dtype table) for the global combination; compat mode only."""
    comb = comb_name(weights, inputs)
    row = table(True).get(comb)
    if row is not None and layer.weight.dtype not in row.weight_dtypes:
        return f"weight dtype {layer.weight.dtype} not supported by AMCT for {comb}"
    if not isinstance(layer, nn.Linear):
        return None  # the shape limits below are for Linear layers only
    n, k = layer.out_features, layer.in_features
    if not inputs.enabled and (n > 65535 or k > 65535):
        return f"AMCT weight-only limit: N or K > 65535 (N={n}, K={k})"
    if comb == "mxfp8_e4m3fn mxfp8_e4m3fn" and (-(-k // 32)) % 2:
        return f"AMCT mxfp8 needs an even number of 32-blocks along K (K={k})"
    if comb in ("NOT_QUANTIZE mxfp4_e2m1", "NOT_QUANTIZE float4_e2m1") and (k % 64 or n % 64):
        return f"AMCT {weights.type} weight-only needs K and N multiples of 64 (N={n}, K={k})"
    if comb in ("NOT_QUANTIZE int4", "int8 int4") and (k % 8 or n % 8):
        return f"AMCT int4 needs K and N multiples of 8 (N={n}, K={k})"
    if weights.group_size is not None and weights.group_size >= k:
        return f"group_size {weights.group_size} >= K = {k} (AMCT skips the layer)"
    return None


def _is_candidate(module: nn.Module, amct_compat: bool) -> bool:
    if amct_compat:
        return type(module).__name__ in ("Linear", "Conv2d", "FP8Linear")
    return isinstance(module, (nn.Linear, nn.Conv2d)) or type(module).__name__ == "FP8Linear"


LOWBIT_LAYERS = (CalibrationModule, QuantizedLinearBase)  # a layer lowbit.quantize already replaced
# Hooks a replaced layer cannot keep: it has no derivative and another state dict (forward hooks move with it:
# modules.replace_layer).
_KEPT_OUT_HOOKS = {"backward": ("_backward_hooks", "_backward_pre_hooks"),
                   "state-dict": ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                                  "_load_state_dict_post_hooks")}


def unreplaceable_reason(module: nn.Module) -> Optional[str]:
    """Why the quantized module could not stand in for ``module``: a class that computes something else in its
    own forward (an nn.Linear / nn.Conv2d subclass overriding it), or hooks that would be lost; else None."""
    for base in (nn.Linear, nn.Conv2d):
        if isinstance(module, base) and any(getattr(type(module), f) is not getattr(base, f)
                                            for f in ("forward", "_conv_forward") if hasattr(base, f)):
            return (f"its class {type(module).__name__} overrides {base.__name__}'s forward, which the quantized "
                    "layer would not compute")
    if parametrize.is_parametrized(module):
        return ("its weight is parametrized (torch.nn.utils.parametrize), which a quantized layer would freeze "
                "(remove the parametrizations, e.g. with parametrize.remove_parametrizations, to quantize it)")
    for kind, attributes in _KEPT_OUT_HOOKS.items():
        if any(getattr(module, a, None) for a in attributes):
            return f"it has {kind} hooks, which a quantized layer cannot keep (remove them to quantize it)"
    for hook in module._forward_pre_hooks.values():
        if type(hook).__module__.startswith("torch.nn.utils"):  # weight_norm, spectral_norm: they make its weight
            return (f"a {type(hook).__name__} hook recomputes its weight before each call (remove it, e.g. with "
                    "torch.nn.utils.remove_weight_norm, to quantize the layer)")
    return None


def _skip(name: str, module: nn.Module, reason: str) -> LayerReport:
    weight = getattr(module, "weight", None)
    measurable = isinstance(weight, torch.Tensor) and not isinstance(weight, nn.parameter.UninitializedParameter)
    size = weight_nbytes(module) if measurable else 0
    return LayerReport(name, type(module).__name__, "skipped", reason=reason, bytes_before=size, bytes_after=size)


def select_layers(model: nn.Module, config: QuantConfig, scheme: str = "") -> Selection:
    """Resolve ``config`` (named ``scheme``, or "") against ``model``: the layers to quantize and the skipped
    candidates (see the module docstring)."""
    compat = config.amct_compat
    algorithm = select_algorithm(config.algorithms, compat)
    if algorithm is None:
        return Selection((), ())
    if config.weights is not None:
        check_combination(config.weights, config.inputs, algorithm, compat)
        check_implemented(config.weights, config.inputs, algorithm, "config")
    chosen, skipped = [], []
    # nn.MultiheadAttention multiplies by out_proj.weight itself: a replaced out_proj would never be called.
    read_directly = {id(m.out_proj): n for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)}
    names_of: dict[int, list[str]] = {}  # a module registered under several names is replaced under none
    for n, m in model.named_modules(remove_duplicate=False):
        names_of.setdefault(id(m), []).append(n)
    for name, module in model.named_modules():
        if isinstance(module, LOWBIT_LAYERS):  # (a second quantize returned an empty report, silently)
            skipped.append(_skip(name, module, f"already quantized by lowbit ({type(module).__name__})"))
            continue
        if not _is_candidate(module, compat):
            continue
        if id(module) in read_directly:
            skipped.append(_skip(name, module, f"nn.MultiheadAttention {read_directly[id(module)]!r} reads its "
                                               "weight directly (its forward never calls this layer)"))
            continue
        if len(names_of[id(module)]) > 1:
            skipped.append(_skip(name, module, f"the same module is registered as {names_of[id(module)]}: "
                                               "replacing it under one name would leave the others float"))
            continue
        if isinstance(module.weight, nn.parameter.UninitializedParameter):
            skipped.append(_skip(name, module, "its weight is not initialized yet (a lazy module: run the model "
                                               "once before quantizing it)"))
            continue
        if 0 in module.weight.shape:
            skipped.append(_skip(name, module, f"empty weight {tuple(module.weight.shape)}"))
            continue
        if type(module).__name__ == "FP8Linear":
            skipped.append(_skip(name, module, "already quantized (FP8Linear)"))
            continue
        conv = type(module).__name__ == "Conv2d" if compat else isinstance(module, nn.Conv2d)
        if conv and algorithm.name != "ofmr":
            continue  # AMCT: only OFMR quantizes Conv2d layers
        unreplaceable = unreplaceable_reason(module)
        if unreplaceable is not None:
            skipped.append(_skip(name, module, unreplaceable))
            continue
        if conv and module.padding_mode != "zeros":
            skipped.append(_skip(name, module, f"Conv2d padding_mode {module.padding_mode!r} (AMCT needs 'zeros')"))
            continue
        hit = next((s for s in config.skip_layers if s in name), None)
        if hit is not None:
            skipped.append(_skip(name, module, f"matched skip_layers entry {hit!r}"))
            continue
        if name == "":
            skipped.append(_skip(name, module, "the root module cannot be replaced in place (wrap it)"))
            continue
        weights, inputs = config.resolve(name)
        if weights is None:
            skipped.append(_skip(name, module, "no weights config for this layer"))
            continue
        overridden = (weights, inputs) != (config.weights, config.inputs)
        if overridden and not compat:
            check_combination(weights, inputs, algorithm, compat)
        if overridden:
            check_implemented(weights, inputs, algorithm, f"layer {name!r}")
        reason = None
        if compat and config.weights is not None:
            reason = amct_skip_reason(module, config.weights, config.inputs)
        elif module.weight.dtype not in FLOAT_DTYPES:
            reason = f"weight dtype {module.weight.dtype} is not float32, float16 or bfloat16"
        if reason is not None:
            skipped.append(_skip(name, module, reason))
            continue
        cfg = LayerConfig(name, weights, inputs, algorithm, config.batch_num, compat, scheme)
        if conv and not inputs.enabled:
            raise ValueError(f"layer {name!r}: weight-only OFMR is not supported for Conv2d (AMCT's deploy op "
                             "needs an activation scale)")
        if not conv:
            check_shape(name, module, cfg)
        chosen.append((name, module, cfg))
    return Selection(tuple(chosen), tuple(skipped))


def weight_nbytes(module: nn.Module) -> int:
    w = module.weight
    return w.numel() * w.element_size()

