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
import threading
from typing import Iterator

COMPILING_THRESHOLDS = (10_000, 10, 100)  # gc.set_threshold's (young, middle, oldest) while compiling

_lock = threading.Lock()
_active = 0  # contexts entered and not left, over all threads
_saved: tuple[int, ...] = ()  # the thresholds the first of them found


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """While any thread is inside (nested or concurrent contexts count once), the garbage collector runs with
    COMPILING_THRESHOLDS where these collect less often than its own thresholds; the last to leave puts back
    the thresholds the first found (a change made meanwhile by other code is lost). The process state is
    global: a forked child starts inside the contexts its parent was in when it forked."""
    global _active, _saved
    with _lock:
        if _active == 0:
            _saved = gc.get_threshold()
            if _saved[0]:  # (a young threshold of 0 turns automatic collection off: left so)
                gc.set_threshold(*(max(ours, theirs) for ours, theirs in zip(COMPILING_THRESHOLDS, _saved)))
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                gc.set_threshold(*_saved)
