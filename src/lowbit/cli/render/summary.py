"""Human views of one-object reports: ``lowbit verify`` (the verifier's verdict), ``lowbit wqbmm example``
and ``lowbit quantize``.

``verify_view`` takes ``dataclasses.asdict`` of lowbit.toolchain.verify.VerifyResult (``size``,
``mismatches``, ``errors``, ``error_ratio``, ``passed``, ``first``: [index, expected, actual, rdiff] rows)
plus, optionally, ``error_tol``. ``quantize_view`` takes the summary dict ``lowbit quantize --json``
prints: ``model``, ``model_kind``, ``scheme`` or ``config``, ``amct_compat``, ``layers_quantized`` (names),
``layers_skipped`` (name -> reason), ``weight_bytes_before`` / ``weight_bytes_after`` (the quantized
layers' weights; after may be None), ``model_bytes`` (float, in memory), ``checkpoint_bytes``,
``seconds`` (stage -> seconds) and ``checkpoint`` (the directory written).
"""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.table import Table

from lowbit.cli.render import human_bytes, shorten, verdict

SHOWN_MISMATCHES = 10  # the human view lists this many (--json and --sample: the first 101, as the sample)


def _key_values(pairs: list[tuple[str, str]]) -> Table:
    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column("key", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    for key, value in pairs:
        table.add_row(key, value)
    return table


def verify_view(result: dict) -> Group:
    """The first mismatches, the totals, and PASS / FAIL as the last line."""
    parts = []
    first = result.get("first", [])[:SHOWN_MISMATCHES]
    if first:
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                      title=f"first {len(first)} of {result['mismatches']} mismatches", title_justify="left")
        for name in ("index", "expected", "actual", "rdiff"):
            table.add_column(name, justify="right")
        for index, expected, actual, rdiff in first:
            table.add_row(str(index), f"{expected:-.9f}", f"{actual:-.9f}", f"{rdiff:.6f}")
        parts.append(table)
    tol = f" (tolerance {result['error_tol']:g})" if "error_tol" in result else ""
    totals = (f"{result['errors']} errors and {result['mismatches']} mismatches in {result['size']} elements, "
              f"error ratio {result['error_ratio']:.6f}{tol}")
    if result["passed"]:
        return Group(*parts, verdict(f"PASS: {totals}", "ok"))
    return Group(*parts, verdict(f"FAIL: {totals} (exit 1)", "bad"))


def quantize_view(summary: dict) -> Group:
    """What was quantized and skipped (and why), the bytes before / after, the time per stage, the verdict."""
    how = summary.get("scheme") or f"config {summary.get('config')}"
    if summary.get("amct_compat"):
        how += " (amct_compat)"
    skipped = summary.get("layers_skipped", {})
    pairs = [
        ("model", f"{summary['model']} ({summary['model_kind']})"),
        ("scheme", how),
        ("layers", f"{len(summary['layers_quantized'])} quantized, {len(skipped)} skipped"),
        ("quantized weights",
         f"{human_bytes(summary['weight_bytes_before'])} -> {human_bytes(summary['weight_bytes_after'])}"),
        ("whole model",
         f"{human_bytes(summary['model_bytes'])} in memory -> {human_bytes(summary['checkpoint_bytes'])} checkpoint"),
        ("time", ", ".join(f"{stage} {seconds:.2f} s" for stage, seconds in summary["seconds"].items())),
    ]
    pairs += [(f"skipped {name}", shorten(reason, 120)) for name, reason in skipped.items()]
    line = (f"quantized {len(summary['layers_quantized'])} layers of {summary['model']} with {how}: "
            f"checkpoint {summary['checkpoint']} ({human_bytes(summary['checkpoint_bytes'])})")
    return Group(_key_values(pairs), verdict(line, "ok"))


def example_view(report: dict) -> Group:
    """The human view of ``lowbit wqbmm example``'s report (``meta``, ``verify``: template -> verify result,
    ``profile``: rows, ``passed``): one row per template, then PASS / FAIL."""
    meta = report["meta"]
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  title=f"M={meta['m']} N={meta['n']} K={meta['k']} G={meta['group_size']} {meta['dtype']} "
                        f"seed={meta['seed']}", title_justify="left")
    for name, justify in (("template", "left"), ("verify", "left"), ("errors", "right"), ("mismatches", "right"),
                          ("backend", "left"), ("us", "right")):
        table.add_column(name, justify=justify)
    timing = {r["template"]: r for r in report["profile"]}
    for template, result in report["verify"].items():
        row = timing.get(template, {})
        table.add_row(template, "pass" if result["passed"] else "FAIL", str(result["errors"]),
                      str(result["mismatches"]), row.get("backend", "-"),
                      f"{row['us']:.1f}" if "us" in row else "-")
    failed = [t for t, r in report["verify"].items() if not r["passed"]]
    if failed:
        return Group(table, verdict(f"FAIL: {', '.join(failed)} does not match the golden (exit 1)", "bad"))
    return Group(table, verdict(f"PASS: {', '.join(report['verify'])} match the golden", "ok"))
