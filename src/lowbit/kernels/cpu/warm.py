"""Fill numba's on-disk cache for several CPU kernel families at once: in this process and in worker processes.

numba compiles under a process-wide lock, so one process compiles one kernel at a time. When the cache of
several families is cold (nothing of the family was ever cached), :func:`warm_cache` compiles them in
parallel, one task per operator running its self-check (which compiles every specialization the probes
need), an operator after those whose kernels it shares. The calling process takes tasks too, on a thread of
its own, and keeps what it compiled loaded; it then loads the workers' kernels from the cache. Workers are
forked where that is safe (they start with torch and lowbit imported), else spawned (each first imports
them). A family counts as cold only when none of its cached kernels has an index file in numba's cache, so
a warm cache costs no worker process. Warming is an optimization only: a worker that fails changes nothing,
as the calling process compiles whatever is still missing itself.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import inspect
import multiprocessing
import os
import pkgutil
import sys
import threading
import time
from typing import Callable, Iterable, Optional

import numba
import torch

import lowbit.kernels.cpu as cpu_package
from lowbit.backends import Operator
from lowbit.collector import fewer_collections
from lowbit.kernels.cpu._runtime import COMPILE_NOTICE, SerialOrParallel, family_module

DEVICE_TYPE = "cpu"


def families(ops: Iterable[Operator]) -> dict[str, list[str]]:
    """``{kernel module: [operator names]}`` of the operators with a CPU kernel loaded by NativeLoader."""
    found: dict[str, list[str]] = {}
    for op in ops:
        module = getattr(op.native.get(DEVICE_TYPE), "module", None)
        if module is not None:
            found.setdefault(module, []).append(op.name)
    return found


def is_cold(module_name: str) -> bool:
    """True when ``module_name`` defines numba kernels cached on disk and none of them has an index in
    numba's cache yet (it imports the module, which compiles nothing)."""
    module = importlib.import_module(module_name)
    index_paths = [_index_path(value) for value in _dispatchers(module) if value.py_func.__module__ == module_name]
    index_paths = [path for path in index_paths if path]  # kernels compiled with cache=True
    return bool(index_paths) and not any(os.path.exists(path) for path in index_paths)


def _index_path(dispatcher) -> Optional[str]:
    """The path of numba dispatcher ``dispatcher``'s index file in numba's on-disk cache (None: not cached)."""
    return getattr(getattr(getattr(dispatcher, "_cache", None), "_cache_file", None), "_index_path", None)


def _dispatchers(module) -> list:
    """The numba dispatchers among a module's names (both of each SerialOrParallel kernel)."""
    found = []
    for value in vars(module).values():
        if isinstance(value, SerialOrParallel):
            found += [value.serial, value.parallel]
        elif isinstance(value, numba.core.dispatcher.Dispatcher):
            found.append(value)
    return found


def _family_bytes(module_name: str) -> int:
    """The bytes of the source files of kernel family ``module_name``: its module's and its private helper
    modules' (_runtime.family_module)."""
    package, _, _ = module_name.rpartition(".")
    folder = os.path.dirname(importlib.import_module(module_name).__file__)
    return sum(os.path.getsize(os.path.join(folder, f"{info.name}.py")) for info in pkgutil.iter_modules([folder])
               if family_module(f"{package}.{info.name}") == module_name)


