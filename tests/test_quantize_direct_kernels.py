"""The quantizers' direct kernel calls (lowbit.ops.library.direct_cpu_kernel): the HiF8 casts they share
(lowbit.quantize.elements) and MXFP4 activations (lowbit.quantize.activations) run the CPU kernels without the
operators' dispatch for plain CPU tensors, with the operators' reference bits (every FP16 / BF16 pattern, every
HiF8 code, FP32, strided, offset, 3-D and empty inputs) and their run recorded; anything not plain, the
"reference" backend, or a kernel that fails auto's self-check goes through the operators."""

import pytest
import torch

import lowbit
from lowbit.formats import hifloat8 as reference
from lowbit.formats import mxfp4
from lowbit.ops import hifloat8 as hifloat8_ops
from lowbit.ops import library
from lowbit.ops import mxfp4 as mxfp4_ops
from lowbit.quantize import activations
from lowbit.quantize.activations import MXFP4_ACT_RULE, fake_quant_input
from lowbit.quantize.elements import hif8_codes, hif8_round_trip, hif8_values


def every_pattern(dtype):
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)


def bits(t):
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def on_reference(function, *args):
    with lowbit.use_backend("reference"):
        return function(*args)


def at_odd_offset(x):
    """x's values in a view that starts one element into a larger buffer (misaligned for wider loads)."""
    buffer = torch.empty(x.numel() + 1, dtype=x.dtype)
    view = buffer[1:].view(x.shape)
    view.copy_(x)
    return view


def record_operator_calls(monkeypatch, module, names):
    calls = []
    for name in names:
        operator = getattr(module, name)

        def call(*args, operator=operator, **kwargs):
            calls.append(operator.__name__)
            return operator(*args, **kwargs)
        monkeypatch.setattr(module, name, call)
    return calls


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_hif8_every_pattern_and_code_give_the_reference_bits(dtype):
    x = every_pattern(dtype)
    codes = hif8_codes(x)
    assert lowbit.last_backend("encode_to_hifloat8") == "native"
    assert torch.equal(codes, on_reference(hif8_codes, x)) and torch.equal(codes, reference.encode(x))
    every_code = torch.arange(256, dtype=torch.uint8)
    values = hif8_values(every_code, dtype)
    assert lowbit.last_backend("decode_from_hifloat8") == "native"
    assert torch.equal(bits(values), bits(on_reference(hif8_values, every_code, dtype)))
    assert torch.equal(bits(hif8_round_trip(x)), bits(on_reference(hif8_round_trip, x)))


def test_hif8_float32_strided_offset_and_empty_inputs():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 6, 64, generator=g) * torch.exp2(torch.randint(-30, 30, (4, 6, 64), generator=g).float())
    x[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e38])
    for case in (x, x.bfloat16()[:, :, ::2], x.half().transpose(0, 2), at_odd_offset(x), at_odd_offset(x.half()),
                 x[:0]):
        assert torch.equal(hif8_codes(case), on_reference(hif8_codes, case))
        assert torch.equal(bits(hif8_round_trip(case)), bits(on_reference(hif8_round_trip, case)))
        assert hif8_round_trip(case).shape == case.shape
    codes = hif8_codes(x.half())
    assert torch.equal(bits(hif8_values(at_odd_offset(codes), torch.bfloat16)),
                       bits(on_reference(hif8_values, codes, torch.bfloat16)))


