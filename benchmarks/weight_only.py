"""Weight-only linear layers on this CPU against BF16 F.linear, measured in one run (interleaved rounds).

For each (N, K) and M: F.linear with a BF16 weight, and lowbit's hifloat8_linear, mxfp4_linear,
hifloat4_linear and mxfp8_linear (backend "native") with BF16 x. As in a model's forward pass, every timed
call follows a torch op (SiLU of an (M, 4K) activation) and cycles through enough copies of its weight
("layers") that they do not all fit in the last-level cache (twice its size, at least 64 MiB per case). Per call; medians and minima over
--rounds rounds, the cases of a round interleaved; ratios are F.linear's median over the case's median.
Clocks: ``wall`` (perf_counter, torch.get_num_threads() threads for torch and numba) or ``cpu1`` (one
thread for everyone, CPU time of the calling thread: not inflated when a shared machine deschedules it).

    PYTHONPATH=src python benchmarks/weight_only.py [--rounds 7] [--ms 1 256] [--clock wall|cpu1]
"""

from __future__ import annotations

import lowbit  # noqa: I001  (first: sets the OpenMP wait policy before torch loads)

import argparse
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F

from lowbit.cli.smoke._common import device_name
from lowbit.formats import hifloat4, mxfp4, mxfp8
from lowbit.toolchain.timing import last_level_cache_bytes

SHAPES = ((4096, 4096), (12288, 8192))  # (N, K)
# Weights cycled per case: twice the last-level cache (480 MiB on the Intel Xeon VM), at least 64 MiB.
CACHE_BYTES = max(64 << 20, 2 * last_level_cache_bytes())


def _weights(n: int, k: int, gen: torch.Generator) -> dict[str, tuple]:
    """Each case's weight tensors (before the copies), from one random normal weight."""
    w = torch.randn(n, k, generator=gen)
    row_scale = w.abs().amax(1) / 32768
    return {
        "F.linear bf16": (w.bfloat16(),),
        "hifloat8_linear": (lowbit.encode_to_hifloat8((w / row_scale[:, None]).bfloat16()), row_scale),
        "mxfp4_linear": mxfp4.quantize(w),
        "hifloat4_linear": hifloat4.pack(w),
        "mxfp8_linear": mxfp8.quantize(w),
    }


def _layers(tensors: tuple) -> list[tuple]:
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    copies = max(1, math.ceil(CACHE_BYTES / nbytes))
    return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(copies - 1)]


def _call(name: str):
    if name == "F.linear bf16":
        return lambda x, w: F.linear(x, w)
    fn = getattr(lowbit, name)
    return lambda x, *weight: fn(x, *weight, backend="native")


def measure(n: int, k: int, m: int, rounds: int, gen: torch.Generator, clock) -> dict[str, list[float]]:
    x = torch.randn(m, k, generator=gen).bfloat16()
    activation = torch.randn(m, 4 * k, generator=gen).bfloat16()
    cases = {name: (_call(name), _layers(tensors)) for name, tensors in _weights(n, k, gen).items()}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for name, (fn, layers) in cases.items():  # warm-up: compile, first touch
        fn(x, *layers[0])
    for _ in range(rounds):
        for name, (fn, layers) in cases.items():
            total = 0.0
            for weight in layers:
                F.silu(activation)
                start = clock()
                fn(x, *weight)
                total += clock() - start
            times[name].append(total / len(layers))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--clock", choices=("wall", "cpu1"), default="wall")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    if args.clock == "cpu1":
        torch.set_num_threads(1)
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    print(f"CPU: {device_name(torch.device('cpu'))}, {os.cpu_count()} logical CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, clock {args.clock}, {CACHE_BYTES >> 20} MiB of weights cycled per case; "
          f"load average at start: {os.getloadavg()}")
    print("| M | N | K | case | median ms | min ms | F.linear / case |")
    print("|---|---|---|---|---|---|---|")
    for n, k in SHAPES:
        for m in args.ms:
            times = measure(n, k, m, args.rounds, gen, clock)
            base = statistics.median(times["F.linear bf16"])
            for name, ts in times.items():
                median = statistics.median(ts)
                print(f"| {m} | {n} | {k} | {name} | {median * 1e3:.3f} | {min(ts) * 1e3:.3f} | {base / median:.2f}x |",
                      flush=True)
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
