"""Progress of long work on stderr, so that a step of a minute never looks like a hang and stdout keeps only the output:
a live bar (or a spinner where the amount is unknown) with the time spent, in a terminal; elsewhere rich draws no live
display and prints the bar's last state once the work ends."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


@contextmanager
def progress(description: str, total: int | None = None) -> Iterator[Callable[[int], None]]:
    """Yield `advance(n)` for `description`: a bar of `total` steps, or a spinner with the elapsed time when the
    amount is not known (None)."""
    columns = ((TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()) if total is not None
               else (SpinnerColumn(), TextColumn("{task.description}")))
    with Progress(*columns, TimeElapsedColumn(), console=Console(stderr=True)) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)
