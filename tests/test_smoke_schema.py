"""`lowbit smoke --json` output against its written schema, docs/smoke_report.schema.json (keys, types)."""

import copy
import json
from pathlib import Path

import pytest
import torch

import json_schema_subset
from lowbit.cli import main as cli
from lowbit.cli.smoke import hifloat8 as hifloat8_smoke

SCHEMA = json.loads((Path(__file__).parents[1] / "docs" / "smoke_report.schema.json").read_text())


def problems(report: dict) -> list[str]:
    """Schema violations, plus what JSON Schema cannot say: extra contracts are boolean keys of their case."""
    found = json_schema_subset.errors(report, SCHEMA)
    for op in report.get("ops", [report]):
        for i, case in enumerate(op.get("results", [])):
            found += [f"{op['op']} case {i}: extra contract {name!r} is not a boolean key"
                      for name in case.get("extra_contracts", []) if not isinstance(case.get(name), bool)]
    return found


def smoke(capsys, *argv):
    code = cli.main(["smoke", *argv, "--json"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("op", ["hifloat8", "weight_only"])
def test_one_operator_report_matches_the_schema(capsys, op):
    code, out, err = smoke(capsys, op, "--backend", "native", "--device", "cpu")
    assert code == 0, err
    report = json.loads(out)
    assert problems(report) == []
    assert out == json.dumps(report, indent=2, sort_keys=True) + "\n"  # sorted keys, as documented


def test_all_operators_report_matches_the_schema(capsys):
    code, out, err = smoke(capsys, "all", "--device", "cpu")
    assert code == 0, err
    report = json.loads(out)
    assert problems(report) == []
    assert len(report["ops"]) >= 5


def test_broken_and_failed_operator_reports_match_the_schema(capsys, monkeypatch):
    real = hifloat8_smoke.decode_from_hifloat8
    monkeypatch.setattr(hifloat8_smoke, "decode_from_hifloat8", lambda *a, **k: real(*a, **k) + 1)
    code, out, _ = smoke(capsys, "hifloat8", "--device", "cpu")
    assert code == 1 and problems(json.loads(out)) == []

    def explode(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(hifloat8_smoke, "encode_to_hifloat8", explode)
    code, out, err = smoke(capsys, "hifloat8", "--device", "cpu")
    assert code == 1
    for text in (out, err):
        if text:
            assert problems(json.loads(text)) == []


def test_cannot_run_error_object_matches_the_schema(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    code, out, err = smoke(capsys, "hifloat8", "--device", "cuda:0")
    assert code == 2 and out == ""
    assert problems(json.loads(err)) == []


GOOD_CASE = {"backend": "native", "input_dtype": "float16", "shape_preserved": True, "dtype_preserved": True,
             "device_preserved": True, "matches_reference": True, "max_abs_error": 0.5, "mean_abs_error": 0.1,
             "warning_count": 0, "extra_contracts": ["codes_match_reference"], "codes_match_reference": True}
GOOD_ENV = {"amct_ops": None, "cann_home": None, "cpu_threads": 2, "device": "cpu", "device_name": "x",
            "lowbit": "0.1.0", "numba": None, "omp_wait_policy": None,
            "gomp_spincount": None, "python": "3.11", "torch": "2.13",
            "torch_npu": None, "triton": None}
GOOD = {"requested_backend": "auto", "hardware_path_verified": True, "environment": GOOD_ENV,
        "ops": [{"op": "hifloat8", "hardware_path_verified": True, "results": [GOOD_CASE]}]}


def _broken(edit):
    report = copy.deepcopy(GOOD)
    edit(report)
    return report


@pytest.mark.parametrize("edit,words", [
    (lambda r: r.pop("environment"), "missing key 'environment'"),
    (lambda r: r.update(extra=1), "unexpected key 'extra'"),
    (lambda r: r["ops"][0]["results"][0].update(matches_reference="yes"), "not of type"),
    (lambda r: r["ops"][0]["results"][0].update(warning_count=1.5), "not of type"),
    (lambda r: r["ops"][0]["results"][0].update(backend="fast"), "not one of"),
    (lambda r: r["ops"][0]["results"][0].pop("max_abs_error"), "missing key 'max_abs_error'"),
    (lambda r: r["ops"][0]["results"][0].update(codes_match_reference=None), "is not a boolean key"),
    (lambda r: r["ops"][0].update(error="RuntimeError: x"), "oneOf"),
    (lambda r: r["ops"][0].pop("results"), "oneOf"),
    (lambda r: r["environment"].update(cpu_threads="2"), "not of type"),
    (lambda r: r.update(ops=[]), "fewer than 1"),
])
def test_the_checker_rejects_drift(edit, words):
    assert problems(GOOD) == []
    found = problems(_broken(edit))
    assert any(words in p for p in found), found


def test_the_error_object_must_say_not_verified():
    error = {"requested_backend": None, "hardware_path_verified": True, "error": "x"}
    assert problems(error)
    assert problems({**error, "hardware_path_verified": False}) == []


def test_the_checker_refuses_keywords_it_does_not_check():
    with pytest.raises(ValueError, match="pattern"):
        json_schema_subset.errors("x", {"type": "string", "pattern": "^x$"})
