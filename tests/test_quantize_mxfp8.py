"""MXFP8 reference (lowbit.formats.mxfp8) against a brute-force scalar oracle; HiF8 element helpers."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbit.errors import DtypeError, ShapeError
from lowbit.formats import mxfp8

# All finite non-negative E4M3FN values by code (0x00..0x7E; 0x7F is NaN), from the bit layout:
# exponent field e (bias 7), mantissa m (3 bits); e == 0 is subnormal.
E4M3_VALUES = [(m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7) for e in range(16) for m in range(8)][:127]


def oracle_element(v: float) -> float:
    """Nearest E4M3FN value, ties to the even code, saturating at 448."""
    mag = min(abs(v), 448.0)
    best = min(range(127), key=lambda c: (abs(E4M3_VALUES[c] - mag), c % 2))
    return math.copysign(E4M3_VALUES[best], v)


def oracle_block(block: list[float]) -> tuple[int, list[float]]:
    amax = max(abs(v) for v in block)
    if amax == 0:
        return 0, [0.0] * len(block)
    shared = max(-127, min(127, math.frexp(amax)[1] - 1 - 8))
    return shared + 127, [oracle_element(v / 2.0**shared) * 2.0**shared for v in block]


finite = st.floats(-1e6, 1e6, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(st.lists(finite, min_size=64, max_size=64), st.integers(-30, 30))
def test_quantize_matches_the_oracle(values, shift):
    x = torch.tensor(values, dtype=torch.float32).reshape(2, 32) * 2.0**shift
    codes, scales = mxfp8.quantize(x)
    y = mxfp8.dequantize(codes, scales, torch.float32)
    for row in range(2):
        byte, expected = oracle_block(x[row].tolist())
        assert scales[row].item() == byte
        assert y[row].tolist() == expected


def test_special_blocks_and_dtypes():
    x = torch.zeros(3, 32)
    x[1, 3] = float("nan")
    x[2, :] = 1.0
    codes, scales = mxfp8.quantize(x)
    assert scales.tolist() == [[0], [0xFF], [127 - 8]]
    y = mxfp8.dequantize(codes, scales, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and torch.isnan(y[1]).all() and (y[2] == 1).all() and (y[0] == 0).all()
    with pytest.raises(DtypeError, match="int32"):
        mxfp8.quantize(torch.zeros(32, dtype=torch.int32))
    with pytest.raises(ShapeError, match=r"\(2, 31\)"):
        mxfp8.quantize(torch.zeros(2, 31))
    with pytest.raises(ShapeError, match="do not match"):
        mxfp8.dequantize(codes, scales[:, :0])


def test_saturation_instead_of_torch_nan():
    codes = mxfp8.e4m3_codes(torch.tensor([464.0, 1e9, -1e9, 447.0]))
    assert mxfp8.e4m3_values(codes).tolist() == [448.0, 448.0, -448.0, 448.0]
