"""The quantization config: AMCT's dict schema, validated, as typed frozen dataclasses.

:meth:`QuantConfig.from_dict` accepts AMCT's dict as is (docs/quantize.md, "Config schema"), raises the
errors AMCT raises with AMCT's message prefixes, and in addition rejects any key AMCT does not know
(``ValueError`` naming it). ``amct_compat=False`` (default) also accepts lowbit's extra formats and
algorithms (``hifloat4`` weights, ``mxfp4_e2m1`` activations, ``svdquant``) and fixes AMCT's config quirks
(docs/quantize.md, "Quirks"). Combination rules live in :mod:`lowbit.quantize.combinations`.
"""

from __future__ import annotations

import fnmatch
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

AMCT_WEIGHT_TYPES = ("int8", "int4", "hifloat8", "float8_e4m3fn", "mxfp4_e2m1", "float4_e2m1", "mxfp8_e4m3fn")
LOWBIT_WEIGHT_TYPES = ("hifloat4",)
AMCT_INPUT_TYPES = ("int8", "int4", "hifloat8", "float8_e4m3fn", "mxfp8_e4m3fn")
LOWBIT_INPUT_TYPES = ("mxfp4_e2m1",)
MX_INPUT_TYPES = ("mxfp8_e4m3fn", "mxfp4_e2m1")  # block-quantized activations: strategy is forced to group
ASYMMETRIC_WEIGHT_TYPES = ("int8", "int4")
WEIGHT_STRATEGIES = ("tensor", "channel", "group")
INPUT_STRATEGIES = ("tensor", "token")
GROUP_WEIGHT_TYPES = ("int4", "int8", "float4_e2m1", "mxfp4_e2m1", "mxfp8_e4m3fn")
FIXED_GROUP_SIZES = {"mxfp8_e4m3fn": (32,), "mxfp4_e2m1": (32,), "float4_e2m1": (32, 64, 128, 256), "hifloat4": (64,)}
AMCT_ALGORITHMS = ("minmax", "awq", "gptq", "smoothquant", "mxquant", "ofmr", "cast", "quantile")
LOWBIT_ALGORITHMS = ("svdquant",)
_SUFFIXES = (".weights", ".inputs", ".kvcache")
_TOP_KEYS = ("batch_num", "quant_cfg", "algorithm", "skip_layers")
_WEIGHT_KEYS = ("type", "symmetric", "strategy", "group_size")
_INPUT_KEYS = ("enable_quant", "type", "symmetric", "strategy", "dynamic")


@dataclass(frozen=True)
class WeightSpec:
    """How weights are quantized: element ``type``, ``symmetric``, ``strategy`` (tensor / channel / group)
    and ``group_size`` (K elements per scale; only with strategy ``group``)."""

    type: str
    symmetric: bool = True
    strategy: str = "tensor"
    group_size: Optional[int] = None


@dataclass(frozen=True)
class InputSpec:
    """How activations are quantized. ``type`` None: not quantized (weight-only). ``strategy`` tensor
    (one static scale), token (per-token), or group (MX blocks of 32); ``dynamic``: scales computed per call."""

    type: Optional[str] = None
    symmetric: bool = True
    strategy: str = "tensor"
    dynamic: Optional[bool] = None

    @property
    def enabled(self) -> bool:
        return self.type is not None


NO_INPUTS = InputSpec()


