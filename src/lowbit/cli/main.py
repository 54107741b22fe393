"""The ``lowbit`` command: info, smoke, bench, quantize, quantize-checkpoint, eval, and the
WeightQuantBatchMatmul tool chain (wqbmm, verify).

Exit codes, --debug and the two renderings of every report (the human view by default, ``--json`` for
scripts): docs/cli.md. Every error is one line on stderr (``lowbit <command>: error: ...``; for
``lowbit smoke --json`` the one-line JSON error object of its contract) and exit 2, without a traceback
unless --debug is given.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import traceback

EXIT_ERROR = 2  # usage, bad input, bad files, a device or backend that cannot run here
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT
EXIT_BROKEN_PIPE = 141  # stdout closed by the reader (`| head`), as shells report SIGPIPE
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

    backends.read_environment()  # this command's variable, whatever an earlier command in this process read
    name = os.environ.get("LOWBIT_BACKEND")
    if name and name not in backends.BACKENDS:
        raise ValueError(f"LOWBIT_BACKEND={name!r} is not a backend; expected one of {', '.join(backends.BACKENDS)}")
    return backends.get_backend()


def _cmd_info(args: argparse.Namespace) -> int:
    """Versions, devices, and which backend serves each operator on each present device."""
    import torch

    from lowbit import backends
    from lowbit.cli import smoke
    from lowbit.cli.render import emit
    from lowbit.cli.render.progress import steps
    from lowbit.cli.render.smoke import info_view

    default = _check_default_backend()
    requested = args.backend or default
    smoke.checks()  # imports every operator module (registers its operators)
    ops = {}
    operators = sorted(backends.operators().items())
    with steps(len(operators), "self-checks") as step:
        if requested == "auto":  # auto runs every CPU self-check below: their cold kernels compile in parallel
            smoke.warm_cpu_kernels([op for _, op in operators], lambda: step("compiling CPU kernels", counted=False))
        devices = [torch.device("cpu")]
        devices += [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]
        for name, operator in operators:
            step(name)
            ops[name] = _backends_serving(operator, devices, requested)
    report = {
        "environment": smoke.environment(devices[-1]),
        "default_backend": default,
        "requested_backend": requested,
        "devices": [str(d) for d in devices],
        "operators": ops,
    }
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        emit(info_view(report))
    return 0


def _backends_serving(operator, devices: list, requested: str) -> dict:
    """``lowbit info``'s entry of one operator: device -> {"backend", "why" (when not native)}."""
    from lowbit import backends

    per_device = {}
    for device in devices:
        try:
            chosen = operator.resolve(device, requested)
            entry = {"backend": chosen}
            if requested == "auto" and chosen == "reference":
                entry["why"] = operator.auto_check_error(device) or "no native kernel"
        except backends.BackendUnavailable as exc:
            entry = {"backend": None, "why": str(exc)}
        per_device[str(device)] = entry
    return per_device


def _cmd_smoke(args: argparse.Namespace) -> int:
    from lowbit.cli import smoke
    from lowbit.cli.render import emit
    from lowbit.cli.render.progress import steps
    from lowbit.cli.render.smoke import smoke_view

    _check_default_backend()  # a bad LOWBIT_BACKEND: the check cannot run (exit 2)
    with steps(len(smoke.checks()) if args.op == "all" else 1, "smoke") as step:
        report, code = smoke.run(args.op, args.backend, args.device, on_check=step, debug=args.debug,
                                 on_compile=lambda: step("compiling CPU kernels", counted=False))
    if "error" in report and "results" not in report and "ops" not in report:  # it could not start
        _smoke_error(report, args.json)
        return code
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True, allow_nan=False))
    else:
        emit(smoke_view(report, code))
    if code == smoke.EXIT_CANNOT_RUN:
        errors = [f"{r['op']}: {r['error']}" for r in report.get("ops", [report]) if "error" in r]
        _smoke_error(smoke.error_report(args.backend, "; ".join(errors)), args.json)
    return code


def _smoke_error(error: dict, as_json: bool) -> None:
    """Smoke's error object (exit 2) on stderr: one line of JSON with --json, else ``lowbit smoke: error: ...``."""
    if as_json:
        print(json.dumps(error, sort_keys=True, allow_nan=False), file=sys.stderr)
    else:
        print(f"lowbit smoke: error: {error['error']}", file=sys.stderr)


