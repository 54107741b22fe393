"""Decode (M = 1) with the weight in ordinary (4 KiB) pages and in huge-page memory
(lowbit.kernels.cpu.memory.huge_page_copy, which the deploy modules use), BF16 F.linear and the weight-only
operators, N = 12288, K = 8192, in one run: every timed call follows a torch op (SiLU) and alternates
between two copies of its weight (over 100 MB each for F.linear). Medians of --rounds rounds, the cases of
a round interleaved; ratios against F.linear with its weight in ordinary pages.

    PYTHONPATH=src python benchmarks/huge_pages.py [--rounds 7]
"""

from __future__ import annotations

import lowbit  # noqa: I001  (first: sets the OpenMP wait policy before torch loads)

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from lowbit.formats import hifloat4, mxfp4
from lowbit.kernels.cpu.memory import huge_page_copy

N, K = 12288, 8192


def _cases(gen: torch.Generator) -> dict[str, tuple]:
    w = torch.randn(N, K, generator=gen)
    codes8 = torch.randint(0, 256, (N, K), dtype=torch.uint8, generator=gen)
    codes8[codes8 == 0x80] = 0  # no NaN code
    return {
        "F.linear bf16": (F.linear, (w.bfloat16(),)),
        "mxfp4_linear": (lambda x, *t: lowbit.mxfp4_linear(x, *t, backend="native"), mxfp4.quantize(w)),
        "hifloat4_linear": (lambda x, *t: lowbit.hifloat4_linear(x, *t, backend="native"), hifloat4.pack(w)),
        "hifloat8_linear": (lambda x, *t: lowbit.hifloat8_linear(x, *t, backend="native"),
                            (codes8, torch.rand(N, generator=gen) + 0.5)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, K, generator=gen).bfloat16()
    activation = torch.randn(1, 4 * K, generator=gen).bfloat16()
    variants = {}
    for name, (fn, tensors) in _cases(gen).items():
        variants[name, "4 KiB pages"] = fn, [tensors, tuple(t.clone() for t in tensors)]
        variants[name, "huge pages"] = fn, [tuple(huge_page_copy(t) for t in tensors) for _ in range(2)]
    times: dict[tuple, list[float]] = {key: [] for key in variants}
    for fn, layers in variants.values():  # warm-up: compile, first touch
        fn(x, *layers[0])
    for _ in range(args.rounds):
        for key, (fn, layers) in variants.items():
            total = 0.0
            for weight in layers:
                F.silu(activation)
                start = time.perf_counter()
                fn(x, *weight)
                total += time.perf_counter() - start
            times[key].append(total / len(layers))
    base = statistics.median(times["F.linear bf16", "4 KiB pages"])
    print(f"{torch.get_num_threads()} threads; N = {N}, K = {K}, M = 1")
    print("| case | weight memory | median ms | F.linear (4 KiB pages) / case |\n|---|---|---|---|")
    for (name, memory), ts in times.items():
        median = statistics.median(ts)
        print(f"| {name} | {memory} | {median * 1e3:.3f} | {base / median:.2f}x |")


if __name__ == "__main__":
    main()
