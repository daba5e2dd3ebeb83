"""The event sequence of fit, and of every Cancel exception at every level."""

import pytest
import torch
from torch import nn

from cadence import (Callback, CancelBackwardException, CancelBatchException, CancelEpochException, CancelFitException,
                     CancelStepException, CancelTrainException, CancelValidateException, Event, Learner)

TRAIN_BATCH = ["before_batch", "after_pred", "after_loss", "before_backward", "after_backward", "before_step",
               "after_step", "after_batch"]
VALID_BATCH = ["before_batch", "after_pred", "after_loss", "after_batch"]


class EventLog(Callback):
    """Records every event it receives; raises `exc` the first time `raise_at` fires."""

    def __init__(self, raise_at=None, exc=None):
        self.log, self.raise_at, self.exc = [], raise_at, exc


for _event in Event:
    def _handler(self, _name=_event.value):
        self.log.append(_name)
        if _name == self.raise_at and self.exc is not None:
            exc, self.exc = self.exc, None
            raise exc()
    setattr(EventLog, _event.value, _handler)


def fit_log(dls, model, **kw):
    log = EventLog(**kw)
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), cbs=log)
    log.log.clear()  # drop after_create
    with learn.no_bar():
        learn.fit(1)
    return log.log, learn


def expected(n_train=4, n_valid=2):
    return (["before_fit", "before_epoch", "before_train"] + TRAIN_BATCH * n_train + ["after_train", "before_validate"]
            + VALID_BATCH * n_valid + ["after_validate", "after_epoch", "after_fit"])


def test_fit_event_sequence(dls, model):
    log, _ = fit_log(dls, model)
    assert log == expected()
    assert set(log) <= {e.value for e in Event}


def test_after_create_fires_once(dls, model):
    log = EventLog()
    Learner(dls, model, loss_func=nn.CrossEntropyLoss(), cbs=log)
    assert log.log == ["after_create"]


@pytest.mark.parametrize("exc,raise_at,want", [
    # a level's Cancel skips the rest of that level, inner levels included (fastai's semantics)
    (CancelFitException, "before_epoch", ["before_fit", "before_epoch", "after_cancel_fit", "after_fit"]),
    (CancelEpochException, "after_train",
     ["before_fit", "before_epoch", "before_train"] + TRAIN_BATCH * 4 + ["after_train", "after_cancel_epoch",
                                                                         "after_epoch", "after_fit"]),
    (CancelTrainException, "before_train",
     ["before_fit", "before_epoch", "before_train", "after_cancel_train", "after_train", "before_validate"]
     + VALID_BATCH * 2 + ["after_validate", "after_epoch", "after_fit"]),
    (CancelValidateException, "before_validate",
     ["before_fit", "before_epoch", "before_train"] + TRAIN_BATCH * 4 + ["after_train", "before_validate",
                                                                         "after_cancel_validate", "after_validate",
                                                                         "after_epoch", "after_fit"]),
])
def test_cancel_outer_levels(dls, model, exc, raise_at, want):
    log, _ = fit_log(dls, model, raise_at=raise_at, exc=exc)
    assert log == want


@pytest.mark.parametrize("exc,raise_at,first_batch", [
    (CancelBatchException, "after_pred", ["before_batch", "after_pred", "after_cancel_batch", "after_batch"]),
    (CancelBackwardException, "before_backward",
     ["before_batch", "after_pred", "after_loss", "before_backward", "after_cancel_backward", "after_backward",
      "before_step", "after_step", "after_batch"]),
    (CancelStepException, "before_step",
     ["before_batch", "after_pred", "after_loss", "before_backward", "after_backward", "before_step",
      "after_cancel_step", "after_step", "after_batch"]),
])
def test_cancel_inner_levels(dls, model, exc, raise_at, first_batch):
    log, learn = fit_log(dls, model, raise_at=raise_at, exc=exc)
    want = expected()
    start = want.index("before_batch")
    want[start:start + len(TRAIN_BATCH)] = first_batch
    assert log == want
    steps_skipped = exc in (CancelBatchException, CancelStepException)
    assert learn.step == 4 - steps_skipped


def test_cancelled_step_takes_no_step_and_keeps_weights_unchanged_for_that_batch(dls, model):
    class SkipAllSteps(Callback):
        def before_step(self):
            raise CancelStepException()

    before = [p.detach().clone() for p in model.parameters()]
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), cbs=SkipAllSteps())
    with learn.no_bar():
        learn.fit(1)
    assert learn.step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_counters(dls, model):
    seen = []

    class Counters(Callback):
        def after_batch(self):
            seen.append((self.epoch, self.iter, self.train_iter, self.step, self.training))

    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), cbs=Counters())
    with learn.no_bar():
        learn.fit(2)
    train = [s for s in seen if s[4]]
    # fastai's order: the batch is counted in train_iter before any callback's after_batch sees it
    assert train[:5] == [(0, 0, 1, 1, True), (0, 1, 2, 2, True), (0, 2, 3, 3, True), (0, 3, 4, 4, True),
                         (1, 0, 5, 5, True)]
    assert [s[:2] for s in seen if not s[4]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert (learn.epoch, learn.train_iter, learn.step) == (1, 8, 8)


def test_run_train_and_run_valid_filter_batch_events(dls, model):
    class TrainOnly(Callback):
        run_valid = False

        def __init__(self):
            self.n, self.fits = 0, 0

        def before_fit(self):
            self.fits += 1

        def after_batch(self):
            self.n += 1

    cb = TrainOnly()
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), cbs=cb)
    with learn.no_bar():
        learn.fit(1)
    assert (cb.n, cb.fits) == (4, 1)


