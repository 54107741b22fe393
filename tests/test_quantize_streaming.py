"""quantize_checkpoint / `lowbit quantize-checkpoint`: the streamed checkpoint equals quantize_ + save_quantized
bit for bit (all-MiniLM-L6-v2 and a small synthetic model), resumes after an interruption without rewriting
completed shards, and refuses bad input with clear errors before writing anything."""

import json
import os
import sys
import threading

import pytest
import torch
from torch import nn

import lowbit
from lowbit.cli.main import main
from lowbit.errors import ShapeError
from lowbit.quantize import stream_worker, streaming
from lowbit.quantize.checkpoint import META_FILE, CheckpointError
from lowbit.quantize.shard_io import INDEX_FILE, read_shard
from lowbit.quantize.streaming import MANIFEST_FILE, quantize_checkpoint

safetensors_torch = pytest.importorskip("safetensors.torch")

STREAMED_SCHEMES = ["hif8-wo", "fp8-wo", "mxfp4-wo", "hif4-wo", "int4-a16w4"]


class Net(nn.Module):
    """Embedding, norms, Linear layers with and without bias, an lm_head, a layer whose K is not a multiple
    of 32 (and of 64, 128), a 1-D and an integer tensor."""

    def __init__(self, dtype=torch.bfloat16):
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 128, dtype=dtype)
        self.norm = nn.LayerNorm(128, dtype=dtype)
        self.up = nn.Linear(128, 256, dtype=dtype)
        self.down = nn.Linear(256, 128, bias=False, dtype=dtype)
        self.odd = nn.Linear(48, 64, dtype=dtype)
        self.lm_head = nn.Linear(128, 10, bias=False, dtype=dtype)
        self.register_buffer("step", torch.tensor([7, 8]))

    def forward(self, tokens):
        h = self.norm(self.embed_tokens(tokens))
        h = h + self.down(torch.relu(self.up(h)))
        return self.lm_head(h) + self.odd(h[..., :48]).sum(-1, keepdim=True)


def net(seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    return Net(dtype)


def write_model_dir(state: dict, directory, shards: int = 1, extra_files=("config.json",)):
    """A Hugging Face-style directory: model.safetensors, or `shards` shards and the index."""
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in state.items()}
    for name in extra_files:
        (directory / name).write_text('{"model_type": "test"}')
    if shards == 1:
        safetensors_torch.save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return directory
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in names[i::shards]}  # a layer's weight and bias land in different shards
        safetensors_torch.save_file(part, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def in_memory_checkpoint(model, scheme, directory):
    lowbit.quantize_(model, scheme)
    lowbit.save_quantized(model, directory)
    return directory


def stored_tensors(directory):
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(str(path)))
    return out


def assert_same_checkpoint(streamed, reference, ignore=()):
    layers = json.loads((streamed / META_FILE).read_text())["layers"]
    assert layers == json.loads((reference / META_FILE).read_text())["layers"]
    got, want = stored_tensors(streamed), stored_tensors(reference)
    assert set(got) - set(ignore) == set(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


# ---- all-MiniLM-L6-v2 -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    all_minilm_l6_v2 = pytest.importorskip("all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    path = all_minilm_l6_v2.extract_model(str(tmp_path_factory.mktemp("minilm")))
    from pathlib import Path

    return Path(path), transformers


def minilm_outputs(directory, transformers, config_dir):
    config = transformers.AutoConfig.from_pretrained(config_dir)
    model = lowbit.load_quantized(directory, transformers.BertModel(config).eval())
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).last_hidden_state


