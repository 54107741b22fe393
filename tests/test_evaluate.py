"""Model-level evaluation: layer replacement is exact, metrics are right, the command works."""

import json

import pytest
import torch
from torch import nn

from lowbit.cli import main as cli
from lowbit.nn import evaluate
from lowbit.ops.hifloat4 import hifloat4_fake_quant
from lowbit.ops.hifloat8 import decode_from_hifloat8, encode_to_hifloat8


def tiny_model():
    """(model, inputs) for `lowbit eval --model test_evaluate:tiny_model`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10))
    return model, torch.randn(32, 128)


def test_replaced_weights_are_the_operators_fake_quant():
    model, _ = tiny_model()
    q, replaced, skipped = evaluate.quantize_linear_layers(model, evaluate.FORMATS["hifloat4"])
    assert (replaced, skipped) == (2, 1)  # K = 48 is not a multiple of 64
    assert torch.equal(q[0].weight, hifloat4_fake_quant(model[0].weight.detach()))
    assert torch.equal(q[4].weight, model[4].weight)  # skipped layer untouched
    q8, replaced, _ = evaluate.quantize_linear_layers(model, evaluate.FORMATS["hifloat8"])
    expected = decode_from_hifloat8(encode_to_hifloat8(model[2].weight.detach().bfloat16())).float()
    assert replaced == 3 and torch.equal(q8[2].weight, expected)
    assert model[0].weight.dtype == torch.float32 and not torch.equal(q[0].weight, model[0].weight)


def test_svdquant_layers_run_inside_a_float32_model():
    model, x = tiny_model()
    q, replaced, skipped = evaluate.quantize_linear_layers(model, evaluate.FORMATS["svdquant-r32"])
    assert (replaced, skipped) == (2, 1)  # K = 48 is not a multiple of 32; the others fit (rank <= min(N, K))
    assert q(x).dtype == torch.float32


def test_compare_outputs():
    ref = torch.tensor([[3.0, 4.0], [1.0, -1.0]])
    same = evaluate.compare_outputs(ref, ref.clone())
    assert same == {"sqnr_db": float("inf"), "rel_l2_error": 0.0, "top1_agreement": 1.0}
    noisy = evaluate.compare_outputs(ref, ref + torch.tensor([[0.0, 0.0], [0.0, 3.0]]))
    # signal 27, noise 9 -> 10 log10(3); second row's argmax flips
    assert noisy["sqnr_db"] == pytest.approx(4.771212547, rel=1e-9)
    assert noisy["rel_l2_error"] == pytest.approx(3**-0.5)
    assert noisy["top1_agreement"] == 0.5


def test_evaluate_formats_orders_formats_by_precision():
    model, x = tiny_model()
    rows = {r["format"]: r for r in evaluate.evaluate_formats(model, x)}
    assert list(rows) == list(evaluate.FORMATS)
    assert rows["bf16"]["sqnr_db"] > rows["hifloat8"]["sqnr_db"] > rows["hifloat4"]["sqnr_db"] > 5
    assert all(r["sqnr_db"] > 5 for r in rows.values())
    with pytest.raises(ValueError, match="nope"):
        evaluate.evaluate_formats(model, x, ["nope"])


def test_eval_command(capsys):
    assert cli.main(["eval", "--model", "test_evaluate:tiny_model", "--formats", "bf16,mxfp4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["format"] for r in rows] == ["bf16", "mxfp4"]
    assert rows[1]["layers_quantized"] == 2 and rows[1]["layers_skipped"] == 1  # K = 48 % 32 != 0
    assert rows[1]["bits_per_weight"] == 4.25
    with pytest.raises(ValueError, match="module:function"):
        cli.main(["eval", "--model", "no_colon"])


def test_json_output_is_strict_json(capsys):
    from lowbit.cli.bench import to_json

    assert json.loads(to_json([{"sqnr_db": float("inf"), "x": float("nan"), "y": 1.5}])) == [
        {"sqnr_db": None, "x": None, "y": 1.5}]


def test_demo_model_is_deterministic():
    a, b = evaluate.DemoMLP(width=64, hidden=128, blocks=1, classes=10), evaluate.DemoMLP(width=64, hidden=128, blocks=1, classes=10)
    x = evaluate.demo_inputs(4, 64)
    assert torch.equal(a(x), b(x)) and torch.equal(x, evaluate.demo_inputs(4, 64))
