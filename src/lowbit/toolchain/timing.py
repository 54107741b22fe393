"""Timing for benchmarks and profiles (never for tests): medians of repeated runs, synchronised on
accelerators."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def synchronize(device: torch.device | str | None) -> None:
    """Wait for the work queued on ``device`` (CUDA, NPU); nothing to wait for on a CPU or None."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type == "cpu":
        return
    module = getattr(torch, device.type, None)
    if module is not None and hasattr(module, "synchronize"):
        module.synchronize(device)


def median_seconds(
    fn: Callable[[], object],
    *,
    repeats: int = 7,
    warmup: int = 2,
    device: torch.device | str | None = None,
    min_time: float = 0.0,
) -> float:
    """Median wall time of ``fn()`` over ``repeats`` (>= 1) samples after ``warmup`` (>= 0) calls.

    Each sample loops ``fn`` until at least ``min_time`` seconds have passed (for sub-millisecond calls)
    and counts the time per call. ValueError for repeats < 1, warmup < 0 or a negative min_time.
    """
    if repeats < 1 or warmup < 0 or not min_time >= 0:
        raise ValueError(f"need repeats >= 1, warmup >= 0, min_time >= 0; got {repeats}, {warmup}, {min_time}")
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        calls = 0
        start = time.perf_counter()
        while True:
            fn()
            calls += 1
            synchronize(device)
            elapsed = time.perf_counter() - start
            if elapsed >= min_time:
                break
        samples.append(elapsed / calls)
    return statistics.median(samples)


def gbps(nbytes: int, seconds: float) -> float:
    """Bytes moved (read + written) per second, in GB/s (1e9)."""
    return nbytes / seconds / 1e9
