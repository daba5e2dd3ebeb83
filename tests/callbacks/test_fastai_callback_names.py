"""fastai's callback names (SaveModelCallback, EarlyStoppingCallback, CSVLogger, GradientAccumulation, GradientClip,
TensorBoardCallback, ReduceLROnPlateau, MixedPrecision) train a tiny Learner with fastai's arguments and effects."""

import csv

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import cadence
from cadence import Callback, DataLoaders, Learner, Order
from cadence.callbacks import (CSVLogger, CSVTracker, EarlyStopping, EarlyStoppingCallback, GradientAccumulation,
                               GradientClip, MixedPrecision, ReduceLROnPlateau, SaveModel, SaveModelCallback,
                               TensorBoardCallback, Tracker)


def _learner(tmp_path, n=32, bs=8, **kwargs):
    torch.manual_seed(0)
    x = torch.randn(n, 4)
    ds = TensorDataset(x, (x.sum(1) > 0).long())
    dls = DataLoaders.from_dsets(ds, ds, bs=bs)
    learn = Learner(dls, nn.Linear(4, 2), loss_func=nn.CrossEntropyLoss(), opt_func=torch.optim.SGD, lr=0.1,
                    path=tmp_path, **kwargs)
    learn.remove_cbs(learn.progress)
    return learn


class Script(Callback):
    """Overwrite the recorded valid_loss with a script, right after the Recorder wrote it."""

    order = Order.RECORD + 1

    def __init__(self, values):
        self.values = values

    def after_epoch(self):
        self.learn.recorder.values[-1]["valid_loss"] = self.values[self.learn.epoch]


def test_fastai_names_are_exported_where_fastai_users_import_them():
    for name in ("SaveModelCallback", "EarlyStoppingCallback", "CSVLogger", "GradientAccumulation", "GradientClip",
                 "TensorBoardCallback", "ReduceLROnPlateau", "MixedPrecision"):
        assert name in cadence.__all__ and getattr(cadence, name) is getattr(cadence.callbacks, name)
    assert issubclass(EarlyStoppingCallback, EarlyStopping) and issubclass(SaveModelCallback, SaveModel)


def test_csv_logger_writes_fastais_history_file_and_appends(tmp_path):
    learn = _learner(tmp_path, metrics=cadence.accuracy)
    learn.fit(2, cbs=CSVLogger())
    rows = list(csv.reader(open(tmp_path / "history.csv")))
    assert rows[0] == ["epoch", "train_loss", "valid_loss", "accuracy", "time"] and len(rows) == 3
    assert [r[0] for r in rows[1:]] == ["0", "1"]
    assert float(rows[2][2]) == pytest.approx(learn.recorder.values[-1]["valid_loss"])
    learn.fit(1, cbs=CSVLogger(fname="logs/h.csv"))
    learn.fit(1, cbs=CSVLogger(fname="logs/h.csv", append=True))
    assert [r[0] for r in csv.reader(open(tmp_path / "logs/h.csv"))] == ["epoch", "0", "epoch", "0"]


class StopAfterEpoch(Callback):
    order = Order.CHECKPOINT + 1     # after the epoch's checkpoint is written

    def after_epoch(self):
        if self.learn.epoch == 1:
            raise RuntimeError("stopped")


def test_a_resumed_run_keeps_the_csv_rows_of_the_epochs_before_it(tmp_path):
    from cadence import Checkpoint

    learn = _learner(tmp_path, cbs=[CSVLogger(), Checkpoint("ckpt"), StopAfterEpoch()])
    with pytest.raises(RuntimeError, match="stopped"):
        learn.fit(4)
    before = list(csv.reader((tmp_path / "history.csv").open()))
    assert [row[0] for row in before] == ["epoch", "0", "1"]
    learn = _learner(tmp_path, cbs=[CSVLogger(), Checkpoint("ckpt")])
    learn.fit(4, resume="auto")
    rows = list(csv.reader((tmp_path / "history.csv").open()))
    assert [row[0] for row in rows] == ["epoch", "0", "1", "2", "3"]   # the resume rewrote the file from the start
    assert rows[1:3] == before[1:]                                     # the epochs before it, as they were written
    assert [float(row[1]) for row in rows[1:]] == [r["train_loss"] for r in learn.recorder.values]


