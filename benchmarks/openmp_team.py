"""Whether numba's parallel loops and torch's ops share one OpenMP team in this process: the libgomp files
loaded, and the CPU time each thread spent in 20 numba parallel loops, then in 20 torch matrix products
(per-thread ticks from /proc): a worker thread with ticks in both ran both, so the two take turns on one team of
threads; two teams would show a worker of each. (Which copy a library binds to is the dynamic linker's choice,
shown by ``LD_DEBUG=bindings``.) Linux only.

    PYTHONPATH=src python benchmarks/openmp_team.py
"""

from __future__ import annotations

import lowbit  # noqa: I001  (first: sets the OpenMP wait policy before torch loads)

import os
import sys

import numba
import numpy as np
import torch

from lowbit.kernels.cpu._runtime import PARALLEL_NJIT_OPTIONS


@numba.njit(**dict(PARALLEL_NJIT_OPTIONS, cache=False))
def _busy(n):
    out = np.zeros(2)
    for p in numba.prange(2):
        s = 0.0
        for i in range(n):
            s += np.sqrt(i + p)
        out[p] = s
    return out


def _thread_ticks() -> dict[str, int]:
    """User + system clock ticks of each thread of this process."""
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks[tid] = int(fields[11]) + int(fields[12])
    return ticks


def _loaded(fragment: str) -> list[str]:
    with open("/proc/self/maps") as f:
        return sorted({line.split()[-1] for line in f if fragment in line and "/" in line})


def main() -> None:
    if not sys.platform.startswith("linux"):
        raise SystemExit("openmp_team.py: Linux only (/proc)")
    torch.set_num_threads(2)
    _busy(10)
    a = torch.randn(1000, 1000)
    a @ a
    print(f"numba threading layer: {numba.threading_layer()}, torch {torch.__version__}, numba {numba.__version__}")
    print("libgomp files loaded:", ", ".join(_loaded("libgomp")))
    before = _thread_ticks()
    for _ in range(20):
        _busy(20_000_000)
    middle = _thread_ticks()
    for _ in range(20):
        a @ a
    after = _thread_ticks()
    print("thread, ticks in numba's loops, ticks in torch's products:")
    for tid in after:
        numba_ticks, torch_ticks = middle.get(tid, 0) - before.get(tid, 0), after[tid] - middle.get(tid, 0)
        if numba_ticks or torch_ticks:
            print(f"  {tid}: {numba_ticks}, {torch_ticks}")


if __name__ == "__main__":
    main()
