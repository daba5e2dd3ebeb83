"""One job per checkpoint directory: an exclusive lock on `<dir>/.lock`, held for the whole fit.

Two jobs writing one directory corrupt it (each prunes and cleans what the other is writing), so
the second is refused at its start with the holder's pid, host, command and start time. The
lock is `flock(2)` on the open file: the kernel releases it when the holding process ends, a
SIGKILL included, so a dead job never blocks the next one. The holder removes the file before
it unlocks, and a job that locked a file already removed tries again: two jobs never hold two
different files. The file is written only as a regular file of its own (0o600): a symbolic link or
anything else at its name is refused, naming it, and never written through.

>>> with DirectoryLock("checkpoints"):      # RuntimeError naming the holder if another job has it
...     learn.fit(3)
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time
import warnings
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
            fd = _open_lock(path, self.root)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if isinstance(e, BlockingIOError):
                    holder = os.pread(fd, 4096, 0).decode(errors="replace")
                    os.close(fd)
                    raise RuntimeError(f"{self.root} is in use by another job ({describe(holder)}): two jobs writing "
                                       f"one checkpoint directory corrupt each other's checkpoints. Wait for it to "
                                       f"end, or give this job its own Checkpoint(dir=...)") from None
                os.close(fd)
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                warnings.warn(f"{self.root} is on a filesystem without locks ({e.strerror}): a second job writing "
                              f"there would not be detected; run one job per checkpoint directory", stacklevel=3)
                return
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
        """Unlock, whatever happens to the lock file: a directory that became read-only (the reason a save
        failed, most likely) keeps the file, which the next `acquire` locks and takes over."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                (self.root / LOCK_FILE).unlink(missing_ok=True)  # before unlocking: see acquire
            except OSError:
                pass
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)  # also for DataLoader workers forked meanwhile, which share the file
                os.close(fd)

    def __enter__(self) -> "DirectoryLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _open_lock(path: Path, root: Path) -> int:
    """`path` opened for reading and writing (created 0o600: it records the command line), never through a
    symbolic link and only as a regular file of one name: writing the lock truncates it, so a link planted in a
    shared directory would destroy the file it points to. Anything else there is refused, naming it.

    >>> fd = _open_lock(Path("checkpoints/.lock"), Path("checkpoints"))   # RuntimeError if it is a link
    """
    def refuse(what: str) -> RuntimeError:
        return RuntimeError(f"{path} is {what}, not the lock file cadence writes there: locking {root} would "
                            f"overwrite it. Remove {path} (nothing of the checkpoints is in it) and start again")

    if path.is_symlink():
        raise refuse(f"a symbolic link (to {os.readlink(path)})")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:  # a link made since the check above
            raise refuse("a symbolic link") from None
        if e.errno == errno.EISDIR:
            raise refuse("not a regular file") from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(fd)
        raise refuse("not a regular file" if not stat.S_ISREG(info.st_mode) else
                     f"a file with {info.st_nlink} names (a hard link to another file)")
    if stat.S_IMODE(info.st_mode) & 0o077 and info.st_uid == os.getuid():  # left by an older cadence
        os.fchmod(fd, 0o600)
    return fd


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
