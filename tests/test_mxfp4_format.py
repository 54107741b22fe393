"""MXFP4 reference (lowbit.formats.mxfp4): worked vectors, an independent oracle, ties, layouts, policies."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lowbit.errors import DtypeError, ShapeError
from lowbit.formats import mxfp4
from mxfp4_oracle import oracle_quantize

WORKED = [4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, 0.2, 5.9, -0.0] + [0.0] * 20
RULE_ROUNDING = [(r, m) for r in mxfp4.SCALE_RULES for m in mxfp4.ROUNDINGS]


# --- worked vectors (docs/mxfp4.md, section 'Worked vectors') ------------------------------------------------------------

@pytest.mark.parametrize("dtype", mxfp4.INPUT_DTYPES)
def test_worked_vector_bytes_and_dequant(dtype):
    codes, scales = mxfp4.quantize(torch.tensor([WORKED], dtype=dtype))
    assert codes[0].tolist() == [0x16, 0x32, 0x54, 0x76, 0x09, 0x87] + [0] * 10
    assert scales.tolist() == [[0x7F]]
    packed = mxfp4.to_fbgemm_layout(codes, scales)
    assert packed[0].tolist() == [0x16, 0x32, 0x54, 0x76, 0x09, 0x87] + [0] * 10 + [0x7F]
    deq = mxfp4.dequantize(codes, scales, torch.float32)[0].tolist()
    assert deq[:12] == [4, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, 0, 6, -0.0]
    assert math.copysign(1, deq[11]) == -1 and deq[12:] == [0.0] * 20


def test_worked_vector_with_rne_elements():
    codes, scales = mxfp4.quantize(torch.tensor([WORKED]), rounding="rne")
    deq = mxfp4.dequantize(codes, scales, torch.float32)[0, :12].tolist()
    assert deq == [4, 0, 1, 1, 2, 2, 4, 4, -0.0, 0, 6, -0.0]


@pytest.mark.parametrize(
    "group, rules, byte, first_two",
    [
        ([5.0] + [0.3] * 31, ("nearest", "floor", "even"), 127, [6.0, 0.5]),
        ([5.0] + [0.3] * 31, ("ceil",), 128, [6.0, 0.0]),
        ([7.5] + [1.0] * 31, ("floor",), 127, [6.0, 1.0]),
        ([7.5] + [1.0] * 31, ("nearest", "even", "ceil"), 128, [8.0, 1.0]),
    ],
)
def test_scale_mode_comparison_vectors(group, rules, byte, first_two):
    for rule in rules:
        codes, scales = mxfp4.quantize(torch.tensor([group]), scale_rule=rule)
        assert scales.item() == byte, rule
        assert mxfp4.dequantize(codes, scales, torch.float32)[0, :2].tolist() == first_two, rule


def test_layout_shapes_and_fbgemm_round_trip():
    codes, scales = mxfp4.quantize(torch.randn(1, 64))
    assert codes.shape == (1, 32) and scales.shape == (1, 2)
    assert mxfp4.to_fbgemm_layout(codes, scales).shape == (1, 34)
    codes, scales = mxfp4.quantize(torch.randn(2, 3, 128), block_size=64)
    packed = mxfp4.to_fbgemm_layout(codes, scales)
    assert packed.shape == (2, 3, 66)
    back = mxfp4.from_fbgemm_layout(packed, block_size=64)
    assert torch.equal(back[0], codes) and torch.equal(back[1], scales)


def test_torch_fp4_and_e8m0_views_round_trip():
    x = torch.randn(4, 64) * 1000
    codes, scales = mxfp4.quantize(x)
    fp4, e8m0 = mxfp4.as_torch_fp4(codes), mxfp4.as_torch_e8m0(scales)
    assert fp4.dtype == torch.float4_e2m1fn_x2 and e8m0.dtype == torch.float8_e8m0fnu
    assert torch.equal(fp4.view(torch.uint8), codes)
    # torch decodes e8m0 bytes exactly (2^(b-127), 0xFF NaN); our bytes mean the same values
    all_bytes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    decoded = mxfp4.as_torch_e8m0(all_bytes).float()
    assert torch.equal(decoded[:255], torch.exp2(all_bytes[:255].float() - 127)) and decoded[255].isnan()
    assert torch.equal(mxfp4.dequantize(fp4, e8m0), mxfp4.dequantize(codes, scales))


def test_scale_bytes_are_not_torch_e8m0_casts():
    # torch's fp32 -> e8m0 cast rounds up (3.0 -> 4.0): the library must build bytes from exponents
    assert torch.tensor([3.0]).to(torch.float8_e8m0fnu).view(torch.uint8).item() == 129  # 4.0 = 2^2
    codes, scales = mxfp4.quantize(torch.tensor([[12.0] + [0.0] * 31]))  # amax 12 -> floor(log2) 3 -> 1
    assert scales.item() == 128 and mxfp4.dequantize(codes, scales, torch.float32)[0, 0] == 12.0


def test_torch_npu_scale_pairs_layout():
    x = torch.randn(3, 96)  # 3 blocks per row: odd, so the last pair is padded with byte 0
    codes, pairs = mxfp4.dynamic_mx_quant(x)
    _, scales = mxfp4.quantize(x)
    assert codes.shape == (3, 48) and pairs.shape == (3, 2, 2)
    assert torch.equal(pairs[:, 0], scales[:, :2]) and torch.equal(pairs[:, 1, 0], scales[:, 2])
    assert pairs[:, 1, 1].eq(0).all()
    assert torch.equal(mxfp4.scales_from_pairs(pairs, 3), scales)
    rne_codes, _ = mxfp4.dynamic_mx_quant(torch.tensor([WORKED]), round_mode="rint")
    assert torch.equal(rne_codes, mxfp4.quantize(torch.tensor([WORKED]), rounding="rne")[0])


# --- policies ------------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", mxfp4.SCALE_RULES)
def test_zero_and_nonfinite_blocks(rule):
    x = torch.zeros(4, 32)
    x[1, 0] = -0.0
    x[2, 5] = float("nan")
    x[3, 7] = float("-inf")
    x[2, 6] = x[3, 8] = 3.0
    codes, scales = mxfp4.quantize(x, scale_rule=rule)
    assert scales[:, 0].tolist() == [0, 0, 0xFF, 0xFF]
    assert codes[2].eq(0).all() and codes[3].eq(0).all()
    deq = mxfp4.dequantize(codes, scales, torch.float32)
    assert deq[:2].eq(0).all() and deq[2:].isnan().all()


def test_saturation_and_extreme_exponents():
    big = torch.tensor([[torch.finfo(torch.float32).max] + [1.0] * 31])
    for rule in mxfp4.SCALE_RULES:
        codes, scales = mxfp4.quantize(big, scale_rule=rule)
        if rule == "rceil":  # 2^126 * 4: rceil never saturates
            assert scales.item() == 253 and codes[0, 0] & 0x7 == 6
        else:  # shared exponent clamped to 125: 2^125 * 6 (saturated)
            assert scales.item() == 252 and codes[0, 0] & 0x7 == 7
    tiny = torch.tensor([[2.0**-149] * 32])  # fp32 subnormal amax: below every clamp
    for rule in mxfp4.SCALE_RULES:
        assert mxfp4.quantize(tiny, scale_rule=rule)[1].item() == 0


def test_dequantize_fp16_overflow_and_fp64():
    codes = torch.tensor([[0x77] * 16], dtype=torch.uint8)  # 6.0 everywhere
    scales = torch.tensor([[200]], dtype=torch.uint8)
    assert mxfp4.dequantize(codes, scales, torch.float16).isinf().all()
    assert mxfp4.dequantize(codes, scales, torch.float64)[0, 0].item() == 6.0 * 2.0**73


# --- the reference against the independent oracle -------------------------------------------------

def _tie_block(scale_exp: int) -> list[float]:
    """Midpoints (exact ties) and their neighbours at scale 2^scale_exp, anchored by amax 4 * 2^e."""
    s = 2.0**scale_exp
    values = [4.0 * s]
    for m in mxfp4.E2M1_MIDPOINTS:
        values += [m * s, -m * s, math.nextafter(m * s, 0.0), math.nextafter(m * s, math.inf)]
    return (values + [0.0] * 32)[:32]


@pytest.mark.parametrize("rule, rounding", RULE_ROUNDING)
def test_ties_and_neighbours_match_oracle(rule, rounding):
    rows = [_tie_block(e) for e in (-130, -20, 0, 7, 100)]
    x = torch.tensor(rows, dtype=torch.float64).to(torch.float32)
    codes, scales = mxfp4.quantize(x, 32, rule, rounding)
    want_codes, want_scales = oracle_quantize(x, 32, rule, rounding)
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)


@pytest.mark.parametrize("rounding", mxfp4.ROUNDINGS)
def test_every_bf16_magnitude_at_unit_scale_matches_oracle(rounding):
    """Exhaustive element rounding: every BF16 value in [-4, 4] in blocks anchored by 4.0 (scale 1)."""
    patterns = torch.arange(0, 0x4081, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # 0 .. 4.0
    values = torch.cat([patterns, -patterns]).float()
    values = torch.cat([values, torch.zeros((-len(values)) % 31)]).reshape(-1, 31)
    x = torch.cat([torch.full((values.shape[0], 1), 4.0), values], dim=1).to(torch.bfloat16)
    codes, scales = mxfp4.quantize(x, rounding=rounding)
    assert scales.eq(127).all()
    want_codes, want_scales = oracle_quantize(x, 32, "floor", rounding)
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)


float_blocks = st.lists(
    st.tuples(st.integers(-140, 127), st.floats(-1.0, 1.0, allow_nan=False, width=32)),
    min_size=32, max_size=32,
)


@pytest.mark.parametrize("dtype", mxfp4.INPUT_DTYPES)
@given(data=st.data())
def test_random_blocks_match_oracle(dtype, data):
    rule = data.draw(st.sampled_from(mxfp4.SCALE_RULES))
    rounding = data.draw(st.sampled_from(mxfp4.ROUNDINGS))
    spread = data.draw(st.integers(0, 40))
    top = data.draw(st.integers(-140, 127))
    pairs = data.draw(float_blocks)
    vals = [m * 2.0 ** max(min(top - (e % (spread + 1)), 127), -149) for e, m in pairs]
    x = torch.tensor([vals], dtype=torch.float64).to(dtype)
    codes, scales = mxfp4.quantize(x, 32, rule, rounding)
    want_codes, want_scales = oracle_quantize(x, 32, rule, rounding)
    assert torch.equal(scales, want_scales) and torch.equal(codes, want_codes)


# --- shapes, axes and errors ---------------------------------------------------------------------

def test_axis_and_block_size():
    x = torch.randn(64, 3, 5)
    codes, scales = mxfp4.quantize(x, block_size=16, axis=0)
    assert codes.shape == (32, 3, 5) and scales.shape == (4, 3, 5)
    moved = mxfp4.quantize(x.movedim(0, -1), block_size=16)
    assert torch.equal(codes, moved[0].movedim(-1, 0)) and torch.equal(scales, moved[1].movedim(-1, 0))
    assert torch.equal(mxfp4.dequantize(codes, scales, axis=0), mxfp4.dequantize(*moved).movedim(-1, 0))


def test_empty_inputs():
    codes, scales = mxfp4.quantize(torch.zeros(0, 64))
    assert codes.shape == (0, 32) and scales.shape == (0, 2)
    assert mxfp4.dequantize(codes, scales).shape == (0, 64)


def test_errors():
    with pytest.raises(DtypeError, match="float64"):
        mxfp4.quantize(torch.zeros(32, dtype=torch.float64))
    with pytest.raises(ShapeError, match="not a multiple of block_size 32"):
        mxfp4.quantize(torch.zeros(2, 40))
    with pytest.raises(ShapeError, match="0-d"):
        mxfp4.quantize(torch.tensor(1.0))
    with pytest.raises(ValueError, match="scale_rule"):
        mxfp4.quantize(torch.zeros(32), scale_rule="stochastic")
    with pytest.raises(ValueError, match="rounding"):
        mxfp4.quantize(torch.zeros(32), rounding="floor")
    with pytest.raises(ShapeError, match="block_size"):
        mxfp4.quantize(torch.zeros(33), block_size=33)
    with pytest.raises(TypeError, match="block_size"):
        mxfp4.quantize(torch.zeros(32), block_size=32.0)
    with pytest.raises(ShapeError, match="block_size"):
        mxfp4.from_fbgemm_layout(torch.zeros(17, dtype=torch.uint8), block_size=31)
    with pytest.raises(ShapeError, match="axis 2"):
        mxfp4.quantize(torch.zeros(32), axis=2)
    with pytest.raises(ShapeError, match="do not fit"):
        mxfp4.dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ShapeError, match="do not fit"):  # no elements but 5 blocks of scales
        mxfp4.dequantize(torch.zeros(4, 0, dtype=torch.uint8), torch.zeros(4, 5, dtype=torch.uint8))
    with pytest.raises(DtypeError, match="int32"):
        mxfp4.dequantize(torch.zeros(2, 16, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(DtypeError, match="int8"):
        mxfp4.dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8), torch.int8)
    with pytest.raises(ValueError, match="round_mode"):
        mxfp4.dynamic_mx_quant(torch.zeros(32), round_mode="floor")
    with pytest.raises(ShapeError, match="block_size"):
        mxfp4.dynamic_mx_quant(torch.zeros(64), block_size=64)
    with pytest.raises(DtypeError, match="scales must be uint8"):
        mxfp4.dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1))
