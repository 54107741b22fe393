"""Time the HiFloat4 numba fake-quant kernel (``FAKE_QUANT.run``) against memcpy in one process, optionally
against an older version of the kernel module (``--before FILE``: ``git show REV:src/lowbit/kernels/cpu/hifloat4.py``
saved under a module-like name such as /tmp/hifloat4_REV.py; a version with the ``FAKE_QUANT`` kernel object).

Usage: ``PYTHONPATH=src python benchmarks/hifloat4_kernel_timing.py --threads 1 --size 64M --dtype bfloat16``

Rounds interleave memcpy (``out.copy_(x)`` into a preallocated tensor), the kernel and the older kernel;
prints medians and minima, ns per element per thread and the ratio to memcpy. The thread count is set
after numba's OpenMP layer has started: starting it resets the OpenMP thread count that torch reads.
"""

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

import numba
import torch

from lowbit.formats.hifloat4 import check_qdim
from lowbit.kernels.cpu import hifloat4

SIZES = {"1M": 1 << 20, "4M": 1 << 22, "64M": 1 << 26}


def _load(path):
    """Import a module file by its name (numba's cache finds its functions again by module name)."""
    path = Path(path).resolve()
    sys.path.insert(0, str(path.parent))
    return importlib.import_module(path.stem)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--size", default="64M", help="1M, 4M, 64M or an element count (multiple of 4096)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--qdim", type=int, default=-1, help="quant dim of the (rows, 4096) input")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--before", help="path of an older lowbit/kernels/cpu/hifloat4.py to compare with")
    args = parser.parse_args()

    numba.get_num_threads()  # start numba's threading layer before choosing the thread count
    torch.set_num_threads(args.threads)
    n = SIZES.get(args.size) or int(args.size)
    x = torch.randn(n // 4096, 4096).to(getattr(torch, args.dtype))
    out = torch.empty_like(x)
    check_qdim(x, args.qdim)  # the kernels are called directly: they do not validate their arguments
    kernels = {"after": hifloat4}
    if args.before:
        kernels = {"before": _load(args.before), **kernels}
    fns = {"memcpy": lambda: out.copy_(x)}
    for name, module in kernels.items():
        module.FAKE_QUANT.run(x, args.qdim, out=out)  # compile (or load from numba's cache)
        fns[name] = lambda module=module: module.FAKE_QUANT.run(x, args.qdim, out=out)
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
        print(f"{args.size} {args.dtype} qdim={args.qdim} threads={args.threads} {name:7s} median "
              f"{median * 1e3:8.2f} ms (min {min(ts) * 1e3:8.2f})  {median / n * 1e9 * args.threads:6.3f} "
              f"ns/element/thread  {memcpy / median:6.3f}x memcpy")


if __name__ == "__main__":
    main()
