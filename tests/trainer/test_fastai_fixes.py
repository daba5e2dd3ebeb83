"""Behaviour fastai's and Accelerate's own tests expect (issue 13, item 5), one test per fix."""

import functools
import pickle

import numpy as np
import pytest
import torch
from torch import nn

from cadence import (Callback, CancelFitException, Learner, Order, ParamScheduler, SchedCos, SchedExp, SchedLin, SchedNo,
                     SchedPoly, combine_scheds, combined_cos)


def test_recorder_lrs_and_losses_keep_one_entry_per_batch_after_a_mid_epoch_cancel(dls, model):
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss())          # 4 training batches per epoch
    learn.lr_find(num_it=10, stop_div=False, show_plot=False)              # stops in the 3rd epoch, batch 2
    assert len(learn.recorder.lrs) == len(learn.recorder.losses) == 10

    class StopAt(Callback):   # like TerminateOnNaN: decides after the Recorder saw the batch
        order = Order.STOP

        def after_batch(self):
            if self.training and self.train_iter == 6:
                raise CancelFitException()

    with learn.no_bar():
        learn.fit(5, cbs=StopAt())
    assert len(learn.recorder.lrs) == len(learn.recorder.losses) == 6
    assert all(np.isfinite(learn.recorder.losses))


def test_lr_bound_in_opt_func_is_the_learners_default(dls, model):
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func=functools.partial(torch.optim.SGD, lr=0.5))
    assert learn.lr == 0.5 and learn.opt.param_groups[0]["lr"] == 0.5
    with learn.no_bar():
        learn.fit(1)
    assert learn.recorder.lrs == [0.5] * 4
    with pytest.warns(UserWarning, match="differ"):   # fastai would take the partial's; cadence says so
        explicit = Learner(dls, model, loss_func=nn.CrossEntropyLoss(),
                           opt_func=functools.partial(torch.optim.SGD, lr=0.5), lr=0.1)
    assert explicit.opt.param_groups[0]["lr"] == 0.1   # an lr given to the Learner itself wins


def test_schedules_pickle_and_keep_their_values():
    scheds = [SchedLin(0, 4), SchedCos(0, 5), SchedNo(2, 7), SchedExp(1e-4, 1e-2), SchedPoly(0, 8, 3),
              combine_scheds([0.5, 0.5], [SchedLin(0, 1), SchedLin(1, 0)]), combined_cos(0.25, 1.0, 4.0, 0.0)]
    expected = [2.0, 2.5, 2, 1e-3, 1.0, 1.0, 3.0]   # each at pos 0.5 (the last: cos(2π/3) = -1/2 into 4 -> 0)
    for sched, value in zip(scheds, expected):
        copy = pickle.loads(pickle.dumps(sched))
        assert copy(0.5) == pytest.approx(value), sched
    scheduler = pickle.loads(pickle.dumps(ParamScheduler({"lr": combined_cos(0.3, 1e-3, 1e-2, 1e-7)})))
    assert scheduler.scheds["lr"](0.3) == pytest.approx(1e-2)


def test_learner_called_with_a_list_of_events_runs_each_in_order(dls, model):
    seen = []

    class Log(Callback):
        def before_fit(self):
            seen.append("before_fit")

        def before_epoch(self):
            seen.append("before_epoch")

    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), cbs=Log())
    learn(["before_epoch", "before_fit"])
    assert seen == ["before_epoch", "before_fit"]
    with pytest.raises(ValueError, match="unknown event 'before_fitt'"):
        learn(["before_fit", "before_fitt"])


def test_an_epoch_whose_validation_is_cancelled_records_no_valid_values_not_the_last_ones(dls, model):
    from cadence import CancelValidateException, accuracy

    class SkipOddValidation(Callback):
        order = Order.DEFAULT                  # before the Recorder's before_validate
        def before_validate(self):
            if self.epoch % 2 == 1:
                raise CancelValidateException()

    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=accuracy, cbs=SkipOddValidation())
    with learn.no_bar():
        learn.fit(3, lr=1e-2)
    rows = learn.recorder.values
    assert rows[1]["valid_loss"] is None and rows[1]["accuracy"] is None            # not epoch 0's values again
    assert None not in (rows[0]["valid_loss"], rows[2]["valid_loss"]) and rows[0]["valid_loss"] != rows[2]["valid_loss"]


def test_fit_one_cycle_moms_none_moves_through_the_learners_moms_as_fastais(dls, model):
    seen = []
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), moms=(0.9, 0.8, 0.7),
                    cbs=Callback(after_batch=lambda cb: seen.append(cb.opt.param_groups[0]["betas"][0])))
    with learn.no_bar():
        learn.fit_one_cycle(2, 1e-3, moms=None)                  # fastai: None means the Learner's moms
    assert seen[0] == pytest.approx(0.9) and seen[2] == pytest.approx(0.8) and seen[-1] == pytest.approx(0.7, abs=1e-2)
