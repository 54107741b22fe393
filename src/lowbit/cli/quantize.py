"""``lowbit quantize``: quantize a model with a named scheme or an AMCT-schema config, write a checkpoint.

Calibration (for schemes and configs that need it) runs the model on the lines of --calib-text, or on
built-in real sentences (docs/evaluation.md, "Sentences"), or on a module:function model's input batch.
Prints a summary (layers quantized / skipped, bytes before / after, time per stage; lowbit.cli.render.summary,
or JSON with ``--json``); progress bars go to stderr. Exit status 0, or 2 with one line on stderr for bad
arguments, files or models (docs/cli.md).
"""

from __future__ import annotations

import argparse
import time

from lowbit.cli._models import MODEL_HELP, progress, read_json_file, read_text_file
from lowbit.cli.argtypes import output_dir, positive_int
from lowbit.cli.output import add_json_flag, json_text, writable_path


def _calibration_sentences(args: argparse.Namespace, encoder: bool) -> list[str]:
    """Non-empty lines of --calib-text, or the built-in calibration sentences ``lowbit eval`` calibrates on by
    default (for an encoder, those after its 256 evaluation sentences), so its numbers are this checkpoint's."""
    from lowbit.evaluation.run import DEFAULT_SENTENCES
    from lowbit.evaluation.text import evaluation_and_calibration_sentences

    if args.calib_text:
        lines = [line.strip() for line in read_text_file(args.calib_text, "--calib-text").splitlines()]
        lines = [line for line in lines if line]
        if not lines:
            raise ValueError(f"--calib-text {args.calib_text} has no non-empty line")
        return lines
    return evaluation_and_calibration_sentences(DEFAULT_SENTENCES if encoder else 0, args.calib_sentences)[1]


def _cmd_quantize(args: argparse.Namespace) -> int:
    from lowbit.evaluation import schemes as scheme_api
    from lowbit.evaluation.models import load_model
    from lowbit.evaluation.run import calibrator
    from lowbit.quantize.checkpoint import check_replaceable

    if args.scheme:
        scheme_api.check_names([args.scheme])
    config = read_json_file(args.config, "--config") if args.config else None
    out = writable_path(args.out, "--out")
    check_replaceable(out, "--out")  # before the model loads: a directory that is not a checkpoint is kept
    times = {}
    start = time.perf_counter()
    loaded = load_model(args.model)
    float_bytes = scheme_api.float_bytes(loaded.model)
    times["load"] = time.perf_counter() - start
    calibrate, bar = None, None
    if loaded.kind == "callable" and args.calib_text:
        raise ValueError(f"--calib-text: {args.model} is a module:function model, which calibrates on the "
                         "batch its function returns; leave --calib-text out")
    if config is not None or scheme_api.needs_calibration(args.scheme) or args.amct_compat:
        sentences = _calibration_sentences(args, loaded.kind == "encoder") if loaded.kind != "callable" else []
        bar = progress(len(sentences), "calibrate", "sentence")
        calibrate = calibrator(loaded, sentences, args.batch_size, bar)
    start = time.perf_counter()
    layers = progress(None, "pack", "layer")
    try:
        report = scheme_api.quantize_model(loaded.model, scheme=args.scheme or None, config=config,
                                           calibrate=calibrate, amct_compat=args.amct_compat,
                                           progress=lambda name: layers.update(1))
    finally:
        layers.close()
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
    summary = {
        "model": args.model, "model_kind": loaded.kind, "scheme": args.scheme or None, "config": args.config or None,
        "amct_compat": args.amct_compat, "layers_quantized": report.quantized, "layers_skipped": report.skipped,
        "weight_bytes_before": report.bytes_before, "weight_bytes_after": report.bytes_after,
        "model_bytes": float_bytes, "checkpoint_bytes": written, "seconds": times, "checkpoint": str(out),
    }
    if args.json:
        print(json_text(summary))
    else:
        from lowbit.cli.render import emit
        from lowbit.cli.render.summary import quantize_view

        emit(quantize_view(summary))
    return 0


def add_subcommand(subparsers) -> None:
    """Add ``quantize`` to the ``lowbit`` parser."""
    p = subparsers.add_parser("quantize", help="quantize a model (named scheme or AMCT config) and save a checkpoint")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--scheme", default="", help="a named scheme (lowbit.quantize.SCHEMES)")
    how.add_argument("--config", default="", help="a JSON file in AMCT's config schema")
    p.add_argument("--calib-text", default="", help="UTF-8 text file, one calibration sample per non-empty line "
                                                     "(default: built-in sentences)")
    p.add_argument("--calib-sentences", type=positive_int, default=64,
                   help="built-in calibration sentences (default 64)")
    p.add_argument("--batch-size", type=positive_int, default=1,
                   help="calibration samples per forward pass (default 1: no padding; larger batches are padded, "
                        "and the padding reaches the activation statistics); every pass counts")
    p.add_argument("--amct-compat", action="store_true", help="reproduce AMCT's quirks (docs/quantize.md)")
    p.add_argument("--out", type=output_dir, required=True, help="checkpoint directory to write (save_quantized)")
    add_json_flag(p, "the summary (layers quantized and skipped, bytes, seconds per stage)")
    p.set_defaults(func=_cmd_quantize)
