"""``lowbit quantize-checkpoint IN_DIR OUT_DIR --scheme NAME``: a thin layer over
lowbit.quantize.streaming.quantize_checkpoint (docs/quantize_checkpoint.md)."""

from __future__ import annotations

import argparse
import sys

from lowbit.cli.argtypes import positive_int


def _cmd_quantize_checkpoint(args: argparse.Namespace) -> int:
    from lowbit.quantize.streaming import quantize_checkpoint

    progress = sys.stderr.isatty() if args.progress is None else args.progress
    report = quantize_checkpoint(args.in_dir, args.out_dir, args.scheme, skip=tuple(args.skip),
                                 workers=args.workers, progress=progress)
    print(report.summary())
    return 0


def add_subcommand(subparsers) -> None:
    """Add ``quantize-checkpoint`` to the ``lowbit`` parser."""
    from lowbit.quantize.stream_plan import streamable_schemes
    from lowbit.quantize.streaming import default_workers

    p = subparsers.add_parser(
        "quantize-checkpoint", help="quantize a safetensors checkpoint directory tensor by tensor (data-free schemes)")
    p.add_argument("in_dir", metavar="IN_DIR", help="model.safetensors or shards + model.safetensors.index.json")
    p.add_argument("out_dir", metavar="OUT_DIR", help="output directory (new, empty, or an earlier run's to resume)")
    p.add_argument("--scheme", required=True, metavar="NAME", help=f"a data-free scheme: {', '.join(streamable_schemes())}")
    p.add_argument("--skip", action="append", default=[], metavar="PATTERN",
                   help="do not quantize layers whose name contains PATTERN (repeatable)")
    p.add_argument("--workers", type=positive_int, default=default_workers(),
                   help="worker processes (default: min(cpu count, 4))")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")
    p.set_defaults(func=_cmd_quantize_checkpoint)
