"""Model-level accuracy of each low-bit format: quantize a model's Linear layers, compare its outputs.

For every format, a copy of the model has each compatible ``nn.Linear`` replaced, and its outputs on the
given inputs are compared with the float32 model's: SQNR in dB (10 log10 of signal over error energy),
relative L2 error, and top-1 agreement of the argmax over the last dimension (for classifier-like
outputs). Weight-only formats quantize the weight (N, K) in blocks along K, as the operators do; the
SVDQuant format replaces the layer with :class:`lowbit.nn.svd_quant.SVDQuantLinear`, which also quantizes
the activations (MXFP4) and keeps a rank-32 BF16 branch. A layer whose shape the format cannot take
(e.g. K not a multiple of its block) stays in float32 and is counted as skipped.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

from lowbit.formats.int4 import quantize_int4_per_group, unpack_int4
from lowbit.nn.svd_quant import SVDQuantLinear
from lowbit.ops.hifloat4 import hifloat4_fake_quant
from lowbit.ops.hifloat8 import decode_from_hifloat8, encode_to_hifloat8
from lowbit.ops.mxfp4 import mxfp4_dequantize, mxfp4_quantize


@dataclass(frozen=True)
class WeightFormat:
    """How one format rewrites a Linear layer. ``bits_per_weight`` counts the scales' share."""

    name: str
    bits_per_weight: float
    activations: str  # what the layer's input goes through
    fits: Callable[[nn.Linear], bool]  # can the format take this layer's shape?
    convert: Callable[[nn.Linear], nn.Module]  # a float32 (or BF16-in/out) replacement layer


def _with_weight(linear: nn.Linear, weight: torch.Tensor) -> nn.Linear:
    """A float32 copy of ``linear`` whose weight is ``weight`` (N, K)."""
    out = nn.Linear(linear.in_features, linear.out_features, linear.bias is not None, dtype=torch.float32)
    with torch.no_grad():
        out.weight.copy_(weight.to(torch.float32))
        if linear.bias is not None:
            out.bias.copy_(linear.bias.to(torch.float32))
    return out


def _bf16(w: torch.Tensor) -> torch.Tensor:
    return w.to(torch.bfloat16)


def _int4_g128(w: torch.Tensor) -> torch.Tensor:
    packed, scale, _ = quantize_int4_per_group(w.T.to(torch.float32), 128, dtype=torch.bfloat16)
    values = unpack_int4(packed).to(torch.float32)  # (K, N)
    return (values * scale.to(torch.float32).repeat_interleave(128, dim=0)).T


def _mxfp4(w: torch.Tensor) -> torch.Tensor:
    return mxfp4_dequantize(*mxfp4_quantize(_bf16(w)), torch.float32)


def _weight_only(name: str, bits: float, quantize: Callable[[torch.Tensor], torch.Tensor],
                 k_multiple: int = 1, n_multiple: int = 1) -> WeightFormat:
    def fits(linear: nn.Linear) -> bool:
        return linear.in_features % k_multiple == 0 and linear.out_features % n_multiple == 0

    def convert(linear: nn.Linear) -> nn.Module:
        with torch.no_grad():
            return _with_weight(linear, quantize(linear.weight.detach()))

    return WeightFormat(name, bits, "float32", fits, convert)


def _svdquant(rank: int) -> WeightFormat:
    def fits(linear: nn.Linear) -> bool:
        return linear.in_features % 32 == 0 and rank <= min(linear.in_features, linear.out_features)

    def convert(linear: nn.Linear) -> nn.Module:
        with torch.no_grad():
            return SVDQuantLinear.from_linear(linear, rank=rank)

    bits = 4.25  # residual; the rank-r BF16 branch adds 16 r (N + K) / (N K) per weight
    return WeightFormat(f"svdquant-r{rank}", bits, "mxfp4", fits, convert)


FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        _weight_only("bf16", 16, lambda w: _bf16(w).to(torch.float32)),
        _weight_only("hifloat8", 8, lambda w: decode_from_hifloat8(encode_to_hifloat8(_bf16(w)))),
        _weight_only("hifloat4", 4.5, lambda w: hifloat4_fake_quant(w.to(torch.float32)), k_multiple=64),
        _weight_only("mxfp4", 4.25, _mxfp4, k_multiple=32),
        _weight_only("int4-g128", 4.125, _int4_g128, k_multiple=128, n_multiple=2),
        _svdquant(32),
    )
}


