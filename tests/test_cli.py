"""The lowbit command: smoke verdicts and exit codes, info, bench plumbing."""

import importlib.util
import json

import pytest

import torch

from helpers import run_cli
from lowbit import backends
from lowbit.cli import smoke
from lowbit.cli.smoke import _common
from lowbit.kernels.cpu import warm
from lowbit.cli.smoke import hifloat8 as hifloat8_smoke


def test_smoke_hifloat8_native_cpu_verifies_the_cpu_path(capsys):
    code, out, err = run_cli(capsys, "smoke", "hifloat8", "--backend", "native", "--device", "cpu", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["requested_backend"] == "native"
    assert report["hardware_path_verified"] is True
    assert report["environment"]["device"] == "cpu"
    assert [r["input_dtype"] for r in report["results"]] == ["float16", "bfloat16"]
    for r in report["results"]:
        assert r["backend"] == "native" and r["matches_reference"] and r["shape_preserved"]
        assert r["max_abs_error"] == 4.0  # 100 -> 96 is the largest error of the smoke input


def test_smoke_reference_backend_is_not_a_hardware_path(capsys):
    code, out, _ = run_cli(capsys, "smoke", "hifloat8", "--backend", "reference", "--device", "cpu", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["hardware_path_verified"] is False
    assert {r["backend"] for r in report["results"]} == {"reference"}


def test_smoke_all_covers_every_operator(capsys):
    from lowbit.cli.smoke import checks

    code, out, _ = run_cli(capsys, "smoke", "all", "--device", "cpu", "--json")
    report = json.loads(out)
    assert [r["op"] for r in report["ops"]] == list(checks())
    assert code == 0 and report["hardware_path_verified"] is True
    assert all("error" not in r for r in report["ops"])


@pytest.mark.parametrize("name", sorted(smoke.checks()))
def test_each_check_declares_the_operators_it_calls(name, monkeypatch):
    """`smoke all` compiles only its checks' OPERATORS before the checks run: each check calls exactly those
    (one it called undeclared would compile alone in the main process; one declared but not called compiled
    for nothing: hifloat4_pack and hifloat4_unpack did, 3 s of a cold first run)."""
    module = smoke.checks()[name]
    called = set()
    monkeypatch.setattr(backends.Operator, "record", lambda self, backend: called.add(self.name))
    module.run("auto", torch.device("cpu"))
    assert called == {op.name for op in module.OPERATORS}


def test_smoke_all_warms_the_checks_operators_only(monkeypatch):
    warmed, on_compile = [], lambda: None
    monkeypatch.setattr(warm, "warm_cache", lambda ops, on_start: warmed.extend([on_start, *(op.name for op in ops)]))
    smoke.run("all", "auto", "cpu", on_compile=on_compile)
    assert warmed.pop(0) is on_compile  # the progress line starts once the compiling processes are forked
    assert sorted(warmed) == sorted({op.name for m in smoke.checks().values() for op in m.OPERATORS})
    assert "hifloat4_pack" not in warmed and "mxfp4_linear" in warmed


def test_smoke_missing_device_exits_2_with_error_on_stderr(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    code, out, err = run_cli(capsys, "smoke", "hifloat8", "--device", "cuda:0", "--json")
    assert code == 2 and out == "" and err.count("\n") == 1
    error = json.loads(err)
    assert error["hardware_path_verified"] is False and "CUDA" in error["error"]
    assert list(error) == sorted(error)


@pytest.mark.parametrize("device,words", [("npu:0", "torch_npu"), ("bogus", "bogus")])
def test_smoke_unknown_or_absent_device_exits_2(capsys, device, words):
    if device == "npu:0" and importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed")
    code, out, err = run_cli(capsys, "smoke", "all", "--device", device, "--json")
    assert code == 2 and out == "" and words in json.loads(err)["error"]


def test_smoke_broken_contract_exits_1(capsys, monkeypatch):
    real = hifloat8_smoke.decode_from_hifloat8
    monkeypatch.setattr(hifloat8_smoke, "decode_from_hifloat8", lambda *a, **k: real(*a, **k) + 1)
    code, out, _ = run_cli(capsys, "smoke", "hifloat8", "--device", "cpu", "--json")
    report = json.loads(out)
    assert code == 1 and report["hardware_path_verified"] is False
    assert not any(r["matches_reference"] for r in report["results"])


def test_smoke_kernel_that_raises_is_a_broken_contract(capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(hifloat8_smoke, "encode_to_hifloat8", broken)
    code, out, err = run_cli(capsys, "smoke", "hifloat8", "--device", "cpu", "--json")
    assert code == 1 and out == "" and "kernel exploded" in json.loads(err)["error"]


def test_smoke_warnings_and_failed_extra_contracts(capsys, monkeypatch):
    import warnings

    real_run = hifloat8_smoke.run

    def noisy(backend, device):
        warnings.warn("something odd")
        return real_run(backend, device)

    monkeypatch.setattr(hifloat8_smoke, "run", noisy)
    code, out, _ = run_cli(capsys, "smoke", "hifloat8", "--backend", "native", "--device", "cpu", "--json")
    report = json.loads(out)
    assert code == 0 and report["hardware_path_verified"] is False
    assert {r["warning_count"] for r in report["results"]} == {1}

    def wrong_codes(backend, device):
        results = real_run(backend, device)
        results[0]["codes_match_reference"] = False
        return results

    monkeypatch.setattr(hifloat8_smoke, "run", wrong_codes)
    code, out, _ = run_cli(capsys, "smoke", "hifloat8", "--backend", "native", "--device", "cpu", "--json")
    assert code == 1 and json.loads(out)["hardware_path_verified"] is False


def test_smoke_device_spellings_are_canonical(capsys):
    code, out, _ = run_cli(capsys, "smoke", "hifloat8", "--device", "cpu:0", "--json")
    report = json.loads(out)
    assert code == 0 and report["environment"]["device"] == "cpu"
    assert all(r["device_preserved"] for r in report["results"])


# torch.randn(16) from a CPU generator seeded 2026, as FP16 (exact binary16 values): pinned, so that a change
# of the seed, the draw or the generator is caught rather than reproduced.
UPSTREAM_RANDOM_FP16 = [
    -0.1839599609375, 0.7294921875, 0.6240234375, 0.12255859375, -0.03143310546875, -0.7412109375,
    -1.357421875, -0.022003173828125, -0.544921875, 0.2193603515625, -1.4951171875, 0.34326171875,
    -0.191650390625, -0.90283203125, 0.998046875, 0.03607177734375,
]


def test_smoke_input_matches_upstream():
    x = hifloat8_smoke.smoke_input(torch.float16)
    tiny = 2.0**-14  # smallest normal FP16
    fixed = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.25, -0.25, 4.0, -4.0, 16.0, -16.0, 100.0, -100.0,
             32768.0, -32768.0, tiny, -tiny]
    expected = torch.tensor(fixed + UPSTREAM_RANDOM_FP16, dtype=torch.float16)
    assert x.dtype == torch.float16 and torch.equal(x.view(torch.int16), expected.view(torch.int16))  # -0.0 too


def test_hardware_path_is_never_verified_by_the_triton_interpreter(monkeypatch):
    results = [{"backend": "native", "warning_count": 0, "extra_contracts": [],
                **{k: True for k in _common.CONTRACT_KEYS}}]
    assert _common.hardware_path_verified(results, torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not _common.hardware_path_verified(results, torch.device("cuda:0"))


def test_info_lists_every_operator(capsys):
    code, out, _ = run_cli(capsys, "info", "--json")
    report = json.loads(out)
    assert code == 0
    assert report["operators"]["encode_to_hifloat8"]["cpu"]["backend"] == "native"
    assert "torch" in report["environment"]


@pytest.mark.parametrize("backend, warmed", [("auto", True), ("reference", False)])
def test_info_compiles_every_operators_cold_kernels_in_parallel_under_auto(monkeypatch, capsys, backend, warmed):
    """auto runs every operator's CPU self-check: on a first run their kernels compile in parallel first."""
    seen = []
    monkeypatch.setattr(warm, "warm_cache", lambda ops, on_start: seen.append(sorted(op.name for op in ops)))
    code, _, _ = run_cli(capsys, "info", "--backend", backend, "--json")
    assert code == 0 and seen == ([sorted(backends.operators())] if warmed else [])


def test_unknown_smoke_operator_is_a_usage_error(capsys):
    code, out, err = run_cli(capsys, "smoke", "nope", "--json")
    assert code == 2 and out == "" and "invalid choice: 'nope'" in json.loads(err)["error"]


def _case(output, reference, **kwargs):
    return _common.case_result(backend="native", input_dtype=torch.bfloat16, output=output, reference=reference,
                               expected_shape=(2,), expected_dtype=torch.bfloat16, expected_device="cpu", **kwargs)


def test_matches_reference_is_bit_equality_and_a_tolerance_case_is_judged_by_within_tolerance():
    reference = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    close = torch.tensor([1.0078125, 2.0], dtype=torch.bfloat16)  # one BF16 ulp above 1: rel. error 0.8 %
    far = torch.tensor([1.0625, 2.0], dtype=torch.bfloat16)  # 6 %
    exact = _case(close, reference)
    assert not exact["matches_reference"] and "within_tolerance" not in exact and not _common.contracts_hold([exact])
    loose = _case(close, reference, tolerance=(1e-2, 1e-2))
    assert not loose["matches_reference"] and loose["within_tolerance"] and _common.contracts_hold([loose])
    assert loose["tolerance"] == {"rtol": 1e-2, "atol": 1e-2} and loose["extra_contracts"] == ["within_tolerance"]
    assert not _common.contracts_hold([_case(far, reference, tolerance=(1e-2, 1e-2))])


def test_bench_all_runs_each_module_with_its_defaults_and_the_common_options(capsys, monkeypatch):
    import types

    from lowbit.cli import bench

    def run(args):
        return [{"what": "fake", "size": args.size, "repeats": args.repeats, "device": args.device}]

    fake = types.SimpleNamespace(NAME="fake", run=run,
                                 add_arguments=lambda p: p.add_argument("--size", type=int, default=5))
    monkeypatch.setattr(bench, "benches", lambda: {"fake": fake})
    code, out, err = run_cli(capsys, "bench", "all", "--repeats", "3", "--device", "cpu:0", "--json")
    assert code == 0, err
    assert json.loads(out) == [{"op": "fake", "what": "fake", "size": 5, "repeats": 3, "device": "cpu"}]


def test_case_timer_rows_and_ratios(monkeypatch):
    from lowbit.cli import bench

    seconds = iter([0.002, 0.001, 0.004])
    monkeypatch.setattr(bench, "median_seconds", lambda fn, **kwargs: next(seconds))  # nothing is timed
    case = bench.CaseTimer("cpu", 1, size="1M")
    for what in ("memcpy", "fast", "slow"):
        case.time(what, lambda: None, nbytes=4_000_000)
    rows = case.ratio_to_baseline("x memcpy")
    assert [(r["size"], r["what"], r["ms"], r["GB/s"], r["x memcpy"]) for r in rows] == [
        ("1M", "memcpy", 2.0, 2.0, 1.0), ("1M", "fast", 1.0, 4.0, 2.0), ("1M", "slow", 4.0, 1.0, 0.5)]
    assert [r["speedup"] for r in case.ratio_to_baseline("speedup", "ms", higher_is_better=False)] == [1.0, 2.0, 0.5]
