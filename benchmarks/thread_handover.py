"""How numba's second thread serves a call that follows a torch op, under the wait policy in the environment
(README, 'Threads'; `GOMP_SPINCOUNT=0` gives threads that sleep at once). Two parts, medians of --rounds calls:

1. A parallel loop of two equal halves of fixed work, each call after a BF16 F.linear: its time against the
   same work on one thread, and how late the second thread started its half (the time stamp counter): where
   the OS lets the woken thread wait, the loop takes the serial time or more.
2. Decode calls (M = 1) of the weight-only layers (--schemes) and of the svd_quant operator (rank 32), each
   after a BF16 F.linear of the same shape, with the kernels' one-thread thresholds set so that they run on one
   thread, then on two: what the thresholds GEMV_ONE_THREAD_WEIGHTS (weight_only), _ONE_THREAD_WORK (wqbmm:
   the int4-a16w4 layer) and _PRODUCT_ONE_THREAD_WEIGHTS (svd_quant) weigh.

    PYTHONPATH=src python benchmarks/thread_handover.py [--shapes 512x1024,1024x1024,2816x2048]
        [--schemes mxfp4-wo,hif8-wo,int4-a16w4] [--rounds 101]
"""

from __future__ import annotations

import lowbit  # noqa: I001  (first: sets the OpenMP wait policy before torch loads)

import argparse
import collections
import os
import statistics
import time

import numba
import numpy as np
import torch
import torch.nn.functional as F
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from lowbit.cli.bench.model import quantized_layer
from lowbit.cli.smoke._common import device_name
from lowbit.formats import mxfp4
from lowbit.kernels.cpu import svd_quant as svd_kernels
from lowbit.kernels.cpu import weight_only as weight_only_kernels
from lowbit.kernels.cpu import wqbmm as wqbmm_kernels
from lowbit.ops.svd_quant import svd_quant

_ONE, _TWO = 1 << 40, 0  # thresholds: always one thread, always two


@intrinsic
def _cycles(typingctx):
    """The time stamp counter (llvm.readcyclecounter)."""
    def codegen(context, builder, signature, args):
        read = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                              "llvm.readcyclecounter")
        return builder.call(read, [])
    return types.int64(), codegen


@numba.njit
def _now():
    return _cycles()


def _cycles_per_us() -> float:
    start, began = _now(), time.perf_counter()
    time.sleep(0.02)
    return (_now() - start) / (time.perf_counter() - began) / 1e6


@numba.njit(parallel=True)
def _halves(values, sums, stamps):
    """Two halves of a dependent chain of float additions over ``values``, one per prange iteration; stamps[i]
    the counter at the start and the end of half i."""
    half = values.size // 2
    for i in numba.prange(2):
        stamps[i, 0] = _cycles()
        total = 0.0
        for j in range(i * half, (i + 1) * half):
            total += values[j] * 1.0000001
        sums[i] = total
        stamps[i, 1] = _cycles()


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def handover(rounds: int) -> None:
    values = np.random.default_rng(0).random(1 << 18)
    sums, stamps = np.zeros(2), np.zeros((2, 2), dtype=np.int64)
    x, weight = torch.randn(1, 4096, dtype=torch.bfloat16), torch.randn(4096, 4096, dtype=torch.bfloat16)
    _halves(values, sums, stamps)
    timed = {}
    for threads in (1, 2):
        numba.set_num_threads(threads)
        samples, lags = [], []
        for _ in range(rounds):
            F.linear(x, weight)
            start = time.perf_counter()
            _halves(values, sums, stamps)
            samples.append(time.perf_counter() - start)
            lags.append(abs(stamps[1, 0] - stamps[0, 0]))
        timed[threads] = _median_ms(samples), statistics.median(lags) / _cycles_per_us()
    numba.set_num_threads(torch.get_num_threads())
    (one, _), (two, lag) = timed[1], timed[2]
    print(f"two halves after a 4096^2 F.linear: one thread {one:.3f} ms, two {two:.3f} ms ({two / one:.2f}x); "
          f"on two threads the second half started {lag:.0f} us after the first (median)")


def _after_linear(call, x, weight, rounds: int) -> tuple[float, float]:
    """(median ms of ``call()``, of F.linear) with each call right after F.linear(x, weight)."""
    ours, linear = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        F.linear(x, weight)
        middle = time.perf_counter()
        call()
        ours.append(time.perf_counter() - middle)
        linear.append(middle - start)
    return _median_ms(ours), _median_ms(linear)


def _one_against_two(name: str, module, attribute: str, call, x, weight, rounds: int) -> None:
    timed = collections.defaultdict(list)
    for _ in range(3):  # alternated
        for threshold in (_ONE, _TWO):
            setattr(module, attribute, threshold)
            call()  # compiles, binds
            ours, linear = _after_linear(call, x, weight, rounds)
            timed[threshold].append(ours)
            timed["F.linear"].append(linear)
    one, two, linear = (statistics.median(timed[key]) for key in (_ONE, _TWO, "F.linear"))
    print(f"{name}: F.linear {linear:.3f} ms; one thread {one:.3f} ms ({one / linear:.2f}x), two {two:.3f} ms "
          f"({two / linear:.2f}x)")


def layers(shapes: list[tuple[int, int]], schemes: list[str], rounds: int) -> None:
    saved = (weight_only_kernels.GEMV_ONE_THREAD_WEIGHTS, wqbmm_kernels._ONE_THREAD_WORK,
             svd_kernels._PRODUCT_ONE_THREAD_WEIGHTS)
    try:
        for n, k in shapes:
            gen = torch.Generator().manual_seed(0)
            weight = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
            bias = torch.randn(n, generator=gen).bfloat16()
            x = torch.randn(1, k, generator=gen).bfloat16()
            with torch.inference_mode():
                for scheme in schemes:
                    layer = quantized_layer(weight, bias, scheme)[0]
                    module, threshold = ((wqbmm_kernels, "_ONE_THREAD_WORK") if scheme == "int4-a16w4"
                                         else (weight_only_kernels, "GEMV_ONE_THREAD_WEIGHTS"))
                    _one_against_two(f"{n}x{k} {scheme}", module, threshold, lambda: layer(x), x, weight, rounds)
            w, s = mxfp4.dynamic_mx_quant(weight)
            d, u = torch.randn(k, 32, generator=gen).bfloat16(), torch.randn(32, n, generator=gen).bfloat16()
            _one_against_two(f"{n}x{k} svd_quant", svd_kernels, "_PRODUCT_ONE_THREAD_WEIGHTS",
                             lambda: svd_quant(x[None], w, s, d, u), x, weight, rounds)
    finally:
        (weight_only_kernels.GEMV_ONE_THREAD_WEIGHTS, wqbmm_kernels._ONE_THREAD_WORK,
         svd_kernels._PRODUCT_ONE_THREAD_WEIGHTS) = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="512x1024,1024x1024,2816x2048")
    parser.add_argument("--schemes", default="mxfp4-wo,hif8-wo,int4-a16w4")
    parser.add_argument("--rounds", type=int, default=101)
    args = parser.parse_args()
    print(f"CPU: {device_name(torch.device('cpu'))}, {torch.get_num_threads()} threads, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY')}, GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}")
    handover(args.rounds)
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    layers(shapes, args.schemes.split(","), args.rounds)


if __name__ == "__main__":
    main()
