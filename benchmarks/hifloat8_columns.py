"""HiFloat8 GEMV kernel alone (M = 1, BF16 x, the calling thread): the telescoped table decode (the operands
the operator makes on every call) against the decode by columns (the operands of a prepared weight, where
lowbit.kernels.cpu.weight_only.CODE8_COLUMNS), the latter with fused multiply-adds (as x's exponent range
allows here) and with a multiply then an add (x bounds given to the rows kernel that rule the fused form
out), interleaved; median of 9 rounds of 12 calls, in cycles per 32 codes at --ghz. Also the time to
prepare (re-encode) one weight. Weights: random normal rows, per-row scales putting each row's largest
magnitude at 2^14.

    PYTHONPATH=src python benchmarks/hifloat8_columns.py [--ghz 3.1]
"""

from __future__ import annotations

import lowbit  # noqa: I001,F401  (first: sets the OpenMP wait policy before torch loads)

import argparse
import statistics
import time

import numpy as np
import torch

from lowbit.formats import hifloat8
from lowbit.kernels.cpu import weight_only as wo
from lowbit.kernels.cpu._runtime import as_numpy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ghz", type=float, default=3.1)
    args = parser.parse_args()
    kernel = wo.HIFLOAT8_LINEAR
    print(f"decode by columns on this CPU: {wo.CODE8_COLUMNS}")
    for n, k, copies in ((64, 4096, 1), (1024, 4096, 1), (4096, 4096, 4)):
        weights = []
        for _ in range(copies):
            w = torch.randn(n, k)
            scale = (w.abs().amax(1) / 2.0**14).float()
            weights.append((hifloat8.encode(w / scale[:, None]), scale))
        table = [kernel._operands(c, s, k, torch.bfloat16) for c, s in weights]
        start = time.perf_counter()
        columns = [kernel.prepare(torch.bfloat16, k, c, s, None)[0] for c, s in weights]
        prepare_ms = (time.perf_counter() - start) / copies * 1e3
        x = torch.randn(1, k).bfloat16()
        x_reg = np.empty((1, wo._padded_k(k)), dtype=np.float32)
        wo._gather_x(as_numpy(x), True, kernel.order, x_reg)
        y32 = np.empty((1, n), np.float32)
        unfused = np.array([[-149, 127]], dtype=np.int64)  # _x_bounds of an x no fused multiply-add suits
        no_pairs = np.empty((1, 0), dtype=np.int16)  # (and no BF16 pairs: the columns' AVX2 CPUs have none)
        cases = {"table": lambda i: kernel.gemv_sums(x_reg, table[i % copies], y32, True),
                 "columns fused": lambda i: kernel.gemv_sums(x_reg, columns[i % copies], y32, True),
                 "columns mul+add": lambda i: wo._code8_rows(x_reg, *columns[i % copies], unfused, no_pairs, 0, n,
                                                             y32)}
        for call in cases.values():
            for i in range(3):
                call(i)
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(9):
            for name, call in cases.items():
                start = time.perf_counter()
                for i in range(12):
                    call(i)
                times[name].append((time.perf_counter() - start) / 12)
        medians = {name: statistics.median(t) for name, t in times.items()}
        cells = [f"{name} {t * 1e6:8.1f} us {t * args.ghz * 1e9 / (n * k / 32):5.1f} cycles/32"
                 for name, t in medians.items()]
        print(f"{n} x {k} ({copies} cycled), prepare {prepare_ms:.1f} ms: " + "   ".join(cells))


if __name__ == "__main__":
    main()
