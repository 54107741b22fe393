"""Benchmark of HiFloat4 fake-quant against memcpy and the reference code (same run).

GB/s counts bytes read + written (2 x element size per element); memcpy copies the input into a
preallocated buffer. The reference is timed on a smaller input (``--reference-size``; it allocates about
20 fp32 temporaries per element), and the native backend on that same input, giving "x reference".
"""

from __future__ import annotations

import argparse

import torch

from lowbit.cli.argtypes import comma_list, element_count, one_of
from lowbit.cli.bench import CaseTimer, size_label
from lowbit.formats import hifloat4
from lowbit.ops.hifloat4 import hifloat4_fake_quant

NAME = "hifloat4"
SIZES = {"1M": 1 << 20, "4M": 1 << 22, "64M": 1 << 26}
ROW = 4096  # elements per row of the benchmark input (64 blocks)
DTYPES = ("float16", "bfloat16", "float32")
QDIMS = ("-2", "-1", "0", "1")  # of the 2-D (rows, 4096) input
# 64 rows at least, so that any qdim of the (rows, 4096) input is quantizable
_size = element_count(SIZES, multiple_of=64 * ROW)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=comma_list(_size), default="64M",
                        help=f"comma-separated element counts (multiples of {64 * ROW}): 1M,4M,64M or integers")
    parser.add_argument("--dtypes", type=comma_list(one_of(DTYPES)), default="bfloat16",
                        help="comma-separated input dtypes: float16,bfloat16,float32")
    parser.add_argument("--qdims", type=comma_list(one_of(QDIMS)), default="-1,0",
                        help="comma-separated quant dims of the (rows, 4096) input; write --qdims=-1,0")
    parser.add_argument("--reference-size", type=_size, default="4M", help="elements for the reference comparison")


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    qdims = [int(q) for q in args.qdims]
    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        nbytes = 2 * torch.empty(0, dtype=dtype).element_size()  # read + write per element
        for n in args.sizes:
            x = torch.randn(n // ROW, ROW, device=device).to(dtype)
            out = torch.empty_like(x)
            case = CaseTimer(device, args.repeats, size=size_label(n, SIZES), dtype=dtype_name)
            case.time("memcpy (prealloc)", lambda: out.copy_(x), nbytes * n)
            for qdim in qdims:
                hifloat4_fake_quant(x, qdim, out=out, backend=args.backend)  # compile, self-check
                case.time(f"fake-quant qdim={qdim} out=",
                          lambda: hifloat4_fake_quant(x, qdim, out=out, backend=args.backend), nbytes * n)
            case.time("fake-quant qdim=-1 alloc", lambda: hifloat4_fake_quant(x, backend=args.backend), nbytes * n)
            case.time("empty_like + copy_ of the output", lambda: torch.empty_like(out).copy_(out), nbytes * n)
            rows += case.ratio_to_baseline("x memcpy")
            del x, out

        n = args.reference_size
        x = torch.randn(n // ROW, ROW, device=device).to(dtype)
        out = torch.empty_like(x)
        case = CaseTimer(device, args.repeats, size=size_label(n, SIZES), dtype=dtype_name)
        case.time("reference (lowbit.formats)", lambda: hifloat4.fake_quant(x), nbytes * n)
        case.time("fake-quant qdim=-1 out=", lambda: hifloat4_fake_quant(x, out=out, backend=args.backend), nbytes * n)
        rows += case.ratio_to_baseline("x reference", "ms", higher_is_better=False)
    return rows
