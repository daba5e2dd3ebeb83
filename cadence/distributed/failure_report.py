"""What `cadence launch` prints when a run does not finish: the failing rank's traceback once, the rank
that stopped responding when others timed out, or the preemption the workers checkpointed for.

>>> report_failure(child_failed_error.failures, status.read_statuses(status_dir), timeout_s=20.0)   # doctest: +SKIP
cadence launch: rank 1 stopped responding during after_batch at step 3 (train.py:40 in after_batch); ...
1
"""

from __future__ import annotations

import signal
import sys

from cadence.distributed import status

PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")


def report_signal(sig) -> int:
    if sig.name in PREEMPTION_SIGNALS:
        print(f"cadence launch: preempted by {sig.name}: the workers were asked to stop (a fit with a Checkpoint "
              f"callback saves first); run the same command again to resume from the last checkpoint "
              f'(fit(resume="auto"), or accelerator.load_state in a loop of your own)', file=sys.stderr)
    else:
        print(f"cadence launch: stopped by {sig.name}; every worker was terminated", file=sys.stderr)
    return 128 + int(sig)


def all_preempted(failures: dict, preempted: dict[int, dict]) -> bool:
    """Every failed rank recorded a preemption and exited with that signal's status (143 alone is not trusted)."""
    return bool(preempted) and all(
        r in preempted and f.exitcode == 128 + signal.Signals[preempted[r]["signal"]] for r, f in failures.items())


def report_preemption(preempted: dict[int, dict]) -> int:
    """Every worker left to be requeued after a preemption signal that reached workers, not the launcher."""
    sig = signal.Signals[next(iter(preempted.values()))["signal"]]
    receivers = sorted(r for r, p in preempted.items() if p["received"])
    steps = sorted({p["step"] for p in preempted.values()})
    by = f" (received by rank{'s' * (len(receivers) > 1)} {', '.join(map(str, receivers))})" if receivers else ""
    print(f"cadence launch: preempted by {sig.name}{by}: every rank checkpointed step {', '.join(map(str, steps))}; "
          f'run the same command again to resume (with fit(resume="auto"))', file=sys.stderr)
    return 128 + int(sig)


def report_failure(failures: dict, statuses: dict[int, dict] | None = None, timeout_s: float | None = None) -> int:
    """Print why the run failed, once; return the exit code for `cadence launch`.

    `failures` maps global rank to torch's `ProcessFailure` (`ChildFailedError.failures`);
    `statuses` maps rank to its last `status` report. When ranks timed out waiting and another
    rank reported no error, that rank stopped responding: it is named first, with its last
    event, step and line. Otherwise the earliest failure's traceback is printed (a rank whose
    collective failed on a peer that went away is never the cause while another rank failed),
    then one line per other failed rank.

    >>> report_failure(child_failed_error.failures, read_statuses(status_dir), 20.0)   # doctest: +SKIP
    1
    """
    statuses = statuses or {}
    hung = hung_ranks(failures, statuses)
    if hung:
        waiting = sorted(r for r, f in failures.items() if _is_timeout(f))
        timed_out_at = min(_failure_time(failures[r]) for r in waiting) / 1e9
        for rank in hung:
            print(f"cadence launch: rank {rank} stopped responding {_where(statuses.get(rank, {}), timed_out_at)}; "
                  f"rank{'s' * (len(waiting) > 1)} {', '.join(map(str, waiting))} timed out waiting for it"
                  f"{f' after {timeout_s:g} s' if timeout_s else ''}", file=sys.stderr)
        for rank in waiting:
            print(f"cadence launch: rank {rank} also stopped: {_failure_text(failures[rank])[0]}", file=sys.stderr)
        code = next(f.exitcode for f in failures.values() if _is_timeout(f))
        return code if code > 0 else 1
    # the cause first: a rank that failed because a peer vanished mid-collective after every other (a peer killed
    # outright, SIGKILL, records no error: it is the cause), then a rank that raised before one that was only
    # stopped (killed or exited without an error: its time is the launcher's, whole seconds)
    ordered = sorted(failures.items(), key=lambda item: (_extra(item[1]).get("peer_failure", False),
                                                          not _has_error(item[1]), _failure_time(item[1])))
    (rank, first), others = ordered[0], ordered[1:]
    headline, trace = _failure_text(first)
    print(f"cadence launch: rank {rank} failed:\n{trace}".rstrip() if trace else
          f"cadence launch: rank {rank} failed: {headline}", file=sys.stderr)
    for rank, failure in others:
        print(f"cadence launch: rank {rank} also stopped: {_failure_text(failure)[0]}", file=sys.stderr)
    return first.exitcode if first.exitcode > 0 else 1


def hung_ranks(failures: dict, statuses: dict[int, dict]) -> list[int]:
    """Ranks that reported no error while others timed out waiting on a collective ([] if none timed out).

    A rank whose only error is a peer failure raised after the first timeout counts as silent: it was
    stopped (SIGSTOP) or stuck, and found its peers gone once it went on.
    """
    waiting = {r for r, f in failures.items() if _is_timeout(f)}
    if not waiting:
        return []
    timed_out_at = min(_failure_time(failures[r]) for r in waiting)

    def silent(rank: int) -> bool:
        failure = failures.get(rank)
        return failure is None or not _has_error(failure) or (
            _extra(failure).get("peer_failure", False) and _failure_time(failure) > timed_out_at)

    return sorted(r for r in (set(statuses) | set(failures)) - waiting if silent(r))


_NO_REPORT_AFTER_S = 2.0      # a live worker's status thread reports twice a second


def _where(last: dict, timed_out_at: float) -> str:
    """Where the rank was; when it stopped reporting well before the timeout (stopped, frozen), that too."""
    quiet_s = timed_out_at - last.get("time", timed_out_at)
    if quiet_s <= _NO_REPORT_AFTER_S:
        return status.describe(last)
    return (f"and sent no report for {quiet_s:.0f} s before the timeout (stopped or frozen: SIGSTOP, a debugger, "
            f"a stuck machine); last seen {status.describe(last)}")


_TIMEOUT_TEXT = ("Timed out", "timed out", "Timeout", "timeout")


def _has_error(failure) -> bool:
    """True when the worker recorded an exception (run_worker's error file), not just an exit code."""
    return isinstance(failure.error_file_data.get("message"), dict)


def _is_timeout(failure) -> bool:
    headline, trace = _failure_text(failure)
    return _has_error(failure) and any(t in headline or t in trace[-2000:] for t in _TIMEOUT_TEXT)


def _extra(failure) -> dict:
    info = failure.error_file_data.get("message", {})
    return info.get("extraInfo", {}) if isinstance(info, dict) else {}


def _failure_time(failure) -> float:
    return _extra(failure).get("time_ns", failure.timestamp * 1e9)


def _failure_text(failure) -> tuple[str, str]:
    """(one-line summary, traceback or '') of a ProcessFailure."""
    info = failure.error_file_data.get("message")
    if isinstance(info, dict):
        return info.get("message", ""), info.get("extraInfo", {}).get("py_callstack", "")
    if failure.exitcode < 0:
        return f"killed by {failure.signal_name()}", ""
    return f"exited with code {failure.exitcode}", ""