def _warm_operator(name: str) -> Optional[str]:
    """A warm-up task, in a worker process or this one: run the CPU self-check of operator ``name`` (compiling
    and caching its kernels), then, where it passed, its native kernel's ``compile_more()`` if it has one (paths
    its callers take that the self-check does not run); returns the self-check's answer (None: passed)."""
    import lowbit  # noqa: F401  (registers every operator)
    from lowbit.backends import operators

    op = operators()[name]
    error = op.auto_check_error(DEVICE_TYPE)
    compile_more = getattr(op.native_kernel(DEVICE_TYPE), "compile_more", None) if error is None else None
    if compile_more is not None:
        compile_more()
    return error


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies of all CPUs from /proc/stat (Linux), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields[:8])  # idle + iowait; no guest time


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_workers() -> int:
    """The warm-up's compiling processes by default: one per CPU this process may run on where the workers are
    forked (a fork costs milliseconds, and the scheduler shares busy CPUs among runnable processes, so two
    compiling processes beside a busy one get 4/3 of a 2-CPU machine where one gets 1: a cold smoke with one
    or two spinning processes beside it took 42.7-44.0 / 60.2 s with two workers against 53.6-54.8 / 83.4 s in
    one process, benchmarks/results_first_run.md, 'Forty-sixth session'); else, where each worker is spawned and
    first imports torch, one per idle CPU (:func:`idle_cpus`)."""
    return usable_cpus() if _start_method() == "fork" else idle_cpus()


def idle_cpus(window: float = 0.1) -> int:
    """The CPUs this process may run on that are idle, rounded up from a quarter (0 or more): measured over
    ``window`` seconds from /proc/stat where there is one, else the CPUs minus the 1-minute load average
    (which also counts sleeping, uninterruptible tasks: a quiet VM here shows 0.9 with its CPUs idle)."""
    cpus = usable_cpus()
    before = _cpu_times()
    if before is not None:
        time.sleep(window)
        after = _cpu_times()
        if after is not None and after[1] > before[1]:
            busy = cpus * (1 - (after[0] - before[0]) / (after[1] - before[1]))
            return max(0, round(cpus - busy + 0.25))
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform
        load = 0.0
    return max(0, round(cpus - load + 0.25))


def cpu_kernels(ops: Iterable[Operator]) -> dict[str, object]:
    """``{operator name: its CPU kernel object}`` of the operators with a CPU kernel loaded by NativeLoader
    (importing their kernel modules, which compiles nothing)."""
    return {op.name: op.native[DEVICE_TYPE]() for op in ops
            if getattr(op.native.get(DEVICE_TYPE), "module", None) is not None}


def _defining_module(value) -> Optional[str]:
    """The kernel family (_runtime.family_module) of module ``value`` or of the module defining it (for a
    numba kernel, its Python function; for a SerialOrParallel kernel pair, its serial kernel's)."""
    if inspect.ismodule(value):
        return family_module(value.__name__)
    if isinstance(value, SerialOrParallel):
        value = value.serial
    module = getattr(getattr(value, "py_func", value), "__module__", None)
    return None if module is None else family_module(module)


def _used_operators(module_name: str, cold: dict[str, list[str]], kernels: dict[str, object]) -> set[str]:
    """The operators of the other families of ``cold`` ({kernel module: [operator names]}) whose kernels
    kernel module ``module_name`` compiles when it runs: where it holds kernel objects of a family's operators
    (``kernels``: {operator name: CPU kernel object}), those operators and the family's first (its shared
    helpers; the family's other helpers the module calls are those its operators' kernels run); where it
    holds the family's module or only its numba kernels and helpers, all of the family's operators."""
    by_id = {id(kernel): name for name, kernel in kernels.items()}
    family = {name: module for module, names in cold.items() for name in names}
    held: dict[str, set[str]] = {}  # family: the operators whose kernel objects the module holds (or none)
    whole = set()  # the modules of other families that the module holds
    for value in vars(importlib.import_module(module_name)).values():
        name = by_id.get(id(value))
        if name in family:
            source, names = family[name], {name}
        else:
            source, names = _defining_module(value), set()
            if inspect.ismodule(value):
                whole.add(source)
        if source in cold and source != module_name:
            held.setdefault(source, set()).update(names)
    return {name for source, names in held.items()
            for name in (names | {cold[source][0]} if names and source not in whole else cold[source])}


