"""WeightQuantBatchMatmul on this CPU against torch baselines, measured in one run (interleaved rounds).

For each N x K in --shapes and M in --ms: F.linear with the dequantized BF16 weight,
aten._weight_int4pack_mm_for_cpu with BF16 activations (same weight, group size), lowbit's MSD ``basic`` and
``preload`` through a reused plan with the weight packed once (``plan.pack_weight``), and the one-shot op
``weight_quant_batch_matmul(x, weight, scale)`` with the raw (K, N/2) weight (no plan, no packing: what a
caller of the upstream convention runs; it allocates its output and workspace every call); for M > 16 also
the ``dequant`` algorithm with BF16 x, one-shot on the raw weight and through a prepacked plan.
Before every timed call an untimed torch op runs (a SiLU over an 8 MiB activation, as the other layers of
a model forward would), so each call starts with torch's threads just used and part of the cache replaced.
Two measurements, both as medians (and minima) over --rounds interleaved rounds:

* wall: all threads (torch.get_num_threads()), perf_counter per call;
* cpu1: one thread for everyone (torch and numba), CPU time of the calling thread (time.thread_time), which
  a shared, noisy machine does not inflate by descheduling.

    PYTHONPATH=src flock /tmp/lowbit-bench.lock python benchmarks/wqbmm_cpu.py --shapes 12288x8192,4096x4096
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import torch
import torch.nn.functional as F

from lowbit.cli.bench.wqbmm import int4pack_baseline
from lowbit.formats import wqbmm as reference
from lowbit.ops.wqbmm import TEMPLATES, plan_weight_quant_batch_matmul, weight_quant_batch_matmul

_FORWARD_NEIGHBOUR = torch.randn(2 * 1024 * 1024)  # 8 MiB of float32 activations


def _cases(m, k, n, g, weight, scale, dense_bf16, int4mm, gen):
    x = torch.randn(m, k, generator=gen).to(torch.float16)
    x_bf16 = x.to(torch.bfloat16)
    cases = {"F.linear bf16": lambda: F.linear(x_bf16, dense_bf16), "int4pack_mm bf16": lambda: int4mm(x_bf16)}
    for template in TEMPLATES:
        plan = plan_weight_quant_batch_matmul(m, k, n, group_size=g, template=template, backend="native",
                                              prepacked=True)
        out, workspace, packed = torch.empty(m, n, dtype=torch.float16), plan.new_workspace(), plan.pack_weight(weight)
        cases[f"lowbit {template}"] = lambda plan=plan, out=out, workspace=workspace, packed=packed: plan.run(
            x, packed, scale, out=out, workspace=workspace
        )
    cases["lowbit one-shot raw W"] = lambda: weight_quant_batch_matmul(x, weight, scale, group_size=g,
                                                                      backend="native")
    if m > 16:  # prefill: the dequant algorithm, BF16 x, on the raw weight and on a PackedWeight
        scale_bf16 = scale.to(torch.bfloat16)
        cases["lowbit dequant raw W bf16"] = lambda: weight_quant_batch_matmul(
            x_bf16, weight, scale_bf16, group_size=g, algorithm="dequant", backend="native")
        plan = plan_weight_quant_batch_matmul(m, k, n, group_size=g, algorithm="dequant", dtype=torch.bfloat16,
                                              backend="native", prepacked=True)
        out, workspace, packed = torch.empty(m, n, dtype=torch.bfloat16), plan.new_workspace(), plan.pack_weight(weight)
        cases["lowbit dequant packed bf16"] = lambda: plan.run(x_bf16, packed, scale_bf16, out=out,
                                                               workspace=workspace)
    return cases


def _measure(cases, rounds, clock):
    samples = {name: [] for name in cases}
    for fn in cases.values():
        fn()
        fn()
    for _ in range(rounds):
        for name, fn in cases.items():
            F.silu(_FORWARD_NEIGHBOUR)
            start = clock()
            fn()
            samples[name].append(clock() - start)
    return {name: (statistics.median(v) * 1e3, min(v) * 1e3) for name, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ms", default="1,16")
    parser.add_argument("--shapes", default="12288x8192", help="comma-separated NxK")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        _run_shape(n, k, args.group_size, [int(v) for v in args.ms.split(",")], args.rounds)


def _run_shape(n, k, g, ms, rounds):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randint(0, 256, (k, n // 2), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(k // g, n, generator=gen) * 0.02).to(torch.float16)
    dense_bf16 = reference.dequantize_weight(weight, scale.to(torch.bfloat16), None, g).t().contiguous()
    int4mm = int4pack_baseline(weight, scale, g)
    threads = torch.get_num_threads()
    print(f"N={n} K={k} G={g}; wall: {threads} threads; cpu1: 1 thread, thread CPU time. ms: median (min)")
    print("| M | what | wall ms | wall x F.linear | cpu1 ms | cpu1 x F.linear |")
    print("|---|---|---|---|---|---|")
    for m in ms:
        cases = _cases(m, k, n, g, weight, scale, dense_bf16, int4mm, gen)
        torch.set_num_threads(threads)
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        wall = _measure(cases, rounds, time.perf_counter)
        torch.set_num_threads(1)  # lowbit's wrapper syncs numba to torch's thread count
        cpu1 = _measure(cases, max(5, rounds // 3), time.thread_time)
        torch.set_num_threads(threads)
        base_wall, base_cpu = wall["F.linear bf16"][0], cpu1["F.linear bf16"][0]
        for name in cases:
            (w, wmin), (c, cmin) = wall[name], cpu1[name]
            print(f"| {m} | {name} | {w:.2f} ({wmin:.2f}) | {base_wall / w:.2f} "
                  f"| {c:.2f} ({cmin:.2f}) | {base_cpu / c:.2f} |")


if __name__ == "__main__":
    main()
