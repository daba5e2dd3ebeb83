"""Fault trials for multi-process runs: does every run end cleanly? Prints a table at the end.

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
- hang_checkpoint: 20, as hang with a Checkpoint callback (its preemption handler catches the launcher's
  SIGTERM): the launch ends within timeout + 10 s of the hang, naming rank 1;
- sigstop: 20, rank 1 stops itself with SIGSTOP (`hang.py --sigstop`, `--timeout 10`): the launch ends within
  timeout + 10 s, names rank 1 as the rank that stopped responding, and leaves no stopped process behind;
- kill_launcher: 20, SIGKILL of `cadence launch` at a random moment of a run: both workers gone within 5 s;
- kill_rank: 20, SIGKILL of a random worker at a random moment of a 2-process run launched with
  `--max_restarts 2` (tests/scripts/resume.py, resume="auto"): the launch exits 0 and the final weights
  are bitwise equal to an uninterrupted run's;
- kill_in_checkpoint: 50, SIGKILL of a 1-process run (resume.py, keep_last=2) just before a random one of
  the filesystem calls its checkpoint saves and prunes make (tests/scripts/fs_kill.py): `latest` names a
  checkpoint that loads, every checkpoint that keep_last keeps (its history) is there, and the same
  command then finishes bitwise equal to an uninterrupted run with no leftovers;
- kill_in_export: 50, a sharded `save_model` (4 shards, 52 MiB) over an existing export
  (tests/scripts/export_save.py) ended by the kernel at a random moment: the directory then loads whole
  as the old export or the new one, never a mix (ended between the swap's two renames: the load refuses,
  naming the interrupted save, and `recover_dir`, as the next save runs first, makes it the new one);
  nothing staged is left. Even trials: SIGKILL just before a random one of the save's filesystem calls
  (tests/scripts/fs_kill.py). Odd trials: a moment drawn uniformly over the CPU time an uninterrupted save
  over an existing export takes (median of 3), where the process ends by SIGPROF at its default action
  (`setitimer(ITIMER_PROF)`: no handler or cleanup runs, as with SIGKILL), mid-write included, however
  loaded the machine. A save that ends before its moment is not a trial: another is drawn (up to 5);
- two_jobs: 20, a second job started on the checkpoint directory of a running one (tests/scripts/resume.py,
  keep_last=2) at a random moment: the second is refused naming the first's pid (every other trial it is a
  2-process launch, every rank refused), and the first finishes bitwise equal to an uninterrupted run with
  its kept checkpoints whole and no leftovers.

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
    return _ends_after_hang(workdir, [], "rank 1 stopped responding during after_batch")


def trial_hang_checkpoint(workdir: Path, i: int) -> tuple[bool, str]:
    return _ends_after_hang(workdir, ["--checkpoint", str(workdir / f"ckpt{i}")],
                            "rank 1 stopped responding during after_batch")


def trial_sigstop(workdir: Path, i: int) -> tuple[bool, str]:
    return _ends_after_hang(workdir, ["--sigstop"], "rank 1 stopped responding and sent no report")


def _ends_after_hang(workdir: Path, script_args: list[str], named: str) -> tuple[bool, str]:
    """hang.py with `script_args` under `--timeout 10`: ended within timeout + 10 s of the hang, `named` in the
    report, and the hung rank's process gone."""
    try:
        proc = subprocess.run([*launch_cmd("hang.py", "--timeout", str(HANG_TIMEOUT_S)), *script_args],
                              capture_output=True, text=True, timeout=300, env=child_env(), cwd=workdir)
    except subprocess.TimeoutExpired:
        return False, "still running after 300 s"
    took = time.time()
    hung_at = re.search(r"HANGING AT ([\d.]+) (\d+)", proc.stdout)
    if not hung_at:
        return False, f"rank 1 never hung (exit {proc.returncode})"
    took -= float(hung_at.group(1))
    left = _alive(int(hung_at.group(2)))
    if left:
        os.kill(int(hung_at.group(2)), signal.SIGKILL)
    if took <= HANG_TIMEOUT_S + 10 and named in proc.stderr and proc.returncode != 0 and not left:
        return True, f"{took:.1f} s"
    return False, (f"{took:.1f} s after the hang, exit {proc.returncode}, hung rank left alive: {left}, "
                   f"report: {proc.stderr.strip()[-300:]!r}")


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


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    except OSError:
        return []


