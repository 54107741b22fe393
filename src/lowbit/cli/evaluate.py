"""``lowbit eval``: accuracy of quantization schemes on a real model (a thin layer over lowbit.evaluation).

Encoders: sentence-embedding agreement with the float model; causal LMs: AMCT's perplexity on --text.
Prints the human view (lowbit.cli.render.rows.eval_view) or, with ``--json`` (``--json -``), the rows as
JSON; ``--json FILE`` and ``--plot FILE.png`` also write files. Exit status 0, or 2 with one line on stderr
for bad arguments, files or models (docs/evaluation.md, docs/cli.md).
"""

from __future__ import annotations

import argparse

from lowbit.cli._models import MODEL_HELP, progress, read_text_file
from lowbit.cli.argtypes import int_at_least, output_file, positive_int
from lowbit.cli.output import json_text, writable_path

DEFAULT_SCHEMES = "hif8-cast,hif8-wo,fp8-wo,hif8-w8a8-minmax,mxfp8-w8a8,mxfp4-wo,hif4-wo,int4-a16w4"


def _cmd_eval(args: argparse.Namespace) -> int:
    from lowbit import evaluation
    from lowbit.cli.render import emit
    from lowbit.cli.render.rows import eval_view
    from lowbit.evaluation import schemes as scheme_api
    from lowbit.evaluation.plot import plot_rows
    from lowbit.toolchain.files import write_bytes_atomic

    if args.plot:
        from lowbit.evaluation.extras import require

        require("matplotlib", "plot", "--plot")  # fail before the long run, not after it
    json_path = writable_path(args.json, "--json") if args.json not in ("", "-") else None
    plot_path = writable_path(args.plot, "--plot") if args.plot else None
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    schemes = scheme_api.names() if schemes == ["all"] else schemes
    scheme_api.check_names(schemes)
    loaded = evaluation.load_model(args.model)
    tokens = None
    if args.text:
        if loaded.kind != "causal-lm":
            raise ValueError(f"--text measures perplexity; {args.model} is not a causal LM ({loaded.kind})")
        tokens = evaluation.tokenize_text(loaded.tokenizer, read_text_file(args.text, "--text"))
    bar = progress(len(schemes), "schemes", "scheme")
    try:
        rows = evaluation.evaluate_schemes(loaded, schemes, sentences=args.sentences,
                                           calib_sentences=args.calib_sentences, tokens=tokens,
                                           seqlen=args.seqlen, batch_size=args.batch_size,
                                           progress=lambda name: bar.update(1))
    finally:
        bar.close()
    if json_path is not None:
        write_bytes_atomic(json_path, (json_text(rows) + "\n").encode())
    if plot_path is not None:
        write_bytes_atomic(plot_path, plot_rows(rows, f"lowbit eval --model {args.model}"))
    if args.json == "-":
        print(json_text(rows))
    else:
        emit(eval_view(rows))
    return 0


def add_subcommand(subparsers) -> None:
    """Add ``eval`` to the ``lowbit`` parser."""
    from lowbit.evaluation.run import DEFAULT_SENTENCES  # (lowbit's modules only: no third-party import)

    p = subparsers.add_parser("eval", help="accuracy of quantization schemes on a real model vs float")
    p.add_argument("--model", default="minilm", help=MODEL_HELP + " (default: minilm)")
    p.add_argument("--schemes", default=DEFAULT_SCHEMES,
                   help=f"comma-separated scheme names, or 'all' (default: {DEFAULT_SCHEMES})")
    p.add_argument("--sentences", type=int_at_least(2), default=DEFAULT_SENTENCES,
                   help=f"sentences to embed and compare (default {DEFAULT_SENTENCES}; nearest neighbours need at "
                        "least 2)")
    p.add_argument("--calib-sentences", type=positive_int, default=64,
                   help="other sentences fed to schemes that calibrate (default 64)")
    p.add_argument("--text", default="", help="causal LMs: UTF-8 text file to measure perplexity on")
    p.add_argument("--seqlen", type=int_at_least(2), default=2048,
                   help="perplexity window in tokens (default 2048, as AMCT)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="sentences per forward pass (default 32)")
    p.add_argument("--json", type=output_file, nargs="?", const="-", default="", metavar="FILE",
                   help="--json: print the rows as JSON instead of the human summary; --json FILE: write them to "
                        "FILE and print the summary")
    p.add_argument("--plot", type=output_file, default="", metavar="FILE.png",
                   help="write a chart of accuracy vs bits per weight (needs matplotlib)")
    p.set_defaults(func=_cmd_eval)
