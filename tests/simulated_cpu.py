"""Run the ``lowbit`` command as if on an older x86 CPU: ``python tests/simulated_cpu.py CPU ARGS...``.

llvmlite is made to report CPU's name and the host's features less those CPU lacks (SIMULATED) before
numba builds its target machine, so numba compiles every kernel for that CPU and lowbit's feature checks
(lowbit.kernels.cpu._simd) pick that CPU's kernels; then ``lowbit ARGS`` runs. The kernels run on this host,
which must have every feature the simulated CPU keeps (simulatable). LLVM aborts the whole process when a
kernel holds an instruction its target lacks: this finds such a kernel without that CPU at hand.

:func:`start_runs` runs the checks of tests/test_simulated_cpus.py in the background, one CPU after another, from
the moment the test session has collected them (tests/conftest.py): each compiles every kernel anew (about 1.5
minutes of CPU), and the rest of the suite does not keep every CPU busy.
"""

from __future__ import annotations

import concurrent.futures
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

_AVX512_BF16_AND_LATER = ["avx512bf16", "avx512fp16", "amx-bf16", "amx-tile", "amx-int8"]
_ICE_LAKE_ADDITIONS = ["avx512vbmi", "avx512vbmi2", "avx512bitalg", "avx512vpopcntdq", "avx512ifma", "gfni", "vaes",
                       "vpclmulqdq"]
_AVX512 = ["avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512vnni"]

# CPU name (LLVM's) -> (the features it lacks, among those lowbit's kernels test or LLVM may use for them;
# the features it must find on the host: the kernels it selects use them).
SIMULATED = {
    "icelake-server": (_AVX512_BF16_AND_LATER,  # Intel Xeon Ice Lake: AVX-512 with VNNI and VBMI, no BF16
                       ["avx512vbmi", "avx512bitalg", "avx512vnni", "avx512bw"]),
    "cascadelake": (_AVX512_BF16_AND_LATER + _ICE_LAKE_ADDITIONS, ["avx512vnni", "avx512bw"]),  # AVX-512 + VNNI
    "skylake-avx512": (_AVX512_BF16_AND_LATER + _ICE_LAKE_ADDITIONS + ["avx512vnni"], ["avx512bw"]),  # no VNNI
    "znver3": (_AVX512_BF16_AND_LATER + _ICE_LAKE_ADDITIONS + _AVX512, ["avx2", "fma", "f16c"]),  # AMD Zen 3
}


def simulatable(cpu: str) -> bool:
    """Whether this host can run CPU's kernels and has a feature CPU lacks (else it would simulate itself)."""
    from llvmlite import binding

    host = binding.get_host_cpu_features()
    lacks, needs = SIMULATED[cpu]
    return all(host.get(f) for f in needs) and any(host.get(f) for f in lacks)


def simulate(cpu: str) -> None:
    """Make llvmlite report ``cpu`` with the host's features less those it lacks (before numba compiles)."""
    from llvmlite import binding

    features = binding.get_host_cpu_features()
    for name in SIMULATED[cpu][0]:
        if name in features:
            features[name] = False
    binding.get_host_cpu_features = lambda: features
    binding.get_host_cpu_name = lambda: cpu


# What each simulated CPU runs: every operator against its reference with the native kernels, then every
# data-free scheme's converted layer of a tiny shape at 1, 3, 16 and 256 rows of x (the one-call GEMV, the rows
# of x together, the batched kernel and the GEMM tiles).
SMOKE = ("smoke", "all", "--backend", "native", "--json")
BENCH = ("bench", "model", "--shape", "64x256", "--ms", "1,3,16,256", "--repeats", "1", "--json")
RUN_TIMEOUT = 1200  # seconds per command

_runs: dict[str, concurrent.futures.Future] = {}
_running: list[subprocess.Popen] = []
_folders: list[str] = []
_stopped = threading.Event()
_lock = threading.Lock()


def _run_as(cpu: str, cache: str, args: tuple) -> subprocess.CompletedProcess:
    """``lowbit ARGS`` as ``cpu`` with numba's cache in ``cache``: a subprocess in a session of its own, so that
    a kill (a timeout, :func:`stop_runs`) ends its warm-up workers too."""
    env = {**os.environ, "NUMBA_CACHE_DIR": cache}
    command = [sys.executable, str(Path(__file__).resolve()), cpu, *args]
    with _lock:
        if _stopped.is_set():
            raise RuntimeError("the simulated-CPU runs were stopped")
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True)
        _running.append(process)
    try:
        out, err = process.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        _kill(process)
        out, err = process.communicate()
        err += f"\n(killed after {RUN_TIMEOUT} s)"
    finally:
        with _lock:
            _running.remove(process)
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def _kill(process: subprocess.Popen) -> None:
    """Kill ``process`` and the processes of its session (it leads one: start_new_session)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # already ended
        pass


def _smoke_then_bench(cpu: str) -> tuple:
    """(SMOKE's CompletedProcess, BENCH's or None where SMOKE failed) as ``cpu``, in one new numba cache."""
    with _lock:
        if _stopped.is_set():
            raise RuntimeError("the simulated-CPU runs were stopped")
        cache = tempfile.mkdtemp(prefix=f"lowbit-simulated-{cpu}-")
        _folders.append(cache)
    smoke = _run_as(cpu, cache, SMOKE)
    return smoke, (_run_as(cpu, cache, BENCH) if smoke.returncode == 0 else None)


def start_runs(cpus: list) -> None:
    """Start :func:`_smoke_then_bench` for each of ``cpus`` not yet started, one after another on a background
    thread (its subprocesses compile beside the caller); :func:`result` waits for one."""
    with _lock:
        todo = [cpu for cpu in dict.fromkeys(cpus) if cpu not in _runs]
        for cpu in todo:
            _runs[cpu] = concurrent.futures.Future()
    if not todo:
        return

    def work() -> None:
        for cpu in todo:
            future = _runs[cpu]
            try:
                future.set_result(_smoke_then_bench(cpu))
            except BaseException as exc:  # the waiting test reports it
                future.set_exception(exc)

    threading.Thread(target=work, name="simulated-cpu-runs", daemon=True).start()


def result(cpu: str) -> tuple:
    """:func:`_smoke_then_bench`'s result for ``cpu``, started now if it was not (waits for it)."""
    start_runs([cpu])
    return _runs[cpu].result()


def stop_runs() -> None:
    """Kill the runs' subprocesses, start no more, and remove their numba caches (at the session's end)."""
    with _lock:
        _stopped.set()
        for process in _running:
            _kill(process)
    for folder in _folders:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    simulate(sys.argv[1])
    sys.argv = ["lowbit", *sys.argv[2:]]
    runpy.run_module("lowbit", run_name="__main__")