def _same_weights(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    wa, wb = load_file(str(a)), load_file(str(b))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _reference(workdir: Path, *cmd: str) -> Path:
    """The final weights of an uninterrupted run of `cmd` (run once per row, kept in `workdir`)."""
    out = workdir / "reference.st"
    if not out.exists():
        subprocess.run([*cmd, "--ckpt", str(workdir / "reference"), "--out", str(out)], check=True,
                       capture_output=True, timeout=600, env=child_env(), cwd=workdir)
    return out


def trial_kill_rank(workdir: Path, i: int) -> tuple[bool, str]:
    rng = random.Random(i)
    cmd = launch_cmd("resume.py", "--max_restarts", "2")
    ref = _reference(workdir, *cmd)
    run = workdir / f"run{i}"
    proc = subprocess.Popen([*cmd, "--ckpt", str(run), "--out", str(run / "final.st"), "--step-delay", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=workdir)
    deadline = time.monotonic() + 120
    while len(_children(proc.pid)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(rng.uniform(0, 6))                   # start-up, training, a checkpoint, validation, the end
    workers = _children(proc.pid)
    victim = rng.choice(workers) if workers and proc.poll() is None else None
    if victim is not None:
        os.kill(victim, signal.SIGKILL)
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        return False, "still running 600 s after the kill"
    if victim is None:
        return False, "the run ended before the kill (not a trial)"
    if proc.returncode != 0 or "STEPS 9" not in out:
        return False, f"exit {proc.returncode}: {err.strip()[-300:]!r}"
    same = _same_weights(ref, run / "final.st")
    return same, "" if same else "final weights differ from the uninterrupted run"


def trial_kill_in_checkpoint(workdir: Path, i: int) -> tuple[bool, str]:
    from cadence.callbacks.checkpoint import read_state
    from cadence.serialization import load_weights

    cmd = [sys.executable, str(SCRIPTS / "resume.py"), "--keep-last", "2"]
    ref = _reference(workdir, *cmd)
    total = _filesystem_ops(workdir, cmd)
    n = random.Random(i).randint(1, total)
    run = workdir / f"run{i}"
    args = ["--ckpt", str(run), "--out", str(run / "final.st")]
    killed = subprocess.run([*cmd, *args, "--kill-at-op", f"any:{n}"], capture_output=True, text=True, timeout=600,
                            env=child_env(), cwd=workdir)
    if killed.returncode != -signal.SIGKILL:
        return False, f"op {n}/{total}: not killed (exit {killed.returncode})"
    pointer = run / "latest"
    if pointer.exists():
        try:
            latest = run / pointer.read_text()
            kept = read_state(latest)["callbacks"]["checkpoint"]["history"][-2:]
            load_weights(latest / "model.safetensors")
        except (OSError, ValueError) as e:
            return False, f"op {n}/{total}: latest does not load: {e}"
        missing = [name for name in kept if not (run / name / "state.json").is_file()]
        if missing:
            return False, f"op {n}/{total}: keep_last=2 checkpoints gone: {missing}"
    done = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=600, env=child_env(), cwd=workdir)
    leftovers = [p.name for p in run.iterdir() if p.name.startswith(".")]
    if done.returncode != 0 or leftovers:
        return False, f"op {n}/{total}: resume exit {done.returncode}, leftovers {leftovers}: {done.stderr[-300:]!r}"
    same = _same_weights(ref, run / "final.st")
    return same, f"op {n}/{total}" + ("" if same else ": final weights differ from the uninterrupted run")


def _filesystem_ops(workdir: Path, cmd: list[str]) -> int:
    """How many filesystem calls the checkpoints of a whole run make (counted once per row)."""
    file = workdir / "fsops"
    if not file.exists():
        proc = subprocess.run([*cmd, "--ckpt", str(workdir / "count"), "--out", str(workdir / "count.st"),
                               "--kill-at-op", "any:0"], capture_output=True, text=True, timeout=600,
                              env=child_env(), cwd=workdir, check=True)
        file.write_text(re.search(r"FSOPS (\d+)", proc.stdout).group(1))
    return int(file.read_text())


EXPORT_SCALE = 16  # export_save.py's model at 16x width: 52 MiB in 4 shards, a save long enough to land kills in


def _export_cmd(directory: Path, seed: int, *flags: str) -> list[str]:
    return [sys.executable, str(SCRIPTS / "export_save.py"), str(directory), "--seed", str(seed),
            "--scale", str(EXPORT_SCALE), *flags]


def _export_fixtures(workdir: Path) -> tuple[Path, float]:
    """The old export (seed 1) every trial starts from, and the CPU time an uninterrupted save over it takes
    (the median of 3, measured once per row)."""
    import shutil

    old, timing = workdir / "old-export", workdir / "export-seconds"
    if not timing.exists():
        subprocess.run(_export_cmd(old, 1), check=True, capture_output=True, timeout=300, env=child_env())
        seconds = []
        for _ in range(3):
            shutil.rmtree(workdir / "timed", ignore_errors=True)
            shutil.copytree(old, workdir / "timed")
            out = subprocess.run(_export_cmd(workdir / "timed", 2), check=True, capture_output=True, text=True,
                                 timeout=300, env=child_env()).stdout
            seconds.append(float(re.search(r"SAVED ([\d.]+)", out).group(1)))
        timing.write_text(str(statistics.median(seconds)))
    return old, float(timing.read_text())


def _export_seed(directory: Path, expected: dict[int, dict]) -> int | None:
    """Which save (seed) `directory` holds, every tensor of it; None for a mix."""
    import torch

    from cadence.big_modeling import init_empty_weights, load_checkpoint_and_dispatch
    sys.path.insert(0, str(SCRIPTS))
    from export_save import model

    with init_empty_weights():
        empty = model(0, EXPORT_SCALE)
    state = load_checkpoint_and_dispatch(empty, directory, device_map={"": "cpu"}).state_dict()
    same = [seed for seed, ref in expected.items() if all(torch.equal(state[k], v) for k, v in ref.items())]
    return same[0] if len(same) == 1 else None


_EXPECTED: dict[int, dict] = {}


def trial_kill_in_export(workdir: Path, i: int) -> tuple[bool, str]:
    import shutil

    from cadence.serialization import recover_dir
    sys.path.insert(0, str(SCRIPTS))
    from export_save import model

    old, seconds = _export_fixtures(workdir)
    if not _EXPECTED:
        _EXPECTED.update({seed: model(seed, EXPORT_SCALE).state_dict() for seed in (1, 2)})
    export, rng = workdir / f"export{i}", random.Random(i)
    for attempt in range(1, 6):  # a save that ends before its kill is no trial: draw another moment
        shutil.rmtree(export, ignore_errors=True)
        shutil.copytree(old, export)
        if i % 2:  # odd trials: a random moment of the save's CPU time
            moment = rng.uniform(0, seconds)
            flags, when = ("--die-after-cpu", f"{moment:.4f}"), f"at {moment * 1000:.0f} of {seconds * 1000:.0f} ms CPU"
        else:      # even trials: just before a random one of its filesystem calls (13 in a save over an export)
            call = rng.randint(1, 14)
            flags, when = ("--kill-at-op", f"any:{call}"), f"before filesystem call {call}"
        proc = subprocess.run(_export_cmd(export, 2, *flags), capture_output=True, text=True, timeout=300,
                              env=child_env())
        if proc.returncode in (-signal.SIGPROF, -signal.SIGKILL) and "SAVED" not in proc.stdout:
            break
        if "SAVED" not in proc.stdout:
            return False, f"the save failed (exit {proc.returncode}): {proc.stderr[-300:]!r}"
    else:
        return False, f"5 saves in a row ended before their kill (the last {when})"
    where = ""
    if not export.exists():  # killed between the swap's two renames: the load must say so, then recover
        try:
            _export_seed(export, _EXPECTED)
            return False, "an export that is not there loaded"
        except FileNotFoundError as e:
            if "interrupted" not in str(e):
                return False, f"the load's message does not name the interrupted save: {e}"
        recover_dir(export)
        where = "mid-swap, recovered: "
    try:
        seed = _export_seed(export, _EXPECTED)
    except (OSError, ValueError) as e:
        return False, f"ended {when}: the export does not load: {e}"
    recover_dir(export)  # what the next save does first: nothing staged may be left after it
    leftovers = [p.name for p in workdir.iterdir() if p.name.startswith(f".{export.name}.")]
    shutil.rmtree(export, ignore_errors=True)
    if seed is None or leftovers:
        return False, f"ended {when}: {'a mix of two saves' if seed is None else ''} leftovers {leftovers}"
    return True, (f"ended {when} (draw {attempt}): "
                  f"{where}{'old' if seed == 1 else 'new'} export")


# ---------------------------------------------------------------------------- two jobs on one directory
def trial_two_jobs(workdir: Path, i: int) -> tuple[bool, str]:
    from cadence.callbacks.checkpoint import read_state

    rng = random.Random(i)
    cmd = [sys.executable, str(SCRIPTS / "resume.py"), "--keep-last", "2"]
    ref = _reference(workdir, *cmd)
    run = workdir / f"run{i}"
    first = subprocess.Popen([*cmd, "--ckpt", str(run), "--out", str(run / "first.st"), "--step-delay", "1.2"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=workdir)
    deadline = time.monotonic() + 120
    while not (run / ".lock").exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    # a random moment of its start-up, training, checkpoints, validation (~45 s): the second job starts then and
    # reaches the directory after its own start-up (5-20 s on a loaded machine), while the first still runs
    time.sleep(rng.uniform(0, 8))
    launched = i % 2 == 1
    second_cmd = launch_cmd("resume.py", "--max_restarts", "0") if launched else cmd
    second = subprocess.run([*second_cmd, "--ckpt", str(run), "--out", str(workdir / "second.st"), "--keep-last", "2"],
                            capture_output=True, text=True, timeout=300, env=child_env(), cwd=workdir)
    out, err = first.communicate(timeout=600)
    if first.returncode != 0 or "STEPS 18" not in out:
        return False, f"first job: exit {first.returncode}: {err.strip()[-300:]!r}"
    if second.returncode == 0 or "STEPS" in second.stdout:
        return False, "the second job was not refused (the first had ended?)" if "STEPS" in second.stdout else \
            f"the second job failed otherwise: {second.stderr.strip()[-300:]!r}"
    named = f"is in use by another job (pid {first.pid} on host"
    refusals = second.stderr.count(named)
    if refusals < (2 if launched else 1):
        return False, f"refusal not said by every rank ({refusals}): {second.stderr.strip()[-300:]!r}"
    latest = run / (run / "latest").read_text()
    kept = read_state(latest)["callbacks"]["checkpoint"]["history"]
    whole = all((run / name / "state.json").is_file() for name in kept)
    leftovers = [p.name for p in run.iterdir() if p.name.startswith(".")]
    same = _same_weights(ref, run / "first.st")
    ok = whole and not leftovers and same
    return ok, ("2-process " if launched else "") + ("refused" if ok else
                                                     f"kept whole {whole}, leftovers {leftovers}, bitwise {same}")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


TRIALS = {
    "finish": (trial_finish, 200, "finished 2-process launches that exit 0"),
    "hang": (trial_hang, 60, f"hung rank: run ends within timeout+10 s ({HANG_TIMEOUT_S}+10) naming rank 1"),
    "hang_checkpoint": (trial_hang_checkpoint, 20, f"hung rank with a Checkpoint callback: ends within timeout+10 s "
                        f"({HANG_TIMEOUT_S}+10) naming rank 1"),
    "sigstop": (trial_sigstop, 20, f"SIGSTOPped rank: ends within timeout+10 s ({HANG_TIMEOUT_S}+10) naming rank 1, "
                f"nothing left stopped"),
    "kill_launcher": (trial_kill_launcher, 20, "SIGKILL of the launcher: workers gone within 5 s"),
    "kill_rank": (trial_kill_rank, 20, "SIGKILL of a random rank under --max_restarts 2: exit 0, bitwise equal"),
    "kill_in_checkpoint": (trial_kill_in_checkpoint, 50, "SIGKILL at a random filesystem call of checkpointing "
                           "(keep_last=2): latest loads, kept ones there; resume bitwise equal, no leftovers"),
    "kill_in_export": (trial_kill_in_export, 50, "a sharded save_model over an existing export killed at a random "
                       "filesystem call or moment of its CPU time: the old or the new export loads whole, never a mix"),
    "two_jobs": (trial_two_jobs, 20, "a second job on a running job's checkpoint directory: refused naming the "
                 "first (every rank); the first ends bitwise equal, its kept checkpoints whole, no leftovers"),
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
