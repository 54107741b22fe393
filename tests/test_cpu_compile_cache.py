"""First use of the CPU kernels: the compile notice on stderr (only while numba compiles, once per kernel
family), cold-cache detection, and the kernel families that `lowbit smoke all` warms in parallel."""

import gc
import os
import subprocess
import sys

import pytest
import torch

import lowbit  # noqa: F401  (registers every operator)
from lowbit.backends import Operator, operators
from lowbit.collector import fewer_collections
from lowbit.kernels.cpu import warm
from lowbit.kernels.cpu._runtime import family_module

HIFLOAT8 = "lowbit.kernels.cpu.hifloat8"
HIFLOAT4 = "lowbit.kernels.cpu.hifloat4"
ENCODE_TWICE = (
    "import torch, lowbit; from lowbit.kernels.cpu import warm; cold = warm.is_cold('lowbit.kernels.cpu.hifloat8'); "
    "[lowbit.encode_to_hifloat8(torch.ones(4, dtype=torch.bfloat16), backend='native') for _ in range(2)]; "
    "print(cold, warm.is_cold('lowbit.kernels.cpu.hifloat8'))"
)


def _encode_in_fresh_process(cache_dir) -> subprocess.CompletedProcess:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)}
    return subprocess.run([sys.executable, "-c", ENCODE_TWICE], env=env, capture_output=True, text=True, timeout=600)


