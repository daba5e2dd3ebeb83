"""EarlyStopping, SaveModel and TerminateOnNaN on one process."""

import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import Callback, DataLoaders, Learner, Order, accuracy
from cadence.callbacks.early_stop import EarlyStopping, SaveModel, TerminateOnNaN


class ScriptValues(Callback):
    """Overwrite recorded per-epoch values with a script, right after the Recorder wrote them."""

    order = Order.RECORD + 1

    def __init__(self, **columns):
        self.columns = columns

    def after_epoch(self):
        row = self.learn.recorder.values[-1]
        for name, values in self.columns.items():
            row[name] = values[self.learn.epoch]


class CaptureWeights(Callback):
    """The model's weights at the end of every epoch, and every training loss (the non-finite one too)."""

    order = Order.GUARD - 1

    def __init__(self):
        self.weights, self.losses = [], []

    def after_batch(self):
        if self.learn.training:
            self.losses.append(self.learn.loss.item())

    def after_epoch(self):
        self.weights.append({k: v.clone() for k, v in self.learn.model.state_dict().items()})


def make_learner(dls, model, tmp_path, **kwargs):
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func=torch.optim.SGD, lr=0.1, path=tmp_path,
                    **kwargs)
    learn.remove_cbs(learn.progress)
    return learn


@pytest.mark.parametrize("losses, kwargs, stop_epoch, best_epoch", [
    ([1.0, 0.8, 0.9, 0.85, 0.7, 0.6], dict(patience=2), 3, 1),            # worse twice after the best
    ([1.0, 0.8, 0.9, 0.7, 0.75, 0.8], dict(patience=2), 5, 3),            # an improvement resets the wait
    ([1.0, 0.95, 0.9, 0.85, 0.8, 0.75], dict(min_delta=0.1), 1, 0),       # improvements under min_delta do not count
    ([1.0, 1.2, 1.4, 1.6, 1.8, 2.0], dict(mode="max", patience=3), None, 5),  # mode="max": always improving
    ([1.0, None, None, 0.9, 1.0, 1.1], dict(patience=2), 5, 3),           # epochs not validated are not counted
    ([1.0, float("nan"), float("nan"), 0.5, 0.4, 0.3], dict(patience=2), 2, 0),  # a NaN is no improvement
])
def test_early_stopping_stops_after_patience(dls, model, tmp_path, capsys, losses, kwargs, stop_epoch, best_epoch):
    learn = make_learner(dls, model, tmp_path)
    learn.fit(6, cbs=[ScriptValues(valid_loss=losses), EarlyStopping("valid_loss", **kwargs)])
    n_epochs = 6 if stop_epoch is None else stop_epoch + 1
    assert len(learn.recorder.values) == n_epochs and learn.epoch == n_epochs - 1
    assert learn.step == n_epochs * len(dls.train)
    out = capsys.readouterr().out
    if stop_epoch is None:
        assert "EarlyStopping" not in out
    else:
        assert (f"no improvement in valid_loss for {kwargs.get('patience', 1)} epoch(s) since epoch {best_epoch} "
                f"(valid_loss={losses[best_epoch]:.6g}); stopping after epoch {stop_epoch}") in out, out


def test_early_stopping_on_a_real_metric_with_a_diverging_lr(dls, model, tmp_path, capsys):
    learn = make_learner(dls, model, tmp_path, metrics=accuracy)
    learn.fit(1, lr=0.1)                              # a sensible start
    learn.fit(30, lr=1e4, cbs=EarlyStopping("valid_loss", patience=2))  # then a huge lr makes it worse
    assert len(learn.recorder.values) < 30
    assert "EarlyStopping: no improvement in valid_loss for 2 epoch(s)" in capsys.readouterr().out