class FrozenMapping(Mapping):
    """A read-only mapping that, unlike types.MappingProxyType, can be pickled and deep-copied: a model between
    quantize and convert holds its layers' configs (deepcopy, pickle and torch.save of it failed)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping = ()) -> None:
        self._items = dict(items)

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"FrozenMapping({self._items!r})"


@dataclass(frozen=True)
class AlgorithmSpec:
    """One algorithm by name and its options (a read-only mapping)."""

    name: str
    options: Mapping[str, Any] = field(default_factory=lambda: FrozenMapping({}))


@dataclass(frozen=True)
class Override:
    """A per-layer (fnmatch) override: layers matching ``pattern`` use ``spec`` for ``kind``."""

    pattern: str
    kind: str  # "weights" or "inputs"
    spec: Any  # WeightSpec or InputSpec


@dataclass(frozen=True)
class QuantConfig:
    """A validated quantization config (build it with :meth:`from_dict`)."""

    weights: Optional[WeightSpec]
    inputs: InputSpec = NO_INPUTS
    algorithms: tuple[AlgorithmSpec, ...] = ()
    skip_layers: tuple[str, ...] = ()
    overrides: tuple[Override, ...] = ()
    batch_num: int = 1
    amct_compat: bool = False

    @classmethod
    def from_dict(cls, config: Mapping, *, amct_compat: bool = False) -> "QuantConfig":
        """Validate AMCT's config dict (see module docstring); ValueError/TypeError on the first problem."""
        return _parse(config, amct_compat)

    def resolve(self, layer_name: str) -> tuple[Optional[WeightSpec], InputSpec]:
        """The (weights, inputs) specs for ``layer_name``: the first matching override of each kind wins."""
        weights, inputs = self.weights, self.inputs
        found: set[str] = set()
        for override in self.overrides:
            if override.kind not in found and pattern_matches(override.pattern, layer_name):
                found.add(override.kind)
                if override.kind == "weights":
                    weights = override.spec
                else:
                    inputs = override.spec
        return weights, inputs

    def is_skipped(self, layer_name: str) -> bool:
        """AMCT's rule: a layer is skipped if any ``skip_layers`` entry is a substring of its name."""
        return any(s in layer_name for s in self.skip_layers)


def pattern_matches(pattern: str, layer_name: str) -> bool:
    """AMCT's fuzzy match: the pattern matches the name, or the name with a .weights/.inputs/.kvcache suffix."""
    return fnmatch.fnmatch(layer_name, pattern) or any(fnmatch.fnmatch(layer_name + s, pattern) for s in _SUFFIXES)


def _reject_unknown(where: str, given: Mapping, known: tuple[str, ...]) -> None:
    unknown = [k for k in given if k not in known]
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown} (AMCT knows {list(known)})")


def _require_mapping(where: str, value: Any) -> Mapping:
    if not isinstance(value, Mapping):
        raise TypeError(f"{where} must be a dict, got {type(value).__name__}")
    return value


def parse_weights(d: Mapping, amct_compat: bool, where: str = "weights") -> Optional[WeightSpec]:
    """One ``weights`` dict -> WeightSpec (None for an empty dict), AMCT's field checks in AMCT's order."""
    d = _require_mapping(where, d)
    if not d:
        return None
    _reject_unknown(where, d, _WEIGHT_KEYS)
    types = AMCT_WEIGHT_TYPES + (() if amct_compat else LOWBIT_WEIGHT_TYPES)
    wtype = d.get("type")
    if wtype not in types:
        raise ValueError(f"Weights quant_dtype only support {list(types)}, but got {wtype!r} ({where})")
    symmetric = d.get("symmetric", True)
    if not isinstance(symmetric, bool):
        raise ValueError(f"Weights symmetric only support bool [True, False], but got {symmetric!r} ({where})")
    if not symmetric and wtype not in ASYMMETRIC_WEIGHT_TYPES:
        raise ValueError(f"Weights symmetric only support to be True when weight quant_type is {wtype} ({where})")
    strategy = d.get("strategy", "tensor")
    if strategy not in WEIGHT_STRATEGIES:
        raise ValueError(f"Weights strategy only support{list(WEIGHT_STRATEGIES)}, but got {strategy!r} ({where})")
    group_size = d.get("group_size")
    if group_size is not None and strategy != "group":
        raise ValueError(f"Weights group_size only support strategy group, but strategy is {strategy!r} ({where})")
    if strategy == "group":
        if group_size is None:
            raise ValueError(f"Weights group_size is necessary, when weights strategy is group ({where})")
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
            raise ValueError(f"group_size only support positive int, but got {group_size!r} ({where})")
        group_types = GROUP_WEIGHT_TYPES + (() if amct_compat else LOWBIT_WEIGHT_TYPES)
        if wtype not in group_types:
            raise ValueError(
                f"Weights group_size only support for weight dtype: {list(group_types)}, got {wtype} ({where})")
        allowed = FIXED_GROUP_SIZES.get(wtype)
        if allowed and group_size not in allowed:
            raise ValueError(
                f"wts_type {wtype} only support group_size value: {list(allowed)}, got {group_size} ({where})")
    return WeightSpec(wtype, symmetric, strategy, group_size)


