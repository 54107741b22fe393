"""MXFP4 and HiFloat4 decode (BF16 x) with and without the GEMV's BF16 pairs (two steps per vdpbf16ps,
docs/weight_only.md, 'BF16 pairs') in one process: the path is switched every --calls calls (the
kernel's ``pair_sources``; None: the fused path), each call follows a torch op (SiLU) and cycles through
copies of its weight (twice the last-level cache, at least 64 MiB). Prints the median call time of each
path and the median, over --rounds rounds, of the per-round ratio pairs / fused. AVX512-BF16 CPUs only.

    PYTHONPATH=src python benchmarks/bf16_pairs.py [--rounds 11] [--shapes 4096x4096 12288x8192] [--m 1]
"""

from __future__ import annotations

import lowbit  # noqa: I001  (first: sets the OpenMP wait policy before torch loads)

import argparse
import math
import statistics
import time

import torch

from lowbit.cli.smoke._common import device_name
from lowbit.kernels.cpu import _simd as simd
from lowbit.kernels.cpu import weight_only as cpu
from lowbit.toolchain.timing import last_level_cache_bytes

CACHE_BYTES = max(64 << 20, 2 * last_level_cache_bytes())
FORMATS = {  # name: (kernel, pack a float32 weight, the operator)
    "mxfp4": (cpu.MXFP4_LINEAR, lowbit.mxfp4_quantize, lowbit.mxfp4_linear),
    "hifloat4": (cpu.HIFLOAT4_LINEAR, lowbit.hifloat4_pack, lowbit.hifloat4_linear),
}


def _median_ms(operator, x, weights, calls: int) -> float:
    times = []
    for i in range(calls):
        torch.nn.functional.silu(x)
        start = time.perf_counter()
        operator(x, *weights[i % len(weights)], backend="native")
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--m", type=int, default=1)
    parser.add_argument("--shapes", nargs="+", default=["4096x4096", "12288x8192"])
    args = parser.parse_args()
    if not simd.HAS_AVX512BF16:
        raise SystemExit("bf16_pairs: this CPU has no AVX512-BF16, so the GEMV has no BF16 pairs to compare")
    print(f"CPU: {device_name(torch.device('cpu'))}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"M = {args.m}")
    gen = torch.Generator().manual_seed(0)
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        x = torch.randn(args.m, k, generator=gen).bfloat16()
        for name, (kernel, pack, operator) in FORMATS.items():
            if kernel.pair_sources is None:  # HiFloat4's pairs also need AVX512-BITALG
                print(f"{n} x {k} {name}: no BF16 pairs on this CPU")
                continue
            first = pack(torch.randn(n, k, generator=gen))
            nbytes = sum(t.numel() * t.element_size() for t in first)
            weights = [first] + [tuple(t.clone() for t in first) for _ in range(math.ceil(CACHE_BYTES / nbytes) - 1)]
            pairs = kernel.pair_sources
            times = {"pairs": [], "fused": []}
            try:
                for _ in range(args.rounds):
                    for path in times:
                        kernel.pair_sources = pairs if path == "pairs" else None
                        times[path].append(_median_ms(operator, x, weights, args.calls))
            finally:
                kernel.pair_sources = pairs
            ratios = [p / f for p, f in zip(times["pairs"], times["fused"])]
            print(f"{n} x {k} {name}: pairs {statistics.median(times['pairs']):.3f} ms, fused "
                  f"{statistics.median(times['fused']):.3f} ms, pairs / fused {statistics.median(ratios):.2f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
