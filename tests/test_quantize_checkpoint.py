"""save_quantized / load_quantized: bit-exact round trips, meta skeletons, and clear errors with nothing loaded."""

import copy
import json
import os

import pytest
import torch
from torch import nn

import lowbit
from lowbit.quantize.checkpoint import META_FILE, TENSORS_FILE, CheckpointError
from lowbit.quantize.modules import QuantizedLinearBase

SCHEMES = ["hif8-w8a8-ofmr", "hif8-w8a8-smoothquant", "fp8-wo", "mxfp8-w8a8", "mxfp4-w4a4", "hif4-wo",
           "int4-a16w4", "svdquant-r32", "hif8-cast"]


class Net(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.embed = nn.Embedding(10, 128, dtype=dtype)
        self.norm = nn.LayerNorm(128, dtype=dtype)
        self.mlp = nn.Sequential(nn.Linear(128, 256, dtype=dtype), nn.ReLU(), nn.Linear(256, 128, dtype=dtype))
        self.lm_head = nn.Linear(128, 10, dtype=dtype)
        self.register_buffer("step", torch.tensor(7))

    def forward(self, tokens):
        h = self.norm(self.embed(tokens))
        return self.lm_head(h + self.mlp(h))


def quantized(scheme, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = Net(dtype)
    tokens = torch.randint(0, 10, (4, 16), generator=torch.Generator().manual_seed(1))
    lowbit.quantize(model, scheme)
    model(tokens)
    lowbit.convert(model)
    return model, tokens


def skeleton(dtype=torch.float32):
    with torch.device("meta"):
        return Net(dtype)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_round_trip_onto_a_meta_skeleton_is_bit_exact(scheme, tmp_path):
    model, tokens = quantized(scheme)
    before = model(tokens)
    lowbit.save_quantized(model, tmp_path / "ckpt")
    loaded = lowbit.load_quantized(tmp_path / "ckpt", skeleton())
    assert all(t.device.type == "cpu" for t in loaded.state_dict().values())
    assert type(loaded.mlp[0]) is type(model.mlp[0]) and type(loaded.lm_head) is type(model.lm_head)
    assert torch.equal(loaded(tokens), before)
    meta = json.loads((tmp_path / "ckpt" / META_FILE).read_text())
    assert meta["format_version"] == 1 and meta["lowbit_version"] == lowbit.__version__
    head = [] if lowbit.SCHEMES[scheme].config["skip_layers"] else ["lm_head"]  # HIFP8_OFMR_CFG skips nothing
    assert sorted(meta["layers"]) == head + ["mlp.0", "mlp.2"]
    assert {layer["scheme"] for layer in meta["layers"].values()} == {scheme}


def test_checkpoint_holds_packed_tensors_only(tmp_path):
    from safetensors.torch import load_file

    model, _ = quantized("hif8-wo", torch.bfloat16)
    lowbit.save_quantized(model, tmp_path / "ckpt")
    tensors = load_file(str(tmp_path / "ckpt" / TENSORS_FILE))
    assert "mlp.0.weight" not in tensors
    assert tensors["mlp.0.codes"].dtype == torch.uint8 and tensors["mlp.0.codes"].shape == (256, 128)
    assert tensors["lm_head.weight"].dtype == torch.bfloat16  # unquantized parameters as they are
    assert tensors["step"].item() == 7


def test_round_trip_bf16_materialized_skeleton(tmp_path):
    model, tokens = quantized("int4-a16w4", torch.bfloat16)
    before = model(tokens)
    lowbit.save_quantized(model, tmp_path / "c")
    loaded = lowbit.load_quantized(str(tmp_path / "c"), Net(torch.bfloat16))
    assert torch.equal(loaded(tokens), before)


def test_save_replaces_an_existing_checkpoint_atomically(tmp_path):
    model, tokens = quantized("hif8-wo")
    target = tmp_path / "ckpt"
    lowbit.save_quantized(quantized("fp8-wo")[0], target)
    lowbit.save_quantized(model, target)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporaries left beside it
    assert sorted(os.listdir(target)) == [TENSORS_FILE, META_FILE]
    assert torch.equal(lowbit.load_quantized(target, skeleton())(tokens), model(tokens))


@pytest.mark.parametrize("contents", [{"keep.txt": "important"}, {"config.json": "{}", TENSORS_FILE: "weights"},
                                      {META_FILE: "{}", "tokenizer.json": "{}"}])
def test_save_never_replaces_a_directory_that_is_not_its_checkpoint(contents, tmp_path):
    """A model's own directory, or any folder of other files, is refused and left as it was (it was replaced,
    deleting them)."""
    target = tmp_path / "d"
    target.mkdir()
    for name, text in contents.items():
        (target / name).write_text(text)
    with pytest.raises(ValueError, match="not empty .* not a checkpoint written by save_quantized"):
        lowbit.save_quantized(quantized("hif8-wo")[0], target)
    assert {p.name: p.read_text() for p in target.iterdir()} == contents
    assert sorted(os.listdir(tmp_path)) == ["d"]


def test_save_writes_an_empty_directory_and_readable_files(tmp_path):
    model, tokens = quantized("hif8-wo")
    target = tmp_path / "empty"
    target.mkdir()
    lowbit.save_quantized(model, target)
    assert oct(target.stat().st_mode & 0o777) == oct(0o755)
    assert {name: oct((target / name).stat().st_mode & 0o777) for name in os.listdir(target)} == {
        TENSORS_FILE: oct(0o644), META_FILE: oct(0o644)}
    assert torch.equal(lowbit.load_quantized(target, skeleton())(tokens), model(tokens))


def test_save_refuses_an_unconverted_model(tmp_path):
    model = Net()
    lowbit.quantize(model, "hif8-w8a8-ofmr")
    with pytest.raises(RuntimeError, match="convert"):
        lowbit.save_quantized(model, tmp_path / "c")
    assert not (tmp_path / "c").exists()


def _saved(tmp_path, scheme="hif8-wo"):
    model, _ = quantized(scheme)
    return lowbit.save_quantized(model, tmp_path / "ckpt")


def _assert_untouched(model, before):
    assert [type(m) for m in model.modules()] == [type(m) for m in before.modules()]
    for (k, a), (_, b) in zip(model.state_dict().items(), before.state_dict().items()):
        assert a.device == b.device and a.shape == b.shape and a.dtype == b.dtype
        if a.device.type != "meta":
            assert torch.equal(a, b), k


@pytest.mark.parametrize("materialized", [False, True])
def test_truncated_file_is_a_clear_error_and_nothing_is_loaded(tmp_path, materialized):
    path = _saved(tmp_path)
    data = (path / TENSORS_FILE).read_bytes()
    (path / TENSORS_FILE).write_bytes(data[: len(data) // 2])
    model = Net() if materialized else skeleton()
    before = copy.deepcopy(model)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated or corrupt"):
        lowbit.load_quantized(path, model)
    _assert_untouched(model, before)


def test_missing_files_are_named(tmp_path):
    path = _saved(tmp_path)
    (path / TENSORS_FILE).unlink()
    with pytest.raises(CheckpointError, match="missing file .*model.safetensors"):
        lowbit.load_quantized(path, skeleton())
    with pytest.raises(CheckpointError, match="missing file .*quantization.json"):
        lowbit.load_quantized(tmp_path / "nowhere", skeleton())


def test_unknown_format_version_and_corrupt_json(tmp_path):
    path = _saved(tmp_path)
    meta = json.loads((path / META_FILE).read_text())
    for version in (99, True, 1.0, "1"):
        (path / META_FILE).write_text(json.dumps({**meta, "format_version": version}))
        with pytest.raises(CheckpointError, match=f"format_version {version!r}"):
            lowbit.load_quantized(path, skeleton())
    (path / META_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        lowbit.load_quantized(path, skeleton())
    (path / META_FILE).write_text('{"format_version": ' + "9" * 5000 + "}")  # json's bare ValueError
    with pytest.raises(CheckpointError, match="not valid JSON \\(ValueError: Exceeds the limit"):
        lowbit.load_quantized(path, skeleton())


def _set(key, value):
    def edit(layer):
        layer[key] = value
    return edit


def _drop(key):
    return lambda layer: layer.pop(key)


@pytest.mark.parametrize("scheme, edit, message", [
    ("fp8-wo", _set("weight_type", "hifloat8"), "contradicts its format"),  # same tensors: it ran, wrongly
    ("hif8-wo", _set("weight_type", "int8"), "contradicts its format"),
    ("hif8-wo", _set("weight_type", "mxfp4_e2m1"), "contradicts its format"),
    ("hif8-wo", _set("kind", "int4"), "invalid description"),
    ("hif8-wo", _set("kind", "svdquant"), "invalid description"),
    ("hif8-wo", _drop("act_kind"), "act_kind None contradicts its format"),
    ("hif8-w8a8-minmax", _set("act_kind", "none"), "act_kind 'none' contradicts its format"),  # ran weight-only
    ("hif8-w8a8-minmax", _set("act_kind", "mxfp8"), "act_kind 'mxfp8' contradicts its format"),
    ("hif8-w8a8-minmax", _set("fake_act_kind", "hif8_position"), "fake_act_kind 'hif8_position' contradicts"),
    ("hif8-w8a8-minmax", _set("algorithm", "quantile"), "algorithm 'quantile' contradicts its format"),
    ("hif8-w8a8-minmax", _set("format", "hifloat8 w channel / weight-only (minmax)"), "act_kind 'hif8_static' contr"),
    ("hif8-w8a8-minmax", _set("format", "hifloat8 w channel"), "is not a layer format of lowbit"),
    ("hif8-w8a8-minmax", lambda layer: layer.update(act_kind="none", fake_act_kind="none",
                                                    format="hifloat8 w channel / weight-only (minmax)"),
     "stores an act_scale, which activation kind 'none' does not read"),
    ("int4-a16w4", _set("kind", "packed"), "kind 'packed' contradicts weight_type 'int4'"),  # ran, other numbers
    ("int4-a16w4", _set("format", "int4 w group 64 / weight-only (minmax)"), "group_size 128 contradicts its form"),
    ("hif8-wo", _set("act_kind", "hif8_static"), "invalid description"),  # no act_scale stored
    ("hif8-wo", _set("act_kind", "hif8_position"), "invalid description"),
    ("int4-a16w4", _set("group_size", "128"), "invalid description"),
    ("int4-a16w4", _set("group_size", 64), "invalid description"),
    ("int4-a16w4", _set("in_features", 64), "do not fit the weight shape"),
    ("hif8-wo", lambda layer: layer["tensors"]["codes"].update(shape=[-1, 128]), "described as uint8 \\[-1, 128\\]"),
    ("hif8-wo", lambda layer: layer["tensors"]["codes"].update(shape=[2**40, 2**20]), "the file holds uint8"),
    ("hif8-wo", lambda layer: layer["tensors"].pop("scale"), "invalid description"),
    ("hif8-wo", lambda layer: layer["tensors"].clear(), "has no packed tensors"),
    ("hif8-wo", lambda layer: layer.update(in_features=float(layer["in_features"])), "must be integers"),
])
def test_a_layer_description_that_does_not_fit_is_refused_before_the_model_changes(tmp_path, scheme, edit,
                                                                                      message):
    """Edited quantization.json entries: each a CheckpointError naming the file and layer, the model unchanged
    (some loaded and computed garbage or NaN, some failed after the model had been changed, some at the first
    forward with an internal KeyError / TypeError)."""
    path = _saved(tmp_path, scheme)
    meta = json.loads((path / META_FILE).read_text())
    edit(meta["layers"]["mlp.0"])
    (path / META_FILE).write_text(json.dumps(meta))
    model = Net()
    before = copy.deepcopy(model)
    with pytest.raises(CheckpointError, match=f"quantization.json: layer 'mlp.0' .*{message}"):
        lowbit.load_quantized(path, model)
    _assert_untouched(model, before)


def test_an_activation_scale_that_would_broadcast_the_output_is_refused(tmp_path):
    """An act_scale of shape (1, 1, 1, 1) made every output of the layer 4-D."""
    st = pytest.importorskip("safetensors.torch")
    path = _saved(tmp_path, "hif8-w8a8-minmax")
    tensors = st.load_file(str(path / TENSORS_FILE))
    tensors["mlp.0.act_scale"] = torch.ones(1, 1, 1, 1)
    st.save_file(tensors, str(path / TENSORS_FILE), metadata={"format": "pt"})
    meta = json.loads((path / META_FILE).read_text())
    meta["layers"]["mlp.0"]["tensors"]["act_scale"] = {"shape": [1, 1, 1, 1], "dtype": "float32"}
    (path / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="layer 'mlp.0' .*the layer computes"):
        lowbit.load_quantized(path, Net())


@pytest.mark.parametrize("amct_compat", [False, True])
def test_per_token_activations_round_trip_through_the_dry_run(tmp_path, amct_compat):
    """Dynamic per-token HiF8 activations (and AMCT's static per-position fake quant beside them): the dry
    run's scale check read the values of meta tensors, and every such checkpoint failed to load."""
    torch.manual_seed(0)
    config = {"batch_num": 1, "algorithm": "quantile",
              "quant_cfg": {"weights": {"type": "hifloat8", "symmetric": True, "strategy": "tensor"},
                            "inputs": {"type": "hifloat8", "symmetric": True, "strategy": "token"}}}
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16)).bfloat16()
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    lowbit.quantize(model, config, amct_compat=amct_compat)
    with torch.no_grad():
        model(x)
    lowbit.convert(model)
    lowbit.save_quantized(model, tmp_path / "t")
    with torch.device("meta"):
        skeleton_ = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16)).bfloat16()
    loaded = lowbit.load_quantized(tmp_path / "t", skeleton_)
    assert torch.equal(loaded(x), model(x))


def test_conv_layers_round_trip_through_the_dry_run(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, stride=2, dilation=2,
                                                                            groups=2, bias=False))
    x = torch.randn(2, 4, 12, 12)
    lowbit.quantize(model, "hif8-w8a8-ofmr")
    model(x)
    lowbit.convert(model)
    lowbit.save_quantized(model, tmp_path / "c")
    with torch.device("meta"):
        skeleton_ = nn.Sequential(nn.Conv2d(4, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, stride=2, dilation=2,
                                                                                   groups=2, bias=False))
    loaded = lowbit.load_quantized(tmp_path / "c", skeleton_)
    assert sum(isinstance(m, QuantizedLinearBase) for m in loaded.modules()) == 2
    assert torch.equal(loaded(x), model(x))


