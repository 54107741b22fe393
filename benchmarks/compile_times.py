"""Where a cold first run spends its compiling: each operator's self-check run in turn in this one process (no
warm-up workers), with numba's compile events recorded. Prints each operator's seconds and the numba functions
that took the most compiling of their own (their callees' compiles subtracted), summed over their
specializations. Run it with an empty numba cache, or it only loads:

    NUMBA_CACHE_DIR=$(mktemp -d) PYTHONPATH=src python benchmarks/compile_times.py [--top 25]
        [--operators mxfp4_linear,...]
"""

from __future__ import annotations

import lowbit  # noqa: I001  (first: sets the OpenMP wait policy before torch loads)

import argparse
import collections
import time

import torch

from numba.core import event

import lowbit.ops  # noqa: F401  (registers every operator)
from lowbit import backends
from lowbit.cli.smoke._common import device_name
from lowbit.kernels.cpu import warm


class _CompileTimes(event.Listener):
    """Each finished numba compile as (seconds of its own, function name); a compile nested in another (a callee)
    is subtracted from its caller's."""

    def __init__(self) -> None:
        self.open: list[list] = []  # [start, seconds of nested compiles, name]
        self.done: list[tuple[float, str]] = []

    def on_start(self, e) -> None:
        func = getattr(e.data.get("dispatcher"), "py_func", None)
        self.open.append([time.perf_counter(), 0.0, getattr(func, "__qualname__", "?")])

    def on_end(self, e) -> None:
        start, nested, name = self.open.pop()
        seconds = time.perf_counter() - start
        self.done.append((seconds - nested, name))
        if self.open:
            self.open[-1][1] += seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=25, help="functions to list")
    parser.add_argument("--operators", default="", help="comma-separated operator names (default: every one)")
    args = parser.parse_args()
    names = args.operators.split(",") if args.operators else list(backends.operators())
    unknown = sorted(set(names) - set(backends.operators()))
    if unknown:
        parser.error(f"unknown operators {unknown}; known: {sorted(backends.operators())}")
    times = _CompileTimes()
    event.register("numba:compile", times)
    print(f"CPU: {device_name(torch.device('cpu'))}; each operator's self-check in turn, one process")
    start = time.perf_counter()
    for name in names:
        began = time.perf_counter()
        failure = warm._warm_operator(name)
        print(f"  {name}: {time.perf_counter() - began:.1f} s" + (f" ({failure})" if failure else ""))
    print(f"all: {time.perf_counter() - start:.1f} s")
    own: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for seconds, name in times.done:
        own[name][0] += seconds
        own[name][1] += 1
    print(f"the {args.top} functions with the most compiling of their own (seconds, specializations):")
    for name, (seconds, count) in sorted(own.items(), key=lambda item: -item[1][0])[: args.top]:
        print(f"  {seconds:6.2f}  x{count}  {name}")


if __name__ == "__main__":
    main()
