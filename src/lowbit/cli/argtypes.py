"""argparse ``type=`` functions that validate numbers and lists where they are parsed, so a bad value is a
one-line usage error naming the argument (exit 2) instead of a failure deep inside a command."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Callable, Iterable, TypeVar

T = TypeVar("T")


def _number(text: str, kind: Callable[[str], T], what: str, ok: Callable[[T], bool]) -> T:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _number(text, int, "a positive integer", lambda v: v >= 1)


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An integer >= ``minimum`` (and <= ``maximum`` where given)."""
    what = f"an integer from {minimum} to {maximum}" if maximum is not None else f"an integer >= {minimum}"
    return lambda text: _number(text, int, what, lambda v: v >= minimum and (maximum is None or v <= maximum))


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    return _number(text, int, "a non-negative integer", lambda v: v >= 0)


def nonnegative_float(text: str) -> float:
    """A float >= 0 (infinity allowed, NaN not)."""
    return _number(text, float, "a non-negative number", lambda v: v >= 0)


def seed(text: str) -> int:
    """A numpy seed: an integer in [0, 2**32)."""
    return _number(text, int, "an integer seed in [0, 2**32)", lambda v: 0 <= v < 2**32)


def comma_list(item: Callable[[str], T]) -> Callable[[str], list[T]]:
    """'a,b,c' -> [item('a'), item('b'), item('c')]; at least one item, none empty."""

    def parse(text: str) -> list[T]:
        parts = text.split(",")
        if not all(p.strip() for p in parts):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list without empty items, got {text!r}")
        return [item(p.strip()) for p in parts]

    return parse


def one_of(choices: Iterable[str]) -> Callable[[str], str]:
    """One of ``choices`` (for items of a :func:`comma_list`)."""
    choices = list(choices)

    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(choices)}, got {text!r}")
        return text

    return parse


MAX_REPEATS = 1_000_000  # timed samples per case: far more than any benchmark here needs
MAX_ELEMENTS = 1 << 40  # far beyond any memory here, and within torch's int64 sizes


def element_count(named: dict[str, int], multiple_of: int = 1) -> Callable[[str], int]:
    """A named size ('1M') or a positive integer up to MAX_ELEMENTS, a multiple of ``multiple_of``."""

    def parse(text: str) -> int:
        n = named[text] if text in named else positive_int(text)
        if n > MAX_ELEMENTS:
            raise argparse.ArgumentTypeError(f"expected at most 2**40 elements, got {text!r}")
        if n % multiple_of:
            raise argparse.ArgumentTypeError(f"expected a multiple of {multiple_of}, got {text!r}")
        return n

    return parse


def dims(count: int, sep: str = "x") -> Callable[[str], tuple[int, ...]]:
    """'1x2x3' -> (1, 2, 3): exactly ``count`` positive integers."""

    def parse(text: str) -> tuple[int, ...]:
        parts = text.split(sep)
        if len(parts) != count:
            raise argparse.ArgumentTypeError(f"expected {count} positive integers joined by {sep!r}, got {text!r}")
        return tuple(positive_int(p) for p in parts)

    return parse


def _writable_place(path: Path, kind: str) -> None:
    """ArgumentTypeError unless a ``kind`` ("file" or "directory") could be written at ``path``: it is not an
    existing entry of the other kind, and its nearest existing ancestor is a directory this process may write in
    (checked before a command's work, so a long run does not fail at its end)."""
    try:
        if kind == "file" and path.is_dir():
            raise argparse.ArgumentTypeError(f"{path} is a directory, expected a file name")
        if kind == "directory" and path.exists() and not path.is_dir():
            raise argparse.ArgumentTypeError(f"{path} exists and is not a directory")
        parent = path.absolute().parent
        while not parent.exists():
            parent = parent.parent
        writable = parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)
    except OSError as exc:  # a folder on the way this process may not search
        raise argparse.ArgumentTypeError(f"cannot write {path}: {exc.strerror or exc}") from None
    if not writable:
        raise argparse.ArgumentTypeError(f"cannot write {path}: {parent} is not a directory this process may write in")


def output_file(text: str) -> str:
    """A file to write ('' for none, '-' for stdout), checked with :func:`_writable_place`."""
    if text not in ("", "-"):
        _writable_place(Path(text), "file")
    return text


def output_dir(text: str) -> str:
    """A directory to write, checked with :func:`_writable_place`."""
    if not text:
        raise argparse.ArgumentTypeError("expected a directory name, got ''")
    _writable_place(Path(text), "directory")
    return text
