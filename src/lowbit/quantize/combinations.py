"""Which (activation, weight) type combinations each algorithm accepts: AMCT's table plus lowbit's rows.

A combination ("comb") is the string ``"<act_type> <wts_type>"``, act_type ``NOT_QUANTIZE`` for weight-only.
:func:`check_combination` applies AMCT's combination rules (same messages); lowbit's extra rows are used
only when ``amct_compat`` is False. Table and rules: docs/quantize.md, "Allowed combinations".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from lowbit.quantize.config import AlgorithmSpec, InputSpec, WeightSpec

_F32, _F16, _BF16 = torch.float32, torch.float16, torch.bfloat16
FLOAT_DTYPES = (_F32, _F16, _BF16)


@dataclass(frozen=True)
class Combination:
    """One row: algorithms, original weight dtypes, weight strategies, activation strategies allowed."""

    algorithms: tuple[str, ...]
    weight_dtypes: tuple[torch.dtype, ...]
    weight_strategies: tuple[str, ...]
    act_strategies: tuple[str, ...] = ()


AMCT_TABLE: dict[str, Combination] = {
    "int8 int8": Combination(("minmax", "smoothquant"), (_BF16, _F16), ("tensor", "channel"), ("tensor", "token")),
    "int8 int4": Combination(("minmax", "smoothquant"), (_F16,), ("tensor", "channel"), ("tensor",)),
    "hifloat8 hifloat8": Combination(("ofmr", "cast", "quantile", "smoothquant"), FLOAT_DTYPES,
                                     ("tensor", "channel"), ("tensor", "token")),
    "float8_e4m3fn float8_e4m3fn": Combination(("ofmr",), FLOAT_DTYPES, ("tensor", "channel"), ("tensor",)),
    "mxfp8_e4m3fn mxfp8_e4m3fn": Combination(("mxquant",), (_BF16,), ("group",), ("group",)),
    "float8_e4m3fn float4_e2m1": Combination(("minmax", "smoothquant"), (_BF16,), ("group",), ("tensor",)),
    "NOT_QUANTIZE int8": Combination(("minmax", "awq", "gptq"), (_BF16, _F16), ("tensor", "channel", "group")),
    "NOT_QUANTIZE int4": Combination(("minmax", "awq", "gptq"), FLOAT_DTYPES, ("tensor", "channel", "group")),
    "NOT_QUANTIZE hifloat8": Combination(("ofmr", "gptq", "cast", "quantile"), (_BF16, _F16), ("tensor", "channel")),
    "NOT_QUANTIZE float8_e4m3fn": Combination(("ofmr", "gptq"), (_BF16, _F16), ("tensor", "channel")),
    "NOT_QUANTIZE mxfp4_e2m1": Combination(("awq", "gptq", "mxquant"), (_BF16, _F16), ("group",)),
    "NOT_QUANTIZE float4_e2m1": Combination(("minmax", "awq", "gptq"), (_BF16, _F16), ("group",)),
}

# lowbit's additions (default mode): extra algorithms for AMCT rows and new rows. Every float dtype works.
LOWBIT_EXTRA_ALGORITHMS = {
    "hifloat8 hifloat8": ("minmax",),
    "NOT_QUANTIZE hifloat8": ("minmax",),
    "NOT_QUANTIZE float8_e4m3fn": ("minmax",),
}
LOWBIT_ROWS: dict[str, Combination] = {
    "NOT_QUANTIZE hifloat4": Combination(("minmax",), FLOAT_DTYPES, ("group",)),
    "mxfp4_e2m1 mxfp4_e2m1": Combination(("mxquant", "svdquant"), FLOAT_DTYPES, ("group",), ("group",)),
}


def table(amct_compat: bool) -> dict[str, Combination]:
    """The combination table of the mode (AMCT's exactly, or with lowbit's rows and all float dtypes)."""
    if amct_compat:
        return AMCT_TABLE
    rows = {
        comb: Combination(row.algorithms + LOWBIT_EXTRA_ALGORITHMS.get(comb, ()), FLOAT_DTYPES,
                          row.weight_strategies, row.act_strategies)
        for comb, row in AMCT_TABLE.items()
    }
    rows.update(LOWBIT_ROWS)
    return rows


def comb_name(weights: WeightSpec, inputs: InputSpec) -> str:
    return f"{inputs.type if inputs.enabled else 'NOT_QUANTIZE'} {weights.type}"


def check_combination(weights: WeightSpec, inputs: InputSpec, algorithm: AlgorithmSpec, amct_compat: bool) -> None:
    """AMCT's combination rules for one (weights, inputs, algorithm); ValueError with AMCT's messages."""
    comb = comb_name(weights, inputs)
    row = table(amct_compat).get(comb)
    if row is None:
        raise ValueError(f"Do not support combination {comb} of act and weight quant dtype.")
    if algorithm.name not in row.algorithms:
        raise ValueError(f"Algorithm {algorithm.name} do not support act and weight quant dtype {comb}")
    full_quant = inputs.enabled
    if full_quant and weights.type != "mxfp8_e4m3fn" and not weights.symmetric:
        raise ValueError(f"{comb} only support symmetric weight quantization")
    if comb == "int8 int4":
        if weights.strategy not in ("tensor", "channel"):
            raise ValueError(f"{comb} only support weight quant strategy tensor or channel")
        if inputs.strategy != "tensor":
            raise ValueError(f"{comb} only support activation quant strategy tensor")
    if weights.strategy not in row.weight_strategies:
        raise ValueError(f"act_dtype and wts_dtype {comb} do not support weight quant strategy {weights.strategy}")
    if full_quant:
        if row.act_strategies == ("group",):
            if inputs.strategy != "group":
                raise ValueError(f"act_dtype and wts_dtype {comb} only support activation quant strategy group")
        elif inputs.strategy not in row.act_strategies:
            raise ValueError(
                f"act_dtype and wts_dtype {comb} do not support activation quant strategy {inputs.strategy}")
    if weights.strategy == "group" and weights.type != "hifloat4":
        g = weights.group_size
        if g < 32 or g % 32:
            raise ValueError(
                f"act_type and wts_type {comb} only support group_size larger than 32 and integer multiple of 32, "
                f"current is {g}")
    if not amct_compat and algorithm.name == "ofmr" and inputs.enabled and inputs.strategy == "token":
        raise ValueError(f"{comb}: ofmr searches one per-tensor activation scale; strategy 'token' is not supported "
                         "(AMCT silently ignores it; use amct_compat=True for that)")


def select_algorithm(algorithms: tuple[AlgorithmSpec, ...], amct_compat: bool) -> Optional[AlgorithmSpec]:
    """The algorithm that quantizes Linear layers: the last one listed (AMCT, compat) or the only one.

    Default mode: ValueError when several algorithms are given (they would all claim Linear layers)."""
    if not algorithms:
        return None
    if len(algorithms) > 1 and not amct_compat:
        names = [a.name for a in algorithms]
        raise ValueError(f"algorithms {names} all apply to Linear layers; give exactly one (AMCT picks the last "
                         "one in iteration order, which for a set varies per process)")
    return algorithms[-1]
