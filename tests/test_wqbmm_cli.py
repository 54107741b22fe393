"""The sample tool chain through the command: gen-data, run, verify, profile, example (lowbit.cli.wqbmm over
lowbit.toolchain)."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from lowbit.cli.main import main
from lowbit.formats import wqbmm as ref
from lowbit.formats.int4 import pack_int4
from lowbit.toolchain import wqbmm as sample
from lowbit.toolchain.verify import verify_arrays
from wqbmm_oracles import sample_golden_m1


def lowbit(*argv) -> int:
    return main([str(a) for a in argv])


@pytest.fixture(scope="module")
def sample_dir(tmp_path_factory):
    """The sample's default data (M=1, N=12288, K=8192, G=128, seed 1), generated once per session."""
    root = tmp_path_factory.mktemp("wqbmm_sample")
    assert lowbit("wqbmm", "gen-data", "--dir", root) == 0
    return root


def _fp16_file(path):
    return np.fromfile(path, dtype=np.float16)


def test_sample_golden_equals_sample_script(sample_dir):
    """Same RNG stream as gen_data.py, and the golden equals the sample's own numpy loop bit for bit."""
    np.random.seed(1)
    x = np.random.uniform(low=-3, high=3, size=(1, 8192)).astype(np.float16)
    scale = np.random.uniform(low=-3, high=3, size=(64, 12288)).astype(np.float16)
    w = np.random.uniform(low=-7, high=7, size=(8192, 12288)).astype(np.int8)
    assert np.array_equal(_fp16_file(sample_dir / "input/input_a.bin"), x.reshape(-1))
    assert np.array_equal(_fp16_file(sample_dir / "input/input_antiquant_scale_fp16.bin"), scale.reshape(-1))
    assert np.array_equal(np.fromfile(sample_dir / "input_input_weight_real.bin", dtype=np.int8), w.reshape(-1))
    u = w.astype(np.uint8)
    packed = (u << 4)[:, 1::2] + (u & 0x0F)[:, 0::2]
    assert np.array_equal(np.fromfile(sample_dir / "input/input_weight.bin", dtype=np.uint8), packed.reshape(-1))
    golden = sample_golden_m1(x, w, scale, 128).reshape(-1)
    assert np.array_equal(_fp16_file(sample_dir / "output/golden.bin").view(np.int16), golden.view(np.int16))


@pytest.mark.parametrize("template", ["basic", "preload"])
@pytest.mark.parametrize("backend", ["native", "reference"])
def test_every_cpu_backend_reproduces_the_golden(sample_dir, template, backend, capsys):
    assert lowbit("wqbmm", "run", "--dir", sample_dir, "--template", template, "--backend", backend) == 0
    output, golden = sample_dir / "output/output_z.bin", sample_dir / "output/golden.bin"
    assert output.read_bytes() == golden.read_bytes()
    assert lowbit("verify", output, golden, "--sample") == 0
    assert "test pass" in capsys.readouterr().out


def test_gen_data_multi_row_bf16(tmp_path):
    assert lowbit("wqbmm", "gen-data", "--dir", tmp_path, "--m", 5, "--n", 96, "--k", 256,
                  "--group-size", 64, "--seed", 3, "--dtype", "bfloat16") == 0
    meta = sample.read_meta(tmp_path)
    x, weight, scale = sample.read_inputs(tmp_path, meta)
    assert x.dtype == torch.bfloat16 and x.shape == (5, 256)
    golden = torch.from_numpy(np.fromfile(tmp_path / "output/golden.bin", dtype=np.int16))
    assert torch.equal(golden, ref.wqbmm_msd(x, weight, scale, None, 64).view(torch.int16).reshape(-1))
    real = torch.from_numpy(np.fromfile(tmp_path / "input_input_weight_real.bin", dtype=np.int8)).reshape(256, 96)
    assert torch.equal(pack_int4(real), weight)
    assert lowbit("wqbmm", "run", "--dir", tmp_path, "--template", "basic") == 0
    output, golden = tmp_path / "output/output_z.bin", tmp_path / "output/golden.bin"
    assert lowbit("verify", output, golden, "--dtype", "bfloat16") == 0
    assert not list(tmp_path.rglob(".*"))  # no temporary files or staging folders left behind
    assert lowbit("wqbmm", "run", "--dir", tmp_path, "--algorithm", "dequant") == 0
    dequant = torch.from_numpy(np.fromfile(output, dtype=np.int16))
    assert torch.equal(dequant, ref.wqbmm_dequant(x, weight, scale, None, 64).view(torch.int16).reshape(-1))


