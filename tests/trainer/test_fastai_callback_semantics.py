"""fastai's Learner and Callback semantics a fastai script relies on: weight decay per fit, `self.run`, the shadowing
warning, a Recorder passed in `cbs`, `learn.logger` (one process)."""

import warnings

import matplotlib
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import Callback, DataLoaders, Learner, Recorder, accuracy

matplotlib.use("Agg")


def learner(bar=False, **kw):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 6, generator=g)
    y = (x @ torch.randn(6, 3, generator=g)).argmax(1)
    dls = DataLoaders(DataLoader(TensorDataset(x[:32], y[:32]), batch_size=8),
                      DataLoader(TensorDataset(x[32:], y[32:]), batch_size=8), device="cpu")
    torch.manual_seed(0)
    learn = Learner(dls, nn.Linear(6, 3), loss_func=nn.CrossEntropyLoss(), **kw)
    if not bar:
        learn.remove_cb(learn.progress)
    return learn


class SeenWd(Callback):
    def after_batch(self):
        self.wd_seen = self.learn.opt.param_groups[0]["weight_decay"]


def test_each_fit_decays_by_learn_wd_unless_told_otherwise():
    learn, seen = learner(wd=0.3), SeenWd()
    learn.add_cb(seen)
    learn.fit(1)
    assert seen.wd_seen == 0.3
    learn.fit(1, wd=0.1)
    assert seen.wd_seen == 0.1
    learn.fit(1)                                   # fastai: `if wd is None: wd = self.wd`
    assert seen.wd_seen == 0.3
    learn.wd = 0.05
    learn.fit_one_cycle(1)
    assert seen.wd_seen == 0.05
    plain = learner()                              # no wd: the optimizer's own (AdamW's 0.01)
    plain.add_cb(seen)
    plain.fit(1)
    assert seen.wd_seen == 0.01


class Once(Callback):
    def before_fit(self):
        self.batches = 0

    def after_batch(self):
        self.batches += 1
        self.run = False


def test_run_false_skips_the_callbacks_events_until_the_fit_ends():
    learn, once = learner(), Once()
    learn.add_cb(once)
    learn.fit(2)                                   # 4 training and 2 validation batches an epoch
    assert once.batches == 1 and once.run is True  # run again after the fit, as fastai's after_fit resets it
    learn.fit(1)
    assert once.batches == 1                       # before_fit ran again (count reset), then one batch


class Fails(Callback):
    def after_batch(self):
        raise RuntimeError("boom")


def test_a_fit_ended_by_an_error_still_runs_stopped_callbacks_in_the_next():
    learn, once = learner(), Once()
    learn.add_cb(once)
    with pytest.raises(RuntimeError, match="boom"):
        learn.fit(1, cbs=Fails())
    assert once.run is True
    learn.fit(1)
    assert once.batches == 1


class Shadows(Callback):
    def after_loss(self):
        self.loss = self.learn.loss * 2            # sets the callback's own `loss`: fastai warns
        self.mine = 1


def test_a_callback_setting_a_learner_attribute_on_itself_is_warned_once():
    learn = learner(cbs=Shadows())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        learn.fit(1)
    messages = [str(w.message) for w in caught]
    assert [m for m in messages if "self.loss" in m] == [                # once, though set at every batch
        "Shadows sets self.loss, which hides the learner's loss from the callback (self.loss reads the callback's "
        "own): write self.learn.loss to change the learner's"]
    assert not [m for m in messages if "mine" in m]


def test_a_recorder_in_cbs_replaces_the_default_and_keeps_the_learners_metrics():
    learn = learner(metrics=accuracy, cbs=Recorder(train_metrics=True))
    assert sum(isinstance(cb, Recorder) for cb in learn.cbs) == 1 and learn.recorder.train_metrics
    learn.fit(1)
    assert learn.recorder.metric_names == ["epoch", "train_loss", "train_accuracy", "valid_loss", "valid_accuracy",
                                           "time"]
    assert len(learn.validate()) == 2              # [valid_loss, accuracy]
    with pytest.raises(ValueError, match="both name metrics"):
        learner(metrics=accuracy, cbs=Recorder([accuracy]))
    with pytest.raises(ValueError, match="has a Recorder already"):
        learn.fit(1, cbs=Recorder())
    assert sum(isinstance(cb, Recorder) for cb in learn.cbs) == 1 and learn.metrics


