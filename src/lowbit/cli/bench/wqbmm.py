"""Benchmark of weight_quant_batch_matmul (MSD, both templates, through a reused plan with the weight
packed once by plan.pack_weight, as torch's baseline packs with _convert_weight_to_int4pack; on the CPU also
the ``dequant`` algorithm with BF16 x on the raw weight, as Int4Linear runs it for prefill) against torch's
dense BF16 ``F.linear`` with the dequantized weight and, on CPU, ``aten._weight_int4pack_mm_for_cpu``
with BF16 activations (same group size), all measured in the same run.

GB/s: bytes of the weight operand each call reads (int4: K * N / 2 plus the scales; dense: 2 * K * N).
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch
import torch.nn.functional as F

from lowbit.cli.argtypes import comma_list, positive_int
from lowbit.cli.bench import CaseTimer
from lowbit.formats import wqbmm as reference
from lowbit.formats.int4 import unpack_int4
from lowbit.ops.wqbmm import TEMPLATES, plan_weight_quant_batch_matmul

NAME = "wqbmm"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ms", type=comma_list(positive_int), default="1,16", help="comma-separated row counts M")
    parser.add_argument("--n", type=positive_int, default=12288, help="N (even)")
    parser.add_argument("--k", type=positive_int, default=8192, help="K (a multiple of the group size)")
    parser.add_argument("--group-size", type=positive_int, default=128, help="G (a multiple of 32 dividing K)")


def int4pack_baseline(
    weight: torch.Tensor, scale: torch.Tensor, group_size: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """torch's CPU int4 kernel on the same weight, as ``fn(x_bf16) -> (M, N) bf16``: (q - 8) * scale + 0 ==
    W * scale. ``weight``: packed int4 (K, N/2) uint8, ``scale``: (K/G, N), both on the CPU."""
    q = (unpack_int4(weight).to(torch.int32) + 8).t().contiguous()  # (N, K) values 0..15
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    scales_and_zeros = torch.stack([scale.to(torch.bfloat16), torch.zeros_like(scale, dtype=torch.bfloat16)], dim=-1)
    return lambda x_bf16: torch.ops.aten._weight_int4pack_mm_for_cpu(x_bf16, packed, group_size, scales_and_zeros)


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    n, k, g = args.n, args.k, args.group_size
    for m in args.ms:  # validate every case before timing any (ShapeError naming the sizes)
        plan_weight_quant_batch_matmul(m, k, n, group_size=g, device=device, backend="reference")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randint(0, 256, (k, n // 2), generator=gen, dtype=torch.uint8).to(device)
    scale = (torch.rand(k // g, n, generator=gen) * 0.02).to(torch.float16).to(device)
    scale_bf16 = scale.to(torch.bfloat16)
    dense_bf16 = reference.dequantize_weight(weight, scale_bf16, None, g).t().contiguous()
    int4_bytes, dense_bytes = k * n // 2 + 2 * scale.numel(), 2 * k * n
    int4mm = int4pack_baseline(weight.cpu(), scale.cpu(), g) if device.type == "cpu" else None
    rows = []
    for m in args.ms:
        x = torch.randn(m, k, generator=gen).to(torch.float16).to(device)
        x_bf16 = x.to(torch.bfloat16)
        case = CaseTimer(device, args.repeats, M=m)
        case.time("F.linear bf16 (dequantized W)", lambda: F.linear(x_bf16, dense_bf16), dense_bytes)
        if int4mm is not None:
            case.time("aten._weight_int4pack_mm_for_cpu bf16", lambda: int4mm(x_bf16), int4_bytes)
        for template in TEMPLATES:
            plan = plan_weight_quant_batch_matmul(m, k, n, group_size=g, template=template, device=device,
                                                  backend=args.backend, prepacked=True)
            out, workspace = torch.empty(m, n, dtype=x.dtype, device=device), plan.new_workspace()
            packed = plan.pack_weight(weight)
            run_plan = lambda: plan.run(x, packed, scale, out=out, workspace=workspace)
            run_plan()  # compile, self-check
            case.time(f"wqbmm msd {template} ({plan.backend})", run_plan, int4_bytes)
        if device.type == "cpu":  # the dequant algorithm's kernel (CPU only): BF16, the raw weight
            plan = plan_weight_quant_batch_matmul(m, k, n, group_size=g, algorithm="dequant", device=device,
                                                  dtype=torch.bfloat16, backend=args.backend)
            out, workspace = torch.empty(m, n, dtype=torch.bfloat16), plan.new_workspace()
            run_dequant = lambda: plan.run(x_bf16, weight, scale_bf16, out=out, workspace=workspace)
            run_dequant()  # compile
            case.time(f"wqbmm dequant bf16 ({plan.backend})", run_dequant, int4_bytes)
        rows += case.ratio_to_baseline("speedup vs F.linear", "ms", higher_is_better=False)
    return rows
