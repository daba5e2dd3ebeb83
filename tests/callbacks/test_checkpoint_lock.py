"""One job per checkpoint directory: a second job is refused at its start, naming the first; the lock dies with
its holder; a checkpoint missing a file its state.json lists is never taken as complete."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from cadence.callbacks.checkpoint import Checkpoint, complete_checkpoints, read_state
from cadence.callbacks.checkpoint.lock import DirectoryLock
from fixtures import make_learner
from helpers import REPO, SCRIPTS, cadence_env, run_launch


def names(root):
    return [d.name for d in complete_checkpoints(root)]


def test_a_second_fit_on_a_locked_directory_is_refused_before_anything_runs(dls, tmp_path):
    root = tmp_path / "checkpoints"
    make_learner(dls, tmp_path, [Checkpoint()]).fit(1)
    with DirectoryLock(root):                                 # another job holds the directory
        learn = make_learner(dls, tmp_path, [Checkpoint()])
        with pytest.raises(RuntimeError, match=rf"{root} is in use by another job \(pid {os.getpid()} on host "
                                               rf"{socket.gethostname()} since .*, command: .*\): two jobs"):
            learn.fit(2, resume="auto")
        assert learn.step == 0 and names(root) == ["step-00000004"]
    learn.fit(2, resume="auto")                               # released: the same call goes on
    assert learn.step == 8 and names(root) == ["step-00000004", "step-00000008"]
    assert not (root / ".lock").exists()


def test_a_lock_file_left_by_a_killed_job_does_not_block(dls, tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / ".lock").write_text(json.dumps({"pid": 1, "host": "gone", "command": "x", "since": "then"}))
    learn = make_learner(dls, tmp_path, [Checkpoint()])
    learn.fit(1)
    assert names(root) == ["step-00000004"]


def test_a_checkpoint_missing_a_listed_file_is_not_complete(dls, tmp_path):
    root = tmp_path / "checkpoints"
    make_learner(dls, tmp_path, [Checkpoint()]).fit(2)
    (root / "step-00000008" / "model.safetensors").unlink()   # what two jobs renaming into one name left
    assert names(root) == ["step-00000004"]
    with pytest.raises(FileNotFoundError, match=r"step-00000008 has no model.safetensors: the checkpoint is incomplete"):
        make_learner(dls, tmp_path, [Checkpoint()]).fit(3, resume="auto")


def wait_for_lock(root, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if json.loads((root / ".lock").read_text())["pid"]:
                return
        except (OSError, ValueError):
            time.sleep(0.05)
    raise AssertionError(f"the first job never locked {root}: {proc.poll()}")


@pytest.mark.slow
def test_a_running_job_keeps_its_directory_and_its_checkpoints(dls, tmp_path):
    root = tmp_path / "ckpt"
    first = subprocess.Popen([sys.executable, str(SCRIPTS / "resume.py"), "--ckpt", str(root), "--out",
                              str(tmp_path / "first.st"), "--step-delay", "0.1"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cadence_env(), cwd=REPO)
    try:
        wait_for_lock(root, first)
        second = make_learner(dls, tmp_path, [Checkpoint(dir=root, keep_last=1)])
        with pytest.raises(RuntimeError, match=rf"in use by another job \(pid {first.pid} on host .*resume.py --ckpt"):
            second.fit(3, resume="auto")
        out, err = first.communicate(timeout=240)
    finally:
        first.kill()
    assert first.returncode == 0, err
    assert "STEPS 18" in out and second.step == 0
    latest = root / (root / "latest").read_text()
    assert read_state(latest)["step"] == 18                   # every 4 steps and each epoch's end, all of them there
    assert names(root) == [f"step-{n:08d}" for n in (4, 6, 8, 12)] + ["step-00000012-1", "step-00000016", "step-00000018"]


@pytest.mark.slow
def test_every_rank_of_a_refused_ddp_job_ends_with_the_holder_named(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    with DirectoryLock(root):
        start = time.monotonic()
        proc = run_launch("resume.py", "--ckpt", root, "--out", tmp_path / "out.st", check=False, timeout=120)
        took = time.monotonic() - start
    assert proc.returncode != 0 and "STEPS" not in proc.stdout
    refusals = proc.stderr.count(f"{root} is in use by another job (pid {os.getpid()}")
    assert refusals >= 2, proc.stderr[-3000:]            # rank 0 found it; rank 1 says the same, it does not hang
    assert took < 60 and not list(root.glob("step-*"))
