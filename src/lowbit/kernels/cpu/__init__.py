"""numba CPU kernels. Each module has private ``@njit`` kernels and public wrappers on torch tensors.

``parallel_loops``: whether the kernels may run numba's parallel loops in this process. False in a child
forked (os.fork; multiprocessing's "fork" start method, Linux's default before Python 3.14) after lowbit was
imported: the parent's OpenMP threads do not exist there, and a parallel region entered in the child hangs
(GNU OpenMP, once torch ran one in the parent) or ends the process (numba's check, once numba's ran), so every
kernel runs on the calling thread, with the same bits (README.md, 'Threads'). Set here, where ``import lowbit``
registers it without importing numba.
"""

import os

parallel_loops = True


def _after_fork_in_child() -> None:
    global parallel_loops
    parallel_loops = False


if hasattr(os, "register_at_fork"):  # (not on Windows, which cannot fork)
    os.register_at_fork(after_in_child=_after_fork_in_child)
