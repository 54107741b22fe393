"""``lowbit wqbmm gen-data | run | profile | example`` and ``lowbit verify OUTPUT GOLDEN``: argument parsing
and printing over the sample's tool chain, lowbit.toolchain.wqbmm and lowbit.toolchain.verify
(docs/wqbmm.md, "The sample's tool chain"; exit codes: docs/cli.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict
from pathlib import Path

from lowbit import backends
from lowbit.cli.argtypes import MAX_REPEATS, comma_list, int_at_least, nonnegative_float, one_of, positive_int, seed
from lowbit.cli.output import add_json_flag, json_text
from lowbit.cli.render import emit
from lowbit.cli.render.progress import steps
from lowbit.cli.render.rows import profile_view
from lowbit.cli.render.summary import example_view, verify_view
from lowbit.ops.wqbmm import ALGORITHMS, TEMPLATES
from lowbit.toolchain import wqbmm as sample
from lowbit.toolchain.verify import VerifyResult, verify_files

EXIT_FAILED = 1  # verify: the output does not match the golden


def _meta_from_args(args: argparse.Namespace) -> sample.SampleMeta:
    return sample.SampleMeta(args.m, args.n, args.k, args.group_size, args.seed, args.dtype)


def _verify_report(result: VerifyResult, args: argparse.Namespace | None = None) -> dict:
    """The verifier's verdict as a JSON-able dict, with the tolerances it used when ``args`` gives them."""
    report = asdict(result)
    if args is not None:
        report.update(rtol=args.rtol, atol=args.atol, error_tol=args.error_tol)
    return report


# Kineto, torch.profiler's library, logs each profiler start and stop on stderr ("USDT: ... profiler_start", its
# severity 5); this minimum severity hides them (and its error lines: KINETO_LOG_LEVEL=4 shows those). Kineto
# reads it when the profiler first starts in the process; a level set by the user is kept.
KINETO_QUIET_LEVEL = "6"


def _profile(root: Path, backend_names, repeats: int) -> list[dict]:
    """The sample's profile rows (lowbit.toolchain.wqbmm.profile_sample); skipped backends on stderr."""
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET_LEVEL)
    rows, skipped = sample.profile_sample(root, backend_names=backend_names, repeats=repeats)
    for message in skipped:
        print(message, file=sys.stderr)
    return rows


def _cmd_gen_data(args: argparse.Namespace) -> int:
    sample.gen_data(Path(args.dir), _meta_from_args(args))
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    print(sample.run_sample(Path(args.dir), args.template, args.algorithm, args.backend))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    result = verify_files(args.output, args.golden, sample.DTYPES[args.dtype],
                          rtol=args.rtol, atol=args.atol, error_tol=args.error_tol)
    if args.sample:
        print("\n".join(result.report_lines()))
    elif args.json:
        print(json_text(_verify_report(result, args)))
    else:
        emit(verify_view(_verify_report(result, args)))
    return 0 if result.passed else EXIT_FAILED


def _cmd_profile(args: argparse.Namespace) -> int:
    rows = _profile(Path(args.dir), args.backends, args.repeats)
    if args.json:
        print(json_text(rows))
    else:
        emit(profile_view(rows))
    return 0


def _cmd_example(args: argparse.Namespace) -> int:
    """run.sh end to end: gen-data, run + verify per template, profile; reports basic vs preload."""
    root, meta = Path(args.dir), _meta_from_args(args)
    if args.sample:
        print(f"[gen-data] M={meta.m} N={meta.n} K={meta.k} G={meta.group_size} seed={meta.seed}")
    verified = {}
    with steps(len(TEMPLATES) + 2, "example") as step:
        step("gen-data")
        sample.gen_data(root, meta)
        for template in TEMPLATES:
            step(f"run + verify {template}")
            path = sample.run_sample(root, template, backend=args.backend)
            verified[template] = verify_files(path, meta.path(root, "golden"), meta.torch_dtype)
            if args.sample:
                print(f"[run+verify] template={template}")
                print("\n".join(verified[template].report_lines()))
        step("profile")
        rows = _profile(root, (args.backend or "auto",), repeats=5)
    report = {"meta": asdict(meta), "verify": {t: _verify_report(r) for t, r in verified.items()},
              "profile": rows, "passed": all(r.passed for r in verified.values())}
    if args.sample:
        print("[profile] basic vs preload (median us; traces under output/profile/)")
        emit(profile_view(rows))
    elif args.json:
        print(json_text(report))
    else:
        emit(example_view(report))
    return 0 if report["passed"] else EXIT_FAILED


