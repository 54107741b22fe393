"""What the report commands share: the ``--json`` switch, strict JSON text, and where a file they write
may go (docs/cli.md, "Output")."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def add_json_flag(parser: argparse.ArgumentParser | argparse._ActionsContainer, what: str = "the report") -> None:
    """``--json`` on ``parser`` (or an argument group): print ``what`` as JSON (scripts, CI) instead of the
    human view."""
    parser.add_argument("--json", action="store_true",
                        help=f"print {what} as JSON (for scripts and CI) instead of the human summary")


def writable_path(name: str, option: str) -> Path:
    """``name`` as a Path to write; FileNotFoundError naming ``option`` if its directory does not exist."""
    path = Path(name)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{option} {name}: no directory {path.parent} to write {path.name} into")
    return path


def json_text(value) -> str:
    """``value`` as strict, indented JSON; non-finite floats (an infinite SQNR, a NaN output) become null."""
    return json.dumps(_finite_or_none(value), indent=2, allow_nan=False)


def _finite_or_none(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v) for v in value]
    return value
