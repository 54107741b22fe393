"""Every scheme end to end on a small MLP: accuracy floor, fake quant vs deploy, packed sizes, operators."""

import copy
import math
import pickle

import pytest
import torch
from torch import nn

import lowbit
from lowbit.formats import hifloat8 as hif8_reference
from lowbit.formats.int4 import quantize_int4_per_group
from lowbit.formats.wqbmm import dequantize_weight
import lowbit.kernels.cpu.mxfp4
from lowbit.kernels.cpu.wqbmm_dequant import packed_is_faster
from lowbit.quantize.activations import FakeQuantInputCall
from lowbit.quantize.modules import CalibrationModule, Int4Linear, SVDQuantLinearDeploy, int4_msd_max_rows

# Accuracy floors, derived from the formats rather than fitted: an element format whose top band keeps p
# significant bits (8-bit floats: 3 mantissa bits, round-to-nearest -> relative error <= 2^-4, p = 4; the
# 4-bit formats: <= 2^-2 of the block's top values, p = 2) adds noise at most 6.02 p dB below the signal per
# quantized tensor. Noise of independent sources adds: weights and activations -> -3 dB; the MLP has two
# quantized layers in series -> another -3 dB.
PRECISION_BITS = {
    "hif8-cast": 4, "hif8-w8a8-minmax": 4, "hif8-w8a8-ofmr": 4, "hif8-w8a8-quantile": 4, "hif8-w8a8-smoothquant": 4,
    "hif8-wo": 4, "fp8-w8a8-ofmr": 4, "fp8-wo": 4, "mxfp8-w8a8": 4, "mxfp4-wo": 2, "mxfp4-w4a4": 2, "hif4-wo": 2,
    "int4-a16w4": 2, "svdquant-r32": 2,
}
LAYERS = 2


def sqnr_db(reference, output):
    ref, err = reference.double(), output.double() - reference.double()
    return 10 * math.log10(float(ref.pow(2).sum()) / float(err.pow(2).sum()))


def floor_db(scheme):
    sources = 2 if lowbit.SCHEMES[scheme].config["quant_cfg"].get("inputs") else 1
    return 6.02 * PRECISION_BITS[scheme] - 10 * math.log10(sources * LAYERS)


def mlp(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 64)).to(dtype)


