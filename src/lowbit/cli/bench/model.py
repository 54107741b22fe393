"""Benchmark of quantized Linear layers against a BF16 ``F.linear`` of the same (N, K), measured in the same run.

Per data-free scheme of :data:`lowbit.SCHEMES` (``--schemes``, default: every scheme ``quantize_`` accepts
without calibration data), a BF16 ``nn.Linear(K, N)`` in a one-layer model is converted with
:func:`lowbit.quantize_` and its deploy module is timed on BF16 (M, K) inputs for each ``--ms`` row count,
alternately with ``F.linear`` on the BF16 weight (one call of each per sample), so load from other
processes hits both alike. Each scheme's row gives the median time, the median of the per-sample ratios to
F.linear, and the bytes of the layer's packed tensors (scales included, from the QuantizeReport) against the
BF16 weight. The deploy module is timed as it is, whatever kernels it uses.

With ``--layers L`` each sample runs L layers of the shape one after another, each with its own weight, as a
model's forward does (a BF16 ``F.linear`` per weight, then the L deploy modules): once the L weights exceed the
caches, every layer reads its weight from memory, as in a model larger than the cache. Times are per layer.
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
    parser.add_argument("--layers", type=positive_int, default=1,
                        help="layers of the shape, each with its own weight, run one after another per sample "
                             "(times per layer)")


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


def in_turn(calls: list):
    """A function that makes each of ``calls`` in turn and returns the last one's result."""
    def run_all():
        result = None
        for call in calls:
            result = call()
        return result
    return run_all


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    n, k = args.shape
    gen = torch.Generator().manual_seed(0)
    layers = [((torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16),
               torch.randn(n, generator=gen).to(torch.bfloat16)) for _ in range(args.layers)]
    inputs = {m: torch.randn(m, k, generator=gen).to(torch.bfloat16).to(device) for m in args.ms}
    on_device = [(weight.to(device), bias.to(device)) for weight, bias in layers]
    rows = []
    with lowbit.use_backend(args.backend), torch.inference_mode():
        for scheme in args.schemes:
            converted = [quantized_layer(weight, bias, scheme) for weight, bias in layers]
            modules = [module.to(device) for module, _, _ in converted]
            _, packed_bytes, float_bytes = converted[0]
            for m, x in inputs.items():
                for module in modules:
                    module(x)  # compile, self-check
                base, ours, ratio = alternating_medians(
                    in_turn([lambda w=w, b=b: F.linear(x, w, b) for w, b in on_device]),
                    in_turn([lambda module=module: module(x) for module in modules]), args.repeats, device,
                    min_time=0.05 if m < 64 else 0.0)
                common = {"scheme": scheme, "M": m, "NxK": f"{n}x{k}", "layers": args.layers}
                rows.append({**common, "what": "F.linear bf16", "ms": base / args.layers * 1e3, "x F.linear time": 1.0,
                             "weight bytes": float_bytes, "x bf16 bytes": 1.0})
                rows.append({**common, "what": type(modules[0]).__name__, "ms": ours / args.layers * 1e3,
                             "x F.linear time": ratio, "weight bytes": packed_bytes,
                             "x bf16 bytes": packed_bytes / float_bytes})
            del converted, modules
    return rows