def _add_bench_arguments(parser: argparse.ArgumentParser, module, backend_choices: list[str]) -> None:
    from lowbit.cli.argtypes import MAX_REPEATS, int_at_least, output_file
    from lowbit.cli.output import add_json_flag

    parser.add_argument("--backend", choices=backend_choices, default="auto", help="default: auto")
    parser.add_argument("--device", default="cpu", help="cpu, cuda:N, npu:N or auto (a device present here)")
    parser.add_argument("--repeats", type=int_at_least(1, MAX_REPEATS), default=7,
                        help="timed samples per case (median reported)")
    add_json_flag(parser, "the rows")
    parser.add_argument("--plot", type=output_file, default="", metavar="FILE.png",
                        help="also write a chart of the rows (throughput against the baselines; needs matplotlib)")
    if module is not None and hasattr(module, "add_arguments"):
        module.add_arguments(parser)


def _cmd_bench(args: argparse.Namespace) -> int:
    from lowbit.backends import BACKENDS
    from lowbit.cli.devices import resolve_device
    from lowbit.cli.output import json_text, writable_path
    from lowbit.cli.render import emit
    from lowbit.cli.render.plot import bench_plot
    from lowbit.cli.render.progress import steps
    from lowbit.cli.render.rows import bench_view
    from lowbit.evaluation.extras import require
    from lowbit.toolchain.files import write_bytes_atomic

    args.device = str(resolve_device(args.device))  # never time a device that cannot run (meta, absent)
    plot = None
    if args.plot:  # fail before the long run, not after it
        require("matplotlib", "plot", "--plot")
        plot = writable_path(args.plot, "--plot")
    rows = []
    with steps(len(args.bench_modules), "bench") as step:
        for name, module in args.bench_modules:
            step(name)
            module_args = args
            if args.op == "all":  # the module's own defaults plus the common options given
                parser = _Parser(prog=f"lowbit bench {name}")
                _add_bench_arguments(parser, module, list(BACKENDS))
                module_args = parser.parse_args([])
                for key in ("backend", "device", "repeats", "json"):
                    setattr(module_args, key, getattr(args, key))
            rows += [{"op": name, **row} for row in module.run(module_args)]
    if plot is not None:
        write_bytes_atomic(plot, bench_plot(rows, f"lowbit bench {args.op} on {args.device}"))
    if args.json:
        print(json_text(rows))
    else:
        emit(bench_view(rows, args.device))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``lowbit`` parser (imports lowbit's operators)."""
    import lowbit
    from lowbit import backends
    from lowbit.cli import bench, evaluate, quantize, quantize_checkpoint, smoke, wqbmm
    from lowbit.cli.help import add_examples, subcommand_parsers
    from lowbit.cli.output import add_json_flag

    backend_choices = list(backends.BACKENDS)
    parser = _Parser(prog="lowbit", description="bit-exact low-bit formats and quantized operators for PyTorch: "
                                                "check this machine, benchmark, quantize, evaluate")
    parser.add_argument("--debug", action="store_true", help="on an error, show the traceback")
    parser.add_argument("--version", action="version", version=f"lowbit {lowbit.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="versions, devices and the backend serving each operator")
    info.add_argument("--backend", choices=backend_choices, default=None, help="default: the process default")
    add_json_flag(info)
    info.set_defaults(func=_cmd_info)

    checks = smoke.checks()
    smoke_parser = sub.add_parser("smoke", help="verdict on whether each operator's hardware path works here")
    smoke_parser.add_argument("op", nargs="?", default="all", choices=["all", *checks], help="operator (default: all)")
    smoke_parser.add_argument("--backend", choices=backend_choices, default="auto", help="default: auto")
    smoke_parser.add_argument("--device", default="auto", help="cpu, cuda:N, npu:N or auto (default)")
    add_json_flag(smoke_parser, "the report (docs/smoke_report.schema.json)")
    smoke_parser.set_defaults(func=_cmd_smoke)

    bench_parser = sub.add_parser("bench", help="throughput against baselines measured in the same run")
    bench_sub = bench_parser.add_subparsers(dest="op", required=True, metavar="OPERATOR")
    modules = bench.benches()
    for name, module in [("all", None), *modules.items()]:
        p = bench_sub.add_parser(name, help=f"benchmark {name}")
        _add_bench_arguments(p, module, backend_choices)
        selected = list(modules.items()) if module is None else [(name, module)]
        p.set_defaults(func=_cmd_bench, bench_modules=selected)

    wqbmm.add_subcommands(sub)  # wqbmm gen-data|run|profile|example, verify
    evaluate.add_subcommand(sub)  # eval
    quantize.add_subcommand(sub)  # quantize
    quantize_checkpoint.add_subcommand(sub)  # quantize-checkpoint
    add_examples(parser)
    leaves = [p for p in subcommand_parsers(parser) if p.subcommands is None]
    for leaf in leaves:  # `--debug` also after the command; error lines name the command
        leaf.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        leaf.set_defaults(command_prog=leaf.prog)
    return parser


def _one_line(exc: BaseException) -> str:
    """The error's message on one line; for a file error ``FILE: reason`` (no errno noise)."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    text = " ".join(str(exc).split("\n")).strip()
    return text or type(exc).__name__


def _report_error(prog: str, message: str, backend: str | None = None, as_json: bool = False) -> None:
    """One line on stderr: ``PROG: error: MESSAGE``, or for ``lowbit smoke --json`` its JSON error object."""
    if as_json and prog.split()[:2] == ["lowbit", "smoke"]:
        print(json.dumps({"requested_backend": backend, "hardware_path_verified": False,
                          "error": f"{prog}: {message}"}, sort_keys=True), file=sys.stderr)
    else:
        print(f"{prog}: error: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run the ``lowbit`` command line ``argv`` (default: sys.argv[1:]); returns the exit code."""
    loading = getattr(sys.modules.get("lowbit"), "_interrupted_while_loading", None)
    if loading is not None and signal.getsignal(signal.SIGINT) is loading:  # from here on, main() reports it
        signal.signal(signal.SIGINT, signal.default_int_handler)
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    debug, as_json = "--debug" in argv, "--json" in argv
    words = [a for a in argv if not a.startswith("-")]
    prog, backend = " ".join(["lowbit", *words[:1]]), None  # until the command line is parsed
    if sys.stdout is None:  # started with file descriptor 1 closed (`lowbit ... >&-`)
        _report_error(prog, "standard output is closed: nowhere to write the result", as_json=as_json)
        return EXIT_ERROR
    try:
        import lowbit  # noqa: F401  (a broken environment, e.g. a bad LOWBIT_BACKEND, fails here or below)
        from lowbit.cli.help import overview

        parser = build_parser()
        if not argv:  # `lowbit` alone: what it can do (docs/cli.md, "Help")
            print(overview(parser))
            return 0
        args, unknown = parser.parse_known_args(argv)
        prog, backend = args.command_prog, getattr(args, "backend", None)
        if unknown:  # reported by the command's parser, not the top-level one
            raise UsageError(prog, f"unrecognized arguments: {' '.join(unknown)}")
        return args.func(args)
    except UsageError as exc:
        _report_error(exc.prog, str(exc), as_json=as_json)
        return EXIT_ERROR
    except SystemExit as exc:  # --help
        return 0 if exc.code is None else exc.code if isinstance(exc.code, int) else EXIT_ERROR
    except BrokenPipeError:  # output piped into e.g. `head`: stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE  # not 1: for smoke that means a broken contract
    except KeyboardInterrupt:
        if debug:
            raise
        _report_error(prog, "interrupted", backend, as_json)
        return EXIT_INTERRUPTED
    except EXPECTED_ERRORS as exc:  # bad input, bad files, a device or backend that cannot run here
        if debug:  # the traceback, then the same line and exit code (an uncaught error would exit 1: "failed")
            traceback.print_exc()
        _report_error(prog, _one_line(exc), backend, as_json)
        return EXIT_ERROR
    except Exception as exc:  # a bug: still one line, and the way to see more
        if debug:
            traceback.print_exc()
        _report_error(prog, f"internal error: {type(exc).__name__}: {_one_line(exc)}"
                      + ("" if debug else " (rerun with --debug)"), backend, as_json)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
