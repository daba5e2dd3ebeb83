"""Tracker: TensorBoard event files, the W&B offline run and metrics.csv, read back and compared with the Recorder."""

from __future__ import annotations

import csv
import datetime
import json
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from cadence import Callback, CancelFitException, CancelStepException, Learner, Order, accuracy
from cadence.callbacks.tracking import CSVTracker, GeneralTracker, TensorBoardTracker, Tracker

from helpers import run_launch


# ---------------------------------------------------------------- readers
def read_tensorboard(run_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], str]:
    """Scalars per tag as (step, value) with tensorboard's own reader, and the stored hparams text."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    texts = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("hparams/text_summary")]
    return scalars, "\n".join(texts)


def read_wandb(run_dir: Path, timeout: float = 30.0) -> tuple[str, dict, list[tuple[int, dict]]]:
    """Run id, config and history rows of an offline run, from its `.wandb` file (a LevelDB-style record log).
    W&B's service process writes the file in 32 KiB blocks and may still be flushing it after `finish()`
    returned (seen on a busy host: the header alone, no record): read again until its last record, the run's
    exit, is there."""
    deadline = time.monotonic() + timeout
    while True:
        run_id, config, history, ended = _parse_wandb(run_dir)
        if ended or time.monotonic() > deadline:
            return run_id, config, history
        time.sleep(0.2)


def _parse_wandb(run_dir: Path) -> tuple[str | None, dict, list[tuple[int, dict]], bool]:
    from wandb.proto import wandb_internal_pb2 as pb

    (file,) = run_dir.glob("run-*.wandb")
    data = file.read_bytes()
    assert struct.unpack("<4sHB", data[:7])[:2] == (b":W&B", 0xBEE1)
    pos, block, chunks, run_id, config, history, ended = 7, 32768, b"", None, {}, [], False
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a complete record
            record = pb.Record.FromString(chunks)
            chunks = b""
            which = record.WhichOneof("record_type")
            if which == "run":
                run_id = record.run.run_id
            elif which == "config":
                config.update({u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in record.config.update})
            elif which == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                history.append((record.history.step.num, {k: v for k, v in items.items() if not k.startswith("_")}))
            ended |= which == "exit"
    return run_id, config, history, ended


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def series(rows: list[tuple[int, dict]], key: str) -> list[tuple[int, float]]:
    return [(step, values[key]) for step, values in rows if key in values]


# ---------------------------------------------------------------- test callbacks
class ListTracker(GeneralTracker):
    """Records every call the Tracker makes."""

    name = "list"

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def start(self, step):
        self.calls.append(("start", step))

    def store_init_configuration(self, config):
        self.calls.append(("config", config))

    def log(self, values, step):
        self.calls.append(("log", step, values))

    def finish(self):
        self.calls.append(("finish",))

    def logs(self, key):
        return [(c[1], c[2][key]) for c in self.calls if c[0] == "log" and key in c[2]]


class StepEveryOther(Callback):
    """Stand-in for gradient accumulation: the optimizer steps on every second batch only; sets a grad norm."""

    order = Order.ACCUMULATE

    def before_step(self):
        if self.learn.iter % 2 == 0:
            raise CancelStepException
        self.learn.grad_norm = torch.tensor(float(self.learn.step + 10))


class FakeResume(Callback):
    """What Checkpoint does on resume: counters set before the tracker's before_fit."""

    order = Order.DEFAULT  # before the tracker; the real resume happens in fit(), before before_fit

    def __init__(self, epoch, step):
        self.resume_epoch, self.resume_step = epoch, step

    def before_fit(self):
        self.learn.epoch, self.learn.step = self.resume_epoch, self.resume_step


class Snapshot(Callback):
    """What Checkpoint does on save: the tracker's state after epoch 0."""

    order = Order.CHECKPOINT

    def after_epoch(self):
        if self.learn.epoch == 0:
            self.state = self.learn.tracker.state_dict()


def learner(dls, model, *cbs, lr=1e-2):
    return Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=accuracy, lr=lr, cbs=list(cbs))


