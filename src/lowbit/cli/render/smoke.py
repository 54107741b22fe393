"""Human views of ``lowbit smoke`` and ``lowbit info``: one row per operator, the verdict last.

The smoke report is the dict ``lowbit smoke --json`` prints (docs/smoke_report.schema.json): one operator
(``op`` with ``results`` or ``error``) or all of them (``ops``). The table has one line per operator; each
operator not verified gets one explanation below it (at most 2 lines at 80 columns), so a view of
``smoke all`` stays under 25 lines whatever the messages.
"""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from lowbit.cli.render import STYLE, shorten, verdict
from lowbit.cli.smoke._common import required_contracts

WHY_LIMIT = 140  # characters of an explanation below the table: at most 2 lines at 80 columns
CASE_LABEL_KEYS = ("input_dtype", "operator", "api", "template", "qdim", "shape_bsnkr", "x_shape")  # tells cases apart


def _case_label(result: dict) -> str:
    parts = [str(result[k]) if k == "input_dtype" else f"{k}={result[k]}" for k in CASE_LABEL_KEYS if k in result]
    return ", ".join(parts)


def operator_status(op_report: dict) -> tuple[str, str, str]:
    """(status, why, tone) of one operator's smoke report; status is 'verified', 'not verified',
    'BROKEN' or 'ERROR'; ``why`` says what failed or what kept the path from being verified."""
    if "error" in op_report:
        return "ERROR", op_report["error"], "bad"
    results = op_report["results"]
    broken = {}
    for result in results:
        for name in required_contracts(result):
            if not result.get(name, False):
                broken.setdefault(name, []).append(result)
    if broken:
        parts = [f"{name} failed in {len(cases)} of {len(results)} cases (first: {_case_label(cases[0])})"
                 for name, cases in broken.items()]
        return "BROKEN", "; ".join(parts), "bad"
    if op_report["hardware_path_verified"]:
        return "verified", "native kernel, bit-exact with the reference", "ok"
    reasons = []
    ran = sorted({r["backend"] for r in results} - {"native"})
    if ran:
        reasons.append(f"ran on the {', '.join(ran)} backend, not a native kernel")
    warnings = max(r.get("warning_count", 0) for r in results)
    if warnings:
        reasons.append(f"{warnings} warning(s) during the check")
    if not reasons:
        reasons.append("the device's path cannot be verified here (e.g. Triton's interpreter on a GPU)")
    return "not verified", "contracts hold; " + "; ".join(reasons), "warn"


def contract_counts(op_report: dict) -> tuple[int, int]:
    """(held, required) over every case and contract of one operator; (0, 0) when it did not run."""
    pairs = [bool(r.get(k, False)) for r in op_report.get("results", []) for k in required_contracts(r)]
    return sum(pairs), len(pairs)


def environment_line(report: dict) -> Text:
    """One line: the lowbit and torch versions, the device and its name, the requested backend."""
    env = report.get("environment", {})
    device = env.get("device", "?")
    threads = f", {env['cpu_threads']} threads" if device == "cpu" and env.get("cpu_threads") else ""
    parts = [f"lowbit {env.get('lowbit')}", f"torch {env.get('torch')}", f"{device}: {env.get('device_name')}{threads}",
             f"backend {report.get('requested_backend')}"]
    return Text(" · ".join(parts), style=STYLE["dim"])


def smoke_view(report: dict, exit_code: int) -> Group:
    """The human view of a smoke report (one operator or all) and its exit code (0 / 1 broken / 2 cannot run).
    The error object of a check that could not start is not a report: the command prints it as an error."""
    ops = report["ops"] if "ops" in report else [report]
    device = report.get("environment", {}).get("device", "?")
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for name in ("operator", "backend", "device", "contracts", "result"):
        table.add_column(name, no_wrap=True, overflow="ellipsis")
    statuses, details = {}, []
    for op in ops:
        status, why, tone = statuses[op["op"]] = operator_status(op)
        backends = sorted({r["backend"] for r in op.get("results", [])}) or ["-"]
        held, required = contract_counts(op)
        counts = f"{held}/{required}" if required else "-"
        table.add_row(op["op"], "/".join(backends), device, counts, Text(status, style=STYLE[tone]))
        if status != "verified":
            details.append(Text(f"{op['op']}: {shorten(why, WHY_LIMIT)}", style=STYLE["dim"] if tone == "warn" else ""))
    return Group(environment_line(report), table, *details, _smoke_verdict(statuses, exit_code, report))


def _smoke_verdict(statuses: dict, exit_code: int, report: dict) -> Text:
    def names(wanted: set[str]) -> list[str]:
        return [op for op, (status, _, _) in statuses.items() if status in wanted]

    env = report.get("environment", {})
    where = f"{env.get('device', '?')} ({env.get('device_name')})"
    subject = f"all {len(statuses)} operators" if len(statuses) > 1 else next(iter(statuses))
    if exit_code == 2:
        broken = names({"BROKEN"})
        also = f"; {', '.join(broken)} broke a contract" if broken else ""
        return verdict(f"CANNOT RUN: {', '.join(names({'ERROR'}))} could not be checked on {where}{also} (exit 2)",
                       "bad")
    if exit_code == 1:
        failed = names({"BROKEN", "ERROR"})
        return verdict(f"FAILED: {', '.join(failed)} broke a contract on {where} (exit 1)", "bad")
    unverified = names({"not verified"})
    if unverified:
        return verdict(f"CONTRACTS HOLD, but the hardware path of {', '.join(unverified)} is not verified on "
                       f"{where}", "warn")
    return verdict(f"VERIFIED: {subject} met every contract with native kernels on {where}", "ok")


def info_view(report: dict) -> Group:
    """The human view of ``lowbit info``: which backend serves each operator on each device, and why."""
    devices = report["devices"]
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("operator", no_wrap=True)
    for device in devices:
        table.add_column(f"{device} ({report['requested_backend']})", overflow="fold")
    for name, per_device in sorted(report["operators"].items()):
        cells = []
        for device in devices:
            entry = per_device[device]
            backend = entry["backend"] or "unavailable"
            cell = Text(backend, style=STYLE["ok"] if backend == "native" else STYLE["warn"])
            if entry.get("why"):
                why = entry["why"].replace(f"{name}: ", "")  # the row names the operator already
                cell.append(f": {shorten(why, WHY_LIMIT)}", style="")
            cells.append(cell)
        table.add_row(name, *cells)
    summary, all_native = [], True
    for device in devices:
        chosen = {name: per_device[device]["backend"] or "unavailable"
                  for name, per_device in sorted(report["operators"].items())}
        others = {}
        for name, backend in chosen.items():
            if backend != "native":
                others.setdefault(backend, []).append(name)
        native = len(chosen) - sum(map(len, others.values()))
        summary.append(f"native kernels for {native} of {len(chosen)} operators on {device}"
                       + "".join(f"; {backend}: {', '.join(names)}" for backend, names in others.items()))
        all_native = all_native and not others
    header = environment_line(report)
    header.append(f" · process default {report['default_backend']}")
    line = f"backend {report['requested_backend']}: " + " | ".join(summary)
    return Group(header, table, verdict(line, "ok" if all_native else "warn"))
