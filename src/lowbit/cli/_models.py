"""What ``lowbit quantize`` and ``lowbit eval`` share: the --model argument, progress bars, JSON files.

Errors are reported by the command's central handler (lowbit.cli.main): one line, exit status 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

MODEL_HELP = ("'minilm' (the packaged all-MiniLM-L6-v2), a local Hugging Face model directory, or "
              "'module:function' returning (torch.nn.Module, input batch tensor)")


def progress(total: int | None, desc: str, unit: str):
    """A tqdm bar on stderr (shown only when stderr is a terminal; ``total`` None: a counter), or a no-op when
    tqdm is missing."""
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


def read_text_file(path: str, what: str) -> str:
    """The UTF-8 text of ``path``; ValueError naming the option ``what`` and the file when it is not UTF-8
    (FileNotFoundError / IsADirectoryError name the file themselves)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def read_json_file(path: str, what: str) -> dict:
    """A JSON object from ``path``; ValueError naming the file when it is not valid JSON or not an object."""
    try:
        value = json.loads(read_text_file(path, what))
    except (ValueError, RecursionError) as exc:  # (JSONDecodeError, the integer digits limit)
        raise ValueError(f"{what} {path} is not valid JSON: {type(exc).__name__}: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} {path} must hold a JSON object, got {type(value).__name__}")
    return value