def inputs(dtype=torch.float32, seed=1):
    return torch.randn(32, 128, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_every_required_scheme_exists_with_its_bits_per_weight():
    assert set(PRECISION_BITS) <= set(lowbit.SCHEMES)
    bits = {name: s.bits_per_weight for name, s in lowbit.SCHEMES.items()}
    assert bits["int4-a16w4"] == 4 + 16 / 128 and bits["mxfp4-wo"] == 4 + 8 / 32 and bits["hif4-wo"] == 4.5
    assert bits["mxfp8-w8a8"] == 8 + 8 / 32 and bits["hif8-wo"] == 8


@pytest.mark.parametrize("scheme", sorted(PRECISION_BITS))
def test_scheme_end_to_end(scheme):
    model, x = mlp(), inputs()
    reference = model(x).detach()
    report = lowbit.quantize(model, scheme)
    assert report.quantized == ["0", "2"] and all(isinstance(model[i], CalibrationModule) for i in (0, 2))
    needs_data = lowbit.SCHEMES[scheme].needs_calibration
    assert [l.status for l in report.layers.values()] == ["calibrating" if needs_data else "quantized"] * 2
    model(x)  # calibration (batch_num 1)
    fake = model(x).detach()
    converted = lowbit.convert(model)
    deployed = model(x).detach()
    assert sqnr_db(reference, fake) >= floor_db(scheme)
    assert sqnr_db(reference, deployed) >= floor_db(scheme)
    if scheme == "int4-a16w4":
        # Documented difference: MSD splits x into three int4 digits per group (relative residual below
        # 1 / (2 * 7.49 * 14.98^2) ~ 3e-4) and runs in BF16 (relative 2^-9): far below 40 dB of noise.
        assert isinstance(model[0], Int4Linear)
        assert sqnr_db(fake, deployed) >= 40
    else:
        assert torch.equal(fake, deployed)
    assert converted.bytes_before == (128 * 256 + 256 * 64) * 4


def _extra_bytes(layer, n, k):
    """Bytes outside the per-weight figure: per-channel/tensor scales, SVD factors, smoothing, act scale."""
    extra = 0
    buffers = dict(layer.named_buffers())
    for name in ("scale", "offset", "smooth", "act_scale", "down", "up"):
        if name in buffers:
            extra += buffers[name].numel() * buffers[name].element_size()
    return extra


@pytest.mark.parametrize("scheme", sorted(PRECISION_BITS))
def test_packed_storage_matches_bits_per_weight(scheme):
    model, x = mlp(), inputs()
    lowbit.quantize(model, scheme)
    model(x)
    lowbit.convert(model)
    for index, (n, k) in ((0, (256, 128)), (2, (64, 256))):
        layer = model[index]
        assert "weight" not in dict(layer.named_parameters())  # no float copy of the weight
        expected = lowbit.SCHEMES[scheme].bits_per_weight * n * k / 8
        core = layer.packed_nbytes() - _extra_bytes(layer, n, k)
        assert abs(core - expected) <= 0.03 * expected, (index, core, expected)


def _rowwise(w, scope):
    return w.abs().amax(dim=1, keepdim=True) / scope


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_deploy_weights_equal_lowbit_operators(dtype):
    torch.manual_seed(5)
    w = (torch.randn(64, 128) * torch.logspace(-3, 2, 64)[:, None]).to(dtype)

    def deployed(scheme):
        model = nn.Sequential(nn.Linear(128, 64, bias=False).to(dtype))
        with torch.no_grad():
            model[0].weight.copy_(w)
        lowbit.quantize_(model, scheme)
        return model[0]

    s = _rowwise(w.float(), 16)
    hif8 = hif8_reference.decode(hif8_reference.encode(w.float() / s), dtype) * s.to(dtype)
    assert torch.equal(deployed("hif8-wo").dequantized_weight(), hif8)
    s = _rowwise(w.float(), 448)
    fp8 = ((w.float() / s).to(torch.float8_e4m3fn).float() * s).to(dtype)
    assert torch.equal(deployed("fp8-wo").dequantized_weight(), fp8)
    mx = lowbit.mxfp4_dequantize(*lowbit.mxfp4_quantize(w, 32, "even", "rne"), dtype)
    assert torch.equal(deployed("mxfp4-wo").dequantized_weight(), mx)
    assert torch.equal(deployed("hif4-wo").dequantized_weight(), lowbit.hifloat4_fake_quant(w))
    scale_dtype = torch.bfloat16
    packed, scale, _ = quantize_int4_per_group(w.float().T, 128, dtype=scale_dtype)
    layer = deployed("int4-a16w4")
    assert torch.equal(layer.weight, packed) and torch.equal(layer.antiquant_scale, scale)
    assert torch.equal(layer.dequantized_weight(), dequantize_weight(packed, scale, None, 128).T.to(dtype))


@pytest.mark.parametrize("scheme", ["hif8-wo", "fp8-wo", "mxfp4-wo", "hif4-wo", "mxfp8-w8a8"])
def test_fused_deploy_layers_follow_every_change_of_their_buffers(scheme):
    """A deploy layer binds its fused operator to its packed buffers once (PreparedCall) and binds it
    again when a buffer is replaced (load_state_dict of another layer's, a copy), written in place, or given
    new memory (``.data =``, as a device move or share_memory_ does): the
    result is always the operator's on the current buffers; copies and pickles leave the binding out."""
    models = [mlp(torch.bfloat16, seed) for seed in range(2)]
    for model in models:
        lowbit.quantize_(model, scheme)
    layer, other = models[0][0], models[1][0]
    _check_binding_follows(layer, other)


def test_svdquant_deploy_layer_follows_its_tensors():
    """The SVDQuant deploy layer binds svd_quant to its packed weight and factors once (PreparedCall); a
    load_state_dict of another layer's tensors, or a write in place, binds it again (a copy, which has no
    binding, gives the bits of the current tensors)."""
    models = [mlp(torch.bfloat16, seed) for seed in range(2)]
    for model in models:
        lowbit.quantize_(model, "svdquant-r32")
    layer, other = models[0][0], models[1][0]
    x = inputs(torch.bfloat16)[:3]
    before = layer(x)
    assert torch.equal(before, lowbit.svd_quant(x, layer.w, layer.s, layer.down, layer.up) + layer.bias)
    xs = inputs(torch.bfloat16)  # 32 rows: the prefill path with the same prepared scales
    assert torch.equal(layer(xs), lowbit.svd_quant(xs, layer.w, layer.s, layer.down, layer.up) + layer.bias)
    layer.load_state_dict(other.state_dict())
    assert torch.equal(layer(x), other(x)) and not torch.equal(layer(x), before)
    with torch.no_grad():
        layer.s.copy_(layer.s ^ 1)  # every E8M0 scale byte one step away
    assert torch.equal(layer(x), copy.deepcopy(layer)(x)) and not torch.equal(layer(x), other(x))


@pytest.mark.parametrize("scheme", ["hif8-wo", "hif4-wo", "int4-a16w4", "svdquant-r32"])
def test_fused_deploy_layers_of_inference_tensors_follow_load_state_dict(scheme):
    """Quantized under torch.inference_mode, a layer's buffers are inference tensors, which have no version
    counter; load_state_dict still binds the operator (int4: makes the PackedWeight) again."""
    with torch.inference_mode():
        models = [mlp(torch.bfloat16, seed) for seed in range(2)]
        for model in models:
            lowbit.quantize_(model, scheme)
        layer, other = models[0][0], models[1][0]
        x = inputs(torch.bfloat16)[:3]
        before = layer(x)
        layer.load_state_dict(other.state_dict())
        assert torch.equal(layer(x), other(x)) and not torch.equal(layer(x), before)


@pytest.mark.parametrize("scheme", ["hif8-wo", "hif4-wo"])
def test_compiled_deploy_model_gives_the_same_bits(scheme):
    """Under torch.compile a deploy layer's call goes through the custom op (PreparedCall's fast path is
    for plain calls only); the bits are the eager model's."""
    model = mlp(torch.bfloat16)
    lowbit.quantize_(model, scheme)
    x = inputs(torch.bfloat16)[:3]
    assert torch.equal(torch.compile(model, backend="eager")(x), model(x))


@pytest.mark.parametrize("scheme", ["hif8-wo", "mxfp4-wo", "hif4-wo", "mxfp4-w4a4", "mxfp8-w8a8"])
def test_deploy_layer_checks_every_other_input_after_its_fast_path(scheme):
    """Once its fused kernel has taken an x, PackedLinear.forward sends an x of that dtype and K straight to
    it (the same bits as the full path); any other x still gets the layer's errors, and an x that requires
    grad the full path (its output in the graph, whose backward raises)."""
    model = mlp(torch.bfloat16)
    lowbit.quantize_(model, scheme)
    layer = model[0]
    x = inputs(torch.bfloat16)[:3]
    want = layer.compute(layer.quantize_input(x))  # the full path's result
    assert torch.equal(layer(x).view(torch.int16), want.view(torch.int16))
    assert layer.__dict__["_fused_input"][:2] == (torch.bfloat16, (128,))  # set: the next calls take it
    assert torch.equal(layer(x).view(torch.int16), want.view(torch.int16))
    assert torch.equal(layer(x[:1]).view(torch.int16), want[:1].view(torch.int16))
    with pytest.raises(lowbit.ShapeError, match=r"layer '0': input must be \(\.\.\., 128\)"):
        layer(x[:, :127])
    with pytest.raises(lowbit.ShapeError, match="layer '0'"):
        layer(x[0, 0])
    with pytest.raises(lowbit.DtypeError, match="layer '0'"):
        layer(x.half())
    y = layer(x.clone().requires_grad_())
    assert y.requires_grad and torch.equal(y.detach().view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("scheme", ["mxfp4-w4a4", "mxfp8-w8a8", "hif8-cast"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_scaleless_activation_layer_fake_quantizes_its_input_in_the_one_call(scheme, dtype):
    """An mxfp4-w4a4 / mxfp8-w8a8 / hif8-cast layer's fast path: x fake-quantized by its kernels' one-call
    form, then the bound GEMV (activations.FakeQuantInputCall; MXFP4 where the CPU has the in-register fake
    quant, HiFloat8 where it has AVX512-BW): the full path's bits for 1-4 rows of x with NaN, Inf, -0, a zero
    block, values past HiFloat8's largest and below its smallest; more rows than the call takes, and the
    "reference" backend, take the full path, with the same bits."""
    model = mlp(dtype)
    lowbit.quantize_(model, scheme)
    layer = model[0]
    x = inputs(dtype)[:4] * torch.logspace(-3, 3, 128).to(dtype)
    x[0, 3], x[1, 40], x[2, 7], x[3, 64:96] = float("nan"), float("inf"), -0.0, 0.0
    x[0, 10], x[1, 11], x[2, 12] = 40000.0, -1e-7, 3e-8
    with torch.inference_mode():
        want = layer.compute(layer.quantize_input(x))  # the full path
        for rows in (1, 2, 3, 4):
            assert torch.equal(layer(x[:rows]).view(torch.int16), want[:rows].view(torch.int16))
        call = layer.__dict__["_one_call"][0]
        if {"mxfp8-w8a8": True, "hif8-cast": lowbit.kernels.cpu._simd.HAS_AVX512BW,
                "mxfp4-w4a4": lowbit.kernels.cpu.mxfp4.fake_quantizes_in_registers(dtype, 32)}[scheme]:
            assert isinstance(call, FakeQuantInputCall) and call.max_rows >= 4
        many = inputs(dtype, seed=5).repeat(200, 1)[: call.max_rows + 1 if call is not None else 5]
        full = layer.compute(layer.quantize_input(many))
        assert torch.equal(layer(many).view(torch.int16), full.view(torch.int16))
        with lowbit.use_backend("reference"):
            assert torch.equal(layer(x).view(torch.int16), want.view(torch.int16))
            assert layer.__dict__["_one_call"][0] is None


def _check_binding_follows(layer, other):
    op, names = layer.fused_kernel(torch.bfloat16)
    x = inputs(torch.bfloat16)[:3]

    def operator_result(module):
        y = op(module.quantize_input(x), *[module._buffers[name] for name in names], module.bias)
        return y.view(torch.int16)  # bits: NaN compares equal to itself

    assert torch.equal(layer(x).view(torch.int16), operator_result(layer))
    prepared = layer._prepared[0]
    assert layer(x) is not None and layer._prepared[0] is prepared  # kept between calls
    layer.load_state_dict(other.state_dict())  # writes the buffers in place
    assert torch.equal(layer(x).view(torch.int16), operator_result(other)) and layer._prepared[0] is not prepared
    scale = layer._buffers[names[1]]  # scales, or HiFloat4's value bytes
    with torch.no_grad():
        scale.copy_(scale ^ 1 if scale.dtype == torch.uint8 else scale * 2)
    written = layer(x).view(torch.int16)
    assert torch.equal(written, operator_result(layer))
    assert not torch.equal(written, operator_result(other))
    scale.data = other._buffers[names[1]].clone()  # new memory under the same tensor, its version unchanged
    assert torch.equal(layer(x).view(torch.int16), operator_result(layer))
    assert not torch.equal(layer(x).view(torch.int16), written)
    copied = copy.deepcopy(layer)
    assert copied._prepared is None and torch.equal(copied(x), layer(x))
    assert pickle.loads(pickle.dumps(layer))._prepared is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_int4_deploy_runs_msd_up_to_its_row_limit_and_dequant_above(dtype):
    """Up to int4_msd_max_rows rows of x: MSD with the prepacked weight; one more: the "dequant" algorithm, on
    the PackedWeight where that is faster (packed_is_faster), else on the raw weight (docs/quantize.md,
    'Packed layouts')."""
    model = mlp(dtype)
    lowbit.quantize_(model, "int4-a16w4")
    layer = model[0]
    assert isinstance(layer._packed, lowbit.PackedWeight)
    limit = int4_msd_max_rows(dtype)
    for rows, algorithm in ((limit, "msd"), (limit + 1, "dequant")):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(dtype)
        if algorithm == "dequant" and packed_is_faster(dtype):
            plan = lowbit.plan_weight_quant_batch_matmul(rows, 128, layer.out_features, algorithm="dequant",
                                                         dtype=dtype, prepacked=True)
            product = plan.run(x, plan.pack_weight(layer.weight), layer.antiquant_scale)
        else:
            product = lowbit.weight_quant_batch_matmul(x, layer.weight, layer.antiquant_scale, group_size=128,
                                                       algorithm=algorithm)
        expected = product + layer.bias
        assert torch.equal(layer(x), expected), algorithm
        other = "dequant" if algorithm == "msd" else "msd"
        assert not torch.equal(layer(x), lowbit.weight_quant_batch_matmul(
            x, layer.weight, layer.antiquant_scale, group_size=128, algorithm=other) + layer.bias), other


def test_int4_deploy_follows_the_backend_setting_with_the_same_bits():
    """A converted int4 layer under use_backend("reference") packs for that backend (it used to refuse the
    native PackedWeight) and gives MSD's bits; its plans are kept per row count and backend setting."""
    model = mlp(torch.bfloat16)
    lowbit.quantize_(model, "int4-a16w4")
    layer, x = model[0], inputs(torch.bfloat16)[:5]
    native = layer(x)
    assert layer._packed.backend == "native" and layer._plan(5, x.device) is layer._plan(5, x.device)
    with lowbit.use_backend("reference"):
        reference = layer(x)
        assert lowbit.last_backend("weight_quant_batch_matmul") == "reference"
        assert layer._packed.backend == "reference"
    assert torch.equal(native, reference)
    assert torch.equal(layer(x), native) and layer._packed.backend == "native"


def test_svdquant_deploy_is_the_svd_quant_operator():
    model = mlp(torch.bfloat16)
    x = inputs(torch.bfloat16)
    lowbit.quantize_(model, "svdquant-r32")
    layer = model[0]
    assert isinstance(layer, SVDQuantLinearDeploy)
    w, s, d, u = lowbit.svd_quant_decompose(mlp(torch.bfloat16)[0].weight, 32)
    assert torch.equal(layer.w, w) and torch.equal(layer.s, s) and torch.equal(layer.down, d)
    assert torch.equal(layer(x), lowbit.svd_quant(x, w, s, d, u) + layer.bias)


@pytest.mark.parametrize("scheme", ["hif8-w8a8-ofmr", "hif8-w8a8-smoothquant", "fp8-w8a8-ofmr", "mxfp8-w8a8"])
def test_bf16_models_and_3d_inputs(scheme):
    model, x = mlp(torch.bfloat16), inputs(torch.bfloat16).reshape(4, 8, 128)
    reference = model(x).detach()
    lowbit.quantize(model, scheme)
    model(x)
    lowbit.convert(model)
    y = model(x)
    assert y.dtype == torch.bfloat16 and y.shape == (4, 8, 64)
    assert sqnr_db(reference, y) >= floor_db(scheme)


def test_degenerate_weights_give_finite_scales():
    model = nn.Sequential(nn.Linear(64, 8))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].weight[1] = 3e38  # overflowing row: max / 448 and / 16 stay finite
    x = torch.randn(4, 64)
    for scheme in ("hif8-wo", "fp8-wo", "hif8-cast", "int4-a16w4"):
        m = nn.Sequential(nn.Linear(64, 8))
        m.load_state_dict(model.state_dict())
        if scheme == "int4-a16w4":
            with torch.no_grad():
                m[0] = nn.Linear(128, 8)
                m[0].weight.zero_()
            xs = torch.randn(4, 128)
        else:
            xs = x
        lowbit.quantize_(m, scheme)
        buffers = dict(m[0].named_buffers())
        scale = buffers.get("scale", buffers.get("antiquant_scale"))
        assert torch.isfinite(scale.float()).all(), scheme
        assert (scale.float()[0] == 1.0).all() if scale.dim() == 1 else (scale.float() == 1.0).all()
        assert torch.isfinite(m(xs)[:, 0]).all(), scheme


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 16, 3, stride=2, padding="valid", groups=2, bias=False)
        self.head = nn.Linear(16 * 7 * 7, 10)

    def forward(self, x):
        h = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.head(h.flatten(1))


def independent_fake_quant(wtype, w, scale):
    """Q(w / s) * s through the reference element codecs (float32)."""
    u = w / scale
    q = hif8_reference.decode(hif8_reference.encode(u), torch.float32) if wtype == "hifloat8" else \
        u.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    return q * scale


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
@pytest.mark.parametrize("wtype", ["hifloat8", "float8_e4m3fn"])
def test_ofmr_conv2d(strategy, wtype, tmp_path):
    torch.manual_seed(0)
    model, x = SmallCNN(), torch.randn(4, 3, 16, 16)
    reference = model(x).detach()
    w1, b1 = model.conv1.weight.detach().clone(), model.conv1.bias.detach().clone()
    config = {"quant_cfg": {"weights": {"type": wtype, "symmetric": True, "strategy": strategy},
                            "inputs": {"type": wtype, "symmetric": True, "strategy": "tensor"}},
              "algorithm": "ofmr"}
    report = lowbit.quantize(model, config)
    assert {n: l.layer_type for n, l in report.layers.items()} == {"conv1": "Conv2d", "conv2": "Conv2d",
                                                                  "head": "Linear"}
    model(x)
    fake = model(x)
    lowbit.convert(model)
    assert torch.equal(model(x), fake)
    assert sqnr_db(reference, fake) >= 6.02 * 4 - 10 * math.log10(2 * 3)  # W and A, three layers
    # conv1's scales: per output channel (or one), the argmin of the output MSE over 2^-5 ... 2^5.
    y = torch.nn.functional.conv2d(x, w1, b1, padding=1)
    candidates = [2.0**e for e in range(-5, 6)]
    losses = torch.stack([
        (torch.nn.functional.conv2d(x, independent_fake_quant(wtype, w1, torch.tensor(c)), b1, padding=1) - y)
        .double().pow(2).sum(dim=(0, 2, 3) if strategy == "channel" else (0, 1, 2, 3)) / y.numel()
        for c in candidates]).float()
    expected = torch.tensor(candidates)[losses.argmin(dim=0)].reshape(-1)
    assert torch.equal(model.conv1.scale, expected)
    assert torch.equal(model.conv1.dequantized_weight(),
                       independent_fake_quant(wtype, w1, expected.reshape(-1, 1, 1, 1)))
    lowbit.save_quantized(model, tmp_path / "cnn")
    with torch.device("meta"):
        skeleton = SmallCNN()
    assert torch.equal(lowbit.load_quantized(tmp_path / "cnn", skeleton)(x), fake)


def test_conv2d_errors_and_skips():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding_mode="reflect", padding=1), nn.Conv2d(4, 4, 1))
    config = {"quant_cfg": {"weights": {"type": "hifloat8", "strategy": "channel"},
                            "inputs": {"type": "hifloat8", "strategy": "tensor"}}, "algorithm": "ofmr"}
    report = lowbit.quantize(model, config)
    assert report.skipped == {"0": "Conv2d padding_mode 'reflect' (AMCT needs 'zeros')"}
    with pytest.raises(lowbit.ShapeError, match=r"layer '1': input must be \(N, 4, H, W\)"):
        model[1](torch.randn(1, 3, 8, 8))
    weight_only = {"quant_cfg": {"weights": config["quant_cfg"]["weights"]}, "algorithm": "ofmr"}
    with pytest.raises(ValueError, match="weight-only OFMR is not supported for Conv2d"):
        lowbit.quantize(nn.Sequential(nn.Conv2d(3, 4, 1)).to(torch.bfloat16), weight_only)
    report = lowbit.quantize_(nn.Sequential(nn.Conv2d(3, 4, 1), nn.Linear(4, 4)), "hif8-wo")  # only OFMR takes Conv2d
    assert list(report.layers) == ["1"]


