"""The ``lowbit`` command: info, smoke, bench, eval, and the WeightQuantBatchMatmul tool chain (wqbmm, verify)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from lowbit import backends
from lowbit.cli import bench as bench_pkg
from lowbit.cli import evaluate as evaluate_cli
from lowbit.cli import quantize as quantize_cli
from lowbit.cli import smoke as smoke_pkg
from lowbit.cli import wqbmm as wqbmm_cli

BACKEND_CHOICES = list(backends.BACKENDS)


def _cmd_info(args: argparse.Namespace) -> int:
    """Versions, devices, and which backend serves each operator on each present device."""
    import lowbit  # noqa: F401  (registers every operator's dispatcher)
    from lowbit.cli.smoke._common import environment

    devices = [torch.device("cpu")]
    devices += [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]
    smoke_pkg.checks()  # imports every operator module
    ops = {}
    for name, dispatcher in sorted(backends.dispatchers().items()):
        per_device = {}
        for device in devices:
            try:
                chosen = dispatcher.resolve(device, args.backend)
                entry = {"backend": chosen}
                if args.backend == "auto" and chosen == "reference":
                    entry["why"] = dispatcher.auto_check_error(device) or "no native kernel"
            except backends.BackendUnavailable as exc:
                entry = {"backend": None, "why": str(exc)}
            per_device[str(device)] = entry
        ops[name] = per_device
    report = {
        "environment": environment(devices[-1]),
        "default_backend": backends.get_backend(),
        "requested_backend": args.backend,
        "devices": [str(d) for d in devices],
        "operators": ops,
    }
    print(json.dumps(report, indent=2, sort_keys=True))
    return 0


def _cmd_smoke(args: argparse.Namespace) -> int:
    try:
        report, code = smoke_pkg.run(args.op, args.backend, args.device)
    except ValueError as exc:
        report, code = {"requested_backend": args.backend, "hardware_path_verified": False,
                        "error": str(exc)}, smoke_pkg.EXIT_CANNOT_RUN
    if "error" in report and "results" not in report and "ops" not in report:
        print(json.dumps(report, indent=2, sort_keys=True, allow_nan=False), file=sys.stderr)
        return code
    print(json.dumps(report, indent=2, sort_keys=True, allow_nan=False))
    if code == smoke_pkg.EXIT_CANNOT_RUN:
        errors = [f"{r['op']}: {r['error']}" for r in report.get("ops", [report]) if "error" in r]
        error = {"requested_backend": args.backend, "hardware_path_verified": False, "error": "; ".join(errors)}
        print(json.dumps(error, indent=2, sort_keys=True), file=sys.stderr)
    return code


def _add_bench_arguments(parser: argparse.ArgumentParser, module) -> None:
    parser.add_argument("--backend", choices=BACKEND_CHOICES, default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=7, help="timed samples per case (median reported)")
    parser.add_argument("--json", action="store_true", help="print rows as JSON")
    if module is not None and hasattr(module, "add_arguments"):
        module.add_arguments(parser)


def _module_args(args: argparse.Namespace, module) -> argparse.Namespace:
    """For ``bench all``: the module's own defaults plus the common options given on the command line."""
    parser = argparse.ArgumentParser()
    _add_bench_arguments(parser, module)
    own = parser.parse_args([])
    for key in ("backend", "device", "repeats", "json"):
        setattr(own, key, getattr(args, key))
    return own


def _cmd_bench(args: argparse.Namespace) -> int:
    rows = []
    for name, module in args.bench_modules:
        module_args = _module_args(args, module) if args.op == "all" else args
        for row in module.run(module_args):
            rows.append({"op": name, **row})
    if args.json:
        print(bench_pkg.to_json(rows))
    else:
        print(bench_pkg.format_table(rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lowbit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="versions, devices and the backend serving each operator")
    info.add_argument("--backend", choices=BACKEND_CHOICES, default=backends.get_backend())
    info.set_defaults(func=_cmd_info)

    checks = smoke_pkg.checks()
    smoke = sub.add_parser("smoke", help="JSON verdict on whether each operator's hardware path works")
    smoke.add_argument("op", nargs="?", default="all", choices=["all", *checks], help="operator (default: all)")
    smoke.add_argument("--backend", choices=BACKEND_CHOICES, default="auto")
    smoke.add_argument("--device", default="auto", help="cpu, cuda:N, npu:N or auto (default)")
    smoke.set_defaults(func=_cmd_smoke)

    bench = sub.add_parser("bench", help="throughput against baselines measured in the same run")
    bench_sub = bench.add_subparsers(dest="op", required=True)
    modules = bench_pkg.benches()
    for name, module in [("all", None), *modules.items()]:
        p = bench_sub.add_parser(name, help=f"benchmark {name}")
        _add_bench_arguments(p, module)
        selected = list(modules.items()) if module is None else [(name, module)]
        p.set_defaults(func=_cmd_bench, bench_modules=selected)

    wqbmm_cli.add_subcommands(sub)  # wqbmm gen-data|run|profile|example, verify
    evaluate_cli.add_subcommand(sub)  # eval
    quantize_cli.add_subcommand(sub)  # quantize
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # output piped into e.g. `head`: stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
