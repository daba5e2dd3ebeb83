"""Preemption: SIGTERM or SIGUSR1 becomes a checkpoint at the next optimizer step on every rank, then an exit.

The handler only records the signal. At every optimizer step the ranks agree whether any of
them got one (`AgreedFlag`: a non-blocking all-reduce read one step later), so all of them
checkpoint the same step. The process then exits with 128 + the signal's number (143 for
SIGTERM), the status schedulers requeue on; `fit(resume="auto")` continues the run.

A SIGTERM that comes after another rank has failed is not a preemption: it is `cadence launch`
ending the group, and no step will come to save at. The rank then dies by it at once, as it
would without a Checkpoint (`status.peer_failed`).

>>> watch = PreemptionWatch(["SIGTERM", "SIGUSR1"], device="cpu")
>>> with watch.installed():             # handlers in place for the fit, the previous ones restored after
...     ...
...     if (sig := watch.agreed()): save(); raise SystemExit(128 + sig)
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterable, Iterator

import torch

from ...distributed import status
from ...distributed.flag import AgreedFlag


DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")   # what schedulers send before they kill (SLURM: --signal=USR1)


def parse_signals(signals: Iterable[str | int] | str | None) -> tuple[signal.Signals, ...]:
    """("SIGTERM", "USR1", 10) -> the signals; ValueError naming any that this system does not have.

    The default keeps those of DEFAULT_SIGNALS this system has (Windows has no SIGUSR1).
    """
    if signals is None:
        return ()
    if signals == DEFAULT_SIGNALS:
        signals = [s for s in DEFAULT_SIGNALS if hasattr(signal, s)]
    out = []
    for s in [signals] if isinstance(signals, (str, int)) else signals:
        try:
            out.append(signal.Signals(s) if isinstance(s, int) else signal.Signals[s if s.startswith("SIG") else f"SIG{s}"])
        except (KeyError, ValueError, AttributeError):
            raise ValueError(f"preempt_on: {s!r} is not a signal on this system; use names such as "
                             f"'SIGTERM' or 'SIGUSR1', or preempt_on=None to handle none") from None
    if signal.SIGKILL in out or signal.SIGSTOP in out:
        raise ValueError("preempt_on cannot include SIGKILL or SIGSTOP: no process can catch them")
    return tuple(out)


class PreemptionWatch:
    """Records the preemption signals during a fit and says, in agreement across ranks, when one came."""

    def __init__(self, signals: Iterable[signal.Signals], device: torch.device | str = "cpu"):
        self.signals = tuple(signals)
        self.received: signal.Signals | None = None   # by this process
        self.acted_on: signal.Signals | None = None   # agreed by every process
        self._flag = AgreedFlag(device)

    @contextlib.contextmanager
    def installed(self) -> Iterator["PreemptionWatch"]:
        """Handle the signals inside the block (main thread only); restore the previous handlers on any exit.

        A signal received but never acted on (the fit ended first) is delivered again to the
        previous handler, so it is not lost.
        """
        if not self.signals or threading.current_thread() is not threading.main_thread():
            yield self
            return
        self.received, self.acted_on = None, None
        previous = {s: signal.signal(s, self._record) for s in self.signals}
        try:
            yield self
            self._flag.finish()
        except BaseException:
            self._flag.abandon()  # another rank may have failed: its part of the collective may never come
            raise
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        if self.received is not None and self.acted_on is None:
            signal.raise_signal(self.received)

    def _record(self, signum: int, frame) -> None:
        if self.acted_on is None and status.peer_failed():    # the launcher tears the group down after a failure
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        self.received = signal.Signals(signum)

    def agreed(self) -> signal.Signals | None:
        """At an optimizer step (every rank): the signal some rank received, once all ranks know it; else None."""
        value = self._flag.check(int(self.received or 0))
        if not value:
            return None
        self._flag.finish()  # every rank stops here: leave no collective in flight
        self.acted_on = signal.Signals(value)
        return self.acted_on
