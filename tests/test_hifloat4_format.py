"""HiFloat4 reference (lowbit.formats.hifloat4): the worked blocks of docs/hifloat4.md, an independent
oracle, byte layout, round trips, block isolation, clamps, signed zeros and error contracts."""

import math

import numpy as np
import pytest
import torch

from helpers import FLOAT_DTYPES
from hypothesis import given
from hypothesis import strategies as st

from lowbit.dtypes import bit_view as bits
from lowbit.errors import DeviceError, DtypeError, ShapeError
from lowbit.formats import hifloat4

import hifloat4_oracle as oracle

DTYPES = FLOAT_DTYPES


# --- worked blocks (docs/hifloat4.md, section 'Worked blocks'), ground truth -----------------------------------------------------

WORKED_SCALE_BYTES = [
    [0xB9, 0xFF, 0xFF, 0xFF],  # all 2.0
    [0xCC, 0x0F, 0x0F, 0xFF],  # x_i = i
    [0xB5, 0x80, 0x80, 0x00],  # [1, 0...]
    [0xC2, 0xA0, 0x88, 0x00],  # mixed
    [0xF7, 0x80, 0x80, 0x00],  # [1e5, -2e4, 3, 0...]
    [0x00, 0x00, 0x00, 0x00],  # [1e-20, 0...]
    [0x00, 0x00, 0x00, 0x00],  # zeros
    [0xFF, 0xFF, 0xFF, 0xFF],  # ones with x_3 = NaN
]


def test_worked_blocks_scale_bytes():
    scale, _ = hifloat4.pack(hifloat4.worked_blocks())
    assert scale.shape == (8, 1, 4)
    assert scale[:, 0].tolist() == WORKED_SCALE_BYTES


def test_worked_blocks_outputs_and_value_bytes():
    blocks = hifloat4.worked_blocks()
    out = hifloat4.fake_quant(blocks)
    _, value = hifloat4.pack(blocks)
    assert out[0].eq(1.875).all() and value[0].eq(0x66).all()
    # 0, 2, 2, 4, 4, 6, 6, 8, ..., last 56 (x = 1 -> 2: the tie 0.125 -> code 1, rounded half up)
    assert out[1].tolist()[:8] == [0, 2, 2, 4, 4, 6, 6, 8] and out[1, 63].item() == 56.0
    assert torch.equal(out[1], torch.tensor(oracle.fake_quant_block(blocks[1].tolist()), dtype=torch.float32))
    assert out[2, 0].item() == 0.9375 and out[2, 1:].eq(0).all()
    mixed = [10.5, -3, 0, 0] + [0.75] * 4 + [0.375] * 8 + [-6.0] + [0.0] * 47
    assert out[3].tolist() == mixed
    assert value[3, :9].tolist() == [0xA7, 0x00, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0C]
    assert out[4, :3].tolist() == [100352.0, -14336.0, 0.0] and out[4, 3:].eq(0).all()
    assert out[5].eq(0).all() and out[6].eq(0).all()
    assert out[7].isnan().all()


def test_worked_block_intermediates():
    """bf16(M c7), sf and r of the worked blocks, through the oracle's arithmetic (the table's columns)."""
    for block, sf0, r in [(hifloat4.worked_blocks()[0], 0.28515625, 3.203125),
                          (hifloat4.worked_blocks()[1], 9.0, 0.125),
                          (hifloat4.worked_blocks()[3], 1.421875, 0.66796875)]:
        m = float(block.abs().max())
        assert float(oracle.bf16(np.float32(m) * np.float32(hifloat4.C7))) == sf0
        byte = hifloat4.pack(block[None])[0][0, 0, 0]
        sf = hifloat4.scale_value(byte.to(torch.int32))
        assert float(oracle.bf16(np.float32(1.0) / np.float32(sf.item()))) == r


# --- the reference against the independent oracle ------------------------------------------------------

def block_strategy():
    """A 64-block: heavy-tailed values at a drawn scale, with drawn zeros, specials and ties."""
    specials = st.sampled_from([0.0, -0.0, math.nan, math.inf, -math.inf])
    value = st.one_of(
        st.floats(-4, 4, width=32),
        st.floats(-2.0**100, 2.0**100, width=32),
        st.sampled_from([0.125, 0.375, 0.625, 1.875, 13.3, 7.0, 2.0**-48, 1.5 * 2**15, 65504.0]),
    )
    return st.tuples(
        st.lists(value, min_size=64, max_size=64),
        st.integers(-40, 40),
        st.lists(st.tuples(st.integers(0, 63), specials), max_size=3),
    )