def _add_output_flags(parser: argparse.ArgumentParser, what: str) -> None:
    """--json, or --sample: what the sample's scripts print (verify_result.py's lines, run.sh's steps)."""
    group = parser.add_mutually_exclusive_group()
    add_json_flag(group, what)
    group.add_argument("--sample", action="store_true",
                       help="print what the sample's scripts print (verify_result.py: the first 101 mismatches, "
                            "'test pass' or '[ERROR] result error')")


def _add_size_flags(parser: argparse.ArgumentParser) -> None:
    sizes = sample.SAMPLE_SIZES
    parser.add_argument("--m", type=positive_int, default=sizes["m"], help="rows of x (positive)")
    parser.add_argument("--n", type=positive_int, default=sizes["n"], help="output columns (positive, even)")
    parser.add_argument("--k", type=positive_int, default=sizes["k"], help="inner size (a multiple of G)")
    parser.add_argument("--group-size", type=positive_int, default=sizes["group_size"],
                        help="G: a multiple of 32 dividing K")
    parser.add_argument("--seed", type=seed, default=sizes["seed"], help="numpy seed in [0, 2**32)")
    parser.add_argument("--dtype", choices=list(sample.DTYPES), default="float16")


def add_subcommands(subparsers) -> None:
    """Add ``wqbmm`` (gen-data, run, profile, example) and ``verify`` to the ``lowbit`` parser."""
    backend_choices = list(backends.BACKENDS)
    wqbmm = subparsers.add_parser("wqbmm", help="the ops-nn WeightQuantBatchMatmul sample flow")
    sub = wqbmm.add_subparsers(dest="wqbmm_command", required=True, metavar="COMMAND")

    gen = sub.add_parser("gen-data", help="inputs and golden as the sample's gen_data.py")
    gen.add_argument("--dir", default=".", help="the sample's folder: input/ and output/ (the golden) are made there "
                                                "(default: .)")
    _add_size_flags(gen)
    gen.set_defaults(func=_cmd_gen_data)

    run = sub.add_parser("run", help="input/ -> output/output_z.bin")
    run.add_argument("--dir", default=".", help="the sample's folder: reads input/, writes output/ (default: .)")
    run.add_argument("--template", choices=list(TEMPLATES), default="preload", help="default: preload")
    run.add_argument("--algorithm", choices=list(ALGORITHMS), default="msd", help="default: msd")
    run.add_argument("--backend", choices=backend_choices, default=None, help="default: the process default")
    run.set_defaults(func=_cmd_run)

    prof = sub.add_parser("profile", help="per-template, per-backend timing and torch.profiler traces")
    prof.add_argument("--dir", default=".", help="the sample's folder: reads input/ (default: .)")
    prof.add_argument("--backends", type=comma_list(one_of(backend_choices)), default="native,reference",
                      help="comma-separated backends")
    prof.add_argument("--repeats", type=int_at_least(1, MAX_REPEATS), default=7,
                      help="timed calls per case (median reported; default: 7)")
    add_json_flag(prof, "the rows")
    prof.set_defaults(func=_cmd_profile)

    ex = sub.add_parser("example", help="run.sh: gen-data, run, verify, profile for both templates")
    ex.add_argument("--dir", default=".", help="the sample's folder (default: .)")
    ex.add_argument("--backend", choices=backend_choices, default=None, help="default: the process default")
    _add_output_flags(ex, "the report (sizes, each template's verdict, the timings)")
    _add_size_flags(ex)
    ex.set_defaults(func=_cmd_example)

    verify = subparsers.add_parser("verify", help="compare OUTPUT with GOLDEN as the sample's verify_result.py")
    verify.add_argument("output")
    verify.add_argument("golden")
    verify.add_argument("--dtype", choices=list(sample.DTYPES), default="float16")
    verify.add_argument("--rtol", type=nonnegative_float, default=1e-6)
    verify.add_argument("--atol", type=nonnegative_float, default=1e-9)
    verify.add_argument("--error-tol", type=nonnegative_float, default=1e-3)
    _add_output_flags(verify, "the verdict")
    verify.set_defaults(func=_cmd_verify)
