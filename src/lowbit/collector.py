"""Fewer garbage collections while kernels compile.

numba's compiler builds millions of objects in reference cycles (its IR, type maps, LLVM wrappers) that live
for the length of one kernel's compile: they outlive Python's young generations, reach the oldest one and die
there, so its thresholds trigger a full collection every few compiles, and each traverses every live object of
the process (torch's and numba's included: about 0.2 s on these VMs). The main process of a cold `lowbit smoke
all` ran 23 of them, 4-5 s (docs/cli.md, 'First run'). While :func:`fewer_collections` is active the young
generation is collected every 10,000 allocations instead of Python's 700 and a full collection waits for 100
collections of the middle one instead of 10: garbage waits longer (that smoke's peak memory 605 -> 695 MB),
and the next full collection once the thresholds are back frees it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from typing import Iterator

COMPILING_THRESHOLDS = (10_000, 10, 100)  # gc.set_threshold's (young, middle, oldest) while compiling

_lock = threading.RLock()  # (a collection started under it may run a finalizer that enters a context itself)
_depth: dict[int, int] = {}  # thread id: the contexts it entered and has not left
_saved: tuple[int, ...] = ()  # the thresholds the first of them found


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """While any thread is inside (nested or concurrent contexts count once), the garbage collector runs with
    COMPILING_THRESHOLDS where these collect less often than its own thresholds; the last to leave puts back
    the thresholds the first found (a change made meanwhile by other code is lost). A young threshold of 0
    (automatic collection off) is left so. A forked child stays inside the contexts its forking thread was in,
    and only those (the other threads do not exist there)."""
    global _saved
    me = threading.get_ident()
    with _lock:
        first = not _depth
        _depth[me] = _depth.get(me, 0) + 1  # before any allocation that may start a collection (and a finalizer)
        if first:
            _saved = gc.get_threshold()
            if _saved[0]:
                gc.set_threshold(*(max(ours, theirs) for ours, theirs in zip(COMPILING_THRESHOLDS, _saved)))
    try:
        yield
    finally:
        with _lock:
            _depth[me] -= 1
            if not _depth[me]:
                del _depth[me]
            if not _depth:
                gc.set_threshold(*_saved)
                _saved = ()


def _after_fork_in_child() -> None:
    """A new lock (another thread may have held the parent's as it forked), and only the forking thread's
    contexts; the thresholds put back where it was in none (also where another thread forked halfway through
    entering or leaving: ``_saved`` is set from before the thresholds are raised until after they are back)."""
    global _lock, _saved
    _lock = threading.RLock()
    me = threading.get_ident()
    for ident in [ident for ident in _depth if ident != me]:
        del _depth[ident]
    if not _depth and _saved:
        gc.set_threshold(*_saved)
        _saved = ()


if hasattr(os, "register_at_fork"):  # (not on Windows, which does not fork)
    os.register_at_fork(after_in_child=_after_fork_in_child)
