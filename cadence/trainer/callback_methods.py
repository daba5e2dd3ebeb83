"""Attaching, detaching and ordering a Learner's callbacks, and the per-event handler tables the loop calls.

Mixed into `Learner`. Each callback becomes `learn.<cb.name>`; after every change the handlers are
rebuilt once per event, in callback order, one table for training and one for validation, so the loop
looks them up without asking each callback.

>>> learn.add_cb(GradClip(1.0))
>>> learn.ordered_cbs("after_batch")
[Recorder(), ProgressCallback()]
>>> with learn.removed_cbs(learn.progress): learn.fit(1)
>>> learn.show_training_loop()
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable
from typing import Any, Self

from .callback import Callback, event_methods
from .events import EVENT_NAMES, Event
from .recorder import Recorder

# the events of one batch, which a callback with run_train / run_valid False skips in that phase
_INNER_EVENTS = frozenset({"before_batch", "after_pred", "after_loss", "before_backward", "after_cancel_backward",
                           "after_backward", "before_step", "after_cancel_step", "after_step", "after_cancel_batch",
                           "after_batch"})
# show_training_loop indents each level by its depth
_DEPTH = {"create": 0, "fit": 0, "epoch": 1, "train": 2, "validate": 2, "batch": 3}


def listify(x) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


_OWN = frozenset({"learn", "run"})  # a callback's own attributes the learner has too


def _learner_has(learn: Any, name: str) -> bool:
    """Whether `learn` has attribute `name` (its own or its class's), without running a property."""
    return name in vars(learn) or any(name in vars(klass) for klass in type(learn).__mro__)


def learner_recorder(cbs: list, metrics: Any) -> Recorder:
    """The Learner's Recorder: one passed in `cbs` (fastai's `cbs=Recorder(train_metrics=True)`) in place of the
    default, taking the Learner's `metrics` unless it has its own."""
    given = [cb for cb in cbs if isinstance(cb, Recorder)]
    if len(given) > 1:
        raise ValueError(f"Learner(cbs=...) holds {len(given)} Recorders; a Learner records with one: pass one")
    if not given:
        return Recorder(listify(metrics))
    recorder = given[0]
    if listify(metrics):
        if recorder.metrics:
            raise ValueError("Learner(metrics=...) and the Recorder in cbs both name metrics: pass them once, to "
                             "either")
        recorder.metrics = listify(metrics)
    return recorder


def _check_one_recorder(learn: Any, cb: Callback) -> None:
    """A Learner records with one Recorder (its metrics are `learn.metrics`): a second one is refused."""
    if isinstance(cb, Recorder) and any(isinstance(c, Recorder) and c is not cb for c in learn.cbs):
        raise ValueError("the Learner has a Recorder already (learn.recorder); set its options "
                         "(learn.recorder.train_metrics = True), pass Recorder(...) to Learner(cbs=...), or "
                         "learn.remove_cb(learn.recorder) first")


class CallbackMethods:
    """Mixed into `Learner`: `add_cb`, `remove_cb`, their plural and `with` forms, and the handler tables."""

    def add_cb(self, cb: Callback | type) -> Self:
        """Attach a callback (an instance, or a class to instantiate); it becomes `learn.<cb.name>`."""
        if isinstance(cb, type):
            cb = cb()
        if not isinstance(cb, Callback):
            raise TypeError(f"callbacks must be cadence.Callback instances, got {cb!r}")
        event_methods(cb)  # rejects misspelled event names
        if hasattr(self, cb.name) and not isinstance(getattr(self, cb.name), Callback):  # `learn.wd` is None
            raise ValueError(f"callback name {cb.name!r} clashes with Learner.{cb.name}; rename the callback class")
        _check_one_recorder(self, cb)
        cb.learn = self
        cb.__dict__["_attrs_at_attach"] = frozenset(vars(cb))  # what it set before: not warned of (fastai's)
        setattr(self, cb.name, cb)
        self.cbs.append(cb)
        self._rebuild_handlers()
        return self

    def add_cbs(self, cbs: Iterable) -> Self:
        """Attach several callbacks (`add_cb` each).

        >>> learn.add_cbs([GradClip(1.0), EarlyStopping(patience=3)])
        """
        for cb in listify(cbs):
            self.add_cb(cb)
        return self

    def remove_cb(self, cb: Callback | type) -> Self:
        """Detach a callback instance, or every callback of a class."""
        targets = [c for c in self.cbs if (isinstance(c, cb) if isinstance(cb, type) else c is cb)]
        for c in targets:
            c.on_remove()
            self.cbs.remove(c)
            if getattr(self, c.name, None) is c:
                delattr(self, c.name)
                for other in self.cbs:  # another of the same name (two of a class): it is `learn.<name>` now
                    if other.name == c.name:
                        setattr(self, c.name, other)
            c.learn = None
        self._rebuild_handlers()
        return self

    def remove_cbs(self, cbs: Iterable) -> Self:
        """Detach several callbacks (`remove_cb` each).

        >>> learn.remove_cbs([learn.progress])
        """
        for cb in listify(cbs):
            self.remove_cb(cb)
        return self

    @contextlib.contextmanager
    def added_cbs(self, cbs: Any):
        """Attach callbacks for the duration of a `with` block."""
        cbs = [cb() if isinstance(cb, type) else cb for cb in listify(cbs)]
        self.add_cbs(cbs)
        try:
            yield self
        finally:
            self.remove_cbs(cbs)

    @contextlib.contextmanager
    def removed_cbs(self, cbs: Any):
        """Detach callbacks for the duration of a `with` block."""
        cbs = listify(cbs)
        self.remove_cbs(cbs)
        try:
            yield self
        finally:
            self.add_cbs(cbs)

    def _rebuild_handlers(self) -> None:
        """Per event, the handlers to call, in order; one table for training, one for validation."""
        self.cbs.sort(key=lambda c: c.order)
        methods = [(cb, event_methods(cb)) for cb in self.cbs]
        train, valid = {}, {}
        methods = [(cb, m) for cb, m in methods if cb.run]  # `self.run = False`: none of its events
        for event in EVENT_NAMES:
            inner = event in _INNER_EVENTS
            train[event] = tuple(m[event] for cb, m in methods if event in m and (cb.run_train or not inner))
            valid[event] = tuple(m[event] for cb, m in methods if event in m and (cb.run_valid or not inner))
        self._train_handlers, self._valid_handlers = train, valid
        self._handlers = train if self.training else valid
        self._forward_cbs = [cb for cb in self.cbs if cb.run and callable(getattr(cb, "forward_context", None))]

    def _run_callbacks_again(self) -> None:
        """fastai's reset at a fit's (and a validation's) end, done at its start too: every callback that set
        `self.run = False` runs again (and any that set a learner attribute on itself is warned)."""
        stopped = [cb for cb in self.cbs if not cb.run]
        for cb in stopped:
            cb.__dict__["run"] = True
        if stopped:
            self._rebuild_handlers()
        self._warn_shadowing()

    def _warn_shadowing(self) -> None:
        """fastai's warning, once per callback class and name: a callback that set an attribute the learner has
        (`self.loss = ...`) after it was attached reads its own from then on, and the learner's is unchanged.
        Checked at each epoch's and fit's end (not as each attribute is set: that would cost every set in the loop)."""
        warned = self.__dict__.setdefault("_shadowing_warned", set())
        for cb in self.cbs:
            for name in vars(cb).keys() - vars(cb).get("_attrs_at_attach", frozenset()):
                if ((type(cb), name) not in warned and not name.startswith("_") and name not in _OWN
                        and not hasattr(type(cb), name) and _learner_has(self, name)):
                    warned.add((type(cb), name))
                    warnings.warn(f"{type(cb).__name__} sets self.{name}, which hides the learner's {name} from the "
                                  f"callback (self.{name} reads the callback's own): write self.learn.{name} to change "
                                  f"the learner's", stacklevel=2)

    def show_training_loop(self) -> None:
        """Print every event in loop order with the callbacks that handle it."""
        for event in Event:
            name = event.value
            indent = "  " * _DEPTH.get(name.split("_")[-1], 4)
            handlers = [type(h.__self__).__name__ for h in self._train_handlers[name]]
            print(f"{indent}{name:<{30 - len(indent)}}{handlers}")

    def ordered_cbs(self, event: str | Event) -> list[Callback]:
        """The callbacks that handle `event`, in the order they run (fastai's).

        >>> learn.ordered_cbs("after_batch")
        [Recorder(), ProgressCallback()]
        """
        if str(event) not in EVENT_NAMES:
            raise ValueError(f"unknown event {str(event)!r}; events are listed in cadence.Event")
        return [h.__self__ for h in self._train_handlers[str(event)]]
