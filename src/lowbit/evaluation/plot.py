"""A PNG chart of evaluation rows: accuracy against bits per weight (matplotlib, the optional ``plot`` extra)."""

from __future__ import annotations

import io
import math

from lowbit.evaluation.extras import require


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def plot_rows(rows: list[dict], title: str) -> bytes:
    """A PNG image of the rows: one horizontal bar per scheme, ordered by bits per weight (labelled and
    coloured by it), for the accuracy metric (``sqnr_db`` for embedding rows, ``perplexity`` for language
    model rows) and, beside it, ``nn_agreement`` (embedding rows only). ImportError (one line) without
    matplotlib; ValueError if no row has a finite metric."""
    require("matplotlib", "plot", "--plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ["perplexity"] if "perplexity" in rows[0] else ["sqnr_db", "nn_agreement"]
    shown = sorted((r for r in rows if _finite(r.get(metrics[0]))),
                   key=lambda r: (-r["bits_per_weight"], r["scheme"]))
    if not shown:
        raise ValueError(f"no scheme has a finite {metrics[0]} to plot")
    labels = [f"{r['scheme']} ({r['bits_per_weight']:g} b/w)" for r in shown]
    bits = [r["bits_per_weight"] for r in shown]
    colours = plt.get_cmap("viridis")([(b - min(bits)) / ((max(bits) - min(bits)) or 1) * 0.8 for b in bits])
    fig, axes = plt.subplots(1, len(metrics), figsize=(6 * len(metrics) + 1, 0.35 * len(shown) + 1.6),
                             sharey=True, squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        values = [r[metric] for r in shown]
        ax.barh(labels, values, color=colours)
        for y, v in enumerate(values):
            ax.annotate(f"{v:.3g}", (v, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
        ax.set_xlabel(_AXIS_LABELS[metric])
        ax.grid(alpha=0.3, axis="x")
        ax.set_xlim(0, max(values) * 1.12 if metric != "nn_agreement" else 1.1)
    axes[0][0].invert_yaxis()
    fig.suptitle(title)
    fig.tight_layout()
    image = io.BytesIO()
    try:
        fig.savefig(image, format="png", dpi=110)
    finally:
        plt.close(fig)
    return image.getvalue()


_AXIS_LABELS = {"sqnr_db": "embedding SQNR vs float (dB, higher is better)",
                "nn_agreement": "nearest-neighbour agreement with float",
                "perplexity": "perplexity (lower is better)"}
