"""PyTorch's transforms over converted and calibrating layers and the operators: each gives the eager result
(vmap, a tensor subclass) or a RuntimeError naming the layer or operator (torch.jit.trace and script, a
derivative by torch.func or forward-mode AD), never a silently wrong graph or a zero derivative."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.func import grad, jvp, vjp, vmap

import lowbit
from helpers import bits
from lowbit.cli.bench.model import quantized_layer

SCHEMES = ["mxfp4-wo", "hif8-wo", "int4-a16w4", "svdquant-r32", "mxfp8-w8a8"]


def _layer(scheme):
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(256, 512, generator=g) / 512**0.5).bfloat16()
    return quantized_layer(weight, torch.randn(256, generator=g).bfloat16(), scheme)[0]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_tracing_and_scripting_a_converted_layer_are_refused(scheme):
    layer = _layer(scheme)
    with pytest.raises(RuntimeError, match="layer '0': torch.jit.trace cannot record a lowbit layer"):
        torch.jit.trace(layer, torch.randn(3, 512).bfloat16())
    with pytest.raises(RuntimeError, match="layer '0': torch.jit.script cannot compile a lowbit layer"):
        torch.jit.script(layer)


def test_tracing_a_calibrating_model_is_refused_and_calibrates_nothing():
    model = nn.Sequential(nn.Linear(64, 32))
    lowbit.quantize(model, "hif8-w8a8-minmax")
    calibrating = model[0]
    with pytest.raises(RuntimeError, match="torch.jit.trace cannot record"):
        torch.jit.trace(model, torch.randn(2, 64))
    assert calibrating.calls == 0 and not calibrating.calibrated
    with pytest.raises(RuntimeError, match="torch.jit.script cannot compile"):
        torch.jit.script(model)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_derivative_through_a_layer_is_refused(scheme):
    layer = _layer(scheme)
    x = torch.randn(3, 512).bfloat16()
    for transform in (lambda: grad(lambda x: layer(x).float().sum())(x), lambda: jvp(layer, (x,), (x,)),
                      lambda: vjp(layer, x)):
        with pytest.raises(RuntimeError, match="layer '0': a quantized layer has no derivative"):
            transform()
    with fwAD.dual_level():
        with pytest.raises(RuntimeError, match="no derivative"):
            layer(fwAD.make_dual(x, torch.ones_like(x)))
        assert torch.equal(bits(layer(x)), bits(_layer(scheme)(x)))  # no tangent: the layer's bits


@pytest.mark.parametrize("scheme", SCHEMES)
def test_vmap_gives_each_rows_result(scheme):
    layer = _layer(scheme)
    x = torch.randn(3, 1, 512).bfloat16()
    assert torch.equal(bits(vmap(layer)(x)), bits(torch.stack([layer(row) for row in x])))


def test_an_operator_refuses_a_tangent():
    x = torch.randn(4, 64).bfloat16()
    with fwAD.dual_level():
        for op in (lowbit.hifloat4_fake_quant, lowbit.mxfp4_quantize, lowbit.encode_to_hifloat8):
            with pytest.raises(RuntimeError, match=f"{op.__name__} has no forward-mode derivative"):
                op(fwAD.make_dual(x, torch.ones_like(x)))
        assert torch.equal(bits(lowbit.hifloat4_fake_quant(x)), bits(lowbit.hifloat4_fake_quant(x.clone())))


class Tagged(torch.Tensor):
    """A tensor subclass that records the torch functions called on it."""

    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("rows", [1, 40])
def test_a_tensor_subclass_stays_one_and_sees_the_operators(scheme, rows):
    layer = _layer(scheme)
    x = torch.randn(rows, 512).bfloat16()
    Tagged.seen = []
    y = layer(x.as_subclass(Tagged))
    assert type(y) is Tagged and Tagged.seen
    if scheme != "int4-a16w4" or rows <= 12:  # int4's prefill under a subclass: the one-shot operator's dequant
        assert torch.equal(bits(y.as_subclass(torch.Tensor)), bits(layer(x)))



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scheme", ["mxfp4-wo", "hif4-wo", "svdquant-r32", "mxfp8-w8a8"])
def test_an_exported_layer_gives_the_eager_bits(scheme, dtype):
    """torch.export runs the layer on fake tensors: no cache reads their data (torch's 'Cannot access data
    pointer of Tensor' before), an FP16 4-bit layer takes its dequantize path (the weights' values are
    unknown; the same bits where the fused kernel applies)."""
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(64, 128, generator=g) / 128**0.5).to(dtype)
    layer = quantized_layer(weight, torch.randn(64, generator=g).to(dtype), scheme)[0]
    x = torch.randn(3, 128, generator=g).to(dtype)
    exported = torch.export.export(layer, (x,)).module()
    assert torch.equal(bits(exported(x)), bits(layer(x)))


def test_a_calibrating_model_is_not_exported_and_a_calibrated_one_is():
    """torch.export stands fake tensors for the weights: a calibrating layer says it is calibrating (the
    identity check said its weights had changed), a calibrated one exports with the eager bits."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32, dtype=torch.bfloat16))
    lowbit.quantize(model, "hif8-w8a8-minmax")  # batch_num 1
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"layer '0' is calibrating \(0 of 1 calls\)"):
        torch.export.export(model, (x,))
    model(x)
    assert torch.equal(bits(torch.export.export(model, (x,)).module()(x)), bits(model(x)))