def _prerequisites(cold: dict[str, list[str]], kernels: dict[str, object]) -> dict[str, set[str]]:
    """``{operator: operators whose warm-up must end before its own starts}`` for the operators of the cold
    families ``cold`` ({kernel module: [operator names]}; ``kernels``: {operator name: CPU kernel object}):
    the first operator of its own family (which compiles the helpers the family's operators share), and the
    operators of other cold families whose kernels its kernel module uses (:func:`_used_operators`). Either
    way its worker then loads those kernels from the cache instead of compiling them a second time
    alongside."""
    needs = {}
    for module, names in cold.items():
        used = _used_operators(module, cold, kernels)
        for i, name in enumerate(names):
            needs[name] = used | ({names[0]} if i else set())
    return needs


def _ready(pending: list[str], needs: dict[str, set[str]], first: dict[str, str], ended: set[str]) -> list[str]:
    """The tasks among ``pending`` that may start once those in ``ended`` have: those whose prerequisites
    have all ended or, where there is none, those that only wait for their family's first operator (``first``)
    to end: a slot compiling a shared helper a second time does more than a slot left idle."""
    return ([name for name in pending if needs[name] <= ended]
            or [name for name in pending if needs[name] - {first[name]} <= ended])


def _start_method() -> str:
    """'fork' where the warm-up's workers may be forked from this process, else 'spawn'. A forked worker
    starts with torch, numba and lowbit imported; a spawned one first imports them (2.5 s on a slow VM).
    Forking is safe on Linux while this process runs no other Python thread (none can hold a lock the
    child would inherit held) and numba's threading layer has not started (its OpenMP or TBB threads would not
    exist in the child). Threads started outside Python may run (numpy's OpenBLAS server thread from the
    import on, which handles forks; torch's OpenMP pool after a parallel op): a forked worker never enters
    a parallel region of theirs (:func:`_worker_setup`; Python 3.12 and later warn of them, hidden by
    default)."""
    if not sys.platform.startswith("linux") or threading.active_count() > 1:
        return "spawn"
    from numba.np.ufunc import parallel as numba_parallel
    return "spawn" if getattr(numba_parallel, "_is_initialized", True) else "fork"


def _worker_setup(forked: bool) -> None:
    """Initializer of a warm-up worker: it prints no compile notice (COMPILE_NOTICE.quiet: the calling process
    prints the cold families' lines, and a worker's would break into its progress line, or repeat the line of
    a helper module such as amx that several processes compile). A forked worker runs torch on one thread
    (its OpenMP pool, if the parent started one, does not exist here) and numba's own threading layer
    (workqueue, which starts here) rather than OpenMP for any parallel kernel a probe runs, so it may run
    them (lowbit.kernels.cpu.parallel_loops); numba caches a kernel for every threading layer alike."""
    COMPILE_NOTICE.quiet = True
    if forked:
        torch.set_num_threads(1)
        numba.config.THREADING_LAYER = "workqueue"
        cpu_package.parallel_loops = True


def _worker_pool(workers: int) -> concurrent.futures.ProcessPoolExecutor:
    """A pool of ``workers`` warm-up processes, forked at once where :func:`_start_method` allows (before this
    process starts its compiling thread, whose locks a later fork would copy held), else spawned as tasks
    arrive."""
    method = _start_method()
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method),
                                                  initializer=_worker_setup,
                                                  initargs=(method == "fork",))
    if method == "spawn":
        return pool
    # CPython forks every worker of a fork pool on its first task, having flushed sys.stdout and sys.stderr
    # (each child would otherwise write out again what they held)
    pool.submit(int)
    return pool


