"""A tampered checkpoint directory cannot be turned against the user: a tracker directory named in state.json is
written only inside this run's log root, a `.lock` link is never written through, and a callback state its
callback could not load is refused naming state.json and the key before the weights or the optimizer are touched."""

import csv
import json
import os
import shutil
import stat
import subprocess
import sys
import time

import pytest
import torch
from cadence.callbacks import EarlyStoppingCallback
from cadence.callbacks.checkpoint import Checkpoint
from cadence.callbacks.checkpoint.lock import DirectoryLock
from cadence.callbacks.tracking import Tracker
from fixtures import edit_state, make_learner
from cadence.distributed.launch import free_port
from helpers import REPO, SCRIPTS, cadence_env


def users_files(path):
    """A directory of the user's own, as a tracker would have written it: metrics.csv, hparams.yaml."""
    path.mkdir(parents=True)
    (path / "metrics.csv").write_text("step,score\n" + "".join(f"{i * 100},{i}\n" for i in range(1, 50)))
    (path / "hparams.yaml").write_text("the user's own hparams\n")
    return {p.name: p.read_bytes() for p in path.iterdir()}


def steps(metrics_csv):
    with metrics_csv.open(newline="") as f:
        return sorted({int(row["step"]) for row in csv.DictReader(f)})


# ---------------------------------------------------------------- 1. the tracker's directory
@pytest.mark.parametrize("kind", ["csv", "tensorboard"])
@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_a_tracker_dir_outside_the_log_root_is_left_untouched(dls, tmp_path, kind, how):
    runs = tmp_path / "run" / "runs"
    make_learner(dls, tmp_path / "run", [Checkpoint(), Tracker(kind, dir=runs, run_name="r")]).fit(1)
    outside = tmp_path / "users_other_project"
    before = users_files(outside)
    named = {"absolute": str(outside), "dotdot": str(runs / ".." / ".." / "users_other_project")}
    if how == "symlink":                              # a run directory inside the root, linked outside
        (runs / "linked").symlink_to(outside, target_is_directory=True)
        named["symlink"] = str(runs / "linked")
    edit_state(tmp_path / "run" / "checkpoints" / "step-00000004",
               lambda s: s["callbacks"]["tracker"]["trackers"][kind].update(dir=named[how]))

    learn = make_learner(dls, tmp_path / "run", [Checkpoint(), Tracker(kind, dir=runs, run_name="r")])
    with pytest.warns(UserWarning, match=rf"state.json names '{named[how]}' as the {kind} tracker's run directory "
                                         rf"\(callbacks.tracker.trackers.{kind}.dir\), outside this run's log root"):
        learn.fit(2, resume="latest")
    assert learn.step == 8
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before      # not a byte written there
    fresh = learn.tracker.trackers[0].log_dir
    assert fresh.parent == runs.resolve() and fresh.name == "r_1" and any(fresh.iterdir())


def test_a_checkpoint_moved_with_its_logs_continues_them(dls, tmp_path):
    """Copied to another place (another machine), the checkpoint names the logs' old absolute path: the run
    directory of that name in this run's log root is continued, and the old one is not written."""
    old = tmp_path / "old"
    make_learner(dls, old, [Checkpoint(), Tracker("csv", dir=old / "runs", run_name="r")]).fit(1)
    new = tmp_path / "new"
    shutil.copytree(old, new)
    old_csv = (old / "runs" / "r" / "metrics.csv").read_bytes()

    learn = make_learner(dls, new, [Checkpoint(), Tracker("csv", dir=new / "runs", run_name="r")])
    learn.fit(2, resume="latest")
    assert learn.tracker.trackers[0].log_dir == (new / "runs" / "r").resolve()
    assert steps(new / "runs" / "r" / "metrics.csv") == list(range(1, 9))
    assert sorted(p.name for p in (new / "runs").iterdir()) == ["r"]
    assert (old / "runs" / "r" / "metrics.csv").read_bytes() == old_csv


