"""Both renderings of every report command (the human view by default, --json) and their exit codes, which
are the same in both (docs/cli.md, "Output")."""

import json

import numpy as np
import pytest
import torch
from torch import nn

from lowbit.cli import main as cli
from lowbit.cli.smoke import hifloat8 as hifloat8_smoke


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def both(capsys, *argv):
    """(code, human stdout lines, err) and (code, parsed JSON, err) of the same command line."""
    code, out, err = run(capsys, *argv)
    assert "\x1b[" not in out  # not a terminal: no colour codes
    json_code, json_out, json_err = run(capsys, *argv, "--json")
    return (code, out.splitlines(), err), (json_code, json.loads(json_out) if json_out else None, json_err)


def tiny_model():
    """For `--model test_cli_output:tiny_model`: (model, input batch)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32)), torch.randn(8, 64)


def test_smoke_verified_in_both_renderings(capsys):
    (code, lines, _), (json_code, report, _) = both(capsys, "smoke", "hifloat8", "--device", "cpu")
    assert code == json_code == 0 and report["hardware_path_verified"] is True
    assert lines[-1].startswith("VERIFIED: hifloat8 met every contract") and len(lines) < 25
    assert not lines[-1].startswith("{")


def test_smoke_broken_contract_exits_1_in_both(capsys, monkeypatch):
    real = hifloat8_smoke.decode_from_hifloat8
    monkeypatch.setattr(hifloat8_smoke, "decode_from_hifloat8", lambda *a, **k: real(*a, **k) + 1)
    (code, lines, _), (json_code, report, _) = both(capsys, "smoke", "hifloat8", "--device", "cpu")
    assert code == json_code == 1 and report["hardware_path_verified"] is False
    assert lines[-1].startswith("FAILED: hifloat8 broke a contract")
    assert any(line.startswith("hifloat8: matches_reference failed in 2 of 2 cases") for line in lines)


def test_smoke_cannot_run_exits_2_in_both(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    (code, lines, err), (json_code, report, json_err) = both(capsys, "smoke", "all", "--device", "cuda:0")
    assert code == json_code == 2 and lines == [] and report is None
    assert err == "lowbit smoke: error: device cuda:0: CUDA is not available\n"
    assert json.loads(json_err)["error"] == "device cuda:0: CUDA is not available"


def test_info_in_both_renderings(capsys):
    (code, lines, _), (json_code, report, _) = both(capsys, "info", "--backend", "reference")
    assert code == json_code == 0
    assert set(report["operators"]["svd_quant"]["cpu"]) == {"backend"}
    assert lines[-1] == f"backend reference: native kernels for 0 of {len(report['operators'])} operators on cpu; " \
                        f"reference: {', '.join(sorted(report['operators']))}"


def test_bench_in_both_renderings_and_the_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    argv = ("bench", "hifloat8", "--sizes", "4096", "--dtypes", "float16", "--repeats", "1", "--plot", png)
    (code, lines, _), (json_code, rows, _) = both(capsys, *argv)
    assert code == json_code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [r["what"] for r in rows][0] == "memcpy (prealloc)" and {r["op"] for r in rows} == {"hifloat8"}
    assert lines[0] == "hifloat8" and lines[-1].startswith(f"timed 1 operator ({len(rows)} rows) on cpu; 'x memcpy'")
    assert sum("4096" in line for line in lines) == len(rows)
    assert not list(tmp_path.glob(".*"))  # written atomically: no temporary left


def test_bench_plot_errors_are_one_line_exit_2(capsys, monkeypatch, tmp_path):
    code, out, err = run(capsys, "bench", "hifloat8", "--sizes", "4096", "--plot", tmp_path / "no" / "b.png")
    assert code == 2 and out == "" and err.startswith("lowbit bench hifloat8: error: --plot ")
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    code, out, err = run(capsys, "bench", "hifloat8", "--sizes", "4096", "--plot", tmp_path / "b.png")
    assert code == 2 and out == "" and "pip install 'lowbit[plot]'" in err and err.count("\n") == 1


@pytest.fixture
def dataset(tmp_path, capsys):
    assert cli.main(["wqbmm", "gen-data", "--dir", str(tmp_path), "--m", "2", "--n", "64", "--k", "128",
                     "--group-size", "64"]) == 0
    assert cli.main(["wqbmm", "run", "--dir", str(tmp_path), "--backend", "reference"]) == 0
    capsys.readouterr()
    return tmp_path


def test_verify_pass_and_fail_in_every_rendering(capsys, dataset):
    output, golden = dataset / "output/output_z.bin", dataset / "output/golden.bin"
    (code, lines, _), (json_code, result, _) = both(capsys, "verify", output, golden)
    assert code == json_code == 0 and result["passed"] is True and result["error_tol"] == 1e-3
    assert lines[-1].startswith("PASS: 0 errors and 0 mismatches in 128 elements")
    wrong = dataset / "wrong.bin"
    values = np.fromfile(golden, dtype=np.float16)
    (values * 2 + 1).astype(np.float16).tofile(wrong)
    (code, lines, _), (json_code, result, _) = both(capsys, "verify", wrong, golden)
    assert code == json_code == 1 and result["passed"] is False and result["errors"] > 0
    assert len(result["first"]) == min(result["mismatches"], 101)  # the sample's printout shows 101
    assert lines[-1].startswith(f"FAIL: {result['errors']} errors") and lines[0].startswith("first 10 of")
    code, out, _ = run(capsys, "verify", wrong, golden, "--sample")
    assert code == 1 and out.splitlines()[-1] == "[ERROR] result error"
    code, _, err = run(capsys, "verify", wrong, golden, "--sample", "--json")
    assert code == 2 and "not allowed with argument" in err


def test_wqbmm_profile_and_example_in_both_renderings(capsys, dataset):
    (code, lines, _), (json_code, rows, _) = both(capsys, "wqbmm", "profile", "--dir", dataset,
                                                  "--backends", "reference", "--repeats", "1")
    assert code == json_code == 0 and {r["backend"] for r in rows} == {"reference"}
    assert lines[-1].startswith("fastest: ") and " on reference, " in lines[-1]
    argv = ("wqbmm", "example", "--dir", dataset, "--m", "2", "--n", "64", "--k", "128", "--group-size", "64",
            "--backend", "reference")
    (code, lines, _), (json_code, report, _) = both(capsys, *argv)
    assert code == json_code == 0 and report["passed"] is True and set(report["verify"]) == {"basic", "preload"}
    assert report["meta"]["k"] == 128 and lines[-1] == "PASS: basic, preload match the golden"


def test_eval_and_quantize_in_both_renderings(capsys, tmp_path):
    model = "test_cli_output:tiny_model"
    (code, lines, _), (json_code, rows, _) = both(capsys, "eval", "--model", model, "--schemes", "hif8-wo,mxfp4-wo")
    assert code == json_code == 0 and [r["scheme"] for r in rows] == ["hif8-wo", "mxfp4-wo"]
    assert lines[-1].startswith("closest to float: ")
    out = tmp_path / "ckpt"
    (code, lines, _), (json_code, summary, _) = both(capsys, "quantize", "--model", model, "--scheme", "hif8-wo",
                                                      "--out", out)
    assert code == json_code == 0 and summary["layers_quantized"] and summary["checkpoint"] == str(out)
    assert lines[-1].startswith(f"quantized {len(summary['layers_quantized'])} layers of {model} with hif8-wo")
    code, out_text, err = run(capsys, "eval", "--model", model, "--schemes", "bogus", "--json")
    assert code == 2 and out_text == "" and err.startswith("lowbit eval: error: ")


def test_no_arguments_prints_the_commands_and_exits_0(capsys):
    code, out, err = run(capsys)
    assert code == 0 and err == ""
    assert out.splitlines()[0].startswith("lowbit: ") and "  smoke " in out and "  verify " in out
