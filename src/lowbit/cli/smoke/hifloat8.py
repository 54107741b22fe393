"""Smoke check of the HiFloat8 round trip (the upstream smoke input: docs/cli.md, "The upstream smoke contract").

Per dtype (FP16, BF16): 20 fixed values (0, -0, +-1, +-0.5, +-2, +-0.25, +-4, +-16, +-100, +-32768,
+-finfo.tiny) and 16 torch.randn values from a CPU generator seeded 2026, on the device; encode then
decode back to the same dtype with the requested backend, and compare with the reference bit for bit.
"""

from __future__ import annotations

import torch

from lowbit.cli.smoke._common import backend_that_ran, case_result
from lowbit.formats import hifloat8
from lowbit.ops.hifloat8 import DECODE, ENCODE, decode_from_hifloat8, encode_to_hifloat8

NAME = "hifloat8"
OPERATORS = (ENCODE, DECODE)
SEED = 2026


def smoke_input(dtype: torch.dtype) -> torch.Tensor:
    """The upstream smoke input: 36 elements of ``dtype`` on the CPU."""
    tiny = torch.finfo(dtype).tiny
    fixed = [0.0, -0.0]
    for v in (1.0, 0.5, 2.0, 0.25, 4.0, 16.0, 100.0, 32768.0, tiny):
        fixed += [v, -v]
    generator = torch.Generator().manual_seed(SEED)
    random = torch.randn(16, generator=generator)
    return torch.cat([torch.tensor(fixed, dtype=torch.float32), random]).to(dtype)


def run(backend: str, device: torch.device) -> list[dict]:
    """Round-trip the smoke input per dtype; one result per dtype."""
    results = []
    for dtype in (torch.float16, torch.bfloat16):
        x_cpu = smoke_input(dtype)
        x = x_cpu.to(device)
        codes = encode_to_hifloat8(x, backend=backend)
        y = decode_from_hifloat8(codes, dtype, backend=backend)
        reference = hifloat8.decode(hifloat8.encode(x_cpu), dtype)
        results.append(
            case_result(
                backend=backend_that_ran(ENCODE.name, DECODE.name),
                input_dtype=dtype,
                output=y,
                reference=reference,
                expected_shape=tuple(x.shape),
                expected_dtype=dtype,
                expected_device=device,
                error_target=x,
                checks={"codes_match_reference": torch.equal(codes.cpu(), hifloat8.encode(x_cpu))},
            )
        )
    return results
