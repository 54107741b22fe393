"""``lowbit bench``: throughput and latency against baselines measured in the same run.

Each operator's module (``lowbit/cli/bench/<op>.py``) defines ``NAME``, ``run(args) -> list[dict]``
and optionally ``add_arguments(parser)`` (validating its options with lowbit.cli.argtypes); ``args.device``
is a device that exists here (lowbit.cli.devices) and ``args.repeats`` >= 1. Rows, built with
:class:`CaseTimer`, are printed as tables (lowbit.cli.render.rows) or JSON (lowbit.cli.output).
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable

import torch

from lowbit.cli._discover import operator_modules
from lowbit.toolchain.timing import gbps, median_seconds


def benches() -> dict[str, ModuleType]:
    """Benchmark modules by operator name, discovered in this package (modules not starting with '_')."""
    return operator_modules(__name__, __path__)


class CaseTimer:
    """Times the calls of one benchmark case into table rows that start with ``keys``.

    Each row is ``{**keys, "what", "ms"}`` plus ``"GB/s"`` when the bytes moved are given; the first row
    timed is the case's baseline for :meth:`ratio_to_baseline`.
    """

    def __init__(self, device: torch.device | str, repeats: int, **keys) -> None:
        self.device, self.repeats, self.keys = device, repeats, keys
        self.rows: list[dict] = []

    def time(self, what: str, fn: Callable[[], object], nbytes: int | None = None, min_time: float = 0.05) -> float:
        """Median seconds of ``fn`` (lowbit.toolchain.timing.median_seconds); appends its row."""
        seconds = median_seconds(fn, repeats=self.repeats, device=self.device, min_time=min_time)
        row = {**self.keys, "what": what, "ms": seconds * 1e3}
        if nbytes is not None:
            row["GB/s"] = gbps(nbytes, seconds)
        self.rows.append(row)
        return seconds

    def ratio_to_baseline(self, column: str, key: str = "GB/s", higher_is_better: bool = True) -> list[dict]:
        """Add ``column`` = each row's ``key`` relative to the first row's (inverted for a time, so that
        above 1 always means better than the baseline); returns the rows."""
        base = self.rows[0][key]
        for row in self.rows:
            row[column] = row[key] / base if higher_is_better else base / row[key]
        return self.rows


def sizes_and_dtypes(args) -> list[tuple[int, str, torch.dtype]]:
    """(element count, dtype name, dtype) for every combination of ``--sizes`` and ``--dtypes``."""
    return [(n, name, getattr(torch, name)) for n in args.sizes for name in args.dtypes]


def size_label(n: int, named: dict[str, int]) -> str:
    """'1M' for 1 << 20 when ``named`` has it, else the number."""
    return next((name for name, value in named.items() if value == n), str(n))
