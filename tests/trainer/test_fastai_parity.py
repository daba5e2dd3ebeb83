"""fastai APIs a ported script relies on, each checked against what fastai does (one process, tiny models).

Expected values come from the data and from torch directly, never from the code under test.
"""

import copy
import io
import json
import pickle
import re
import warnings
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import Callback, DataLoaders, EpochRecord, Learner, Order, ProgressCallback, Recorder, accuracy

N_TRAIN, N_VALID, BS = 40, 16, 8   # 5 training batches, 2 validation batches


def data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_TRAIN + N_VALID, 6, generator=g)
    y = (x @ torch.randn(6, 3, generator=g)).argmax(1)
    return TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), TensorDataset(x[N_TRAIN:], y[N_TRAIN:])


def learner(train_dl=None, bar=False, **kw):
    train, valid = data()
    dls = DataLoaders(train_dl or DataLoader(train, batch_size=BS), DataLoader(valid, batch_size=BS), device="cpu")
    torch.manual_seed(0)
    kw = {"loss_func": nn.CrossEntropyLoss(), "metrics": accuracy, **kw}
    learn = Learner(dls, kw.pop("model", None) or nn.Linear(6, 3), **kw)
    if not bar:
        learn.remove_cb(learn.progress)
    return learn


class BatchLosses(Callback):
    """Every training batch's loss, as the loop computed it."""

    def before_fit(self):
        self.losses = []

    def after_loss(self):
        if self.training:
            self.losses.append(self.learn.loss.item())


def smoothed(losses, beta=0.98):
    """fastai's AvgSmoothLoss, by hand."""
    val = 0.0
    for loss in losses:
        val = beta * val + (1 - beta) * loss
    return val / (1 - beta ** len(losses))


def valid_by_hand(learn):
    x, y = data()[1].tensors
    with torch.no_grad():
        out = learn.model(x)
    return F.cross_entropy(out, y).item(), (out.argmax(1) == y).float().mean().item()


# ---------------------------------------------------------------- 1. learn.final_record
def test_final_record_is_the_last_epochs_list_and_validate_sets_it_too():
    learn = learner(cbs=BatchLosses())
    assert learn.final_record is None                       # nothing recorded yet
    learn.fit(2, lr=1e-2)
    train_loss = smoothed(learn.batch_losses.losses)        # 10 batches, smoothed over the whole fit
    valid_loss, acc = valid_by_hand(learn)
    assert learn.final_record == pytest.approx([train_loss, valid_loss, acc])
    assert learn.final_record is learn.recorder.values[-1] and len(learn.final_record) == 3
    learn.validate()
    assert learn.final_record == pytest.approx([valid_loss, acc])     # fastai: validate() returns final_record


# ---------------------------------------------------------------- 2. recorder.log and recorder.iters
class Snapshots(Callback):
    order = Order.RECORD + 1   # after the Recorder, as any callback reading its log

    def before_fit(self):
        self.after_train, self.after_epoch_ = [], []

    def after_train(self):
        self.after_train.append(list(self.learn.recorder.log))

    def after_epoch(self):
        self.after_epoch_.append(list(self.learn.recorder.log))


def test_recorder_log_is_the_row_being_built_and_iters_the_batches_at_each_validation():
    learn = learner(cbs=[Snapshots(), BatchLosses()])
    learn.fit(3, lr=1e-2)
    losses = learn.batch_losses.losses
    assert learn.recorder.iters == [5, 10, 15]              # 40 items, batches of 8
    first, last = learn.snapshots.after_train[0], learn.snapshots.after_epoch_[-1]
    assert first == [0, pytest.approx(smoothed(losses[:5]))]          # [epoch, train_loss] before validation
    valid_loss, acc = valid_by_hand(learn)
    assert last[:4] == [2, pytest.approx(smoothed(losses)), pytest.approx(valid_loss), pytest.approx(acc)]
    assert re.fullmatch(r"\d\d:\d\d", last[4])               # fastai's format_time
    assert learn.recorder.log == last