class _Float32Input(nn.Module):
    """Runs a BF16-only layer (SVDQuantLinear) inside a float32 model."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).to(x.dtype)


def quantize_linear_layers(model: nn.Module, fmt: WeightFormat) -> tuple[nn.Module, int, int]:
    """A float32 copy of ``model`` with each Linear the format fits replaced; (model, replaced, skipped)."""
    model = copy.deepcopy(model).to(torch.float32)
    replaced = skipped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                if fmt.fits(child):
                    new = fmt.convert(child)
                    setattr(parent, name, _Float32Input(new) if isinstance(new, SVDQuantLinear) else new)
                    replaced += 1
                else:
                    skipped += 1
    return model, replaced, skipped


def compare_outputs(reference: torch.Tensor, output: torch.Tensor) -> dict:
    """SQNR (dB), relative L2 error and argmax agreement of ``output`` against ``reference``."""
    ref = reference.detach().to(torch.float64)
    err = output.detach().to(torch.float64) - ref
    signal, noise = float(ref.pow(2).sum()), float(err.pow(2).sum())
    sqnr = float("inf") if noise == 0 else 10 * math.log10(signal / noise)
    rel = (noise / signal) ** 0.5 if signal else float("nan")
    top1 = float((reference.argmax(-1) == output.argmax(-1)).to(torch.float64).mean())
    return {"sqnr_db": sqnr, "rel_l2_error": rel, "top1_agreement": top1}


def evaluate_formats(model: nn.Module, inputs: torch.Tensor, formats: Iterable[str] | None = None) -> list[dict]:
    """Compare ``model`` (float32 copy) with its quantized copies on ``inputs``, one row per format.

    ``formats``: names from :data:`FORMATS` (default: all). Raises ValueError for an unknown name.
    Rows: format, bits_per_weight, activations, layers_quantized, layers_skipped, sqnr_db, rel_l2_error,
    top1_agreement.
    """
    names = list(FORMATS) if formats is None else list(formats)
    unknown = [n for n in names if n not in FORMATS]
    if unknown:
        raise ValueError(f"unknown format(s) {unknown}; expected some of {list(FORMATS)}")
    with torch.no_grad():
        reference_model = copy.deepcopy(model).to(torch.float32).eval()
        reference = reference_model(inputs.to(torch.float32))
        rows = []
        for name in names:
            fmt = FORMATS[name]
            quantized, replaced, skipped = quantize_linear_layers(reference_model, fmt)
            output = quantized.eval()(inputs.to(torch.float32))
            rows.append({"format": name, "bits_per_weight": fmt.bits_per_weight, "activations": fmt.activations,
                         "layers_quantized": replaced, "layers_skipped": skipped,
                         **compare_outputs(reference, output)})
    return rows


class DemoMLP(nn.Module):
    """The built-in evaluation model: residual MLP blocks and a classifier head, seeded initialisation.

    Weights are Gaussian with a few heavy rows (outlier channels, as trained LLM layers have), so the
    formats' block scaling matters. Nothing is downloaded.
    """

    def __init__(self, width: int = 512, hidden: int = 2048, blocks: int = 4, classes: int = 1000, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.blocks = nn.ModuleList()
        for _ in range(blocks):
            block = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
            self.blocks.append(block)
        self.head = nn.Linear(width, classes)
        with torch.no_grad():
            for layer in self.modules():
                if isinstance(layer, nn.Linear):
                    w = torch.randn(layer.weight.shape, generator=g) / layer.in_features**0.5
                    heavy = torch.randint(0, w.shape[0], (max(1, w.shape[0] // 64),), generator=g)
                    w[heavy] *= 8
                    layer.weight.copy_(w)
                    layer.bias.copy_(0.01 * torch.randn(layer.bias.shape, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def demo_inputs(batch: int = 64, width: int = 512, seed: int = 1) -> torch.Tensor:
    """Heavy-tailed inputs (Student-t, 3 degrees of freedom) for :class:`DemoMLP`."""
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(batch, width, generator=g)
    chi2 = torch.randn(batch, width, 3, generator=g).pow(2).sum(-1)
    return normal / (chi2 / 3).sqrt()
