"""Timing for benchmarks (never for tests): medians of repeated runs, synchronised on accelerators."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(
    fn: Callable[[], object],
    *,
    repeats: int = 7,
    warmup: int = 2,
    device: torch.device | str | None = None,
    min_time: float = 0.0,
) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` runs.

    Each of the ``repeats`` samples loops ``fn`` until at least ``min_time`` seconds have passed (for
    sub-millisecond calls) and reports the time per call.
    """
    device = torch.device(device) if device is not None else None
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        calls = 0
        start = time.perf_counter()
        while True:
            fn()
            calls += 1
            _sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= min_time:
                break
        samples.append(elapsed / calls)
    return statistics.median(samples)


def gbps(nbytes: int, seconds: float) -> float:
    """Bytes moved (read + written) per second, in GB/s (1e9)."""
    return nbytes / seconds / 1e9
