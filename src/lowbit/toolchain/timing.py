"""Timing for benchmarks and profiles (never for tests): medians of repeated runs, synchronised on
accelerators."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
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


_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}  # suffixes of Linux's cache sizes


def last_level_cache_bytes(cache_dir: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """Size in bytes of the CPU's last-level cache as Linux reports it (the highest ``level`` under
    ``cache_dir``); 0 where that is not readable (another OS, a container without /sys). Benchmarks that
    stream weights cycle through more than this, so that they are read from memory as in a model."""
    sizes = {}
    for index in Path(cache_dir).glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        if size[-1:] in _SIZE_UNITS and size[:-1].isdigit():
            sizes[level] = max(sizes.get(level, 0), int(size[:-1]) * _SIZE_UNITS[size[-1]])
        elif size.isdigit():
            sizes[level] = max(sizes.get(level, 0), int(size))
    return sizes[max(sizes)] if sizes else 0