def test_callback_order_and_attribute(dls, model):
    calls = []

    class Late(Callback):
        order = 100

        def before_fit(self):
            calls.append("late")

    class Early(Callback):
        order = -100

        def before_fit(self):
            calls.append("early")

    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), cbs=[Late(), Early()])
    with learn.no_bar():
        learn.fit(1)
    assert calls == ["early", "late"]
    assert isinstance(learn.late, Late) and isinstance(learn.early, Early)


def test_callback_error_names_callback_and_event(dls, model):
    class Broken(Callback):
        def after_loss(self):
            raise RuntimeError("boom")

    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), cbs=Broken())
    with pytest.raises(RuntimeError, match="boom") as info:
        learn.fit(1)
    assert any("Broken" in n and "after_loss" in n for n in info.value.__notes__)


def test_forward_context_wraps_pred_and_loss(dls, model):
    inside = []

    class Ctx(Callback):
        active = False

        def forward_context(self):
            import contextlib

            @contextlib.contextmanager
            def ctx():
                self.active = True
                yield
                self.active = False
            return ctx()

        def after_pred(self):
            inside.append(("pred", self.active))

        def after_loss(self):
            inside.append(("loss", self.active))

    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), cbs=Ctx())
    with learn.no_bar():
        learn.fit(1)
    assert inside[:2] == [("pred", True), ("loss", False)]


def test_added_and_removed_cbs(dls, model):
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss())
    log = EventLog()
    with learn.added_cbs(log):
        assert log in learn.cbs
    assert log not in learn.cbs and log.learn is None
    with learn.removed_cbs(learn.recorder):
        assert not hasattr(learn, "recorder")
    assert learn.recorder in learn.cbs


def test_show_training_loop_lists_events(dls, model, capsys):
    Learner(dls, model, loss_func=nn.CrossEntropyLoss()).show_training_loop()
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()] == [e.value for e in Event]
    assert "Recorder" in out


def test_loss_is_detached_and_a_replaced_loss_grad_leaves_the_recorded_loss(dls, model):
    seen = []

    class Regularize(Callback):  # fastai's pattern: add a penalty to loss_grad only
        def after_loss(self):
            seen.append((self.learn.loss.requires_grad, self.learn.loss.item()))
            self.learn.loss_grad = self.learn.loss_grad + 100.0

        def after_batch(self):
            seen.append((self.learn.loss_grad is not None, self.learn.loss.item()))

    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func=torch.optim.SGD, lr=0.0, cbs=Regularize())
    with learn.no_bar():
        learn.fit(1)
    at_loss, at_batch = seen[0::2][:4], seen[1::2][:4]
    assert [grad for grad, _ in at_loss] == [False] * 4  # learn.loss never carries the graph
    assert [v for _, v in at_batch] == [v for _, v in at_loss]  # still the loss before the penalty
    assert learn.recorder.raw_losses == pytest.approx([v for _, v in at_loss])  # and that is what the Recorder records
    assert learn.loss is None and learn.loss_grad is None  # nothing of the last batch is kept after fit


def test_a_loss_set_by_a_callback_is_what_the_recorder_records(dls, model):
    class Report(Callback):
        def after_loss(self):
            self.learn.loss = torch.tensor(7.0)

    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), cbs=Report())
    with learn.no_bar():
        learn.fit(1)
    assert learn.recorder.raw_losses == [7.0] * 4
    assert learn.recorder.values[-1]["train_loss"] == pytest.approx(7.0)


def test_step_events_follow_callbacks_added_and_removed_between_fits(dls, model):
    class CancelSteps(Callback):  # only step-level events: the loop must wrap the step for it
        def __init__(self):
            self.cancelled = 0

        def before_step(self):
            raise CancelStepException()

        def after_cancel_step(self):
            self.cancelled += 1

    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func=torch.optim.SGD, lr=0.1)
    cb = CancelSteps()
    with learn.no_bar():
        learn.fit(1, cbs=cb)
        assert cb.cancelled == 4 and learn.step == 0  # every step cancelled, none taken
        learn.fit(1)
        assert cb.cancelled == 4 and learn.step == 4  # removed with the fit: steps run bare again
        learn.add_cb(cb)
        learn.fit(1)
        assert cb.cancelled == 8 and learn.step == 0


def test_a_loss_set_from_the_graph_is_still_read_detached(dls, model):
    seen = []

    class Double(Callback):
        def after_loss(self):
            seen.append(self.learn.loss.item())
            self.learn.loss = self.learn.loss_grad * 2  # still on the graph

        def after_batch(self):
            assert not self.learn.loss.requires_grad

    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func=torch.optim.SGD, lr=0.0, cbs=Double())
    with learn.no_bar():
        learn.fit(1)
    assert learn.recorder.raw_losses == pytest.approx([2 * v for v in seen[:4]])
