"""Where each rank is, for the launcher's failure report: "rank 1 stopped responding during after_batch at step 12".

A daemon thread in each worker samples the main thread's stack twice a second and writes a
small JSON file per rank into `$CADENCE_STATUS_DIR` (made by `cadence launch`): the Learner
event being fired (found as the `_fire` frame, by name, so nothing here imports the trainer),
its step / epoch / iter, and the innermost frame of the user's own code. The training loop
itself pays nothing. When a run fails, the launcher reads the files back (`read_statuses`). A rank
that leaves to be requeued after a preemption signal says so (`record_preempted`), so the launcher
reports a preemption even when the signal reached one worker only, not the launcher. A worker whose
script is over records its exit code (`record_exit`), so that `failed_ranks` tells a worker that ended
in failure (gone with a non-zero code, or killed) from one that finished or left for a preemption.

>>> start_reporter("/tmp/status", rank=0)        # in a worker        # doctest: +SKIP
>>> read_statuses("/tmp/status")[0]["event"]                           # doctest: +SKIP
'after_batch'
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType

from ..processes import process_exists

STATUS_DIR_VAR = "CADENCE_STATUS_DIR"
_DIR_PREFIX = "cadence-status-"
_STALE_AFTER_S = 60.0            # a live run's workers rewrite their files twice a second
_LIBRARY_DIRS = tuple(str(Path(p).resolve()) + os.sep for p in {
    sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
    str(Path(__file__).resolve().parent.parent),       # cadence itself
})


def make_status_dir() -> str:
    """A new directory for this launcher's run, named after its pid.

    Those left by launchers that died without removing theirs (SIGKILL) go first: ours, untouched
    for a minute, and named after a process that no longer exists.
    """
    root = Path(tempfile.gettempdir())
    for old in root.glob(f"{_DIR_PREFIX}*-*"):
        pid = old.name[len(_DIR_PREFIX):].split("-", 1)[0]
        try:
            stale = (pid.isdigit() and old.stat().st_uid == os.getuid()
                     and time.time() - old.stat().st_mtime > _STALE_AFTER_S and not process_exists(int(pid)))
        except FileNotFoundError:       # another launcher removed it first
            continue
        if stale:
            shutil.rmtree(old, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-")


def start_reporter(directory: str | os.PathLike, rank: int, interval_s: float = 0.5) -> threading.Thread:
    """Start the daemon thread that writes `directory/rank<rank>.json` every `interval_s` seconds; an `os._exit`
    of this process records its exit code (`record_exit_on_os_exit`)."""
    record_exit_on_os_exit()
    main = threading.main_thread()
    path = Path(directory) / f"rank{rank}.json"
    restart = _restart()

    def report() -> None:
        while main.is_alive():
            frame = sys._current_frames().get(main.ident)
            if frame is not None:
                _write_atomic(path, {"rank": rank, "pid": os.getpid(), "restart": restart, "time": time.time(),
                                     **describe_stack(frame)})
            del frame
            time.sleep(interval_s)

    thread = threading.Thread(target=report, name="cadence-status", daemon=True)
    thread.start()
    return thread


def describe_stack(frame: FrameType | None) -> dict:
    """The Learner event `frame`'s stack is in (with step, epoch, iter) and its innermost user frame.

    >>> describe_stack(sys._getframe())["where"].endswith("in <module>")        # doctest: +SKIP
    True
    """
    info: dict = {"event": None, "where": None}
    while frame is not None:
        code = frame.f_code
        if info["where"] is None and not code.co_filename.startswith(_LIBRARY_DIRS) and not code.co_filename.startswith("<"):
            info["where"] = f"{_shown_path(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
        if code.co_name == "_fire" and "event" in frame.f_locals:
            learner = frame.f_locals.get("self")
            info.update(event=str(frame.f_locals["event"]),
                        **{k: getattr(learner, k, None) for k in ("step", "epoch", "iter", "training")})
            break
        frame = frame.f_back
    return info


def read_statuses(directory: str | os.PathLike | None) -> dict[int, dict]:
    """Rank -> last status written into `directory` ({} when there is none)."""
    return _read_records(directory, "rank*.json")


def _read_records(directory: str | os.PathLike | None, pattern: str) -> dict[int, dict]:
    records = {}
    for path in Path(directory).glob(pattern) if directory else ():
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        records[int(record["rank"])] = record
    return records


def record_preempted(signal_name: str, step: int, received: bool) -> None:
    """In a worker leaving for a preemption: tell the launcher this rank checkpointed `step` and why.

    `received`: this rank got the signal itself (a cluster agent may signal one process only).
    Does nothing outside `cadence launch`.

    >>> record_preempted("SIGTERM", step=120, received=True)                 # doctest: +SKIP
    """
    directory = os.environ.get(STATUS_DIR_VAR)
    if directory:
        rank = int(os.environ.get("RANK", "0"))
        _write_atomic(Path(directory) / f"preempted-rank{rank}.json",
                      {"rank": rank, "pid": os.getpid(), "signal": signal_name, "step": step, "received": received})


def read_preemptions(directory: str | os.PathLike | None) -> dict[int, dict]:
    """Rank -> its `record_preempted` record, for the ranks that left for a preemption."""
    return _read_records(directory, "preempted-rank*.json")


def record_exit(code: int) -> None:
    """In a worker whose script is over: the exit code it leaves with. Does nothing outside `cadence launch`."""
    directory = os.environ.get(STATUS_DIR_VAR)
    if directory:
        rank = int(os.environ.get("RANK", "0"))
        _write_atomic(Path(directory) / f"exit-rank{rank}.json", {"rank": rank, "pid": os.getpid(), "code": code})


def record_exit_on_os_exit() -> None:
    """In a worker: a script that ends its process itself with `os._exit(code)` (skipping teardown, as
    multi-process scripts often do) leaves its exit code too, so the launcher does not take the rank for a
    failed one and kill its peers. Forked children (DataLoader workers) of the worker write nothing.

    >>> record_exit_on_os_exit(); os._exit(0)          # doctest: +SKIP
    """
    real_exit, worker = os._exit, os.getpid()
    if getattr(real_exit, "records_exit", False):
        return

    def exit_recording(code: int) -> None:
        if os.getpid() == worker:
            with contextlib.suppress(OSError):
                record_exit(code)
        real_exit(code)

    exit_recording.records_exit = True
    os._exit = exit_recording


def failed_ranks(directory: str | os.PathLike | None, restart: int | None = None) -> dict[int, dict]:
    """Rank -> status of the workers in `directory` that ended in failure (of worker group `restart`, or
    any): their process is gone (reaped by the launcher) and it left neither an exit code of 0 nor a
    preemption record.

    >>> failed_ranks(os.environ["CADENCE_STATUS_DIR"])        # rank 0 raised and exited 1   # doctest: +SKIP
    {0: {'rank': 0, 'pid': 4242, 'restart': 0, ...}}
    """
    exits, preempted = _read_records(directory, "exit-rank*.json"), read_preemptions(directory)
    failed = {}
    for rank, record in read_statuses(directory).items():
        pid = record["pid"]
        finished = exits.get(rank, {}).get("pid") == pid and exits[rank]["code"] == 0
        if (restart is None or record.get("restart", 0) == restart) and not finished and \
                preempted.get(rank, {}).get("pid") != pid and not process_exists(pid):
            failed[rank] = record
    return failed


def peer_failed() -> bool:
    """In a worker under `cadence launch`: another rank of this machine's worker group has ended in failure."""
    rank = int(os.environ.get("RANK", "0"))
    return any(r != rank for r in failed_ranks(os.environ.get(STATUS_DIR_VAR), restart=_restart()))


def _restart() -> int:
    """Which worker group this is: torchrun counts the group's restarts (`--max_restarts`)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def describe(status: dict) -> str:
    """One phrase for a rank's status: 'during after_batch at step 12 (train.py:20 in after_batch)'.

    >>> describe({"event": "after_batch", "step": 12, "where": "train.py:20 in after_batch"})
    'during after_batch at step 12 (train.py:20 in after_batch)'
    """
    text = f"during {status['event']} at step {status.get('step')}" if status.get("event") else "outside the training loop"
    return f"{text} ({status['where']})" if status.get("where") else text


def _shown_path(filename: str) -> str:
    try:
        return os.path.relpath(filename)
    except ValueError:
        return filename


def _write_atomic(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(data, default=str))
        os.replace(tmp, path)
    except OSError:
        pass                                    # the launcher removed the directory: the run is over
