"""Progress of slow commands on stderr (never on stdout, where reports and JSON go).

``with steps(total, "smoke") as step: step("hifloat8")`` shows one transient line, spinner, step name,
n/total and the elapsed time, from the first step until the block ends, and only when stderr is a terminal:
a pipe, a file or a CI log gets nothing. The line (and the thread that redraws it) starts at the first step,
so that what runs before it may fork worker processes (lowbit.kernels.cpu.warm).
"""

from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager
from typing import Callable, Iterator


@contextmanager
def steps(total: int, what: str) -> Iterator[Callable[..., None]]:
    """Yield ``step(name, counted=True)``: call it as each of ``total`` steps of ``what`` starts (a no-op off a
    terminal); an uncounted step (``counted=False``, a phase before the counted steps) shows its name without
    adding to n."""
    if not sys.stderr.isatty():
        yield lambda name, counted=True: None
        return
    from rich.console import Console
    from rich.progress import MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True, highlight=False, markup=False)
    columns = (SpinnerColumn(), TextColumn("{task.description}", markup=False), MofNCompleteColumn(),
               TimeElapsedColumn())
    with ExitStack() as shown:
        progress, task, started = None, None, 0

        def step(name: str, counted: bool = True) -> None:
            nonlocal progress, task, started
            if progress is None:  # the line's first drawing shows this step
                progress = Progress(*columns, console=console, transient=True)
                task = progress.add_task(f"{what}: {name}", total=total, completed=started)
                shown.enter_context(progress)
            progress.update(task, description=f"{what}: {name}", completed=started)
            started += counted

        yield step