def warm_cache(ops: Iterable[Operator], workers: int | None = None,
               on_start: Callable[[], object] | None = None) -> list[str]:
    """Compile the CPU kernels of the cold families among ``ops`` in parallel; returns those modules.

    One task per operator (its self-check), run by ``workers`` compiling processes at a time, this one
    included (default: :func:`default_workers`, at most one per cold family): a thread of this process takes
    the first task at once, worker processes the others; nothing is started when fewer than two would run
    (spawned workers on CPUs busy with other work would only add their start-up to the same compile time:
    benchmarks/results_first_run.md). A worker process that dies ends the warm-up (the pool takes no more
    tasks). A worker's passed self-check is adopted here (Operator.adopt_passed_check): this process loads
    those kernels from the cache when it first runs them, without running the probes again. A task starts
    once its :func:`_prerequisites` have ended; among those ready, the families that others use come first,
    then those that use others, then the larger kernel modules (the longer compiles), each family's
    operators in their order. A slot that would otherwise stay idle takes a task
    whose family's first operator is still compiling (it may compile some shared helper a second time).
    The compile notice of every cold family (lowbit.kernels.cpu._runtime.COMPILE_NOTICE) is printed here,
    up front, and by no worker. ``on_start()``, if given, is called once the workers exist and before the
    first task (progress: a thread started earlier would rule out forking the workers).
    """
    ops = list(ops)
    by_name = {op.name: op for op in ops}
    cold = {module: names for module, names in families(ops).items() if is_cold(module)}
    workers = min(default_workers() if workers is None else workers, len(cold))  # a family's tasks wait for its first
    if workers < 2:
        return []
    needs = _prerequisites(cold, cpu_kernels(ops))
    family = {name: module for module, names in cold.items() for name in names}
    uses = {module: {family[n] for name in names for n in needs[name]} - {module} for module, names in cold.items()}
    used, users = set().union(*uses.values()), {module for module, others in uses.items() if others}
    order = sorted(cold, key=lambda m: (m not in used, m not in users,
                                        -_family_bytes(m)))
    for module in order:  # all up front; the workers print none (_worker_setup)
        COMPILE_NOTICE.announce(module, next(d for d in _dispatchers(importlib.import_module(module))
                                             if d.py_func.__module__ == module and _index_path(d)))
    with fewer_collections():  # held between tasks, here and in the workers forked inside it
        _run_tasks([name for module in order for name in cold[module]], cold, needs, by_name, workers, on_start)
    return order


def _run_tasks(pending: list[str], cold: dict[str, list[str]], needs: dict[str, set[str]],
               by_name: dict[str, Operator], workers: int, on_start: Callable[[], object] | None) -> None:
    """:func:`warm_cache`'s tasks ``pending`` (operator names in the order to try them) run by ``workers``
    processes, this one included."""
    first = {name: names[0] for names in cold.values() for name in names}
    ended: set[str] = set()
    running: dict[concurrent.futures.Future, tuple[str, bool]] = {}  # future: (operator, run by this process)
    pool = _worker_pool(workers - 1)
    try:
        if on_start is not None:
            on_start()
        with concurrent.futures.ThreadPoolExecutor(1) as here:
            while pending or running:
                ready = _ready(pending, needs, first, ended) or (pending[:1] if not running else [])
                here_free = not any(local for _, local in running.values())
                try:
                    for name in ready[:workers - len(running)]:  # (a cycle of prerequisites runs in list order)
                        executor = here if here_free else pool
                        running[executor.submit(_warm_operator, name)] = name, here_free
                        pending.remove(name)
                        here_free = False
                except concurrent.futures.BrokenExecutor:  # a worker died (memory, a crash): the pool takes no more
                    break
                finished, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in finished:
                    name, local = running.pop(future)
                    ended.add(name)
                    try:
                        passed = future.result() is None
                    except Exception:  # the caller compiles what a failed task left out
                        passed = False
                    if passed and not local:  # the same kernels, from the cache: no second self-check here
                        by_name[name].adopt_passed_check(DEVICE_TYPE)
    finally:  # every task has ended, or the pool broke, or an interrupt: the workers exit on their own
        pool.shutdown(wait=False, cancel_futures=True)
