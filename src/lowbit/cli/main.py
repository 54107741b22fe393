"""The ``lowbit`` command: info, smoke, bench, eval, quantize-checkpoint, and the WeightQuantBatchMatmul tool
chain (wqbmm, verify).

Exit codes and --debug: docs/cli.md. Every error is one line on stderr (``lowbit <command>: error: ...``;
for ``lowbit smoke`` the one-line JSON error object of its contract) and exit 2, without a traceback
unless --debug is given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Iterator

EXIT_ERROR = 2  # usage, bad input, bad files, a device or backend that cannot run here
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT
# lowbit's DtypeError / ShapeError / DeviceError / BackendUnavailable / DatasetError derive from these
EXPECTED_ERRORS = (ValueError, TypeError, OSError, RuntimeError, ImportError, MemoryError)


class UsageError(Exception):
    """A command line argparse rejected; ``prog`` is the (sub)command whose parser rejected it."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors raise UsageError (main prints one line) instead of printing
    the usage and exiting, and which remembers its subcommands (the subparsers are _Parsers too)."""

    subcommands: argparse.Action | None = None

    def add_subparsers(self, **kwargs):
        self.subcommands = super().add_subparsers(**kwargs)
        return self.subcommands

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(self.prog, message)


def _check_default_backend() -> str:
    """The process default backend; ValueError naming a bad LOWBIT_BACKEND (whether or not lowbit.backends
    already rejected it), so that the commands reading the default fail with exit 2."""
    from lowbit import backends

    name = os.environ.get("LOWBIT_BACKEND")
    if name and name not in backends.BACKENDS:
        raise ValueError(f"LOWBIT_BACKEND={name!r} is not a backend; expected one of {', '.join(backends.BACKENDS)}")
    return backends.get_backend()


def _cmd_info(args: argparse.Namespace) -> int:
    """Versions, devices, and which backend serves each operator on each present device."""
    import torch

    from lowbit import backends
    from lowbit.cli import smoke

    default = _check_default_backend()
    requested = args.backend or default
    devices = [torch.device("cpu")]
    devices += [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]
    smoke.checks()  # imports every operator module (registers its dispatcher)
    ops = {}
    for name, dispatcher in sorted(backends.dispatchers().items()):
        per_device = {}
        for device in devices:
            try:
                chosen = dispatcher.resolve(device, requested)
                entry = {"backend": chosen}
                if requested == "auto" and chosen == "reference":
                    entry["why"] = dispatcher.auto_check_error(device) or "no native kernel"
            except backends.BackendUnavailable as exc:
                entry = {"backend": None, "why": str(exc)}
            per_device[str(device)] = entry
        ops[name] = per_device
    report = {
        "environment": smoke.environment(devices[-1]),
        "default_backend": default,
        "requested_backend": requested,
        "devices": [str(d) for d in devices],
        "operators": ops,
    }
    print(json.dumps(report, indent=2, sort_keys=True))
    return 0


def _cmd_smoke(args: argparse.Namespace) -> int:
    from lowbit.cli import smoke

    _check_default_backend()  # a bad LOWBIT_BACKEND: the check cannot run (exit 2)
    report, code = smoke.run(args.op, args.backend, args.device)
    if "error" in report and "results" not in report and "ops" not in report:
        print(json.dumps(report, sort_keys=True, allow_nan=False), file=sys.stderr)
        return code
    print(json.dumps(report, indent=2, sort_keys=True, allow_nan=False))
    if code == smoke.EXIT_CANNOT_RUN:
        errors = [f"{r['op']}: {r['error']}" for r in report.get("ops", [report]) if "error" in r]
        print(json.dumps(smoke.error_report(args.backend, "; ".join(errors)), sort_keys=True), file=sys.stderr)
    return code


def _add_bench_arguments(parser: argparse.ArgumentParser, module, backend_choices: list[str]) -> None:
    from lowbit.cli.argtypes import positive_int

    parser.add_argument("--backend", choices=backend_choices, default="auto")
    parser.add_argument("--device", default="cpu", help="cpu, cuda:N, npu:N or auto (a device present here)")
    parser.add_argument("--repeats", type=positive_int, default=7, help="timed samples per case (median reported)")
    parser.add_argument("--json", action="store_true", help="print rows as JSON")
    if module is not None and hasattr(module, "add_arguments"):
        module.add_arguments(parser)


def _cmd_bench(args: argparse.Namespace) -> int:
    from lowbit.backends import BACKENDS
    from lowbit.cli import bench
    from lowbit.cli.devices import resolve_device

    args.device = str(resolve_device(args.device))  # never time a device that cannot run (meta, absent)
    rows = []
    for name, module in args.bench_modules:
        module_args = args
        if args.op == "all":  # the module's own defaults plus the common options given
            parser = _Parser(prog=f"lowbit bench {name}")
            _add_bench_arguments(parser, module, list(BACKENDS))
            module_args = parser.parse_args([])
            for key in ("backend", "device", "repeats", "json"):
                setattr(module_args, key, getattr(args, key))
        rows += [{"op": name, **row} for row in module.run(module_args)]
    print(bench.to_json(rows) if args.json else bench.format_table(rows))
    return 0


def _leaf_parsers(parser: _Parser) -> Iterator[_Parser]:
    """The parsers of the runnable (sub)commands under ``parser``."""
    if parser.subcommands is None:
        yield parser
        return
    for child in dict.fromkeys(parser.subcommands.choices.values()):  # aliases once
        yield from _leaf_parsers(child)


def build_parser() -> argparse.ArgumentParser:
    """The ``lowbit`` parser (imports lowbit's operators)."""
    from lowbit import backends
    from lowbit.cli import bench, evaluate, quantize_checkpoint, smoke, wqbmm

    backend_choices = list(backends.BACKENDS)
    parser = _Parser(prog="lowbit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--debug", action="store_true", help="on an error, show the traceback")
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="versions, devices and the backend serving each operator")
    info.add_argument("--backend", choices=backend_choices, default=None, help="default: the process default")
    info.set_defaults(func=_cmd_info)

    checks = smoke.checks()
    smoke_parser = sub.add_parser("smoke", help="JSON verdict on whether each operator's hardware path works")
    smoke_parser.add_argument("op", nargs="?", default="all", choices=["all", *checks], help="operator (default: all)")
    smoke_parser.add_argument("--backend", choices=backend_choices, default="auto")
    smoke_parser.add_argument("--device", default="auto", help="cpu, cuda:N, npu:N or auto (default)")
    smoke_parser.set_defaults(func=_cmd_smoke)

    bench_parser = sub.add_parser("bench", help="throughput against baselines measured in the same run")
    bench_sub = bench_parser.add_subparsers(dest="op", required=True)
    modules = bench.benches()
    for name, module in [("all", None), *modules.items()]:
        p = bench_sub.add_parser(name, help=f"benchmark {name}")
        _add_bench_arguments(p, module, backend_choices)
        selected = list(modules.items()) if module is None else [(name, module)]
        p.set_defaults(func=_cmd_bench, bench_modules=selected)

    wqbmm.add_subcommands(sub)  # wqbmm gen-data|run|profile|example, verify
    evaluate.add_subcommand(sub)  # eval
    quantize_checkpoint.add_subcommand(sub)  # quantize-checkpoint
    for leaf in _leaf_parsers(parser):  # `--debug` also after the command; error lines name the command
        leaf.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        leaf.set_defaults(command_prog=leaf.prog)
    return parser


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split("\n")).strip()
    return text or type(exc).__name__


