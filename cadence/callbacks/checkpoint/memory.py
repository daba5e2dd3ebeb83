"""This process's host memory during a save: resident at its start and the most it held until its end.

Sampled (VmRSS, every 5 ms, by a thread) rather than read from the kernel's peak counter: resetting that
counter (/proc/self/clear_refs) would change what the user's own `ru_maxrss` or VmHWM says about the run.

>>> memory = PeakMemory().start(); ...save...; memory.stop(); memory.resident, memory.peak   # bytes, or None
"""

from __future__ import annotations

import os
import threading

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident() -> int | None:
    """The host memory this process holds now (bytes); None where the system does not say (no /proc)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class PeakMemory:
    """The most host memory this process holds between `start` and `stop`."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.resident = self.peak = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="checkpoint memory", daemon=True)

    def start(self) -> "PeakMemory":
        self.resident = self.peak = resident()
        if self.resident is not None:
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(self.interval):
            now = resident()
            if now is not None and now > self.peak:
                self.peak = now

    def stop(self) -> int | None:
        """Stop sampling; the peak (bytes)."""
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
        now = resident()
        if now is not None and self.peak is not None:
            self.peak = max(self.peak, now)
        return self.peak
