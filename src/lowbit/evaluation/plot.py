"""A PNG chart of evaluation rows: accuracy against bits per weight (matplotlib, the optional ``plot`` extra)."""

from __future__ import annotations

import io
import math

from lowbit.evaluation.extras import require


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend; ImportError (one line) naming the ``plot`` extra."""
    require("matplotlib", "plot", "--plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def titled_png(fig, title: str, dpi: int) -> bytes:
    """``fig`` with ``title`` above it as PNG bytes; the figure is closed."""
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout()
    image = io.BytesIO()
    try:
        fig.savefig(image, format="png", dpi=dpi)
    finally:
        plt.close(fig)
    return image.getvalue()


def plot_rows(rows: list[dict], title: str) -> bytes:
    """A PNG image of the rows: left, the accuracy metric of each scheme against its bits per
    weight (``sqnr_db`` for embedding rows, ``perplexity`` for language-model rows); right, a bar per scheme
    of ``nn_agreement`` or ``perplexity``. ImportError (one line) without matplotlib; ValueError if no row
    has a finite metric."""
    plt = pyplot()
    metric, bar_metric = ("perplexity", "perplexity") if "perplexity" in rows[0] else ("sqnr_db", "nn_agreement")
    points = [r for r in rows if _finite(r.get(metric)) and _finite(r.get("bits_per_weight"))]
    if not points:
        raise ValueError(f"no scheme has a finite {metric} to plot")
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    same_bits: dict[float, int] = {}
    for r in sorted(points, key=lambda r: -r[metric]):
        k = same_bits[r["bits_per_weight"]] = same_bits.get(r["bits_per_weight"], -1) + 1
        left.scatter(r["bits_per_weight"], r[metric], color="tab:blue")
        left.annotate(r["scheme"], (r["bits_per_weight"], r[metric]), textcoords="offset points",
                      xytext=(6, -11 * k), fontsize=8)  # labels of schemes with equal bits stacked downwards
    left.set_xlabel("bits per weight")
    left.set_ylabel({"sqnr_db": "embedding SQNR vs float (dB)", "perplexity": "perplexity"}[metric])
    left.grid(alpha=0.3)
    bars = [r for r in rows if _finite(r.get(bar_metric))]
    right.barh([r["scheme"] for r in bars], [r[bar_metric] for r in bars], color="tab:orange")
    right.invert_yaxis()
    right.set_xlabel({"nn_agreement": "nearest-neighbour agreement with float",
                      "perplexity": "perplexity"}[bar_metric])
    if bar_metric == "nn_agreement":
        right.set_xlim(0, 1)
    right.grid(alpha=0.3, axis="x")
    return titled_png(fig, title, dpi=110)
