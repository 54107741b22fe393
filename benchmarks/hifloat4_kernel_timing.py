"""Time the HiFloat4 numba fake-quant kernel against memcpy in one process, on a chosen thread count.

Usage: ``PYTHONPATH=src python benchmarks/hifloat4_kernel_timing.py --threads 1 --size 64M --dtype bfloat16``

Rounds interleave memcpy (``out.copy_(x)`` into a preallocated tensor) and the kernel; prints medians and
minima, ns per element per thread and the ratio to memcpy. The thread count is set
after numba's OpenMP layer has started: starting it resets the OpenMP thread count that torch reads.
"""

import argparse
import statistics
import time

import numba
import torch

from lowbit.cli.argtypes import element_count, positive_int
from lowbit.formats.hifloat4 import check_qdim
from lowbit.kernels.cpu import hifloat4

SIZES = {"1M": 1 << 20, "4M": 1 << 22, "64M": 1 << 26}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--size", type=element_count(SIZES, multiple_of=64 * 4096), default="64M",
                        help="1M, 4M, 64M or an element count (multiple of 64 * 4096)")
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--qdim", type=int, choices=[-2, -1, 0, 1], default=-1,
                        help="quant dim of the (rows, 4096) input")
    parser.add_argument("--rounds", type=positive_int, default=9)
    args = parser.parse_args()

    numba.get_num_threads()  # start numba's threading layer before choosing the thread count
    torch.set_num_threads(args.threads)
    n = args.size
    x = torch.randn(n // 4096, 4096).to(getattr(torch, args.dtype))
    out = torch.empty_like(x)
    check_qdim(x, args.qdim)  # the kernel is called directly: it does not validate its arguments
    hifloat4.FAKE_QUANT.run(x, args.qdim, out=out)  # compile (or load from numba's cache)
    fns = {"memcpy": lambda: out.copy_(x), "kernel": lambda: hifloat4.FAKE_QUANT.run(x, args.qdim, out=out)}
    if numba.get_num_threads() != args.threads:
        raise RuntimeError(f"numba runs {numba.get_num_threads()} threads, not {args.threads}")

    times = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    memcpy = statistics.median(times["memcpy"])
    for name, ts in times.items():
        median = statistics.median(ts)
        print(f"{n} {args.dtype} qdim={args.qdim} threads={args.threads} {name:7s} median "
              f"{median * 1e3:8.2f} ms (min {min(ts) * 1e3:8.2f})  {median / n * 1e9 * args.threads:6.3f} "
              f"ns/element/thread  {memcpy / median:6.3f}x memcpy")


if __name__ == "__main__":
    main()
