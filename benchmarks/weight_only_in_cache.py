"""Weight-only GEMV kernels with the weight in cache: the instructions' cost, without the memory system.

One (N, K) weight (default 1024 x 4096: 2 MiB as MXFP4, 4 MiB as 8-bit codes, within a 32 MiB L3) and one
row of BF16 x; F.linear with the BF16 weight and lowbit's mxfp4_linear, hifloat4_linear, hifloat8_linear and
mxfp8_linear (backend "native") called in turn, --calls rounds; the fastest call of each, in ms. Run two
trees alternately (each with its own NUMBA_CACHE_DIR) to compare kernels; see benchmarks/weight_only.py for
the weight streamed from memory as a model's forward pass meets it.

    PYTHONPATH=src python benchmarks/weight_only_in_cache.py [--threads 1] [--shape 1024x4096] [--calls 300]
"""

from __future__ import annotations

import lowbit  # noqa: I001  (first: sets the OpenMP wait policy before torch loads)

import argparse
import time

import torch
import torch.nn.functional as F

from lowbit.cli.smoke._common import device_name
from lowbit.formats import hifloat4, mxfp4, mxfp8


def _cases(n: int, k: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(1, k, generator=gen).bfloat16()
    w_bf16 = w.bfloat16()
    row_scale = w.abs().amax(1) / 32768
    packed = {
        "mxfp4_linear": mxfp4.quantize(w),
        "hifloat4_linear": hifloat4.pack(w),
        "hifloat8_linear": (lowbit.encode_to_hifloat8((w / row_scale[:, None]).bfloat16()), row_scale),
        "mxfp8_linear": mxfp8.quantize(w),
    }
    cases = {"F.linear bf16": lambda: F.linear(x, w_bf16)}
    for name, weight in packed.items():
        cases[name] = lambda fn=getattr(lowbit, name), weight=weight: fn(x, *weight, backend="native")
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shape", default="1024x4096", help="N x K")
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n, k = (int(v) for v in args.shape.split("x"))
    cases = _cases(n, k)
    for call in cases.values():  # compile and warm up
        call()
        call()
    fastest = dict.fromkeys(cases, float("inf"))
    for _ in range(args.calls):
        for name, call in cases.items():
            start = time.perf_counter()
            call()
            fastest[name] = min(fastest[name], time.perf_counter() - start)
    print(f"CPU: {device_name(torch.device('cpu'))}, {args.threads} thread(s), N x K = {n} x {k}, "
          f"fastest of {args.calls} calls (ms):")
    print("  ".join(f"{name} {seconds * 1e3:.3f}" for name, seconds in fastest.items()))


if __name__ == "__main__":
    main()
