"""Int4 packing/quantization and the MSD reference (lowbit.formats.int4, lowbit.formats.wqbmm)."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lowbit.errors import DtypeError, ShapeError
from lowbit.formats import wqbmm as ref
from lowbit.formats.int4 import pack_int4, quantize_int4_per_group, unpack_int4
from wqbmm_oracles import float64_matmul_and_bound, sample_golden_m1


def test_unpack_every_byte():
    codes = torch.arange(256, dtype=torch.uint8).reshape(1, 256)
    values = unpack_int4(codes).reshape(256, 2)
    nibble = lambda v: v - 16 if v >= 8 else v
    expected = torch.tensor([[nibble(b & 15), nibble(b >> 4)] for b in range(256)], dtype=torch.int8)
    assert torch.equal(values, expected)
    assert torch.equal(pack_int4(values.reshape(1, 512)), codes)


def test_pack_matches_sample_formula():
    w = np.random.default_rng(0).integers(-8, 8, size=(5, 14)).astype(np.int8)
    u = w.astype(np.uint8)
    sample = (u << 4)[:, 1::2] + (u & 0x0F)[:, 0::2]
    assert np.array_equal(pack_int4(torch.from_numpy(w)).numpy(), sample)


def test_pack_errors():
    with pytest.raises(DtypeError, match="int32"):
        pack_int4(torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ShapeError, match=r"\(2, 3\)"):
        pack_int4(torch.zeros(2, 3, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(torch.full((2, 2), 8, dtype=torch.int8))


@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_per_group_reconstructs(symmetric):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(256, 40, generator=gen)
    w[:64, 3] = 0.0  # an all-zero group: scale 1.0
    packed, scale, offset = quantize_int4_per_group(w, 64, dtype=torch.float16, symmetric=symmetric)
    assert packed.shape == (256, 20) and scale.shape == (4, 40)
    assert (offset is None) == symmetric
    q = unpack_int4(packed).to(torch.float32)
    if offset is not None:
        q = q + offset.to(torch.float32).repeat_interleave(64, 0)
    deq = q * scale.to(torch.float32).repeat_interleave(64, 0)
    step = scale.to(torch.float32).repeat_interleave(64, 0)
    # half a step from rounding; up to a whole step where the symmetric scale divides by 8 and the
    # positive extreme clamps to 7; the FP16 scale adds a relative 2**-11 per step.
    assert bool(((deq - w).abs() <= step * (1 + 8 * 2**-11)).all())
    assert float((deq - w).abs().mean()) < 0.3 * float(step.mean())
    assert scale[0, 3] == 1.0


def test_quantize_symmetric_uses_eight_for_negative_side():
    w = torch.zeros(32, 2)
    w[0, 0], w[1, 0] = -8.0, 3.0  # |min| > |max| -> scale = 8 / 8
    w[0, 1], w[1, 1] = -2.0, 7.0  # |max| wins -> scale = 7 / 7
    packed, scale, _ = quantize_int4_per_group(w, 32)
    assert scale.tolist() == [[1.0, 1.0]]
    assert unpack_int4(packed)[0].tolist() == [-8, -2]


def _sample_inputs(m, k, n, g, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-3, 3, (m, k)).astype(np.float16)
    scale = rng.uniform(-3, 3, (k // g, n)).astype(np.float16)
    w = rng.uniform(-7, 7, (k, n)).astype(np.int8)
    return x, w, scale


@pytest.mark.parametrize("k,n,g", [(256, 64, 128), (512, 96, 64), (1024, 32, 256), (128, 16, 32)])
def test_reference_equals_sample_script_at_m1(k, n, g):
    x, w, scale = _sample_inputs(1, k, n, g, seed=k + n)
    y = ref.wqbmm_msd(torch.from_numpy(x), pack_int4(torch.from_numpy(w)), torch.from_numpy(scale), None, g)
    assert np.array_equal(y.numpy().view(np.int16), sample_golden_m1(x, w, scale, g).view(np.int16))


@given(m=st.integers(2, 64), groups=st.integers(1, 4), g=st.sampled_from([32, 64, 128, 256]),
       n=st.sampled_from([2, 16, 62, 128]), bf16=st.booleans(), seed=st.integers(0, 2**16))
def test_reference_multi_row_against_float64(m, groups, g, n, bf16, seed):
    """Per-row a_max: every row within the MSD truncation bound of the exact float64 product."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-3, 3, (m, groups * g)) * rng.choice([1e-3, 1.0, 10.0], size=(m, 1))  # rows of different size
    w = rng.integers(-8, 8, size=(groups * g, n)).astype(np.int8)
    scale = rng.uniform(-1, 1, (groups, n))
    dtype = torch.bfloat16 if bf16 else torch.float16
    xt, st_ = torch.from_numpy(x).to(dtype), torch.from_numpy(scale).to(dtype)
    y = ref.wqbmm_msd(xt, pack_int4(torch.from_numpy(w)), st_, None, g).to(torch.float64).numpy()
    half_ulp = 2.0**-8 if bf16 else 2.0**-11
    y64, bound = float64_matmul_and_bound(xt.double().numpy(), w, st_.double().numpy(), g, half_ulp)
    assert np.all(np.abs(y - y64) <= bound)


def test_zero_group_contributes_zero_and_nan_row_is_canonical():
    x = torch.ones(3, 64, dtype=torch.float16)
    x[0, :32] = 0  # first group of row 0 all zero
    x[1, 5] = float("nan")
    x[2, 40] = float("inf")
    w = pack_int4(torch.ones(64, 4, dtype=torch.int8))
    scale = torch.ones(2, 4, dtype=torch.float16)
    y = ref.wqbmm_msd(x, w, scale, None, 32)
    row0_only_second_group = ref.wqbmm_msd(x[:1, 32:], w[32:], scale[1:], None, 32)
    assert torch.equal(y[0], row0_only_second_group[0])
    assert torch.isfinite(y[0]).all()
    assert (y[1:].view(torch.int16) == 0x7E00).all()  # canonical NaN rows


def test_offset_means_w_plus_offset():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 64, generator=gen).half()
    w = torch.randint(-8, 8, (64, 6), generator=gen, dtype=torch.int8)
    scale = torch.rand(2, 6, generator=gen).half()
    offset = torch.randint(-3, 4, (2, 6), generator=gen).half()
    deq = ref.dequantize_weight(pack_int4(w), scale, offset, 32).double()
    expected = (w.double() + offset.double().repeat_interleave(32, 0)) * scale.double().repeat_interleave(32, 0)
    assert torch.allclose(deq, expected, rtol=2**-10, atol=0)
    y = ref.wqbmm_msd(x, pack_int4(w), scale, offset, 32).double()
    assert torch.allclose(y, x.double() @ expected, rtol=2e-2, atol=2e-2)