def test_compile_notice_is_printed_once_while_compiling_and_not_when_the_cache_is_warm(tmp_path):
    first = _encode_in_fresh_process(tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == ["True", "False"]  # cold before, cached after
    notices = [line for line in first.stderr.splitlines() if line.startswith("lowbit:")]
    assert len(notices) == 1, first.stderr
    assert notices[0].startswith(f"lowbit: compiling CPU kernels for hifloat8 (first run only; cached in {tmp_path}")
    second = _encode_in_fresh_process(tmp_path)
    assert second.returncode == 0, second.stderr
    assert second.stdout.split() == ["False", "False"] and "lowbit:" not in second.stderr


def test_operators_are_grouped_by_their_cpu_kernel_module():
    families = warm.families(operators().values())
    assert families[HIFLOAT8] == ["encode_to_hifloat8", "decode_from_hifloat8"]
    expected = ("hifloat4", "hifloat8", "mxfp4", "svd_quant", "weight_only", "wqbmm")
    assert sorted(families) == [f"lowbit.kernels.cpu.{f}" for f in expected]
    assert sum(map(len, families.values())) == sum("cpu" in op.native for op in operators().values())


def test_a_private_helper_module_belongs_to_the_family_its_name_starts_with():
    """`_<family>_<part>` is family <family>'s where lowbit/kernels/cpu/<family>.py exists (the longest such
    name); any other module is its own family."""
    cpu = "lowbit.kernels.cpu"
    assert family_module(f"{cpu}._weight_only_gemv8") == f"{cpu}.weight_only"
    assert family_module(f"{cpu}._hifloat4_blocks") == f"{cpu}.hifloat4"
    assert family_module(f"{cpu}.wqbmm_dequant") == f"{cpu}.wqbmm_dequant"
    assert family_module(f"{cpu}._block_sums") == f"{cpu}._block_sums"  # no family `block`
    assert family_module("lowbit.ops._weight_only_x") == "lowbit.ops._weight_only_x"  # another package


def test_a_family_is_sized_with_its_helper_modules():
    """The warm-up starts larger families first: weight_only's size counts its private modules."""
    folder = os.path.dirname(warm.__file__)
    helpers = [f for f in os.listdir(folder) if f.startswith("_weight_only_") and f.endswith(".py")]
    assert len(helpers) >= 2
    expected = sum(os.path.getsize(os.path.join(folder, f)) for f in helpers + ["weight_only.py"])
    assert warm._family_bytes("lowbit.kernels.cpu.weight_only") == expected


def test_a_helper_modules_kernels_compile_under_their_familys_notice(tmp_path):
    """A cold weight-only call compiles kernels of weight_only's private modules: one notice, naming
    weight_only."""
    code = ("import torch, lowbit; from lowbit.formats import mxfp4; "
            "codes, scales = mxfp4.quantize(torch.ones(4, 64)); "
            "lowbit.mxfp4_linear(torch.ones(1, 64, dtype=torch.bfloat16), codes, scales, backend='native')")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    notices = [line for line in done.stderr.splitlines() if line.startswith("lowbit:")]
    assert [line.split()[5] for line in notices] == ["weight_only"], done.stderr


def test_a_quiet_notice_prints_nothing_and_a_worker_is_quiet(capsys):
    """A warm-up worker prints no notice at all, not even for a module no family announced (amx: compiled by
    weight_only's and svd_quant's tasks, whose processes each printed its line)."""
    notice = type(warm.COMPILE_NOTICE)()
    dispatcher = next(d for d in warm._dispatchers(warm.importlib.import_module(HIFLOAT8)))
    notice.quiet = True
    notice.announce("lowbit.kernels.cpu.amx", dispatcher)
    assert capsys.readouterr().err == ""
    notice.quiet = False
    notice.announce("lowbit.kernels.cpu.amx", dispatcher)
    assert capsys.readouterr().err.startswith("lowbit: compiling CPU kernels for amx ")


def test_a_module_without_numba_kernels_of_its_own_is_never_cold():
    assert not warm.is_cold("lowbit.kernels.cpu._runtime")  # plumbing only, no numba kernel


def test_one_worker_or_spawned_workers_on_busy_cpus_start_no_process(monkeypatch):
    monkeypatch.setattr(warm, "is_cold", lambda module: True)
    monkeypatch.setattr(warm.concurrent.futures, "ProcessPoolExecutor", None)  # would fail if used
    monkeypatch.setattr(warm, "_start_method", lambda: "spawn")
    assert warm.warm_cache(operators().values(), workers=1) == []
    busy = iter([(100, 1000), (100, 2000)])  # no idle jiffies in the window
    monkeypatch.setattr(warm, "_cpu_times", lambda: next(busy))
    assert warm.idle_cpus(window=0) == 0
    monkeypatch.setattr(warm, "_cpu_times", lambda: None)  # no /proc/stat: the load average
    monkeypatch.setattr(warm.os, "getloadavg", lambda: (1000.0, 0.0, 0.0))
    assert warm.idle_cpus() == 0
    assert warm.warm_cache(operators().values()) == []


def test_forked_workers_take_every_usable_cpu_busy_or_not_spawned_ones_the_idle_cpus(monkeypatch):
    monkeypatch.setattr(warm.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    monkeypatch.setattr(warm, "_cpu_times", lambda: None)  # no /proc/stat: the load average
    monkeypatch.setattr(warm.os, "getloadavg", lambda: (2.0, 0.0, 0.0))  # two of the three CPUs busy
    monkeypatch.setattr(warm, "_start_method", lambda: "fork")
    assert warm.default_workers() == 3
    monkeypatch.setattr(warm, "_start_method", lambda: "spawn")
    assert warm.default_workers() == 1


def test_idle_cpus_counts_idle_time_not_the_load_average(monkeypatch):
    monkeypatch.setattr(warm.os, "getloadavg", lambda: (1000.0, 0.0, 0.0))
    quiet = iter([(0, 0), (1000, 1000)])  # all idle in the window
    monkeypatch.setattr(warm, "_cpu_times", lambda: next(quiet))
    monkeypatch.setattr(warm.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert warm.idle_cpus(window=0) == 2


def test_a_family_using_another_family_is_warmed_after_the_operators_whose_kernels_it_holds():
    """svd_quant's kernels call the MXFP4 quantizer (the whole module) and the MXFP4 weight-only kernel
    object: its task waits for the MXFP4 family, for mxfp4_linear and for the weight-only family's first
    operator (the family's shared helpers), not for the other weight-only operators."""
    ops = list(operators().values())
    cold, kernels = warm.families(ops), warm.cpu_kernels(ops)
    assert kernels["mxfp4_linear"] is sys.modules["lowbit.kernels.cpu.weight_only"].MXFP4_LINEAR
    used = {module: warm._used_operators(module, cold, kernels) for module in cold}
    svd = "lowbit.kernels.cpu.svd_quant"
    assert used.pop(svd) == {"mxfp4_quantize", "mxfp4_dequantize", "mxfp4_linear", "hifloat8_linear"}
    assert not any(used.values()), used
    assert not warm._used_operators(svd, {svd: cold[svd], HIFLOAT4: cold[HIFLOAT4]}, kernels)


def test_a_module_holding_only_another_familys_helpers_waits_for_that_whole_family(monkeypatch):
    """Without a kernel object to name the operators, every operator of the family counts."""
    import types

    cold = {"user": ["u"], HIFLOAT8: ["encode_to_hifloat8", "decode_from_hifloat8"]}
    helper = types.SimpleNamespace(py_func=types.SimpleNamespace(__module__=HIFLOAT8))
    monkeypatch.setitem(sys.modules, "user", types.SimpleNamespace(helper=helper))
    kernels = warm.cpu_kernels(operators()[name] for name in cold[HIFLOAT8])
    assert warm._used_operators("user", cold, kernels) == set(cold[HIFLOAT8])
    pair = next(v for v in vars(sys.modules[HIFLOAT8]).values() if isinstance(v, warm.SerialOrParallel))
    monkeypatch.setitem(sys.modules, "user", types.SimpleNamespace(pair=pair))  # a serial / parallel kernel pair
    assert warm._used_operators("user", cold, kernels) == set(cold[HIFLOAT8])
    monkeypatch.setitem(sys.modules, "user", types.SimpleNamespace(helper=helper, k=kernels["decode_from_hifloat8"]))
    assert warm._used_operators("user", cold, kernels) == {"decode_from_hifloat8", "encode_to_hifloat8"}
    monkeypatch.setitem(sys.modules, "user", types.SimpleNamespace(k=kernels["decode_from_hifloat8"]))
    assert warm._used_operators("user", cold, kernels) == {"decode_from_hifloat8", "encode_to_hifloat8"}
    cold[HIFLOAT8].reverse()  # now decode is the family's first: the kernel object's operator alone
    assert warm._used_operators("user", cold, kernels) == {"decode_from_hifloat8"}


# Run in a process of its own with an empty numba cache, so that every kernel compiles (kernels loaded from the
# cache bring none of their callees' signatures) whatever ran before: the warm-up of every operator, each compile
# in any of its processes (forked workers inherit the listener) reported on stderr.
REPORT_COMPILES = """
import sys, numba, lowbit
from numba.core import event
from lowbit.backends import operators
from lowbit.kernels.cpu import warm

class Report(event.Listener):
    def on_start(self, e):
        func, args = e.data['dispatcher'].py_func, e.data['args']
        literal = any(isinstance(t, numba.core.types.Literal) for t in args)
        print(f"{'LITERAL' if literal else 'COMPILE'} {func.__module__}.{func.__qualname__}{args}", file=sys.stderr,
              flush=True)

    def on_end(self, e):
        pass

event.register('numba:compile', Report())
if warm._start_method() == 'fork':
    warm.warm_cache(operators().values())
for op in operators().values():
    assert op.auto_check_error('cpu') is None, op.name
"""


def test_no_kernel_is_compiled_for_a_literal_argument(tmp_path):
    """A literal argument in numba code (``f(x, 0)``) compiles a specialization of ``f`` of its own, next to
    the one for int64 (seconds each for a kernel's rows): every operator's CPU self-check, compiled from an
    empty cache, compiles no lowbit function for a literal argument type."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", REPORT_COMPILES], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    compiled = [line for line in lines if line.startswith(("COMPILE lowbit.", "LITERAL lowbit."))]
    assert len(compiled) > 100, lines[-20:]  # the kernels did compile here (not loaded from a cache)
    assert not [line for line in compiled if line.startswith("LITERAL")], compiled


class _PoolStub:
    """A stand-in for ProcessPoolExecutor and ThreadPoolExecutor (subclasses define submit)."""

    def __init__(self, workers, mp_context=None, initializer=None, initargs=()):
        self.workers = workers

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def shutdown(self, wait=True, cancel_futures=False):
        pass


def test_operators_are_warmed_after_those_whose_kernels_they_share(monkeypatch, capsys):
    """One task per operator: each starts only after every operator of a family whose kernels it calls
    (svd_quant after the MXFP4 quantizer and the weight-only GEMV) and after the first operator of its own
    family (the family's shared helpers), unless no other task could start, whatever order the tasks end
    in."""
    cold = warm.families(operators().values())
    needs = warm._prerequisites(cold, warm.cpu_kernels(operators().values()))
    assert needs["mxfp4_quantize"] == set() and needs["mxfp4_dequantize"] == {"mxfp4_quantize"}
    assert needs["svd_quant"] == set(cold["lowbit.kernels.cpu.mxfp4"]) | {"hifloat8_linear", "mxfp4_linear"}
    assert needs["mxfp8_linear"] == {"hifloat8_linear"}

    started, ended, names, here = [], set(), {}, []
    first = {name: names_[0] for names_ in cold.values() for name in names_}

    class FakePool(_PoolStub):  # records submissions; tasks end only when the scheduler waits (fake_wait)
        def submit(self, fn, name):
            assert needs[name] - {first[name]} <= ended, (name, needs[name] - ended)
            if first[name] not in ended | {name}:  # its family's first still compiling: only rather than idle
                assert not [n for n in needs if n not in started and needs[n] <= ended], name
            started.append(name)
            future = warm.concurrent.futures.Future()
            names[future] = name
            return future

    seen_initargs, seen_thresholds = [], []

    class FakeProcesses(FakePool):  # the worker processes: workers - 1 tasks at a time
        def __init__(self, workers, mp_context=None, initializer=None, initargs=()):
            super().__init__(workers)
            seen_initargs.append(initargs)
            seen_thresholds.append(gc.get_threshold())  # what a forked worker would start with

        def submit(self, fn, name):
            assert self.workers == 1 and all(n in ended or n in here for n in started), started
            return super().submit(fn, name)

    class FakeThread(FakePool):  # this process's own slot: one task at a time
        def submit(self, fn, name):
            assert self.workers == 1 and all(n in ended for n in here), here
            here.append(name)
            return super().submit(fn, name)

    def fake_wait(futures, return_when):  # the task submitted last ends first; one of them fails
        future = max(futures, key=lambda f: started.index(names[f]))
        if names[future] == "weight_quant_batch_matmul":
            future.set_exception(RuntimeError("a failed worker"))
        else:
            future.set_result(None)
        ended.add(names[future])
        return {future}, set(futures) - {future}

    adopted = []
    monkeypatch.setattr(warm, "_start_method", lambda: "spawn")  # the pool's start: test_forked_workers_...
    monkeypatch.setattr(warm, "is_cold", lambda module: True)
    monkeypatch.setattr(warm.concurrent.futures, "ProcessPoolExecutor", FakeProcesses)
    monkeypatch.setattr(warm.concurrent.futures, "ThreadPoolExecutor", FakeThread)
    monkeypatch.setattr(warm.concurrent.futures, "wait", fake_wait)
    monkeypatch.setattr(Operator, "adopt_passed_check", lambda self, device: adopted.append((self.name, device)))
    on_start = []  # the tasks started when on_start was called: none
    monkeypatch.setattr(warm.COMPILE_NOTICE, "announced", set())
    capsys.readouterr()
    thresholds = gc.get_threshold()
    with fewer_collections():
        raised = gc.get_threshold()
    assert raised != thresholds
    modules = warm.warm_cache(operators().values(), workers=2, on_start=lambda: on_start.append(list(started)))
    assert on_start == [[]]
    notices = capsys.readouterr().err.splitlines()  # every cold family's, up front; the workers print none
    assert [line.split()[5] for line in notices] == [m.rpartition(".")[2] for m in modules], notices
    assert seen_initargs == [(False,)]  # not forked here; quiet either way (_worker_setup)
    assert seen_thresholds == [raised] and gc.get_threshold() == thresholds  # fewer collections
    assert sorted(started) == sorted(needs) and sorted(modules) == sorted(cold)
    assert here and here[0] == started[0]  # this process takes the first task, without a process start-up
    assert modules.index("lowbit.kernels.cpu.mxfp4") < modules.index("lowbit.kernels.cpu.svd_quant")
    # the workers' passed checks are adopted; this process's own and a failed one are not
    workers_passed = [n for n in started if n not in here and n != "weight_quant_batch_matmul"]
    assert sorted(adopted) == sorted((n, "cpu") for n in workers_passed)


def test_a_slot_takes_a_task_waiting_for_its_family_first_only_rather_than_stay_idle():
    needs = {"pack": {"fake_quant"}, "svd": {"quantize"}, "decode": {"encode"}, "encode": set()}
    first = {"pack": "fake_quant", "svd": "svd", "decode": "encode", "encode": "encode"}
    assert warm._ready(["pack", "svd", "encode"], needs, first, set()) == ["encode"]
    assert warm._ready(["pack", "svd", "decode"], needs, first, set()) == ["pack", "decode"]  # else idle
    assert warm._ready(["svd"], needs, first, set()) == []  # another family's kernels: always waited for
    assert warm._ready(["svd"], needs, first, {"quantize"}) == ["svd"]


def test_a_worker_that_dies_ends_the_warm_up_without_an_error(monkeypatch):
    """A worker killed (out of memory, a crash) breaks the process pool: the warm-up stops submitting and
    returns, and the calling process compiles what is left itself."""
    submitted, here = [], []

    class Here(_PoolStub):  # this process's own tasks end at once
        def submit(self, fn, name):
            here.append(name)
            future = warm.concurrent.futures.Future()
            future.set_result(None)
            return future

    class BreakingPool(_PoolStub):
        def submit(self, fn, name):
            if submitted:  # the first task's worker died: the pool refuses the rest
                raise warm.concurrent.futures.process.BrokenProcessPool("a worker died")
            submitted.append(name)
            future = warm.concurrent.futures.Future()
            future.set_exception(warm.concurrent.futures.process.BrokenProcessPool("a worker died"))
            return future

    monkeypatch.setattr(warm, "_start_method", lambda: "spawn")
    monkeypatch.setattr(warm, "is_cold", lambda module: True)
    monkeypatch.setattr(warm.concurrent.futures, "ProcessPoolExecutor", BreakingPool)
    monkeypatch.setattr(warm.concurrent.futures, "ThreadPoolExecutor", Here)
    assert warm.warm_cache(operators().values(), workers=2)  # returns the cold modules, raises nothing
    assert len(submitted) == 1 and len(here) <= 2  # no task after the pool broke


def test_workers_are_forked_only_from_a_process_without_other_threads_or_numba_threading_layer(monkeypatch):
    from numba.np.ufunc import parallel as numba_parallel

    monkeypatch.setattr(warm.sys, "platform", "linux")
    monkeypatch.setattr(numba_parallel, "_is_initialized", False)
    monkeypatch.setattr(warm.threading, "active_count", lambda: 1)  # (earlier tests may leave threads running)
    assert warm._start_method() == "fork"
    monkeypatch.setattr(warm.threading, "active_count", lambda: 2)  # another Python thread runs
    assert warm._start_method() == "spawn"
    monkeypatch.setattr(warm.threading, "active_count", lambda: 1)
    monkeypatch.setattr(numba_parallel, "_is_initialized", True)  # numba's OpenMP threads would be lost
    assert warm._start_method() == "spawn"
    monkeypatch.setattr(numba_parallel, "_is_initialized", False)
    monkeypatch.setattr(warm.sys, "platform", "darwin")
    assert warm._start_method() == "spawn"


WORKERS = """
import os, sys, torch, numba, lowbit
from lowbit.kernels.cpu import warm

def in_worker():
    return torch.get_num_threads(), numba.config.THREADING_LAYER, warm.COMPILE_NOTICE.quiet

if __name__ == "__main__":
    method = warm._start_method()
    print("buffered here", end=" ")  # left in this process's stdout buffer: the fork must not copy it
    for start in (method, "spawn"):
        warm._start_method = lambda: start
        pool = warm._worker_pool(1)
        threads, layer, announced = pool.submit(in_worker).result()
        pool.shutdown(wait=True)
        print(pool._mp_context.get_start_method(), threads, layer, announced)
"""


def test_worker_processes_forked_with_one_torch_thread_and_numba_workqueue_or_spawned(tmp_path):
    """From a fresh `lowbit` process (no thread pool started yet) the warm-up's workers are forked: they
    run torch on one thread (an OpenMP pool of the parent would not exist in them) and numba's own
    threading layer; spawned ones keep the defaults. Either kind prints no compile notice (their parent
    prints the lines), and what this process had buffered on stdout is written once."""
    script = tmp_path / "workers.py"
    script.write_text(WORKERS)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["buffered", "here", "fork", "1", "workqueue", "True",
                                     "spawn", str(torch.get_num_threads()), "default", "True"], result.stdout


def test_one_cold_family_starts_no_worker(monkeypatch):
    """A single cold family's operators wait for its first one: workers would only add their start-up."""
    monkeypatch.setattr(warm, "is_cold", lambda module: module == "lowbit.kernels.cpu.weight_only")
    monkeypatch.setattr(warm.concurrent.futures, "ProcessPoolExecutor", None)  # would fail if used
    assert warm.warm_cache(operators().values(), workers=2) == []


def test_serial_or_parallel_kernels_are_two_dispatchers_with_cache_entries_of_their_own():
    from lowbit.kernels.cpu import wqbmm

    serial, parallel = wqbmm._preload.serial, wqbmm._preload.parallel
    assert serial.py_func.__qualname__ == "_preload_serial" and parallel.py_func.__qualname__ == "_preload"
    assert serial.py_func.__code__ is parallel.py_func.__code__
    assert not serial.targetoptions.get("parallel") and parallel.targetoptions["parallel"]
    assert serial._cache._cache_file._index_path != parallel._cache._cache_file._index_path
    assert {serial, parallel} <= set(warm._dispatchers(wqbmm))



def test_bound_serial_or_parallel_kernels_have_names_and_cache_entries_of_their_own():
    from lowbit.kernels.cpu import wqbmm

    streamed, walked = wqbmm._raw_preload_streamed, wqbmm._raw_preload_walked
    names = [k.py_func.__qualname__ for k in (streamed.serial, streamed.parallel, walked.serial, walked.parallel)]
    assert names == ["_raw_preload_streamed_serial", "_raw_preload_streamed", "_raw_preload_walked_serial",
                     "_raw_preload_walked"]
    assert streamed.parallel.py_func.__globals__["_SPAN_ROWS"] is wqbmm._span_streamed
    assert walked.serial.py_func.__globals__["_SPAN_ROWS"] is wqbmm._span_in_registers
    assert "_SPAN_ROWS" not in vars(wqbmm)  # the module's own globals are left alone
    paths = {k._cache._cache_file._index_path for k in (streamed.serial, streamed.parallel, walked.serial,
                                                        walked.parallel)}
    assert len(paths) == 4
    assert {streamed.serial, walked.parallel} <= set(warm._dispatchers(wqbmm))
    with pytest.raises(ValueError, match="name"):
        wqbmm.SerialOrParallel(wqbmm._raw_preload, _SPAN_ROWS=wqbmm._span_streamed)


RAW_CALL = (
    "import torch, lowbit; from lowbit.kernels.cpu import wqbmm; wqbmm.RAW_ROWS_STREAMED = {streamed}; "
    "lowbit.weight_quant_batch_matmul(torch.ones(1, 64, dtype=torch.float16), torch.zeros(64, 16, dtype=torch.uint8), "
    "torch.ones(1, 32, dtype=torch.float16), group_size=64, backend='native'); "
    "print(bool(wqbmm._raw_preload_streamed.serial.signatures), bool(wqbmm._raw_preload_walked.serial.signatures))"
)


@pytest.mark.parametrize("streamed", [True, False])
def test_a_raw_weight_call_compiles_only_its_row_order(streamed, tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", RAW_CALL.format(streamed=streamed)], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(streamed), str(not streamed)]


def test_an_adopted_check_answers_without_running_the_probes(monkeypatch):
    op = Operator(name="adopted", outputs=lambda x: None, reference=None, native={}, probes=lambda: [])
    monkeypatch.setattr(Operator, "_self_check", lambda *args: pytest.fail("the probes ran"))
    op.adopt_passed_check("cpu")
    assert op.auto_check_error("cpu") is None
    assert op.auto_check_error("cpu", (torch.ones(2, dtype=torch.float16),)) is None


SMALL_MATMUL = (
    "import torch, lowbit; from lowbit.kernels.cpu import warm, wqbmm; "
    "cold = warm.is_cold('lowbit.kernels.cpu.wqbmm'); "
    "lowbit.weight_quant_batch_matmul(torch.ones(1, 64, dtype=torch.float16), torch.zeros(64, 16, dtype=torch.uint8), "
    "torch.ones(1, 32, dtype=torch.float16), group_size=64, backend='native'); "
    "kernels = [k for k in vars(wqbmm).values() if isinstance(k, wqbmm.SerialOrParallel)]; "
    "print(cold, warm.is_cold('lowbit.kernels.cpu.wqbmm'), any(k.serial.signatures for k in kernels), "
    "any(k.parallel.signatures for k in kernels))"
)


def test_a_small_call_compiles_only_serial_versions_and_the_family_is_warm_after_it(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", SMALL_MATMUL], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False", "True", "False"]  # cold, then warm; no parallel loop compiled
