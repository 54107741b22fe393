"""Converted layers of every data-free scheme, called the way models call them with inputs of every layout a
model may pass (transposed, strided, at an odd offset, broadcast, with NaN or Inf, huge values, another dtype,
several leading dims, no rows): the reference backend's bits, or a ValueError / TypeError / RuntimeError,
never a crash or other bits. Up to EXACT_ROWS rows of x, where every kernel equals the reference bit for bit
(more rows may sum in another order, within the documented interval: docs/weight_only.md, 'Tolerance of the
GEMM path', tested in tests/test_weight_only_gemm.py)."""

import random

import pytest
import torch
from torch import nn

import lowbit
from lowbit.backends import use_backend
from lowbit.formats.weight_only import EXACT_ROWS

SCHEMES = [name for name, scheme in lowbit.SCHEMES.items() if not scheme.needs_calibration]
K, N = 128, 96
LEADS = [(1,), (2,), (3,), (EXACT_ROWS,), (1, 1), (2, 2), (1, 3), (0,), ()]
KINDS = ["contiguous", "transposed", "strided", "odd offset", "broadcast", "non-finite", "huge", "other dtype"]
ERRORS = (ValueError, TypeError, RuntimeError)


def _layer(scheme: str, dtype: torch.dtype, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(K, N, bias=seed % 2 == 0)).to(dtype)
    lowbit.quantize_(model, scheme)
    return model


def _input(kind: str, lead: tuple, dtype: torch.dtype, rng: random.Random) -> torch.Tensor:
    """x of shape (*lead, K) laid out as ``kind`` says (the values: torch's seeded normal numbers)."""
    x = torch.randn(*lead, K).to(dtype)
    if kind == "transposed" and x.dim() >= 2:
        return x.transpose(0, -1).contiguous().transpose(0, -1)
    if kind == "strided":
        return torch.randn(*lead, 2 * K).to(dtype)[..., ::2]
    if kind == "odd offset":
        flat = torch.empty(x.numel() + 1, dtype=dtype)
        flat[1:] = x.reshape(-1)
        return flat[1:].view(x.shape)
    if kind == "broadcast" and lead:
        return torch.randn(K).to(dtype).expand(*lead, K)
    if kind == "non-finite" and x.numel():
        x.view(-1, K)[rng.randrange(x.numel() // K), rng.randrange(K)] = rng.choice([float("nan"), float("inf"),
                                                                                    float("-inf")])
    if kind == "huge":
        return x * torch.finfo(dtype).max / 8
    if kind == "other dtype":
        return x.to(rng.choice([torch.float32, torch.float16, torch.bfloat16]))
    return x


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_layer_gives_the_reference_bits_or_an_error_for_any_input_layout(scheme, weight_dtype):
    rng = random.Random(f"{scheme} {weight_dtype}")
    model = _layer(scheme, weight_dtype, rng.randrange(1000))
    compared = 0
    for kind in KINDS:
        for lead in rng.sample(LEADS, 4):
            x = _input(kind, lead, weight_dtype, rng)
            try:
                with torch.no_grad():
                    got = model(x)
            except ERRORS:
                with pytest.raises(ERRORS), torch.no_grad(), use_backend("reference"):
                    model(x)  # refused by the reference too: the same contract, not a native shortcoming
                continue
            with torch.no_grad(), use_backend("reference"):
                want = model(x)
            assert got.shape == want.shape and got.dtype == want.dtype, (kind, lead)
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), (kind, lead)
            compared += got.numel() > 0
    assert compared >= len(KINDS)  # most inputs ran (the errors are the exception)
