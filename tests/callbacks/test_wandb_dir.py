"""W&B offline: where `Tracker("wandb")` writes (`$WANDB_DIR` honoured, an explicit `dir` first), and fastai's
`WandbCallback` name on it (the run `wandb.init()` opened, else its own; what it refuses)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from cadence import Learner, accuracy
from cadence.callbacks import ProgressCallback, Tracker, WandbCallback

from test_tracking import read_wandb

pytest.importorskip("wandb")


def learner(dls, model, *cbs):
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=accuracy, lr=1e-2, cbs=list(cbs))
    learn.remove_cbs([cb for cb in learn.cbs if isinstance(cb, ProgressCallback)])
    return learn


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """A working directory and a `$WANDB_DIR`, both empty (W&B offline, from conftest)."""
    work, wandb_dir = tmp_path / "work", tmp_path / "wandb_dir"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    return work, wandb_dir


def offline_runs(root: Path) -> list[Path]:
    return sorted(root.glob("**/offline-run-*"))


def test_tracker_writes_under_wandb_dir_when_set(dls, model, dirs):
    work, wandb_dir = dirs
    learn = learner(dls, model, Tracker("wandb", project="qa", run_name="r1"))
    learn.fit(1)

    (run,) = offline_runs(wandb_dir)
    assert run.parent == wandb_dir / "wandb"           # where wandb.init(dir=$WANDB_DIR) puts it
    assert not (work / "runs").exists() and not offline_runs(work)
    run_id, config, history = read_wandb(run)
    assert run_id == learn.tracker.state_dict()["trackers"]["wandb"]["id"]
    assert config["n_epoch"] == 1 and any("valid/accuracy" in row for _, row in history)


def test_explicit_dir_wins_over_wandb_dir(dls, model, dirs, tmp_path):
    work, wandb_dir = dirs
    learner(dls, model, Tracker("wandb", project="qa", run_name="r1", dir=tmp_path / "logs")).fit(1)

    (run,) = offline_runs(tmp_path / "logs")
    assert run.parent == tmp_path / "logs" / "qa" / "r1" / "wandb"
    assert not offline_runs(wandb_dir)


def test_without_wandb_dir_the_run_directory_is_used(dls, model, dirs, monkeypatch):
    work, wandb_dir = dirs
    monkeypatch.delenv("WANDB_DIR")
    learner(dls, model, Tracker("wandb", project="qa", run_name="r1")).fit(1)

    (run,) = offline_runs(work)
    assert run.parent == work / "runs" / "qa" / "r1" / "wandb"


def test_a_resumed_run_continues_under_wandb_dir(dls, model, dirs):
    work, wandb_dir = dirs
    first = learner(dls, model, Tracker("wandb", project="qa", run_name="r1"))
    first.fit(1)
    state = first.tracker.state_dict()
    assert state["trackers"]["wandb"]["dir"] is None   # W&B's own choice ($WANDB_DIR), not a path to check

    tracker = Tracker("wandb", project="qa", run_name="r1")
    tracker.load_state_dict(state)
    learner(dls, model, tracker).fit(1)

    runs = offline_runs(wandb_dir)
    assert len(runs) == 2 and not (work / "runs").exists()
    assert {read_wandb(r)[0] for r in runs} == {state["trackers"]["wandb"]["id"]}


# ---------------------------------------------------------------- fastai's WandbCallback
def test_wandb_callback_logs_into_the_run_wandb_init_opened_and_leaves_it_open(dls, model, dirs):
    import wandb

    work, wandb_dir = dirs
    run = wandb.init(project="qa", mode="offline", dir=wandb_dir)   # W&B reads $WANDB_DIR once per process
    try:
        learn = learner(dls, model, WandbCallback())
        learn.fit(2)
        assert wandb.run is run                        # fastai's: the callback does not finish the user's run
        run.log({"after": 1.0})
    finally:
        run.finish()

    (path,) = offline_runs(wandb_dir)
    run_id, config, history = read_wandb(path)
    assert run_id == run.id and config["n_epoch"] == 2
    rows = [row for _, row in history]
    assert sum("valid/loss" in row for row in rows) == 2 and any("train/lr" in row for row in rows)
    assert any("after" in row for row in rows)
    assert learn.wandb is learn.cbs[-1]               # attached under fastai's name, learn.wandb


def test_wandb_callback_opens_and_finishes_its_own_run_without_wandb_init(dls, model, dirs):
    import wandb

    work, wandb_dir = dirs
    assert wandb.run is None
    learner(dls, model, WandbCallback(log="gradients")).fit(1)

    assert wandb.run is None                           # its own run, finished with the fit
    (path,) = offline_runs(wandb_dir)
    _, config, history = read_wandb(path)
    assert config["n_epoch"] == 1 and any("valid/accuracy" in row for _, row in history)
    assert not list(work.iterdir())                    # nothing in the working directory: W&B's files in $WANDB_DIR


@pytest.mark.parametrize("kwargs,name", [
    (dict(log_preds=True), "log_preds"), (dict(log_model=True), "log_model"),
    (dict(log_preds_every_epoch=True), "log_preds_every_epoch"), (dict(log_dataset="data"), "log_dataset"),
    (dict(model_name="best"), "model_name"), (dict(valid_dl=[]), "valid_dl")])
def test_wandb_callback_refuses_what_cadence_does_not_log(kwargs, name):
    with pytest.raises(ValueError, match=rf"WandbCallback\({name}=\.\.\.\).*drop {name}"):
        WandbCallback(**kwargs)


def test_wandb_callback_checks_log_and_takes_fastais_other_arguments():
    with pytest.raises(ValueError, match=r"log='weights'"):
        WandbCallback(log="weights")
    cb = WandbCallback(log=None, log_preds=False, n_preds=9, seed=1, reorder=False)   # inert without log_preds
    assert repr(cb) == "WandbCallback(log=None)"


def test_accelerator_with_project_dir_writes_wandb_under_wandb_dir_as_accelerate(dirs, tmp_path):
    """`Accelerator(log_with="wandb", project_dir=X)` with `$WANDB_DIR` set: Accelerate's W&B run goes under
    `$WANDB_DIR/wandb` (its tracker takes no logging directory); cadence's did under X. Without `$WANDB_DIR` it stays
    in the run's directory under X."""
    from cadence import Accelerator

    work, wandb_dir = dirs
    accelerator = Accelerator(cpu=True, log_with="wandb", project_dir=tmp_path / "proj")
    accelerator.init_trackers("qa")
    accelerator.log({"loss": 1.0}, step=0)
    accelerator.end_training()
    (run,) = offline_runs(wandb_dir)
    assert run.parent == wandb_dir / "wandb" and not offline_runs(tmp_path / "proj")


def test_accelerator_without_wandb_dir_keeps_wandb_in_the_project_dir(dirs, tmp_path, monkeypatch):
    from cadence import Accelerator

    monkeypatch.delenv("WANDB_DIR")
    accelerator = Accelerator(cpu=True, log_with="wandb", project_dir=tmp_path / "proj")
    accelerator.init_trackers("qa")
    accelerator.log({"loss": 1.0}, step=0)
    accelerator.end_training()
    (run,) = offline_runs(tmp_path / "proj")
    assert run.parent.parent.parent == tmp_path / "proj" / "qa"    # proj/qa/<start time>/wandb/offline-run-*
