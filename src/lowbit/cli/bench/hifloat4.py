"""Benchmark of HiFloat4 fake-quant against memcpy and the reference code (same run).

GB/s counts bytes read + written (2 x element size per element); memcpy copies the input into a
preallocated buffer. The reference is timed on a smaller input (``--reference-size``; it allocates about
20 fp32 temporaries per element), and the native backend on that same input, giving "x reference".
"""

from __future__ import annotations

import argparse

import torch

from lowbit.cli.bench._timing import gbps, median_seconds
from lowbit.formats import hifloat4
from lowbit.ops.hifloat4 import hifloat4_fake_quant

NAME = "hifloat4"
SIZES = {"1M": 1 << 20, "4M": 1 << 22, "64M": 1 << 26}
ROW = 4096  # elements per row of the benchmark input (64 blocks)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="64M", help="comma-separated element counts: 1M,4M,64M or integers")
    parser.add_argument("--dtypes", default="bfloat16", help="comma-separated input dtypes")
    parser.add_argument("--qdims", default="-1,0", help="comma-separated quant dims of the (rows, 4096) input; write --qdims=-1,0")
    parser.add_argument("--reference-size", default="4M", help="elements for the reference comparison")


def _size(text: str) -> int:
    n = SIZES.get(text) or int(text)
    if n % (64 * ROW):  # 64 rows at least, so that any qdim of the (rows, 4096) input is quantizable
        raise ValueError(f"size {n} is not a multiple of {64 * ROW}")
    return n


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    qdims = [int(q) for q in args.qdims.split(",")]
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        nbytes = 2 * torch.empty(0, dtype=dtype).element_size()  # read + write per element

        def timed(case_rows, size_name, what, fn, n):
            s = median_seconds(fn, repeats=args.repeats, device=device, min_time=0.05)
            case_rows.append({"size": size_name, "dtype": dtype_name, "what": what, "ms": s * 1e3,
                              "GB/s": gbps(nbytes * n, s)})
            return s

        for size_name in args.sizes.split(","):
            n = _size(size_name)
            x = torch.randn(n // ROW, ROW, device=device).to(dtype)
            out = torch.empty_like(x)
            case_rows = []
            timed(case_rows, size_name, "memcpy (prealloc)", lambda: out.copy_(x), n)
            for qdim in qdims:
                hifloat4_fake_quant(x, qdim, out=out, backend=args.backend)  # compile, self-check
                timed(case_rows, size_name, f"fake-quant qdim={qdim} out=",
                      lambda: hifloat4_fake_quant(x, qdim, out=out, backend=args.backend), n)
            timed(case_rows, size_name, "fake-quant qdim=-1 alloc",
                  lambda: hifloat4_fake_quant(x, backend=args.backend), n)
            for row in case_rows:  # case_rows[0] is the memcpy baseline
                row["x memcpy"] = row["GB/s"] / case_rows[0]["GB/s"]
            rows += case_rows
            del x, out

        size_name = args.reference_size
        n = _size(size_name)
        x = torch.randn(n // ROW, ROW, device=device).to(dtype)
        out = torch.empty_like(x)
        case_rows = []
        native = timed(case_rows, size_name, "fake-quant qdim=-1 out=",
                       lambda: hifloat4_fake_quant(x, out=out, backend=args.backend), n)
        reference = timed(case_rows, size_name, "reference (lowbit.formats)", lambda: hifloat4.fake_quant(x), n)
        case_rows[0]["x reference"] = reference / native
        case_rows[1]["x reference"] = 1.0
        rows += case_rows
    return rows
