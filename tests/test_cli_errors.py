"""Bad invocations of the lowbit command: each is exit 2 with exactly one line on stderr naming the problem
and no traceback (docs/cli.md). In-process through main(argv); a few end-to-end checks run the command."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from lowbit import backends
from lowbit.cli import main as cli

SMALL = ["--m", "2", "--n", "64", "--k", "64", "--group-size", "32"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A valid small dataset with an output (gen-data + run), copied per test by ``data_dir``."""
    root = tmp_path_factory.mktemp("dataset")
    assert cli.main(["wqbmm", "gen-data", "--dir", str(root), *SMALL]) == 0
    assert cli.main(["wqbmm", "run", "--dir", str(root), "--backend", "reference"]) == 0
    return root


@pytest.fixture
def data_dir(dataset, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(dataset, root)
    return root


def _empty(path):
    path.write_bytes(b"")


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-3])


def _write(text):
    return lambda path: path.write_text(text)


def _meta(**changes):
    def edit(path):
        meta = json.loads(path.read_text())
        meta.update(changes)
        path.write_text(json.dumps(meta))

    return edit


def _remove(path):
    path.unlink()


# (argv, file to break relative to the dataset (or None), how, words the error line must contain)
# "{d}" is the dataset folder, "{t}" a scratch folder.
BAD_DATASETS = [
    ("wqbmm run --dir {d}", "input/input_a.bin", _empty, ["input_a.bin", "empty"]),
    ("wqbmm run --dir {d}", "input/input_weight.bin", _truncate, ["input_weight.bin", "bytes"]),
    ("wqbmm run --dir {d}", "input/input_antiquant_scale_fp16.bin", _remove, ["scale_fp16.bin"]),
    ("wqbmm run --dir {d}", "input/meta.json", _meta(m=3), ["input_a.bin", "bytes"]),  # wrong size
    ("wqbmm run --dir {d}", "input/meta.json", _meta(dtype="bfloat16"), ["scale_bf16.bin"]),  # wrong dtype
    ("wqbmm run --dir {d}", "input/meta.json", _remove, ["input_a.bin", "bytes"]),  # missing: sample sizes
    ("wqbmm run --dir {d}", "input/meta.json", _write("{not json"), ["meta.json"]),
    ("wqbmm run --dir {d}", "input/meta.json", _write("[1, 2]"), ["meta.json", "object"]),
    ("wqbmm run --dir {d}", "input/meta.json", _write("[" * 100000 + "]" * 100000), ["meta.json", "recursion"]),
    ("wqbmm run --dir {d}", "input/meta.json", _meta(group_size=16), ["meta.json", "group size"]),
    ("wqbmm run --dir {d}", "input/meta.json", _meta(n="64"), ["meta.json", "integer"]),
    ("wqbmm run --dir {d}", "input/meta.json", _meta(bogus=1), ["meta.json", "bogus"]),
    ("wqbmm profile --dir {d} --repeats 1", "input/input_a.bin", _truncate, ["input_a.bin"]),
    ("verify {d}/output/output_z.bin {d}/output/golden.bin", "output/output_z.bin", _empty, ["output_z.bin", "empty"]),
    ("verify {d}/output/output_z.bin {d}/output/golden.bin", "output/golden.bin", _remove, ["golden.bin"]),
    ("verify {d}/output/output_z.bin {d}/output/golden.bin", "output/output_z.bin", _truncate, ["output_z.bin"]),
    ("verify {d}/input_input_weight_real.bin {d}/output/golden.bin", None, None, ["bytes"]),  # sizes differ
]

