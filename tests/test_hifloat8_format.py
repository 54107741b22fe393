"""HiFloat8 reference format: worked vectors, exhaustive encode, all 256 codes, FP32 single rounding."""

import hashlib
import math

import numpy as np
import pytest
import torch

import hifloat8_oracle as oracle
from lowbit.formats import hifloat8

# docs/hifloat8.md, "Worked vectors": (FP16 bits, BF16 bits, code, FP16 out bits, BF16 out bits)
WORKED_VECTORS = [
    (0x0000, 0x0000, 0x00, 0x0000, 0x0000), (0x8000, 0x8000, 0x00, 0x0000, 0x0000),
    (0x3C00, 0x3F80, 0x08, 0x3C00, 0x3F80), (0xBC00, 0xBF80, 0x88, 0xBC00, 0xBF80),
    (0x3C40, 0x3F88, 0x09, 0x3C80, 0x3F90), (0x3FC0, 0x3FF8, 0x10, 0x4000, 0x4000),
    (0x3800, 0x3F00, 0x18, 0x3800, 0x3F00), (0x4200, 0x4040, 0x14, 0x4200, 0x4040),
    (0xC280, 0xC050, 0x95, 0xC280, 0xC050), (0x3400, 0x3E80, 0x30, 0x3400, 0x3E80),
    (0x4780, 0x40F0, 0x27, 0x4780, 0x40F0), (0x4BC0, 0x4178, 0x40, 0x4C00, 0x4180),
    (0x2E66, 0x3DCD, 0x52, 0x2E00, 0x3DC0), (0x9419, 0xBA83, 0xF4, 0x9400, 0xBA80),
    (0x4D00, 0x41A0, 0x41, 0x4D00, 0x41A0), (0x4D80, 0x41B0, 0x42, 0x4E00, 0x41C0),
    (0x5640, 0x42C8, 0x4A, 0x5600, 0x42C0), (0x5C00, 0x4380, 0x60, 0x5C00, 0x4380),
    (0x5E00, 0x43C0, 0x61, 0x5E00, 0x43C0), (0x5F00, 0x43E0, 0x62, 0x6000, 0x4400),
    (0x7800, 0x4700, 0x6E, 0x7800, 0x4700), (0x78E2, 0x471C, 0x6E, 0x7800, 0x4700),
    (0x7BFF, 0x4780, 0x6E, 0x7800, 0x4700), (0x0200, 0x3800, 0x7E, 0x0200, 0x3800),
    (0x0300, 0x3840, 0x7F, 0x0300, 0x3840), (0x0100, 0x3780, 0x07, 0x0100, 0x3780),
    (0x0140, 0x37A0, 0x07, 0x0100, 0x3780), (0x0180, 0x37C0, 0x7E, 0x0200, 0x3800),
    (0x01C8, 0x37E4, 0x7E, 0x0200, 0x3800), (0x0014, 0x35A0, 0x03, 0x0010, 0x3580),
    (0x0004, 0x3480, 0x01, 0x0004, 0x3480), (0x0002, 0x3400, 0x01, 0x0004, 0x3480),
    (0x0001, 0x3380, 0x00, 0x0000, 0x0000), (0x7C00, 0x7F80, 0x6F, 0x7C00, 0x7F80),
    (0xFC00, 0xFF80, 0xEF, 0xFC00, 0xFF80), (0x7E00, 0x7FC0, 0x80, 0x7FFF, 0x7FFF),
]

# sha256 of the 65 536 codes (index = input bit pattern) computed by the independent oracle
# (tests/hifloat8_oracle.py); checked in so that a change to the oracle is caught as well.
GOLDEN_SHA256 = {
    (torch.float16, True): "8ea30fbd881e596d7762840345cae9f35752b0fdd74d1d3516f56eb79701dfc7",
    (torch.float16, False): "4e85867f2a96b171c5e3935f544eec7e131d5800b08e053da7b198038f394bf3",
    (torch.bfloat16, True): "0b4ba9138ffb58dbdac79a999e71d3209dbc8cf3d42320e063c9d2d30e92b9ea",
    (torch.bfloat16, False): "bca1768faaec90c66563dedd844a67aa3203a96199637780bc6d22901180d57b",
}


def bits_tensor(patterns, dtype):
    return torch.tensor(patterns, dtype=torch.int32).to(torch.int16).view(dtype)


