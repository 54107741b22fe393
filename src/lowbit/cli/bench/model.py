"""Benchmark of quantized Linear layers against a BF16 ``F.linear`` of the same (N, K), measured in the same run.

Per data-free scheme of :data:`lowbit.SCHEMES` (``--schemes``, default: every scheme ``quantize_`` accepts
without calibration data), a BF16 ``nn.Linear(K, N)`` in a one-layer model is converted with
:func:`lowbit.quantize_` and its deploy module is timed on BF16 (M, K) inputs for each ``--ms`` row count,
alternately with ``F.linear`` on the BF16 weight (one call of each per sample), so load from other
processes hits both alike. Each scheme's row gives the median time, the median of the per-sample ratios to
F.linear, and the bytes of the layer's packed tensors (scales included, from the QuantizeReport) against the
BF16 weight. The deploy module is timed as it is, whatever kernels it uses.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch import nn

import lowbit
from lowbit.cli.argtypes import comma_list, dims, one_of, positive_int
from lowbit.toolchain.timing import median_seconds

NAME = "model"
DATA_FREE = tuple(name for name, scheme in lowbit.SCHEMES.items() if not scheme.needs_calibration)
LAYER = "0"  # the layer's name in the one-layer model (not matched by any scheme's skip_layers)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--schemes", type=comma_list(one_of(DATA_FREE)), default=",".join(DATA_FREE),
                        help=f"comma-separated data-free schemes: {','.join(DATA_FREE)}")
    parser.add_argument("--ms", type=comma_list(positive_int), default="1,16,256,2048",
                        help="comma-separated row counts M of the input")
    parser.add_argument("--shape", type=dims(2), default="4096x4096", help="NxK of the layer's weight")


def quantized_layer(weight: torch.Tensor, bias: torch.Tensor, scheme: str) -> tuple[nn.Module, int, int]:
    """(deploy module, its packed bytes, the float weight's bytes) of ``nn.Linear`` with ``weight`` (N, K)
    and ``bias`` (N,) converted by ``lowbit.quantize_(..., scheme)``; CPU tensors of one float dtype."""
    n, k = weight.shape
    linear = nn.Linear(k, n, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    model = nn.Sequential(linear)
    layer = lowbit.quantize_(model, scheme).layers[LAYER]
    return model[0], layer.bytes_after, layer.bytes_before


def alternating_medians(baseline, candidate, repeats: int, device: torch.device, min_time: float):
    """(median seconds of ``baseline``, of ``candidate``, median of the per-sample ratios candidate /
    baseline), timing one sample of each in turn ``repeats`` times."""
    once = dict(repeats=1, warmup=1, device=device, min_time=min_time)
    samples = []
    for _ in range(repeats):
        base = median_seconds(baseline, **once)
        ours = median_seconds(candidate, **once)
        samples.append((base, ours, ours / base))
    return tuple(statistics.median(column) for column in zip(*samples))


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    n, k = args.shape
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    inputs = {m: torch.randn(m, k, generator=gen).to(torch.bfloat16).to(device) for m in args.ms}
    weight_d, bias_d = weight.to(device), bias.to(device)
    rows = []
    with lowbit.use_backend(args.backend), torch.inference_mode():
        for scheme in args.schemes:
            module, packed_bytes, float_bytes = quantized_layer(weight, bias, scheme)
            module = module.to(device)
            for m, x in inputs.items():
                module(x)  # compile, self-check
                base, ours, ratio = alternating_medians(
                    lambda: F.linear(x, weight_d, bias_d), lambda: module(x), args.repeats, device,
                    min_time=0.05 if m < 64 else 0.0)
                common = {"scheme": scheme, "M": m, "NxK": f"{n}x{k}"}
                rows.append({**common, "what": "F.linear bf16", "ms": base * 1e3, "x F.linear time": 1.0,
                             "weight bytes": float_bytes, "x bf16 bytes": 1.0})
                rows.append({**common, "what": type(module).__name__, "ms": ours * 1e3, "x F.linear time": ratio,
                             "weight bytes": packed_bytes, "x bf16 bytes": packed_bytes / float_bytes})
    return rows
