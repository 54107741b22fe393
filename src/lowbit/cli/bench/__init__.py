"""``lowbit bench``: throughput and latency against baselines measured in the same run.

Each operator's module (``lowbit/cli/bench/<op>.py``) defines ``NAME``, ``run(args) -> list[dict]``
and optionally ``add_arguments(parser)`` (validating its options with lowbit.cli.argtypes); ``args.device``
is a device that exists here (lowbit.cli.devices) and ``args.repeats`` >= 1. Rows, built with
:class:`CaseTimer`, are printed as a table or JSON.
"""

from __future__ import annotations

import json
import math
from types import ModuleType
from typing import Callable

import torch

from lowbit.cli._discover import operator_modules
from lowbit.toolchain.timing import gbps, median_seconds


def benches() -> dict[str, ModuleType]:
    """Benchmark modules by operator name, discovered in this package (modules not starting with '_')."""
    return operator_modules(__name__, __path__)


def to_json(rows: list[dict]) -> str:
    """Rows as strict JSON: non-finite floats (an infinite SQNR, say) become null."""

    def clean(v):
        return None if isinstance(v, float) and not math.isfinite(v) else v

    return json.dumps([{k: clean(v) for k, v in row.items()} for row in rows], indent=2, allow_nan=False)


def format_table(rows: list[dict]) -> str:
    """Rows (dicts with the same keys, in order) as an aligned text table; floats to 4 significant digits."""
    if not rows:
        return "(no rows)"
    keys = list(rows[0])
    for row in rows[1:]:
        keys += [k for k in row if k not in keys]

    def cell(v) -> str:
        return f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v))

    table = [keys] + [[cell(row.get(k)) for k in keys] for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(keys))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


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
