"""Benchmark of MXFP4 quantize/dequantize against memcpy (same run).

GB/s counts bytes read + written: quantize reads 2 (BF16/FP16) or 4 (FP32) bytes per element and writes
0.5 + 1/32; dequantize the reverse; memcpy copies the input into a preallocated buffer. Rows go through
torch.ops.lowbit with the requested backend; "out=" rows write into preallocated outputs, the others
allocate theirs (and pay first-touch page faults). The goal is CPU quantize of 64M BF16 elements at
>= 25 % of memcpy bandwidth.
"""

from __future__ import annotations

import argparse

import torch

from lowbit.cli.bench._timing import gbps, median_seconds
from lowbit.ops.mxfp4 import mxfp4_dequantize, mxfp4_quantize

NAME = "mxfp4"
SIZES = {"1M": 1 << 20, "64M": 1 << 26}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="64M", help="comma-separated element counts: 1M,64M or integers")
    parser.add_argument("--dtypes", default="bfloat16", help="comma-separated input dtypes")
    parser.add_argument("--scale-rule", default="floor", help="floor, nearest, even, ceil or rceil")
    parser.add_argument("--rounding", default="ta", help="ta or rne")


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    rows = []
    for size_name in args.sizes.split(","):
        n = SIZES.get(size_name) or int(size_name)
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            x = torch.randn(n // 32, 32, device=device).to(dtype)
            copy_dst = torch.empty_like(x)
            def quant(out=None):
                return mxfp4_quantize(x, 32, args.scale_rule, args.rounding, out=out, backend=args.backend)

            codes, scales = quant()  # compile, self-check
            in_bytes, packed_bytes = n * x.element_size(), n // 2 + n // 32
            case_rows = []

            def timed(what, fn, nbytes):
                s = median_seconds(fn, repeats=args.repeats, device=device, min_time=0.05)
                case_rows.append({"size": size_name, "dtype": dtype_name, "what": what, "ms": s * 1e3,
                                  "GB/s": gbps(nbytes, s)})

            timed("memcpy (prealloc)", lambda: copy_dst.copy_(x), 2 * in_bytes)
            out = (torch.empty_like(codes), torch.empty_like(scales))
            timed("quantize op out=", lambda: quant(out), in_bytes + packed_bytes)
            timed("quantize op alloc", quant, in_bytes + packed_bytes)
            values = torch.empty_like(x)
            timed("dequantize op out=", lambda: mxfp4_dequantize(codes, scales, dtype, out=values, backend=args.backend),
                  in_bytes + packed_bytes)
            timed("dequantize op alloc", lambda: mxfp4_dequantize(codes, scales, dtype, backend=args.backend),
                  in_bytes + packed_bytes)
            for row in case_rows:  # case_rows[0] is the memcpy baseline
                row["x memcpy"] = row["GB/s"] / case_rows[0]["GB/s"]
            rows += case_rows
    return rows
