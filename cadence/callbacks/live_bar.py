"""The rich bar ProgressCallback draws on a terminal; imported only when a terminal shows it.

>>> bar = live_bar(Console(), poll=lambda: None); bar.start(); task = bar.add_task("train", total=10, loss="")
"""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class _PolledProgress(Progress):
    """A rich Progress that asks `poll` for the latest numbers each time it redraws (5 times a second).

    The training loop never calls the bar, so a live bar costs nothing per batch.
    """

    def __init__(self, poll: Callable[[], None], *columns, **kwargs):
        self.poll = poll  # set first: rich renders once while constructing
        super().__init__(*columns, **kwargs)

    def get_renderables(self):
        self.poll()
        yield from super().get_renderables()


def live_bar(console: Console, poll: Callable[[], None]) -> _PolledProgress:
    """Description, bar, n/total, elapsed, remaining and the loss (a task field `loss`), redrawn every 0.2 s."""
    return _PolledProgress(poll, TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[loss]}"),
                          console=console, transient=True, refresh_per_second=5)