def test_mode_is_inferred_from_the_name_or_taken_from_comp():
    assert EarlyStopping("valid_loss").mode == "min" and EarlyStopping("error_rate").mode == "min"
    assert EarlyStopping("accuracy").mode == "max" and SaveModel("f1").mode == "max"
    assert EarlyStopping("accuracy", comp=np.less).mode == "min"
    assert SaveModel("valid_loss", mode="max").mode == "max"


def test_save_model_reloads_the_best_epoch(dls, model, tmp_path, capsys):
    learn = make_learner(dls, model, tmp_path)
    capture, saver = CaptureWeights(), SaveModel(fname="best")
    learn.fit(4, cbs=[ScriptValues(valid_loss=[1.0, 0.5, 0.7, 0.9]), capture, saver])
    assert learn.recorder.values[-1]["epoch"] == 3
    for k, v in learn.model.state_dict().items():
        assert torch.equal(v, capture.weights[1][k]), k
        assert not torch.equal(v, capture.weights[3][k]), k
    saved = load_file(tmp_path / "models" / "best" / "model.safetensors")
    assert all(torch.equal(saved[k], capture.weights[1][k]) for k in saved)
    assert "better model found at epoch 1 with valid_loss=0.5" in capsys.readouterr().out
    assert saver.best == 0.5 and saver.best_epoch == 1


def test_save_model_saves_the_epoch_early_stopping_cancels_on(dls, model, tmp_path):
    # accuracy improves at epoch 1, where valid_loss has not improved: SaveModel must save before the cancel
    learn = make_learner(dls, model, tmp_path, metrics=accuracy)
    capture = CaptureWeights()
    learn.fit(5, cbs=[ScriptValues(valid_loss=[1.0, 1.1, 1.2, 1.3, 1.4], accuracy=[0.5, 0.6, 0.7, 0.8, 0.9]), capture,
                      EarlyStopping("valid_loss"), SaveModel("accuracy", fname="acc")])
    assert len(learn.recorder.values) == 2
    saved = load_file(tmp_path / "models" / "acc" / "model.safetensors")
    assert all(torch.equal(saved[k], capture.weights[1][k]) for k in saved)


def test_save_model_every_epoch_and_at_end(dls, model, tmp_path):
    learn = make_learner(dls, model, tmp_path)
    capture = CaptureWeights()
    learn.fit(3, cbs=[capture, SaveModel(every_epoch=2, fname="e")])
    assert sorted(p.parent.name for p in (tmp_path / "models").glob("*/model.safetensors")) == ["e_0", "e_2"]
    learn.fit(2, cbs=[ScriptValues(valid_loss=[0.1, 0.9]), SaveModel(at_end=True, fname="last")])
    final = load_file(tmp_path / "models" / "last" / "model.safetensors")
    assert all(torch.equal(final[k], v) for k, v in learn.model.state_dict().items())
    with pytest.raises(ValueError, match="every_epoch and at_end"):
        SaveModel(every_epoch=True, at_end=True)


