"""The weight-only GEMM path's parts on this CPU, in one run: torch's BF16 GEMM in both orientations, the BF16
tile decode of every format, and the batched kernel against the GEMM path for a few rows of x.

* ``orientation``: ``F.linear(x, w)`` against ``torch.mm(w, x.t())`` (y^T: the weight as the first operand,
  what the GEMM path runs on AMX CPUs) and the transpose of its result (``transpose_bf16`` against torch's
  strided copy), each after a SiLU, medians of --rounds;
* ``tile decode``: each format's (N, K) weight decoded to BF16 on one thread, into 64-row tiles that stay in
  the cache and into one tile of the whole weight, fastest of --rounds (int4: weight_quant_batch_matmul's
  dequant rows from a PackedWeight, group size 128);
* ``batched vs GEMM``: MXFP4 and HiFloat4 with M rows of BF16 x through the batched kernel and through the GEMM
  path (``AMX_BATCH_MAX_M`` / ``BATCH_MAX_M`` set for each), time over F.linear's, after a SiLU, medians.

With ``--grid-ks/--grid-ns/--grid-ms`` it runs only ``orientation grid``: for every (K, N, M), the GEMM path's two
orientations on a padded BF16 tile (``torch.mm(x, w.t())`` into the output; ``torch.mm(w, x.t())`` and
``transpose_bf16``), medians after a SiLU, and the transposed one's time over the other's (what sets
``TRANSPOSED_MIN_SIDE``, ``TRANSPOSED_MAX_M`` and ``TRANSPOSED_LONG_K``).

    PYTHONPATH=src python benchmarks/gemm_path.py [--shape 4096x4096] [--m 256] [--batched-ms 5 8 16 32]
    PYTHONPATH=src python benchmarks/gemm_path.py --grid-ks 384 1536 4096 --grid-ns 384 1536 4096 \
        --grid-ms 32 128 256 512 1024 1888
"""

from __future__ import annotations

import lowbit  # noqa: I001  (first: sets the OpenMP wait policy before torch loads)

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from lowbit.cli.smoke._common import device_name
from lowbit.formats import hifloat4, mxfp4, mxfp8
from lowbit.kernels.cpu import weight_only as cpu
from lowbit.kernels.cpu import wqbmm as cpu_wqbmm
from lowbit.kernels.cpu import wqbmm_dequant
from lowbit.kernels.cpu._runtime import as_numpy, run_tasks


def _medians(cases: dict, rounds: int, activation: torch.Tensor) -> dict[str, float]:
    """Median seconds of each case, the cases of a round interleaved, each call after a SiLU; after half a
    second of warm-up calls (AMX's first tens of milliseconds in a process ran at half speed here)."""
    warm_until = time.perf_counter() + 0.5
    while time.perf_counter() < warm_until:
        for call in cases.values():
            call()
    times = {name: [] for name in cases}
    for _ in range(rounds):
        for name, call in cases.items():
            F.silu(activation)
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def orientation(n: int, k: int, m: int, rounds: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=gen).bfloat16(), torch.randn(n, k, generator=gen).bfloat16()
    y_t, y = torch.empty(n, m, dtype=torch.bfloat16), torch.empty(m, n, dtype=torch.bfloat16)
    cases = {
        "F.linear(x, w)": lambda: F.linear(x, w),
        "torch.mm(w, x.t())": lambda: torch.mm(w, x.t(), out=y_t),
        "transpose_bf16 of y^T": lambda: cpu.transpose_bf16(as_numpy(y_t), as_numpy(y)),
        "torch copy of y^T.t()": lambda: y.copy_(y_t.t()),
    }
    times = _medians(cases, rounds, torch.randn(m, 4 * k).bfloat16())
    print(f"orientation, M = {m}, N x K = {n} x {k} (medians of {rounds}, ms): "
          + "  ".join(f"{name} {t * 1e3:.3f}" for name, t in times.items()))


def orientation_grid(ks: list[int], ns: list[int], ms: list[int], rounds: int) -> None:
    gen = torch.Generator().manual_seed(0)
    print("K N M: F.linear's orientation / transposed + transpose_bf16 (medians, ms), transposed over F.linear's")
    for k in ks:
        for n in ns:
            w = torch.randn(n, cpu._tile_width(k), generator=gen).bfloat16()[:, :k]  # a GEMM tile's padded rows
            for m in ms:
                x = torch.randn(m, k, generator=gen).bfloat16()
                y_t, y = torch.empty(n, m, dtype=torch.bfloat16), torch.empty(m, n, dtype=torch.bfloat16)

                def transposed():
                    torch.mm(w, x.t(), out=y_t)
                    cpu.transpose_bf16(as_numpy(y_t), as_numpy(y))

                cases = {"plain": lambda: torch.mm(x, w.t(), out=y), "transposed": transposed}
                times = _medians(cases, rounds, torch.randn(m, 4 * k).bfloat16())
                print(f"{k} {n} {m}: {times['plain'] * 1e3:.3f} / {times['transposed'] * 1e3:.3f} "
                      f"{times['transposed'] / times['plain']:.2f}", flush=True)