def all_patterns(dtype):
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("column,dtype", [(0, torch.float16), (1, torch.bfloat16)])
def test_worked_vectors_encode(column, dtype):
    x = bits_tensor([v[column] for v in WORKED_VECTORS], dtype)
    expected = torch.tensor([v[2] for v in WORKED_VECTORS], dtype=torch.uint8)
    assert torch.equal(hifloat8.encode(x), expected)


@pytest.mark.parametrize("column,dtype", [(3, torch.float16), (4, torch.bfloat16)])
def test_worked_vectors_decode(column, dtype):
    codes = torch.tensor([v[2] for v in WORKED_VECTORS], dtype=torch.uint8)
    expected = bits_tensor([v[column] for v in WORKED_VECTORS], dtype).view(torch.int16)
    assert torch.equal(hifloat8.decode(codes, dtype).view(torch.int16), expected)


def test_fp32_is_rounded_once():
    x = torch.tensor([1.0624999], dtype=torch.float32)
    assert hifloat8.encode(x).item() == 0x08  # direct: below the 1.0625 tie -> 1.0
    assert hifloat8.encode(x, amct_compat=True).item() == 0x09  # via BF16 1.0625 -> tie away -> 1.125


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("saturate", [True, False])
def test_every_bit_pattern_matches_the_golden(dtype, saturate):
    x = all_patterns(dtype)
    codes = hifloat8.encode(x, saturate=saturate).numpy()
    golden = oracle.encode(x.to(torch.float64).numpy(), saturate)
    assert hashlib.sha256(golden.tobytes()).hexdigest() == GOLDEN_SHA256[(dtype, saturate)]
    np.testing.assert_array_equal(codes, golden)


@pytest.mark.parametrize("dtype,count", [(torch.float16, 1536), (torch.bfloat16, 28864)])
def test_non_saturating_differs_only_at_40960_and_above(dtype, count):
    x = all_patterns(dtype)
    differs = hifloat8.encode(x) != hifloat8.encode(x, saturate=False)
    assert int(differs.sum()) == count  # docs/hifloat8.md, "Options of the reference encoder"
    assert bool((x[differs].float().abs() >= 40960).all())
    assert set(hifloat8.encode(x[differs], saturate=False).tolist()) == {0x6F, 0xEF}


def test_fp32_encoding_agrees_with_the_oracle_on_random_values():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=g) * torch.exp2(torch.randint(-30, 20, (200_000,), generator=g).float())
    # float64 midpoints of the grid are exact, and FP32 values are exact in float64
    np.testing.assert_array_equal(hifloat8.encode(x).numpy(), oracle.encode(x.double().numpy()))


def test_all_256_codes_decode_to_the_class_table():
    for dtype in hifloat8.DECODE_DTYPES:
        decoded = hifloat8.decode(torch.arange(256, dtype=torch.uint8), dtype).double()
        for code in range(256):
            expected = oracle.class_table_value(code)
            got = decoded[code].item()
            assert (math.isnan(got) and math.isnan(expected)) or got == expected, (dtype, hex(code))
        assert int(decoded.isnan().sum()) == 1


def test_value_set_properties():
    positive = [hifloat8.code_value(c) for c in range(0x80) if c not in (0x00, 0x6F)]
    assert len(set(positive)) == 126
    assert min(positive) == 2.0**-22 and max(positive) == hifloat8.MAX_VALUE == 2.0**15


@pytest.mark.parametrize("dtype", hifloat8.DECODE_DTYPES)
def test_encode_of_decode_is_identity(dtype):
    codes = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(hifloat8.encode(hifloat8.decode(codes, dtype)), codes)


def test_nan_and_fp16_subnormal_bit_patterns():
    codes = torch.tensor([0x80, 0x01, 0x07, 0x7E, 0x7F], dtype=torch.uint8)
    fp16 = hifloat8.decode(codes, torch.float16).view(torch.int16).tolist()
    assert fp16 == [0x7FFF, 0x0004, 0x0100, 0x0200, 0x0300]
    assert hifloat8.decode(codes[:1], torch.bfloat16).view(torch.int16).item() == 0x7FFF
    assert hifloat8.decode(codes[:1], torch.float32).view(torch.int32).item() == 0x7FFFFFFF


def test_code_table_and_errors():
    table = hifloat8.code_table()
    assert len(table) == 256 and table[0x6E] == (0x6E, 32768.0)
    with pytest.raises(ValueError, match="256"):
        hifloat8.code_value(256)
    with pytest.raises(TypeError, match="int32"):
        hifloat8.encode(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="float32"):
        hifloat8.decode(torch.zeros(3, dtype=torch.float32))
    with pytest.raises(TypeError, match="float64"):
        hifloat8.decode_table(torch.float64)
