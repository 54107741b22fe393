"""AMCT's worked vectors (docs/quantize.md, "Worked vectors") through the public API, amct_compat=True."""

import math

import pytest
import torch
from torch import nn

import lowbit
from lowbit.quantize import algorithms as alg
from lowbit.quantize.modules import PackedLinear


def _linear(rows, dtype=torch.bfloat16, bias=False):
    w = torch.tensor(rows, dtype=torch.float32)
    layer = nn.Linear(w.shape[1], w.shape[0], bias=bias).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(w.to(dtype))
    return nn.Sequential(layer)


def _config(weights, inputs=None, algorithm="minmax", batch_num=1):
    quant_cfg = {"weights": weights}
    if inputs is not None:
        quant_cfg["inputs"] = inputs
    return {"batch_num": batch_num, "quant_cfg": quant_cfg, "algorithm": algorithm}


def _deploy(model, config, calibration=(), compat=True):
    lowbit.quantize(model, config, amct_compat=compat)
    for x in calibration:
        model(x)
    lowbit.convert(model)
    layer = model[0]
    assert isinstance(layer, PackedLinear)
    return layer


def test_int8_symmetric_row_uses_the_extra_negative_code():
    layer = _deploy(_linear([[-1.0, 0.5]]), _config({"type": "int8", "symmetric": True, "strategy": "channel"}))
    assert layer.scale.tolist() == [2.0**-7]
    assert layer.codes.tolist() == [[-128, 64]]


def test_int8_asymmetric_row():
    layer = _deploy(_linear([[-1.0, 3.0]]), _config({"type": "int8", "symmetric": False, "strategy": "channel"}))
    assert layer.scale.tolist() == [torch.tensor(4.0 / 255, dtype=torch.float32).item()]
    assert layer.offset.tolist() == [-64]
    assert layer.codes.tolist() == [[-128, 127]]
    dq = layer.dequantized_weight().to(torch.float32)[0]
    assert dq.tolist() == pytest.approx([-1.00392, 2.99608], abs=1e-2)  # bf16 output of the fp32 dequant
    exact = (torch.tensor([-128.0, 127.0]) + 64) * (4.0 / 255)
    assert dq.tolist() == exact.to(torch.bfloat16).to(torch.float32).tolist()


HIF8_CAST = _config({"type": "hifloat8", "symmetric": True, "strategy": "channel"},
                    {"type": "hifloat8", "symmetric": True, "strategy": "tensor"}, "cast")


def test_cast_channel_scale_is_max_over_16_and_exact():
    layer = _deploy(_linear([[-4.0, 1.0, 2.0]]), HIF8_CAST)
    assert layer.scale.tolist() == [0.125]
    assert layer.dequantized_weight().tolist() == [[-4.0, 1.0, 2.0]]


def test_cast_all_negative_row_gets_scale_one():
    layer = _deploy(_linear([[-8.0, -1.0]]), HIF8_CAST)
    assert layer.scale.tolist() == [1.0]
    assert layer.dequantized_weight().tolist() == [[-8.0, -1.0]]


def test_cast_negative_outlier_compat_saturates():
    layer = _deploy(_linear([[-20.0, 2.0**-10]]), HIF8_CAST)
    assert layer.scale.tolist() == [2.0**-14]
    assert layer.dequantized_weight().tolist() == [[-2.0, 2.0**-10]]


def test_cast_negative_outlier_default_uses_abs_max():
    layer = _deploy(_linear([[-20.0, 2.0**-10]]), HIF8_CAST, compat=False)
    assert layer.scale.tolist() == [1.25]
    assert layer.dequantized_weight().tolist() == [[-20.0, 0.00091552734375]]


QUANTILE = _config({"type": "hifloat8", "symmetric": True, "strategy": "channel"},
                   {"type": "hifloat8", "symmetric": True, "strategy": "tensor"}, "quantile", batch_num=3)


def test_quantile_negative_row_keeps_the_negative_scale_in_compat():
    x = torch.ones(1, 2, dtype=torch.bfloat16)
    layer = _deploy(_linear([[-8.0, -1.0]]), QUANTILE, [x, x, x])
    assert layer.scale.tolist() == [-0.0625]
    assert layer.codes.tolist() == lowbit.encode_to_hifloat8(torch.tensor([[128.0, 16.0]], dtype=torch.bfloat16)).tolist()
    assert layer.dequantized_weight().tolist() == [[-8.0, -1.0]]