def _write(path, values):
    np.asarray(values, dtype=np.float16).tofile(path)
    return path


def test_verify_pass_fail_nan_negative_and_size(tmp_path, capsys):
    golden = _write(tmp_path / "golden.bin", [1.0, -2.0, 3.0, 0.5] * 500)
    assert lowbit("verify", _write(tmp_path / "same.bin", [1.0, -2.0, 3.0, 0.5] * 500), golden) == 0
    # negative golden: the sample divides by the signed golden and never counts these
    wrong_negative = _write(tmp_path / "neg.bin", [1.0, -3.0, 3.0, 0.5] * 500)
    assert lowbit("verify", wrong_negative, golden, "--sample") == 1
    out = capsys.readouterr().out
    assert "[ERROR] result error" in out and "errors: 500 of 2000" in out
    assert out.count("data index") == 101  # printout capped like the sample, count is not
    # a single error in 2000 is within error_tol = 1e-3; three are not
    one = [1.0, -2.0, 3.0, 0.5] * 500
    one[7] = 9.0
    assert lowbit("verify", _write(tmp_path / "one.bin", one), golden) == 0
    one[8] = one[9] = 9.0
    assert lowbit("verify", _write(tmp_path / "three.bin", one), golden) == 1
    nan = [1.0, -2.0, 3.0, 0.5] * 500
    nan[:3] = [float("nan")] * 3
    assert lowbit("verify", _write(tmp_path / "nan.bin", nan), golden) == 1
    assert lowbit("verify", golden, golden, "--error-tol", "0") == 0
    capsys.readouterr()
    assert lowbit("verify", _write(tmp_path / "short.bin", [1.0] * 1999), golden) == 2  # cannot compare
    assert "bytes" in capsys.readouterr().err


def test_verify_nan_matches_nan():
    result = verify_arrays(np.array([np.nan, 1.0]), np.array([np.nan, 1.0]))
    assert result.passed and result.mismatches == 0


def test_profile_and_example_small(tmp_path, capsys):
    assert lowbit("wqbmm", "example", "--dir", tmp_path, "--m", 2, "--n", 128, "--k", 256, "--group-size", 128,
                  "--sample") == 0
    out = capsys.readouterr().out
    assert out.count("test pass") == 2 and "basic" in out and "preload" in out
    assert list((tmp_path / "output/profile").glob("preload_*.json"))
    assert lowbit("wqbmm", "profile", "--dir", tmp_path, "--backends", "native,reference", "--repeats", 1) == 0
    assert (tmp_path / "output/profile/basic_reference.json").exists()


@pytest.mark.parametrize("template", ["basic", "preload"])
def test_triton_reproduces_the_golden(sample_dir, template):
    """The Triton kernels (under the interpreter without CUDA) at the sample's default shape."""
    triton_wqbmm = pytest.importorskip("lowbit.kernels.triton.wqbmm", reason="triton is not installed")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meta = sample.read_meta(sample_dir)
    x, weight, scale = (t.to(device) for t in sample.read_inputs(sample_dir, meta))
    out = torch.empty(1, meta.n, dtype=x.dtype, device=device)
    triton_wqbmm.MATMUL.run(x, weight, scale, None, 128, "msd", template, out=out)
    assert out.cpu().numpy().tobytes() == (sample_dir / "output/golden.bin").read_bytes()


def test_profile_prints_no_profiler_library_lines(tmp_path):
    """torch.profiler's Kineto logs each start and stop on stderr unless KINETO_LOG_LEVEL hides them: the
    command's stderr holds nothing (a fresh process: the level is read when the profiler first starts)."""
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    command = [sys.executable, "-m", "lowbit", "wqbmm"]
    subprocess.run(command + ["gen-data", "--dir", str(tmp_path), "--m", "2", "--n", "128", "--k", "256",
                              "--group-size", "128"], env=env, check=True, capture_output=True, timeout=600)
    result = subprocess.run(command + ["profile", "--dir", str(tmp_path), "--backends", "reference", "--repeats", "1"],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stderr == "", result.stderr