class Other(nn.Module):
    def __init__(self, hidden=256, extra=False):
        super().__init__()
        self.embed = nn.Embedding(10, 128)
        self.norm = nn.LayerNorm(128)
        self.mlp = nn.Sequential(nn.Linear(128, hidden), nn.ReLU(), nn.Linear(hidden, 128))
        self.lm_head = nn.Linear(128, 10)
        self.register_buffer("step", torch.tensor(7))
        if extra:
            self.extra = nn.Linear(4, 4)


@pytest.mark.parametrize("foreign, message", [
    (lambda: Other(hidden=512), r"layer 'mlp.0', which in the model is .*'weight_shape': \[512, 128\]"),
    (lambda: Other(extra=True), r"missing tensors \['extra.bias', 'extra.weight'\]"),
    (lambda: nn.Sequential(nn.Linear(128, 256)), "lists layer 'mlp.0', which in the model is missing"),
])
def test_checkpoint_of_another_model_is_rejected_before_loading(tmp_path, foreign, message):
    path = _saved(tmp_path)
    model = foreign()
    before = copy.deepcopy(model)
    with pytest.raises(CheckpointError, match=message):
        lowbit.load_quantized(path, model)
    _assert_untouched(model, before)


def test_wrong_dtype_or_shape_of_a_stored_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path = _saved(tmp_path)
    tensors = load_file(str(path / TENSORS_FILE))
    tensors["norm.weight"] = tensors["norm.weight"][:64].clone()
    save_file(tensors, str(path / TENSORS_FILE))
    model = skeleton()
    with pytest.raises(CheckpointError, match=r"tensor 'norm.weight' is torch.float32 \(64,\)"):
        lowbit.load_quantized(path, model)
    assert not any(isinstance(m, QuantizedLinearBase) for m in model.modules())