def tile_decode(n: int, k: int, rounds: int) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen)
    row_scale = w.abs().amax(1) / 32768
    weights = {
        "hifloat8": (cpu.HIFLOAT8_LINEAR, (lowbit.encode_to_hifloat8((w / row_scale[:, None]).bfloat16()), row_scale)),
        "mxfp4": (cpu.MXFP4_LINEAR, mxfp4.quantize(w)),
        "hifloat4": (cpu.HIFLOAT4_LINEAR, hifloat4.pack(w)),
        "mxfp8": (cpu.MXFP8_LINEAR, mxfp8.quantize(w)),
    }
    small = as_numpy(torch.empty(64, cpu._tile_width(k), dtype=torch.bfloat16))
    whole = as_numpy(torch.empty(n, cpu._tile_width(k), dtype=torch.bfloat16))
    decoders = {name: (kernel.tile, kernel._operands(*weight, k, torch.bfloat16))
                for name, (kernel, weight) in weights.items()}
    int4 = torch.randint(0, 256, (k, n // 2), generator=gen, dtype=torch.uint8)
    scale32 = (torch.rand(k // 128, n, generator=gen) / 8).bfloat16().float()
    decoders["int4 (PackedWeight)"] = (wqbmm_dequant.PACKED_TILE, (
        as_numpy(cpu_wqbmm.MATMUL.pack_weight(int4, 128)), as_numpy(scale32), as_numpy(scale32), False, 128, True))
    results = []
    for name, (tile, operands) in decoders.items():

        def in_cache():
            for r0 in range(0, n - 63, 64):
                run_tasks(tile, (*operands, r0), 64, small, True)

        def one_tile():
            run_tasks(tile, (*operands, 0), n, whole, True)

        fastest = []
        for call in (in_cache, one_tile):
            call()
            samples = []
            for _ in range(rounds):
                start = time.perf_counter()
                call()
                samples.append(time.perf_counter() - start)
            fastest.append(min(samples) * 1e3)
        results.append(f"{name} {fastest[0]:.3f} / {fastest[1]:.3f}")
    print(f"BF16 tile decode, one thread, {n} x {k} (64-row tiles in cache / one tile; fastest of {rounds}, ms): "
          + "  ".join(results))


def batched_vs_gemm(n: int, k: int, ms: list[int], rounds: int) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen)
    w_bf16 = w.bfloat16()
    operators = {"mxfp4": (lowbit.mxfp4_linear, mxfp4.quantize(w)),
                 "hifloat4": (lowbit.hifloat4_linear, hifloat4.pack(w))}
    saved = cpu.AMX_BATCH_MAX_M, cpu.BATCH_MAX_M
    try:
        for m in ms:
            x = torch.randn(m, k, generator=gen).bfloat16()
            cases = {"F.linear": lambda: F.linear(x, w_bf16)}
            for name, (op, weight) in operators.items():
                for path, rows in (("batched", saved[1]), ("GEMM", cpu.GEMV_MAX_M)):
                    if m > rows > cpu.GEMV_MAX_M:  # past the batched kernel's rows
                        continue

                    def call(op=op, weight=weight, rows=rows):
                        cpu.AMX_BATCH_MAX_M = cpu.BATCH_MAX_M = rows
                        op(x, *weight, backend="native")
                    cases[f"{name} {path}"] = call
            times = _medians(cases, rounds, torch.randn(64, 4 * k).bfloat16())
            base = times.pop("F.linear")
            print(f"M = {m}, {n} x {k}, time over F.linear's ({base * 1e3:.2f} ms): "
                  + "  ".join(f"{name} {t / base:.2f}" for name, t in times.items()))
    finally:
        cpu.AMX_BATCH_MAX_M, cpu.BATCH_MAX_M = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="4096x4096", help="N x K of the weight")
    parser.add_argument("--m", type=int, default=256, help="rows of x for the orientation case")
    parser.add_argument("--batched-ms", type=int, nargs="+", default=[5, 8, 16, 32])
    parser.add_argument("--rounds", type=int, default=11)
    for axis in "knm":
        parser.add_argument(f"--grid-{axis}s", type=int, nargs="+", help="orientation grid only: these sizes")
    args = parser.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    print(f"CPU: {device_name(torch.device('cpu'))}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"TRANSPOSED_GEMM {cpu.TRANSPOSED_GEMM}")
    if args.grid_ks or args.grid_ns or args.grid_ms:
        orientation_grid(args.grid_ks or [k], args.grid_ns or [n], args.grid_ms or [args.m], args.rounds)
        return
    orientation(n, k, args.m, args.rounds)
    tile_decode(n, k, args.rounds)
    batched_vs_gemm(n, k, args.batched_ms, args.rounds)


if __name__ == "__main__":
    main()
