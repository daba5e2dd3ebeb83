"""The Callback base class and the table of `order` constants.

A callback is an object with methods named after events (see `events.Event`); the Learner
calls them in `order`, lowest first. It reads and writes the training state through
`self.learn` (attribute reads fall through to the learner: `self.epoch` is `self.learn.epoch`).

>>> class PrintLoss(Callback):
...     order = Order.REPORT
...     def after_batch(self):
...         if self.training: print(self.step, self.loss.item())
>>> learn.fit(1, cbs=PrintLoss())
"""

from __future__ import annotations

import difflib
import re
import types
from collections.abc import Callable
from typing import Any

from .events import EVENT_NAMES


# the callbacks every new Learner gets, as classes (fastai's `defaults.callbacks`); cadence.callbacks adds
# ProgressCallback, so the trainer package never imports it
default_callbacks: list[type] = []


class Order:
    """When each kind of callback runs within an event: lower runs first.

    >>> Order.PRECISION < Order.CLIP < Order.SCHEDULE   # unscale, then clip, then step and schedule
    True
    """

    DISTRIBUTED = -20   # swaps data loaders / wraps the model before anything else sees them
    ACCUMULATE = -5     # decides whether this batch steps
    DEFAULT = 0
    PRECISION = 10
    CLIP = 20           # after unscaling (PRECISION), before the step
    SCHEDULE = 30
    GUARD = 40          # NaN checks: stop before the Recorder records a non-finite loss (fastai runs them first)
    RECORD = 50         # Recorder: sees the final loss and metrics
    REPORT = 60         # progress, trackers: read what the Recorder stored
    STOP = 70           # early stopping, NaN checks: decide after everything is recorded
    CHECKPOINT = 80     # saves after every other callback updated its state


_CASE_BOUNDARY = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def camel2snake(name: str) -> str:
    """fastcore's `camel2snake`: split at case boundaries, an acronym staying one word, lower-cased, joined by `_`.

    >>> camel2snake("CSVLogger"), camel2snake("ReduceLROnPlateau")
    ('csv_logger', 'reduce_lr_on_plateau')
    """
    return "_".join(word.lower() for word in _CASE_BOUNDARY.split(name))


def legacy_name(cb: Any) -> str:
    """The attribute name cadence gave `cb` before it took fastcore's (a capital was a word: `c_s_v_logger`),
    under which checkpoints written then keep its state.

    >>> legacy_name(ReduceLROnPlateau())
    'reduce_l_r_on_plateau'
    """
    return re.sub(r"(?<!^)(?=[A-Z])", "_", re.sub(r"Callback$", "", type(cb).__name__) or type(cb).__name__).lower()


def class2attr(obj: Any, cls_name: str) -> str:
    """fastai's `class2attr`: `obj`'s class name without a trailing `cls_name`, snake-cased.

    >>> class2attr(EarlyStoppingCallback(), "Callback")
    'early_stopping'
    """
    return camel2snake(re.sub(rf"{cls_name}$", "", type(obj).__name__) or cls_name.lower())


class Callback:
    """Base class for callbacks. Override event methods; set `order`, `run_train`, `run_valid`, `run_lr_find`.

    As in fastai, a callback can also be made of functions, one per event, each called with the
    callback (`cb.learn` is the learner):

    >>> learn.fit(1, cbs=Callback(after_batch=lambda cb: print(cb.learn.loss)))
    """

    order: int = Order.DEFAULT
    run_train: bool = True      # called during training batches/events
    run_valid: bool = True      # called during validation
    run_lr_find: bool = True    # False: detached during lr_find's throwaway fit (callbacks acting on the run's results)
    learn: Any = None
    # keys of `state_dict()` / `rank_state_dict()` a saved state may lack (written before they were added): the
    # callback's `load_state_dict` fills them in, and a resume's check of the saved state lets them be absent
    optional_state_keys: frozenset[str] = frozenset()

    def __init__(self, **event_funcs: Callable[["Callback"], Any]):
        for event, func in event_funcs.items():
            if event not in EVENT_NAMES:
                close = difflib.get_close_matches(event, EVENT_NAMES, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"Callback({event}=...): {event!r} is not a training event.{hint} "
                                 f"Events are listed in cadence.Event.")
            if not callable(func):
                raise TypeError(f"Callback({event}=...) takes a function of the callback, got {func!r}")
            setattr(self, event, types.MethodType(func, self))

    @property
    def run(self) -> bool:
        """fastai's switch: `self.run = False` (in any event) skips every event of this callback from the next one
        on, until the fit ends; each fit starts with it True again.

        >>> class FirstBatchOnly(Callback):
        ...     def after_batch(self): print(self.loss); self.run = False
        """
        return self.__dict__.get("run", True)

    @run.setter
    def run(self, value: bool) -> None:
        if not (isinstance(value, (bool, int)) and value in (0, 1) or type(value).__name__ == "bool_"):  # numpy's
            raise TypeError(f"{type(self).__name__}.run is fastai's switch of the callback's events, True or False; "
                            f"got {value!r}: keep it under another name (e.g. self.wandb_run)")
        if bool(value) != self.run:
            self.__dict__["run"] = bool(value)
            learn = self.__dict__.get("learn")
            if learn is not None:
                learn._rebuild_handlers()

    @property
    def name(self) -> str:
        """Attribute name on the learner (fastai's): `ParamScheduler` -> `learn.param_scheduler`, `CSVLogger` ->
        `learn.csv_logger`."""
        return class2attr(self, "Callback")

    def on_remove(self) -> None:
        """Called by `learn.remove_cb` (and after `fit(cbs=...)`) as the callback leaves, `self.learn` still set: undo
        what it set on the learner outside its events (MixedPrecision takes its precision off the strategy).

        >>> class Tag(Callback):
        ...     def before_fit(self): self.learn.tagged = True
        ...     def on_remove(self): del self.learn.tagged
        """

    def __getattr__(self, attr: str) -> Any:
        # fall through to the learner for the training state (epoch, loss, model, ...)
        learn = self.__dict__.get("learn") or type(self).learn
        if learn is not None and not attr.startswith("__"):
            return getattr(learn, attr)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {attr!r}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def event_methods(cb: Callback) -> dict[str, Any]:
    """The bound event methods `cb` defines; raises ValueError for a misspelled event name."""
    found = {attr: f for attr, f in vars(cb).items() if attr in EVENT_NAMES}  # Callback(before_batch=...)
    for attr in dir(type(cb)):
        if attr in EVENT_NAMES:
            found[attr] = getattr(cb, attr)
        elif re.fullmatch(r"(before|after)_[a-z_]+", attr) and callable(getattr(type(cb), attr, None)):
            close = difflib.get_close_matches(attr, EVENT_NAMES, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{type(cb).__name__}.{attr} is not a training event.{hint} "
                             f"Events are listed in cadence.Event.")
    return found


def before_batch_cb(f: Callable[[Any, tuple, tuple], tuple[tuple, tuple]]) -> Callback:
    """fastai's shortcut: a callback on `before_batch` that replaces the batch with `f(cb, xb, yb) -> (xb, yb)`.

    >>> learn.fit(1, cbs=before_batch_cb(lambda cb, xb, yb: ((xb[0] * 2,), yb)))
    """
    def before_batch(cb: Callback) -> None:
        cb.learn.xb, cb.learn.yb = f(cb, cb.learn.xb, cb.learn.yb)

    return Callback(before_batch=before_batch)
