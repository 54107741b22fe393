"""``lowbit smoke``: does each operator's hardware path really work here? A report + exit code.

Exit codes (upstream contract, docs/cli.md): 0 every contract holds; 1 a contract is broken; 2 the check
cannot run (device missing, backend unavailable, import failure, bad arguments). The report (this module's
:func:`run`; docs/smoke_report.schema.json) goes to stdout, as JSON with ``--json`` or as the human view
(lowbit.cli.render.smoke); on exit 2 with ``--json`` an error object ``{"error", "hardware_path_verified":
false, "requested_backend"}`` goes to stderr as one line of JSON.
"""

from __future__ import annotations

import sys
import traceback
import warnings
from types import ModuleType
from typing import Callable, Iterable

import torch

from lowbit.backends import BackendUnavailable, Operator
from lowbit.cli._discover import operator_modules
from lowbit.cli.devices import resolve_device
from lowbit.cli.smoke import _common
from lowbit.cli.smoke._common import environment  # noqa: F401  (public: also `lowbit info`'s record)

EXIT_OK, EXIT_CONTRACT_BROKEN, EXIT_CANNOT_RUN = 0, 1, 2

# Errors that mean "cannot run here"; any other exception from a check means the path ran and broke.
CANNOT_RUN_ERRORS = (BackendUnavailable, ImportError, OSError)


def checks() -> dict[str, ModuleType]:
    """Smoke modules by operator name, discovered in this package (modules not starting with '_')."""
    return operator_modules(__name__, __path__)


def error_report(backend: str | None, error: str) -> dict:
    """The error object of a check that cannot run (exit 2)."""
    return {"requested_backend": backend, "hardware_path_verified": False, "error": error}


def run_one(module: ModuleType, backend: str, device: torch.device, debug: bool = False) -> tuple[dict, int]:
    """Run one operator's check; returns (report without environment, exit code).

    Warnings raised during the check are counted into every result's ``warning_count`` (any warning
    means the path is not verified, as upstream). An exception other than CANNOT_RUN_ERRORS is a broken
    contract (exit 1), reported with its message. ``debug``: an exception's traceback also goes to stderr.
    """
    try:
        with torch.inference_mode(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = module.run(backend, device)
    except Exception as exc:  # reported, never raised (the report is the contract)
        if debug:
            traceback.print_exc(file=sys.stderr)
        code = EXIT_CANNOT_RUN if isinstance(exc, CANNOT_RUN_ERRORS) else EXIT_CONTRACT_BROKEN
        return {"op": module.NAME, "hardware_path_verified": False, "error": f"{type(exc).__name__}: {exc}"}, code
    for result in results:
        result["warning_count"] = len(caught)
    report = {
        "op": module.NAME,
        "hardware_path_verified": _common.hardware_path_verified(results, device),
        "results": results,
    }
    return report, EXIT_OK if _common.contracts_hold(results) else EXIT_CONTRACT_BROKEN


def warm_cpu_kernels(ops: Iterable[Operator], on_compile: Callable[[], object] | None = None) -> None:
    """Compile the cold CPU kernel families of operators ``ops`` in parallel processes before their first
    use (lowbit.kernels.cpu.warm; ``on_compile()`` as they start: nothing that starts a thread may run
    before it, as the compiling processes are forked). Without numba nothing happens here: each operator
    reports its missing backend itself."""
    try:
        from lowbit.kernels.cpu.warm import warm_cache
    except (ImportError, OSError):
        return
    warm_cache(ops, on_start=on_compile)


def run(op: str, backend: str, device_name: str, on_check: Callable[[str], object] | None = None,
        debug: bool = False, on_compile: Callable[[], object] | None = None) -> tuple[dict, int]:
    """Run ``op`` (or 'all') and build the report; returns (report, exit code).

    The report always has ``requested_backend`` and ``hardware_path_verified``; on success also
    ``environment`` and ``results`` (one op) or ``ops`` (all); when the check cannot run, ``error``.
    ``on_check(name)``, if given, is called as each operator's check starts (progress); ``on_compile()`` as
    the cold CPU kernels of the operators the checks call start compiling in parallel before the checks
    (:func:`warm_cpu_kernels`). ``debug``: the traceback of each error also goes to stderr.
    """
    available = checks()
    if op != "all" and op not in available:
        raise ValueError(f"unknown operator {op!r}; expected one of: all, {', '.join(available)}")
    try:
        device = resolve_device(device_name)
    except (BackendUnavailable, RuntimeError, ValueError) as exc:
        if debug:
            traceback.print_exc(file=sys.stderr)
        return error_report(backend, str(exc)), EXIT_CANNOT_RUN
    selected = list(available.values()) if op == "all" else [available[op]]
    if op == "all" and device.type == "cpu" and backend != "reference":  # operators no check calls: on first use
        warm_cpu_kernels(dict.fromkeys(called for module in selected for called in module.OPERATORS), on_compile)
    outcomes = []
    for module in selected:
        if on_check is not None:
            on_check(module.NAME)
        outcomes.append(run_one(module, backend, device, debug))
    reports, codes = zip(*outcomes)
    report = {
        "requested_backend": backend,
        "hardware_path_verified": all(r["hardware_path_verified"] for r in reports),
        "environment": _common.environment(device),
    }
    if op == "all":
        report["ops"] = list(reports)
    else:
        report.update({k: v for k, v in reports[0].items() if k != "hardware_path_verified"})
    return report, max(codes)
