"""Smoke check of HiFloat4 fake-quant: zero, NaN and Inf blocks next to ordinary ones, compared with the
reference bit for bit.

Per dtype (FP16, BF16, FP32), the (16, 128) probe input of :func:`lowbit.ops.hifloat4.probe_input`: the
worked blocks of docs/hifloat4.md (all 2.0, 0..63, a lone 1, a mixed block, huge, tiny, zeros, a NaN
block), an Inf block, a -0.0 block, and heavy-tailed random blocks; quantized along the last dim and,
transposed, along dim 0.
"""

from __future__ import annotations

import torch

from lowbit.cli.smoke._common import backend_that_ran, case_result
from lowbit.formats import hifloat4
from lowbit.ops.hifloat4 import FAKE_QUANT, hifloat4_fake_quant, probe_input

NAME = "hifloat4"
OPERATORS = (FAKE_QUANT,)  # the operators the check calls (warmed before it: lowbit.cli.smoke.run)


def _poisoned_blocks_nan(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Blocks (along the last dim) with a non-finite input are all NaN, and no other output is NaN."""
    blocks_x = x.cpu().float().reshape(x.shape[0], -1, hifloat4.BLOCK)
    blocks_y = y.cpu().float().reshape(x.shape[0], -1, hifloat4.BLOCK)
    poisoned = ~torch.isfinite(blocks_x).all(-1, keepdim=True)
    return bool(torch.equal(blocks_y.isnan(), poisoned.expand_as(blocks_y)))


def run(backend: str, device: torch.device) -> list[dict]:
    """Fake-quant the probe input per dtype along qdim -1 and 0; one result per (dtype, qdim)."""
    results = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        x_cpu = probe_input(dtype)
        for qdim, xq_cpu in ((-1, x_cpu), (0, x_cpu.t().contiguous())):
            xq = xq_cpu.to(device)
            y = hifloat4_fake_quant(xq, qdim, backend=backend)
            row_major = y if qdim == -1 else y.t()
            results.append(
                case_result(
                    backend=backend_that_ran(FAKE_QUANT.name),
                    input_dtype=dtype,
                    output=y,
                    reference=hifloat4.fake_quant(xq_cpu, qdim),
                    expected_shape=tuple(xq.shape),
                    expected_dtype=dtype,
                    expected_device=device,
                    error_target=xq,
                    qdim=qdim,
                    checks={"poisoned_blocks_all_nan_others_not": _poisoned_blocks_nan(x_cpu, row_major)},
                )
            )
    return results