def test_hif8_what_is_not_plain_takes_the_operators(monkeypatch):
    calls = record_operator_calls(monkeypatch, hifloat8_ops, ["encode_to_hifloat8", "decode_from_hifloat8"])
    x = torch.randn(3, 32).bfloat16()
    codes = hif8_codes(x)
    values = hif8_values(codes, torch.float16)
    assert calls == []  # plain CPU tensors: the kernels, directly
    assert torch.equal(codes, reference.encode(x))
    assert torch.equal(bits(values), bits(reference.decode(codes, torch.float16)))
    assert torch.equal(hif8_codes(x.detach().requires_grad_()), codes)
    assert hif8_codes(x.to("meta")).device.type == "meta"
    with lowbit.use_backend("reference"):
        hif8_values(codes, torch.bfloat16)
    assert calls == ["encode_to_hifloat8"] * 2 + ["decode_from_hifloat8"]
    monkeypatch.setattr(hifloat8_ops.ENCODE, "auto_check_error", lambda device, args=(): "broken here")
    monkeypatch.setattr(library, "_DIRECT", {})  # the self-check's answers, kept
    assert torch.equal(hif8_codes(x), codes) and len(calls) == 4  # a failed self-check: the operator
    with pytest.raises(TypeError, match="float64"):  # another dtype: the operator's own error
        hif8_codes(torch.zeros(2, dtype=torch.float64))


def mxfp4_round_trip(x):
    return mxfp4.dequantize(*mxfp4.quantize(x, 32, *MXFP4_ACT_RULE), x.dtype)


@pytest.mark.parametrize("dtype", mxfp4.INPUT_DTYPES, ids=str)
def test_mxfp4_activations_give_the_operators_bits(dtype):
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(6, 96, generator=g) * torch.exp2(torch.randint(-12, 12, (6, 96), generator=g).float())).to(dtype)
    x[0, :32], x[1, 5], x[2, 40], x[3, 64:] = 0.0, float("nan"), float("-inf"), torch.finfo(dtype).max
    x[4, :3] = torch.tensor([-0.0, torch.finfo(dtype).tiny, torch.finfo(dtype).tiny / 4])  # -0, tiny, subnormal
    x[5, :32] = 0.0  # a block of scale 2^0 (largest 6) holding E2M1's ties: 0.25, 1.25, 1.75, 2.5, 5 (ties away)
    x[5, :6] = torch.tensor([6.0, 0.25, -1.25, 1.75, -2.5, 5.0])
    for case in (x, x.reshape(2, 3, 96), x[:, ::2][:, :32], torch.cat([x, x[:, :32]], 1), at_odd_offset(x), x[:0]):
        fast = fake_quant_input(case, "mxfp4")
        assert lowbit.last_backend("mxfp4_quantize") == "native" == lowbit.last_backend("mxfp4_dequantize")
        assert fast.dtype == dtype and fast.shape == case.shape
        assert torch.equal(bits(fast), bits(on_reference(fake_quant_input, case, "mxfp4")))
        assert torch.equal(bits(fast), bits(mxfp4_round_trip(case)))


def test_mxfp4_activations_not_plain_take_the_operators(monkeypatch):
    calls = record_operator_calls(monkeypatch, mxfp4_ops, ["mxfp4_quantize", "mxfp4_dequantize"])
    monkeypatch.setattr(activations, "mxfp4_quantize", mxfp4_ops.mxfp4_quantize)
    monkeypatch.setattr(activations, "mxfp4_dequantize", mxfp4_ops.mxfp4_dequantize)
    x = torch.randn(2, 64).bfloat16()
    want = mxfp4_round_trip(x)
    assert torch.equal(bits(fake_quant_input(x, "mxfp4")), bits(want)) and calls == []
    leaf = x.detach().requires_grad_()
    assert torch.equal(bits(fake_quant_input(leaf, "mxfp4").detach()), bits(want))
    assert fake_quant_input(x.to("meta"), "mxfp4").device.type == "meta"
    assert calls == ["mxfp4_quantize", "mxfp4_dequantize"] * 2
    monkeypatch.setattr(mxfp4_ops.DEQUANTIZE, "auto_check_error", lambda device, args=(): "broken here")
    monkeypatch.setattr(library, "_DIRECT", {})
    assert torch.equal(bits(fake_quant_input(x, "mxfp4")), bits(want))
    assert calls == ["mxfp4_quantize", "mxfp4_dequantize"] * 3  # one kernel fails its self-check: the operators
