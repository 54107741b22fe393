"""Benchmark of HiFloat8 encode/decode against memcpy and torch's float8_e4m3fn casts (same run).

GB/s counts bytes read + written: encode reads 2 and writes 1 byte per element, decode the reverse;
memcpy copies the FP16/BF16 input into a preallocated buffer (2 + 2 bytes per element). "empty_like + copy_"
rows copy an op's output into a fresh tensor: the first-touch cost an allocating call pays, as a baseline.
"""

from __future__ import annotations

import argparse

import torch

from lowbit.cli.argtypes import comma_list, element_count, one_of
from lowbit.cli.bench import CaseTimer, size_label, sizes_and_dtypes
from lowbit.formats import hifloat8
from lowbit.ops.hifloat8 import decode_from_hifloat8, encode_to_hifloat8

NAME = "hifloat8"
SIZES = {"1M": 1 << 20, "64M": 1 << 26}
DTYPES = ("float16", "bfloat16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=comma_list(element_count(SIZES)), default="1M,64M",
                        help="comma-separated element counts: 1M,64M or integers")
    parser.add_argument("--dtypes", type=comma_list(one_of(DTYPES)), default=",".join(DTYPES),
                        help="comma-separated input dtypes: float16,bfloat16")


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    rows = []
    for n, dtype_name, dtype in sizes_and_dtypes(args):
        x = torch.randn(n, device=device).to(dtype)
        copy_dst = torch.empty_like(x)
        codes = torch.empty(n, dtype=torch.uint8, device=device)
        decoded = torch.empty_like(x)
        fp8 = x.to(torch.float8_e4m3fn)
        encode_to_hifloat8(x, out=codes, backend=args.backend)  # compile, self-check, warm tables
        case = CaseTimer(device, args.repeats, size=size_label(n, SIZES), dtype=dtype_name)
        case.time("memcpy (prealloc)", lambda: copy_dst.copy_(x), 4 * n)
        case.time("encode out=", lambda: encode_to_hifloat8(x, out=codes, backend=args.backend), 3 * n)
        case.time("encode alloc", lambda: encode_to_hifloat8(x, backend=args.backend), 3 * n)
        case.time("empty_like + copy_ of encode's output", lambda: torch.empty_like(codes).copy_(codes), 2 * n)
        case.time("decode out=",
                  lambda: decode_from_hifloat8(codes, dtype, out=decoded, backend=args.backend), 3 * n)
        case.time("decode alloc", lambda: decode_from_hifloat8(codes, dtype, backend=args.backend), 3 * n)
        case.time("empty_like + copy_ of decode's output", lambda: torch.empty_like(decoded).copy_(decoded), 4 * n)
        case.time("torch -> float8_e4m3fn", lambda: x.to(torch.float8_e4m3fn), 3 * n)
        case.time("torch float8_e4m3fn ->", lambda: fp8.to(dtype), 3 * n)
        if n <= SIZES["1M"]:
            case.time("reference encode", lambda: hifloat8.encode(x), 3 * n)
        rows += case.ratio_to_baseline("x memcpy")
    return rows