def parse_inputs(d: Mapping, amct_compat: bool, where: str = "inputs") -> InputSpec:
    """One ``inputs`` dict -> InputSpec, AMCT's field checks in AMCT's order."""
    d = _require_mapping(where, d)
    _reject_unknown(where, d, _INPUT_KEYS)
    enable = d.get("enable_quant", True)
    if not isinstance(enable, bool):
        raise ValueError(f"Inputs enable_quant only support bool [True, False], but got {enable!r} ({where})")
    if not enable or (not d and not amct_compat):
        return NO_INPUTS
    types = AMCT_INPUT_TYPES + (() if amct_compat else LOWBIT_INPUT_TYPES)
    itype = d.get("type")
    if itype is None and amct_compat:
        raise TypeError(f"Inputs quant_dtype is unset ({where}): AMCT fails building the dtype combination")
    if itype not in types:
        raise ValueError(f"Inputs quant_dtype only support {list(types)}, but got {itype!r} ({where})")
    symmetric = d.get("symmetric", True)
    if not isinstance(symmetric, bool):
        raise ValueError(f"Inputs symmetric only support bool [True, False], but got {symmetric!r} ({where})")
    if not symmetric and itype != "int8":
        raise ValueError(f"Inputs symmetric is unsupported to be False when Inputs quant_type is {itype} ({where})")
    strategy = d.get("strategy", "tensor")
    if itype not in MX_INPUT_TYPES and strategy not in INPUT_STRATEGIES:
        raise ValueError(f"Inputs strategy only support{list(INPUT_STRATEGIES)}, but got {strategy!r} ({where})")
    if strategy == "token" and not symmetric:
        raise ValueError(f"Inputs strategy token do not support asymmetric quantization ({where})")
    dynamic = d.get("dynamic")
    if dynamic is not None and strategy != "token":
        raise ValueError(f"Inputs dynamic only support strategy ['token'], but strategy is {strategy!r} ({where})")
    if dynamic is not None and not isinstance(dynamic, bool):
        raise ValueError(f"Inputs dynamic only support bool [True, False], but got {dynamic!r} ({where})")
    return InputSpec(itype, symmetric, strategy, dynamic)


def _check_kvcache(d: Any) -> None:
    _require_mapping("kvcache", d)
    if d and d.get("enable_quant", True):
        raise ValueError(
            "kvcache: KV-cache quantization is not supported by lowbit (AMCT applies it only to "
            "DeepseekV3Attention / LongcatFlashMLA modules with algorithm quantile)"
        )


def _algorithm_options(name: str, options: Any, amct_compat: bool) -> Mapping[str, Any]:
    options = {} if options is None else options
    if not isinstance(options, Mapping):
        raise ValueError(f"invalid algo name, pls check config: options of {name!r} must be a dict, got {options!r}")
    if name == "awq":
        grids = options.get("grids_num")
        if grids is None:
            raise ValueError("Awq grids_num is necessary param, pls check and set")
        if not isinstance(grids, int) or isinstance(grids, bool) or grids <= 0:
            raise ValueError(f"Awq grids_num only support positive int, but got {grids!r}")
        known: tuple[str, ...] = ("grids_num",)
    elif name == "smoothquant":
        alpha = options.get("smooth_strength")
        if alpha is None:
            raise ValueError("Smoothquant smooth_strength is necessary param, pls check and set")
        if not isinstance(alpha, float) or not 0.0 < alpha < 1.0:
            raise ValueError(f"Smoothquant smooth_strength only support float (0, 1), but got {alpha!r}")
        known = ("smooth_strength",)
    elif name == "svdquant":
        rank = options.get("rank", 32)
        if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
            raise ValueError(f"svdquant rank must be a positive int, got {rank!r}")
        known = ("rank",)
    elif name in ("ofmr", "quantile") and amct_compat:
        known = tuple(options)  # AMCT accepts and ignores any options here
    else:
        known = ()
    _reject_unknown(f"algorithm {name!r} options", options, known)
    return FrozenMapping(options)


def parse_algorithms(algorithm: Any, amct_compat: bool) -> tuple[AlgorithmSpec, ...]:
    """``str`` | ``set`` of names | ``dict`` name -> options -> AlgorithmSpec tuple (iteration order)."""
    if algorithm is None:
        return ()
    if isinstance(algorithm, str):
        items = [(algorithm, None)]
    elif isinstance(algorithm, (set, frozenset)):
        items = [(name, None) for name in algorithm]
    elif isinstance(algorithm, Mapping):
        items = list(algorithm.items())
    else:
        raise ValueError(f"invalid algo name, pls check config: got {algorithm!r}")
    known = AMCT_ALGORITHMS + (() if amct_compat else LOWBIT_ALGORITHMS)
    specs = []
    for name, options in items:
        if not isinstance(name, str) or name not in known:
            raise ValueError(f"Not support algorithm {name}, pls regiter it first (known: {list(known)})")
        specs.append(AlgorithmSpec(name, _algorithm_options(name, options, amct_compat)))
    return tuple(specs)


