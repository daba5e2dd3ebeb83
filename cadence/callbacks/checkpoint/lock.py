"""One job per checkpoint directory: an exclusive lock on `<dir>/.lock`, held for the whole fit.

Two jobs writing one directory corrupt it (each prunes and cleans what the other is writing), so
the second is refused at its start with the holder's pid, host, command and start time. The
lock is `flock(2)` on the open file: the kernel releases it when the holding process ends, a
SIGKILL included, so a dead job never blocks the next one. The holder removes the file before
it unlocks, and a job that locked a file already removed tries again: two jobs never hold two
different files.

>>> with DirectoryLock("checkpoints"):      # RuntimeError naming the holder if another job has it
...     learn.fit(3)
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

LOCK_FILE = ".lock"


class DirectoryLock:
    """The lock of checkpoint directory `root` (created if needed); `acquire` raises if another job holds it."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self._fd: int | None = None

    def acquire(self) -> None:
        path = self.root / LOCK_FILE
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 4096, 0).decode(errors="replace")
                os.close(fd)
                raise RuntimeError(f"{self.root} is in use by another job ({describe(holder)}): two jobs writing "
                                   f"one checkpoint directory corrupt each other's checkpoints. Wait for it to end, "
                                   f"or give this job its own Checkpoint(dir=...)") from None
            except BaseException:
                os.close(fd)
                raise
            if _same_file(fd, path):
                break
            os.close(fd)  # locked a file its holder removed meanwhile: lock the one now at `path`
        me = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv),
              "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            (self.root / LOCK_FILE).unlink(missing_ok=True)  # before unlocking: see acquire
            fcntl.flock(fd, fcntl.LOCK_UN)  # also for DataLoader workers forked meanwhile, which share the file
            os.close(fd)

    def __enter__(self) -> "DirectoryLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def describe(holder: str) -> str:
    """"pid 123 on host gpu7 since 2026-01-01 10:00:00 UTC, command: train.py --lr 1e-3" from the lock file's text."""
    try:
        h = json.loads(holder)
        return f"pid {h['pid']} on host {h['host']} since {h['since']}, command: {h['command']}"
    except (ValueError, TypeError, KeyError):
        return "its details are not written yet"
