"""Progress of slow commands on stderr (never on stdout, where reports and JSON go).

``with steps(total, "smoke") as step: step("hifloat8")`` shows one transient line, spinner, step name,
n/total and the elapsed time, while the block runs, and only when stderr is a terminal: a pipe, a file or a
CI log gets nothing.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Iterator


@contextmanager
def steps(total: int, what: str) -> Iterator[Callable[[str], None]]:
    """Yield ``step(name)``: call it as each of ``total`` steps of ``what`` starts (a no-op off a terminal)."""
    if not sys.stderr.isatty():
        yield lambda name: None
        return
    from rich.console import Console
    from rich.progress import MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True, highlight=False, markup=False)
    columns = (SpinnerColumn(), TextColumn("{task.description}", markup=False), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(what, total=total, completed=0)
        started = [0]

        def step(name: str) -> None:
            progress.update(task, description=f"{what}: {name}", completed=started[0])
            started[0] += 1

        yield step
