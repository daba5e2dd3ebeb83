"""ProgressCallback: a live bar and an epoch table on a terminal, one plain line per epoch elsewhere.

Attached to every Learner by default; output comes from the main process only.

>>> learn.fit(3)                    # terminal: live bar with the running loss, a results row per epoch
>>> with learn.no_bar(): learn.fit(1)
>>> with learn.no_logging(): learn.fit(1)     # the bar without the results rows (fastai's)
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING

from ..trainer.callback import Callback, Order
from ..trainer.data import n_batches

if TYPE_CHECKING:
    from rich.console import Console


def format_value(name: str, value) -> str:
    """How one results cell is shown: durations as m:ss, epochs as ints, floats with 6 digits."""
    if value is None:
        return "-"
    if name == "time":
        return f"{int(value // 60):02d}:{value % 60:05.2f}"
    if isinstance(value, int):
        return str(value)
    return f"{value:.6f}"


def _plain_output() -> bool:
    """True when rich would find no terminal either (its checks, in its order), so rich need not be imported.

    Logs, CI and launched workers then print plain lines without importing rich (~60 ms). Workers that
    `notebook_launcher` started from a Jupyter kernel (`CADENCE_NOTEBOOK_OUTPUT=1`) write into a cell: plain
    lines too, though the kernel's `FORCE_COLOR=1` would make rich draw a terminal's bar there.
    """
    if os.environ.get("CADENCE_NOTEBOOK_OUTPUT") == "1":   # set by cadence.distributed.notebook
        return True
    tty_compatible = os.environ.get("TTY_COMPATIBLE", "")
    if tty_compatible in ("0", "1"):
        return tty_compatible == "0"
    force_color = os.environ.get("FORCE_COLOR")
    if force_color is not None:
        return force_color == ""
    try:
        return not sys.stdout.isatty()
    except (AttributeError, ValueError):  # no isatty, or stdout already closed
        return True


class ProgressCallback(Callback):
    """Show training progress: rich bar + table on a terminal, plain lines in logs and notebooks.

    >>> any(isinstance(cb, ProgressCallback) for cb in Learner(dls, model).cbs)   # every Learner has one; no_bar() hides it
    True
    """

    order = Order.REPORT

    def __init__(self, console: Console | None = None):
        self.console, self.active, self.live, self.in_fit = console, False, False, False
        self.task = self._xb_before = None  # the bar's current task; the learner's xb when it was added
        self._shown = 0  # the Recorder's rows printed (or not to print: a resumed run's earlier epochs)

    @contextlib.contextmanager
    def fit_context(self):
        """During a fit the rows are this display's to show, not `learn.logger`'s (fastai's ProgressCallback takes
        the logger over the same way); `no_bar()` leaves them to it."""
        logger, self.learn.logger = self.learn.logger, _shown_by_progress
        try:
            yield
        finally:
            self.learn.logger = logger

    def before_fit(self):
        self.in_fit = True
        self._shown = len(self.learn.recorder.values)   # a resumed run's earlier epochs were printed by that run
        self._start(header=True)

    def before_epoch(self):
        self._print_rows()   # the epochs fit(start_epoch=) skipped, recorded by now: fastai prints them first

    def _start(self, header: bool):
        self.active = self.learn.strategy.is_main
        if not self.active:
            return
        if self.console is None and _plain_output():
            self.live = False
        else:
            from rich.console import Console

            self.console = self.console or Console()
            self.live = self.console.is_terminal and not self.console.is_jupyter  # notebooks get plain lines
        self.names = self.learn.recorder.metric_names
        self.widths = [max(len(n), 10) for n in self.names]
        if self.live:
            if header and self._epoch_lines():
                self.console.print("  ".join(n.rjust(w) for n, w in zip(self.names, self.widths)), style="bold")
            from .live_bar import live_bar

            self.bar = live_bar(self.console, self._poll)
            self.bar.start()

    def _epoch_lines(self) -> bool:
        """Whether epoch results are printed: not inside `learn.no_logging()` or `learn.no_mbar()` (fastai's)."""
        return self.learn.log_epochs and self.learn.create_mbar

    def _start_bar(self, what: str):
        if self.active and self.live:
            in_epoch = self.in_fit and self.learn.create_mbar  # no_mbar(): the pass's bar alone, as fastai's
            desc = f"epoch {self.learn.epoch + 1}/{self.learn.n_epoch} {what}" if in_epoch else what
            self._xb_before = self.learn.xb  # the loop has not started this loader while xb is still this object
            self.task = self.bar.add_task(desc, total=n_batches(self.learn.dl), loss="")

    def _poll(self):
        """Copy the batch counter and loss from the learner into the bar (called by the bar as it redraws)."""
        task, learn = self.task, self.learn
        if task is None or learn is None or learn.xb is self._xb_before:
            return
        loss = learn.loss
        try:
            self.bar.update(task, completed=learn.iter + 1, loss="" if loss is None else f"loss {float(loss):.4f}")
        except KeyError:  # the task ended while this redraw was starting
            pass

    def before_train(self):
        self._start_bar("train")

    def before_validate(self):
        if not self.in_fit:  # learn.validate() on its own
            self._start(header=False)
        self._start_bar("valid")

    def _end_bar(self):
        if self.active and self.live and self.task is not None:
            self.bar.refresh()  # draws the final count before the results row replaces the bar
            task, self.task = self.task, None
            self.bar.remove_task(task)

    def after_train(self):
        self._end_bar()

    def after_validate(self):
        self._end_bar()
        if not self.in_fit:
            self._stop()

    def after_epoch(self):
        self._print_rows()

    def _print_rows(self):
        """Print the Recorder's rows not printed yet: the epoch's, or those of the epochs skipped before it."""
        values = self.learn.recorder.values
        rows, self._shown = values[self._shown:], len(values)
        if not self.active or not self._epoch_lines():
            return
        for row in rows:
            if self.live:   # a skipped epoch's row (empty, as fastai's) is blank but for its epoch and time
                cells = [("" if not row and n not in row else format_value(n, row.get(n))).rjust(w)
                         for n, w in zip(self.names, self.widths)]
                self.console.print("  ".join(cells), highlight=False)
            else:
                line = " | ".join(f"{n} {format_value(n, row.get(n))}" for n in self.names if n in row.keys())
                print(line + "\n", end="", flush=True)  # one write: other processes' lines cannot split it

    def after_fit(self):
        self._stop()
        self.in_fit = False

    def _stop(self):
        if self.active and self.live:
            self.bar.stop()
        self.active = self.live = False


def _shown_by_progress(row: list) -> None:
    """`learn.logger` while a ProgressCallback shows the rows itself."""