BAD_ARGUMENTS = [
    ("nope", ["invalid choice", "nope"]),
    ("wqbmm", ["required"]),
    ("info --backend bogus", ["--backend", "bogus"]),
    ("info --bogus", ["lowbit info: error: unrecognized arguments: --bogus"]),
    ("wqbmm gen-data --dir {t} --m 0", ["--m", "'0'"]),
    ("wqbmm gen-data --dir {t} --n -2", ["--n", "'-2'"]),
    ("wqbmm gen-data --dir {t} --k x", ["--k", "'x'"]),
    ("wqbmm gen-data --dir {t} --group-size 0", ["--group-size", "'0'"]),
    ("wqbmm gen-data --dir {t} --seed -1", ["--seed", "'-1'"]),
    ("wqbmm gen-data --dir {t} --seed 4294967296", ["--seed"]),
    ("wqbmm gen-data --dir {t} --dtype float32", ["--dtype", "float32"]),
    ("wqbmm gen-data --dir {t} --m 1 --n 64 --k 64 --group-size 16", ["group size", "16"]),
    ("wqbmm gen-data --dir {t} --m 1 --n 64 --k 96 --group-size 64", ["group size", "K=96"]),
    ("wqbmm gen-data --dir {t} --m 1 --n 63 --k 64 --group-size 32", ["N must be even", "63"]),
    ("wqbmm gen-data --dir {f} --m 1 --n 64 --k 64 --group-size 32", ["afile"]),  # --dir is a file
    ("wqbmm example --dir {t} --m 1 --n 64 --k 64 --group-size 48", ["group size", "48"]),
    ("wqbmm run --dir {t}/missing", ["missing", "input_a.bin"]),
    ("wqbmm run --dir {t} --template bogus", ["--template", "bogus"]),
    ("wqbmm profile --dir {t} --repeats 0", ["--repeats", "'0'"]),
    ("wqbmm profile --dir {t} --repeats 1000001", ["--repeats", "from 1 to 1000000"]),
    ("wqbmm profile --dir {t} --backends native,,reference", ["--backends"]),
    ("wqbmm profile --dir {t} --backends bogus", ["--backends", "bogus"]),
    ("verify {t}/a.bin {t}/b.bin", ["a.bin"]),
    ("verify {t}/a.bin", ["required", "golden"]),
    ("verify {f} {f} --rtol -1", ["--rtol", "'-1'"]),
    ("verify {f} {f} --error-tol nan", ["--error-tol", "nan"]),
    ("bench mxfp4 --repeats 0", ["--repeats", "'0'"]),
    ("bench mxfp4 --repeats x", ["--repeats", "'x'"]),
    ("bench hifloat8 --repeats 99999999999999999999999", ["--repeats", "from 1 to 1000000"]),
    ("bench hifloat8 --plot {t}", ["--plot", "is a directory, expected a file name"]),
    ("bench mxfp4 --device meta --sizes 64 --repeats 1", ["meta"]),
    ("bench all --device meta", ["meta"]),
    ("bench hifloat8 --device bogus --sizes 64", ["bogus"]),
    ("bench mxfp4 --sizes abc", ["--sizes", "abc"]),
    ("bench mxfp4 --sizes 33", ["--sizes", "multiple of 32"]),
    ("bench hifloat8 --sizes 0", ["--sizes", "'0'"]),
    ("bench hifloat8 --sizes 99999999999999999999", ["--sizes", "at most 2**40 elements"]),
    ("bench hifloat8 --dtypes float64", ["--dtypes", "float64"]),
    ("bench hifloat4 --qdims=5", ["--qdims", "'5'"]),
    ("bench hifloat4 --reference-size 4096", ["--reference-size", "multiple of"]),
    ("bench mxfp4 --scale-rule bogus", ["--scale-rule", "bogus"]),
    ("bench svd_quant --shapes 1x2x3", ["--shapes", "1x2x3"]),
    ("bench svd_quant --shapes 1x0x64x64x32", ["--shapes", "'0'"]),
    ("bench wqbmm --ms 0", ["--ms", "'0'"]),
    ("bench wqbmm --ms 1 --n 65 --k 64 --group-size 32 --repeats 1", ["N must be even", "65"]),  # the operator's rule
    ("bench wqbmm --ms 1 --n 64 --k 64 --group-size 48 --repeats 1", ["group_size", "48"]),
]

SMOKE_ERRORS = [
    ("smoke nope", ["nope"]),
    ("smoke hifloat8 --backend bogus", ["--backend", "bogus"]),
    ("smoke hifloat8 --device meta", ["meta"]),
    ("smoke all --device bogus", ["bogus"]),
    ("smoke hifloat8 --device cpu --bogus", ["--bogus"]),
]


def _argv(template, tmp_path):
    afile = tmp_path / "afile"
    afile.write_bytes(np.zeros(4, np.float16).tobytes())
    return template.format(d=tmp_path / "data", t=tmp_path, f=afile).split()


