"""The events of the training loop (the single source of truth) and the Cancel exceptions.

The loop, as `Learner.fit` runs it::

    before_fit
      for epoch:                                   before_epoch
        train:                                     before_train
          for batch:                               before_batch
            with forward contexts: pred            after_pred
                                   loss            after_loss
            backward (strategy.backward)           before_backward ... after_backward
            step (strategy.step)                   before_step ... after_step
            zero_grad                              after_batch
                                                   after_train
        validate: the same batch events, no backward/step       before_validate ... after_validate
                                                   after_epoch
    after_fit

Raising `Cancel<Level>Exception` inside a level fires `after_cancel_<level>` and then still
`after_<level>`; the enclosing level continues.

>>> class Stop(Callback):
...     def after_batch(self):
...         if self.learn.iter == 10: raise CancelEpochException()
"""

from __future__ import annotations

from enum import Enum


class Event(str, Enum):
    """Every event a callback may define, in loop order."""

    after_create = "after_create"
    before_fit = "before_fit"
    before_epoch = "before_epoch"
    before_train = "before_train"
    before_batch = "before_batch"
    after_pred = "after_pred"
    after_loss = "after_loss"
    before_backward = "before_backward"
    after_cancel_backward = "after_cancel_backward"
    after_backward = "after_backward"
    before_step = "before_step"
    after_cancel_step = "after_cancel_step"
    after_step = "after_step"
    after_cancel_batch = "after_cancel_batch"
    after_batch = "after_batch"
    after_cancel_train = "after_cancel_train"
    after_train = "after_train"
    before_validate = "before_validate"
    after_cancel_validate = "after_cancel_validate"
    after_validate = "after_validate"
    after_cancel_epoch = "after_cancel_epoch"
    after_epoch = "after_epoch"
    after_cancel_fit = "after_cancel_fit"
    after_fit = "after_fit"

    def __str__(self) -> str:
        return self.value


EVENT_NAMES = frozenset(e.value for e in Event)


class CancelException(Exception):
    """Base of the Cancel exceptions: control flow, never an error."""


class CancelFitException(CancelException):
    """Stop training; `after_cancel_fit` then `after_fit` run."""


class CancelEpochException(CancelException):
    """Skip the rest of this epoch (validation included)."""


class CancelTrainException(CancelException):
    """Skip the rest of this epoch's training; validation still runs."""


class CancelValidateException(CancelException):
    """Skip the rest of this validation pass."""


CancelValidException = CancelValidateException  # fastai's name


class CancelBatchException(CancelException):
    """Skip the rest of this batch (no backward/step/zero_grad if raised before them)."""


class CancelBackwardException(CancelException):
    """Skip the backward pass of this batch."""


class CancelStepException(CancelException):
    """Skip the optimizer step of this batch (gradients are still zeroed)."""
