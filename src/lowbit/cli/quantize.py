"""``lowbit quantize``: quantize a model with a named scheme or an AMCT-schema config, write a checkpoint.

Calibration (for schemes and configs that need it) runs the model on the lines of --calib-text, or on
built-in real sentences (docs/evaluation.md, "Sentences"), or on a module:function model's input batch.
Prints a summary (layers quantized / skipped, bytes before / after, time per stage); progress bars go to
stderr. Exit status 0, or 2 with one line on stderr for bad arguments, files or models.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from lowbit.cli._models import MODEL_HELP, progress, read_json_file


def _calibration_sentences(args: argparse.Namespace) -> list[str]:
    """Non-empty lines of --calib-text, or the built-in calibration sentences."""
    from lowbit.evaluation.text import evaluation_and_calibration_sentences

    if args.calib_text:
        lines = [line.strip() for line in Path(args.calib_text).read_text(encoding="utf-8").splitlines()]
        lines = [line for line in lines if line]
        if not lines:
            raise ValueError(f"--calib-text {args.calib_text} has no non-empty line")
        return lines
    return evaluation_and_calibration_sentences(0, args.calib_sentences)[1]


def _cmd_quantize(args: argparse.Namespace) -> int:
    from lowbit.evaluation import schemes as scheme_api
    from lowbit.evaluation.models import load_model
    from lowbit.evaluation.run import calibrator

    if args.scheme:
        scheme_api.check_names([args.scheme])
    config = read_json_file(args.config, "--config") if args.config else None
    out = Path(args.out)
    if not out.parent.is_dir():
        raise FileNotFoundError(f"no directory {out.parent} to write {out.name} into")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} exists and is not a directory")
    times = {}
    start = time.perf_counter()
    loaded = load_model(args.model)
    float_bytes = scheme_api.float_bytes(loaded.model)
    times["load"] = time.perf_counter() - start
    calibrate, bar = None, None
    if config is not None or scheme_api.needs_calibration(args.scheme) or args.amct_compat:
        sentences = _calibration_sentences(args) if loaded.kind != "callable" else []
        bar = progress(len(sentences), "calibrate", "sentence")
        calibrate = calibrator(loaded, sentences, args.batch_size, bar)
    start = time.perf_counter()
    try:
        report = scheme_api.quantize_model(loaded.model, scheme=args.scheme or None, config=config,
                                           calibrate=calibrate, amct_compat=args.amct_compat)
    finally:
        if bar is not None:
            bar.close()
    times["quantize" if calibrate is None else "quantize+calibrate"] = time.perf_counter() - start
    if not report.quantized:
        raise ValueError(f"nothing to quantize: no layer of {args.model} was selected "
                         f"({len(report.skipped)} skipped); nothing written")
    start = time.perf_counter()
    scheme_api.save(loaded.model, out)
    times["save"] = time.perf_counter() - start
    written = scheme_api.directory_bytes(out)
    print(_summary(args, loaded, report, float_bytes, written, times))
    return 0


def _summary(args, loaded, report, float_bytes: int, written: int, times: dict) -> str:
    """The summary printed after quantizing: layers, bytes, time per stage."""
    after = report.bytes_after
    rows = [
        ("model", f"{args.model} ({loaded.kind})"),
        ("scheme", args.scheme or f"config {args.config}" + (" (amct_compat)" if args.amct_compat else "")),
        ("layers quantized", str(len(report.quantized))),
        ("layers skipped", str(len(report.skipped))),
        ("quantized weights, bytes", f"{report.bytes_before} -> {after if after is not None else '?'}"),
        ("whole model, bytes", f"{float_bytes} (float32 in memory) -> {written} (checkpoint)"),
        ("time, s", ", ".join(f"{k} {v:.2f}" for k, v in times.items())),
        ("checkpoint", str(args.out)),
    ]
    rows += [(f"skipped {name}", reason) for name, reason in report.skipped.items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def add_subcommand(subparsers) -> None:
    """Add ``quantize`` to the ``lowbit`` parser."""
    p = subparsers.add_parser("quantize", help="quantize a model (named scheme or AMCT config) and save a checkpoint")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--scheme", default="", help="a named scheme (lowbit.quantize.SCHEMES)")
    how.add_argument("--config", default="", help="a JSON file in AMCT's config schema")
    p.add_argument("--calib-text", default="", help="UTF-8 text file, one calibration sample per non-empty line "
                                                     "(default: built-in sentences)")
    p.add_argument("--calib-sentences", type=int, default=64, help="built-in calibration sentences (default 64)")
    p.add_argument("--batch-size", type=int, default=16, help="calibration samples per forward pass (default 16)")
    p.add_argument("--amct-compat", action="store_true", help="reproduce AMCT's quirks (docs/quantize.md)")
    p.add_argument("--out", required=True, help="checkpoint directory to write (save_quantized)")
    p.set_defaults(func=_cmd_quantize)
