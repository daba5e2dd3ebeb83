"""A launched worker's standard streams written a whole line at a time, so the lines of ranks sharing a terminal or
pipe never mix.

Line buffering alone is not enough: a write that holds a newline goes out at once, the unfinished line after it
included, so `print("a\\nb")` (its text, then its newline, written apart) lets another rank's line in between "b"
and its newline. Here the text up to a write's last newline goes out in one `os.write` and the rest waits for its
newline or a flush.

>>> write_whole_lines()  # in a worker, before the user's script runs
"""

from __future__ import annotations

import io
import os
import sys
import threading


class WholeLines(io.RawIOBase):
    """The file descriptor `fd` written whole lines at a time (what follows the last newline waits for the next one,
    or for `flush`).

    >>> out = io.TextIOWrapper(WholeLines(1), write_through=True); out.write("a\\nb"); out.write("\\n")
    """

    def __init__(self, fd: int):
        super().__init__()
        self._fd, self._pending, self._lock = fd, bytearray(), threading.Lock()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return os.isatty(self._fd)

    def write(self, data: bytes) -> int:
        with self._lock:
            self._pending += data
            end = self._pending.rfind(b"\n") + 1
            if end:
                self._send(end)
        return len(data)

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                self._send(len(self._pending))

    def _send(self, end: int) -> None:
        out, self._pending = bytes(self._pending[:end]), self._pending[end:]
        while out:
            out = out[os.write(self._fd, out):]


def write_whole_lines() -> None:
    """`sys.stdout` and `sys.stderr` (when they are files) replaced by text streams over `WholeLines`; the streams
    they replace (still `sys.__stdout__`, `sys.__stderr__` and those handed out before) line-buffered."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, io.TextIOWrapper):
            continue
        stream.flush()
        stream.reconfigure(line_buffering=True, write_through=False)
        setattr(sys, name, io.TextIOWrapper(WholeLines(stream.fileno()), encoding=stream.encoding,
                                            errors=stream.errors, write_through=True))