# ---------------------------------------------------------------- 2. the lock file
def test_a_lock_symlink_is_refused_naming_it_and_its_target_stays_untouched(dls, tmp_path):
    victim = tmp_path / "victim_notes.txt"
    victim.write_text("years of notes\n" * 1000)
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / ".lock").symlink_to(victim)
    learn = make_learner(dls, tmp_path, [Checkpoint()])
    with pytest.raises(RuntimeError, match=rf"{root / '.lock'} is a symbolic link \(to {victim}\).*Remove "
                                           rf"{root / '.lock'}"):
        learn.fit(1)
    assert victim.read_text() == "years of notes\n" * 1000
    assert (root / ".lock").is_symlink() and learn.step == 0       # the cause is left for the user to see


@pytest.mark.parametrize("what", ["directory", "hard link"])
def test_a_lock_path_that_is_not_a_file_of_its_own_is_refused(tmp_path, what):
    root = tmp_path / "checkpoints"
    root.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    if what == "directory":
        (root / ".lock").mkdir()
    else:
        os.link(victim, root / ".lock")
    with pytest.raises(RuntimeError, match=rf"{root / '.lock'} is (not a regular file|a file with 2 names)"):
        DirectoryLock(root).acquire()
    assert victim.read_text() == "keep me"


def test_the_lock_file_is_readable_by_its_owner_only(tmp_path):
    with DirectoryLock(tmp_path):
        assert stat.S_IMODE((tmp_path / ".lock").stat().st_mode) == 0o600


# ---------------------------------------------------------------- 3. callback states
def early_stopping():
    return EarlyStoppingCallback(monitor="valid_loss", patience=3)


@pytest.mark.parametrize("field,change,problem", [
    ("recorder.lrs", lambda cbs: cbs["recorder"].pop("lrs"), "is missing"),
    ("recorder.values", lambda cbs: cbs["recorder"].update(values=5), "is 5: expected a list"),
    ("early_stopping.wait", lambda cbs: cbs["early_stopping"].pop("wait"), "is missing"),
    ("early_stopping.best", lambda cbs: cbs["early_stopping"].update(best="abc"), "is 'abc': expected a number"),
    ("early_stopping.wait", lambda cbs: cbs["early_stopping"].update(wait=True), "is True: expected a number"),
])
def test_a_tampered_callback_state_is_refused_before_anything_is_loaded(dls, tmp_path, field, change, problem):
    make_learner(dls, tmp_path, [Checkpoint(), early_stopping()]).fit(1)
    checkpoint = tmp_path / "checkpoints" / "step-00000004"
    edit_state(checkpoint, lambda s: change(s["callbacks"]))
    learn = make_learner(dls, tmp_path / "other", [Checkpoint(), early_stopping()])
    learn.fit(2)                                   # weights and optimizer state that differ from the checkpoint's
    before = snapshot(learn)
    with pytest.raises(ValueError, match=rf"{checkpoint / 'state.json'}: callbacks.{field} {problem}.*resume from "
                                         rf"another checkpoint, or remove the {field.split('.')[0]} callback"):
        learn.fit(3, resume=checkpoint)
    after = snapshot(learn)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert len(learn.recorder.values) == 2 and learn.early_stopping.best_epoch == before["best_epoch"].item()


def snapshot(learn):
    """Every weight and optimizer tensor, and the EarlyStopping state, as tensors to compare."""
    out = {f"model.{k}": v.clone() for k, v in learn.model.state_dict().items()}
    for i, state in learn.opt.state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": torch.as_tensor(v).clone() for k, v in state.items()})
    out["best_epoch"] = torch.tensor(learn.early_stopping.best_epoch)
    return out