def expected_epoch_values(learn, steps_per_epoch, first_epoch=0):
    """{tag: [(step, value)]} for the per-epoch values the Recorder stored."""
    out = {}
    for i, row in enumerate(learn.recorder.values):
        step = (first_epoch + i + 1) * steps_per_epoch
        for tag, key in (("train/epoch_loss", "train_loss"), ("valid/loss", "valid_loss"), ("valid/accuracy", "accuracy")):
            out.setdefault(tag, []).append((step, row[key]))
    return out


def assert_series(got, expected):
    assert [s for s, _ in got] == [s for s, _ in expected], (got, expected)
    for (_, a), (_, b) in zip(got, expected):
        assert a == pytest.approx(b, rel=1e-5), (got, expected)


# ---------------------------------------------------------------- single process
def test_tensorboard_csv_and_custom_tracker_hold_recorder_values(dls, model, tmp_path):
    custom = ListTracker()
    learn = learner(dls, model, Tracker(["tensorboard", "csv", custom], project="p", run_name="r", dir=tmp_path,
                                        config={"arch": "mlp"}))
    learn.fit(2)
    run_dir = tmp_path / "p" / "r"
    steps = list(range(1, 9))  # 4 batches per epoch, 2 epochs
    train_loss = list(zip(steps, learn.recorder.raw_losses))
    per_epoch = expected_epoch_values(learn, 4)

    scalars, hparams = read_tensorboard(run_dir)
    assert_series(scalars["train/loss"], train_loss)
    assert_series(scalars["train/lr"], list(zip(steps, learn.recorder.lrs)))
    assert "train/grad_norm" not in scalars  # no callback set learn.grad_norm
    for tag, expected in per_epoch.items():
        assert_series(scalars[tag], expected)
    stored = json.loads(re.search(r"```\n(.*)\n```", hparams, re.S).group(1))
    assert stored == {"arch": "mlp", "n_epoch": 2, "lr": 1e-2, "batch_size": 16, "optimizer": "AdamW", "world_size": 1}

    rows = read_csv(run_dir / "metrics.csv")
    assert list(rows[0]) == ["step", "train/lr", "train/loss", "train/epoch_loss", "valid/loss", "valid/accuracy"]
    assert_series([(int(r["step"]), float(r["train/loss"])) for r in rows if r["train/loss"]], train_loss)
    for tag, expected in per_epoch.items():
        assert_series([(int(r["step"]), float(r[tag])) for r in rows if r[tag]], expected)
    assert yaml.safe_load((run_dir / "hparams.yaml").read_text()) == stored

    assert custom.calls[0] == ("start", 0) and custom.calls[1] == ("config", stored) and custom.calls[-1] == ("finish",)
    assert_series(custom.logs("train/loss"), train_loss)
    assert_series(custom.logs("valid/accuracy"), per_epoch["valid/accuracy"])


def test_logs_once_per_optimizer_step_with_mean_loss_and_grad_norm(dls, model):
    custom = ListTracker()
    learn = learner(dls, model, StepEveryOther(), Tracker(custom))
    learn.fit(1)
    assert learn.step == 2  # 4 batches, 2 steps
    losses = learn.recorder.raw_losses
    assert_series(custom.logs("train/loss"), [(1, (losses[0] + losses[1]) / 2), (2, (losses[2] + losses[3]) / 2)])
    assert_series(custom.logs("train/grad_norm"), [(1, 10.0), (2, 11.0)])
    assert [s for s, _ in custom.logs("valid/loss")] == [2]


def test_cancelled_fit_still_finishes_the_run(dls, model):
    class StopAtStep2(Callback):
        def after_batch(self):
            if self.learn.training and self.learn.step == 2:
                raise CancelFitException

    custom = ListTracker()
    learner(dls, model, StopAtStep2(), Tracker(custom)).fit(3)
    assert [s for s, _ in custom.logs("train/loss")] == [1, 2]
    assert custom.calls[-1] == ("finish",)