def parse_skip_layers(skip: Any, amct_compat: bool) -> tuple[str, ...]:
    """An iterable of str; a plain str is one pattern (AMCT would iterate its characters: warned in compat)."""
    if skip is None:
        return ()
    if isinstance(skip, str):
        if amct_compat:
            warnings.warn(
                f"skip_layers={skip!r} is a str: lowbit treats it as one pattern, AMCT would skip every layer "
                "containing any of its characters", stacklevel=4)
        return (skip,)
    try:
        entries = tuple(skip)
    except TypeError:
        raise ValueError(f"Skip layers must be str: skip_layers must be an iterable of str, got {skip!r}") from None
    for entry in entries:
        if not isinstance(entry, str):
            raise ValueError(f"Skip layers must be str, got {entry!r}")
    return entries


def _parse(config: Mapping, amct_compat: bool) -> QuantConfig:
    if not isinstance(config, Mapping):
        raise TypeError(f"Func quantize argument config must be dict, got {type(config).__name__}")
    _reject_unknown("config", config, _TOP_KEYS)
    batch_num = config.get("batch_num", 1)
    bool_ok = amct_compat  # AMCT accepts batch_num=True as 1
    if not isinstance(batch_num, int) or batch_num <= 0 or (isinstance(batch_num, bool) and not bool_ok):
        raise ValueError(f"Batch num only support positive int, but got {batch_num!r}")
    quant_cfg = _require_mapping("quant_cfg", config.get("quant_cfg", {}))
    overrides = []
    for key in quant_cfg:
        if key in ("weights", "inputs", "kvcache"):
            continue
        if not (isinstance(key, str) and "*" in key and key.endswith(_SUFFIXES)):
            raise ValueError(
                f"quant_cfg: unknown key {key!r} (expected weights, inputs, kvcache or a pattern with '*' ending "
                f"in .weights / .inputs / .kvcache)"
            )
    weights = parse_weights(quant_cfg.get("weights", {}), amct_compat)
    inputs = parse_inputs(quant_cfg["inputs"], amct_compat) if "inputs" in quant_cfg else NO_INPUTS
    _check_kvcache(quant_cfg.get("kvcache", {}))
    for key, value in quant_cfg.items():
        if key in ("weights", "inputs", "kvcache"):
            continue
        if key.endswith(".weights"):
            overrides.append(Override(key, "weights", parse_weights(value, amct_compat, key)))
        elif key.endswith(".inputs"):
            overrides.append(Override(key, "inputs", parse_inputs(value, amct_compat, key)))
        else:
            _check_kvcache(value)
    if weights is None and not any(o.kind == "weights" for o in overrides):
        raise ValueError(
            'Configuration must include at least one weights configuration: either a "weights" field or a fuzzy '
            'matching pattern like "*.weights"'
        )
    algorithms = parse_algorithms(config.get("algorithm"), amct_compat)
    skip_layers = parse_skip_layers(config.get("skip_layers", ()), amct_compat)
    if not algorithms:
        if not amct_compat:
            raise ValueError("config has no algorithm: nothing would be quantized (AMCT quantizes nothing silently)")
        warnings.warn("config has no algorithm: AMCT quantizes nothing", stacklevel=3)
    return QuantConfig(weights, inputs, algorithms, skip_layers, tuple(overrides), batch_num, amct_compat)


@dataclass(frozen=True)
class LayerConfig:
    """The resolved config of one selected layer (what its calibration module receives)."""

    name: str
    weights: WeightSpec
    inputs: InputSpec
    algorithm: AlgorithmSpec
    batch_num: int = 1
    amct_compat: bool = False
    scheme: str = ""  # the SCHEMES name the config came from, if any

    def describe(self) -> str:
        """e.g. ``hifloat8 w channel / hifloat8 a tensor (ofmr)``."""
        w = self.weights
        wdesc = f"{w.type} w {w.strategy}" + (f" {w.group_size}" if w.group_size else "")
        adesc = f"{self.inputs.type} a {self.inputs.strategy}" if self.inputs.enabled else "weight-only"
        return f"{wdesc} / {adesc} ({self.algorithm.name})"