def test_convert_and_quantize_underscore_report_progress_per_layer():
    seen = []
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 64)).to(torch.bfloat16)
    lowbit.quantize_(model, "mxfp4-wo", progress=seen.append)
    assert seen == ["0", "2"]
    seen.clear()
    model = nn.Sequential(nn.Linear(64, 32)).to(torch.bfloat16)
    lowbit.quantize(model, "hif8-w8a8-minmax")
    model(torch.randn(4, 64, dtype=torch.bfloat16))
    report = lowbit.convert(model, progress=seen.append)
    assert seen == ["0"]
    assert report.scheme == "hif8-w8a8-minmax" and str(report).startswith("convert (hif8-w8a8-minmax)")


@pytest.mark.parametrize("scheme", ["int4-a16w4", "mxfp4-wo", "svdquant-r32"])
def test_a_converted_model_under_torch_compile_gives_the_eager_bits_in_and_out_of_inference_mode(scheme):
    """torch.compile sees the custom ops whole: the int4 layer's plan (Python and numpy) under inference mode
    broke dynamo's guards ("Guard failed on the same frame it was created")."""
    model = nn.Sequential(nn.Linear(128, 64)).bfloat16()
    lowbit.quantize_(model, scheme)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0)).bfloat16()
    want = model(x)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    assert torch.equal(compiled(x), want)
    with torch.inference_mode():
        assert torch.equal(compiled(x), want)