# ---------------------------------------------------------------- 3. no_logging() and no_mbar()
def test_no_logging_silences_the_epoch_lines_for_the_block_only(capsys):
    learn = learner(bar=True)          # not a terminal here: plain lines, one per epoch
    with learn.no_logging():
        learn.fit(2)
    assert capsys.readouterr().out == ""
    with learn.no_mbar():
        learn.fit(2)
    assert capsys.readouterr().out == ""                     # fastai writes the table into the master bar
    learn.fit(2)
    assert [line.split(" |")[0] for line in capsys.readouterr().out.splitlines()] == ["epoch 0", "epoch 1"]


class BarTasks(Callback):
    order = Order.REPORT + 1   # after the progress display started its bar

    def before_fit(self):
        self.seen = []

    def before_train(self):
        self.seen += [t.description for t in self.learn.progress.bar.tasks]


def test_on_a_terminal_no_logging_keeps_the_bar_and_no_mbar_drops_the_epoch_from_it():
    out = io.StringIO()
    learn = learner(cbs=BarTasks())
    learn.add_cb(ProgressCallback(console=Console(file=out, force_terminal=True, color_system=None, width=120)))
    with learn.no_logging():
        learn.fit(1)
    assert learn.bar_tasks.seen == ["epoch 1/1 train"] and "train_loss" not in out.getvalue()
    with learn.no_mbar():
        learn.fit(1)
    assert learn.bar_tasks.seen == ["train"] and "train_loss" not in out.getvalue()
    learn.fit(1)
    assert learn.bar_tasks.seen == ["epoch 1/1 train"] and "train_loss" in out.getvalue()


# ---------------------------------------------------------------- 4. show_results
def test_show_results_returns_and_prints_max_n_items_with_their_predictions(capsys):
    learn = learner()
    learn.fit(1, lr=1e-2)
    capsys.readouterr()                       # the fit's row, printed by learn.logger (no bar)
    x, y = data()[1].tensors
    inputs, preds, targs = learn.show_results(max_n=3, shuffle=False)
    with torch.no_grad():
        expected = learn.model(x[:3])
    assert torch.equal(inputs, x[:3]) and torch.equal(targs, y[:3]) and torch.allclose(preds, expected)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["input", "target", "prediction"] and len(lines) == 4
    assert [line.split()[-2:] for line in lines[1:]] == [[str(int(t)), str(int(p))]
                                                         for t, p in zip(y[:3], expected.argmax(1))]
    torch.manual_seed(1)
    inputs, preds, targs = learn.show_results(max_n=5)          # random items of the validation set
    rows = [int(torch.nonzero((x == row).all(1))[0]) for row in inputs]
    assert len(set(rows)) == 5 and torch.equal(targs, y[rows]) and rows != sorted(rows)