def test_quantile_all_zero_row_is_an_error_in_compat_and_scale_one_by_default():
    model = _linear([[0.0, 0.0]])
    with pytest.raises(ValueError, match="NaN"):
        lowbit.quantize(model, QUANTILE, amct_compat=True)
    assert type(model[0]) is nn.Linear  # unchanged
    x = torch.ones(1, 2, dtype=torch.bfloat16)
    layer = _deploy(model, QUANTILE, [x, x, x], compat=False)
    assert layer.scale.tolist() == [1.0]


def test_quantile_activation_scale_is_the_ema_of_abs_maxima():
    batches = [torch.tensor([[10.0]]), torch.tensor([[2.0]]), torch.tensor([[-2.0]])]
    layer = _deploy(_linear([[1.0]], torch.float32), QUANTILE, batches)
    q = torch.tensor([10.0])
    for m in (2.0, 2.0):
        q = 0.99 * q + 0.01 * torch.tensor([m])
    assert layer.act_scale.tolist() == (q / 16).tolist()
    assert layer.act_scale.item() == pytest.approx(0.61505, rel=1e-6)


def test_smoothquant_factor():
    sigma = alg.smooth_factor(torch.tensor([4.0, 1.0]), torch.tensor([-1.0, -0.5]), torch.tensor([[1.0, 4.0]]), 0.5,
                              amct_compat=True)
    assert sigma.tolist() == [2.0, 0.5]


def test_smoothquant_through_the_api():
    cfg = _config({"type": "hifloat8", "symmetric": True, "strategy": "channel"},
                  {"type": "hifloat8", "symmetric": True, "strategy": "tensor"},
                  {"smoothquant": {"smooth_strength": 0.5}})
    layer = _deploy(_linear([[1.0, 4.0]]), cfg, [torch.tensor([[4.0, -1.0]], dtype=torch.bfloat16)])
    assert layer.smooth.tolist() == [2.0, 0.5]
    assert layer.smooth.dtype == torch.bfloat16  # compat: sigma in the weight dtype
    assert layer.scale.tolist() == [2.0 / 16]  # abs-max of W * sigma = [2, 2]
    assert layer.act_scale.tolist() == [2.0 / 16]  # abs-max of x / sigma = [2, -2]


def test_ofmr_picks_the_candidate_with_the_smallest_output_error():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 32))
    x = torch.randn(8, 64) * 5
    cfg = _config({"type": "hifloat8", "symmetric": True, "strategy": "tensor"},
                  {"type": "hifloat8", "symmetric": True, "strategy": "tensor"}, "ofmr")
    w, b = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    y = x @ w.T + b
    layer = _deploy(model, cfg, [x])

    def mse(y_hat):
        return float((y.double() - y_hat.double()).pow(2).sum() / y.numel())

    def hif8(v):  # independent HiF8 round trip through the reference encoder
        from lowbit.formats import hifloat8
        return hifloat8.decode(hifloat8.encode(v), torch.float32)

    w_losses = [mse(x @ (hif8(w / 2.0**e) * 2.0**e).T + b) for e in range(-5, 6)]
    d_losses = [mse((hif8(x / 2.0**e) * 2.0**e) @ w.T + b) for e in range(-5, 6)]
    assert layer.scale.item() == 2.0 ** (w_losses.index(min(w_losses)) - 5)
    assert layer.act_scale.item() == 2.0 ** (d_losses.index(min(d_losses)) - 5)


def test_process_scale_rejects_nan_and_calculate_scale_offset_never_returns_inf():
    with pytest.raises(RuntimeError, match="not finite"):
        alg.process_scale(torch.tensor([float("nan")]))
    scale, _ = alg.calculate_scale_offset(torch.tensor([0.0]), torch.tensor([0.0]), True, "hifloat8")
    assert scale.tolist() == [1.0]
    scale, offset = alg.calculate_scale_offset(torch.tensor([0.0]), torch.tensor([0.0]), False, "int8")
    assert (scale.tolist(), offset.tolist()) == ([1.0], [-128])
    assert math.isfinite(alg.calculate_scale_offset(torch.tensor([3e38]), torch.tensor([-3e38]), True,
                                                    "float8_e4m3fn")[0].item())


