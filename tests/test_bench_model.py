"""`lowbit bench model` plumbing on tiny layers: schemes, row counts, ratios and bytes (nothing is timed)."""

import itertools
import json

import pytest
import torch

import lowbit
from helpers import run_cli
from lowbit.cli.bench import model as bench_model
from lowbit.quantize.modules import QuantizedLinearBase

WEIGHT_ONLY = ("hif8-wo", "fp8-wo", "mxfp4-wo", "hif4-wo", "int4-a16w4")


@pytest.fixture
def fake_clock(monkeypatch):
    """median_seconds runs each function once and answers 2 s for the baseline, 3 s for the layer."""
    calls = []
    answers = itertools.cycle([0.002, 0.003])

    def fake(fn, **kwargs):
        calls.append(fn())
        return next(answers)

    monkeypatch.setattr(bench_model, "median_seconds", fake)
    return calls


def test_default_schemes_are_the_data_free_ones_including_every_weight_only_scheme():
    assert set(WEIGHT_ONLY) <= set(bench_model.DATA_FREE)
    assert all(not lowbit.SCHEMES[name].needs_calibration for name in bench_model.DATA_FREE)
    assert {name for name, s in lowbit.SCHEMES.items() if not s.needs_calibration} == set(bench_model.DATA_FREE)


def test_rows_pair_each_scheme_and_m_with_its_baseline(capsys, fake_clock):
    code, out, err = run_cli(capsys, "bench", "model", "--shape", "64x256", "--ms", "1,3", "--repeats", "2",
                             "--schemes", ",".join(WEIGHT_ONLY), "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert [(r["scheme"], r["M"]) for r in rows] == [(s, m) for s in WEIGHT_ONLY for m in (1, 3) for _ in "ab"]
    for base, layer in zip(rows[::2], rows[1::2]):
        assert base["what"] == "F.linear bf16" and base["ms"] == 2.0 and base["x F.linear time"] == 1.0
        assert layer["what"] in ("PackedLinear", "Int4Linear")
        assert layer["ms"] == 3.0 and layer["x F.linear time"] == 1.5
        assert base["weight bytes"] == 64 * 256 * 2 and base["NxK"] == layer["NxK"] == "64x256"
        assert 0 < layer["weight bytes"] < base["weight bytes"]
        assert layer["x bf16 bytes"] == layer["weight bytes"] / base["weight bytes"]
    # both functions ran on the (M, K) input: F.linear and the deploy module give (M, N) BF16
    assert {(tuple(y.shape), y.dtype) for y in fake_clock} == {((1, 64), torch.bfloat16), ((3, 64), torch.bfloat16)}


def test_layers_run_in_turn_each_with_its_own_weight_and_times_are_per_layer(capsys, fake_clock, monkeypatch):
    made, calls = [], []
    quantized_layer = bench_model.quantized_layer

    def recording(weight, bias, scheme):  # each converted layer counts its calls
        result = quantized_layer(weight, bias, scheme)
        made.append(weight)
        index = len(made) - 1
        result[0].register_forward_hook(lambda *args: calls.append(index))
        return result

    monkeypatch.setattr(bench_model, "quantized_layer", recording)
    code, out, err = run_cli(capsys, "bench", "model", "--shape", "64x256", "--ms", "2", "--repeats", "2",
                             "--schemes", "mxfp4-wo", "--layers", "3", "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert [r["layers"] for r in rows] == [3, 3]
    assert rows[0]["ms"] == pytest.approx(2.0 / 3) and rows[1]["ms"] == pytest.approx(1.0)
    assert rows[1]["x F.linear time"] == 1.5
    assert len(made) == 3 and not any(torch.equal(made[0], w) for w in made[1:])
    assert calls == [0, 1, 2] * 3  # a first call each, then one pass per sample (two repeats)
    assert {(tuple(y.shape), y.dtype) for y in fake_clock} == {((2, 64), torch.bfloat16)}


@pytest.mark.parametrize("scheme", bench_model.DATA_FREE)
def test_quantized_layer_is_the_deploy_module_and_counts_its_packed_tensors(scheme):
    weight = torch.randn(32, 128).to(torch.bfloat16)
    bias = torch.zeros(32, dtype=torch.bfloat16)
    module, packed, float_bytes = bench_model.quantized_layer(weight, bias, scheme)
    assert isinstance(module, QuantizedLinearBase)
    assert float_bytes == 32 * 128 * 2
    tensors = [t for name, t in module.state_dict().items() if name != "bias"]
    assert packed == sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("argv, message", [
    (("--schemes", "hif8-w8a8-ofmr"), "hif8-w8a8-ofmr"),  # needs calibration data
    (("--shape", "64"), "64"),
    (("--ms", "0"), "0"),
    (("--layers", "0"), "0"),
    (("--shape", "63x100", "--schemes", "int4-a16w4"), "K = 100"),
])
def test_bad_options_are_one_line_errors(capsys, fake_clock, argv, message):
    code, out, err = run_cli(capsys, "bench", "model", "--repeats", "1", "--ms", "1", *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err
