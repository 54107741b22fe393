"""Decode (M = 1) with the weight in ordinary (4 KiB) pages and in huge-page memory
(lowbit.kernels.cpu.memory.huge_page_copy, which the deploy modules use), BF16 F.linear and the weight-only
operators, N x K = --shape (12288 x 8192 by default), in one run: every timed call follows a torch op (SiLU)
and cycles through copies of its weight (twice the last-level cache, at least 64 MiB). Medians of --rounds rounds, the cases
of a round interleaved; ratios against F.linear with its weight in ordinary pages.

    PYTHONPATH=src python benchmarks/huge_pages.py [--rounds 7] [--shape 12288x8192]
"""

from __future__ import annotations

import lowbit  # noqa: I001  (first: sets the OpenMP wait policy before torch loads)

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

from lowbit.formats import hifloat4, mxfp4
from lowbit.kernels.cpu.memory import huge_page_copy
from lowbit.toolchain.timing import last_level_cache_bytes

# Weights cycled per case: twice the last-level cache (480 MiB on the Intel Xeon VM), at least 64 MiB.
CACHE_BYTES = max(64 << 20, 2 * last_level_cache_bytes())


def _copies(tensors: tuple) -> int:
    return max(2, math.ceil(CACHE_BYTES / sum(t.numel() * t.element_size() for t in tensors)))


def _cases(n: int, k: int, gen: torch.Generator) -> dict[str, tuple]:
    w = torch.randn(n, k, generator=gen)
    codes8 = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
    codes8[codes8 == 0x80] = 0  # no NaN code
    return {
        "F.linear bf16": (F.linear, (w.bfloat16(),)),
        "mxfp4_linear": (lambda x, *t: lowbit.mxfp4_linear(x, *t, backend="native"), mxfp4.quantize(w)),
        "hifloat4_linear": (lambda x, *t: lowbit.hifloat4_linear(x, *t, backend="native"), hifloat4.pack(w)),
        "hifloat8_linear": (lambda x, *t: lowbit.hifloat8_linear(x, *t, backend="native"),
                            (codes8, torch.rand(n, generator=gen) + 0.5)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--shape", default="12288x8192", help="NxK of the weight")
    args = parser.parse_args()
    n, k = (int(v) for v in args.shape.lower().split("x"))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, k, generator=gen).bfloat16()
    activation = torch.randn(1, 4 * k, generator=gen).bfloat16()
    variants = {}
    for name, (fn, tensors) in _cases(n, k, gen).items():
        copies = _copies(tensors)
        variants[name, "4 KiB pages"] = fn, [tensors] + [tuple(t.clone() for t in tensors) for _ in range(copies - 1)]
        variants[name, "huge pages"] = fn, [tuple(huge_page_copy(t) for t in tensors) for _ in range(copies)]
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
    print(f"{torch.get_num_threads()} threads; N = {n}, K = {k}, M = 1")
    print("| case | weight memory | median ms | F.linear (4 KiB pages) / case |\n|---|---|---|---|")
    for (name, memory), ts in times.items():
        median = statistics.median(ts)
        print(f"| {name} | {memory} | {median * 1e3:.3f} | {base / median:.2f}x |")


if __name__ == "__main__":
    main()