def _calibrated_pair(scheme, compat, dtype=torch.bfloat16):
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(64, 32).to(dtype))
    x = (torch.randn(8, 64) * 3).to(dtype)
    lowbit.quantize(model, scheme, amct_compat=compat)
    model(x)
    fake = model(x)
    lowbit.convert(model)
    return model[0], x, fake, model(x)


def test_compat_deploy_multiplies_by_the_rounded_reciprocal_of_the_activation_scale():
    layer, x, fake, deployed = _calibrated_pair("hif8-w8a8-quantile", compat=True)
    s = layer.act_scale
    assert (1 / s).to(torch.bfloat16).float() != 1 / s  # the case where deploy and fake quant differ
    from lowbit.formats import hifloat8
    x_q = hifloat8.decode(hifloat8.encode(x.float() * (1 / s).to(torch.bfloat16).float()), torch.float32)
    expected = torch.nn.functional.linear((x_q * s).to(torch.bfloat16), layer.dequantized_weight(), layer.bias)
    assert torch.equal(deployed, expected)
    x_fq = hifloat8.decode(hifloat8.encode(x.float() / s), torch.bfloat16) * s.to(torch.bfloat16)
    assert torch.equal(fake, torch.nn.functional.linear(x_fq, layer.dequantized_weight(), layer.bias))
    # Default mode: deploy divides like fake quant, so the two agree bit for bit.
    _, _, fake, deployed = _calibrated_pair("hif8-w8a8-quantile", compat=False)
    assert torch.equal(fake, deployed)


def test_compat_ofmr_power_of_two_scales_make_deploy_equal_fake_quant():
    _, _, fake, deployed = _calibrated_pair("hif8-w8a8-ofmr", compat=True)
    assert torch.equal(fake, deployed)


TOKEN_QUANTILE = _config({"type": "hifloat8", "symmetric": True, "strategy": "channel"},
                         {"type": "hifloat8", "symmetric": True, "strategy": "token"}, "quantile", batch_num=2)


def test_compat_static_token_scales_are_per_sequence_position_in_fake_quant_only():
    from lowbit.formats import hifloat8

    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(64, 32).to(torch.bfloat16))
    calib = [(torch.randn(3, 5, 64) * torch.arange(1, 6)[:, None]).to(torch.bfloat16) for _ in range(2)]
    lowbit.quantize(model, TOKEN_QUANTILE, amct_compat=True)
    for x in calib:
        model(x)
    with pytest.raises(lowbit.ShapeError, match="sequence length 5"):
        model(calib[0][:, :4])
    x = calib[0]
    fake = model(x)
    lowbit.convert(model)
    layer = model[0]
    # EMA over the two calls of the abs-max per position (over batch and channels), / 16.
    m1, m2 = (c.float().abs().amax(dim=(0, 2)).reshape(5, 1) for c in calib)
    assert torch.equal(layer.act_scale, (0.99 * m1 + 0.01 * m2) / 16)
    s = layer.act_scale
    x_fq = hifloat8.decode(hifloat8.encode(x.float() / s), torch.bfloat16) * s.to(torch.bfloat16)
    w = layer.dequantized_weight()
    assert torch.equal(fake, torch.nn.functional.linear(x_fq, w, layer.bias))
    # Deploy: dynamic per token, max|x| / 15 over the channels of each token.
    t = alg.process_scale(x.float().abs().amax(dim=-1, keepdim=True) / 15)[0]
    x_dq = hifloat8.decode(hifloat8.encode(x.float() / t), torch.bfloat16) * t.to(torch.bfloat16)
    assert torch.equal(model(x), torch.nn.functional.linear(x_dq, w, layer.bias))


def test_default_token_activations_are_dynamic_in_fake_quant_and_deploy():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(64, 32).to(torch.bfloat16))
    x = torch.randn(3, 5, 64).to(torch.bfloat16)
    lowbit.quantize(model, TOKEN_QUANTILE)
    assert model[0].calibrated  # nothing to calibrate: per-token scales are computed at run time
    fake = model(x)
    lowbit.convert(model)
    assert torch.equal(model(x), fake)
    assert model(x[:, :2]).shape == (3, 2, 32)  # any sequence length
