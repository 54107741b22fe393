"""Config validation: AMCT's errors (type and message prefix), lowbit's extra checks, model left unchanged."""

import copy

import pytest
import torch
from torch import nn

import lowbit
from lowbit.errors import DtypeError, ShapeError
from lowbit.quantize.config import QuantConfig
from lowbit.quantize.modules import CalibrationModule

HIF8 = {"type": "hifloat8", "symmetric": True, "strategy": "tensor"}


def cfg(weights=HIF8, inputs=None, algorithm="ofmr", **top):
    quant_cfg = {} if weights is None else {"weights": weights}
    if inputs is not None:
        quant_cfg["inputs"] = inputs
    return {"quant_cfg": quant_cfg, "algorithm": algorithm, **top}


AMCT_ERRORS = [
    (cfg(batch_num=0), "Batch num only support positive int"),
    (cfg(batch_num=1.5), "Batch num only support positive int"),
    (cfg({"type": "int2"}), "Weights quant_dtype only support"),
    (cfg({**HIF8, "symmetric": "yes"}), "Weights symmetric only support bool [True, False]"),
    (cfg({**HIF8, "symmetric": False}), "Weights symmetric only support to be True when weight quant_type is hifloat8"),
    (cfg({**HIF8, "strategy": "row"}), "Weights strategy only support"),
    (cfg({**HIF8, "group_size": 32}), "Weights group_size only support strategy group"),
    (cfg({"type": "int4", "strategy": "group"}), "Weights group_size is necessary, when weights strategy is group"),
    (cfg({"type": "int4", "strategy": "group", "group_size": -32}), "group_size only support positive int"),
    (cfg({"type": "hifloat8", "strategy": "group", "group_size": 32}), "Weights group_size only support for weight dtype"),
    (cfg({"type": "mxfp4_e2m1", "strategy": "group", "group_size": 64}), "wts_type mxfp4_e2m1 only support group_size value"),
    (cfg(inputs={"type": "float16"}), "Inputs quant_dtype only support"),
    (cfg(inputs={**HIF8, "symmetric": 1}), "Inputs symmetric only support bool"),
    (cfg(inputs={**HIF8, "symmetric": False}), "Inputs symmetric is unsupported to be False when Inputs quant_type is hifloat8"),
    (cfg(inputs={**HIF8, "strategy": "channel"}), "Inputs strategy only support"),
    (cfg(inputs={"type": "int8", "symmetric": False, "strategy": "token"}), "Inputs strategy token do not support asymmetric"),
    (cfg(inputs={**HIF8, "dynamic": True}), "Inputs dynamic only support strategy ['token']"),
    (cfg(weights=None), "Configuration must include at least one weights configuration"),
    (cfg(algorithm=["ofmr"]), "invalid algo name, pls check config"),
    (cfg(algorithm="magic"), "Not support algorithm magic, pls regiter it first"),
    (cfg(algorithm={"awq": {}}), "Awq grids_num is necessary param"),
    (cfg(algorithm={"awq": {"grids_num": 0}}), "Awq grids_num only support positive int"),
    (cfg(algorithm={"smoothquant": {}}), "Smoothquant smooth_strength is necessary param"),
    (cfg(algorithm={"smoothquant": {"smooth_strength": 1}}), "Smoothquant smooth_strength only support float (0, 1)"),
    (cfg(algorithm={"smoothquant": {"smooth_strength": 1.0}}), "Smoothquant smooth_strength only support float (0, 1)"),
    (cfg(skip_layers=["a", 3]), "Skip layers must be str"),
]

