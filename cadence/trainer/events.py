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
    """Every event a callback may define, in loop order.

    >>> [e.name for e in Event][:4]
    ['after_create', 'before_fit', 'before_epoch', 'before_train']
    """

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
    """Base of the Cancel exceptions: control flow, never an error.

    >>> issubclass(CancelFitException, CancelException)
    True
    """


class CancelFitException(CancelException):
    """Stop training; `after_cancel_fit` then `after_fit` run.

    >>> class StopAtFirstBatch(Callback):
    ...     def after_batch(self): raise CancelFitException()
    >>> with learn.no_bar(): learn.fit(3, cbs=StopAtFirstBatch())
    >>> learn.train_iter, learn.epoch
    (1, 0)
    """


class CancelEpochException(CancelException):
    """Skip the rest of this epoch (validation included).

    >>> class OneBatchPerEpoch(Callback):
    ...     def after_batch(self):
    ...         if self.training: raise CancelEpochException()
    >>> with learn.no_bar(): learn.fit(2, cbs=OneBatchPerEpoch())
    >>> learn.train_iter
    2
    """


class CancelTrainException(CancelException):
    """Skip the rest of this epoch's training; validation still runs.

    >>> class TrainOneBatch(Callback):
    ...     def after_batch(self):
    ...         if self.training: raise CancelTrainException()
    >>> with learn.no_bar(): learn.fit(1, cbs=TrainOneBatch())
    >>> learn.train_iter, len(learn.recorder.values)   # one batch trained, the epoch still validated
    (1, 1)
    """


class CancelValidateException(CancelException):
    """Skip the rest of this validation pass.

    >>> class NoValidation(Callback):
    ...     def before_validate(self): raise CancelValidateException()
    >>> with learn.no_bar(): learn.fit(1, cbs=NoValidation())
    >>> learn.train_iter
    4
    """


CancelValidException = CancelValidateException  # fastai's name


class CancelBatchException(CancelException):
    """Skip the rest of this batch (no backward/step/zero_grad if raised before them).

    >>> class SkipEveryStep(Callback):
    ...     def before_step(self): raise CancelBatchException()
    >>> with learn.no_bar(): learn.fit(1, cbs=SkipEveryStep())
    >>> learn.step   # no optimizer step was taken
    0
    """


class CancelBackwardException(CancelException):
    """Skip the backward pass of this batch.

    >>> class NoBackward(Callback):
    ...     def before_backward(self): raise CancelBackwardException()
    >>> with learn.no_bar(): learn.fit(1, cbs=NoBackward())
    >>> all(p.grad is None for p in learn.model.parameters())
    True
    """


class CancelStepException(CancelException):
    """Skip the optimizer step of this batch (gradients are still zeroed).

    >>> class NoStep(Callback):
    ...     def before_step(self): raise CancelStepException()
    >>> with learn.no_bar(): learn.fit(1, cbs=NoStep())
    >>> learn.step
    0
    """
