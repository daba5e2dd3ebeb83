"""Fault trials for multi-process runs (issue 9): does every run end cleanly? Prints a table at the end.

Run from the repo root (each trial launches 2 CPU processes through `cadence launch`, ~7-15 s):

    .venv/bin/python bench/faults.py                       # every row at its goal count (~1 h on 2 cores)
    .venv/bin/python bench/faults.py --trials 10           # 10 trials per row
    .venv/bin/python bench/faults.py --only hang --only finish --trials 5

Rows (name: goal, what passes):
- finish: 200, a finished 2-process run exits 0 and prints its result: a Learner fit under distrib_ctx
  (tests/scripts/finish_ddp.py) and, every other trial, plain torch DDP that never destroys its
  group (tests/scripts/plain_ddp.py, the shape that died with SIGABRT at exit);
- hang: 60, rank 1 stops responding (tests/scripts/hang.py, `--timeout 10`): the launch ends within
  timeout + 10 s of the hang and its report names rank 1 as the rank that stopped responding;
- kill_launcher: 20, SIGKILL of `cadence launch` at a random moment of a run: both workers gone within 5 s.

Each row is a function `trial_<name>(workdir: Path, i: int) -> tuple[bool, str]` (passed, detail)
registered in TRIALS as name -> (function, goal count, description); other rows plug in the same way.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "tests" / "scripts"
HANG_TIMEOUT_S = 10


def launch_cmd(script: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "cadence.cli", "launch", "--cpu", "--num_processes", "2", *flags, str(SCRIPTS / script)]


def child_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
            "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def trial_finish(workdir: Path, i: int) -> tuple[bool, str]:
    script, result = ("finish_ddp.py", "FINISHED ") if i % 2 == 0 else ("plain_ddp.py", "PLAIN DONE")
    try:
        proc = subprocess.run(launch_cmd(script), capture_output=True, text=True, timeout=180,
                              env=child_env(), cwd=workdir)
    except subprocess.TimeoutExpired:
        return False, f"{script} still running after 180 s"
    if proc.returncode == 0 and result in proc.stdout:
        return True, ""
    return False, f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:] or ['(no stderr)']}"


def trial_hang(workdir: Path, i: int) -> tuple[bool, str]:
    try:
        proc = subprocess.run(launch_cmd("hang.py", "--timeout", str(HANG_TIMEOUT_S)), capture_output=True,
                              text=True, timeout=300, env=child_env(), cwd=workdir)
    except subprocess.TimeoutExpired:
        return False, "still running after 300 s"
    ended = time.time()
    hung_at = re.search(r"HANGING AT ([\d.]+)", proc.stdout)
    if not hung_at:
        return False, f"rank 1 never hung (exit {proc.returncode})"
    took = ended - float(hung_at.group(1))
    named = "rank 1 stopped responding during after_batch" in proc.stderr
    if took <= HANG_TIMEOUT_S + 10 and named and proc.returncode != 0:
        return True, f"{took:.1f} s"
    return False, f"{took:.1f} s after the hang, exit {proc.returncode}, report: {proc.stderr.strip()[-300:]!r}"


def trial_kill_launcher(workdir: Path, i: int) -> tuple[bool, str]:
    proc = subprocess.Popen(launch_cmd("hang.py", "--timeout", "600"), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=child_env(), cwd=workdir)
    pids, end = [], time.monotonic() + 120
    while len(pids) < 2 and time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("STARTED "):
            pids.append(int(line.split()[1]))
    time.sleep(random.Random(i).uniform(0, 3))         # kill at a random moment: start, training, hang
    proc.kill()
    proc.wait()
    if len(pids) < 2:
        return False, f"only {len(pids)} workers started"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    alive = [p for p in pids if _alive(p)]
    for pid in alive:                                   # leave nothing behind for the next trial
        os.kill(pid, signal.SIGKILL)
    return (not alive), (f"still alive after 5 s: {alive}" if alive else "")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


TRIALS = {
    "finish": (trial_finish, 200, "finished 2-process launches that exit 0"),
    "hang": (trial_hang, 60, f"hung rank: run ends within timeout+10 s ({HANG_TIMEOUT_S}+10) naming rank 1"),
    "kill_launcher": (trial_kill_launcher, 20, "SIGKILL of the launcher: workers gone within 5 s"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=None, help="trials per row (default: each row's goal)")
    parser.add_argument("--only", action="append", choices=sorted(TRIALS), help="run only this row (repeatable)")
    args = parser.parse_args(argv)
    rows = []
    for name in args.only or TRIALS:
        function, goal, description = TRIALS[name]
        n = args.trials or goal
        passed, failures, times = 0, [], []
        with tempfile.TemporaryDirectory(prefix=f"faults-{name}-") as tmp:
            for i in range(n):
                start = time.monotonic()
                ok, detail = function(Path(tmp), i)
                times.append(time.monotonic() - start)
                passed += ok
                if not ok:
                    failures.append(f"{name} #{i}: {detail}")
                print(f"{name} #{i}: {'ok' if ok else 'FAILED'} {detail}", flush=True)
        rows.append((name, passed, n, goal, statistics.median(times), description, failures))
    print(f"\n| row | passed | goal | s/trial | what passes |\n|---|---|---|---|---|")
    for name, passed, n, goal, median_s, description, _ in rows:
        print(f"| {name} | {passed}/{n} | {goal}/{goal} | {median_s:.1f} | {description} |")
    for *_, failures in rows:
        for failure in failures:
            print(f"  {failure}")
    return 0 if all(passed == n for _, passed, n, *_ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
