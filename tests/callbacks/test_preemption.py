"""Preemption on one process: a signal becomes a checkpoint at the next optimizer step and a requeue status;
handlers are restored after fit, also when fit raises. (Two processes: tests/distributed/test_restarts.py.)"""

import os
import signal

import pytest
import torch
from torch import nn

import fixtures
from cadence import Callback, Order
from cadence.callbacks.checkpoint import Checkpoint, complete_checkpoints, read_state


def make_learner(dls, path, cbs=()):
    torch.manual_seed(0)
    return fixtures.make_learner(dls, path, cbs, nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3)))


class SendSignal(Callback):
    """Send `sig` to this process in the middle of batch `at` (between backward and step)."""
    order = Order.DEFAULT

    def __init__(self, sig, at):
        self.sig, self.at = sig, at

    def after_backward(self):
        if self.learn.train_iter == self.at:
            os.kill(os.getpid(), self.sig)


@pytest.fixture
def previous_handler():
    seen = []
    handler = lambda signum, frame: seen.append(signum)  # noqa: E731
    old = signal.signal(signal.SIGUSR1, handler)
    yield handler, seen
    signal.signal(signal.SIGUSR1, old)


def test_signal_saves_at_the_next_step_exits_with_requeue_status_and_resumes_exactly(dls, tmp_path, previous_handler):
    handler, seen = previous_handler
    reference = make_learner(dls, tmp_path / "ref", [Checkpoint()])  # the same loader order and random draws
    reference.fit(3)                        # 4 batches per epoch, 12 steps

    learn = make_learner(dls, tmp_path, [Checkpoint(every_epoch=False), SendSignal(signal.SIGUSR1, at=5)])
    with pytest.raises(SystemExit) as info:
        learn.fit(3)
    assert info.value.code == 128 + signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) is handler and seen == []   # restored; the signal was handled
    [saved] = complete_checkpoints(tmp_path / "checkpoints")
    state = read_state(saved)
    assert (saved.name, state["epoch"], state["epoch_complete"]) == ("step-00000006", 1, False)  # batch 5's step

    resumed = make_learner(dls, tmp_path, [Checkpoint(every_epoch=False)])
    resumed.fit(3, resume="auto")
    assert resumed.step == 12
    for a, b in zip(reference.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


def test_handlers_and_loader_are_restored_when_fit_raises(dls, tmp_path, previous_handler):
    handler, _ = previous_handler

    class Boom(Callback):
        def after_batch(self):
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # Checkpoint's handler is in place
            raise RuntimeError("boom")

    before_term = signal.getsignal(signal.SIGTERM)
    learn = make_learner(dls, tmp_path, [Checkpoint(), Boom()])
    loader = learn.dls.train
    with pytest.raises(RuntimeError, match="boom"):
        learn.fit(1)
    assert signal.getsignal(signal.SIGUSR1) is handler and signal.getsignal(signal.SIGTERM) is before_term
    assert learn.dls.train is loader          # the resumable wrapper Checkpoint put in place is gone


def test_a_signal_that_came_too_late_to_act_on_goes_to_the_previous_handler(dls, tmp_path, previous_handler):
    handler, seen = previous_handler

    class SignalInLastValidation(Callback):
        def after_validate(self):
            if self.learn.epoch == self.learn.n_epoch - 1:
                os.kill(os.getpid(), signal.SIGUSR1)

    learn = make_learner(dls, tmp_path, [Checkpoint(), SignalInLastValidation()])
    learn.fit(2)                              # finishes: no step came after the signal
    assert seen == [signal.SIGUSR1] and learn.step == 8


def test_preempt_on_choices(dls, tmp_path, previous_handler):
    handler, seen = previous_handler
    learn = make_learner(dls, tmp_path, [Checkpoint(preempt_on=None), SendSignal(signal.SIGUSR1, at=2)])
    learn.fit(1)                              # not handled by cadence: the user's handler gets it at once
    assert seen == [signal.SIGUSR1] and learn.step == 4
    assert Checkpoint(preempt_on="USR2").preempt_on == (signal.SIGUSR2,)
    with pytest.raises(ValueError, match=r"preempt_on: 'SIGTERMINATE' is not a signal"):
        Checkpoint(preempt_on=["SIGTERMINATE"])
    with pytest.raises(ValueError, match="SIGKILL"):
        Checkpoint(preempt_on="SIGKILL")