def test_import_lowbit_does_not_import_optional_packages():
    import subprocess
    import sys

    code = ("import sys, lowbit; lowbit.quantize, lowbit.save_quantized, lowbit.QuantizeReport; "
            "print(sorted(m for m in ('safetensors', 'transformers', 'numba') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ)
    assert out.stdout.strip() == "[]"


def test_a_hugging_face_skeleton_built_under_parameters_on_meta_loads(minilm_path, tmp_path):
    """The README's recipe on a real model: a skeleton built under torch.device("meta") leaves the
    non-persistent position ids on the meta device (a clear error naming the way out); under
    lowbit.parameters_on_meta() the buffers are real and the load gives the quantized model's bits."""
    import transformers

    model = transformers.AutoModel.from_pretrained(minilm_path, local_files_only=True).eval()
    lowbit.quantize_(model, "hif8-wo")
    lowbit.save_quantized(model, tmp_path / "ckpt")
    config = transformers.AutoConfig.from_pretrained(minilm_path, local_files_only=True)
    with torch.device("meta"):
        on_meta = transformers.AutoModel.from_config(config)
    with pytest.raises(CheckpointError, match=r"position_ids.*lowbit\.parameters_on_meta\(\)"):
        lowbit.load_quantized(tmp_path / "ckpt", on_meta)
    with lowbit.parameters_on_meta():
        skeleton_ = transformers.AutoModel.from_config(config)
    assert all(p.device.type == "meta" for p in skeleton_.parameters())
    assert all(b.device.type == "cpu" for b in skeleton_.buffers())
    loaded = lowbit.load_quantized(tmp_path / "ckpt", skeleton_).eval()
    ids = torch.tensor([[101, 2023, 2003, 1037, 6251, 102]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).last_hidden_state, model(ids).last_hidden_state)


def test_the_working_directory_is_refused_as_a_checkpoint_and_nothing_is_left(tmp_path, monkeypatch):
    """save_quantized(model, ".") in an empty working directory failed renaming it ([Errno 16], naming a
    temporary folder) and left a hidden folder beside it."""
    model, _ = quantized("hif8-wo")
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    for target in (".", "..", str(tmp_path / "here")):
        with pytest.raises(ValueError, match="is the working directory \\(or holds it\\), which cannot be replaced"):
            lowbit.save_quantized(model, target)
    assert [p.name for p in tmp_path.iterdir()] == ["here"] and not any((tmp_path / "here").iterdir())
    lowbit.save_quantized(model, "checkpoint")
    assert sorted(p.name for p in (tmp_path / "here" / "checkpoint").iterdir()) == sorted([META_FILE, TENSORS_FILE])


def test_a_skeleton_layer_a_quantized_layer_would_not_replace_faithfully_is_refused(tmp_path):
    """load_quantized replaced an nn.Linear subclass with its own forward (or with backward hooks) silently,
    where quantize skips such a layer."""

    class Doubled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32))
    lowbit.quantize_(model, "hif8-wo")
    path = lowbit.save_quantized(model, tmp_path / "ckpt")
    hooked = nn.Sequential(nn.Linear(64, 32))
    hooked[0].register_full_backward_hook(lambda module, grad_in, grad_out: None)
    for skeleton_ in (nn.Sequential(Doubled(64, 32)), hooked):
        with pytest.raises(CheckpointError, match="layer '0', which in the model cannot be replaced: "):
            lowbit.load_quantized(path, skeleton_)
        assert isinstance(skeleton_[0], nn.Linear)


def test_the_working_directory_check_survives_a_deleted_working_directory(tmp_path, monkeypatch):
    model, _ = quantized("hif8-wo")
    (tmp_path / "gone").mkdir()
    monkeypatch.chdir(tmp_path / "gone")
    (tmp_path / "gone").rmdir()
    lowbit.save_quantized(model, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / META_FILE).is_file()
