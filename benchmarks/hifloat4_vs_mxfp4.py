"""HiFloat4 against MXFP4 weight-only decode (M = 1, N = 12288, K = 8192) in one process: the two operators
(backend "native") and BF16 F.linear interleaved for --rounds rounds, at each thread count; prints medians
and the median of the per-round ratio HiFloat4 / MXFP4 (the two share the GEMV's structure, so the ratio
is the cost of HiFloat4's decode, steadier than either time on a shared machine).

    PYTHONPATH=src python benchmarks/hifloat4_vs_mxfp4.py [--rounds 9] [--threads 1 2]
"""

from __future__ import annotations

import lowbit  # noqa: I001  (first: sets the OpenMP wait policy before torch loads)

import argparse
import statistics
import torch
import torch.nn.functional as F

from lowbit.cli.smoke._common import device_name
from lowbit.toolchain.timing import median_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(12288, 8192, generator=gen).bfloat16()
    x = torch.randn(1, 8192, generator=gen).bfloat16()
    scale, value = lowbit.hifloat4_pack(w)
    codes, scales = lowbit.mxfp4_quantize(w)
    cases = {
        "hifloat4": lambda: lowbit.hifloat4_linear(x, scale, value, backend="native"),
        "mxfp4": lambda: lowbit.mxfp4_linear(x, codes, scales, backend="native"),
        "F.linear": lambda: F.linear(x, w),
    }
    print(f"CPU: {device_name(torch.device('cpu'))}, torch {torch.__version__}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        times = {name: [] for name in cases}
        with torch.inference_mode():
            for fn in cases.values():
                fn()
            for _ in range(args.rounds):
                for name, fn in cases.items():
                    times[name].append(median_seconds(fn, repeats=1, warmup=0))
        med = {name: statistics.median(t) for name, t in times.items()}
        ratio = statistics.median(h / m for h, m in zip(times["hifloat4"], times["mxfp4"]))
        print(f"threads {threads}: hifloat4 {med['hifloat4'] * 1e3:.2f} ms, mxfp4 {med['mxfp4'] * 1e3:.2f} ms, "
              f"F.linear {med['F.linear'] * 1e3:.2f} ms; F.linear / hifloat4 {med['F.linear'] / med['hifloat4']:.2f}x, "
              f"F.linear / mxfp4 {med['F.linear'] / med['mxfp4']:.2f}x; hifloat4 / mxfp4 {ratio:.2f}")


if __name__ == "__main__":
    main()