@given(block_strategy())
def test_reference_equals_oracle_on_drawn_blocks(drawn):
    values, exponent, specials = drawn
    x = torch.tensor(values, dtype=torch.float32) * 2.0**exponent
    for index, special in specials:
        x[index] = special
    x = x.to(torch.float32)
    byte, e2, e3, codes, negative = oracle.quantize_block(x.tolist())
    scale, value = hifloat4.pack(x[None])
    assert scale[0, 0, 0].item() == byte
    assert scale[0, 0, 1].item() == int("".join(map(str, e2)), 2)
    assert scale[0, 0, 2].item() * 256 + scale[0, 0, 3].item() == int("".join(map(str, e3)), 2)
    nibbles = [(v >> s) & 0xF for v in value[0].tolist() for s in (0, 4)]
    assert nibbles == [c | (8 if n else 0) for c, n in zip(codes, negative)]
    expected = torch.tensor(oracle.fake_quant_block(x.tolist()), dtype=torch.float32)
    out = hifloat4.fake_quant(x)
    if byte == 0xFF:
        assert bits(out).eq(hifloat4.NAN_BITS[torch.float32]).all()
    else:
        assert torch.equal(bits(out), bits(expected))


def test_scale_carry_q8():
    """Block max 13.3: bf16(13.3 c7) = 1.8984375 rounds to q = 8, i.e. the next binade."""
    x = torch.zeros(64)
    x[0] = 13.3
    scale, _ = hifloat4.pack(x[None])
    assert scale[0, 0, 0].item() == (1 + 48) * 4  # sf = 2.0
    assert hifloat4.scale_value(scale[0, 0, 0].to(torch.int32)).item() == 2.0


def test_scale_byte_table():
    """E6M2 bytes 0x00..0xFE decode to 2^(b>>2 - 48) (1 + (b&3)/4); the extremes are 2^-48 and 49152."""
    b = torch.arange(255, dtype=torch.int32)
    expected = torch.tensor([2.0 ** ((i >> 2) - 48) * (1 + (i & 3) / 4) for i in range(255)], dtype=torch.float64)
    assert torch.equal(hifloat4.scale_value(b).double(), expected)
    assert hifloat4.scale_value(torch.tensor(0)).item() == hifloat4.SCALE_MIN
    assert hifloat4.scale_value(torch.tensor(0xFE)).item() == hifloat4.SCALE_MAX


def test_clamps_tiny_and_huge_blocks():
    tiny = torch.full((1, 64), 1e-30)
    huge = torch.full((1, 64), 1e30)
    assert hifloat4.pack(tiny)[0][0, 0, 0].item() == 0x00
    assert hifloat4.fake_quant(tiny).eq(0).all()
    assert hifloat4.pack(huge)[0][0, 0, 0].item() == 0xFE
    assert hifloat4.fake_quant(huge).eq(hifloat4.MAX_VALUE).all()  # 1.75 * 4 * 49152


# --- contracts -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_poisoned_blocks_are_nan_and_isolated(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 256, generator=g) * 100).to(dtype)
    clean = hifloat4.fake_quant(x)
    x[0, 70] = float("nan")
    x[2, 255] = float("-inf")
    x[1, 0] = float("inf")
    out = hifloat4.fake_quant(x)
    poisoned = torch.zeros(3, 4, dtype=torch.bool)
    poisoned[0, 1] = poisoned[2, 3] = poisoned[1, 0] = True
    mask = poisoned.repeat_interleave(64, dim=1)
    assert bits(out)[mask].eq(hifloat4.NAN_BITS[dtype]).all()
    assert torch.equal(bits(out)[~mask], bits(clean)[~mask])


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_blocks_give_zeros(dtype):
    out = hifloat4.fake_quant(torch.zeros(2, 128, dtype=dtype))
    assert bits(out).eq(0).all()


