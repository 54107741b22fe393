"""The batched kernel's products (float32 FMAs, `_batch_block_f32`: M rows of x against a block of four decoded
rows of W) with the decoded rows' buffer on a 64-byte boundary and 32 bytes off it, on the calling thread, in
the cache: fastest of --calls calls each, the two placements alternated three times. Off the boundary every
64-byte load of W straddles two cache lines (numba's own arrays are aligned to 32 bytes only).

    PYTHONPATH=src python benchmarks/batch_buffer_alignment.py [--m 16] [--kp 4096] [--calls 2000] [--ghz 2.8]
"""

from __future__ import annotations

import lowbit  # noqa: F401,I001  (first: sets the OpenMP wait policy before torch loads)

import argparse
import time

import numpy as np
import torch

from lowbit.cli.smoke._common import device_name
from lowbit.kernels.cpu import _weight_only_batched as batched
from lowbit.kernels.cpu._runtime import aligned_empty


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", type=int, default=16, help="rows of x")
    parser.add_argument("--kp", type=int, default=4096, help="K (a multiple of 64)")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--ghz", type=float, default=2.8, help="the CPU's clock, for cycles per 16-lane FMA")
    args = parser.parse_args()
    x = aligned_empty(args.m, args.kp, np.float32)
    x[:] = np.random.default_rng(0).random((args.m, args.kp), dtype=np.float32)
    raw = aligned_empty(1, 4 * args.kp + 64, np.float32)[0]
    y32 = np.empty((args.m, 4), dtype=np.float32)
    fmas = args.m * 4 * args.kp / 16
    print(f"CPU: {device_name(torch.device('cpu'))}; M = {args.m}, Kp = {args.kp}, four rows of W, one thread")
    for offset in (0, 8) * 3:  # float32 elements: 0 and 32 bytes
        w = raw[offset : offset + 4 * args.kp]
        w[:] = 1.0
        batched._batch_block_f32(x.reshape(-1), args.kp, args.m, w, 4, 0, y32)  # compile
        fastest = float("inf")
        for _ in range(args.calls):
            start = time.perf_counter()
            batched._batch_block_f32(x.reshape(-1), args.kp, args.m, w, 4, 0, y32)
            fastest = min(fastest, time.perf_counter() - start)
        print(f"  W at {4 * offset} bytes past a 64-byte boundary: {fastest * 1e6:.1f} us, "
              f"{fastest * args.ghz * 1e9 / fmas:.2f} cycles per 16-lane FMA at {args.ghz} GHz")


if __name__ == "__main__":
    main()
