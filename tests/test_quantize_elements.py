"""lowbit.quantize.elements: the HiF8 casts the quantizers share call the CPU kernels directly for plain CPU
tensors (no operator dispatch) and give the operators' reference bits: every FP16 / BF16 pattern, FP32 inputs,
every code, strided and empty tensors; anything not plain goes through the operators."""

import pytest
import torch

import lowbit
from lowbit.formats import hifloat8 as reference
from lowbit.quantize import elements
from lowbit.quantize.elements import hif8_codes, hif8_round_trip, hif8_values


def every_pattern(dtype):
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)


def bits(t):
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def on_reference(function, *args):
    with lowbit.use_backend("reference"):
        return function(*args)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_pattern_and_code_give_the_reference_bits(dtype):
    x = every_pattern(dtype)
    codes = hif8_codes(x)
    assert torch.equal(codes, on_reference(hif8_codes, x)) and torch.equal(codes, reference.encode(x))
    every_code = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(bits(hif8_values(every_code, dtype)), bits(on_reference(hif8_values, every_code, dtype)))
    assert torch.equal(bits(hif8_round_trip(x)), bits(on_reference(hif8_round_trip, x)))


def test_float32_strided_and_empty_inputs():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 6, 64, generator=g) * torch.exp2(torch.randint(-30, 30, (4, 6, 64), generator=g).float())
    x[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e38])
    for case in (x, x.bfloat16()[:, :, ::2], x.half().transpose(0, 2), x[:0]):
        assert torch.equal(hif8_codes(case), on_reference(hif8_codes, case))
        assert torch.equal(bits(hif8_round_trip(case)), bits(on_reference(hif8_round_trip, case)))
        assert hif8_round_trip(case).shape == case.shape


def test_tensors_that_are_not_plain_take_the_operators(monkeypatch):
    operator_calls = []

    def recorded(operator):
        def call(*args, **kwargs):
            operator_calls.append(operator.__name__)
            return operator(*args, **kwargs)
        return call

    monkeypatch.setattr(elements, "encode_to_hifloat8", recorded(elements.encode_to_hifloat8))
    monkeypatch.setattr(elements, "decode_from_hifloat8", recorded(elements.decode_from_hifloat8))
    x = torch.randn(3, 32).bfloat16()
    codes = hif8_codes(x)
    values = hif8_values(codes, torch.float16)
    assert operator_calls == []  # plain CPU tensors: the kernels, directly
    assert torch.equal(codes, reference.encode(x))
    assert torch.equal(bits(values), bits(reference.decode(codes, torch.float16)))
    leaf = x.detach().requires_grad_()
    assert torch.equal(hif8_codes(leaf), codes)
    assert hif8_codes(x.to("meta")).device.type == "meta"
    with lowbit.use_backend("reference"):
        hif8_values(codes, torch.bfloat16)
    assert operator_calls == ["encode_to_hifloat8"] * 2 + ["decode_from_hifloat8"]
    with pytest.raises(TypeError, match="float64"):  # another dtype: the operator's own error
        hif8_codes(torch.zeros(2, dtype=torch.float64))
