"""This process's host memory during a save: resident at its start and the most it held until its end.

Sampled (VmRSS, every 5 ms, by a thread) rather than read from the kernel's peak counter: resetting that
counter (/proc/self/clear_refs) would change what the user's own `ru_maxrss` or VmHWM says about the run.

>>> memory = PeakMemory().start(); ...save...; memory.stop(); memory.resident, memory.peak   # bytes, or None
"""

from __future__ import annotations

import os
import threading
import time

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

    def start(self) -> "PeakMemory":
        self.resident = self.peak = resident()
        if self.resident is not None:
            _SAMPLER.watch(self)
        return self

    def sample(self, now: int) -> None:
        if now > self.peak:
            self.peak = now

    def stop(self) -> int | None:
        """Stop sampling; the peak (bytes)."""
        _SAMPLER.forget(self)
        now = resident()
        if now is not None and self.peak is not None:
            self.peak = max(self.peak, now)
        return self.peak


class _Sampler:
    """One thread per process that samples the memory while some `PeakMemory` watches, and sleeps otherwise:
    started once, so a save does not wait for a new thread to be scheduled. A forked child starts its own."""

    def __init__(self):
        self._watching: set[PeakMemory] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._pid: int | None = None

    def watch(self, meter: PeakMemory) -> None:
        with self._lock:
            if self._pid != os.getpid():
                self._pid, self._watching, self._wake = os.getpid(), set(), threading.Event()
                threading.Thread(target=self._run, args=(self._wake,), name="checkpoint memory", daemon=True).start()
            self._watching.add(meter)
            self._wake.set()

    def forget(self, meter: PeakMemory) -> None:
        with self._lock:
            self._watching.discard(meter)

    def _run(self, wake: threading.Event) -> None:
        while True:
            wake.wait()
            with self._lock:
                meters = list(self._watching)
                if not meters:
                    wake.clear()
                    continue
            now = resident()
            if now is not None:
                for meter in meters:
                    meter.sample(now)
            time.sleep(min(m.interval for m in meters))


_SAMPLER = _Sampler()