def test_a_gradient_of_a_head_over_a_quantized_layer_is_computed():
    """torch.func wraps every argument, the data x too: only an x being differentiated is refused, so the
    gradients of a trainable head over a frozen quantized layer (per sample too) are torch's."""
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(128, 64))
    lowbit.quantize_(backbone, "hif8-wo")
    head = nn.Linear(64, 1)
    params = {k: v.detach() for k, v in head.named_parameters()}
    x, y = torch.randn(8, 128), torch.randn(8, 1)

    def loss(p, x, y):
        return ((torch.func.functional_call(head, p, (backbone(x),)) - y) ** 2).mean()

    features = backbone(x)
    weight = params["weight"].clone().requires_grad_()
    ((features @ weight.t() + params["bias"] - y) ** 2).mean().backward()
    assert torch.allclose(grad(loss)(params, x, y)["weight"], weight.grad)
    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x.unsqueeze(1), y.unsqueeze(1))
    assert per_sample["weight"].shape == (8, 1, 64)


def _calibration_layer(calibrated):
    model = nn.Sequential(nn.Linear(512, 256)).bfloat16()  # its weight requires grad, as a model's does
    lowbit.quantize(model, "hif8-w8a8-minmax")
    if calibrated:
        with torch.no_grad():
            model(torch.randn(2, 512).bfloat16())
    return model[0]


@pytest.mark.parametrize("scheme", [*SCHEMES, "calibrating", "calibrated"])
def test_a_backward_pass_through_a_layer_is_refused_not_dropped(scheme):
    """loss.backward() through a layer whose x required grad: the output came out detached (computed under
    torch.no_grad), so the gradients of everything before the layer were silently None. Now the backward
    raises, naming the layer, and the output is the same bits."""
    layer = _calibration_layer(scheme == "calibrated") if "calibrat" in scheme else _layer(scheme)
    x = torch.randn(3, 512).bfloat16().requires_grad_()
    y = layer(x)  # (a calibrating layer's first call: a calibration call)
    assert y.requires_grad
    with pytest.raises(RuntimeError, match="layer '0': a quantized layer has no derivative, so no gradient"):
        y.float().sum().backward()
    with torch.no_grad():
        again = layer(x)
    assert not again.requires_grad and (scheme == "calibrating" or torch.equal(bits(y.detach()), bits(again)))


@pytest.mark.parametrize("scheme", ["hif8-wo", "int4-a16w4", "calibrating", "calibrated"])
def test_a_head_trains_over_layers_whose_own_parameters_require_grad(scheme):
    """Only x's graph matters: a layer's own parameters get no gradient (as AMCT's layers), so a head over a
    model whose quantized weights or biases require grad (a fresh model's do) trains, and vmap runs."""
    layer = _calibration_layer(scheme == "calibrated") if "calibrat" in scheme else _layer(scheme)
    if layer.bias is not None:
        layer.bias.requires_grad_()
    head = nn.Linear(256, 1).bfloat16()
    x = torch.randn(3, 512).bfloat16()
    features = layer(x)
    assert not features.requires_grad
    head(features).float().sum().backward()
    assert head.weight.grad is not None and layer.bias.grad is None
    if scheme != "calibrating":  # (it raised under vmap: torch.func refuses an autograd.Function of this form)
        mapped = vmap(layer)(x.unsqueeze(1)).squeeze(1)
        if scheme == "calibrated":  # the fake quant's float matmul is torch's, whose kernel vmap may change
            assert torch.allclose(mapped, layer(x), rtol=0.02, atol=0.02)
        else:
            assert torch.equal(bits(mapped), bits(layer(x)))


def test_a_weight_of_a_parameter_subclass_calibrates():
    """Only torch.export's fake tensors stand for weights whose data cannot be read; a Parameter subclass
    (a user's own) is a weight like any other."""

    class Tagged(nn.Parameter):
        pass

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32))
    model[0].weight = Tagged(model[0].weight.detach())
    reference = nn.Sequential(nn.Linear(64, 32))
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 64)
    for m in (model, reference):
        lowbit.quantize(m, "hif8-w8a8-minmax")
        m(x)
    assert torch.equal(bits(model(x)), bits(reference(x)))


@pytest.mark.parametrize("scheme, dtype", [(s, torch.bfloat16) for s in [*SCHEMES, "hif4-wo", "fp8-wo", "mxfp4-w4a4"]]
                         + [("mxfp4-wo", torch.float16), ("hif4-wo", torch.float16), ("int4-a16w4", torch.float32)])
def test_a_converted_layer_compiles_whole(scheme, dtype):
    """torch.compile(fullgraph=True): no cache, data pointer or backend setting is read while dynamo traces
    (the operators as traced; an FP16 4-bit layer takes its dequantize path), with the eager bits."""
    torch._dynamo.reset()  # (one compiled forward per layer: dynamo's recompile limit counts them together)
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(64, 128, generator=g) / 11).to(dtype)
    layer = quantized_layer(weight, torch.randn(64, generator=g).to(dtype), scheme)[0]
    compiled = torch.compile(layer, fullgraph=True, backend="eager", dynamic=False)
    for rows in (1, 40):
        x = torch.randn(rows, 128, generator=g).to(dtype)
        assert torch.equal(bits(compiled(x)), bits(layer(x)))
    # an x that requires grad (a model run without no_grad): dynamo traced the functorch check and the raising
    # backward; while compiling the output is detached
    assert torch.equal(bits(compiled(x.clone().requires_grad_()).detach()), bits(layer(x)))
