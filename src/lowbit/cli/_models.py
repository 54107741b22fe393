"""What ``lowbit quantize`` and ``lowbit eval`` share: the --model argument, progress bars, one-line errors."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

from lowbit.cli.wqbmm import _write_atomic as write_atomically  # noqa: F401  (re-exported: the one atomic writer)

EXIT_BAD_INPUT = 2  # bad argument, unreadable or malformed file, missing optional package, unusable model

MODEL_HELP = ("'minilm' (the packaged all-MiniLM-L6-v2), a local Hugging Face model directory, or "
              "'module:function' returning (torch.nn.Module, input batch tensor)")


def one_line_errors(command: str):
    """Decorate a command: expected failures (bad values, files, types, missing packages, a model that
    cannot run: ValueError, TypeError, RuntimeError, OSError, ImportError) print
    ``lowbit <command>: error: <message>`` as one line on stderr and return :data:`EXIT_BAD_INPUT`."""

    def wrap(func):
        @functools.wraps(func)
        def run(args) -> int:
            try:
                return func(args)
            except (ValueError, TypeError, RuntimeError, OSError, ImportError) as exc:
                if isinstance(exc, OSError) and exc.filename and exc.strerror:
                    message = f"{exc.filename}: {exc.strerror}"
                else:
                    message = " ".join(str(exc).split()) or type(exc).__name__
                print(f"lowbit {command}: error: {message}", file=sys.stderr)
                return EXIT_BAD_INPUT

        return run

    return wrap


def progress(total: int, desc: str, unit: str):
    """A tqdm bar on stderr (shown only when stderr is a terminal), or a no-op when tqdm is missing."""
    try:
        from tqdm import tqdm
    except ImportError:
        class _NoBar:
            def update(self, n: int = 1) -> None:
                pass

            def close(self) -> None:
                pass

        return _NoBar()
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=None, leave=False)


def read_json_file(path: str, what: str) -> dict:
    """A JSON object from ``path``; ValueError naming the file when it is not valid JSON or not an object."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {path} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} {path} must hold a JSON object, got {type(value).__name__}")
    return value
