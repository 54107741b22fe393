"""``lowbit eval``: model-level accuracy of each format (a thin layer over lowbit.nn.evaluate)."""

from __future__ import annotations

import argparse
import importlib

import torch

from lowbit.cli.bench import format_table, to_json
from lowbit.nn import evaluate


def _load_model(spec: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """'package.module:function' -> function() returning (model, inputs)."""
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"--model must be 'module:function', got {spec!r}")
    model, inputs = getattr(importlib.import_module(module_name), attr)()
    if not isinstance(model, torch.nn.Module) or not isinstance(inputs, torch.Tensor):
        raise TypeError(f"{spec}() must return (torch.nn.Module, torch.Tensor)")
    return model, inputs


def _cmd_eval(args: argparse.Namespace) -> int:
    if args.model:
        model, inputs = _load_model(args.model)
    else:
        model, inputs = evaluate.DemoMLP(seed=args.seed), evaluate.demo_inputs(seed=args.seed + 1)
    formats = args.formats.split(",") if args.formats else None
    rows = evaluate.evaluate_formats(model, inputs, formats)
    print(to_json(rows) if args.json else format_table(rows))
    return 0


def add_subcommand(subparsers) -> None:
    """Add ``eval`` to the ``lowbit`` parser."""
    p = subparsers.add_parser("eval", help="model-level accuracy of each format (output SQNR, top-1 agreement)")
    p.add_argument("--formats", default="", help=f"comma-separated, default all: {','.join(evaluate.FORMATS)}")
    p.add_argument("--model", default="", help="'module:function' returning (model, inputs); default: a demo MLP")
    p.add_argument("--seed", type=int, default=0, help="seed of the demo model (inputs use seed + 1)")
    p.add_argument("--json", action="store_true", help="print rows as JSON")
    p.set_defaults(func=_cmd_eval)