def _one_error_line(capsys, argv):
    code = cli.main(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    assert captured.err.endswith("\n") and captured.err.count("\n") == 1, captured.err
    return code, captured.out, captured.err.strip()


@pytest.mark.parametrize("template,relative,breaker,words", BAD_DATASETS)
def test_bad_dataset_files_are_one_line_exit_2(capsys, tmp_path, data_dir, template, relative, breaker, words):
    if relative is not None:
        breaker(data_dir / relative)
    code, out, err = _one_error_line(capsys, _argv(template, tmp_path))
    assert code == 2 and out == ""
    command = " ".join(w for w in template.split()[:2] if not w.startswith(("-", "{")))
    assert err.startswith(f"lowbit {command}: error: ")
    assert all(w in err for w in words), err


@pytest.mark.parametrize("template,words", BAD_ARGUMENTS)
def test_bad_arguments_are_one_line_exit_2(capsys, tmp_path, template, words):
    code, out, err = _one_error_line(capsys, _argv(template, tmp_path))
    assert code == 2 and out == ""
    assert err.startswith("lowbit") and ": error: " in err
    assert all(w in err for w in words), err


def test_bad_sizes_write_nothing(capsys, tmp_path):
    target = tmp_path / "new"
    assert cli.main(["wqbmm", "gen-data", "--dir", str(target), "--m", "1", "--n", "64", "--k", "64",
                     "--group-size", "16"]) == 2
    assert not target.exists()


@pytest.mark.parametrize("template,words", SMOKE_ERRORS)
def test_smoke_errors_are_one_json_line_exit_2(capsys, tmp_path, template, words):
    code, out, err = _one_error_line(capsys, _argv(template + " --json", tmp_path))
    error = json.loads(err)
    assert code == 2 and out == ""
    assert set(error) == {"error", "hardware_path_verified", "requested_backend"}
    assert error["hardware_path_verified"] is False
    assert all(w in error["error"] for w in words), err
    code, out, err = _one_error_line(capsys, _argv(template, tmp_path))  # the human rendering
    assert code == 2 and out == "" and err.startswith("lowbit smoke: error: ")
    assert all(w in err for w in words), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_bench_refuses_an_absent_device(capsys):
    code, out, err = _one_error_line(capsys, ["bench", "mxfp4", "--device", "cuda:0", "--sizes", "64"])
    assert code == 2 and out == "" and "CUDA is not available" in err


def _bad_default_backend():
    raise ValueError("unknown backend 'bogus' (LOWBIT_BACKEND); expected one of native, reference, auto")


def test_bad_default_backend_smoke_exit_2_json(capsys, monkeypatch):
    """A bad LOWBIT_BACKEND surfacing when the default backend is read (lowbit.backends.get_backend)."""
    monkeypatch.setattr(backends, "get_backend", _bad_default_backend)
    code, out, err = _one_error_line(capsys, ["smoke", "hifloat8", "--device", "cpu", "--json"])
    assert code == 2 and out == "" and "bogus" in json.loads(err)["error"]
    code, out, err = _one_error_line(capsys, ["info"])
    assert code == 2 and out == "" and err.startswith("lowbit info: error: ") and "bogus" in err


def test_bad_lowbit_backend_variable_smoke_exit_2_json(capsys, monkeypatch):
    monkeypatch.setenv("LOWBIT_BACKEND", "bogus")
    code, out, err = _one_error_line(capsys, ["smoke", "hifloat8", "--device", "cpu", "--json"])
    assert code == 2 and out == "" and "LOWBIT_BACKEND='bogus'" in json.loads(err)["error"]
    code, out, err = _one_error_line(capsys, ["info"])
    assert code == 2 and out == "" and err.startswith("lowbit info: error: LOWBIT_BACKEND='bogus'")


def test_debug_shows_the_traceback_before_or_after_the_command_and_keeps_exit_2(tmp_path, capsys):
    """(--debug re-raised: the process then exited 1, which for verify and smoke means "failed".)"""
    for argv in (["--debug", "wqbmm", "run"], ["wqbmm", "run", "--debug"]):
        assert cli.main([*argv, "--dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and "DatasetError" in err
        assert err.strip().splitlines()[-1].startswith("lowbit wqbmm run: error: ") and "input_a.bin" in err


@pytest.mark.parametrize("argv", [["--debug", "smoke", "all", "--device", "npu"],
                                  ["smoke", "hifloat8", "--device", "npu", "--json", "--debug"]])
def test_debug_shows_the_traceback_of_a_smoke_that_cannot_run(argv, capsys):
    """smoke reports errors rather than raising (its exit codes and report are the contract); --debug adds
    the traceback on stderr, before the one error line."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "BackendUnavailable" in err
    assert "device npu" in err.strip().splitlines()[-1]


def test_a_closed_stdout_ends_quietly_with_141():
    """(`lowbit smoke ... | head -1`) exited 1, which for smoke means a broken contract."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to stdout fails with EPIPE
    try:
        result = subprocess.run([sys.executable, "-m", "lowbit", "info", "--json"], stdout=write_end,
                                stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write_end)
    assert result.returncode == 141 and result.stderr == ""


def test_a_closed_stdout_descriptor_is_one_line_exit_2():
    result = subprocess.run(f"{sys.executable} -m lowbit smoke hifloat8 >&-", shell=True, stderr=subprocess.PIPE,
                            text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr == "lowbit smoke: error: standard output is closed: nowhere to write the result\n"


def test_help_exits_0(capsys):
    assert cli.main(["wqbmm", "gen-data", "--help"]) == 0
    assert "--group-size" in capsys.readouterr().out


def test_unexpected_exception_is_one_line_internal_error(capsys, monkeypatch, tmp_path):
    from lowbit.toolchain import wqbmm as sample

    def buggy(root):
        raise KeyError("oops")

    monkeypatch.setattr(sample, "read_meta", buggy)
    code, out, err = _one_error_line(capsys, ["wqbmm", "run", "--dir", str(tmp_path)])
    assert code == 2 and "internal error: KeyError" in err and "--debug" in err
    monkeypatch.setattr(sample, "read_meta", lambda root: (_ for _ in ()).throw(KeyboardInterrupt()))
    code, out, err = _one_error_line(capsys, ["wqbmm", "run", "--dir", str(tmp_path)])
    assert code == 130 and err == "lowbit wqbmm run: error: interrupted"


# ---- end to end: the installed command line, in a fresh process ----------------------------------------


def _lowbit(*argv, env=None):
    env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "lowbit", *argv], capture_output=True, text=True, env=env, timeout=300)


def test_end_to_end_bad_sizes_and_meta_device(tmp_path):
    done = _lowbit("wqbmm", "gen-data", "--dir", str(tmp_path), "--m", "0")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "lowbit wqbmm gen-data: error: argument --m: expected a positive integer, got '0'\n"
    done = _lowbit("bench", "mxfp4", "--device", "meta", "--sizes", "64")
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1 and "meta" in done.stderr


def test_end_to_end_bogus_lowbit_backend():
    env = {"LOWBIT_BACKEND": "bogus"}
    imported = subprocess.run([sys.executable, "-c", "import lowbit"], env={**os.environ, **env}, capture_output=True)
    if imported.returncode:
        pytest.skip("lowbit.backends still rejects a bad LOWBIT_BACKEND at import, before the command runs")
    done = _lowbit("smoke", "hifloat8", "--device", "cpu", "--json", env=env)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1
    assert "bogus" in json.loads(done.stderr)["error"]


def test_a_ctrl_c_while_the_command_loads_is_one_line_exit_130():
    """A Ctrl-C in the second the lowbit command spends importing printed a traceback of the imports."""
    start = "import os, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "  # (as a terminal)
    as_command = start + "sys.argv[0] = os.path.join('bin', 'lowbit'); "
    script = as_command + "import lowbit; os.kill(os.getpid(), signal.SIGINT); print('not reached')"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert (result.returncode, result.stdout, result.stderr) == (130, "", "lowbit: error: interrupted\n")
    script = as_command + ("from lowbit.cli.main import main; code = main(['--help']); "
                           "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, code)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("True 0")
    for prefix in (start, as_command + "signal.signal(signal.SIGINT, signal.SIG_IGN); "):
        script = prefix + ("before = signal.getsignal(signal.SIGINT); import lowbit; "
                           "print(signal.getsignal(signal.SIGINT) is before)")
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert result.stdout == "True\n"  # a program importing lowbit, and an ignored SIGINT (nohup), keep theirs
