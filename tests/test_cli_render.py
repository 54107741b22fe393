"""Human views of the CLI reports (lowbit.cli.render): verdict last, short, names what failed, plain when
not a terminal."""

import copy
import io
import sys
import threading

import pytest

from lowbit.cli import render
from lowbit.cli.render.rows import bench_view, eval_view
from lowbit.cli.render.smoke import info_view, smoke_view
from lowbit.cli.render.summary import quantize_view, verify_view

OPS = ["hifloat4", "hifloat8", "mxfp4", "svd_quant", "wqbmm"]
ENV = {"amct_ops": None, "cann_home": None, "cpu_threads": 2, "device": "cpu", "device_name": "Test CPU 9000",
       "lowbit": "0.1.0", "numba": "0.60", "omp_wait_policy": None,
       "gomp_spincount": None, "python": "3.11.7", "torch": "2.13.0",
       "torch_npu": None, "triton": None}


def case(dtype="float16", backend="native", **changes):
    result = {"backend": backend, "input_dtype": dtype, "shape_preserved": True, "dtype_preserved": True,
              "device_preserved": True, "matches_reference": True, "max_abs_error": 0.5, "mean_abs_error": 0.1,
              "warning_count": 0, "extra_contracts": ["codes_match_reference"], "codes_match_reference": True}
    return {**result, **changes}


def all_verified():
    ops = [{"op": op, "hardware_path_verified": True, "results": [case("float16"), case("bfloat16")]} for op in OPS]
    return {"requested_backend": "auto", "hardware_path_verified": True, "environment": dict(ENV), "ops": ops}


def lines(view, width=80):
    text = render.to_text(view, width=width)
    assert text.endswith("\n")
    return text.splitlines()


def test_smoke_all_verified_is_short_with_the_verdict_last():
    out = lines(smoke_view(all_verified(), 0))
    assert len(out) < 25
    assert out[-1].startswith("VERIFIED: all 5 operators") and "cpu (Test CPU 9000)" in out[-1]
    for op in OPS:
        row = next(line for line in out if line.startswith(op + " "))
        assert row.split()[-2:] == ["10/10", "verified"]  # 2 cases x 5 contracts


def test_smoke_failure_names_the_operator_contract_and_case():
    report = all_verified()
    hif8 = report["ops"][1]
    hif8["results"][1]["matches_reference"] = False
    hif8["hardware_path_verified"] = report["hardware_path_verified"] = False
    out = lines(smoke_view(report, 1))
    assert out[-1].startswith("FAILED: hifloat8 broke a contract") and "exit 1" in out[-1]
    assert next(line for line in out if line.startswith("hifloat8 ")).split()[-2:] == ["9/10", "BROKEN"]
    assert any("matches_reference failed in 1 of 2 cases (first: bfloat16)" in line for line in out)


def test_smoke_every_operator_failing_with_long_messages_still_fits():
    report = all_verified()
    for op in report["ops"]:
        op.pop("results")
        op.update(hardware_path_verified=False, error="RuntimeError: " + "a very long message [with brackets] " * 20)
    for width in (80, 100, 200):
        out = lines(smoke_view(report, 2), width)
        assert len(out) < 25, "\n".join(out)
        assert out[-1].startswith("CANNOT RUN: hifloat4, hifloat8, mxfp4, svd_quant, wqbmm")
        assert any("[with brackets]" in line for line in out)  # messages are text, never rich markup


def test_smoke_single_operator():
    one = {"requested_backend": "native", "hardware_path_verified": True, "environment": dict(ENV),
           "op": "hifloat8", "results": [case()]}
    assert lines(smoke_view(one, 0))[-1].startswith("VERIFIED: hifloat8 met every contract")


def test_smoke_contracts_hold_but_not_verified_says_why():
    report = all_verified()
    report["ops"][2]["results"] = [case(backend="reference")]
    report["ops"][3]["results"][0]["warning_count"] = 3
    for i in (2, 3):
        report["ops"][i]["hardware_path_verified"] = False
    report["hardware_path_verified"] = False
    out = lines(smoke_view(report, 0))
    assert out[-1].startswith("CONTRACTS HOLD") and "mxfp4, svd_quant" in out[-1]
    assert any(line.startswith("mxfp4: contracts hold; ran on the reference backend") for line in out)
    assert any(line.startswith("svd_quant: contracts hold; 3 warning(s)") for line in out)