# ---------------------------------------------------------------- 5. fit(reset_opt=True)
def test_fit_reset_opt_starts_a_new_optimizer_and_takes_a_changed_opt_func():
    learn = learner(opt_func=torch.optim.Adam)
    learn.fit(1)
    learn.fit(1)
    assert {s["step"].item() for s in learn.opt.state.values()} == {10.0}     # Adam's step count carried over
    learn.fit(1, reset_opt=True)
    assert {s["step"].item() for s in learn.opt.state.values()} == {5.0}      # counted afresh: one epoch's batches
    learn.opt_func = partial(torch.optim.SGD, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                       # no warning about a changed opt_func: it is used
        learn.fit_one_cycle(1, 1e-2, reset_opt=True)
    assert type(learn.opt) is torch.optim.SGD
    with learn.distrib_ctx():                                # one process: the engine keeps the optimizer it built
        learn.fit(1, reset_opt=True)
    assert type(learn.opt) is torch.optim.SGD
    with pytest.raises(TypeError, match="reset_opt.*True or False, got 'auto'; pass resume= by name"):
        learn.fit(1, None, None, None, "auto")             # a resume given by position, before reset_opt was there


# ---------------------------------------------------------------- 6. get_preds(reorder=, inner=, concat_dim=)
def test_get_preds_reorder_false_keeps_a_shuffled_loaders_order():
    learn = learner()
    x, y = data()[0].tensors
    shuffled = DataLoader(TensorDataset(x, y), batch_size=BS, shuffle=True, generator=torch.Generator().manual_seed(3))
    twin = DataLoader(torch.arange(N_TRAIN), batch_size=BS, shuffle=True, generator=torch.Generator().manual_seed(3))
    order = torch.cat(list(twin))                                     # the items in the order that loader draws them
    preds, targs = learn.get_preds(dl=shuffled, reorder=False)
    with torch.no_grad():
        assert torch.equal(targs, y[order]) and torch.allclose(preds, learn.model(x[order]))
    preds, targs = learn.get_preds(dl=shuffled)                       # reorder=True: the data set's order
    assert torch.equal(targs, y)
    assert torch.equal(learn.get_preds(reorder=False)[1], data()[1].tensors[1])   # dls[1] is read in order anyway


class SeqFirst(nn.Module):
    """Outputs (2, batch, 3), sequence first, as a language model's."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x):
        return torch.stack([self.lin(x), -self.lin(x)])


def seq_first(items):
    """Collate targets sequence first: (2, batch)."""
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items]).expand(2, -1)


def test_get_preds_concat_dim_joins_sequence_first_batches():
    train, valid = data()
    dls = DataLoaders(DataLoader(train, batch_size=BS), DataLoader(valid, batch_size=BS, collate_fn=seq_first),
                      device="cpu")
    learn = Learner(dls, SeqFirst(), loss_func=lambda p, y: F.cross_entropy(p.flatten(0, 1), y.flatten()))
    learn.remove_cb(learn.progress)
    preds, targs = learn.get_preds(concat_dim=1)
    x, y = valid.tensors
    with torch.no_grad():
        assert preds.shape == (2, N_VALID, 3) and torch.allclose(preds, learn.model(x))
    assert torch.equal(targs, y.expand(2, -1))


class PredsMidEpoch(Callback):
    """A callback calling get_preds(inner=True) in the middle of every training epoch."""

    order = Order.REPORT + 1

    def before_fit(self):
        self.states, self.n_preds = [], []

    def after_batch(self):
        learn = self.learn
        if learn.training and learn.iter == 2:
            xb = learn.xb
            self.n_preds.append(len(learn.get_preds(inner=True)[0]))
            self.states.append((learn.training, learn.dl is learn.dls.train, learn.xb is xb, learn.iter,
                                learn.model[0].training, learn.model[1].training))


def test_get_preds_inner_leaves_the_fit_as_it_was(capsys):
    def bn_frozen_model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 3), nn.BatchNorm1d(3))

    class FreezeBn(Callback):
        def before_train(self):
            self.learn.model[1].eval()

    def with_train_metrics(learn):      # train_accuracy accumulates over the epoch, around the inner pass
        return learn.remove_cb(learn.recorder).add_cb(Recorder([accuracy], train_metrics=True))

    plain = with_train_metrics(learner(model=bn_frozen_model(), cbs=FreezeBn()))
    plain.fit(2, lr=1e-2)
    capsys.readouterr()                       # its rows, printed by learn.logger (no bar)
    inner = with_train_metrics(learner(model=bn_frozen_model(), cbs=[FreezeBn(), PredsMidEpoch()], bar=True))
    inner.fit(2, lr=1e-2)
    assert inner.preds_mid_epoch.n_preds == [N_VALID, N_VALID]
    assert inner.preds_mid_epoch.states == [(True, True, True, 2, True, False)] * 2   # BatchNorm kept frozen
    for a, b in zip(plain.model.parameters(), inner.model.parameters()):
        assert torch.equal(a, b)                              # the same training, batch for batch
    assert [list(r) for r in inner.recorder.values] == [list(r) for r in plain.recorder.values]   # every column
    assert inner.recorder.values[0].keys()[:3] == ["epoch", "train_loss", "train_accuracy"]
    assert len(capsys.readouterr().out.splitlines()) == 2     # the two epoch lines: get_preds printed nothing


# ---------------------------------------------------------------- 7. DataLoaders.train_ds / valid_ds / one_batch
def test_dataloaders_datasets_and_one_batch():
    train, valid = data()
    dls = DataLoaders(DataLoader(train, batch_size=BS, shuffle=True), DataLoader(valid, batch_size=BS), device="cpu")
    assert dls.train_ds is train and dls.valid_ds is valid
    torch.manual_seed(5)
    xb, yb = dls.one_batch()
    torch.manual_seed(5)
    first = next(iter(DataLoader(torch.arange(N_TRAIN), batch_size=BS, shuffle=True)))   # the items torch draws first
    assert xb.device == torch.device("cpu") and len(set(first.tolist())) == BS
    assert torch.equal(xb, train.tensors[0][first]) and torch.equal(yb, train.tensors[1][first])
    assert DataLoaders(DataLoader(train, batch_size=BS), device="cpu").valid_ds is None
    with pytest.raises(AttributeError, match="train_ds: the train loader, a list, has no data set"):
        DataLoaders([(torch.ones(2, 6), torch.ones(2))], device="cpu").train_ds


# ---------------------------------------------------------------- 8. recorder.values rows are fastai's lists
def test_values_rows_are_lists_that_name_their_columns_and_survive_a_checkpoint(tmp_path):
    learn = learner(cbs=BatchLosses(), path=tmp_path)
    learn.fit(2, lr=1e-2)
    values = learn.recorder.values
    valid_loss, acc = valid_by_hand(learn)
    train_loss, valid, last_acc = values[-1]                          # unpacking, as fastai's list
    assert [train_loss, valid, last_acc] == pytest.approx([smoothed(learn.batch_losses.losses), valid_loss, acc])
    assert values[-1][1] == valid == values[-1]["valid_loss"] and len(values[-1]) == 3
    assert [v[1] for v in values] == [r["valid_loss"] for r in values]  # L(values).itemgot(1)
    assert np.array(values).shape == (2, 3)
    assert values[-1]["epoch"] == 1 and values[-1]["time"] >= 0 and "accuracy" in values[-1]
    values[-1]["accuracy"] = 0.25                                      # written by name: the list sees it
    assert values[-1][2] == 0.25 and json.loads(json.dumps(values[-1])) == list(values[-1])
    learn.save_state(tmp_path / "ckpt")
    other = learner(path=tmp_path)
    other.load_state(tmp_path / "ckpt")
    assert all(isinstance(r, EpochRecord) for r in other.recorder.values)
    assert [r.as_dict() for r in other.recorder.values] == [r.as_dict() for r in values]   # epoch and time too
    assert other.recorder.iters == learn.recorder.iters == [5, 10]


def test_a_row_copies_pickles_and_compares_as_the_dict_it_was_and_keeps_its_columns_fixed():
    row = EpochRecord({"epoch": 3, "train_loss": 0.5, "valid_loss": 0.4, "time": 2.0})
    copied = copy.copy(row)
    copied["new"], copied["time"] = 1.0, 9.0                 # the copy's columns are its own
    assert row.keys() == ["epoch", "train_loss", "valid_loss", "time"] and row["time"] == 2.0
    assert pickle.loads(pickle.dumps(row)).as_dict() == copy.deepcopy(row).as_dict() == \
        {"epoch": 3, "train_loss": 0.5, "valid_loss": 0.4, "time": 2.0}
    assert row == {"epoch": 3, "train_loss": 0.5, "valid_loss": 0.4, "time": 2.0} and row == [0.5, 0.4]
    assert row != {"epoch": 3, "train_loss": 0.5} and row != copied and dict(row)["epoch"] == 3
    assert row.values() == [3, 0.5, 0.4, 2.0] and list(row) == [0.5, 0.4]
    for change in (lambda: row.append(1.0), lambda: row.pop(), lambda: row.__delitem__(0), lambda: row.sort()):
        with pytest.raises(TypeError, match="columns are fixed: set a value by name or position"):
            change()
    assert row.as_dict() == {"epoch": 3, "train_loss": 0.5, "valid_loss": 0.4, "time": 2.0}


# ---------------------------------------------------------------- 9. from_dsets drops the last partial batch
def test_from_dsets_drops_the_last_partial_training_batch_as_fastai():
    train, valid = data()
    train = TensorDataset(train.tensors[0][:37], torch.arange(37))   # 4 whole batches of 8, 5 items left over
    dls = DataLoaders.from_dsets(train, valid, bs=8, device="cpu")
    assert [len(yb) for _, yb in dls.train] == [8] * 4 and [len(yb) for _, yb in dls.valid] == [8, 8]
    torch.manual_seed(0)
    seen = [int(i) for _, yb in dls.train for i in yb]
    assert len(set(seen)) == 32 and seen != list(range(32))      # shuffled, each item at most once
    assert len(DataLoaders.from_dsets(train, valid, bs=8, drop_last=False, device="cpu").train) == 5
    with pytest.raises(ValueError, match="train_ds has 37 items, fewer than bs=64.*drop_last=False"):
        DataLoaders.from_dsets(train, bs=64)


def test_two_metrics_of_one_name_are_two_columns_each_with_its_own_value():
    """fastai shows F1Score() and F1Score(average="macro") as two columns; one used to overwrite the other."""
    from sklearn.metrics import f1_score

    from cadence import F1Score

    learn = learner(metrics=[F1Score(average="micro"), F1Score(average="macro"), accuracy])
    learn.fit(1, 0.1)
    assert learn.recorder.metric_names[3:6] == ["f1_score", "f1_score_2", "accuracy"]
    preds, targs = learn.get_preds()
    row = learn.recorder.values[-1]
    assert len(row) == 5   # fastai's list: train_loss, valid_loss and the three metrics
    assert row["f1_score"] == pytest.approx(f1_score(targs, preds.argmax(1), average="micro"))
    assert row["f1_score_2"] == pytest.approx(f1_score(targs, preds.argmax(1), average="macro"))
    assert row["f1_score"] != pytest.approx(row["f1_score_2"])
    assert list(learn.validate().keys())[1:] == ["f1_score", "f1_score_2", "accuracy"]


def test_learn_metrics_is_set_as_in_fastai():
    from cadence import error_rate

    learn = learner()
    assert [m.name for m in learn.metrics] == ["accuracy"]
    learn.metrics = [accuracy, error_rate]
    learn.fit(1, 0.1)
    row = learn.recorder.values[-1]
    assert row["error_rate"] == pytest.approx(1 - row["accuracy"])


def _one_cycle_lr(pos, lr_max=1e-2, div=25.0, div_final=1e5, pct_start=0.25):
    """fastai's fit_one_cycle lr at `pos` (its documented formula: cosine up for pct_start, then down)."""
    def cos(start, end, p):
        return start + (1 + np.cos(np.pi * (1 - p))) * (end - start) / 2
    if pos < pct_start:
        return cos(lr_max / div, lr_max, pos / pct_start)
    return cos(lr_max, lr_max / div_final, (pos - pct_start) / (1 - pct_start))


@pytest.mark.parametrize("cancel", ["CancelBatchException", "CancelStepException"])
def test_a_schedule_moves_past_steps_callbacks_cancel_as_fastais_does(cancel):
    """fastai's schedule follows every training batch, so a fit whose callback cancels every other step still ends
    where the one-cycle schedule ends (it used to stop at its peak: it counted only the steps taken)."""
    import cadence

    exc = getattr(cadence, cancel)

    class Skip(Callback):
        def before_batch(self):
            if cancel == "CancelBatchException" and self.training and self.iter % 2 == 0:
                raise exc()

        def before_step(self):
            if cancel == "CancelStepException" and self.iter % 2 == 0:
                raise exc()

    class StepLrs(Callback):
        order = Order.RECORD

        def before_fit(self):
            self.lrs, self.taken = [], 0

        def after_batch(self):   # the lr of each step taken
            if self.learn.step > self.taken:
                self.lrs.append(self.opt.param_groups[0]["lr"])
            self.taken = self.learn.step

    steps = StepLrs()
    learn = learner()
    learn.fit_one_cycle(2, 1e-2, cbs=[Skip(), steps])   # 5 batches an epoch: steps at batches 1, 3, 6, 8
    positions = [b / (2 * N_TRAIN // BS) for b in (1, 3, 6, 8)]
    np.testing.assert_allclose(steps.lrs, [_one_cycle_lr(p) for p in positions], rtol=1e-6)


def test_one_cycle_with_sgd_without_momentum_takes_plain_sgd_steps_as_fastais():
    """fastai's SGD with mom=0 ignores the scheduled momentum; a torch SGD built without momentum used to get
    0.95-0.85-0.95 written into it (a different optimizer). Checked against plain SGD steps at fastai's one-cycle lrs."""
    learn = learner(opt_func=partial(torch.optim.SGD, momentum=0.0), wd=0.0)
    w = copy.deepcopy(learn.model)
    learn.fit_one_cycle(2, 1e-2)
    assert [g["momentum"] for g in learn.opt.param_groups] == [0.0]
    n = 2 * N_TRAIN // BS
    batches = list(DataLoader(data()[0], batch_size=BS)) * 2
    for i, (x, y) in enumerate(batches):
        w.zero_grad()
        F.cross_entropy(w(x), y).backward()
        with torch.no_grad():
            for p in w.parameters():
                p -= _one_cycle_lr(i / n) * p.grad
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(learn.model.parameters(), w.parameters()))


def test_a_plain_function_metric_is_fastais_batch_weighted_average_and_accum_metric_the_whole_sets_value():
    """fastai wraps a plain function in AvgMetric: its value on each batch, weighted by the batch's size (two
    validation batches of 8 here; uneven ones below). AccumMetric(func) computes it once over the whole set."""
    from cadence import AccumMetric

    def max_err(pred, targ):
        return (pred.argmax(1) != targ).float().max() * pred.softmax(1).max()

    train, valid = data()
    dls = DataLoaders(DataLoader(train, batch_size=BS), DataLoader(valid, batch_size=6), device="cpu")  # 6, 6, 4
    torch.manual_seed(0)
    learn = Learner(dls, nn.Linear(6, 3), loss_func=nn.CrossEntropyLoss(), metrics=[max_err, AccumMetric(max_err)])
    learn.remove_cb(learn.progress)
    res = learn.validate()
    x, y = valid.tensors
    with torch.no_grad():
        out = learn.model(x)
    per_batch = [(max_err(out[i:i + 6], y[i:i + 6]).item(), len(y[i:i + 6])) for i in range(0, len(y), 6)]
    assert res[1] == pytest.approx(sum(v * n for v, n in per_batch) / len(y))
    assert res[2] == pytest.approx(max_err(out, y).item())
    assert res[1] != pytest.approx(res[2])


def test_a_momentum_schedule_through_zero_takes_sgd_momentum_up_again():
    """An SGD built with momentum whose schedule passes through 0 gets it back (the group's 0 does not mark it as
    an SGD without momentum)."""
    from cadence.trainer.schedule import set_hyper

    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    set_hyper(opt, "mom", 0.0)
    set_hyper(opt, "mom", 0.8)
    assert opt.param_groups[0]["momentum"] == 0.8


def test_a_plain_metric_of_one_element_counts_and_one_of_several_says_to_use_accum_metric():
    def mae_1(pred, targ):  # shape [1], as a one-output regressor's mean over dim 0
        return (pred.argmax(1).float() - targ.float()).abs().mean(0, keepdim=True)

    def per_class(pred, targ):
        return pred.mean(0)

    learn = learner(metrics=[mae_1])
    x, y = data()[1].tensors
    with torch.no_grad():
        out = learn.model(x)
    by_batch = [(out[i:i + BS].argmax(1).float() - y[i:i + BS].float()).abs().mean().item() for i in range(0, len(y), BS)]
    assert learn.validate()[1] == pytest.approx(sum(by_batch) / len(by_batch))   # two batches of 8
    learn.metrics = [per_class]
    with pytest.raises(TypeError, match=r"metric per_class returned a tensor of shape \(3,\).*AccumMetric\(per_class\)"):
        learn.validate()
