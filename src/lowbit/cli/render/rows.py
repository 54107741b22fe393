"""Human views of row reports: ``lowbit bench`` (timings), ``lowbit eval`` (accuracy per scheme) and
``lowbit wqbmm profile`` (time per template and backend).

Rows are the dicts the commands print as JSON (a list of flat dicts; bench rows start with ``op``).
Non-finite floats may appear as None (JSON null) or as float('inf'/'nan').
"""

from __future__ import annotations

import math

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from lowbit.cli.render import human_bytes, verdict

EVAL_DIGITS = {"mean_cosine": 6, "nn_agreement": 3, "sqnr_db": 2, "perplexity": 4}  # bits_per_weight: 4.125
EVAL_HEADERS = {"bits_per_weight": "bits/w", "layers_quantized": "layers", "layers_skipped": "skipped",
                "mean_cosine": "cosine", "nn_agreement": "NN agree", "sqnr_db": "SQNR dB",
                "weight_bytes": "weights", "checkpoint_bytes": "checkpoint"}


def _columns(rows: list[dict], skip: tuple[str, ...] = ()) -> list[str]:
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys and k not in skip]
    return keys


def cell(value, digits: int | None = None) -> str:
    """A table cell: floats to ``digits`` decimals, else 4 significant digits; None as '-'. (Columns named
    ``*_bytes`` go through :func:`lowbit.cli.render.human_bytes` instead.)"""
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.{digits}f}" if digits is not None else f"{value:.4g}"
    return str(value)


def rows_table(rows: list[dict], skip: tuple[str, ...] = (), digits: dict[str, int] | None = None,
               headers: dict[str, str] | None = None) -> Table:
    """The rows as one table (columns: the union of their keys, in order, less ``skip``, titled by
    ``headers`` where given); numbers right-aligned, floats as :func:`cell` with ``digits`` per column. On a
    narrow terminal text cells are cut with an ellipsis and headers wrap; numbers are never cut."""
    digits, headers = digits or {}, headers or {}
    keys = _columns(rows, skip)
    cells = [[human_bytes(row.get(k)) if k.endswith("_bytes") else cell(row.get(k), digits.get(k)) for k in keys]
             for row in rows]
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for i, key in enumerate(keys):
        numeric = all(isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
                      for r in rows if r.get(key) is not None)
        title = headers.get(key, key)
        if numeric:  # as wide as its widest number and its title's longest word
            widest = max([len(c[i]) for c in cells] + [len(word) for word in title.split()])
            table.add_column(title, justify="right", overflow="fold", min_width=widest)
        else:
            table.add_column(title, no_wrap=True, overflow="ellipsis")
    for row_cells in cells:
        table.add_row(*row_cells)
    return table


def ratio_columns(rows: list[dict]) -> list[str]:
    """The columns comparing a row with its case's baseline (``x memcpy``, ``speedup vs F.linear``, ...)."""
    return [k for k in _columns(rows) if k.startswith("x ") or k.startswith("speedup")]


def bench_view(rows: list[dict], device: str | None = None) -> Group:
    """The human view of ``lowbit bench`` rows: one table per operator, then the verdict."""
    if not rows:
        return Group(verdict("no benchmark rows (nothing was timed)", "warn"))
    ops = list(dict.fromkeys(r.get("op", "") for r in rows))
    parts = []
    for op in ops:
        mine = [r for r in rows if r.get("op", "") == op]
        parts += [Text(f"{op}" if op else "bench", style="bold"), rows_table(mine, skip=("op",)), Text("")]
    ratios = ", ".join(f"'{k}'" for k in ratio_columns(rows)) or "ratio columns"
    where = f" on {device}" if device else ""
    line = (f"timed {len(ops)} operator{'s' if len(ops) != 1 else ''} ({len(rows)} rows){where}; "
            f"{ratios}: each row against the first row of its case, timed in the same run")
    return Group(*parts, verdict(line, "ok"))


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def eval_verdict(rows: list[dict]) -> Text:
    """Which scheme stays closest to the float model, and what the fewest bits cost."""
    if rows and "perplexity" in rows[0]:
        base = rows[0] if rows[0]["scheme"] == "float32" else None
        scored = [r for r in rows if r is not base and _finite(r.get("perplexity"))]
        if not scored:
            return verdict("no scheme has a finite perplexity", "bad")
        best = min(scored, key=lambda r: r["perplexity"])
        ref = f"float32 perplexity {base['perplexity']:.4f}; " if base and _finite(base["perplexity"]) else ""
        return verdict(f"{ref}best quantized: {best['scheme']} (perplexity {best['perplexity']:.4f} at "
                       f"{best['bits_per_weight']:g} bits per weight)", "ok")
    scored = [r for r in rows if _finite(r.get("sqnr_db"))]
    if not scored:
        return verdict("no scheme has a finite SQNR", "bad" if rows else "warn")

    def describe(r):
        return f"{r['scheme']} ({r['sqnr_db']:.2f} dB SQNR, {r['bits_per_weight']:g} bits per weight)"

    best = max(scored, key=lambda r: r["sqnr_db"])
    fewest = min(scored, key=lambda r: (r["bits_per_weight"], -r["sqnr_db"]))
    line = f"closest to float: {describe(best)}"
    if fewest is not best:
        line += f"; fewest bits: {describe(fewest)}"
    return verdict(line, "ok")


def eval_view(rows: list[dict]) -> Group:
    """The human view of ``lowbit eval`` rows: the table (metrics to fixed decimals), then the verdict."""
    if not rows:
        return Group(verdict("no schemes evaluated", "warn"))
    return Group(rows_table(rows, skip=("nonfinite_outputs",), digits=EVAL_DIGITS, headers=EVAL_HEADERS),
                 eval_verdict(rows))  # (non-finite outputs show as nan metrics)


def profile_view(rows: list[dict]) -> Group:
    """The human view of ``lowbit wqbmm profile`` rows (template, backend, us, trace): the table, then the
    fastest template and backend."""
    if not rows:
        return Group(verdict("nothing was profiled (every template / backend was skipped)", "warn"))
    fastest = min(rows, key=lambda r: r["us"])
    line = f"fastest: {fastest['template']} on {fastest['backend']}, {fastest['us']:.1f} us (median)"
    return Group(rows_table(rows, digits={"us": 1}), verdict(line, "ok"))
