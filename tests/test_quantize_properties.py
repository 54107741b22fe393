"""Property tests (hypothesis): scale rules against scalar oracles, deploy equal to fake quant, devices."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lowbit
from lowbit.formats import weight_only
from lowbit.quantize import algorithms as alg
from lowbit.quantize.weight_formats import WEIGHT_FORMATS

finite = st.floats(-1e4, 1e4, allow_nan=False, width=32)


def oracle_int_scale(vmax: float, vmin: float, bits: int, symmetric: bool):
    """AMCT's integer scale/offset for one channel, in Python floats (then float32)."""
    f32 = lambda v: float(torch.tensor(v, dtype=torch.float32))  # noqa: E731
    if symmetric:
        scope = 2 ** (bits - 1) - 1 + (1 if abs(vmax) < abs(vmin) else 0)
        s = f32(f32(max(abs(vmax), abs(vmin))) / scope)
        return (1.0 if s < alg.FLT_EPSILON else s), None
    levels = 2**bits - 1
    hi, lo = max(vmax, 0.0), min(vmin, 0.0)
    s = f32(f32(hi - lo) / levels)
    if s < alg.FLT_EPSILON:
        return 1.0, -(2 ** (bits - 1))
    o = -math.ceil(levels / 2) - f32(lo / s)
    return s, int(torch.round(torch.tensor(o, dtype=torch.float32)))


@settings(max_examples=200, deadline=None)
@given(finite, finite, st.sampled_from([("int8", 8), ("int4", 4)]), st.booleans())
def test_integer_scale_matches_the_oracle(a, b, dtype_bits, symmetric):
    vmax, vmin = max(a, b), min(a, b)
    name, bits = dtype_bits
    scale, offset = alg.calculate_scale_offset(torch.tensor([vmax]), torch.tensor([vmin]), symmetric, name)
    want_scale, want_offset = oracle_int_scale(vmax, vmin, bits, symmetric)
    assert scale.item() == pytest.approx(want_scale, rel=1e-6)
    if symmetric:
        assert offset is None
    else:
        assert abs(offset.item() - want_offset) <= 1  # float32 rounding of lo / s may move a tie


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=1, max_size=8),
       st.sampled_from(["hifloat8", "float8_e4m3fn", "int8", "int4"]))
def test_scales_are_always_finite_and_positive(values, dtype_name):
    v = torch.tensor(values)
    scale, _ = alg.calculate_scale_offset(v.max().reshape(1), v.min().reshape(1), True, dtype_name)
    assert torch.isfinite(scale).all() and (scale > 0).all() and torch.isfinite(1 / scale).all()


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(0, 2**31 - 1),
       st.sampled_from(["hif8-wo", "fp8-wo", "hif8-cast", "mxfp8-w8a8", "mxfp4-w4a4", "hif4-wo"]),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_deploy_equals_fake_quant(n_blocks, rows, seed, scheme, dtype):
    g = torch.Generator().manual_seed(seed)
    k, n = 64 * n_blocks, 8 * rows
    model = nn.Sequential(nn.Linear(k, n).to(dtype))
    with torch.no_grad():
        model[0].weight.copy_(torch.randn(n, k, generator=g) * 10.0 ** torch.randint(-3, 3, (n, 1), generator=g))
    x = torch.randn(5, k, generator=g).to(dtype)
    lowbit.quantize(model, scheme)
    fake = model(x)
    lowbit.convert(model)
    deployed = model(x)
    layer = model[0]
    if layer.fused_kernel(x.dtype) is None:
        assert torch.equal(deployed, fake)
        return
    # The fused kernel sums the same products in another order: both results meet the weight-only contract
    # against the reference sum of the same quantized activations and weight (docs/weight_only.md).
    x_q, w32 = layer.quantize_input(x), layer.dequantized_weight().float()
    want = weight_only.linear(x_q, w32, layer.bias)
    for got in (deployed, fake):
        assert weight_only.meets_contract(got, want, x_q, w32, layer.bias)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(["hifloat8", "float8_e4m3fn", "int8"]))
def test_decode_of_encode_is_the_fake_quant_formula(seed, fmt):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(4, 32, generator=g) * 100
    scale = w.abs().amax(dim=1) / {"hifloat8": 16, "float8_e4m3fn": 448, "int8": 127}[fmt]
    f = WEIGHT_FORMATS[fmt]
    dq = f.decode(f.encode(w, scale, None, None, torch.float32), torch.float32, None)
    u = w / scale[:, None]
    if fmt == "int8":
        q = torch.clamp(torch.round(u), -128, 127)
    elif fmt == "float8_e4m3fn":
        q = u.to(torch.float8_e4m3fn).float()
    else:
        from lowbit.formats import hifloat8
        q = hifloat8.decode(hifloat8.encode(u), torch.float32)
    assert torch.equal(dq, q * scale[:, None])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scheme", ["hif8-wo", "fp8-wo", "mxfp8-w8a8", "mxfp4-wo", "hif4-wo", "int4-a16w4",
                                    "svdquant-r32", "hif8-w8a8-ofmr", "hif8-w8a8-smoothquant"])
def test_cuda_packs_the_same_bits_as_the_cpu(scheme):
    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 64)).to(torch.bfloat16)
    gpu = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 64)).to(torch.bfloat16)
    gpu.load_state_dict(cpu.state_dict())
    gpu.cuda()
    x = torch.randn(16, 128, dtype=torch.bfloat16)
    for model, inp in ((cpu, x), (gpu, x.cuda())):
        lowbit.quantize(model, scheme)
        model(inp)
        fake = model(inp)
        lowbit.convert(model)
        out = model(inp)
        if scheme != "int4-a16w4":
            assert torch.equal(out, fake)
    for name, t in cpu.state_dict().items():
        if not lowbit.SCHEMES[scheme].needs_calibration or t.dtype == torch.uint8:
            assert torch.equal(gpu.state_dict()[name].cpu(), t), name


def _hif8_midpoints() -> torch.Tensor:
    """Every midpoint between adjacent positive HiF8 values, and its FP32 neighbours."""
    from lowbit.formats import hifloat8

    values = sorted({v for _, v in hifloat8.code_table() if math.isfinite(v) and v > 0})
    mids = torch.tensor([(a + b) / 2 for a, b in zip(values, values[1:])] + values, dtype=torch.float32)
    return torch.cat([mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e38))])


def test_fp32_hif8_codes_round_once_exhaustively_near_every_midpoint():
    from lowbit.formats import hifloat8
    from lowbit.quantize.elements import hif8_codes

    v = _hif8_midpoints()
    v = torch.cat([v, -v, torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3e38, 1e-40,
                                        32768.0, 40960.0, -1e9])])
    nan_payload = torch.tensor([0x7F800001, 0x7FC00000, -0x7FFF]).view(torch.float32)  # NaNs (low payload bits)
    v = torch.cat([v, nan_payload])
    assert torch.equal(hif8_codes(v), hifloat8.encode(v))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=64))
def test_fp32_hif8_codes_match_the_reference_on_any_bit_pattern(bits):
    from lowbit.formats import hifloat8
    from lowbit.quantize.elements import hif8_codes

    v = torch.tensor(bits, dtype=torch.int32).view(torch.float32)
    assert torch.equal(hif8_codes(v), hifloat8.encode(v))
