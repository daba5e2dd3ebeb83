"""Restarts and preemption on 2 processes through `cadence launch`: the same command line continues the run
(resume="auto") and it ends bitwise equal to an uninterrupted run.

tests/scripts/resume.py trains with shuffling, dropout, GradAccum(steps=2), AdamW and one-cycle on 2
processes (3 steps per epoch, 9 in all), checkpointing every 4 optimizer steps and every epoch end.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from cadence.callbacks.checkpoint import read_state
from helpers import REPO, SCRIPTS, cadence_env, run_launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # two or three 2-process launches each, one restarted


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    run_launch("resume.py", "--ckpt", out / "ckpt", "--out", out / "ref.st")
    return load_file(str(out / "ref.st"))


def assert_equal_weights(file, reference):
    final = load_file(str(file))
    assert final.keys() == reference.keys()
    assert all(torch.equal(final[k], reference[k]) for k in final)


def test_a_rank_killed_once_is_restarted_and_ends_bitwise_equal(tmp_path, reference):
    # rank 1 SIGKILLs itself after step 5 (the checkpoint of step 4 is the latest); the agent restarts both workers,
    # whose rendezvous must not read the dead group's keys, and resume="auto" continues from step 4
    done = run_launch("resume.py", "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "run.st", "--kill-once-at", 5,
                      "--rank", 1, flags=("--max_restarts", "2"), timeout=300)
    assert (tmp_path / "ckpt" / "killed-once").read_text() == "sent"      # the kill happened
    assert "STEPS 9" in done.stdout
    assert_equal_weights(tmp_path / "run.st", reference)


def launch_and_signal(tmp_path, send) -> tuple[int, str, str]:
    """Launch resume.py on 2 processes, call `send(launcher)` once the checkpoint of step 4 is written (mid-epoch 1);
    return the launch's exit code, stdout and stderr."""
    args = [str(SCRIPTS / "resume.py"), "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "run.st")]
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        launcher = subprocess.Popen([sys.executable, "-m", "cadence.cli", "launch", "--cpu", "--num_processes", "2",
                                     *args, "--step-delay", "0.5"], stdout=out, stderr=err, env=cadence_env(), cwd=REPO)
        deadline = time.monotonic() + 180
        while not (tmp_path / "ckpt" / "latest").exists() and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        send(launcher)
        code = launcher.wait(timeout=120)
    return code, (tmp_path / "out.txt").read_text(), (tmp_path / "err.txt").read_text()


def assert_one_preemption_and_an_exact_rerun(tmp_path, launched: tuple[int, str, str], reference) -> dict:
    """The launch ended as one SIGTERM preemption, no failure; the preemption checkpoint holds both ranks' state
    after step 4; the requeued command ends bitwise equal. Returns the checkpoint's state."""
    code, stdout, stderr = launched
    assert code == 128 + signal.SIGTERM, stderr
    assert "preempted by SIGTERM" in stderr and "failed" not in stderr and "Traceback" not in stderr, stderr
    assert stdout.count("Checkpoint: SIGTERM received") == 1, stdout
    latest = (tmp_path / "ckpt" / "latest").read_text()
    assert f"Checkpoint: SIGTERM received: saved {latest}" in stdout
    state = read_state(tmp_path / "ckpt" / latest)
    assert 4 < state["step"] < 9 and state["world_size"] == 2
    assert sorted(p.name for p in (tmp_path / "ckpt" / latest).glob("rng-*")) == ["rng-rank0.pt", "rng-rank1.pt"]
    done = run_launch("resume.py", "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "run.st")   # the requeue
    assert "STEPS 9" in done.stdout
    assert_equal_weights(tmp_path / "run.st", reference)
    return state


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """Rank -> pid of the launcher's workers (its children whose environment holds a RANK)."""
    children = open(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read().split()
    ranks = {}
    for pid in map(int, children):
        env = dict(v.split("=", 1) for v in open(f"/proc/{pid}/environ").read().split("\0") if "=" in v)
        if "RANK" in env:
            ranks[int(env["RANK"])] = pid
    return ranks


def test_sigterm_to_the_launcher_even_twice_checkpoints_every_rank_and_the_rerun_is_exact(tmp_path, reference):
    # the second signal (a scheduler or a user repeating it) lands while the workers checkpoint: ~3 s here
    def send(launcher):
        launcher.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        launcher.send_signal(signal.SIGTERM)

    launched = launch_and_signal(tmp_path, send)
    assert_one_preemption_and_an_exact_rerun(tmp_path, launched, reference)


@pytest.mark.long
def test_sigterm_to_one_worker_only_is_a_preemption_of_the_whole_job(tmp_path, reference):
    # a cluster agent (or `kill PID`) may signal one worker, not the launcher: every rank still saves the same step
    launched = launch_and_signal(tmp_path, lambda launcher: os.kill(worker_pids(launcher.pid)[1], signal.SIGTERM))
    state = assert_one_preemption_and_an_exact_rerun(tmp_path, launched, reference)
    stderr = launched[2]
    assert f"preempted by SIGTERM (received by rank 1): every rank checkpointed step {state['step']};" in stderr, stderr


@pytest.mark.long
def test_sigterm_twice_to_one_worker_and_to_the_launcher_is_one_preemption(tmp_path, reference):
    def send(launcher):
        worker = worker_pids(launcher.pid)[1]
        os.kill(worker, signal.SIGTERM)
        os.kill(worker, signal.SIGTERM)
        launcher.send_signal(signal.SIGTERM)

    launched = launch_and_signal(tmp_path, send)
    assert_one_preemption_and_an_exact_rerun(tmp_path, launched, reference)
