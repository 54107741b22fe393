"""Inputs that used to crash or break a model: tensors at odd offsets of a larger buffer, an ``out`` whose
elements share memory, attention layers whose weights torch reads directly, layers on the meta device or
with empty weights."""

import copy

import pytest
import torch
from torch import nn

import lowbit
from lowbit.errors import DeviceError, ShapeError


def _at_odd_offset(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` that starts one element into a larger buffer."""
    buffer = torch.empty(t.numel() + 1, dtype=t.dtype)
    view = buffer[1:].view(t.shape)
    view.copy_(t)
    return view


def test_operands_and_outputs_at_odd_offsets_give_the_aligned_result():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=g)
    codes, scales = lowbit.mxfp4_quantize(x)
    got_codes, got_scales = lowbit.mxfp4_quantize(_at_odd_offset(x))
    assert torch.equal(got_codes, codes) and torch.equal(got_scales, scales)
    out = _at_odd_offset(torch.zeros(4, 64))
    lowbit.mxfp4_dequantize(codes, scales, out=out)
    assert torch.equal(out, lowbit.mxfp4_dequantize(codes, scales))
    w, s, d, u = lowbit.svd_quant_decompose(torch.randn(64, 128, generator=g).bfloat16(), 8)
    xb = torch.randn(3, 128, generator=g).bfloat16()
    assert torch.equal(lowbit.svd_quant(_at_odd_offset(xb), w, s, d, u), lowbit.svd_quant(xb, w, s, d, u))
    half = torch.randn(5, 64, generator=g).half()
    assert torch.equal(lowbit.encode_to_hifloat8(_at_odd_offset(half)), lowbit.encode_to_hifloat8(half))


@pytest.mark.parametrize("out", [
    lambda: torch.empty(1, dtype=torch.uint8).expand(4, 64),
    lambda: torch.zeros(80, dtype=torch.uint8).as_strided((4, 64), (1, 1)),  # wrote garbage, no error
    lambda: torch.zeros(200, dtype=torch.uint8).as_strided((4, 64), (40, 1)),
])
def test_an_out_whose_elements_share_memory_is_a_shape_error(out):
    x = torch.randn(4, 64).half()
    with pytest.raises(ShapeError, match=r"out has elements that may share memory \(strides"):
        lowbit.encode_to_hifloat8(x, out=out())


@pytest.mark.parametrize("out", [
    lambda: torch.zeros(64, 4, dtype=torch.uint8).t(),
    lambda: torch.zeros(4, 128, dtype=torch.uint8)[:, ::2],
    lambda: torch.zeros(4, 64, dtype=torch.uint8).flip(1),
    lambda: torch.zeros(300, dtype=torch.uint8).as_strided((4, 64), (70, 1)),
])
def test_an_out_of_any_layout_whose_elements_are_apart_is_written(out):
    x = torch.randn(4, 64).half()
    target = out()
    lowbit.encode_to_hifloat8(x, out=target)
    assert torch.equal(target, lowbit.encode_to_hifloat8(x))


def test_outputs_that_share_memory_with_each_other_are_a_shape_error():
    """(codes and scales in one buffer: the codes were silently wrong); outputs in one buffer that do not
    share memory, contiguous or interleaved, are written."""
    x = torch.randn(4, 64).bfloat16()
    buf = torch.zeros(144, dtype=torch.uint8)
    with pytest.raises(ShapeError, match=r"mxfp4_quantize: out\[0\] and out\[1\] share memory"):
        lowbit.mxfp4_quantize(x, out=(buf[:128].view(4, 32), buf[120:128].view(4, 2)))
    with pytest.raises(ShapeError, match=r"hifloat4_pack: out\[0\] and out\[1\] share memory"):
        lowbit.hifloat4_pack(x, out=(buf[112:128].view(4, 1, 4), buf[:128].view(4, 32)))
    strided = torch.zeros(4, 64, dtype=torch.uint8)  # scales on bytes 0 and 2 of each row of codes
    for backend in ("native", "reference"):
        with pytest.raises(ShapeError, match=r"mxfp4_quantize: out\[0\] and out\[1\] share memory"):
            lowbit.mxfp4_quantize(x, out=(strided[:, :32], strided[:, 0:4:2]), backend=backend)
    want = lowbit.mxfp4_quantize(x)
    rows = torch.zeros(4, 34, dtype=torch.uint8)  # each row's codes then its scales: interleaved, apart
    pairs = torch.zeros(4, 64, dtype=torch.uint8)
    for codes, scales in ((buf[:128].view(4, 32), buf[128:136].view(4, 2)), (rows[:, :32], rows[:, 32:]),
                          (pairs[:, ::2], pairs[:, 1::2][:, :2])):
        lowbit.mxfp4_quantize(x, out=(codes, scales))
        assert torch.equal(codes, want[0]) and torch.equal(scales, want[1])


@pytest.mark.parametrize("scheme", ["hif8-wo", "mxfp4-wo"])
def test_a_transformer_encoder_layer_keeps_working(scheme, tmp_path):
    """nn.MultiheadAttention multiplies by out_proj.weight itself (out_proj is skipped, with the reason), and
    the encoder's fused eval path, which reads linear1.weight directly, is not taken: the quantized
    modules' forward runs. Saved and loaded, the model gives the same output."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)).eval()
    x = torch.randn(2, 5, 64)
    model = copy.deepcopy(base)
    report = lowbit.quantize_(model, scheme)
    assert "MultiheadAttention" in report.skipped["0.self_attn.out_proj"]
    assert report.quantized == ["0.linear1", "0.linear2"]
    with torch.no_grad():
        got, want = model(x), base(x)
        assert (got - want).abs().max() < 0.2 * want.abs().max()
        lowbit.save_quantized(model, tmp_path / "q")
        assert torch.equal(lowbit.load_quantized(tmp_path / "q", copy.deepcopy(base))(x), got)


def test_a_calibrated_transformer_encoder_layer_converts():
    torch.manual_seed(1)
    model = nn.Sequential(nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)).eval()
    x = torch.randn(2, 5, 64)
    lowbit.quantize(model, "hif8-w8a8-ofmr")
    with torch.no_grad():
        model(x)
        lowbit.convert(model)
        assert model(x).isfinite().all()


def test_a_layer_on_the_meta_device_is_a_device_error_and_the_model_is_unchanged():
    model = nn.Sequential(nn.Linear(128, 128, device="meta"), nn.Linear(128, 64))
    with pytest.raises(DeviceError, match="meta"):
        lowbit.quantize_(model, "hif8-wo")
    assert type(model[0]) is nn.Linear and type(model[1]) is nn.Linear


@pytest.mark.parametrize("shape", [(64, 0), (0, 64)])
def test_a_layer_with_an_empty_weight_is_skipped(shape):
    model = nn.Sequential(nn.Linear(*shape), nn.Linear(64, 64) if shape[1] == 64 else nn.Identity())
    report = lowbit.quantize_(model, "hif8-wo")
    assert report.skipped["0"].startswith("empty weight")


def test_arguments_of_the_wrong_kind_are_named():
    x, w = torch.randn(2, 256).half(), torch.randint(0, 256, (256, 32), dtype=torch.uint8)
    with pytest.raises(TypeError, match="antiquant_scale must be a tensor"):
        lowbit.weight_quant_batch_matmul(x, w, None)
    with pytest.raises(TypeError, match="antiquant_scale must be a tensor"):
        lowbit.plan_weight_quant_batch_matmul(2, 256, 64, dtype=torch.float16).run(x, w, None)
    with pytest.raises(TypeError, match="codes must be a tensor, got list"):
        lowbit.mxfp4_dequantize([1, 2], torch.zeros(1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="qdim = .* int64"):
        lowbit.hifloat4_fake_quant(torch.randn(4, 64).bfloat16(), 2**70)


def test_mxfp4_linear_takes_the_float4_and_e8m0_views_too():
    codes, scales = lowbit.mxfp4_quantize(torch.randn(8, 64))
    x = torch.randn(2, 64).bfloat16()
    views = (codes.view(torch.float4_e2m1fn_x2), scales.view(torch.float8_e8m0fnu))
    assert torch.equal(lowbit.mxfp4_linear(x, *views), lowbit.mxfp4_linear(x, codes, scales))


@pytest.mark.parametrize("field, value", [("weight_type", "nope"), ("act_kind", [1]), ("weight_dtype", 3),
                                          ("tensors", "x"), ("out_features", "a")])
def test_a_corrupted_layer_description_is_a_checkpoint_error(field, value, tmp_path):
    import json

    from lowbit.quantize.checkpoint import CheckpointError

    base = nn.Sequential(nn.Linear(64, 64))
    model = copy.deepcopy(base)
    lowbit.quantize_(model, "hif8-wo")
    lowbit.save_quantized(model, tmp_path)
    path = tmp_path / "quantization.json"
    meta = json.loads(path.read_text())
    meta["layers"]["0"][field] = value
    path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="quantization.json: layer '0'"):
        lowbit.load_quantized(tmp_path, copy.deepcopy(base))


def test_a_layer_registered_under_two_names_is_skipped_with_both_names():
    shared = nn.Linear(64, 64)
    model = nn.Sequential(shared, nn.ReLU(), shared, nn.Linear(64, 32))
    report = lowbit.quantize_(model, "hif8-wo")
    assert "['0', '2']" in report.skipped["0"] and report.quantized == ["3"]
    assert model[0] is shared and model[2] is shared


def test_other_wrong_arguments_are_named():
    with pytest.raises(DeviceError, match="npu"):
        lowbit.plan_weight_quant_batch_matmul(2, 256, 64, device="npu")
    with pytest.raises(TypeError, match="nn.Module"):
        lowbit.save_quantized("x", "somewhere")
    with pytest.raises(TypeError, match="nn.Linear"):
        lowbit.SVDQuantLinear.from_linear(nn.Conv2d(3, 3, 1))
    with pytest.raises(TypeError, match="dense"):
        lowbit.encode_to_hifloat8(torch.randn(4, 64).half().to_sparse())


def test_a_model_without_quantized_layers_is_not_saved(tmp_path):
    """A float model (never quantized, or every layer skipped) is refused before anything is written."""
    with pytest.raises(ValueError, match="no layer quantized by lowbit"):
        lowbit.save_quantized(nn.Sequential(nn.Linear(64, 32)), tmp_path / "q")
    shared = nn.Linear(64, 64)
    model = nn.Sequential(shared, nn.ReLU(), shared)  # a layer used twice is skipped
    assert lowbit.quantize_(model, "hif8-wo").quantized == []
    with pytest.raises(ValueError, match="no layer quantized by lowbit"):
        lowbit.save_quantized(model, tmp_path / "q")
    assert not (tmp_path / "q").exists()


def test_verify_with_infinite_tolerances_or_a_directory(tmp_path, capsys):
    import numpy as np

    from lowbit.cli.main import main

    np.asarray([1.0, 0.0, 2.0], dtype=np.float16).tofile(tmp_path / "out.bin")
    np.asarray([1.0, 0.0, 3.0], dtype=np.float16).tofile(tmp_path / "golden.bin")
    for option in ("--atol", "--rtol"):
        assert main(["verify", str(tmp_path / "out.bin"), str(tmp_path / "golden.bin"), option, "inf"]) == 0
        assert capsys.readouterr().err == ""  # no numpy warnings
    assert main(["verify", str(tmp_path), str(tmp_path / "golden.bin")]) == 2
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("scheme", ["mxfp4-wo", "int4-a16w4"])
def test_a_transformer_encoder_stack_with_a_padding_mask(scheme):
    """nn.TransformerEncoder's own nested-tensor path (eval, a padding mask) read layers[0].linear1.weight."""
    torch.manual_seed(2)
    layer = nn.TransformerEncoderLayer(128, 4, 256, batch_first=True)
    base = nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)).eval()
    model = copy.deepcopy(base)
    lowbit.quantize_(model, scheme)
    x = torch.randn(2, 6, 128)
    mask = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    with torch.no_grad():
        got, want = model[0](x, src_key_padding_mask=mask), base[0](x, src_key_padding_mask=mask)
    keep = ~mask
    assert (got[keep] - want[keep]).abs().max() < 0.2 * want[keep].abs().max()


def test_an_int4_layer_follows_a_loaded_weight_at_every_batch_size():
    """The MSD PackedWeight is rebuilt when the weight buffer changes (load_state_dict copies in place), so
    decode (MSD) and prefill (dequant) use the same weight."""
    torch.manual_seed(3)
    a, b = nn.Sequential(nn.Linear(256, 64)), nn.Sequential(nn.Linear(256, 64))
    lowbit.quantize_(a, "int4-a16w4")
    lowbit.quantize_(b, "int4-a16w4")
    x = torch.randn(1, 256)
    a(x)  # packs a's weight
    a.load_state_dict(b.state_dict())
    assert torch.equal(a(x), b(x))
    many = torch.randn(64, 256)
    assert torch.equal(a(many), b(many))


def test_a_native_dequant_plan_packs_and_checks_what_it_is_given():
    plan = lowbit.plan_weight_quant_batch_matmul(70, 256, 64, algorithm="dequant", dtype=torch.bfloat16,
                                                 backend="native", prepacked=True)
    packed = plan.pack_weight(torch.zeros(256, 32, dtype=torch.uint8))
    x, scale = torch.zeros(70, 256, dtype=torch.bfloat16), torch.ones(2, 64, dtype=torch.bfloat16)
    assert torch.equal(plan.run(x, packed, scale), torch.zeros(70, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="prepacked=True"):
        plan.run(x, torch.zeros(256, 32, dtype=torch.uint8), scale)
    with pytest.raises(ShapeError, match=r"\(256, 31\)"):
        plan.pack_weight(torch.zeros(256, 31, dtype=torch.uint8))


def test_the_dequant_workspace_follows_the_tile_budget(monkeypatch):
    """A call under a small tile budget, then the same sizes under the default one (the workspace layout
    used to be cached from the first: a too-small tile buffer)."""
    from lowbit.formats import wqbmm as ref
    from lowbit.kernels.cpu import wqbmm_dequant

    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(70, 256, generator=g).bfloat16(), torch.randint(0, 256, (256, 101), generator=g,
                                                                         dtype=torch.uint8)
    s = torch.rand(2, 202, generator=g).bfloat16()
    lo, hi = (t.float() for t in ref.dequant_interval(x, w, s, None, 128))
    monkeypatch.setattr(wqbmm_dequant, "TILE_BYTES", 256 * 64 * 4)
    results = [lowbit.weight_quant_batch_matmul(x, w, s, algorithm="dequant", backend="native")]
    monkeypatch.undo()
    results.append(lowbit.weight_quant_batch_matmul(x, w, s, algorithm="dequant", backend="native"))
    for y in results:
        assert ((lo <= y.float()) & (y.float() <= hi)).all()


def _wqbmm_operands(m: int = 3):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, 256, generator=g).half()
    packed, scale, _ = lowbit.formats.int4.quantize_int4_per_group(torch.randn(256, 64, generator=g), 128,
                                                                   dtype=torch.float16)
    return x, packed, scale


@pytest.mark.parametrize("prepacked", [False, True])
def test_a_plans_operands_with_the_negative_bit_give_their_values(prepacked):
    """plan.run calls its kernel without torch's dispatcher, which would apply a lazy negative view: the
    values the views show are computed, not their memory (the sign-flipped result before)."""
    x, packed, scale = _wqbmm_operands()
    plan = lowbit.plan_weight_quant_batch_matmul(3, 256, 64, group_size=128, dtype=torch.float16,
                                                 prepacked=prepacked)
    weight = plan.pack_weight(packed) if prepacked else packed
    want = plan.run(x, weight, scale)
    assert torch.equal(plan.run(torch._neg_view(-x), weight, scale), want)
    assert torch.equal(plan.run(x, weight, torch._neg_view(-scale)), want)
    assert torch.equal(want, lowbit.weight_quant_batch_matmul(x, packed, scale, group_size=128))


def test_an_int4_layer_takes_an_input_with_the_negative_bit():
    model = nn.Sequential(nn.Linear(128, 48)).half()
    lowbit.quantize_(model, "int4-a16w4")
    x = torch.randn(2, 128).half()
    assert torch.equal(model(torch._neg_view(-x)), model(x))


def test_an_out_with_the_negative_bit_or_an_inference_out_outside_inference_mode_is_refused():
    x, packed, scale = _wqbmm_operands()
    plan = lowbit.plan_weight_quant_batch_matmul(3, 256, 64, group_size=128, dtype=torch.float16)
    with pytest.raises(ValueError, match="out has the negative"):
        plan.run(x, packed, scale, out=torch._neg_view(torch.zeros(3, 64, dtype=torch.float16)))
    y = torch.randn(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="hifloat4_fake_quant: out has the negative"):
        lowbit.hifloat4_fake_quant(y, out=torch._neg_view(torch.zeros_like(y)))
    with torch.inference_mode():
        frozen = torch.zeros_like(y)
    with pytest.raises(RuntimeError, match="inference tensor"):  # as torch's own ops (the reference backend)
        lowbit.hifloat4_fake_quant(y, out=frozen)
    with pytest.raises(RuntimeError, match="inference tensor"):
        plan.run(x, packed, scale, out=torch.inference_mode()(torch.zeros)(3, 64, dtype=torch.float16))
    with torch.inference_mode():
        assert lowbit.hifloat4_fake_quant(y, out=frozen) is frozen


@pytest.mark.parametrize("call", [
    lambda: lowbit.dynamic_mx_quant(torch.zeros(0, 64, dtype=torch.bfloat16)),
    lambda: lowbit.formats.mxfp8.quantize(torch.zeros(0, 64)),
    lambda: lowbit.formats.mxfp4.from_fbgemm_layout(torch.zeros(0, 17, dtype=torch.uint8)),
])
def test_inputs_without_rows_give_empty_outputs(call):
    assert all(t.shape[0] == 0 for t in call())


def test_an_mxfp8_w8a8_layer_without_rows_under_the_reference_backend():
    model = nn.Sequential(nn.Linear(64, 48)).bfloat16()
    lowbit.quantize_(model, "mxfp8-w8a8")
    with lowbit.use_backend("reference"):
        assert model(torch.zeros(0, 64, dtype=torch.bfloat16)).shape == (0, 48)


@pytest.mark.parametrize("sizes", [(2**62, 256, 64), (1, 2**64, 64), (2**31, 2**31, 1)])
def test_a_plan_of_sizes_past_int64_bytes_is_a_shape_error_naming_them(sizes):
    with pytest.raises(ShapeError, match=r"\(M, K, N\) = "):
        lowbit.plan_weight_quant_batch_matmul(*sizes, group_size=128)


def test_decode_from_hifloat8_names_a_dtype_that_is_not_one():
    with pytest.raises(TypeError, match="dtype must be a torch.dtype or None, got str 'bfloat16'"):
        lowbit.decode_from_hifloat8(torch.zeros(4, dtype=torch.uint8), "bfloat16")


@pytest.mark.parametrize("scheme", ["int4-a16w4", "mxfp4-wo", "hif8-wo", "svdquant-r32"])
def test_a_layer_cast_after_quantization_is_a_dtype_error_naming_it_until_cast_back(scheme):
    """model.half() casts a converted layer's scales, factors and bias, not what they were quantized for:
    the int4 layer computed silently in the cast scale's dtype and returned float32; others failed inside an
    operator without naming the layer."""
    model = nn.Sequential(nn.Linear(128, 64)).bfloat16()
    lowbit.quantize_(model, scheme)
    x = torch.randn(2, 128).bfloat16()
    want = model(x)
    model.half()
    for x_now in (x, x.half()):
        with pytest.raises(lowbit.DtypeError, match=r"layer '0': its tensors were cast after quantization \(.*"
                                                    r"bias torch.bfloat16 -> torch.float16"):
            model(x_now)
    model.bfloat16()
    if scheme == "hif8-wo":  # its float32 scale does not come back from bfloat16
        with pytest.raises(lowbit.DtypeError, match="scale torch.float32 -> torch.bfloat16"):
            model(x)
    else:
        assert torch.equal(model(x), want)
    model.to("cpu")  # a device move is not a cast
    assert scheme == "hif8-wo" or torch.equal(model(x), want)


@pytest.mark.parametrize("scheme", ["hif8-cast", "mxfp4-wo", "int4-a16w4", "svdquant-r32"])
def test_an_input_on_another_device_is_a_device_error_naming_the_layer(scheme):
    model = nn.Sequential(nn.Linear(128, 64)).bfloat16()
    lowbit.quantize_(model, scheme)
    for _ in range(2):  # the first call, and one after a CPU call has bound the layer's kernel
        with pytest.raises(DeviceError, match="layer '0': input is on meta but the layer's tensors are on cpu"):
            model(torch.randn(2, 128, device="meta", dtype=torch.bfloat16))
        model(torch.randn(2, 128, dtype=torch.bfloat16))


def test_outputs_sharing_bytes_are_told_exactly_by_rows_as_by_marking():
    """backends.share_bytes compares rows of contiguous elements by their strides (codes and scales side by
    side in 8192 rows: no 24x-their-size marking, which made such a call 9x slower): the same answer as
    marking every byte, on random row views of one buffer."""
    from lowbit.backends import _marked_share, share_bytes

    g = torch.Generator().manual_seed(0)
    buf = torch.zeros(4096, dtype=torch.uint8)

    def view():
        item = [1, 2, 4][int(torch.randint(0, 3, (), generator=g))]
        stride = int(torch.randint(1, 40, (), generator=g)) * item
        rows, width = (int(v) for v in torch.randint(1, 9, (2,), generator=g))
        width = min(width * item, stride)
        start = int(torch.randint(0, 200, (), generator=g)) * item
        t = buf[start:].as_strided((rows, width // item * item), (stride, 1))
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[item]) if width % item == 0 else t

    told = 0
    for _ in range(3000):
        a, b = view(), view()
        assert share_bytes(a, b) == _marked_share(a, b) == share_bytes(b, a), (a.stride(), b.stride(), a.shape)
        told += share_bytes(a, b)
    assert 500 < told < 2500  # both answers are common