def test_save_model_callback_takes_fastais_positional_order_and_loads_the_best(tmp_path):
    learn = _learner(tmp_path)
    cb = SaveModelCallback("valid_loss", None, 0.0, "best")   # monitor, comp, min_delta, fname
    snapshots = []
    learn.fit(3, cbs=[Script([0.5, 0.1, 0.9]), cb, Snapshot(snapshots)])
    assert (tmp_path / "models" / "best").is_dir() and cb.best == 0.1
    assert torch.equal(learn.model.weight, snapshots[1])   # the best epoch's weights are back


class Snapshot(Callback):
    order = Order.REPORT + 1

    def __init__(self, out):
        self.out = out

    def after_epoch(self):
        self.out.append(self.learn.model.weight.detach().clone())


def test_early_stopping_callback_stops_after_patience(tmp_path):
    learn = _learner(tmp_path)
    learn.fit(10, cbs=[Script([1.0, 0.5, 0.6, 0.7, 0.8] + [0.9] * 5), EarlyStoppingCallback(patience=2)])
    assert len(learn.recorder.values) == 4


def test_gradient_accumulation_steps_once_per_n_acc_samples_and_gradient_clip_clips(tmp_path):
    learn = _learner(tmp_path, n=32, bs=8)
    learn.fit(1, cbs=GradientAccumulation(n_acc=16))
    assert learn.step == 2                        # 4 batches of 8 samples, a step per 16
    learn = _learner(tmp_path)
    learn.fit(1, cbs=GradientClip(1e-3))
    assert learn.grad_norm > 1e-3                 # the norm before clipping
    assert GradientClip().max_norm == 1.0         # fastai's default


def test_tensorboard_callback_writes_into_log_dir_and_refuses_what_it_cannot(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    learn = _learner(tmp_path)
    learn.fit(2, cbs=TensorBoardCallback(tmp_path / "tb"))
    (events,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    tb = EventAccumulator(str(events.parent))
    tb.Reload()
    assert [e.step for e in tb.Scalars("valid/loss")] == [4, 8]
    assert len(tb.Scalars("train/loss")) == 8
    with pytest.raises(ValueError, match=r"TensorBoardCallback\(trace_model=True\).*drop trace_model"):
        TensorBoardCallback(trace_model=True)


def test_reduce_lr_on_plateau_and_mixed_precision_keep_fastais_names(tmp_path):
    learn = _learner(tmp_path)
    learn.fit(3, cbs=[Script([1.0, 1.0, 1.0]), ReduceLROnPlateau(patience=1, factor=10)])
    assert learn.opt.param_groups[0]["lr"] == pytest.approx(0.1 / 100)
    learn = _learner(tmp_path)
    seen = []
    learn.fit(1, cbs=[MixedPrecision("bf16"), Callback(after_batch=lambda cb: seen.append(learn.strategy.precision.name))])
    assert set(seen) == {"bf16"} and hasattr(learn, "mixed_precision") is False   # a fit's callback, gone after it
    assert learn.strategy.precision.name == "no"   # as fastai's MixedPrecision.after_fit drops its autocast


def test_a_tracker_in_cbs_says_to_wrap_it_in_tracker(tmp_path):
    learn = _learner(tmp_path)
    advice = r"not a callback; in cbs= pass Tracker\(CSVTracker\(...\)\) or Tracker\('csv'\)"
    with pytest.raises(TypeError, match=advice):
        learn.fit(1, cbs=CSVTracker(dir=tmp_path))
    learn.fit(1, cbs=Tracker(CSVTracker(dir=tmp_path)))   # what it says works
    assert next(tmp_path.rglob("metrics.csv")).read_text().startswith("step,")
