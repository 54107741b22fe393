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

from lowbit.cli.argtypes import comma_list, element_count, one_of
from lowbit.cli.bench import CaseTimer, size_label, sizes_and_dtypes
from lowbit.formats import mxfp4
from lowbit.ops.mxfp4 import mxfp4_dequantize, mxfp4_quantize

NAME = "mxfp4"
SIZES = {"1M": 1 << 20, "64M": 1 << 26}
DTYPES = ("float16", "bfloat16", "float32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=comma_list(element_count(SIZES, multiple_of=32)), default="64M",
                        help="comma-separated element counts (multiples of 32): 1M,64M or integers")
    parser.add_argument("--dtypes", type=comma_list(one_of(DTYPES)), default="bfloat16",
                        help="comma-separated input dtypes: float16,bfloat16,float32")
    parser.add_argument("--scale-rule", choices=list(mxfp4.SCALE_RULES), default="floor")
    parser.add_argument("--rounding", choices=list(mxfp4.ROUNDINGS), default="ta")


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    rows = []
    for n, dtype_name, dtype in sizes_and_dtypes(args):
        x = torch.randn(n // 32, 32, device=device).to(dtype)
        copy_dst = torch.empty_like(x)

        def quant(out=None):
            return mxfp4_quantize(x, 32, args.scale_rule, args.rounding, out=out, backend=args.backend)

        codes, scales = quant()  # compile, self-check
        in_bytes, packed_bytes = n * x.element_size(), n // 2 + n // 32
        out, values = (torch.empty_like(codes), torch.empty_like(scales)), torch.empty_like(x)
        case = CaseTimer(device, args.repeats, size=size_label(n, SIZES), dtype=dtype_name)
        case.time("memcpy (prealloc)", lambda: copy_dst.copy_(x), 2 * in_bytes)
        case.time("quantize op out=", lambda: quant(out), in_bytes + packed_bytes)
        case.time("quantize op alloc", quant, in_bytes + packed_bytes)
        case.time("empty_like + copy_ of quantize's outputs",
                  lambda: (torch.empty_like(out[0]).copy_(out[0]), torch.empty_like(out[1]).copy_(out[1])),
                  2 * packed_bytes)
        case.time("dequantize op out=",
                  lambda: mxfp4_dequantize(codes, scales, dtype, out=values, backend=args.backend),
                  in_bytes + packed_bytes)
        case.time("dequantize op alloc", lambda: mxfp4_dequantize(codes, scales, dtype, backend=args.backend),
                  in_bytes + packed_bytes)
        case.time("empty_like + copy_ of dequantize's output", lambda: torch.empty_like(values).copy_(values),
                  2 * in_bytes)
        rows += case.ratio_to_baseline("x memcpy")
    return rows
