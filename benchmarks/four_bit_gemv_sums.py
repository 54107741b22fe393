"""The 4-bit GEMV kernels' sums alone (HiFloat4 and MXFP4, one row of BF16 x), on the calling thread: no
Python path, no rounding, the weight small enough to stay in the L2 cache (default 64 x 8192: 256 KiB of
value bytes). Prints the fastest of --calls calls and cycles per 64 weights at --ghz (the clock is not read:
give the one ``lscpu`` or /proc/cpuinfo reports). Compare kernels by running two trees alternately, each
with its own NUMBA_CACHE_DIR; see benchmarks/hifloat4_vs_mxfp4.py for the operators with the weight
streamed from memory.

    PYTHONPATH=src python benchmarks/four_bit_gemv_sums.py [--shape 64x8192] [--calls 200] [--ghz 2.7]
"""

from __future__ import annotations

import lowbit  # noqa: F401,I001  (first: sets the OpenMP wait policy before torch loads)

import argparse
import time

import numpy as np
import torch

from lowbit.cli.smoke._common import device_name
from lowbit.formats import hifloat4, mxfp4
from lowbit.kernels.cpu import weight_only as cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="64x8192", help="N x K")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--ghz", type=float, default=2.7, help="the CPU's clock, for cycles per 64 weights")
    args = parser.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, k, generator=gen).bfloat16()
    print(f"CPU: {device_name(torch.device('cpu'))}, N x K = {n} x {k}, fastest of {args.calls} calls, one thread")
    for name, kernel, pack in (("hifloat4", cpu.HIFLOAT4_LINEAR, hifloat4.pack), ("mxfp4", cpu.MXFP4_LINEAR,
                                                                               mxfp4.quantize)):
        operands = kernel.prepare(torch.bfloat16, k, *pack(torch.randn(n, k, generator=gen)), None)[0]
        x_reg = np.empty((1, k), dtype=np.float32)
        cpu._gather_x(x.view(torch.int16).numpy(), True, kernel.order, x_reg)
        y32 = np.empty((1, n), dtype=np.float32)
        kernel.gemv_sums(x_reg, operands, y32, serial=True)  # compile
        fastest = float("inf")
        for _ in range(args.calls):
            start = time.perf_counter()
            kernel.gemv_sums(x_reg, operands, y32, serial=True)
            fastest = min(fastest, time.perf_counter() - start)
        cycles = fastest * args.ghz * 1e9 / (n * k / 64)
        print(f"  {name}: {fastest * 1e3:.3f} ms, {cycles:.1f} cycles per 64 weights at {args.ghz} GHz")


if __name__ == "__main__":
    main()