@pytest.mark.parametrize("scheme", ["hif8-w8a8-minmax", "hif8-wo", "int4-a16w4"])
def test_a_model_between_quantize_and_convert_and_every_scheme_can_be_copied_and_pickled(scheme):
    """The schemes' configs were read-only MappingProxyType mappings, which neither deepcopy nor pickle take."""
    assert copy.deepcopy(lowbit.SCHEMES[scheme]) == lowbit.SCHEMES[scheme]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 64))
    lowbit.quantize(model, scheme)
    clones = [copy.deepcopy(model), pickle.loads(pickle.dumps(model))]
    x = torch.randn(4, 128)
    for m in (model, *clones):  # the same calibration batch (where the scheme takes one), then convert
        m(x)
        lowbit.convert(m)
    assert all(torch.equal(clone(x), model(x)) for clone in clones)


def test_a_failed_calibration_starts_over_and_an_empty_batch_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64))
    lowbit.quantize(model, "hif8-w8a8-minmax")
    with pytest.raises(lowbit.ShapeError, match="layer '0': a calibration batch needs elements, got shape \\(0, 64\\)"):
        model(torch.randn(0, 64))
    bad = torch.randn(2, 64)
    bad[0, 0] = float("nan")
    starts_over = "layer '0': .*not finite.*; the layer's calibration starts over \\(1 calls\\)"
    with pytest.raises(RuntimeError, match=starts_over):
        model(bad)
    assert not model[0].calibrated and model[0].calls == 0
    model(torch.randn(2, 64))  # a good batch calibrates it: it was stuck counting calls past batch_num
    lowbit.convert(model)
    assert type(model[0]).__name__ == "PackedLinear"