COMBINATION_ERRORS = [
    (cfg({"type": "hifloat8"}, {"type": "float8_e4m3fn"}), "Do not support combination float8_e4m3fn hifloat8"),
    (cfg({"type": "hifloat8"}, HIF8, "mxquant"), "Algorithm mxquant do not support act and weight quant dtype hifloat8 hifloat8"),
    (cfg({"type": "int4", "symmetric": False}, {"type": "int8"}, "minmax"), "int8 int4 only support symmetric weight"),
    (cfg({"type": "int4", "strategy": "group", "group_size": 32}, {"type": "int8"}, "minmax"),
     "int8 int4 only support weight quant strategy tensor or channel"),
    (cfg({"type": "float8_e4m3fn", "strategy": "tensor"}, {"type": "float8_e4m3fn", "strategy": "token"}),
     "act_dtype and wts_dtype float8_e4m3fn float8_e4m3fn do not support activation quant strategy token"),
    (cfg({"type": "mxfp8_e4m3fn", "strategy": "group", "group_size": 32}, {"type": "mxfp8_e4m3fn", "strategy": "tensor"},
         "mxquant"), "act_dtype and wts_dtype mxfp8_e4m3fn mxfp8_e4m3fn only support activation quant strategy group"),
    (cfg({"type": "int4", "strategy": "group", "group_size": 48}, None, "minmax"),
     "act_type and wts_type NOT_QUANTIZE int4 only support group_size larger than 32 and integer multiple of 32"),
    (cfg({"type": "hifloat8", "strategy": "group", "group_size": 32}, None, "cast"), "Weights group_size only support"),
]


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))


