"""Human views of the ``lowbit`` commands' reports (rich), beside the JSON the commands print for scripts.

Each ``*_view`` function (render.smoke, render.rows, render.summary) is pure: it takes the same dict (or
rows) that the command prints as JSON and returns a rich renderable whose last line is a one-line verdict.
:func:`emit` prints one: styled on a terminal, plain text (no ANSI codes, no trailing spaces) otherwise;
rich also honours ``NO_COLOR``. docs/cli.md, "Output".
"""

from __future__ import annotations

import io
import sys
from typing import IO

from rich.console import Console, RenderableType
from rich.text import Text

WIDTH_WHEN_NOT_A_TERMINAL = 100  # columns of the plain-text rendering (a pipe, a file, a CI log)

STYLE = {"ok": "bold green", "warn": "bold yellow", "bad": "bold red", "dim": "dim"}


def console(file: IO[str] | None = None, *, width: int | None = None, terminal: bool | None = None) -> Console:
    """A console writing to ``file`` (default stdout). ``terminal`` None: colour only if ``file`` is a tty."""
    file = sys.stdout if file is None else file
    is_tty = file.isatty() if terminal is None else terminal
    if not is_tty and width is None:
        width = WIDTH_WHEN_NOT_A_TERMINAL
    return Console(file=file, width=width, force_terminal=terminal, highlight=False, emoji=False,
                   markup=False, soft_wrap=False)


def to_text(view: RenderableType, width: int = WIDTH_WHEN_NOT_A_TERMINAL) -> str:
    """``view`` as plain text ``width`` columns wide: no ANSI codes, no trailing spaces, ending in a newline."""
    out = console(io.StringIO(), width=width, terminal=False)
    with out.capture() as captured:
        out.print(view, crop=False)
    return "".join(line.rstrip() + "\n" for line in captured.get().splitlines())


def emit(view: RenderableType, file: IO[str] | None = None) -> None:
    """Print ``view`` to ``file`` (default stdout): styled on a terminal, else as :func:`to_text`."""
    file = sys.stdout if file is None else file
    if file.isatty():
        console(file).print(view, crop=False)
    else:
        file.write(to_text(view))
        file.flush()


def verdict(text: str, tone: str) -> Text:
    """The verdict that ends every view: one line however long (never wrapped: ``tail -n 1`` gets all of
    it; a terminal folds it on screen); ``tone`` is 'ok', 'warn' or 'bad' (its colour)."""
    return Text(" ".join(text.split()), style=STYLE[tone], no_wrap=True, overflow="ignore")


def shorten(text: str, limit: int) -> str:
    """``text`` on one line, cut to ``limit`` characters with an ellipsis."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def human_bytes(n: int | None) -> str:
    """'12.50 MiB' for 13107200; '?' for None."""
    if n is None:
        return "?"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