@pytest.mark.parametrize("scheme", ["hif8-wo", "int4-a16w4", "hif8-w8a8-minmax"])
@pytest.mark.parametrize("called_before", [False, True])
def test_weights_changed_after_quantize_are_refused_not_used_stale(scheme, called_before):
    """(The fake quant and convert used the scales and packed weight of the old weights, without an error.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 64))
    lowbit.quantize(model, scheme)
    x = torch.randn(2, 128)
    if called_before:
        model(x)
    model.load_state_dict(nn.Sequential(nn.Linear(128, 64)).state_dict())
    with pytest.raises(RuntimeError, match="layer '0': its weight or bias changed after lowbit.quantize"):
        model(x)
    calibrated = model[0].calibrated  # (else convert names the calls missing first)
    with pytest.raises(RuntimeError, match="its weight or bias changed" if calibrated else "not calibrated"):
        lowbit.convert(model)
    assert isinstance(model[0], CalibrationModule)  # convert replaced nothing


def test_a_second_quantize_reports_the_layers_already_quantized():
    model = nn.Sequential(nn.Linear(128, 64), nn.Linear(64, 32))
    lowbit.quantize_(model, "hif8-wo")
    for call, scheme in ((lowbit.quantize_, "mxfp4-wo"), (lowbit.quantize, "hif8-w8a8-minmax")):
        report = call(model, scheme)
        assert [(layer.name, layer.status, layer.reason) for layer in report.layers.values()] == [
            (name, "skipped", "already quantized by lowbit (PackedLinear)") for name in ("0", "1")]


@pytest.mark.parametrize("flow", ["quantize_", "quantize-convert"])
def test_forward_hooks_move_to_the_quantized_layer(flow):
    """A layer's forward hooks were dropped with the module it replaced: a pre-hook scaling x by 10 and a hook
    adding 100 to y silently stopped running. They now run on the quantized layer, and their handles remove
    them there."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))
    x = torch.randn(3, 64)
    calls = []

    def scale_input(module, args):
        calls.append(("pre", type(module).__name__))
        return (args[0] * 10,)

    def shift_output(module, args, kwargs, y):
        calls.append(("post", type(module).__name__))
        return y + 100

    handles = [model[0].register_forward_pre_hook(scale_input),
               model[2].register_forward_hook(shift_output, with_kwargs=True)]
    if flow == "quantize_":
        lowbit.quantize_(model, "hif8-wo")
    else:
        lowbit.quantize(model, "hif8-w8a8-minmax")
        model(x)
        lowbit.convert(model)
    calls.clear()
    y = model(x)
    assert calls == [("pre", type(model[0]).__name__), ("post", type(model[2]).__name__)]
    assert not isinstance(model[0], nn.Linear) and not isinstance(model[2], nn.Linear)
    for handle in handles:
        handle.remove()
    plain = model(x)
    assert torch.equal(y, model[2](model[1](model[0](x * 10))) + 100) and not torch.equal(y, plain + 100)
    assert len(calls) == 2 and not model[0]._forward_pre_hooks and not model[2]._forward_hooks