def assert_unchanged(m, before):
    assert [type(x) for x in m.modules()] == [type(x) for x in before.modules()]
    for (k, a), (_, b) in zip(m.state_dict().items(), before.state_dict().items()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("compat", [True, False])
@pytest.mark.parametrize("config, message", AMCT_ERRORS + COMBINATION_ERRORS)
def test_amct_errors_leave_the_model_unchanged(config, message, compat):
    m = model()
    before = copy.deepcopy(m)
    with pytest.raises(ValueError) as info:
        lowbit.quantize(m, config, amct_compat=compat)
    assert str(info.value).startswith(message)
    assert_unchanged(m, before)


@pytest.mark.parametrize("config, key", [
    ({**cfg(), "quant": 1}, "quant"),
    (cfg({**HIF8, "axis": 0}), "axis"),
    (cfg(inputs={**HIF8, "round_mode": "rint"}), "round_mode"),
    ({"quant_cfg": {"weights": HIF8, "fc.weights": HIF8}, "algorithm": "cast"}, "fc.weights"),
    (cfg(algorithm={"cast": {"alpha": 0.5}}), "alpha"),
])
def test_a_key_amct_does_not_know_is_named(config, key):
    m = model()
    before = copy.deepcopy(m)
    with pytest.raises(ValueError, match=key):
        lowbit.quantize(m, config)
    assert_unchanged(m, before)


def test_amct_type_errors():
    with pytest.raises(TypeError, match="model must be"):
        lowbit.quantize("not a model", cfg())
    with pytest.raises(TypeError, match="config must be dict"):
        lowbit.quantize(model(), ["ofmr"])
    with pytest.raises(TypeError, match="Inputs quant_dtype is unset"):  # AMCT fails building the comb
        lowbit.quantize(model(), cfg(inputs={"symmetric": True}), amct_compat=True)
    with pytest.raises(TypeError, match="Inputs quant_dtype is unset"):  # 'inputs': {} as well
        lowbit.quantize(model(), cfg(inputs={}), amct_compat=True)
    assert not QuantConfig.from_dict(cfg(inputs={})).inputs.enabled  # default: {} means weight-only


def test_quirk_decisions_in_config():
    # No algorithm: AMCT quantizes nothing (compat warns); default raises.
    with pytest.raises(ValueError, match="no algorithm"):
        lowbit.quantize(model(), cfg(algorithm=None))
    with pytest.warns(UserWarning, match="no algorithm"):
        report = lowbit.quantize(model(), cfg(algorithm=None), amct_compat=True)
    assert report.quantized == []
    # Several algorithms for Linear: AMCT takes the last; default raises.
    with pytest.raises(ValueError, match="give exactly one"):
        lowbit.quantize(model(), cfg({"type": "hifloat8", "strategy": "channel"}, HIF8, {"cast": None, "ofmr": None}))
    m = model()
    lowbit.quantize(m, cfg({"type": "hifloat8", "strategy": "channel"}, HIF8, {"cast": None, "ofmr": None}),
                    amct_compat=True)
    assert m[0].layer_config.algorithm.name == "ofmr"
    # skip_layers as a str is one pattern in both modes (AMCT would iterate its characters).
    m = model().to(torch.bfloat16)
    with pytest.warns(UserWarning, match="one pattern"):
        report = lowbit.quantize(m, cfg(skip_layers="2"), amct_compat=True)
    assert report.skipped == {"2": "matched skip_layers entry '2'"}
    # OFMR ignores token in AMCT; lowbit's default rejects it.
    with pytest.raises(ValueError, match="token"):
        lowbit.quantize(model(), cfg(HIF8, {**HIF8, "strategy": "token"}))
    # batch_num=True: accepted as 1 by AMCT only.
    assert QuantConfig.from_dict(cfg(batch_num=True), amct_compat=True).batch_num == 1
    with pytest.raises(ValueError, match="Batch num"):
        QuantConfig.from_dict(cfg(batch_num=True))


def test_lowbit_extensions_are_rejected_in_compat_mode():
    with pytest.raises(ValueError, match="Weights quant_dtype only support"):
        lowbit.quantize(model(), "hif4-wo", amct_compat=True)
    with pytest.raises(ValueError, match="Inputs quant_dtype only support"):
        lowbit.quantize(model(), "svdquant-r32", amct_compat=True)
    with pytest.raises(ValueError, match="Not support algorithm svdquant"):
        mxfp4 = {"type": "mxfp4_e2m1", "strategy": "group", "group_size": 32}
        lowbit.quantize(model(), cfg(mxfp4, None, {"svdquant": {"rank": 32}}), amct_compat=True)
    with pytest.raises(ValueError, match="Algorithm minmax do not support"):
        lowbit.quantize(model(), "fp8-wo", amct_compat=True)


def test_fuzzy_overrides_and_skip_layers():
    m = nn.Sequential()
    m.add_module("q_proj", nn.Linear(64, 64))
    m.add_module("k_proj", nn.Linear(64, 64))
    m.add_module("lm_head", nn.Linear(64, 32))
    config = {"quant_cfg": {"weights": {"type": "hifloat8", "strategy": "channel"},
                            "*k_proj.weights": {"type": "hifloat8", "strategy": "tensor"}},
              "algorithm": "cast", "skip_layers": ["lm_head"]}
    report = lowbit.quantize(m, config)
    assert m.q_proj.layer_config.weights.strategy == "channel"
    assert m.k_proj.layer_config.weights.strategy == "tensor"
    assert report.skipped == {"lm_head": "matched skip_layers entry 'lm_head'"}
    assert type(m.lm_head) is nn.Linear


def test_default_mode_validates_each_override_with_the_combination_rules():
    config = {"quant_cfg": {"weights": {"type": "hifloat8", "strategy": "channel"},
                            "*0.weights": {"type": "int8", "strategy": "channel"}}, "algorithm": "cast"}
    m = model()
    before = copy.deepcopy(m)
    with pytest.raises(ValueError, match="Algorithm cast do not support act and weight quant dtype NOT_QUANTIZE int8"):
        lowbit.quantize(m, config)
    assert_unchanged(m, before)


def test_unknown_scheme_and_unimplemented_combinations():
    m = model()
    before = copy.deepcopy(m)
    with pytest.raises(ValueError, match="unknown quantization scheme 'hif9'"):
        lowbit.quantize(m, "hif9")
    with pytest.raises(ValueError, match="does not implement algorithm 'awq'"):
        lowbit.quantize(m, cfg({"type": "int4", "strategy": "group", "group_size": 32}, None, {"awq": {"grids_num": 20}}))
    with pytest.raises(ValueError, match="does not implement int8 activation"):
        lowbit.quantize(m, cfg({"type": "int8", "strategy": "channel"}, {"type": "int8"}, "minmax"))
    with pytest.raises(ValueError, match="kvcache"):
        lowbit.quantize(m, {"quant_cfg": {"weights": HIF8, "kvcache": HIF8}, "algorithm": "quantile"})
    assert_unchanged(m, before)


def test_group_size_that_does_not_divide_k_names_the_layer():
    m = nn.Sequential(nn.Linear(256, 64), nn.Linear(64, 32), nn.Linear(32, 8))  # K = 256, 64, 32
    before = copy.deepcopy(m)
    with pytest.raises(ShapeError, match="layer '1': group size 128 does not divide K = 64"):
        lowbit.quantize(m, "int4-a16w4")
    assert_unchanged(m, before)
    with pytest.raises(ShapeError, match="layer '2': group size 64 does not divide K = 32"):
        lowbit.quantize_(m, "hif4-wo")
    with pytest.raises(ShapeError, match="svdquant rank 32 exceeds"):
        lowbit.quantize_(nn.Sequential(nn.Linear(64, 16)), "svdquant-r32")
    assert_unchanged(m, before)


def test_compat_mode_skips_what_amct_skips_and_says_why():
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32).to(torch.bfloat16))
    report = lowbit.quantize(m, "hif8-wo", amct_compat=True)
    assert report.skipped == {"0": "weight dtype torch.float32 not supported by AMCT for NOT_QUANTIZE hifloat8"}
    assert report.quantized == ["1"]
    report = lowbit.quantize_(nn.Sequential(nn.Linear(64, 64)), "hif8-wo")  # default: every float dtype
    assert report.quantized == ["0"]


