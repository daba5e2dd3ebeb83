"""How a worker process ends: with its launcher, and never through interpreter finalization.

A process that reaches interpreter finalization while a gloo process group (or a DDP model
holding one) is alive can die with SIGABRT or hang: gloo's worker threads drop work objects
whose tensors need the GIL while the interpreter is being torn down (torch PR 179291). So a
cadence worker leaves with `os._exit` once its script is over: `exit_now` runs what a normal
exit runs first (non-daemon threads joined, atexit handlers, streams flushed), then skips
finalization. Workers started by `cadence launch` / `notebook_launcher` call it themselves;
under plain torchrun, `setup_distrib` installs `install_exit_guard`, an atexit handler that does
the same with the script's exit code.

The launcher's side: once a worker has failed, torch's agent SIGTERMs the others and waits 30 s
before SIGKILL; `kill_survivors_of_failure` SIGKILLs those still there after a short grace (a
stopped rank, or one stuck in C code, cannot act on SIGTERM), so a hung job ends soon after its timeout.

>>> die_with_parent(os.getppid())     # in a worker: SIGKILL when the launcher goes away   # doctest: +SKIP
>>> exit_now(0)                                                                           # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

from cadence.distributed import status

_PR_SET_PDEATHSIG = 1
TEARDOWN_GRACE_S = 3.0     # after a worker failed: what the others get to end on SIGTERM before SIGKILL
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


@contextlib.contextmanager
def kill_survivors_of_failure(status_dir: str, grace_s: float = TEARDOWN_GRACE_S, poll_s: float = 0.2) -> Iterator[None]:
    """In the launcher, around torch's agent: once a worker has failed (`status.failed_ranks`), SIGKILL the
    workers of its group still alive `grace_s` seconds later (and their process groups, as the agent
    does). A group restarted after the failure (`--max_restarts`) is a new group, left alone.

    The agent sends SIGTERM at once; a worker that can act on it has ended by then. Only this
    process's own children are killed, so a pid reused since its status was written is left alone.

    >>> with kill_survivors_of_failure(status_dir):          # doctest: +SKIP
    ...     torchrun.run(agent_args)
    """
    stop = threading.Event()

    def watch() -> None:
        handled: set[int] = set()              # worker groups (torchrun's restart count) already torn down
        while not stop.wait(poll_s):
            failed = status.failed_ranks(status_dir)
            groups = {record.get("restart", 0) for record in failed.values()} - handled
            if not groups:
                continue
            handled |= groups
            survivors = {record["pid"] for rank, record in status.read_statuses(status_dir).items()
                         if rank not in failed and record.get("restart", 0) in groups}
            if stop.wait(grace_s):
                return
            for pid in survivors:
                if _is_child(pid):
                    _kill_group(pid)

    watcher = threading.Thread(target=watch, name="cadence-teardown", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()


def _is_child(pid: int) -> bool:
    """`pid` is a live (not yet reaped) child of this process."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid()
    except (OSError, IndexError, ValueError):
        return False


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)           # torch starts each worker in its own session
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
