"""Model-level quantization (AMCT-compatible quantize -> calibrate -> convert, packed modules, checkpoints).

See docs/quantize.md.
"""

from lowbit.quantize.api import convert, quantize, quantize_
from lowbit.quantize.checkpoint import load_quantized, parameters_on_meta, save_quantized
from lowbit.quantize.config import AlgorithmSpec, InputSpec, Override, QuantConfig, WeightSpec
from lowbit.quantize.report import LayerReport, QuantizeReport
from lowbit.quantize.schemes import SCHEMES, Scheme

__all__ = [
    "SCHEMES", "AlgorithmSpec", "InputSpec", "LayerReport", "Override", "QuantConfig", "QuantizeReport", "Scheme",
    "WeightSpec", "convert", "load_quantized", "parameters_on_meta", "quantize", "quantize_", "save_quantized",
]