def test_calibration_data_of_the_wrong_shape_or_dtype_is_rejected_before_recording():
    m = model()
    lowbit.quantize(m, "hif8-w8a8-ofmr")
    with pytest.raises(ShapeError, match="layer '0': input must be"):
        m(torch.randn(4, 63))
    with pytest.raises(DtypeError, match="layer '0'"):
        m(torch.randn(4, 64, dtype=torch.float64))
    assert m[0].calls == 0 and not m[0].calibrated


def test_convert_names_uncalibrated_layers_and_leaves_the_model_unchanged():
    m = model()
    lowbit.quantize(m, {**cfg({"type": "hifloat8", "strategy": "tensor"}, HIF8), "batch_num": 2})
    m(torch.randn(4, 64))
    with pytest.raises(RuntimeError, match=r"0 \(1/2 calls\), 2 \(1/2 calls\)"):
        lowbit.convert(m)
    assert isinstance(m[0], CalibrationModule) and isinstance(m[2], CalibrationModule)


def test_quantize_underscore_refuses_schemes_that_need_calibration():
    m = model()
    before = copy.deepcopy(m)
    with pytest.raises(ValueError, match="needs calibration data"):
        lowbit.quantize_(m, "hif8-w8a8-ofmr")
    assert_unchanged(m, before)


def test_calibration_returns_float_outputs_then_fake_quant():
    m = model()
    x = torch.randn(8, 64)
    ref = m(x)
    lowbit.quantize(m, "hif8-w8a8-ofmr")
    assert torch.equal(m(x), ref)  # call 1 of batch_num = 1: statistics only
    assert m[0].calibrated
    assert not torch.equal(m(x), ref)


def test_report_is_printable_and_json_able():
    import json

    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32))
    m.add_module("lm_head", nn.Linear(32, 8))
    report = lowbit.quantize_(m, "hif8-wo")
    text = str(report)
    assert "lm_head" in text and "matched skip_layers entry 'lm_head'" in text and "total" in text
    d = json.loads(json.dumps(report.to_dict()))
    assert d["layers"]["0"]["status"] == "converted" and d["totals"]["skipped"] == 1
    assert d["totals"]["bytes_before"] == (64 * 64 + 64 * 32) * 4
    assert d["layers"]["lm_head"]["bytes_before"] == d["layers"]["lm_head"]["bytes_after"] == 32 * 8 * 4


def test_non_finite_calibration_data_is_an_error_naming_the_layer_not_an_inf_scale():
    m = model()
    lowbit.quantize(m, "hif8-w8a8-minmax")
    x = torch.randn(4, 64)
    x[0, 0] = float("inf")
    with pytest.raises(RuntimeError, match="layer '0': quantization scale is not finite"):
        m(x)
    m = model()
    lowbit.quantize(m, "hif8-w8a8-ofmr")
    x[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="layer '0': ofmr: every candidate scale gave a non-finite output error"):
        m(x)