class _Doubled(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class _Plain(nn.Linear):
    pass


def test_layers_whose_computation_or_hooks_a_quantized_layer_would_lose_are_skipped_with_the_reason():
    """An nn.Linear subclass with its own forward was replaced by a plain quantized layer (its output halved,
    silently); backward and state-dict hooks would be lost the same way. A subclass that only inherits is
    quantized."""
    model = nn.Sequential(_Doubled(64, 64), _Plain(64, 64), nn.Linear(64, 64), nn.Linear(64, 64),
                          nn.Conv2d(4, 4, 1), torch.nn.utils.weight_norm(nn.Linear(64, 64)),
                          torch.nn.utils.parametrizations.spectral_norm(nn.Linear(64, 64)))
    model[2].register_full_backward_hook(lambda module, grad_in, grad_out: None)
    model[3].register_state_dict_post_hook(lambda module, state_dict, prefix, local_metadata: None)
    model[4].register_full_backward_hook(lambda module, grad_in, grad_out: None)  # not a candidate: not listed
    report = lowbit.quantize_(model, "hif8-wo")
    assert {name: (layer.status, layer.reason) for name, layer in report.layers.items()} == {
        "0": ("skipped", "its class _Doubled overrides Linear's forward, which the quantized layer would not "
                         "compute"),
        "1": ("converted", ""),
        "2": ("skipped", "it has backward hooks, which a quantized layer cannot keep (remove them to quantize it)"),
        "3": ("skipped", "it has state-dict hooks, which a quantized layer cannot keep (remove them to quantize "
                         "it)"),
        "5": ("skipped", "a WeightNorm hook recomputes its weight before each call (remove it, e.g. with "
                         "torch.nn.utils.remove_weight_norm, to quantize the layer)"),
        "6": ("skipped", "its weight is parametrized (torch.nn.utils.parametrize), which a quantized layer would "
                         "freeze (remove the parametrizations, e.g. with parametrize.remove_parametrizations, to "
                         "quantize it)")}
    assert type(model[0]) is _Doubled and not isinstance(model[1], nn.Linear)


def _fp16_layer(scheme, big):
    torch.manual_seed(0)
    linear = nn.Linear(64, 8).half()
    if big:
        with torch.no_grad():
            linear.weight[0, 0] = 60000  # the block's E8M0 scale rounds up: 65536, not an FP16 value
    model = nn.Sequential(linear)
    lowbit.quantize(model, scheme)
    return model


def test_fp16_mxfp4_weights_that_are_not_fp16_values_take_the_fake_quants_path():
    """(The fused kernel summed 65536 in float32: a finite output where fake quant and the dequantize path give
    -Inf.)"""
    x = torch.randn(3, 64).half()
    model = _fp16_layer("mxfp4-wo", big=True)
    fake = model(x)
    lowbit.convert(model)
    assert torch.isinf(fake[:, 0]).all() and torch.equal(model(x), fake) and torch.equal(model(x), fake)
    assert model[0].__dict__.get("_fused_input") is None
    normal = _fp16_layer("mxfp4-wo", big=False)
    normal_fake = normal(x)
    lowbit.convert(normal)
    assert torch.equal(normal(x), normal_fake) and normal[0].__dict__["_fused_input"] is not None  # fused
    normal[0].load_state_dict(model[0].state_dict())  # now holding the 65536 weight: the check runs again
    assert torch.equal(normal(x), fake) and normal[0].__dict__.get("_fused_input") is None


def test_per_position_scales_of_another_sequence_length_are_refused_naming_the_layer():
    """AMCT's static per-position activation scales (compat mode, Quantile, 'token'): a call of another sequence
    length raised a ShapeError without the layer's name."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).bfloat16()
    config = {"batch_num": 1, "algorithm": "quantile",
              "quant_cfg": {"weights": {"type": "hifloat8", "symmetric": True, "strategy": "tensor"},
                            "inputs": {"type": "hifloat8", "symmetric": True, "strategy": "token"}}}
    lowbit.quantize(model, config, amct_compat=True)
    with torch.no_grad():
        model(torch.randn(2, 5, 64, dtype=torch.bfloat16))
    with pytest.raises(lowbit.ShapeError, match="layer '0': static per-position activation scales were calibrated "
                                                "for sequence length 5, got input shape \\(1, 7, 64\\)"):
        model(torch.randn(1, 7, 64, dtype=torch.bfloat16))


def test_a_lazy_layer_not_yet_initialized_is_skipped_with_the_reason():
    """An uninitialized nn.LazyLinear raised torch's error about uninitialized parameters, naming no layer."""
    model = nn.Sequential(nn.LazyLinear(32), nn.Linear(32, 16))
    report = lowbit.quantize_(model, "hif8-wo")
    assert (report.layers["0"].status, report.layers["0"].reason) == (
        "skipped", "its weight is not initialized yet (a lazy module: run the model once before quantizing it)")
    model(torch.randn(2, 64))
    assert lowbit.quantize_(model, "hif8-wo").layers["0"].status == "converted"


def test_hooks_a_deploy_module_cannot_keep_added_since_quantize_make_convert_refuse():
    """A state-dict or backward hook registered on a calibrating layer was dropped by convert silently."""
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 16))
    lowbit.quantize(model, "hif8-w8a8-minmax")
    handle = model[1].register_state_dict_post_hook(lambda module, state_dict, prefix, local_metadata: None)
    model(torch.randn(3, 64))
    with pytest.raises(RuntimeError, match="convert: layers a deploy module cannot replace: 1 \\(it has state-dict "
                                           "hooks"):
        lowbit.convert(model)
    assert isinstance(model[0], CalibrationModule) and isinstance(model[1], CalibrationModule)
    handle.remove()
    assert lowbit.convert(model).layers["1"].status == "converted"
