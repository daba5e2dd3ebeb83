"""A checkpoint being written: a thread of every rank writes its part, and the ranks agree when all parts are in.

The main thread never blocks in a collective while a disk writes: it asks (`poll`, one small
all-reduce over the ranks) whether every rank's writer is done, and only then does the main
process commit (state.json, rename into place). Waiting (`wait`) is the same question asked
every second, so no collective outlasts the disk and a slow disk is named with the time it has
taken, not reported as a hung rank; past `io_timeout` the save fails. A failed write fails
every rank with a message naming the checkpoint.

>>> save = BackgroundWrite(staged_save, strategy, io_timeout=3600).start()
>>> ...training goes on...; save.poll()    # True once the checkpoint is complete and visible
>>> save.wait()                            # or block until it is
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...disk import format_size
from ...distributed.env import is_initialized, rank, world_size
from ...distributed.ops import main_print
from .memory import PeakMemory

RUNNING, DONE, FAILED = 0, 1, 2
POLL_S = 1.0        # how long a waiting rank listens to its own writer before asking the others again
SLOW_NOTICE_S = 60  # a save still being written after this long is said in the log, then every as long again


class BackgroundWrite:
    """`staged` (with `write()`, this rank's files, and `commit()`, the main process's last step) written by a
    thread; `directory` names the checkpoint in every message."""

    def __init__(self, staged: Any, strategy: Any, io_timeout: float | None, directory: Path,
                 on_commit: Callable[[], None] | None = None, report: bool = False, blocking: bool = True,
                 since: float | None = None, memory: PeakMemory | None = None, waited_s: float = 0.0,
                 staging: Any = None):
        self.staged, self.strategy, self.io_timeout, self.directory = staged, strategy, io_timeout, directory
        self.on_commit, self.report, self.blocking = on_commit, report, blocking
        self.since = time.perf_counter() if since is None else since  # when the loop stopped for this save
        self.memory = memory      # sampling this process's host memory since the save began
        self.held_s = 0.0         # how long the training loop was held: until `start` (async) or the commit
        self.waited_s = waited_s  # of which waiting for the save before this one
        self.staging = staging    # the copy the loop waits for before the next step (`Staging`); its wait is held
        self.stats: dict[str, Any] = {}  # once committed: `_measure`, and on the main process "bytes"
        self.error: BaseException | None = None
        self.committed = False
        self._done = threading.Event()  # set once `staged.write()` returned or raised (`in_background`'s event)
        self._started = 0.0
        self._next_notice = SLOW_NOTICE_S

    def start(self) -> "BackgroundWrite":
        self._started = time.monotonic()
        self.held_s = time.perf_counter() - self.since
        self._done = in_background(self._run)
        return self

    def _run(self) -> None:
        try:
            self.staged.write()
        except BaseException as e:  # handed to the main thread: a background failure is never lost
            self.error = e

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def poll(self) -> bool:
        """Every rank, at the same point: True once every rank's part is written and the checkpoint committed.
        Raises (every rank) when a rank's write failed or outlasted `io_timeout`."""
        if self.committed:
            return True
        states, late = self._agree()
        if FAILED in states:
            self._fail(states)
        if all(s == DONE for s in states):
            self._commit()
            return True
        self._check_time(states, late)
        return False

    def wait(self) -> None:
        """Block until the checkpoint is committed (every rank), saying so in the log while a slow disk takes long."""
        while not self.committed:
            self._done.wait(POLL_S)
            self.poll()

    def join_local(self, timeout: float | None) -> None:
        """After a failure elsewhere (no collective can be trusted): let this rank's own writer finish its files."""
        self._give_up()
        self._done.wait(timeout)

    def _give_up(self) -> None:
        self.committed = True  # nothing more to wait for
        if self.memory is not None:
            self.memory.stop()

    def _agree(self) -> tuple[list[int], bool]:
        """(every rank's writer state, whether the main process's clock says `io_timeout` has passed): the same
        on every rank, so all of them give up at the same poll."""
        mine = FAILED if self.error is not None else DONE if self._done.is_set() else RUNNING
        late = self.io_timeout is not None and self.elapsed > self.io_timeout
        if not is_initialized() or world_size() == 1:
            return [mine], late
        states = torch.zeros(world_size() + 1, dtype=torch.int32, device=self.strategy.device)
        states[rank()] = mine
        states[-1] = int(late and rank() == 0)
        dist.all_reduce(states)
        return states[:-1].tolist(), bool(states[-1])

    def _fail(self, states: list[int]) -> None:
        self._give_up()
        if self.error is not None:
            if isinstance(self.error, OSError):
                raise self.error
            raise RuntimeError(f"Checkpoint: writing {self.directory} failed: {self.error!r}") from self.error
        failed = [r for r, s in enumerate(states) if s == FAILED]
        raise RuntimeError(f"Checkpoint: writing {self.directory} failed on rank(s) {failed} (their error says why); "
                           f"the checkpoint was not made visible")

    def _check_time(self, states: list[int], late: bool) -> None:
        t = self.elapsed
        slow = [r for r, s in enumerate(states) if s == RUNNING]
        if late:
            self._give_up()
            raise TimeoutError(f"Checkpoint: writing {self.directory} took more than io_timeout={self.io_timeout:g} s "
                               f"({t:.0f} s; rank(s) {slow} not done): the disk is too slow or stuck. The checkpoint "
                               f"was not made visible; raise Checkpoint(io_timeout=...) or write to a faster disk")
        if t >= self._next_notice:
            self._next_notice += SLOW_NOTICE_S
            main_print(f"Checkpoint: {self.directory} is still being written after {t:.0f} s (rank(s) {slow} not "
                       f"done); a slow disk? (it fails after io_timeout={self.io_timeout} s)", file=sys.stderr)

    def _measure(self) -> dict[str, Any]:
        """What this save cost on this rank: seconds from the loop's stop for it to its commit (with what the engine
        wrote at the save point; not the wait for the save before), how long the loop was held, the peak and the
        resident host memory before the save (bytes; None where the system does not say)."""
        since_stop = time.perf_counter() - self.since
        if self.blocking:
            self.held_s = since_stop
        seconds = since_stop - self.waited_s
        copy_wait = self.staging.waited_s if self.staging is not None else 0.0
        return {"name": self.directory.name, "seconds": seconds, "held_s": self.held_s + copy_wait,
                "waited_s": self.waited_s, "copy_wait_s": copy_wait,
                "peak": self.memory.stop() if self.memory else None,
                "resident": self.memory.resident if self.memory else None}

    def _summary(self) -> str:
        """"Checkpoint: step-00000200 written: 1.2 GiB in 3.1 s (390 MiB/s), the loop held 0.04 s; peak host memory
        2.3 GiB, 1.05x the 2.2 GiB before the save" (the main process's part and memory)."""
        m, size = self.stats, self.stats["bytes"]
        line = (f"Checkpoint: {m['name']} written: {format_size(size)} in {m['seconds']:.2f} s "
                f"({format_size(int(size / max(m['seconds'], 1e-9)))}/s), the loop held {m['held_s']:.2f} s" +
                (f" ({m['waited_s']:.2f} s of it for the save before)" if m["waited_s"] >= 0.005 else "") +
                (f" ({m['copy_wait_s']:.2f} s of it for the copy, before the next step)"
                 if m["copy_wait_s"] >= 0.005 else ""))
        if m["peak"] is not None and m["resident"]:
            line += (f"; peak host memory {format_size(m['peak'])}, {m['peak'] / m['resident']:.2f}x the "
                     f"{format_size(m['resident'])} before the save")
        return line

    def _commit(self) -> None:
        error = None
        self.stats = self._measure()
        if self.strategy.is_main:
            try:
                self.staged.commit()
                self.stats["bytes"] = sum(p.stat().st_size for p in self.directory.rglob("*") if p.is_file())
            except BaseException as e:
                error = e
            if error is None and self.on_commit is not None:
                try:  # the checkpoint is in place: what runs after it (pruning) warns, it does not fail the save
                    self.on_commit()
                except Exception as e:
                    warnings.warn(f"{self.directory} was saved, but what follows a save failed: {e!r}", stacklevel=2)
            if error is None and self.report:
                main_print(self._summary())
        failed = self.strategy.broadcast(None if error is None else repr(error))
        self.committed = True
        if error is not None:
            raise error
        if failed is not None:
            raise RuntimeError(f"Checkpoint: the main process could not commit {self.directory}: {failed}")