def test_only_the_main_process_tracks(dls, model, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    custom = ListTracker()
    learn = learner(dls, model, Tracker(["csv", custom], dir=tmp_path))
    learn.fit(1)
    assert custom.calls == [] and not any(tmp_path.iterdir())
    assert learn.tracker.state_dict() == {"trackers": {"csv": {}, "list": {}}}


def test_lr_find_is_not_tracked(dls, model):
    custom = ListTracker()
    learn = learner(dls, model, Tracker(custom))
    learn.lr_find(num_it=5, show_plot=False)
    assert custom.calls == []


def test_a_new_run_never_writes_into_an_existing_run(dls, model, tmp_path):
    for _ in range(2):
        learner(dls, model, Tracker(["csv", "tensorboard"], run_name="r", dir=tmp_path)).fit(1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r", "r_1"]
    for name in ("r", "r_1"):
        assert len(read_csv(tmp_path / name / "metrics.csv")) == 4 + 1
        assert len(list((tmp_path / name).glob("events.out.tfevents.*"))) == 1


def test_every_kind_writes_into_one_run_directory_and_hparams_hold_the_fit_lr(dls, model, tmp_path, monkeypatch):
    seconds = iter(range(10**6))

    class TickingClock:   # every reading is a new second: a run name taken per tracker would differ
        @staticmethod
        def now():
            return datetime.datetime.fromtimestamp(1.8e9 + next(seconds))

    monkeypatch.setattr("cadence.callbacks.tracking.base.datetime", TickingClock)
    learn = learner(dls, model, Tracker(["tensorboard", "wandb", "csv"], project="p", dir=tmp_path), lr=1e-3)
    learn.fit_one_cycle(1, lr_max=0.05)
    (run_dir,) = (tmp_path / "p").iterdir()
    assert sorted(p.name for p in run_dir.iterdir() if not p.name.startswith("events.out")) == [
        "hparams.yaml", "metrics.csv", "wandb"]
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1 and list((run_dir / "wandb").glob("offline-run-*"))
    assert yaml.safe_load((run_dir / "hparams.yaml").read_text())["lr"] == 0.05   # fit_one_cycle's lr_max, not 1e-3
    _, hparams = read_tensorboard(run_dir)
    assert '"lr": 0.05' in hparams


def test_state_round_trip_continues_tensorboard_csv_and_wandb_run(dls, model, tmp_path):
    """A 'crashed' run goes on past its checkpoint (steps 5..8); the resumed run replaces those steps."""
    snapshot = Snapshot()
    first = learner(dls, model, snapshot, Tracker(["tensorboard", "csv", "wandb"], project="p", run_name="r",
                                                   dir=tmp_path))
    first.fit(2)
    first_losses = first.recorder.raw_losses
    state = json.loads(json.dumps(snapshot.state))  # as Checkpoint would store it in state.json
    run_dir = (tmp_path / "p" / "r").resolve()
    assert state["trackers"]["tensorboard"] == state["trackers"]["csv"] == {"dir": str(run_dir)}
    wandb_id = state["trackers"]["wandb"]["id"]

    # W&B names an offline session's directory by the second it started: two sessions of one run id
    # within one second would share it (seen on a fast machine), and the check below counts sessions
    time.sleep(max(0.0, 1.05 - (time.time() % 1.0)))
    torch.manual_seed(1)
    tracker = Tracker(["tensorboard", "csv", "wandb"], project="p", run_name="r", dir=tmp_path)
    tracker.load_state_dict(state)
    resumed = learner(dls, nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), FakeResume(epoch=1, step=4),
                      tracker, lr=1e-3)
    resumed.fit(2)
    assert resumed.step == 8 and len(resumed.recorder.raw_losses) == 4
    train_loss = list(zip(range(1, 9), first_losses[:4] + resumed.recorder.raw_losses))
    assert first_losses[4:] != resumed.recorder.raw_losses  # the replaced tail differs, so the purge is visible
    valid = [(4, first.recorder.values[0]["valid_loss"]), (8, resumed.recorder.values[0]["valid_loss"])]

    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["r"]
    scalars, _ = read_tensorboard(run_dir)
    assert_series(scalars["train/loss"], train_loss)
    assert_series(scalars["valid/loss"], valid)
    rows = read_csv(run_dir / "metrics.csv")
    assert_series([(int(r["step"]), float(r["train/loss"])) for r in rows if r["train/loss"]], train_loss)
    assert_series([(int(r["step"]), float(r["valid/loss"])) for r in rows if r["valid/loss"]], valid)

    runs = sorted((run_dir / "wandb").glob("offline-run-*"))  # W&B's files in the run's one directory
    assert len(runs) == 2  # W&B offline writes one directory per process session, both with the same run id
    (id1, config1, history1), (id2, _, history2) = map(read_wandb, runs)
    assert id1 == id2 == wandb_id == resumed.tracker.state_dict()["trackers"]["wandb"]["id"]
    assert config1["n_epoch"] == 2 and config1["optimizer"] == "AdamW"
    assert_series(series(history1, "train/loss"), list(zip(range(1, 9), first_losses)))
    assert_series(series(history1, "valid/accuracy"), [(4, first.recorder.values[0]["accuracy"]),
                                                       (8, first.recorder.values[1]["accuracy"])])
    assert_series(series(history2, "train/loss"), train_loss[4:])
    assert_series(series(history2, "valid/loss"), valid[1:])


# ---------------------------------------------------------------- errors and imports
@pytest.mark.parametrize("module,kind", [("wandb", "wandb"), ("tensorboard", "tensorboard")])
def test_missing_package_fails_at_construction_with_the_pip_line(monkeypatch, module, kind):
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ImportError, match=re.escape(f'pip install "cadence[{kind}]"')):
        Tracker(["csv", kind])