def nan_dls(bad_item):
    """64 training items in 4 batches of 16, no shuffling; item `bad_item` has an infinite input."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g)
    x[bad_item, 0] = float("inf")
    return DataLoaders(DataLoader(TensorDataset(x[:64], y[:64]), batch_size=16),
                       DataLoader(TensorDataset(x[64:], y[64:]), batch_size=16), device="cpu")


@pytest.mark.parametrize("bad_item, nan_step", [(0, 1), (40, 3)])
def test_terminate_on_nan_stops_at_the_first_nan_step(model, tmp_path, capsys, bad_item, nan_step):
    learn = make_learner(nan_dls(bad_item), model, tmp_path)
    capture = CaptureWeights()
    learn.fit(3, cbs=[capture, TerminateOnNaN()])
    assert learn.step == nan_step and learn.train_iter == nan_step   # the NaN batch was seen (counted before after_batch)
    assert learn.recorder.values == []                                    # no validation after the NaN
    assert not np.isfinite(capture.losses[-1]) and len(capture.losses) == nan_step
    # the Recorder never saw the non-finite loss (TerminateOnNaN runs before it, as in fastai)
    assert len(learn.recorder.losses) == nan_step - 1 and np.isfinite(learn.recorder.losses).all()
    last = "none" if nan_step == 1 else f"{capture.losses[-2]:.6g} at step {nan_step - 1}"
    assert (f"TerminateOnNaN: loss is not finite on 1 of 1 process(es) at step {nan_step} (epoch 0, "
            f"batch {nan_step - 1}); last finite loss {last}") in capsys.readouterr().out


class InfInput(Callback):
    """Put an infinite value into the inputs of training batch number `at` (counted over the fit)."""

    def __init__(self, at):
        self.at = at

    def before_batch(self):
        if self.learn.training and self.learn.train_iter == self.at:
            x = self.learn.xb[0].clone()
            x[0, 0] = float("inf")
            self.learn.xb = (x, *self.learn.xb[1:])


def test_save_model_restores_finite_weights_after_a_nan(dls, model, tmp_path):
    learn = make_learner(dls, model, tmp_path)
    capture = CaptureWeights()
    learn.fit(3, cbs=[capture, InfInput(at=5), TerminateOnNaN(), SaveModel()])   # NaN in epoch 1, batch 1
    assert learn.step == 6 and len(capture.weights) == 1
    for k, v in learn.model.state_dict().items():
        assert torch.equal(v, capture.weights[0][k]), k


def test_unknown_monitor_fails_before_training_with_the_available_names(dls, model, tmp_path):
    learn = make_learner(dls, model, tmp_path, metrics=accuracy)
    with pytest.raises(ValueError, match=r"monitors 'acuracy'.*\['train_loss', 'valid_loss', 'accuracy'\]"):
        learn.fit(1, cbs=EarlyStopping("acuracy"))
    assert learn.step == 0
    no_valid = make_learner(DataLoaders(dls.train, device="cpu"), model, tmp_path)
    with pytest.raises(ValueError, match=r"monitors 'valid_loss'.*\['train_loss'\]"):
        no_valid.fit(1, cbs=SaveModel())
    no_valid.fit(2, cbs=EarlyStopping("train_loss"))


@pytest.mark.parametrize("make, match", [
    (lambda: EarlyStopping(patience=0), "patience must be a positive int"),
    (lambda: EarlyStopping(mode="lowest"), "mode must be 'min' or 'max'"),
    (lambda: EarlyStopping(min_delta=-1), "min_delta must be >= 0"),
    (lambda: EarlyStopping(mode="min", comp=np.less), "either mode"),
    (lambda: SaveModel(every_epoch=-1), "every_epoch must be"),
])
def test_bad_arguments_say_what_to_change(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_state_dict_survives_the_reset_of_a_resumed_fit(dls, model, tmp_path):
    learn = make_learner(dls, model, tmp_path)
    stopper = EarlyStopping(patience=2)
    learn.fit(2, cbs=[ScriptValues(valid_loss=[0.5, 0.6]), stopper])
    state = stopper.state_dict()
    assert state == {"best": 0.5, "best_epoch": 0, "wait": 1}
    resumed = EarlyStopping(patience=2)
    resumed.load_state_dict(state)
    learn.fit(2, cbs=[ScriptValues(valid_loss=[0.7, 0.8]), resumed])   # one more bad epoch reaches patience
    assert len(learn.recorder.values) == 1


def test_lr_find_ignores_monitoring_callbacks(dls, model, tmp_path):
    learn = make_learner(dls, model, tmp_path, cbs=[EarlyStopping(), SaveModel()])
    learn.fit(1)                                              # saves: the last epoch was a new best
    shutil.rmtree(tmp_path / "models" / "model")
    learn.lr_find(num_it=8, show_plot=False)                  # neither saves, loads nor stops
    assert not (tmp_path / "models" / "model").exists()
    assert learn.step == 8