def _report_error(prog: str, message: str, backend: str | None = None) -> None:
    """One line on stderr: smoke's JSON error object for ``lowbit smoke``, else ``PROG: error: MESSAGE``."""
    if prog.split()[:2] == ["lowbit", "smoke"]:
        error = {"requested_backend": backend, "hardware_path_verified": False, "error": f"{prog}: {message}"}
        print(json.dumps(error, sort_keys=True), file=sys.stderr)
    else:
        print(f"{prog}: error: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run the ``lowbit`` command line ``argv`` (default: sys.argv[1:]); returns the exit code."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    debug = "--debug" in argv
    words = [a for a in argv if not a.startswith("-")]
    prog, backend = " ".join(["lowbit", *words[:1]]), None  # until the command line is parsed
    try:
        import lowbit  # noqa: F401  (a broken environment, e.g. a bad LOWBIT_BACKEND, fails here or below)

        args, unknown = build_parser().parse_known_args(argv)
        prog, backend = args.command_prog, getattr(args, "backend", None)
        if unknown:  # reported by the command's parser, not the top-level one
            raise UsageError(prog, f"unrecognized arguments: {' '.join(unknown)}")
        return args.func(args)
    except UsageError as exc:
        _report_error(exc.prog, str(exc))
        return EXIT_ERROR
    except SystemExit as exc:  # --help
        return 0 if exc.code is None else exc.code if isinstance(exc.code, int) else EXIT_ERROR
    except BrokenPipeError:  # output piped into e.g. `head`: stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        if debug:
            raise
        _report_error(prog, "interrupted", backend)
        return EXIT_INTERRUPTED
    except EXPECTED_ERRORS as exc:  # bad input, bad files, a device or backend that cannot run here
        if debug:
            raise
        _report_error(prog, _one_line(exc), backend)
        return EXIT_ERROR
    except Exception as exc:  # a bug: still one line, and the way to see more
        if debug:
            raise
        _report_error(prog, f"internal error: {type(exc).__name__}: {_one_line(exc)} (rerun with --debug)", backend)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
