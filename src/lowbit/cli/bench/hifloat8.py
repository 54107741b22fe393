"""Benchmark of HiFloat8 encode/decode against memcpy and torch's float8_e4m3fn casts (same run).

GB/s counts bytes read + written: encode reads 2 and writes 1 byte per element, decode the reverse;
memcpy copies the FP16/BF16 input into a preallocated buffer (2 + 2 bytes per element).
"""

from __future__ import annotations

import argparse

import torch

from lowbit.cli.bench._timing import gbps, median_seconds
from lowbit.formats import hifloat8
from lowbit.ops.hifloat8 import decode_from_hifloat8, encode_to_hifloat8

NAME = "hifloat8"
SIZES = {"1M": 1 << 20, "64M": 1 << 26}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="1M,64M", help="comma-separated element counts: 1M,64M or integers")
    parser.add_argument("--dtypes", default="float16,bfloat16", help="comma-separated input dtypes")


def _size(text: str) -> int:
    return SIZES.get(text) or int(text)


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    rows = []
    for size_name in args.sizes.split(","):
        n = _size(size_name)
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            x = torch.randn(n, device=device).to(dtype)
            copy_dst = torch.empty_like(x)
            codes = torch.empty(n, dtype=torch.uint8, device=device)
            decoded = torch.empty_like(x)
            fp8 = x.to(torch.float8_e4m3fn)
            encode_to_hifloat8(x, out=codes, backend=args.backend)  # compile, self-check, warm tables

            case_rows = []

            def timed(what, fn, nbytes):
                s = median_seconds(fn, repeats=args.repeats, device=device, min_time=0.05)
                case_rows.append({"size": size_name, "dtype": dtype_name, "what": what, "ms": s * 1e3,
                                  "GB/s": gbps(nbytes, s)})

            timed("memcpy (prealloc)", lambda: copy_dst.copy_(x), 4 * n)
            timed("encode out=", lambda: encode_to_hifloat8(x, out=codes, backend=args.backend), 3 * n)
            timed("encode alloc", lambda: encode_to_hifloat8(x, backend=args.backend), 3 * n)
            timed("decode out=", lambda: decode_from_hifloat8(codes, dtype, out=decoded, backend=args.backend), 3 * n)
            timed("decode alloc", lambda: decode_from_hifloat8(codes, dtype, backend=args.backend), 3 * n)
            timed("torch -> float8_e4m3fn", lambda: x.to(torch.float8_e4m3fn), 3 * n)
            timed("torch float8_e4m3fn ->", lambda: fp8.to(dtype), 3 * n)
            if n <= SIZES["1M"]:
                timed("reference encode", lambda: hifloat8.encode(x), 3 * n)
            for row in case_rows:  # case_rows[0] is the memcpy baseline
                row["x memcpy"] = row["GB/s"] / case_rows[0]["GB/s"]
            rows += case_rows
    return rows