def test_signed_zero_choice():
    """-0.0 in -> +0.0 out (AMCT's reference); a negative value that rounds to zero -> -0.0."""
    x = torch.ones(1, 64)
    x[0, 0] = -0.0
    x[0, 1] = -1e-6
    out = hifloat4.fake_quant(x)
    assert bits(out)[0, 0].item() == 0
    assert bits(out)[0, 1].item() == -(2**31)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unpack_of_pack_is_fake_quant(dtype):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(5, 192, generator=g) * torch.exp2(torch.randn(5, 1, generator=g) * 8)).to(dtype)
    x[1, :64] = 0
    x[2, 100] = float("nan")
    x[3, 0] = -0.0
    scale, value = hifloat4.pack(x)
    assert scale.dtype == value.dtype == torch.uint8
    assert scale.shape == (5, 3, 4) and value.shape == (5, 96)
    assert torch.equal(bits(hifloat4.unpack(scale, value, dtype)), bits(hifloat4.fake_quant(x)))
    from_numpy = hifloat4.unpack(scale.numpy(), value.numpy(), dtype)
    assert torch.equal(bits(from_numpy), bits(hifloat4.fake_quant(x)))


def test_fp16_near_max_stays_finite():
    x = torch.full((1, 64), 65504.0, dtype=torch.float16)
    x[0, 1::2] = -61440.0
    out = hifloat4.fake_quant(x)
    assert torch.isfinite(out).all() and out.abs().max().item() <= 61440


@pytest.mark.parametrize("qdim", [0, 1, 2, -1, -2, -3])
def test_qdim_equals_moving_the_dim_last(qdim):
    g = torch.Generator().manual_seed(5)
    shape = [3, 5, 7]
    shape[qdim] = 128
    x = torch.randn(shape, generator=g).to(torch.bfloat16)
    moved = hifloat4.fake_quant(x.movedim(qdim, -1).contiguous(), -1).movedim(-1, qdim)
    out = hifloat4.fake_quant(x, qdim)
    assert out.is_contiguous() and out.shape == x.shape and out.dtype == x.dtype
    assert torch.equal(bits(out), bits(moved.contiguous()))


def test_errors():
    with pytest.raises(RuntimeError, match="multiple of 64, got 65"):
        hifloat4.fake_quant(torch.ones(2, 65))
    with pytest.raises(ShapeError, match="got 0"):
        hifloat4.fake_quant(torch.ones(0, 2), 0)
    with pytest.raises(RuntimeError, match="out of range"):
        hifloat4.fake_quant(torch.ones(2, 64), 2)
    with pytest.raises(RuntimeError, match="out of range"):
        hifloat4.fake_quant(torch.ones(2, 64), -3)
    for qdim in (1.0, True, np.bool_(True), "1", None):  # bools are ints to Python, not to us
        with pytest.raises(TypeError, match="qdim"):
            hifloat4.fake_quant(torch.ones(2, 64), qdim)
    assert hifloat4.fake_quant(torch.ones(2, 64), np.int64(1)).shape == (2, 64)
    with pytest.raises(RuntimeError, match="0-d"):
        hifloat4.fake_quant(torch.tensor(1.0))
    for dtype in (torch.float64, torch.int32):
        with pytest.raises(TypeError, match=str(dtype)):
            hifloat4.fake_quant(torch.ones(64, dtype=dtype))
    with pytest.raises(RuntimeError, match="2-D"):
        hifloat4.pack(torch.ones(64))
    with pytest.raises(RuntimeError, match="multiple of 64"):
        hifloat4.pack(torch.ones(2, 96))
    scale, value = hifloat4.pack(torch.ones(2, 128))
    with pytest.raises(DtypeError, match="int8"):
        hifloat4.unpack(scale.to(torch.int8), value)
    with pytest.raises(ShapeError, match=r"\(2, 2, 4\)"):
        hifloat4.unpack(scale, value[:, :32])
    with pytest.raises(DtypeError, match="float64"):
        hifloat4.unpack(scale, value, torch.float64)
    with pytest.raises(DeviceError, match="meta"):
        hifloat4.unpack(scale, value.to("meta"))


def test_empty_non_quant_dims():
    out = hifloat4.fake_quant(torch.ones(0, 64))
    assert out.shape == (0, 64)