def test_without_the_bar_each_epochs_row_goes_to_learn_logger(capsys):
    learn = learner(metrics=accuracy)
    learn.fit(2)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("[0, ") and lines[1].startswith("[1, ")
    rows = []
    learn.logger = rows.append
    learn.fit(1)
    assert len(rows) == 1 and rows[0][0] == 0 and len(rows[0]) == 5          # epoch, 2 losses, accuracy, time
    assert rows[0][1:4] == list(learn.recorder.values[-1]) and rows[0][4].count(":") == 1
    with learn.no_logging():
        learn.fit(1)
    learn.lr_find(num_it=10)                       # lr_find's fit logs nothing (fastai's no_logging)
    assert len(rows) == 1


def test_the_progress_display_shows_the_rows_not_learn_logger():
    learn, rows = learner(bar=True), []
    learn.logger = rows.append
    learn.fit(1)
    assert rows == [] and learn.logger == rows.append     # given back after the fit


class Wd(Callback):
    pass


def test_a_callback_named_like_a_learner_attribute_holding_none_is_refused():
    learn = learner()
    assert learn.wd is None
    with pytest.raises(ValueError, match="callback name 'wd' clashes with Learner.wd"):
        learn.add_cb(Wd())


class Tag(Callback):
    pass


def test_removing_one_of_two_callbacks_of_a_name_leaves_the_other_as_that_attribute():
    learn, first, second = learner(), Tag(), Tag()
    learn.add_cbs([first, second])
    learn.remove_cb(second)
    assert learn.tag is first


def test_plot_loss_takes_fastais_log_show_epochs_and_ax():
    import matplotlib.pyplot as plt

    learn = learner()
    learn.fit(2)
    fig, ax = plt.subplots()
    assert learn.recorder.plot_loss(skip_start=0, log=True, show_epochs=True, ax=ax) is fig
    assert ax.get_xscale() == ax.get_yscale() == "log"
    assert [line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == ":"] == learn.recorder.iters
    plt.close(fig)


class OffInValidation(Callback):
    def __init__(self):
        self.batches = 0

    def before_fit(self):
        self.batches = 0

    def after_batch(self):
        self.batches += 1
        if not self.training:
            self.run = False


def test_a_callback_switched_off_in_a_validation_runs_in_the_next_fit():
    learn, cb = learner(), OffInValidation()
    learn.add_cb(cb)
    learn.validate()                                # fastai's validate ends with after_fit, which resets `run`
    assert cb.run is True
    learn.fit(1)
    assert cb.batches == 5                          # 4 training batches, then the first validation batch


class NotDuringLrFind(Callback):
    """fastai's own callbacks (TensorBoard, W&B, ShowGraph) sit lr_find's fit out this way."""
    def before_fit(self):
        self.run = not hasattr(self.learn, "lr_finder")
        self.epochs = 0

    def after_epoch(self):
        self.epochs += 1


def test_fastais_lr_finder_idiom_sits_out_the_sweep_and_not_the_fits_after_it():
    learn, cb = learner(), NotDuringLrFind()
    learn.add_cb(cb)
    learn.lr_find(num_it=10, show_plot=False)
    assert cb.epochs == 0 and len(learn.lr_finder.lrs) > 0     # the sweep stays readable until the next fit
    learn.fit(2)
    assert cb.epochs == 2 and not hasattr(learn, "lr_finder")


class SetsInInit(Callback):
    def __init__(self):
        self.path = "mine"                           # set before it was attached: fastai does not warn


def test_a_copied_learner_warns_of_nothing_its_callbacks_set_before_they_were_attached():
    import copy

    learn = copy.deepcopy(learner(cbs=SetsInInit()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        learn.fit(1)


class CancelEpochAt(Callback):
    def __init__(self, event):
        setattr(self, event, self.cancel)

    def cancel(self):
        from cadence import CancelEpochException

        raise CancelEpochException()


@pytest.mark.parametrize("event, row", [("before_train", []), ("before_validate", ["train_loss"])])
def test_a_cancelled_epochs_row_holds_what_it_recorded_before_as_fastais(event, row, tmp_path):
    import csv

    from cadence import CSVLogger

    learn = learner(metrics=accuracy, path=tmp_path)
    learn.fit(2, cbs=[CancelEpochAt(event), CSVLogger()])
    assert [list(r.keys()) for r in learn.recorder.values] == [["epoch", *row, "time"]] * 2
    assert len(learn.recorder.values[0]) == len(row)            # fastai's row: [] cancelled in training
    header, *lines = csv.DictReader((tmp_path / "history.csv").open()).reader   # each cell under its column
    assert header == ["epoch", "train_loss", "valid_loss", "accuracy", "time"]
    assert [[cell != "" for cell in line] for line in lines] == [[True, bool(row), False, False, True]] * 2
