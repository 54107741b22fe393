"""Benchmark of svd_quant against a plain BF16 F.linear of the same (N, K), measured in the same run.

Default shapes (B, S, N, K, R): upstream's prefill (1, 2048, 2816, 2048, 32) scaled to S = 2048 and the
decode case (1, 1, 2816, 2048, 32). Goal: prefill on CPU no slower than 1.3x F.linear.
The two are timed alternately (one call of each per sample), so load from other processes hits both
alike; the table reports the median of each and the median of the per-sample ratios.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from lowbit.cli.bench._timing import median_seconds
from lowbit.formats import mxfp4
from lowbit.ops.svd_quant import svd_quant

NAME = "svd_quant"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", default="1x2048x2816x2048x32,1x1x2816x2048x32",
                        help="comma-separated BxSxNxKxR shapes")


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    rows = []
    for shape in args.shapes.split(","):
        b, s_len, n, k, r = (int(v) for v in shape.split("x"))
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(b, s_len, k, generator=gen).to(torch.bfloat16).to(device)
        weight = torch.randn(n, k, generator=gen).to(torch.bfloat16).to(device)
        d = torch.randn(k, r, generator=gen).to(torch.bfloat16).to(device)
        u = torch.randn(r, n, generator=gen).to(torch.bfloat16).to(device)
        w, s = mxfp4.dynamic_mx_quant(weight)
        svd_quant(x, w, s, d, u, backend=args.backend)  # compile, self-check
        min_time = 0.05 if s_len * b < 64 else 0.0  # loop sub-millisecond calls
        samples = []
        for _ in range(args.repeats):
            once = dict(repeats=1, warmup=1, device=device, min_time=min_time)
            linear = median_seconds(lambda: F.linear(x, weight), **once)
            ours = median_seconds(lambda: svd_quant(x, w, s, d, u, backend=args.backend), **once)
            samples.append((linear, ours, ours / linear))
        linear, ours, ratio = (statistics.median(column) for column in zip(*samples))
        flops = 2 * b * s_len * n * k
        for what, sec, rel in (("F.linear bf16", linear, 1.0), ("svd_quant", ours, ratio)):
            rows.append({"shape BxSxNxKxR": shape, "what": what, "ms": sec * 1e3, "GFLOP/s": flops / sec / 1e9,
                         "x F.linear time": rel})
    return rows
