"""The lowbit command for mxfp4 and svd_quant: smoke verdicts, broken contracts, bench plumbing."""

import json

import torch

from helpers import run_cli
from lowbit.cli.smoke import mxfp4 as mxfp4_smoke
from lowbit.cli.smoke import svd_quant as svd_quant_smoke


def test_smoke_mxfp4_native_cpu(capsys):
    code, out, err = run_cli(capsys, "smoke", "mxfp4", "--backend", "native", "--device", "cpu", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["hardware_path_verified"] is True
    assert [r["input_dtype"] for r in report["results"]] == ["float16", "bfloat16", "float32"]
    for r in report["results"]:
        assert r["matches_reference"] and r["codes_match_reference"] and r["worked_vector_bytes_ok"]


def test_smoke_svd_quant_native_cpu(capsys):
    code, out, err = run_cli(capsys, "smoke", "svd_quant", "--backend", "native", "--device", "cpu", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["hardware_path_verified"] is True
    assert [r["shape_bsnkr"] for r in report["results"]] == [list(c) for c in svd_quant_smoke.CASES]
    for r in report["results"]:
        assert r["backend"] == "native" and r["within_tolerance"] and r["extra_contracts"] == ["within_tolerance"]
        assert r["tolerance"] == {"rtol": 1e-2, "atol": 1e-2}
        assert r["bitwise_equal_reference"] == r["matches_reference"]


def test_smoke_reference_backends_do_not_verify_hardware(capsys):
    for op in ("mxfp4", "svd_quant"):
        code, out, _ = run_cli(capsys, "smoke", op, "--backend", "reference", "--device", "cpu", "--json")
        assert code == 0 and json.loads(out)["hardware_path_verified"] is False


def test_smoke_broken_contracts_exit_1(capsys, monkeypatch):
    real = mxfp4_smoke.mxfp4_dequantize
    monkeypatch.setattr(mxfp4_smoke, "mxfp4_dequantize", lambda *a, **k: real(*a, **k) * 2)
    code, out, _ = run_cli(capsys, "smoke", "mxfp4", "--device", "cpu", "--json")
    assert code == 1 and not any(r["matches_reference"] for r in json.loads(out)["results"])
    real_op = svd_quant_smoke.svd_quant
    monkeypatch.setattr(svd_quant_smoke, "svd_quant", lambda *a, **k: real_op(*a, **k) * 1.05)
    code, out, _ = run_cli(capsys, "smoke", "svd_quant", "--device", "cpu", "--json")
    results = json.loads(out)["results"]
    assert code == 1 and not any(r["matches_reference"] or r["within_tolerance"] for r in results)


def _bf16_bits(t):
    return [v & 0xFFFF for v in t.view(torch.int16).tolist()]


def test_smoke_input_holds_the_worked_vector_and_the_ties():
    """Rows 0 and 2 against hand-derived BF16 bit patterns (0.2 -> 0x3E4D and 5.9 -> 0x40BD round to nearest)."""
    x = mxfp4_smoke.smoke_input(torch.bfloat16)
    assert x.shape == (3, 64)
    # 4, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, 0.2, 5.9, -0.0, then 20 zeros; the block appears twice
    worked = [0x4080, 0x3E80, 0x3F40, 0x3FA0, 0x3FE0, 0x4020, 0x4060, 0x40A0, 0xBE80, 0x3E4D, 0x40BD, 0x8000]
    assert _bf16_bits(x[0]) == (worked + [0] * 20) * 2
    # a zero block, then the seven E2M1 midpoints 0.25 .. 5 repeated (ties of every rounding step)
    midpoints = [0x3E80, 0x3F40, 0x3FA0, 0x3FE0, 0x4020, 0x4060, 0x40A0]
    assert _bf16_bits(x[2]) == [0] * 32 + (midpoints * 5)[:32]
    assert bool(torch.isfinite(x[1]).all())  # the random row (randn * 100)


def test_bench_modules_run_tiny_cases(capsys):
    code, out, _ = run_cli(capsys, "bench", "mxfp4", "--sizes", "4096", "--repeats", "1", "--json")
    rows = json.loads(out)
    assert code == 0 and rows[0]["what"] == "memcpy (prealloc)" and len(rows) == 7
    code, out, _ = run_cli(capsys, "bench", "svd_quant", "--shapes", "1x4x64x64x32", "--repeats", "1", "--json")
    rows = json.loads(out)
    assert code == 0 and [r["what"] for r in rows] == ["F.linear bf16", "svd_quant"]
