"""How a worker process ends: with its launcher, and never through interpreter finalization.

A process that reaches interpreter finalization while a gloo process group (or a DDP model
holding one) is alive can die with SIGABRT or hang: gloo's worker threads drop work objects
whose tensors need the GIL while the interpreter is being torn down (torch PR 179291). So a
cadence worker leaves with `os._exit` once its script is over: `exit_now` runs what a normal
exit runs first (non-daemon threads joined, atexit handlers, streams flushed), then skips
finalization. Workers started by `cadence launch` / `notebook_launcher` call it themselves;
under plain torchrun, `setup_distrib` installs `install_exit_guard`, an atexit handler that does
the same with the script's exit code.

>>> die_with_parent(os.getppid())     # in a worker: SIGKILL when the launcher goes away   # doctest: +SKIP
>>> exit_now(0)                                                                           # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import sys
import threading
from typing import NoReturn

_PR_SET_PDEATHSIG = 1
# set by run_worker and the notebook worker: they end the process themselves, no guard needed
SELF_EXITING_VAR = "CADENCE_WORKER_EXITS"


def die_with_parent(parent_pid: int) -> None:
    """Have Linux SIGKILL this process when its parent dies; exit at once if `parent_pid` already died.

    The parent may die before the request is made, so the parent pid is checked after it.
    Elsewhere than Linux this does nothing.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return
    if os.getppid() != parent_pid:
        os._exit(128 + int(signal.SIGKILL))


def exit_code(e: SystemExit) -> int:
    """The status Python gives `raise SystemExit(e.code)` (None: 0, a message: printed, 1)."""
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


def exit_now(code: int) -> NoReturn:
    """End this process with `code` without interpreter finalization.

    First what a normal exit does: join the non-daemon threads, run the atexit handlers, flush
    logging and the standard streams. Then `os._exit`, so no process group, DDP model or
    pending gloo work is ever destroyed while the interpreter is being torn down.
    """
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    try:
        atexit._run_exitfuncs()
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def install_exit_guard() -> None:
    """Make this process leave by `exit_now` when its script ends (plain torchrun + `setup_distrib`).

    The guard runs where Python's exit starts (with `threading`'s exit hooks, before non-daemon
    threads are joined and before atexit handlers, all of which `exit_now` then runs once); it
    exits with 1 when an exception ended the script (seen through `sys.excepthook`), else 0.
    A script that ends with `sys.exit(n)` exits 0 under this guard (the hook cannot see n);
    `cadence launch` keeps n.
    Does nothing in a worker that ends itself (`cadence launch`, `notebook_launcher`).
    """
    if os.environ.get(SELF_EXITING_VAR) == str(os.getpid()) or getattr(sys.excepthook, "__wrapped_by_cadence__", False):
        return
    previous = sys.excepthook

    def record_failure(*exc_info) -> None:
        os.environ["CADENCE_EXIT_STATUS"] = "1"
        previous(*exc_info)

    record_failure.__wrapped_by_cadence__ = True
    sys.excepthook = record_failure
    threading._register_atexit(_guard)      # private, but stable since 3.9 (concurrent.futures uses it)


def _guard() -> None:
    exit_now(int(os.environ.get("CADENCE_EXIT_STATUS", "0")))