class _WriterThreads:
    """The threads that write checkpoints, kept from one save to the next: handing an idle one a write costs the
    loop nothing, where starting a thread per save waits for the new thread to be scheduled (ms on a busy host).
    A write finds an idle thread or starts one, so none waits behind a stuck one. A forked child starts its own."""

    def __init__(self):
        self._idle: list[queue.SimpleQueue] = []
        self._lock = threading.Lock()
        self._pid: int | None = None

    def submit(self, job: Callable[[], None]) -> None:
        """Run `job` (which handles its own errors) in a writer thread."""
        with self._lock:
            if self._pid != os.getpid():
                self._idle, self._pid = [], os.getpid()
            jobs = self._idle.pop() if self._idle else None
        if jobs is None:
            jobs = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(jobs,), name="checkpoint writer", daemon=True).start()
        jobs.put(job)

    def _serve(self, jobs: queue.SimpleQueue) -> None:
        while True:
            jobs.get()()
            with self._lock:
                self._idle.append(jobs)


_WRITER = _WriterThreads()


def in_background(job: Callable[[], None]) -> threading.Event:
    """Run `job` in a writer thread (its errors its own); the event is set once it returned.

    >>> done = in_background(lambda: shutil.rmtree(tomb, ignore_errors=True)); ...; done.wait()
    """
    done = threading.Event()

    def run() -> None:
        try:
            job()
        finally:
            done.set()
    _WRITER.submit(run)
    return done
