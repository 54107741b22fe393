"""`lowbit smoke weight_only`: the three weight-only linear operators on both CPU paths, verdicts, a broken
kernel, and the inputs the check relies on (specials in x, exact sums in the GEMM case)."""

import json
from collections import Counter

import pytest
import torch

from helpers import run_cli
from lowbit.cli.smoke import weight_only as smoke
from lowbit.formats.weight_only import EXACT_ROWS

OPERATORS = ["hifloat8_linear", "float8_e4m3fn_linear", "mxfp8_linear", "mxfp4_linear", "hifloat4_linear"]


def rows(result):
    return torch.Size(result["x_shape"][:-1]).numel()


def test_native_cpu_verifies_every_operator_on_both_paths(capsys):
    code, out, err = run_cli(capsys, "smoke", "weight_only", "--backend", "native", "--device", "cpu", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["op"] == "weight_only" and report["hardware_path_verified"] is True
    results = report["results"]
    assert Counter(r["operator"] for r in results) == {op: 10 for op in OPERATORS}
    assert Counter((r["input_dtype"], r["path"]) for r in results) == {
        ("bfloat16", "decode"): 20, ("float16", "decode"): 20, ("bfloat16", "gemm"): 5, ("float16", "gemm"): 5}
    for r in results:
        assert r["backend"] == "native" and r["matches_reference"] and r["extra_contracts"] == []
        assert (rows(r) <= EXACT_ROWS) == (r["path"] == "decode")  # the GEMM case runs the other CPU path
    tails = {r["operator"] for r in results if r["x_shape"][-1] % 64}
    assert tails == {"hifloat8_linear", "float8_e4m3fn_linear", "mxfp8_linear", "mxfp4_linear"}  # HiF4: 64-blocks
    assert {r["bias"] for r in results} == {None, "bfloat16", "float16"}


def test_reference_backend_holds_but_is_not_a_hardware_path(capsys):
    code, out, _ = run_cli(capsys, "smoke", "weight_only", "--backend", "reference", "--device", "cpu", "--json")
    report = json.loads(out)
    assert code == 0 and report["hardware_path_verified"] is False
    assert {r["backend"] for r in report["results"]} == {"reference"}


def test_a_broken_kernel_fails_its_operator_only(capsys, monkeypatch):
    real = smoke.hifloat4_linear
    monkeypatch.setattr(smoke, "hifloat4_linear", lambda *a, **k: real(*a, **k) * 2)
    code, out, _ = run_cli(capsys, "smoke", "weight_only", "--device", "cpu", "--json")
    results = json.loads(out)["results"]
    assert code == 1
    assert all(r["matches_reference"] == (r["operator"] != "hifloat4_linear") for r in results)
    code, out, _ = run_cli(capsys, "smoke", "weight_only", "--device", "cpu")
    assert code == 1 and "FAILED: weight_only broke a contract" in out
    assert "(first: bfloat16, operator=hifloat4_linear, x_shape=[1, 128])" in " ".join(out.split())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 96), (1, 3, 100)])
def test_decode_x_holds_a_zero_a_large_and_a_tiny_value(dtype, shape):
    x = smoke.decode_x(shape, dtype, torch.Generator().manual_seed(0))
    assert x.shape == shape and x.dtype == dtype
    first = x.reshape(-1, shape[-1])[0, :3].tolist()
    assert first == [0.0, smoke.LARGE, torch.finfo(dtype).tiny]
    assert torch.isfinite(x).all()


@pytest.mark.parametrize("seed", range(4))
def test_gemm_case_sums_are_exact_in_float32_in_any_order(seed):
    """Every product is a multiple of 2^-10 and each row's absolute sum (plus a bias of at most 4) is below
    2^14: every partial sum of any order is a multiple of 2^-10 below 2^14, exact in float32's 24 bits."""
    for _, _, ks, quantize, dense in smoke.formats():
        x, w = smoke.gemm_operands(ks[1], torch.Generator().manual_seed(seed))
        assert x.shape == (smoke.GEMM_ROWS, ks[1]) and smoke.GEMM_ROWS > EXACT_ROWS
        products = x.double()[:, None, :] * dense(*quantize(w)).double()[None]
        scaled = products * 2**10
        assert torch.equal(scaled, scaled.round())
        assert (products.abs().sum(-1) + 4 < 2**14).all()
