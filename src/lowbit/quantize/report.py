"""What quantize / convert did to each layer: :class:`QuantizeReport` (printable, JSON-able)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass(frozen=True)
class LayerReport:
    """One candidate layer. ``status``: "quantized", "calibrating", "converted" or "skipped" (then ``reason``
    says why). ``format``: e.g. "hifloat8 w tensor / hifloat8 a tensor (ofmr)". Bytes: weight storage before
    and after (after: packed elements + every scale; None until converted; a skipped layer's weight is
    unchanged). The report's totals count the quantized layers only."""

    name: str
    layer_type: str
    status: str
    format: str = ""
    reason: str = ""
    bytes_before: int = 0
    bytes_after: Optional[int] = None


@dataclass
class QuantizeReport:
    """Per-layer outcome of :func:`lowbit.quantize`, :func:`lowbit.convert` or :func:`lowbit.quantize_`.

    ``layers`` maps the layer name (``named_modules`` path) to its :class:`LayerReport`; ``print(report)``
    gives a table, :meth:`to_dict` a JSON-able dict."""

    stage: str
    scheme: str = ""
    amct_compat: bool = False
    layers: dict[str, LayerReport] = field(default_factory=dict)

    def add(self, layer: LayerReport) -> None:
        self.layers[layer.name] = layer

    @property
    def quantized(self) -> list[str]:
        return [n for n, l in self.layers.items() if l.status != "skipped"]

    @property
    def skipped(self) -> dict[str, str]:
        return {n: l.reason for n, l in self.layers.items() if l.status == "skipped"}

    @property
    def bytes_before(self) -> int:
        return sum(l.bytes_before for l in self.layers.values() if l.status != "skipped")

    @property
    def bytes_after(self) -> Optional[int]:
        sizes = [l.bytes_after for l in self.layers.values() if l.status != "skipped"]
        return None if any(s is None for s in sizes) else sum(sizes)

    def to_dict(self) -> dict:
        return {
            "stage": self.stage, "scheme": self.scheme, "amct_compat": self.amct_compat,
            "layers": {n: asdict(l) for n, l in self.layers.items()},
            "totals": {"quantized": len(self.quantized), "skipped": len(self.skipped),
                       "bytes_before": self.bytes_before, "bytes_after": self.bytes_after},
        }

    def __str__(self) -> str:
        head = ("layer", "type", "status", "format / reason", "bytes before", "bytes after")
        rows = [(l.name, l.layer_type, l.status, l.reason if l.status == "skipped" else l.format,
                 str(l.bytes_before), "" if l.bytes_after is None else str(l.bytes_after))
                for l in self.layers.values()]
        after = self.bytes_after
        rows.append(("total", "", f"{len(self.quantized)} quantized, {len(self.skipped)} skipped", "",
                     str(self.bytes_before), "" if after is None else str(after)))
        widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
        lines = [f"{self.stage} ({self.scheme or 'custom config'}{', amct_compat' if self.amct_compat else ''})"]
        for r in [head] + rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        return "\n".join(lines)