def test_an_untampered_checkpoint_resumes_exactly(dls, tmp_path):
    straight = make_learner(dls, tmp_path / "a", [early_stopping(), Tracker("csv", dir=tmp_path / "a" / "runs")])
    straight.fit(3)
    make_learner(dls, tmp_path / "b", [Checkpoint(), early_stopping(),
                                       Tracker("csv", dir=tmp_path / "b" / "runs", run_name="r")]).fit(1)
    resumed = make_learner(dls, tmp_path / "b", [Checkpoint(), early_stopping(),
                                                 Tracker("csv", dir=tmp_path / "b" / "runs", run_name="r")])
    resumed.fit(3, resume="latest")
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    assert [r["valid_loss"] for r in resumed.recorder.values] == [r["valid_loss"] for r in straight.recorder.values]
    assert resumed.early_stopping.state_dict() == straight.early_stopping.state_dict()
    assert steps(tmp_path / "b" / "runs" / "r" / "metrics.csv") == list(range(1, 13))


def two_machines(*args, timeout_s="90"):
    """`resume.py args` as a job of two machines of one process each (two launchers on this machine, the way two
    hosts would run it: no launcher stops the other machine's rank); (exit codes, stderrs, seconds taken)."""
    port = str(free_port())
    common = [sys.executable, "-m", "cadence.cli", "launch", "--cpu", "--num_machines", "2", "--num_processes", "2",
              "--main_process_ip", "127.0.0.1", "--main_process_port", port, "--timeout", timeout_s]
    start = time.monotonic()
    nodes = [subprocess.Popen([*common, "--machine_rank", str(m), str(SCRIPTS / "resume.py"), *map(str, args)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cadence_env(), cwd=REPO)
             for m in (0, 1)]
    outputs = [node.communicate(timeout=240) for node in nodes]
    return [node.returncode for node in nodes], [err for _, err in outputs], time.monotonic() - start


@pytest.mark.slow
def test_a_tampered_state_of_one_rank_stops_every_rank_at_once(tmp_path):
    """Rank 1's own callback state (in rng-rank1.pt) is bad: rank 1 refuses it naming the file, and rank 0, on
    another machine and with a good file, stops soon after, at its first collective with the rank that left (gloo
    notices the closed connection). No agreement before the load: it made every rank wait for the slowest there,
    doubling a ZeRO-3 resume's time on a small host (bench/checkpoint.py), for a damaged file of one rank's."""
    ckpt = tmp_path / "ckpt"
    codes, _, _ = two_machines("--ckpt", ckpt, "--out", tmp_path / "w.st", "--kill-at", 5)
    assert codes != [0, 0] and (ckpt / "step-00000004" / "rng-rank1.pt").is_file()
    file = ckpt / "step-00000004" / "rng-rank1.pt"
    rng = torch.load(file, weights_only=True)
    rng["callbacks"]["recorder"]["losses"] = 5
    torch.save(rng, file)
    codes, errs, seconds = two_machines("--ckpt", ckpt, "--out", tmp_path / "w.st")
    assert codes[0] != 0 and codes[1] != 0
    assert f"{file}: callbacks.recorder.losses is 5: expected a list" in errs[1], errs[1][-3000:]
    assert "Connection closed by peer" in errs[0] or "Connection reset by peer" in errs[0], errs[0][-3000:]
    assert seconds < 60, "rank 0 waited for the collective timeout"


def test_a_callback_state_saved_under_its_earlier_name_is_resumed(dls, tmp_path):
    """Checkpoints written before callbacks took fastcore's names keep ReduceLROnPlateau's state under
    `reduce_l_r_on_plateau`: a resume gives it to the callback (it started afresh, its patience count lost)."""
    from cadence.callbacks import ReduceLROnPlateau

    make_learner(dls, tmp_path, [Checkpoint(), ReduceLROnPlateau(patience=5)]).fit(2)
    checkpoint = tmp_path / "checkpoints" / "step-00000008"
    saved = json.loads((checkpoint / "state.json").read_text())["callbacks"]["reduce_lr_on_plateau"]
    edit_state(checkpoint, lambda s: s["callbacks"].update(reduce_l_r_on_plateau=s["callbacks"].pop("reduce_lr_on_plateau")))
    learn = make_learner(dls, tmp_path / "other", [Checkpoint(), ReduceLROnPlateau(patience=5)])
    learn.fit(2, resume=checkpoint)     # the run had ended: nothing left to train, the states are loaded
    assert learn.reduce_lr_on_plateau.state_dict() == saved and saved["best"] is not None
