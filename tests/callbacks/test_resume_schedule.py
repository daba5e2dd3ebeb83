"""A schedule over the fit (fit_one_cycle) resumed with another batch size, i.e. another number of steps per epoch
(the same as another number of processes): the interrupted epoch keeps its batches and moves the schedule by its
share of them; the later epochs by steps of the new size. Its learning rates were those of a much later point (the
saved step count over the new, smaller total), reaching the schedule's floor an epoch early."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from cadence import Callback, DataLoaders, Learner, Order
from cadence.callbacks.checkpoint import Checkpoint


class StopAt(Callback):
    order = Order.CHECKPOINT + 1       # after the step's checkpoint is written

    def __init__(self, step):
        self.at = step

    def after_batch(self):
        if self.training and self.learn.step == self.at:
            raise RuntimeError("stopped")


def learner(tmp_path, bs, cbs=()):
    torch.manual_seed(0)
    x = torch.randn(600, 10)
    y = (x[:, 0] + x[:, 1] > 0).long()
    dls = DataLoaders.from_dsets(TensorDataset(x[:480], y[:480]), TensorDataset(x[480:], y[480:]), bs=bs)
    learn = Learner(dls, nn.Linear(10, 2), loss_func=nn.CrossEntropyLoss(), path=tmp_path, cbs=list(cbs))
    learn.remove_cb(learn.progress)
    learn.logger = lambda row: None
    return learn


def test_a_one_cycle_fit_resumed_with_another_batch_size_keeps_its_place_in_the_schedule(tmp_path):
    whole16, whole32 = learner(tmp_path / "a", 16), learner(tmp_path / "b", 32)
    whole16.fit_one_cycle(3, 1e-2)                          # 30 steps an epoch
    whole32.fit_one_cycle(3, 1e-2)                          # 15 steps an epoch
    stopped = learner(tmp_path / "c", 16, [Checkpoint("ckpt", every_n_steps=40, every_epoch=False), StopAt(40)])
    with pytest.raises(RuntimeError, match="stopped"):
        stopped.fit_one_cycle(3, 1e-2)
    resumed = learner(tmp_path / "c", 32, [Checkpoint("ckpt", every_n_steps=40, every_epoch=False)])
    with pytest.warns(UserWarning, match="resuming epoch 1 saved with batch 16"):
        resumed.fit_one_cycle(3, 1e-2, resume="auto")
    assert resumed.step == 40 + 20 + 15                      # the rest of epoch 1 in 16s, epoch 2 in 32s
    # the same points of the fit as the whole runs: epoch 1's batches 10-29 of 30, then epoch 2's steps of 15
    assert resumed.recorder.lrs[:40] == whole16.recorder.lrs[:40]   # the saved run's history
    assert resumed.recorder.lrs[40:] == pytest.approx(whole16.recorder.lrs[40:60] + whole32.recorder.lrs[30:45],
                                                      rel=1e-12)
    assert resumed.recorder.lrs[-1] == pytest.approx(whole32.recorder.lrs[-1], rel=1e-12)   # ends where a fit ends


def test_a_fit_resumed_with_another_number_of_epochs_says_its_schedule_jumps(tmp_path):
    stopped = learner(tmp_path, 16, [Checkpoint("ckpt", every_n_steps=40, every_epoch=False), StopAt(40)])
    with pytest.raises(RuntimeError, match="stopped"):
        stopped.fit_one_cycle(3, 1e-2)
    resumed = learner(tmp_path, 16, [Checkpoint("ckpt", every_n_steps=40, every_epoch=False)])
    with pytest.warns(UserWarning, match=r"resuming a fit of 3 epochs as one of 5: the schedule is that of 5 epochs"):
        resumed.fit_one_cycle(5, 1e-2, resume="auto")
    assert resumed.step == 150


def resumed_until(tmp_path, bs, stop=None):
    cbs = [Checkpoint("ckpt", every_n_steps=1, every_epoch=True, keep_last=2)] + ([StopAt(stop)] if stop else [])
    learn = learner(tmp_path, bs, cbs)
    if stop:
        with pytest.raises(RuntimeError, match="stopped"):
            learn.fit_one_cycle(3, 1e-2, resume="auto")
    else:
        learn.fit_one_cycle(3, 1e-2, resume="auto")
    return learn


def test_resumes_back_and_forth_between_batch_sizes_keep_the_schedules_place(tmp_path):
    whole32 = learner(tmp_path / "whole", 32)
    whole32.fit_one_cycle(3, 1e-2)
    resumed_until(tmp_path, 16, stop=60)      # epoch 0 and 1 in 16s: an epoch-complete checkpoint at step 60
    resumed_until(tmp_path, 32, stop=65)      # epoch 2 whole in 32s: its steps from the epoch's boundary
    resumed_until(tmp_path, 16, stop=68)      # epoch 2's rest keeps its 32s: counted by its batches
    last = resumed_until(tmp_path, 32)        # back in 32s, mid-epoch 2: the shift of the 32s run again
    assert last.step == 75 and len(last.recorder.lrs) == 75
    assert last.recorder.lrs[60:] == pytest.approx(whole32.recorder.lrs[30:], rel=1e-12)   # epoch 2: 15 steps of 32