@pytest.mark.parametrize("scheme", ["hif8-wo", "mxfp4-wo", "int4-a16w4"])  # hif4-wo: the sharded test below
def test_minilm_streamed_equals_in_memory(minilm, scheme, tmp_path):
    src, transformers = minilm
    report = quantize_checkpoint(src, tmp_path / "streamed", scheme, workers=1)
    reference = in_memory_checkpoint(transformers.BertModel.from_pretrained(src).eval(), scheme, tmp_path / "ref")
    # the file also holds embeddings.position_ids, a non-persistent buffer of BertModel (ignored on load)
    assert_same_checkpoint(tmp_path / "streamed", reference, ignore={"embeddings.position_ids"})
    assert len(report.layers) == 37 and sorted(report.not_quantized) == [
        "embeddings.position_embeddings.weight", "embeddings.token_type_embeddings.weight",
        "embeddings.word_embeddings.weight"]
    streamed_out = minilm_outputs(tmp_path / "streamed", transformers, src)
    assert torch.equal(streamed_out, minilm_outputs(reference, transformers, src))
    assert (tmp_path / "streamed" / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert (tmp_path / "streamed" / "1_Pooling" / "config.json").is_file()


def test_minilm_sharded_through_a_worker_pool(minilm, tmp_path):
    src, transformers = minilm
    state = safetensors_torch.load_file(str(src / "model.safetensors"))
    sharded = write_model_dir(state, tmp_path / "sharded", shards=3)
    quantize_checkpoint(sharded, tmp_path / "streamed", "hif4-wo", workers=2)
    index = json.loads((tmp_path / "streamed" / INDEX_FILE).read_text())
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index["metadata"]["total_size"] == sum(
        e.nbytes for p in (tmp_path / "streamed").glob("*.safetensors") for e in read_shard(p).tensors.values())
    reference = in_memory_checkpoint(transformers.BertModel.from_pretrained(src).eval(), "hif4-wo", tmp_path / "ref")
    assert_same_checkpoint(tmp_path / "streamed", reference, ignore={"embeddings.position_ids"})
    assert torch.equal(minilm_outputs(tmp_path / "streamed", transformers, src),
                       minilm_outputs(reference, transformers, src))


# ---- synthetic model: selection, all streamable schemes, row blocks ------------------------------------------

@pytest.mark.parametrize("scheme", STREAMED_SCHEMES + ["hif8-cast", "mxfp8-w8a8", "mxfp4-w4a4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_synthetic_streamed_equals_in_memory(scheme, dtype, tmp_path, monkeypatch):
    monkeypatch.setattr(stream_worker, "BLOCK_BYTES", 1024)  # many row blocks per weight
    model = net(dtype=dtype)
    src = write_model_dir(model.state_dict(), tmp_path / "in", shards=2)
    report = quantize_checkpoint(src, tmp_path / "out", scheme, workers=1)
    reference = net(dtype=dtype)
    if lowbit.SCHEMES[scheme].config["quant_cfg"]["weights"].get("group_size") is not None:
        # K = 48 is not a multiple of the group: streamed copies it, quantize_ refuses it (so it is left out)
        assert "does not divide K = 48" in report.not_quantized["odd.weight"]
        odd = reference.odd
        del reference.odd
        lowbit.quantize_(reference, scheme)
        reference.odd = odd
        lowbit.save_quantized(reference, tmp_path / "ref")
    else:
        in_memory_checkpoint(reference, scheme, tmp_path / "ref")
    assert_same_checkpoint(tmp_path / "out", tmp_path / "ref")
    assert report.not_quantized["embed_tokens.weight"] == "an embedding table"
    assert "lm_head" in report.not_quantized["lm_head.weight"]
    tokens = torch.randint(0, 10, (3, 5), generator=torch.Generator().manual_seed(2))
    loaded = lowbit.load_quantized(tmp_path / "out", net(seed=9, dtype=dtype))
    assert torch.equal(loaded(tokens), lowbit.load_quantized(tmp_path / "ref", net(seed=9, dtype=dtype))(tokens))


def test_skip_option_and_odd_rows_for_int4(tmp_path):
    state = net().state_dict()
    state["odd_n.weight"] = torch.randn(5, 128, dtype=torch.bfloat16)  # int4 packs two rows a byte
    state["no..path.weight"] = torch.randn(8, 128, dtype=torch.bfloat16)
    src = write_model_dir(state, tmp_path / "in")
    report = quantize_checkpoint(src, tmp_path / "out", "int4-a16w4", skip=("down",), workers=1)
    assert report.not_quantized["down.weight"] == "matched --skip 'down'"
    assert "N = 5 is odd" in report.not_quantized["odd_n.weight"]
    assert report.not_quantized["no..path.weight"] == "its name is not a module path"
    assert report.layers == ["up"]
    stored = stored_tensors(tmp_path / "out")
    for name in ("down.weight", "odd_n.weight", "no..path.weight", "step", "norm.weight", "embed_tokens.weight"):
        assert torch.equal(stored[name], state[name])


# ---- resuming ------------------------------------------------------------------------------------------------

def test_interrupted_run_resumes_without_rewriting_completed_shards(tmp_path, monkeypatch):
    src = write_model_dir(net().state_dict(), tmp_path / "in", shards=3)
    out = tmp_path / "out"
    real_run = streaming.run_indexed
    ran = []

    def interrupt_in_second_shard(job):
        if job[0] == 1:
            raise KeyboardInterrupt
        ran.append(job)
        return real_run(job)

    monkeypatch.setattr(streaming, "run_indexed", interrupt_in_second_shard)
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(src, out, "mxfp4-wo", workers=1)
    first = out / "model-00001-of-00003.safetensors"
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_FILE, first.name]  # no partial shard, no marker
    stat = first.stat()

    ran.clear()
    monkeypatch.setattr(streaming, "run_indexed", lambda job: ran.append(job) or real_run(job))
    report = quantize_checkpoint(src, out, "mxfp4-wo", workers=1)
    assert report.shards_kept == [first.name]
    assert {task.src for _, task in ran} == {str(src / f"model-0000{i}-of-00003.safetensors") for i in (2, 3)}
    assert (first.stat().st_ino, first.stat().st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)
    quantize_checkpoint(src, tmp_path / "fresh", "mxfp4-wo", workers=1)
    for path in (tmp_path / "fresh").glob("*.safetensors"):
        assert (out / path.name).read_bytes() == path.read_bytes()
    assert (out / META_FILE).read_text() == (tmp_path / "fresh" / META_FILE).read_text()

    (out / ".model-00002-of-00003.safetensors.partial").write_bytes(b"half a shard")  # left by a kill
    os.utime(src / "model-00003-of-00003.safetensors")  # a changed input shard is redone
    report = quantize_checkpoint(src, out, "mxfp4-wo", workers=1)
    assert report.shards_written == ["model-00003-of-00003.safetensors"]
    assert not list(out.glob("*.partial"))
    assert len(quantize_checkpoint(src, out, "hif4-wo", workers=1).shards_written) == 3  # another scheme


# ---- errors: nothing written ---------------------------------------------------------------------------------

@pytest.fixture
def small_dir(tmp_path):
    return write_model_dir(net().state_dict(), tmp_path / "in", shards=2)


def _corrupt(directory, how):
    shard = directory / "model-00001-of-00002.safetensors"
    data = shard.read_bytes()
    index = json.loads((directory / INDEX_FILE).read_text())
    if how == "truncated":
        shard.write_bytes(data[:-10])
    elif how == "garbage":
        shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + data[24:])
    elif how == "tiny":
        shard.write_bytes(data[:5])
    elif how == "padded":
        shard.write_bytes(data + b"\0" * 8)
    elif how == "unlisted":
        index["weight_map"].pop(next(k for k, v in index["weight_map"].items() if v == shard.name))
    elif how == "phantom":
        index["weight_map"]["ghost.weight"] = shard.name
    elif how == "missing shard":
        index["weight_map"]["ghost.weight"] = "model-00009-of-00009.safetensors"
    elif how == "escaping shard":
        index["weight_map"]["ghost.weight"] = "../model.safetensors"
    elif how == "shard named as a side file":  # the side files' copy would overwrite the packed shard
        (directory / "config.json").unlink()
        shard.rename(directory / "config.json")
        index["weight_map"] = {k: "config.json" if v == shard.name else v for k, v in index["weight_map"].items()}
    elif how in HEADER_EDITS:
        _edit_header(shard, HEADER_EDITS[how])
    elif how == "metadata not strings":  # safetensors itself refused it, in the worker, after writing began
        _edit_header(shard, lambda e: None, lambda header: header.update(__metadata__={"format": 5}))
    elif how == "metadata a list":
        _edit_header(shard, lambda e: None, lambda header: header.update(__metadata__=["pt"]))
    elif how == "metadata null":  # safetensors reads it as no metadata: quantized as any other
        _edit_header(shard, lambda e: None, lambda header: header.update(__metadata__=None))
    elif how == "integer of 5000 digits":  # json raises a bare ValueError for it
        _edit_header(shard, lambda e: e.update(shape=["DIGITS", *e["shape"][1:]]),
                     encode=lambda text: text.replace('"DIGITS"', "9" * 5000))
    (directory / INDEX_FILE).write_text(json.dumps(index))


def _edit_header(shard, edit, edit_header=lambda header: None, encode=lambda text: text):
    """Rewrite the first 2-D weight's entry in ``shard``'s header with ``edit(entry)`` (and the header with
    ``edit_header``, its JSON text with ``encode``), the data unchanged."""
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    name = next(k for k, v in header.items() if k.endswith(".weight") and len(v["shape"]) == 2)
    edit(header[name])
    edit_header(header)
    encoded = encode(json.dumps(header)).encode()
    shard.write_bytes(len(encoded).to_bytes(8, "little") + encoded + data[8 + n :])


HEADER_EDITS = {
    "unknown dtype": lambda e: e.update(dtype="ZZZ"),
    "boolean in shape": lambda e: e.update(shape=[True, *e["shape"][1:]]),
    "dtype of other size": lambda e: e.update(dtype="F32" if e["dtype"] != "F32" else "F16"),
    "huge shape": lambda e: e.update(shape=[1 << 40, 1 << 20]),
}


@pytest.mark.parametrize("how, message", [
    ("truncated", "truncated or corrupt"), ("garbage", "corrupt safetensors header"), ("tiny", "truncated"), ("padded", "the file has"),
    ("unlisted", "does not list it"), ("phantom", "lists tensors no shard holds: ['ghost.weight']"),
    ("missing shard", "which is missing"), ("escaping shard", "not a file name in the same directory"),
    ("shard named as a side file", "'config.json' is not a .safetensors file"),
    ("unknown dtype", "has unknown dtype 'ZZZ'"), ("boolean in shape", "corrupt safetensors header entry"),
    ("dtype of other size", "its data_offsets span"), ("huge shape", "needs 18446744073709551616 bits"),
    ("metadata not strings", "__metadata__ must map names to strings"),
    ("metadata a list", "__metadata__ must map names to strings"),
    ("integer of 5000 digits", "corrupt safetensors header \\(ValueError: Exceeds the limit")])
def test_bad_input_is_refused_before_writing(small_dir, tmp_path, how, message):
    _corrupt(small_dir, how)
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
        quantize_checkpoint(small_dir, tmp_path / "out", "hif8-wo", workers=1)
    assert not (tmp_path / "out").exists()


def test_a_worker_that_dies_ends_the_run_with_an_error_not_a_hang():
    """A worker killed mid-task (the out-of-memory killer's SIGKILL) left multiprocessing.Pool waiting for its
    lost task for ever."""
    outcome = []

    def run():
        try:
            with streaming._mapper(2) as mapper:
                list(mapper(os._exit, [3, 3, 3]))  # each task ends its worker abruptly
        except RuntimeError as exc:
            outcome.append(str(exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "the run hung"
    assert outcome and outcome[0].startswith("a worker process exited unexpectedly")


@pytest.mark.parametrize("missing", ["safetensors", "tqdm"])
def test_a_missing_models_extra_is_named_before_anything_is_written(small_dir, tmp_path, monkeypatch, missing):
    """Without safetensors quantize-checkpoint failed with "No module named 'safetensors'" after making the
    output folder, and load_quantized called an intact file truncated or corrupt."""
    model = nn.Sequential(nn.Linear(64, 64))
    lowbit.quantize_(model, "hif8-wo")
    lowbit.save_quantized(model, tmp_path / "ckpt")
    for module in ([missing, f"{missing}.torch"] if missing == "safetensors" else [missing]):
        monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    with pytest.raises(ModuleNotFoundError, match=f"'{missing}' package: pip install 'lowbit\\[models\\]'"):
        quantize_checkpoint(small_dir, tmp_path / "out", "hif8-wo", workers=1, progress=True)
    assert not (tmp_path / "out").exists()
    if missing == "safetensors":
        with pytest.raises(ModuleNotFoundError, match="need the 'safetensors' package"):
            lowbit.load_quantized(tmp_path / "ckpt", nn.Sequential(nn.Linear(64, 64)))


def test_null_metadata_is_no_metadata(small_dir, tmp_path):
    _corrupt(small_dir, "metadata null")
    quantize_checkpoint(small_dir, tmp_path / "out", "hif8-wo", workers=1)
    assert (tmp_path / "out" / META_FILE).is_file()


def test_a_packed_tensor_that_would_take_an_input_tensors_name_is_refused(tmp_path):
    state = net().state_dict()
    layer = next(k for k, v in state.items() if k.endswith(".weight") and v.dim() == 2 and "embed" not in k)
    state[layer.replace(".weight", ".codes")] = torch.zeros(3, dtype=torch.uint8)  # hif8-wo packs codes, scale
    directory = write_model_dir(state, tmp_path / "in")
    with pytest.raises(CheckpointError, match="already has .*codes"):
        quantize_checkpoint(directory, tmp_path / "out", "hif8-wo", workers=1)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("scheme, message", [
    ("nope", "unknown quantization scheme 'nope'"), ("hif8-w8a8-ofmr", "needs calibration data"),
    ("svdquant-r32", "quantizes a weight as a whole")])
def test_unstreamable_schemes(small_dir, tmp_path, scheme, message):
    with pytest.raises(ValueError, match=message):
        quantize_checkpoint(small_dir, tmp_path / "out", scheme)
    assert not (tmp_path / "out").exists()


def test_streamable_schemes_are_the_data_free_row_wise_ones():
    from lowbit.quantize.stream_plan import streamable_schemes

    assert sorted(streamable_schemes()) == sorted(STREAMED_SCHEMES + ["hif8-cast", "mxfp8-w8a8", "mxfp4-w4a4"])


def test_bad_options(small_dir, tmp_path):
    with pytest.raises(ValueError, match="skip must be a sequence of non-empty strings"):
        quantize_checkpoint(small_dir, tmp_path / "out", "hif8-wo", skip="up")
    with pytest.raises(ShapeError, match="workers must be >= 1"):
        quantize_checkpoint(small_dir, tmp_path / "out", "hif8-wo", workers=0)
    assert not (tmp_path / "out").exists()


def test_bad_output_directories(small_dir, tmp_path):
    for out in (small_dir, small_dir / "sub"):
        with pytest.raises(ValueError, match="must not be the input directory"):
            quantize_checkpoint(small_dir, out, "hif8-wo")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="was not written by quantize-checkpoint"):
        quantize_checkpoint(small_dir, foreign, "hif8-wo")
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        quantize_checkpoint(foreign, tmp_path / "out", "hif8-wo")


def test_workers_are_at_most_one_per_cpu_and_per_task(small_dir, tmp_path, monkeypatch):
    """A huge --workers starts no more processes than there are tensors to write or CPUs (it hung, spawning
    them all)."""
    started = []
    real = streaming._mapper
    monkeypatch.setattr(streaming, "_mapper", lambda workers: started.append(workers) or real(1))
    tensors = sum(len(read_shard(path).tensors) for path in small_dir.glob("*.safetensors"))
    quantize_checkpoint(small_dir, tmp_path / "out", "hif8-wo", workers=100_000)
    assert len(started) == 1 and 1 <= started[0] <= min(tensors, os.cpu_count())


@pytest.mark.parametrize("workers", [1, 2])
def test_a_weight_that_cannot_be_quantized_is_named_with_its_shard(workers, tmp_path):
    state = net().state_dict()
    state["down.weight"] = torch.full_like(state["down.weight"], float("nan"))
    src = write_model_dir(state, tmp_path / "in")
    with pytest.raises(RuntimeError, match=r"^model\.safetensors: layer 'down': quantization scale is not finite"):
        quantize_checkpoint(src, tmp_path / "out", "hif8-wo", workers=workers)
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_cli_errors_are_one_line_exit_2(small_dir, tmp_path, capsys):
    _corrupt(small_dir, "truncated")
    cases = [[str(small_dir), str(tmp_path / "out"), "--scheme", "hif8-wo"],
             [str(small_dir), str(small_dir / "o"), "--scheme", "hif8-wo"],
             [str(small_dir), str(tmp_path / "out"), "--scheme", "fp8-w8a8-ofmr"],
             [str(small_dir), str(tmp_path / "out"), "--scheme", "hif8-wo", "--workers", "0"]]
    for args in cases:
        assert main(["quantize-checkpoint", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("lowbit quantize-checkpoint: error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_cli_quantizes_and_prints_a_summary(tmp_path, capsys):
    src = write_model_dir(net().state_dict(), tmp_path / "in")
    assert main(["quantize-checkpoint", str(src), str(tmp_path / "out"), "--scheme", "hif8-wo", "--workers", "1",
                 "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "3 layers quantized" in captured.out and captured.err == ""
    assert lowbit.load_quantized(tmp_path / "out", net(seed=4)).up.__class__.__name__ == "PackedLinear"


# ---- load_quantized of a sharded checkpoint ------------------------------------------------------------------

def test_load_quantized_reads_shards_and_checks_the_index(tmp_path):
    src = write_model_dir(net().state_dict(), tmp_path / "in", shards=2)
    quantize_checkpoint(src, tmp_path / "out", "hif8-wo", workers=1)
    (tmp_path / "out" / "model-00002-of-00002.safetensors").unlink()
    before = net(seed=5)
    state = {k: v.clone() for k, v in before.state_dict().items()}
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors', which is missing"):
        lowbit.load_quantized(tmp_path / "out", before)
    assert all(torch.equal(state[k], v) for k, v in before.state_dict().items())  # model untouched


def test_stored_non_persistent_buffers_are_ignored_on_load(tmp_path):
    class WithPositions(Net):
        def __init__(self):
            super().__init__()
            self.register_buffer("positions", torch.arange(4), persistent=False)

    state = {**net().state_dict(), "positions": torch.tensor([9, 9, 9, 9])}  # as older checkpoints store it
    quantize_checkpoint(write_model_dir(state, tmp_path / "in"), tmp_path / "out", "hif8-wo", workers=1)
    loaded = lowbit.load_quantized(tmp_path / "out", WithPositions())
    assert torch.equal(loaded.positions, torch.arange(4))
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['positions'\]"):
        lowbit.load_quantized(tmp_path / "out", net())  # a persistent-only model: still strict


def test_progress_bar_on_stderr(tmp_path, capsys):
    pytest.importorskip("tqdm")
    src = write_model_dir(net().state_dict(), tmp_path / "in", shards=2)
    quantize_checkpoint(src, tmp_path / "out", "hif4-wo", workers=1, progress=True)
    captured = capsys.readouterr()
    assert captured.out == "" and "quantize-checkpoint: 100%" in captured.err
