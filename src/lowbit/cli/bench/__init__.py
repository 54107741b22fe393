"""``lowbit bench``: throughput and latency against baselines measured in the same run.

Each operator's module (``lowbit/cli/bench/<op>.py``) defines ``NAME``, ``run(args) -> list[dict]``
and optionally ``add_arguments(parser)``; rows are printed as a table or JSON.
"""

from __future__ import annotations

import json
import math
from types import ModuleType

from lowbit.cli._discover import operator_modules


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
