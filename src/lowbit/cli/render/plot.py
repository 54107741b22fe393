"""PNG charts of ``lowbit bench`` rows (matplotlib: the optional ``plot`` extra, imported only here).

One panel per operator; in it, one group of bars per case (size, dtype, M or shape: the row's values
that are not measurements) and one bar per timed row: the lowbit paths beside the baseline (memcpy, dense
F.linear, the reference) and the peers (torch's float8 casts, the int4pack kernel) timed in the same run,
each labelled with its ratio to the case's baseline (``x memcpy``, ``speedup vs F.linear``, ...).
"""

from __future__ import annotations

from lowbit.cli.render.rows import ratio_columns
from lowbit.evaluation.plot import pyplot, titled_png

THROUGHPUT_KEYS = ("GB/s", "GFLOP/s")  # higher is better; without one of them a panel plots ``ms``


def case_of(row: dict) -> str:
    """The case a bench row belongs to: its values that are not measurements ('64M float16', 'M=16')."""
    keys = [k for k, v in row.items() if k not in ("op", "what") and not isinstance(v, float)]
    return " ".join(str(row[k]) if k in ("size", "dtype") else f"{k}={row[k]}" for k in keys)


def metric_of(rows: list[dict]) -> str:
    """The measurement a panel plots: the first of :data:`THROUGHPUT_KEYS` every row has, else 'ms'."""
    return next((k for k in THROUGHPUT_KEYS if all(isinstance(r.get(k), float) for r in rows)), "ms")


def bench_plot(rows: list[dict], title: str) -> bytes:
    """A PNG of bench rows (``op``, ``what``, ``ms``, ...), one horizontal-bar panel per operator.

    ValueError if there are no rows; ImportError (one line) without matplotlib.
    """
    if not rows:
        raise ValueError("no benchmark rows to plot")
    plt = pyplot()
    ops = list(dict.fromkeys(r.get("op", "bench") for r in rows))
    per_op = {op: [r for r in rows if r.get("op", "bench") == op] for op in ops}
    heights = [0.32 * len(per_op[op]) + 1.2 for op in ops]
    fig, axes = plt.subplots(len(ops), 1, figsize=(10, sum(heights)), gridspec_kw={"height_ratios": heights},
                             squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, op in zip(axes[:, 0], ops):
        mine, metric = per_op[op], metric_of(per_op[op])
        cases = list(dict.fromkeys(case_of(r) for r in mine))
        ratios = ratio_columns(mine)
        labels, values, notes, bar_colours = [], [], [], []
        for i, case in enumerate(cases):
            for r in (r for r in mine if case_of(r) == case):
                labels.append(f"{r['what']}  [{case}]" if case else r["what"])
                values.append(r[metric])
                notes.append(", ".join(f"{r[k]:.3g} {k}" for k in ratios if isinstance(r.get(k), float)))
                bar_colours.append(colours[i % len(colours)])
        positions = range(len(values))
        ax.barh(positions, values, color=bar_colours)
        for y, value, note in zip(positions, values, notes):
            ax.annotate(f" {note}", (value, y), va="center", fontsize=7)
        ax.set_xlim(0, max(values) * 1.3)  # room for the ratio labels
        ax.set_yticks(list(positions), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(f"{metric} ({'higher' if metric != 'ms' else 'lower'} is better)")
        ax.set_title(op, loc="left", fontsize=10, fontweight="bold")
        ax.grid(alpha=0.3, axis="x")
    return titled_png(fig, title, dpi=100)