def test_smoke_tolerance_case_is_judged_by_within_tolerance():
    report = all_verified()
    report["ops"][3]["results"] = [case(matches_reference=False, within_tolerance=True,
                                        tolerance={"rtol": 0.01, "atol": 0.01}, extra_contracts=["within_tolerance"])]
    out = lines(smoke_view(report, 0))
    row = next(line for line in out if line.startswith("svd_quant "))
    assert row.split()[-2:] == ["4/4", "verified"]  # 3 common contracts + within_tolerance


def test_no_ansi_codes_unless_a_terminal(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    plain = io.StringIO()
    render.emit(smoke_view(all_verified(), 0), plain)
    assert "\x1b[" not in plain.getvalue() and plain.getvalue().splitlines()[-1].startswith("VERIFIED")
    assert all(line == line.rstrip() for line in plain.getvalue().splitlines())

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    styled = Terminal()
    render.emit(smoke_view(all_verified(), 0), styled)
    assert "\x1b[" in styled.getvalue()  # the same view on a terminal is coloured
    monkeypatch.setenv("NO_COLOR", "1")
    no_color = Terminal()
    render.emit(smoke_view(all_verified(), 0), no_color)
    assert "\x1b[3" not in no_color.getvalue()  # no colour codes (bold may remain)


def test_info_view_shows_what_auto_picks_and_why():
    report = {"environment": dict(ENV), "default_backend": "auto", "requested_backend": "auto", "devices": ["cpu"],
              "operators": {"encode_to_hifloat8": {"cpu": {"backend": "native"}},
                            "wqbmm_dequant": {"cpu": {"backend": "reference", "why": "no native kernel for 'cpu'"}}}}
    out = lines(info_view(report), width=120)
    assert next(line for line in out if line.startswith("encode_to_hifloat8")).split()[-1] == "native"
    assert "reference: no native kernel for 'cpu'" in next(line for line in out if line.startswith("wqbmm_dequant"))
    assert out[0].endswith("backend auto · process default auto")
    assert out[-1] == "backend auto: native kernels for 1 of 2 operators on cpu; reference: wqbmm_dequant"


def test_bench_view_one_table_per_operator_and_the_verdict_last():
    rows = [{"op": "hifloat8", "size": "1M", "dtype": "float16", "what": "memcpy (prealloc)", "ms": 0.25,
             "GB/s": 16.0, "x memcpy": 1.0},
            {"op": "hifloat8", "size": "1M", "dtype": "float16", "what": "encode out=", "ms": 0.5, "GB/s": 6.0,
             "x memcpy": 0.375},
            {"op": "wqbmm", "M": 1, "what": "F.linear bf16", "ms": 2.0, "speedup vs F.linear": 1.0},
            {"op": "wqbmm", "M": 1, "what": "wqbmm msd preload (native)", "ms": 1.0, "speedup vs F.linear": 2.0}]
    out = lines(bench_view(rows, "cpu"), width=100)
    assert out[0] == "hifloat8" and "wqbmm" in out
    assert next(line for line in out if "encode out=" in line).split()[-3:] == ["0.5", "6", "0.375"]
    assert out[-1].startswith("timed 2 operators (4 rows) on cpu; 'x memcpy', 'speedup vs F.linear': each row against")
    assert lines(bench_view([]))[-1].startswith("no benchmark rows")


@pytest.mark.parametrize("width", [80, 60])
def test_bench_model_rows_keep_every_number_on_a_narrow_terminal(width):
    """(`lowbit bench model` on an 80-column terminal cut M = 256 to '2…' and the times to '0…')"""
    rows = [{"op": "model", "scheme": scheme, "M": m, "NxK": "4096x4096", "what": what, "ms": ms,
             "x F.linear time": ratio, "weight bytes": nbytes, "x bf16 bytes": share}
            for scheme in ("hif8-wo", "mxfp4-w4a4")
            for m, what, ms, ratio, nbytes, share in ((1, "F.linear bf16", 0.07731, 1.0, 33554432, 1.0),
                                                      (256, "PackedLinear", 14.0312, 0.8392, 8912896, 0.2656))]
    text = render.to_text(bench_view(rows, "cpu"), width=width)
    for number in ("256", "0.07731", "14.03", "0.8392", "33554432", "8912896", "0.2656"):
        assert number in text, (number, text)


def test_eval_view_names_the_closest_and_the_smallest_scheme():
    rows = [{"scheme": "hif8-wo", "bits_per_weight": 8.0, "layers_quantized": 36, "layers_skipped": 1,
             "mean_cosine": 0.999991, "nn_agreement": 1.0, "sqnr_db": 40.123, "checkpoint_bytes": 3 << 20},
            {"scheme": "mxfp4-wo", "bits_per_weight": 4.25, "layers_quantized": 36, "layers_skipped": 1,
             "mean_cosine": 0.98, "nn_agreement": 0.9, "sqnr_db": 15.5, "checkpoint_bytes": 2 << 20},
            {"scheme": "broken", "bits_per_weight": 4.0, "layers_quantized": 36, "layers_skipped": 1,
             "mean_cosine": None, "nn_agreement": 0.0, "sqnr_db": None, "checkpoint_bytes": 2 << 20}]
    out = lines(eval_view(rows), width=100)
    assert "0.999991" in out[2] and "3.00 MiB" in out[2] and out[4].split()[-3] == "-"
    assert out[-1] == ("closest to float: hif8-wo (40.12 dB SQNR, 8 bits per weight); "
                       "fewest bits: mxfp4-wo (15.50 dB SQNR, 4.25 bits per weight)")
    lm = [{"scheme": "float32", "bits_per_weight": 32.0, "perplexity": 10.0},
          {"scheme": "hif8-wo", "bits_per_weight": 8.0, "perplexity": 10.5},
          {"scheme": "mxfp4-wo", "bits_per_weight": 4.25, "perplexity": 12.0}]
    assert lines(eval_view(lm))[-1] == ("float32 perplexity 10.0000; best quantized: hif8-wo "
                                        "(perplexity 10.5000 at 8 bits per weight)")


def test_verify_view_pass_and_fail():
    result = {"size": 4096, "mismatches": 12, "errors": 0, "error_ratio": 0.0, "passed": True,
              "first": [[i, 1.0, 1.0000001, 1e-7] for i in range(12)], "error_tol": 1e-3}
    out = lines(verify_view(result))
    assert out[0] == "first 10 of 12 mismatches"
    assert out[-1] == ("PASS: 0 errors and 12 mismatches in 4096 elements, error ratio 0.000000 "
                       "(tolerance 0.001)")
    failed = {**result, "errors": 8, "error_ratio": 8 / 4096, "passed": False}
    assert lines(verify_view(failed), 200)[-1].startswith("FAIL: 8 errors and 12 mismatches")


def test_quantize_view_lists_skipped_layers_and_ends_with_the_checkpoint():
    summary = {"model": "minilm", "model_kind": "encoder", "scheme": "hif8-wo", "config": None,
               "amct_compat": False, "layers_quantized": ["l0", "l1"], "layers_skipped": {"head": "not a Linear"},
               "weight_bytes_before": 4 << 20, "weight_bytes_after": 1 << 20, "model_bytes": 90 << 20,
               "checkpoint_bytes": 30 << 20, "seconds": {"load": 1.0, "quantize": 2.5}, "checkpoint": "out"}
    out = lines(quantize_view(summary), 120)
    assert "layers             2 quantized, 1 skipped" in out
    assert "quantized weights  4.00 MiB -> 1.00 MiB" in out
    assert "skipped head       not a Linear" in out
    assert out[-1] == "quantized 2 layers of minilm with hif8-wo: checkpoint out (30.00 MiB)"


def test_bench_plot_is_a_png_and_needs_matplotlib(monkeypatch):
    from lowbit.cli.render.plot import bench_plot, case_of

    rows = [{"op": "hifloat8", "size": "1M", "dtype": "float16", "what": "memcpy", "ms": 0.25, "GB/s": 16.0,
             "x memcpy": 1.0},
            {"op": "wqbmm", "M": 16, "what": "F.linear", "ms": 2.0, "speedup vs F.linear": 1.0}]
    assert [case_of(r) for r in rows] == ["1M float16", "M=16"]
    assert bench_plot(rows, "test").startswith(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(ValueError, match="no benchmark rows"):
        bench_plot([], "test")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'lowbit\[plot\]'"):
        bench_plot(rows, "test")


def test_views_do_not_change_the_report():
    report = all_verified()
    before = copy.deepcopy(report)
    render.to_text(smoke_view(report, 0))
    assert report == before


def test_progress_goes_to_stderr_and_only_on_a_terminal(monkeypatch, capsys):
    from lowbit.cli.render.progress import steps

    with steps(2, "smoke") as step:
        step("hifloat8")
        step("mxfp4")
    assert capsys.readouterr() == ("", "")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    threads = threading.active_count()
    with steps(2, "smoke") as step:
        assert threading.active_count() == threads and not terminal.getvalue()  # nothing before the first step
        step("compiling CPU kernels", counted=False)
        assert threading.active_count() == threads + 1  # rich's redrawing thread
        step("hifloat8")
        step("mxfp4")
    shown = terminal.getvalue()
    assert "smoke: mxfp4" in shown and "1/2" in shown and "2/2" not in shown and capsys.readouterr().out == ""
