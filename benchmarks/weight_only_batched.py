"""Batched decode (BF16 x, GEMV_MAX_M < M <= BATCH_MAX_M): the weight-only operators' batched kernel against
their GEMM path (the same call with lowbit.kernels.cpu.weight_only.BATCH_MAX_M set to GEMV_MAX_M) and BF16
F.linear, in one run: per round every case once, interleaved, so each call follows other torch and numba
work as in a model's forward. Medians of --rounds rounds; ratios are time / F.linear's time. The batched
kernel's products are BF16 dot products on CPUs with AVX512-BF16, float32 FMAs elsewhere.

    PYTHONPATH=src python benchmarks/weight_only_batched.py [--rounds 7] [--ms 8 16 32]
"""

from __future__ import annotations

import lowbit  # noqa: I001  (first: sets the OpenMP wait policy before torch loads)

import argparse
import statistics

import torch
import torch.nn.functional as F

from lowbit.cli.smoke._common import device_name
from lowbit.kernels.cpu import weight_only as cpu
from lowbit.toolchain.timing import median_seconds

SHAPES = ((4096, 4096), (12288, 8192))


def _operators(w: torch.Tensor) -> dict:
    row_scale = w.abs().amax(1) / 32768
    return {
        "mxfp4": (lowbit.mxfp4_linear, lowbit.mxfp4_quantize(w)),
        "hifloat4": (lowbit.hifloat4_linear, lowbit.hifloat4_pack(w)),
        "hifloat8": (lowbit.hifloat8_linear, (lowbit.encode_to_hifloat8((w / row_scale[:, None]).bfloat16()),
                                              row_scale)),
    }


def _one_call(fn) -> float:
    return median_seconds(fn, repeats=1, warmup=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--ms", type=int, nargs="+", default=[8, 16, 32])
    args = parser.parse_args()
    print(f"CPU: {device_name(torch.device('cpu'))}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, batched products in {'BF16' if cpu.BATCH_IN_BF16 else 'float32'}")
    print("| N x K | M | F.linear ms | format | batched x F.linear | GEMM path x F.linear |")
    print("|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    batch_max = cpu.BATCH_MAX_M
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen)
        dense, operators = w.bfloat16(), _operators(w)
        for m in args.ms:
            x = torch.randn(m, k, generator=gen).bfloat16()
            times: dict[str, list[float]] = {}
            for fn, weight in operators.values():
                fn(x, *weight)  # compile / load the kernels outside the timing
            try:
                for _ in range(args.rounds):
                    times.setdefault("F.linear", []).append(_one_call(lambda: F.linear(x, dense)))
                    for name, (fn, weight) in operators.items():
                        for path, limit in (("batched", batch_max), ("gemm", cpu.GEMV_MAX_M)):
                            cpu.BATCH_MAX_M = limit
                            times.setdefault((name, path), []).append(_one_call(lambda: fn(x, *weight)))
            finally:
                cpu.BATCH_MAX_M = batch_max
            base = statistics.median(times["F.linear"])
            for name in operators:
                ratios = [statistics.median(times[(name, path)]) / base for path in ("batched", "gemm")]
                print(f"| {n} x {k} | {m} | {base * 1e3:.2f} | {name} | {ratios[0]:.2f} | {ratios[1]:.2f} |")


if __name__ == "__main__":
    main()
