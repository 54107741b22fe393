"""Smoke check of weight_quant_batch_matmul (MSD): both templates, FP16 and BF16, with and without an
antiquant offset, through the one-shot op and through a plan with the weight packed once
(``plan.pack_weight``), on a small problem (M=3, K=512, N=192, G=128; CPU generator seeded 2026).

``matches_reference``: bit equality with the reference backend; the error figures compare with the exact
float64 product ``x @ ((W + offset) * scale)`` (MSD truncation error, about 3e-4 relative).
"""

from __future__ import annotations

import torch

from lowbit.cli.smoke._common import backend_that_ran, case_result
from lowbit.formats import wqbmm as reference
from lowbit.formats.int4 import unpack_int4
from lowbit.ops.wqbmm import MATMUL, TEMPLATES, plan_weight_quant_batch_matmul, weight_quant_batch_matmul

NAME = "wqbmm"
OPERATORS = (MATMUL,)
SEED = 2026
M, K, N, G = 3, 512, 192, 128


def smoke_inputs(dtype: torch.dtype, with_offset: bool):
    """(x, weight, scale, offset) on the CPU."""
    gen = torch.Generator().manual_seed(SEED)
    x = (torch.rand(M, K, generator=gen) * 6 - 3).to(dtype)
    weight = torch.randint(0, 256, (K, N // 2), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(K // G, N, generator=gen) * 0.2 - 0.1).to(dtype)
    offset = torch.randint(-2, 3, (K // G, N), generator=gen).to(dtype) if with_offset else None
    return x, weight, scale, offset


def _exact(x, weight, scale, offset) -> torch.Tensor:
    w = unpack_int4(weight).to(torch.float64)
    if offset is not None:
        w = w + offset.to(torch.float64).repeat_interleave(G, 0)
    return x.to(torch.float64) @ (w * scale.to(torch.float64).repeat_interleave(G, 0))


def _run_api(api, backend, device, x, weight, scale, offset, template):
    if api == "one-shot":
        return weight_quant_batch_matmul(
            x, weight, scale, antiquant_offset=offset, group_size=G, template=template, backend=backend
        )
    plan = plan_weight_quant_batch_matmul(
        M, K, N, group_size=G, template=template, device=device, dtype=x.dtype, backend=backend, prepacked=True
    )
    return plan.run(x, plan.pack_weight(weight), scale, offset, workspace=plan.new_workspace())


def run(backend: str, device: torch.device) -> list[dict]:
    """One result per (dtype, offset, template, api: one-shot or packed plan)."""
    results = []
    for dtype in (torch.float16, torch.bfloat16):
        for with_offset in (False, True):
            x, weight, scale, offset = smoke_inputs(dtype, with_offset)
            expected = reference.wqbmm_msd(x, weight, scale, offset, G)
            moved = [t.to(device) if t is not None else None for t in (x, weight, scale, offset)]
            for template, api in ((t, a) for t in TEMPLATES for a in ("one-shot", "packed plan")):
                y = _run_api(api, backend, device, *moved, template)
                results.append(
                    case_result(
                        backend=backend_that_ran(MATMUL.name),
                        input_dtype=dtype,
                        output=y,
                        reference=expected,
                        expected_shape=(M, N),
                        expected_dtype=dtype,
                        expected_device=device,
                        error_target=_exact(x, weight, scale, offset),
                        template=template,
                        antiquant_offset=with_offset,
                        api=api,
                    )
                )
    return results
