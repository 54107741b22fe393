"""``lowbit eval``: accuracy of quantization schemes on a real model (a thin layer over lowbit.evaluation).

Encoders: sentence-embedding agreement with the float model; causal LMs: AMCT's perplexity on --text.
Prints a table (or JSON with ``--json -``); ``--json FILE`` and ``--plot FILE.png`` also write files.
Exit status 0, or 2 with one line on stderr for bad arguments, files or models (docs/evaluation.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lowbit.cli._models import MODEL_HELP, progress
from lowbit.cli.bench import format_table, to_json
from lowbit.toolchain.files import write_bytes_atomic

DEFAULT_SCHEMES = "hif8-cast,hif8-wo,fp8-wo,hif8-w8a8-minmax,mxfp8-w8a8,mxfp4-wo,hif4-wo,int4-a16w4"


def _cmd_eval(args: argparse.Namespace) -> int:
    from lowbit import evaluation
    from lowbit.evaluation import schemes as scheme_api
    from lowbit.evaluation.plot import plot_rows

    if args.sentences < 2:
        raise ValueError(f"--sentences must be >= 2 (nearest neighbours need another sentence), got {args.sentences}")
    if args.calib_sentences < 1:
        raise ValueError(f"--calib-sentences must be >= 1, got {args.calib_sentences}")
    if args.plot:
        from lowbit.evaluation.extras import require

        require("matplotlib", "plot", "--plot")  # fail before the long run, not after it
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    schemes = scheme_api.names() if schemes == ["all"] else schemes
    scheme_api.check_names(schemes)
    loaded = evaluation.load_model(args.model)
    tokens = None
    if args.text:
        if loaded.kind != "causal-lm":
            raise ValueError(f"--text measures perplexity; {args.model} is not a causal LM ({loaded.kind})")
        tokens = evaluation.tokenize_text_file(loaded.tokenizer, args.text)
    bar = progress(len(schemes), "schemes", "scheme")
    try:
        rows = evaluation.evaluate_schemes(loaded, schemes, sentences=args.sentences,
                                           calib_sentences=args.calib_sentences, tokens=tokens,
                                           seqlen=args.seqlen, batch_size=args.batch_size,
                                           progress=lambda name: bar.update(1))
    finally:
        bar.close()
    if args.json and args.json != "-":
        write_bytes_atomic(_path(args.json), (to_json(rows) + "\n").encode())
    if args.plot:
        write_bytes_atomic(_path(args.plot), plot_rows(rows, f"lowbit eval --model {args.model}"))
    print(to_json(rows) if args.json == "-" else format_table([_readable(r) for r in rows]))
    return 0


_DIGITS = {"mean_cosine": 6, "nn_agreement": 3, "sqnr_db": 2, "perplexity": 4}


def _readable(row: dict) -> dict:
    """The row with each metric to a fixed number of decimals (a cosine of 0.99998 is not printed as 1)."""
    return {k: f"{v:.{_DIGITS[k]}f}" if k in _DIGITS and isinstance(v, float) else v for k, v in row.items()}


def _path(name: str) -> Path:
    """``name`` as a Path; FileNotFoundError if its directory does not exist."""
    path = Path(name)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"no directory {path.parent} to write {path.name} into")
    return path


def add_subcommand(subparsers) -> None:
    """Add ``eval`` to the ``lowbit`` parser."""
    p = subparsers.add_parser("eval", help="accuracy of quantization schemes on a real model vs float")
    p.add_argument("--model", default="minilm", help=MODEL_HELP + " (default: minilm)")
    p.add_argument("--schemes", default=DEFAULT_SCHEMES,
                   help=f"comma-separated scheme names, or 'all' (default: {DEFAULT_SCHEMES})")
    p.add_argument("--sentences", type=int, default=256, help="sentences to embed and compare (default 256)")
    p.add_argument("--calib-sentences", type=int, default=64,
                   help="other sentences fed to schemes that calibrate (default 64)")
    p.add_argument("--text", default="", help="causal LMs: UTF-8 text file to measure perplexity on")
    p.add_argument("--seqlen", type=int, default=2048, help="perplexity window in tokens (default 2048, as AMCT)")
    p.add_argument("--batch-size", type=int, default=32, help="sentences per forward pass (default 32)")
    p.add_argument("--json", default="", metavar="FILE",
                   help="also write the rows as JSON to FILE ('-': print JSON instead of the table)")
    p.add_argument("--plot", default="", metavar="FILE.png",
                   help="write a chart of accuracy vs bits per weight (needs matplotlib)")
    p.set_defaults(func=_cmd_eval)
