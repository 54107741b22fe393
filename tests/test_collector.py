"""Fewer garbage collections while kernels compile (lowbit.collector)."""

import gc
import multiprocessing
import sys
import threading

import pytest
import torch

from lowbit import collector
from lowbit.backends import Kernel, Operator, TensorSpec
from lowbit.collector import COMPILING_THRESHOLDS, fewer_collections


@pytest.fixture
def thresholds():
    """The collector's thresholds set to Python's defaults for the test, and put back after it."""
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def test_thresholds_are_raised_inside_and_put_back_by_the_last_context_to_leave(thresholds):
    with fewer_collections():
        assert gc.get_threshold() == COMPILING_THRESHOLDS
        with fewer_collections():
            assert gc.get_threshold() == COMPILING_THRESHOLDS
        assert gc.get_threshold() == COMPILING_THRESHOLDS  # the outer context is still open
    assert gc.get_threshold() == (700, 10, 10)
    with pytest.raises(KeyError), fewer_collections():  # put back when the body raises too
        raise KeyError("compile failed")
    assert gc.get_threshold() == (700, 10, 10) and collector._depth == {}


def test_contexts_of_several_threads_count_once(thresholds):
    inside, leave = threading.Event(), threading.Event()

    def other_thread():
        with fewer_collections():
            inside.set()
            leave.wait(timeout=60)

    worker = threading.Thread(target=other_thread)
    worker.start()
    inside.wait(timeout=60)
    with fewer_collections():
        pass
    assert gc.get_threshold() == COMPILING_THRESHOLDS  # the other thread's context is still open
    leave.set()
    worker.join(timeout=60)
    assert gc.get_threshold() == (700, 10, 10)


def test_higher_thresholds_and_a_collector_turned_off_are_kept():
    saved = gc.get_threshold()
    try:
        gc.set_threshold(50_000, 5, 20)
        with fewer_collections():
            assert gc.get_threshold() == (50_000, 10, 100)  # each the larger of the two
        assert gc.get_threshold() == (50_000, 5, 20)
        gc.set_threshold(0, 10, 10)  # automatic collection off
        with fewer_collections():
            assert gc.get_threshold()[0] == 0
        assert gc.get_threshold() == (0, 10, 10)
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
    assert native.seen == [COMPILING_THRESHOLDS]  # the probe's run (the first, which compiles)
    op(torch.ones(3), backend="auto")  # a call after the check: the process's own thresholds
    assert native.seen[1:] == [(700, 10, 10)] and gc.get_threshold() == (700, 10, 10)


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
    inside, leave = threading.Event(), threading.Event()

    def other_thread():
        with fewer_collections():
            inside.set()
            leave.wait(timeout=60)

    worker = threading.Thread(target=other_thread)
    worker.start()
    inside.wait(timeout=60)
    try:
        with fewer_collections():  # forked inside a context of the forking thread too: the child stays in it
            both = _forked_state()
        alone = _forked_state()  # forked while only the other thread is inside: the child is in none
    finally:
        leave.set()
        worker.join(timeout=60)
    assert both == (COMPILING_THRESHOLDS, ["me"]) and alone == ((700, 10, 10), [])
    assert gc.get_threshold() == (700, 10, 10)
