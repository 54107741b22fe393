"""Smoke check of MXFP4 quantize + dequantize (docs/mxfp4.md).

Per input dtype (FP16, BF16, FP32): a (3, 64) input = the worked vector of docs/mxfp4.md (section
'Worked vectors') padded to 64, one row of 64 torch.randn values from a CPU generator seeded 2026
(times 100), and a row with a zero block and a block of ties; quantized (floor scale, TA) and dequantized back to the same dtype with the
requested backend, compared bit for bit with the reference. Extra keys: ``codes_match_reference`` and
``worked_vector_bytes_ok`` (the packed bytes of that worked vector).
"""

from __future__ import annotations

import torch

from lowbit.cli.smoke._common import backend_that_ran, case_result
from lowbit.formats import mxfp4
from lowbit.ops.mxfp4 import DEQUANTIZE, QUANTIZE, mxfp4_dequantize, mxfp4_quantize

NAME = "mxfp4"
OPERATORS = (QUANTIZE, DEQUANTIZE)
SEED = 2026
WORKED_VECTOR = [4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, 0.2, 5.9, -0.0] + [0.0] * 20
WORKED_BYTES = [0x16, 0x32, 0x54, 0x76, 0x09, 0x87] + [0x00] * 10  # scale byte 0x7F


def smoke_input(dtype: torch.dtype) -> torch.Tensor:
    """The (3, 64) smoke input on the CPU."""
    generator = torch.Generator().manual_seed(SEED)
    worked = torch.tensor(WORKED_VECTOR * 2)
    random = torch.randn(64, generator=generator) * 100
    ties = torch.cat([torch.zeros(32), torch.tensor(mxfp4.E2M1_MIDPOINTS * 5)[:32]])
    return torch.stack([worked, random, ties]).to(dtype)


def run(backend: str, device: torch.device) -> list[dict]:
    """Round-trip the smoke input per dtype; one result per dtype."""
    results = []
    for dtype in mxfp4.INPUT_DTYPES:
        x_cpu = smoke_input(dtype)
        codes, scales = mxfp4_quantize(x_cpu.to(device), backend=backend)
        y = mxfp4_dequantize(codes, scales, dtype, backend=backend)
        ref_codes, ref_scales = mxfp4.quantize(x_cpu)
        results.append(
            case_result(
                backend=backend_that_ran(QUANTIZE.name, DEQUANTIZE.name),
                input_dtype=dtype,
                output=y,
                reference=mxfp4.dequantize(ref_codes, ref_scales, dtype),
                expected_shape=tuple(x_cpu.shape),
                expected_dtype=dtype,
                expected_device=device,
                error_target=x_cpu.to(device),
                checks={
                    "codes_match_reference": torch.equal(codes.cpu(), ref_codes)
                    and torch.equal(scales.cpu(), ref_scales),
                    "worked_vector_bytes_ok": codes[0, :16].cpu().tolist() == WORKED_BYTES
                    and int(scales[0, 0]) == 0x7F,
                },
            )
        )
    return results
