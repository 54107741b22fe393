"""8-bit GEMV kernel alone (M = 1, BF16 x, the calling thread) on prepared FP8 E4M3 and MXFP8 weights
(lowbit.kernels.cpu.weight_only.CODE8_COLUMNS: codes re-encoded by columns): the rows holding a code the
columns leave out decoded by columns but for those blocks of 32 codes ("blocks by the table", the prepared
operands as they are) against the same rows by the table throughout (their ``fast`` entry set to 0: the
table decode, the same bits), interleaved; median of 15 calls each over three copies of the weight, in ms
and in cycles per 32 codes at --ghz. Weights: Gaussian rows (FP8: per-row scale amax / 448; MXFP8:
lowbit.formats.mxfp8.quantize of the BF16 weight), or Student-t (4 degrees) rows with --heavy-tails.

    PYTHONPATH=src python benchmarks/code8_slow_blocks.py [--shape 12288x8192] [--ghz 2.7] [--heavy-tails]
"""

from __future__ import annotations

import lowbit  # noqa: I001,F401  (first: sets the OpenMP wait policy before torch loads)

import argparse
import statistics
import time

import numpy as np
import torch

from lowbit.formats import mxfp8
from lowbit.kernels.cpu import _weight_only_layout as wo_layout
from lowbit.kernels.cpu import weight_only as wo

COPIES = 3


def _weights(n: int, k: int, heavy_tails: bool) -> dict:
    """format: (kernel, its weight tensors, the index of ``fast`` in its prepared operands)."""
    if heavy_tails:
        w = torch.distributions.StudentT(4.0).sample((n, k)) * 0.02
    else:
        w = torch.randn(n, k) * 0.02
    scale = (w.abs().amax(1) / 448).float()
    return {"fp8": (wo.FLOAT8_E4M3FN_LINEAR, (mxfp8.e4m3_codes(w / scale[:, None]), scale), 7),
            "mxfp8": (wo.MXFP8_LINEAR, mxfp8.quantize(w.bfloat16()), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="12288x8192", help="NxK")
    parser.add_argument("--ghz", type=float, default=2.7)
    parser.add_argument("--heavy-tails", action="store_true")
    args = parser.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    torch.set_num_threads(1)
    print(f"decode by columns on this CPU: {wo.CODE8_COLUMNS}; {n} x {k}")
    x = torch.randn(1, k).bfloat16()
    for name, (kernel, weight, at) in _weights(n, k, args.heavy_tails).items():
        prepared = [kernel.prepare(torch.bfloat16, k, *(t.clone() for t in weight), None)[0] for _ in range(COPIES)]
        fast = prepared[0][at]
        by_table = []
        for operands in prepared:
            slow_rows = operands[at].copy()
            slow_rows[slow_rows == 2] = 0
            by_table.append((*operands[:at], slow_rows, *operands[at + 1:]))
        x_reg = wo_layout._reorder(x.float(), *kernel.split).numpy()
        y32 = np.empty((1, n), dtype=np.float32)
        variants = {"blocks by the table": prepared, "rows by the table": by_table}
        times = {v: [] for v in variants}
        for i in range(15 * COPIES + COPIES):
            for variant, copies in variants.items():
                start = time.perf_counter()
                kernel.gemv_sums(x_reg, copies[i % COPIES], y32, True)
                if i >= COPIES:  # the first round warms up
                    times[variant].append(time.perf_counter() - start)
        shares = np.bincount(fast, minlength=3) / n if fast.size else np.zeros(3)
        print(f"{name}: rows by columns {shares[1]:.3f}, with blocks by the table {shares[2]:.3f}, by the table "
              f"{shares[0]:.3f}")
        for variant, samples in times.items():
            ms = statistics.median(samples) * 1e3
            print(f"  {variant}: {ms:.3f} ms, {ms * 1e-3 * args.ghz * 1e9 / (n * k / 32):.1f} cycles per 32 codes")


if __name__ == "__main__":
    main()
