"""fastai APIs, each against fastai's documented behaviour (one process)."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import (Callback, DataLoaders, Learner, Recorder, ShortEpochCallback, ValueMetric, accuracy,
                     before_batch_cb, to_detach)


def learner(n_train=32, bs=8, n_valid=16, **kw):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_train + n_valid, 6, generator=g)
    y = (x @ torch.randn(6, 3, generator=g)).argmax(1)
    dls = DataLoaders(DataLoader(TensorDataset(x[:n_train], y[:n_train]), batch_size=bs),
                      DataLoader(TensorDataset(x[n_train:], y[n_train:]), batch_size=bs), device="cpu")
    torch.manual_seed(0)
    learn = Learner(dls, nn.Sequential(nn.Linear(6, 3)), loss_func=nn.CrossEntropyLoss(), **kw)
    learn.remove_cb(learn.progress)
    return learn


class Log(Callback):
    def before_fit(self):
        self.pct, self.epochs = [], []

    def before_batch(self):
        if self.training:
            self.pct.append(self.learn.pct_train)
            self.epochs.append(self.learn.epoch)


def test_fit_one_cycle_start_epoch_continues_the_schedule_of_the_whole_fit():
    full = learner(cbs=Log())
    full.fit_one_cycle(4, 1e-2)
    later = learner(cbs=Log())
    later.fit_one_cycle(4, 1e-2, start_epoch=2)
    assert later.recorder.lrs == pytest.approx(full.recorder.lrs[8:])            # 4 batches per epoch: the last 8
    assert [r["epoch"] for r in later.recorder.values] == [0, 1, 2, 3] and later.step == full.step == 16
    assert later.recorder.values[:2] == [[], []]                                  # fastai's rows of skipped epochs
    assert later.log.epochs == [2] * 4 + [3] * 4
    assert full.log.pct == pytest.approx([i / 16 for i in range(16)])             # fastai's pct_train
    assert later.log.pct == pytest.approx([i / 16 for i in range(8, 16)])
    from cadence import GradAccum

    accum_full, accum_later = learner(), learner()
    accum_full.fit_one_cycle(3, 1e-2, cbs=GradAccum(steps=2))
    accum_later.fit_one_cycle(3, 1e-2, cbs=GradAccum(steps=2), start_epoch=1)   # 2 optimizer steps per epoch
    assert accum_later.step == accum_full.step == 6 and accum_later.recorder.lrs == pytest.approx(accum_full.recorder.lrs[4:])
    later.fit(3, lr=1e-3, start_epoch=1)
    assert [r["epoch"] for r in later.recorder.values] == [0, 1, 2]
    with pytest.raises(ValueError, match=r"start_epoch must be an int in \[0, n_epoch=2\), got 2"):
        later.fit(2, start_epoch=2)
    with pytest.raises(ValueError, match="pass only one"):
        later.fit(2, start_epoch=1, resume="auto")


def test_callback_from_functions_before_batch_cb_and_ordered_cbs():
    seen = []
    learn = learner(cbs=[before_batch_cb(lambda cb, xb, yb: ((xb[0] * 0,), yb)),
                         Callback(after_pred=lambda cb: seen.append(cb.learn.x.abs().sum().item()))])
    assert learn.ordered_cbs("after_pred") == [learn.cbs[1]] and learn.ordered_cbs("before_batch") == [learn.cbs[0]]
    assert [type(cb).__name__ for cb in learn.ordered_cbs("after_batch")] == ["Recorder"]
    learn.fit(1)
    assert seen == [0.0] * 4 + [0.0] * 2       # every batch's inputs were replaced (training and validation)
    with pytest.raises(ValueError, match="'after_bacth' is not a training event. Did you mean 'after_batch'"):
        Callback(after_bacth=print)


def test_x_y_aliases_and_to_detach():
    got = []
    learn = learner(cbs=Callback(after_loss=lambda cb: got.append((cb.learn.x, cb.learn.y, cb.learn.to_detach(
        cb.learn.loss_grad)))))
    assert learn.x is None and torch.equal(learn.loss, torch.tensor(0.0))
    learn.fit(1)
    x, y, loss = got[0]
    assert x.shape == (8, 6) and y.shape == (8,)
    assert not loss.requires_grad and loss.device.type == "cpu"
    nested = to_detach({"a": (torch.ones(2, requires_grad=True) * 2,)})
    assert not nested["a"][0].requires_grad


def test_value_metric_and_recorder_train_metrics_without_time(tmp_path):
    calls = []

    def best():
        calls.append(1)
        return torch.tensor(0.5)

    learn = learner(metrics=[accuracy, ValueMetric(best, "best")])
    learn.fit(1)
    assert learn.recorder.values[-1]["best"] == 0.5 and len(calls) == 1
    assert ValueMetric(best).name == "best"

    class Preds(Callback):
        def before_fit(self):
            self.hits, self.n = 0, 0

        def after_loss(self):
            if self.training:
                self.hits += int((self.learn.pred.argmax(1) == self.learn.y).sum())
                self.n += len(self.learn.y)

    from cadence import Tracker

    learn = learner(cbs=Preds(), path=tmp_path)
    learn.remove_cb(learn.recorder).add_cb(Recorder([accuracy], train_metrics=True, add_time=False))
    learn.fit(1, cbs=Tracker("csv", project="p", run_name="r", dir=tmp_path))
    assert learn.recorder.metric_names == ["epoch", "train_loss", "train_accuracy", "valid_loss", "valid_accuracy"]
    row = learn.recorder.values[-1]
    assert row.keys() == learn.recorder.metric_names and len(row) == 4      # fastai's list: no epoch (nor time)
    assert row["train_accuracy"] == pytest.approx(learn.preds.hits / learn.preds.n)
    assert row["valid_accuracy"] == pytest.approx(learn.validate()["valid_accuracy"])
    import csv

    with open(tmp_path / "p" / "r" / "metrics.csv") as f:
        logged = [r for r in csv.DictReader(f) if r["valid/accuracy"]]
    assert float(logged[0]["valid/accuracy"]) == pytest.approx(row["valid_accuracy"])    # the tracker finds both
    assert float(logged[0]["train/accuracy"]) == pytest.approx(row["train_accuracy"])


def test_short_epoch_callback_runs_a_fraction_of_each_pass():
    batches = []
    learn = learner(n_train=80, n_valid=80, cbs=[Callback(after_batch=lambda cb: batches.append(cb.learn.training)),
                                                 ShortEpochCallback(pct=0.3)])
    learn.fit(1)
    # 10 batches each: fastai stops after the batch where iter / n_iter >= pct, the 4th
    assert batches.count(True) == 4 and batches.count(False) == 4
    learn.remove_cb(ShortEpochCallback)
    learn.fit(1, cbs=ShortEpochCallback(pct=0.3, short_valid=False))
    assert batches.count(True) == 8 and batches.count(False) == 4 + 10


def test_warnings_where_fastai_users_would_be_surprised(tmp_path):
    import functools

    learn = learner(path=tmp_path)
    learn.opt_func = functools.partial(torch.optim.SGD, momentum=0.9)
    with pytest.warns(UserWarning, match="opt_func was changed after the optimizer was built.*learn.create_opt"):
        learn.fit(1)
    assert isinstance(learn.opt, torch.optim.AdamW)                 # the fit kept the Learner's optimizer
    learn.create_opt()
    assert isinstance(learn.opt, torch.optim.SGD)
    with pytest.warns(UserWarning, match=r"Learner\(lr=0.1\) and opt_func's lr=0.5 differ: cadence trains at lr=0.1"):
        other = learner(opt_func=functools.partial(torch.optim.SGD, lr=0.5), lr=0.1)
    assert other.opt.param_groups[0]["lr"] == 0.1
    with pytest.warns(UserWarning, match="writes a directory"):
        saved = learn.save("stage1.pth")
    assert (saved / "model.safetensors").is_file()
    learn.load("stage1.pth")


def test_wd_bn_bias_false_keeps_norm_and_bias_parameters_from_decaying():
    """Zero gradients: an AdamW step only decays, p *= 1 - lr * wd. fastai's wd_bn_bias=False spares norms and biases."""
    def make(**kw):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 4), nn.LayerNorm(4), nn.BatchNorm1d(4), nn.Linear(4, 3))
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
        learn = Learner(DataLoaders(DataLoader(TensorDataset(x, y), batch_size=16), device="cpu"), model,
                        loss_func=lambda pred, y: pred.sum() * 0, lr=0.1, wd=0.5,
                        splitter=lambda m: [m[:2].parameters(), m[2:].parameters()], **kw)
        learn.remove_cb(learn.progress)
        return learn, {k: v.clone() for k, v in model.state_dict().items()}

    fastai, before = make(wd_bn_bias=False)
    assert len(fastai.opt.param_groups) == 4                       # two splitter groups, each split in two
    fastai.fit(1, lr=slice(0.05, 0.1))
    decayed = {"0.weight": 1 - 0.05 * 0.5, "3.weight": 1 - 0.1 * 0.5}
    for k, v in fastai.model.state_dict().items():
        if k.endswith(("weight", "bias")):
            assert torch.allclose(v, before[k] * decayed.get(k, 1.0)), k
    assert [g["lr"] for g in fastai.opt.param_groups] == [0.05, 0.05, 0.1, 0.1]
    fastai.freeze()                                                  # freezes the first splitter group, both parts
    assert [p.requires_grad for p in fastai.model[0].parameters()] == [False, False]
    assert all(p.requires_grad for p in fastai.model[3].parameters())

    torch_way, before = make()
    torch_way.fit(1)
    assert torch.allclose(torch_way.model[0].bias, before["0.bias"] * 0.95)   # the default decays every parameter


def test_load_strict_false_takes_the_body_keeps_a_new_head_and_says_what_it_skipped(tmp_path):
    """fastai's transfer habit: weights saved from a model, loaded into one with a different head."""
    old = learner(path=tmp_path)
    old.model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    old.fit(1, lr=0.1)
    old.save("body", with_opt=False)
    new = learner(path=tmp_path)
    new.model = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
    new.model.add_module("head", nn.Linear(8, 5))                                      # a new head: 5 classes
    head = {k: v.clone() for k, v in new.model.head.state_dict().items()}
    with pytest.warns(UserWarning, match=r"2 of the model's weights not in the file keep their values.*"
                                         r"2 in the file not in the model are ignored"):
        new.load("body", with_opt=False, strict=False)
    for k in ("weight", "bias"):
        assert torch.equal(getattr(new.model[0], k), getattr(old.model[0], k))          # the body came
        assert torch.equal(getattr(new.model.head, k), head[k])                        # the head kept its values
    with pytest.raises(Exception, match="head|missing|2.weight"):
        new.load("body", with_opt=False)                                              # strict: refused