def test_bad_arguments_say_what_to_change():
    with pytest.raises(ValueError, match="unknown tracker 'mlflow'"):
        Tracker("mlflow")
    with pytest.raises(TypeError, match=r"pass an instance, e.g. Tracker\(CSVTracker\(...\)\)"):
        Tracker(CSVTracker)
    with pytest.raises(ValueError, match="share a name"):
        Tracker(["csv", CSVTracker(run_name="other")])
    with pytest.raises(TypeError, match="config must be a dict"):
        Tracker("csv", config=["lr", 1e-3])
    with pytest.raises(ValueError, match="at least one tracker"):
        Tracker([])
    assert isinstance(Tracker("tensorboard").trackers[0], TensorBoardTracker)


def test_importing_trackers_does_not_import_tensorboard_or_wandb():
    code = ("import sys, cadence.callbacks.tracking; "
            "print([m for m in ('wandb', 'tensorboard', 'torch.utils.tensorboard') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------- two processes
@pytest.mark.slow
def test_one_run_per_job_under_ddp(tmp_path):
    run_launch("tracking_ddp.py", str(tmp_path))
    result = json.loads((tmp_path / "result.json").read_text())
    assert not (tmp_path / "result_rank1.json").exists()
    values, losses, steps = result["values"], result["losses"], result["step"]
    assert steps == 2 * 4  # 64 samples / 2 ranks / batch 8, two epochs
    train_loss = list(zip(range(1, steps + 1), losses))
    per_epoch = {"valid/loss": [(4, values[0]["valid_loss"]), (8, values[1]["valid_loss"])],
                 "valid/accuracy": [(4, values[0]["accuracy"]), (8, values[1]["accuracy"])],
                 "train/epoch_loss": [(4, values[0]["train_loss"]), (8, values[1]["train_loss"])]}

    (events,) = tmp_path.rglob("events.out.tfevents.*")
    scalars, hparams = read_tensorboard(events.parent)
    assert '"world_size": 2' in hparams
    assert_series(scalars["train/loss"], train_loss)
    for tag, expected in per_epoch.items():
        assert_series(scalars[tag], expected)

    (metrics_csv,) = tmp_path.rglob("metrics.csv")
    rows = read_csv(metrics_csv)
    for tag, expected in per_epoch.items():
        assert_series([(int(r["step"]), float(r[tag])) for r in rows if r[tag]], expected)

    (wandb_run,) = (events.parent / "wandb").glob("offline-run-*")  # one directory for the run's three trackers
    run_id, config, history = read_wandb(wandb_run)
    assert run_id == result["state"]["trackers"]["wandb"]["id"] and config["world_size"] == 2
    assert_series(series(history, "train/loss"), train_loss)
    for tag, expected in per_epoch.items():
        assert_series(series(history, tag), expected)
