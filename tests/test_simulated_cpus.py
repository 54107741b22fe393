"""Every kernel compiles and runs for each older x86 CPU level lowbit supports, simulated on this host
(tests/simulated_cpu.py: numba compiles for that CPU, lowbit picks that CPU's kernels): `lowbit smoke all`
with the native kernels (every operator against its reference) and `lowbit bench model` on a tiny layer
(every data-free scheme's converted layer at 1, 3, 16 and 256 rows of x: the one-call GEMV, the rows of x
together, the batched kernel and the GEMM tiles; its times are not checked). A kernel holding an instruction
its CPU lacks made LLVM abort the whole process: every HiFloat8 and FP8 layer on an Intel Xeon Ice Lake,
whose kernels had only ever been compiled on CPUs with AVX512-BF16 (docs/weight_only.md, 'BF16 pairs').
A CPU is simulated where this host has the features it keeps and one it lacks (else skipped). The runs start in
the background as soon as the session has collected these tests (tests/conftest.py, simulated_cpu.start_runs)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import simulated_cpu
from lowbit.cli.bench import model as bench_model


@pytest.mark.parametrize("cpu", list(simulated_cpu.SIMULATED))
def test_every_kernel_compiles_and_runs_on_an_older_cpu(cpu):
    if not simulated_cpu.simulatable(cpu):
        pytest.skip(f"this CPU cannot simulate {cpu} (lacks a feature it keeps, or is no newer)")
    smoke, bench = simulated_cpu.result(cpu)
    assert smoke.returncode == 0, smoke.stderr[-3000:]
    report = json.loads(smoke.stdout)
    assert report["hardware_path_verified"] is True, smoke.stdout[-3000:]
    assert bench.returncode == 0, bench.stderr[-3000:]
    rows = json.loads(bench.stdout)
    assert {row["what"] for row in rows[1::2]} >= {"PackedLinear", "Int4Linear", "SVDQuantLinearDeploy"}
    assert len(rows) == 2 * 4 * len(bench_model.DATA_FREE)  # (baseline, layer) per row count and scheme


def test_a_simulated_cpu_is_what_numba_compiles_for_and_lowbit_sees(tmp_path):
    """The simulation itself: numba's target and lowbit's feature flags are the simulated CPU's."""
    cpu = next((c for c in ("cascadelake", "skylake-avx512", "znver3") if simulated_cpu.simulatable(c)), None)
    if cpu is None:
        pytest.skip("this CPU can simulate none of the older levels")
    probe = ("import simulated_cpu, sys; simulated_cpu.simulate(sys.argv[1]); "
             "from numba.core.registry import cpu_target; from lowbit.kernels.cpu import _simd; "
             "codegen = cpu_target.target_context.codegen(); "
             "print(codegen._get_host_cpu_name(), '+avx512vbmi' in codegen._get_host_cpu_features().split(','), "
             "_simd.HAS_AVX512VBMI, _simd.HAS_AVX512BF16)")
    path = [str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(path)}
    done = subprocess.run([sys.executable, "-c", probe, cpu], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [cpu, "False", "False", "False"]
