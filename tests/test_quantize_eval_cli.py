"""`lowbit quantize` and `lowbit eval` on the real all-MiniLM-L6-v2 and a tiny local causal LM."""

import json
import re

import pytest
import torch
from torch import nn

from lowbit.cli import main as cli

EVAL_KEYS = {"scheme", "bits_per_weight", "layers_quantized", "layers_skipped", "mean_cosine", "nn_agreement",
             "sqnr_db", "nonfinite_outputs", "weight_bytes", "checkpoint_bytes"}


def wrong_type():
    """For `--model test_quantize_eval_cli:wrong_type`: not a (model, inputs) pair."""
    return nn.Linear(64, 64)


def no_linear():
    """A model with no layer any scheme quantizes."""
    return nn.Sequential(nn.Tanh()), torch.randn(4, 64)


def small_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128)), torch.randn(16, 128)


def token_model():
    """An embedding model fed token ids (integers: they must not be cast to float)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(50, 128), nn.Linear(128, 128)), torch.randint(0, 50, (4, 16))


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


def test_quantize_writes_a_loadable_checkpoint(tiny_causal_lm_path, tmp_path, capsys):
    import lowbit
    from lowbit.evaluation.models import load_hf_dir

    out = tmp_path / "ckpt"
    assert cli.main(["quantize", "--model", str(tiny_causal_lm_path), "--scheme", "hif8-wo", "--out", str(out)]) == 0
    summary = capsys.readouterr().out
    # 2 x (4 attention + 3 MLP) quantized; lm_head skipped
    assert re.search(r"^layers +14 quantized, 1 skipped$", summary, re.M)
    assert summary.splitlines()[-1].startswith("quantized 14 layers of ") and f"checkpoint {out} (" in summary
    loaded = lowbit.load_quantized(out, load_hf_dir(tiny_causal_lm_path, meta=True).model)
    reference = load_hf_dir(tiny_causal_lm_path).model
    lowbit.quantize_(reference, "hif8-wo")
    ids = torch.arange(40).reshape(2, 20)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)


def test_quantize_with_a_config_file(tmp_path, capsys):
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps({"batch_num": 1, "quant_cfg": {"weights": {"type": "hifloat8", "strategy": "channel"},
                                                                   "inputs": {"type": "hifloat8"}},
                                  "algorithm": "minmax"}))
    out = tmp_path / "ckpt"
    assert cli.main(["quantize", "--model", "test_quantize_eval_cli:small_mlp", "--config", str(config),
                     "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert len(summary["layers_quantized"]) == 2 and summary["checkpoint"] == str(out) and any(out.iterdir())


def test_eval_on_minilm_json_keys_and_honest_floors(minilm_path, tmp_path, capsys):
    path = tmp_path / "rows.json"
    assert cli.main(["eval", "--model", str(minilm_path), "--schemes", "hif8-wo,mxfp4-wo", "--sentences", "48",
                     "--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    assert [r["scheme"] for r in rows] == ["hif8-wo", "mxfp4-wo"] and all(set(r) == EVAL_KEYS for r in rows)
    hif8, mxfp4 = rows
    assert hif8["layers_quantized"] == 37 and hif8["layers_skipped"] == 0  # all-MiniLM-L6-v2's 37 Linear layers
    # floors well below the measured values (benchmarks/results_quantize.md), far above an unquantized-noise model
    assert 20 < hif8["sqnr_db"] < 60 and hif8["mean_cosine"] > 0.99 and hif8["nn_agreement"] >= 0.85
    assert 6 < mxfp4["sqnr_db"] < hif8["sqnr_db"] and mxfp4["mean_cosine"] > 0.9
    float_bytes = (minilm_path / "model.safetensors").stat().st_size
    assert mxfp4["checkpoint_bytes"] < hif8["checkpoint_bytes"] < float_bytes
    assert mxfp4["weight_bytes"] < hif8["weight_bytes"] < hif8["checkpoint_bytes"]
    table = capsys.readouterr().out
    assert "hif8-wo" in table and "SQNR dB" in table and table.splitlines()[-1].startswith("closest to float: ")


def test_eval_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "eval.png"
    assert cli.main(["eval", "--model", "test_quantize_eval_cli:small_mlp", "--schemes", "hif8-wo,mxfp4-wo",
                     "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_perplexity_of_a_causal_lm(tiny_causal_lm_path, tmp_path, capsys):
    from lowbit.evaluation.models import load_hf_dir
    from lowbit.evaluation.ppl import perplexity, tokenize_text_file
    from lowbit.evaluation.text import all_sentences

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(all_sentences()[:60]))
    assert cli.main(["eval", "--model", str(tiny_causal_lm_path), "--schemes", "hif8-w8a8-minmax",
                     "--text", str(corpus), "--seqlen", "64", "--calib-sentences", "4", "--json", "-"]) == 0
    rows = json.loads(capsys.readouterr().out)
    lm = load_hf_dir(tiny_causal_lm_path)
    assert rows[0]["scheme"] == "float32"
    assert rows[0]["perplexity"] == perplexity(lm.model, tokenize_text_file(lm.tokenizer, corpus), 64)
    assert rows[1]["scheme"] == "hif8-w8a8-minmax" and rows[1]["layers_quantized"] == 14  # calibrated on sentences
    ratio = rows[1]["perplexity"] / rows[0]["perplexity"]
    assert ratio != 1 and abs(ratio - 1) < 0.1


@pytest.mark.parametrize("argv, message", [
    (["eval", "--model", "/nonexistent/model"], "not a Hugging Face model directory"),
    (["eval", "--model", "test_quantize_eval_cli:wrong_type", "--schemes", "hif8-wo"],
     "must return (torch.nn.Module, torch.Tensor), got Linear"),
    (["eval", "--model", "test_quantize_eval_cli:no_linear", "--schemes", "hif8-wo"], "quantized no layer"),
    (["eval", "--model", "test_quantize_eval_cli:nope", "--schemes", "hif8-wo"], "has no function nope"),
    (["eval", "--model", "test_quantize_eval_cli:small_mlp", "--schemes", "hif8-wo,bogus"], "unknown scheme(s) bogus"),
    (["eval", "--model", "test_quantize_eval_cli:small_mlp", "--sentences", "1"],
     "argument --sentences: expected an integer >= 2, got '1'"),
    (["eval", "--model", "test_quantize_eval_cli:small_mlp", "--seqlen", "0"],
     "argument --seqlen: expected an integer >= 2, got '0'"),
    (["eval", "--model", "test_quantize_eval_cli:small_mlp", "--plot", "{tmp}"],
     "is a directory, expected a file name"),
    (["quantize", "--model", "test_quantize_eval_cli:small_mlp", "--scheme", "hif8-wo", "--out", "{tmp}/c.txt"],
     "c.txt exists and is not a directory"),
    (["eval", "--model", "test_quantize_eval_cli:small_mlp", "--schemes", "hif8-wo", "--json", "/nonexistent/x.json"],
     "no directory /nonexistent"),
    (["quantize", "--model", "test_quantize_eval_cli:small_mlp", "--scheme", "bogus", "--out", "x"], "unknown scheme"),
    (["quantize", "--model", "test_quantize_eval_cli:small_mlp", "--config", "/nonexistent.json", "--out", "x"],
     "/nonexistent.json"),
    (["quantize", "--model", "test_quantize_eval_cli:no_linear", "--scheme", "hif8-wo", "--out", "{tmp}/x"],
     "nothing to quantize"),
    (["quantize", "--model", "test_quantize_eval_cli:small_mlp", "--scheme", "hif8-w8a8-ofmr", "--calib-text",
      "{tmp}/c.txt", "--out", "{tmp}/x"], "--calib-text: test_quantize_eval_cli:small_mlp is a module:function"),
    (["quantize", "--model", "minilm", "--scheme", "hif8-w8a8-ofmr", "--calib-text", "{tmp}/bin.txt", "--out",
      "{tmp}/x"], "--calib-text {tmp}/bin.txt is not UTF-8 text"),
    (["eval", "--model", "{causal}", "--schemes", "hif8-wo", "--text", "{tmp}/bin.txt"],
     "--text {tmp}/bin.txt is not UTF-8 text"),
])
def test_cli_errors_are_one_line_exit_2(argv, message, tmp_path, capsys, request):
    (tmp_path / "c.txt").write_text("a calibration sentence\n")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe binary")
    causal = str(request.getfixturevalue("tiny_causal_lm_path")) if "{causal}" in argv else ""
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{causal}", causal) for a in argv]
    assert cli.main(argv) == 2
    err = one_error_line(capsys)
    assert err.startswith(f"lowbit {argv[0]}: error: ") and message.replace("{tmp}", str(tmp_path)) in err


@pytest.mark.parametrize("content, message", [
    ("[]", "expected a JSON object, got list"), ("{", "not a JSON file"),
    ('{"architectures": 5}', "'architectures' must be a list of class names"),
    ("[" * 100000 + "]" * 100000, "not a JSON file (RecursionError")])
def test_a_bad_hugging_face_config_is_named(content, message, tmp_path, capsys):
    (tmp_path / "config.json").write_text(content)
    assert cli.main(["eval", "--model", str(tmp_path), "--schemes", "hif8-wo"]) == 2
    err = one_error_line(capsys)
    assert f"{tmp_path / 'config.json'}: {message}" in err


@pytest.mark.parametrize("command", ["quantize", "eval"])
@pytest.mark.parametrize("option, value", [("--calib-sentences", "0"), ("--calib-sentences", "-1"),
                                           ("--batch-size", "0")])
def test_counts_are_checked_when_the_command_line_is_read(command, option, value, tmp_path, capsys):
    argv = [command, "--model", "test_quantize_eval_cli:small_mlp", option, value]
    argv += ["--scheme", "hif8-w8a8-ofmr", "--out", str(tmp_path / "x")] if command == "quantize" else []
    assert cli.main(argv) == 2
    err = one_error_line(capsys)
    assert f"argument {option}: expected a positive integer, got {value!r}" in err
    assert not (tmp_path / "x").exists()


def test_quantize_out_that_is_not_a_checkpoint_is_refused_and_kept(tiny_causal_lm_path, tmp_path, capsys):
    """--out pointing at the model's own directory (or any folder of other files) is refused before anything
    loads, and nothing in it is touched (it was replaced, deleting the model)."""
    before = {p.name: p.read_bytes() for p in tiny_causal_lm_path.iterdir() if p.is_file()}
    argv = ["quantize", "--model", str(tiny_causal_lm_path), "--scheme", "hif8-wo", "--out", str(tiny_causal_lm_path)]
    assert cli.main(argv) == 2
    err = one_error_line(capsys)
    assert err.startswith("lowbit quantize: error: --out: ") and "not a checkpoint written by save_quantized" in err
    assert {p.name: p.read_bytes() for p in tiny_causal_lm_path.iterdir() if p.is_file()} == before


def test_a_callable_model_fed_token_ids_is_quantized_and_evaluated(tmp_path, capsys):
    assert cli.main(["quantize", "--model", "test_quantize_eval_cli:token_model", "--scheme", "hif8-wo",
                     "--out", str(tmp_path / "q")]) == 0
    assert cli.main(["eval", "--model", "test_quantize_eval_cli:token_model", "--schemes", "hif8-wo"]) == 0
    assert "hif8-wo" in capsys.readouterr().out


def test_bad_config_json_is_one_line(tmp_path, capsys):
    config = tmp_path / "cfg.json"
    config.write_text("{not json")
    argv = ["quantize", "--model", "test_quantize_eval_cli:small_mlp", "--config", str(config),
            "--out", str(tmp_path / "o")]
    assert cli.main(argv) == 2
    assert f"--config {config} is not valid JSON" in one_error_line(capsys)


def test_text_on_an_encoder_is_refused(minilm_path, tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("some text")
    assert cli.main(["eval", "--model", str(minilm_path), "--schemes", "hif8-wo", "--text", str(corpus)]) == 2
    assert "is not a causal LM" in one_error_line(capsys)


@pytest.mark.parametrize("damage", ["truncated", "a layer missing"])
def test_a_damaged_model_directory_is_refused_naming_it(tiny_causal_lm_path, tmp_path, capsys, damage):
    """A truncated weight file was an "internal error" naming no file; tensors missing from it were filled at
    random by transformers (its warning silenced), quantized and evaluated with exit 0."""
    import shutil

    st = pytest.importorskip("safetensors.torch")
    directory = tmp_path / "damaged"
    shutil.copytree(tiny_causal_lm_path, directory)
    weights = directory / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        message = "a weight file is truncated or corrupt"
    else:
        tensors = st.load_file(str(weights))
        st.save_file({k: v for k, v in tensors.items() if ".layers.1." not in k}, str(weights),
                     metadata={"format": "pt"})
        message = "the weight files lack or mis-shape 9 tensors the model needs"
    assert cli.main(["quantize", "--model", str(directory), "--scheme", "hif8-wo", "--out", str(tmp_path / "q")]) == 2
    assert f"error: {directory}: {message}" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


def test_an_encoder_without_its_pooler_loads(minilm_path, tmp_path):
    """A masked-LM checkpoint has no pooler, which lowbit never reads (last_hidden_state): its absence is not
    a missing tensor; any other is."""
    import shutil

    from lowbit.evaluation.models import load_hf_dir

    st = pytest.importorskip("safetensors.torch")
    directory = tmp_path / "no-pooler"
    shutil.copytree(minilm_path, directory)
    tensors = st.load_file(str(directory / "model.safetensors"))
    st.save_file({k: v for k, v in tensors.items() if not k.startswith("pooler.")},
                 str(directory / "model.safetensors"), metadata={"format": "pt"})
    assert load_hf_dir(directory).kind == "encoder"
    st.save_file({k: v for k, v in tensors.items() if not k.startswith(("pooler.", "encoder.layer.5.output"))},
                 str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lack or mis-shape 4 tensors .*encoder.layer.5.output.LayerNorm.bias"):
        load_hf_dir(directory)


def test_a_model_function_beside_the_command_is_found_and_its_errors_are_named(tmp_path, monkeypatch, capsys):
    """`lowbit quantize --model mymodel:build` in the folder of mymodel.py: "No module named 'mymodel'" (the
    console script's sys.path lacks the working directory); a function that raised printed only its message."""
    import sys

    (tmp_path / "lowbit_user_model_x.py").write_text(
        "import torch\n"
        "def build():\n    return torch.nn.Sequential(torch.nn.Linear(64, 32)), torch.randn(4, 64)\n"
        "def bad():\n    raise RuntimeError('user bug')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "lowbit_user_model_x", raising=False)
    assert cli.main(["quantize", "--model", "lowbit_user_model_x:build", "--scheme", "hif8-wo", "--out", "q"]) == 0
    assert (tmp_path / "q").is_dir()
    assert cli.main(["quantize", "--model", "lowbit_user_model_x:bad", "--scheme", "hif8-wo", "--out", "q2"]) == 2
    assert "error: lowbit_user_model_x:bad() raised RuntimeError: user bug" in capsys.readouterr().err


def test_a_perplexity_window_past_the_models_positions_is_refused(tiny_causal_lm_path, tmp_path, capsys):
    """--seqlen above max_position_embeddings: an IndexError ("internal error") for learned positions, a number
    computed past the trained context for rotary ones (the default 2048 against this model's 256)."""
    from lowbit.evaluation.text import all_sentences

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(all_sentences()[:200]))
    assert cli.main(["eval", "--model", str(tiny_causal_lm_path), "--schemes", "hif8-wo", "--text", str(corpus),
                     "--seqlen", "512"]) == 2
    assert "--seqlen 512 exceeds the 256 positions of" in capsys.readouterr().err


class _TupleModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 32)

    def forward(self, x):
        return self.linear(x), None


def tuple_mlp():
    torch.manual_seed(0)
    return _TupleModel(), torch.randn(8, 64)


def test_a_model_returning_a_tuple_is_compared_on_its_first_tensor(capsys):
    """A module:function model whose forward returns a tuple was an "internal error: AttributeError"."""
    assert cli.main(["eval", "--model", "test_quantize_eval_cli:tuple_mlp", "--schemes", "hif8-wo", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["mean_cosine"] > 0.99
