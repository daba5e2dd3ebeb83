"""Exact resume: a run killed with SIGKILL and resumed ends bitwise equal to an uninterrupted run.

tests/scripts/resume.py trains with shuffling, dropout, GradAccum(steps=2), AdamW and one-cycle,
checkpointing every 4 optimizer steps and after every epoch.
"""

import csv
import json
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from helpers import REPO, SCRIPTS, cadence_env, run_launch

pytestmark = pytest.mark.slow


def run_one(*args, check=True):
    proc = subprocess.run([sys.executable, str(SCRIPTS / "resume.py"), *map(str, args)], capture_output=True, text=True,
                          timeout=180, env=cadence_env(), cwd=REPO)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def assert_same_weights(a, b):
    wa, wb = load_file(str(a)), load_file(str(b))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def latest(ckpt):
    return (ckpt / "latest").read_text()


def assert_tracked_steps(ckpt, n_steps):
    """The trackers of a killed-and-resumed run hold every optimizer step exactly once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = ckpt / "runs" / "resume" / "run"
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows if r["train/loss"]] == list(range(1, n_steps + 1))
    acc = EventAccumulator(str(run))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, n_steps + 1))


def test_one_process_killed_mid_epoch_resumes_exactly(tmp_path):
    run_one("--ckpt", tmp_path / "ref", "--out", tmp_path / "ref.st")
    killed = run_one("--ckpt", tmp_path / "run", "--out", tmp_path / "run.st", "--kill-at", 10, check=False)
    assert killed.returncode == -signal.SIGKILL
    assert latest(tmp_path / "run") == "step-00000008"
    state = json.loads((tmp_path / "run" / "step-00000008" / "state.json").read_text())
    assert not state["epoch_complete"] and state["sampler"]["batches_done"] == 4  # mid-epoch 1
    done = run_one("--ckpt", tmp_path / "run", "--out", tmp_path / "run.st")
    assert "STEPS 18" in done.stdout
    assert_same_weights(tmp_path / "ref.st", tmp_path / "run.st")
    assert_tracked_steps(tmp_path / "run", 18)
    # the resumed run prints the same epoch results as the uninterrupted one (time aside)
    ref_lines = [line.rsplit("|", 1)[0] for line in run_one("--ckpt", tmp_path / "ref2", "--out", tmp_path / "r2.st")
                 .stdout.splitlines() if line.startswith("epoch")]
    assert [line.rsplit("|", 1)[0] for line in done.stdout.splitlines() if line.startswith("epoch")] == ref_lines[1:]


@pytest.mark.long
def test_kill_during_a_checkpoint_write_leaves_latest_complete(tmp_path):
    run_one("--ckpt", tmp_path / "ref", "--out", tmp_path / "ref.st")
    killed = run_one("--ckpt", tmp_path / "run", "--out", tmp_path / "run.st", "--kill-in-save", 12, check=False)
    assert killed.returncode == -signal.SIGKILL
    root = tmp_path / "run"
    assert (root / ".step-00000012.tmp").is_dir() and not (root / "step-00000012").exists()
    assert latest(root) == "step-00000008" and (root / "step-00000008" / "state.json").is_file()
    run_one("--ckpt", root, "--out", tmp_path / "run.st")
    assert_same_weights(tmp_path / "ref.st", tmp_path / "run.st")


@pytest.mark.long
def test_two_processes_killed_resume_exactly(tmp_path):
    ref = run_launch("resume.py", "--ckpt", tmp_path / "ref", "--out", tmp_path / "ref.st")
    killed = run_launch("resume.py", "--ckpt", tmp_path / "run", "--out", tmp_path / "run.st", "--kill-at", 5,
                        check=False)
    assert killed.returncode != 0
    assert latest(tmp_path / "run") == "step-00000004"
    assert sorted(p.name for p in (tmp_path / "run" / "step-00000004").glob("rng-*")) == ["rng-rank0.pt", "rng-rank1.pt"]
    done = run_launch("resume.py", "--ckpt", tmp_path / "run", "--out", tmp_path / "run.st")
    assert "STEPS 9" in done.stdout
    assert_same_weights(tmp_path / "ref.st", tmp_path / "run.st")
    # each process's own smoothed loss resumed (not rank 0's on both): the train_loss column, their mean, is the same
    column = [line for line in ref.stdout.splitlines() if line.startswith("TRAIN_LOSS")]
    assert len(column) == 1 and column[0] in done.stdout.splitlines(), (column, done.stdout)
    assert_tracked_steps(tmp_path / "run", 9)

    # the same 2-process checkpoint continues on one process: the rest of epoch 1 keeps its global batches of
    # 16 (2 of 4 optimizer steps left), epoch 2 has 96 / 8 = 12 batches of 8: 6 steps; 4 + 2 + 6 = 12
    (tmp_path / "run" / "latest").write_text("step-00000004")
    one = run_one("--ckpt", tmp_path / "run", "--out", tmp_path / "one.st")
    assert "STEPS 12" in one.stdout and "saved with batch 8 x 2 processes (16 per step) on 1 processes" in one.stderr
