"""Fewer garbage collections while kernels compile (lowbit.collector)."""

import contextlib
import gc
import multiprocessing
import os
import sys
import threading

import numba
import pytest
import torch
from numba.extending import overload

from lowbit import collector
from lowbit.backends import Kernel, Operator, TensorSpec
from lowbit.collector import COMPILING_THRESHOLDS, fewer_collections


def reported(*values) -> tuple:
    """The thresholds gc reports once set to ``values`` (an interpreter may ignore some: Python 3.14's
    incremental collector has no threshold of the oldest generation)."""
    saved = gc.get_threshold()
    gc.set_threshold(*values)
    try:
        return gc.get_threshold()
    finally:
        gc.set_threshold(*saved)


DEFAULT, RAISED = reported(700, 10, 10), reported(*COMPILING_THRESHOLDS)


@pytest.fixture
def thresholds():
    """The collector's thresholds set to Python's defaults for the test, and put back after it."""
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def test_thresholds_are_raised_inside_and_put_back_by_the_last_context_to_leave(thresholds):
    with fewer_collections():
        assert gc.get_threshold() == RAISED
        with fewer_collections():
            assert gc.get_threshold() == RAISED
        assert gc.get_threshold() == RAISED  # the outer context is still open
    assert gc.get_threshold() == DEFAULT
    with pytest.raises(KeyError), fewer_collections():  # put back when the body raises too
        raise KeyError("compile failed")
    assert gc.get_threshold() == DEFAULT and collector._depth == {}


@contextlib.contextmanager
def _another_thread_inside():
    """While the body runs, another thread is inside a fewer_collections() context."""
    inside, leave = threading.Event(), threading.Event()

    def other_thread():
        with fewer_collections():
            inside.set()
            leave.wait(timeout=60)

    worker = threading.Thread(target=other_thread)
    worker.start()
    inside.wait(timeout=60)
    try:
        yield
    finally:
        leave.set()
        worker.join(timeout=60)


def test_contexts_of_several_threads_count_once(thresholds):
    with _another_thread_inside():
        with fewer_collections():
            pass
        assert gc.get_threshold() == RAISED  # the other thread's context is still open
    assert gc.get_threshold() == DEFAULT


def test_higher_thresholds_and_a_collector_turned_off_are_kept():
    saved = gc.get_threshold()
    try:
        gc.set_threshold(50_000, 5, 20)
        with fewer_collections():
            assert gc.get_threshold() == reported(50_000, 10, 100)  # each the larger of the two
        assert gc.get_threshold() == reported(50_000, 5, 20)
        gc.set_threshold(0, 10, 10)  # automatic collection off
        with fewer_collections():
            assert gc.get_threshold()[0] == 0
        assert gc.get_threshold() == reported(0, 10, 10)
    finally:
        gc.set_threshold(*saved)


class _Recording(Kernel):
    """A native kernel that records the collector's thresholds while it runs."""

    def __init__(self):
        self.seen = []

    def run(self, x, *, out):
        self.seen.append(gc.get_threshold())
        out.copy_(x * 2)


class _Double(Kernel):
    def run(self, x, *, out):
        out.copy_(x * 2)


def test_the_self_check_runs_with_fewer_collections(thresholds):
    native = _Recording()
    op = Operator(name="toy_collector", outputs=lambda x: (TensorSpec(tuple(x.shape), x.dtype),),
                  reference=_Double(), native={"cpu": lambda: native}, probes=lambda: [(torch.arange(4.0),)])
    assert op.auto_check_error("cpu") is None
    assert native.seen == [RAISED]  # the probe's run (the first, which compiles)
    op(torch.ones(3), backend="auto")  # a call after the check: the process's own thresholds
    assert native.seen[1:] == [DEFAULT] and gc.get_threshold() == DEFAULT


def _report_state(queue) -> None:
    """In a forked child: its thresholds and which threads' contexts it is in (this thread: "me")."""
    me = threading.get_ident()
    queue.put((gc.get_threshold(), ["me" if ident == me else ident for ident in collector._depth]))


def _forked_state() -> tuple:
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_report_state, args=(queue,))
    child.start()
    try:
        return queue.get(timeout=60)
    finally:
        child.join(timeout=60)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks on Linux only")
def test_a_forked_child_keeps_only_its_forking_threads_contexts(thresholds):
    with _another_thread_inside():
        with fewer_collections():  # forked inside a context of the forking thread too: the child stays in it
            both = _forked_state()
        alone = _forked_state()  # forked while only the other thread is inside: the child is in none
    assert both == (RAISED, ["me"]) and alone == (DEFAULT, [])
    assert gc.get_threshold() == DEFAULT


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks on Linux only")
def test_a_child_forked_while_another_thread_enters_or_leaves_is_left_with_the_thresholds_put_back(thresholds):
    """Forks racing a thread that enters and leaves contexts in a loop: a child in no context has the
    thresholds put back, wherever the other thread was as it forked (a race that caught one fork in ten)."""
    stop = False

    def enter_and_leave():
        while not stop:
            with fewer_collections():
                pass

    worker = threading.Thread(target=enter_and_leave)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    worker.start()
    states = []
    try:
        for _ in range(300):
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: one byte, then out at once
                os.write(write, b"1" if collector._depth or gc.get_threshold() == DEFAULT else b"0")
                os._exit(0)
            os.close(write)
            states.append(os.read(read, 1))
            os.close(read)
            os.waitpid(pid, 0)
    finally:
        stop = True
        worker.join(timeout=60)
        sys.setswitchinterval(interval)
    assert states.count(b"1") == 300, states.count(b"0")


def _record_thresholds(value):
    """Called in numba code: typed once per argument type (its overload below runs then) and compiled to nothing."""


_SEEN_WHILE_TYPING = []


@overload(_record_thresholds)
def _record_thresholds_typing(value):
    _SEEN_WHILE_TYPING.append(gc.get_threshold())
    return lambda value: None


def _compile_in_module(module: str, value) -> None:
    """Compile (not cached) a numba function of module ``module`` whose typing records gc's thresholds, for an
    argument of ``value``'s type (a type not seen before, or the overload's typing is not run again)."""
    def kernel(value):
        _record_thresholds(value)

    kernel.__module__ = module
    numba.njit(cache=False)(kernel)(value)


def test_a_lowbit_kernel_compiles_with_fewer_collections_wherever_it_first_runs(thresholds):
    import lowbit.kernels.cpu._runtime  # noqa: F401  (registers the compile listener)

    _SEEN_WHILE_TYPING.clear()
    _compile_in_module("lowbit.kernels.cpu.toy", 1)
    _compile_in_module("users_own_module", 1.0)
    assert _SEEN_WHILE_TYPING == [RAISED, DEFAULT] and gc.get_threshold() == DEFAULT
