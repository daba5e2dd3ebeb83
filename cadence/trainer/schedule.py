"""Parameter schedules and `ParamScheduler` (the fit policies that use them are in policies.py).

A schedule maps the training position `pos` in [0, 1] (optimizer steps / steps planned)
to a value; start and end may be arrays (one value per parameter group).

>>> sched = combine_scheds([0.25, 0.75], [SchedCos(1e-4, 1e-2), SchedCos(1e-2, 1e-7)])
>>> learn.fit(3, cbs=ParamScheduler({"lr": sched}))
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .callback import Callback, Order

Sched = Callable[[float], Any]


class _Sched:
    """A schedule from `start` to `end`: a plain object (not a closure), so a Learner holding one pickles."""

    def __init__(self, start, end):
        self.start, self.end = start, end

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.start!r}, {self.end!r})"


class SchedLin(_Sched):
    """Linear from `start` to `end`.

    >>> SchedLin(0.0, 1.0)(0.25)
    0.25
    """

    def __call__(self, pos: float):
        return self.start + pos * (self.end - self.start)


class SchedCos(_Sched):
    """Cosine annealing from `start` to `end`.

    >>> SchedCos(1.0, 0.0)(0.5)
    0.5
    """

    def __call__(self, pos: float):
        return self.start + (1 + math.cos(math.pi * (1 - pos))) * (self.end - self.start) / 2


class SchedNo(_Sched):
    """Constant `start`.

    >>> SchedNo(2.0, 5.0)(0.7)
    2.0
    """

    def __call__(self, pos: float):
        return self.start


class SchedExp(_Sched):
    """Exponential from `start` to `end` (used by the learning-rate finder).

    >>> round(SchedExp(1e-3, 1e-1)(0.5), 6)
    0.01
    """

    def __call__(self, pos: float):
        return self.start * (self.end / self.start) ** pos


class SchedPoly(_Sched):
    """Polynomial from `start` to `end`: `start + (end - start) * pos ** power`.

    >>> SchedPoly(0.0, 1.0, 2)(0.5)
    0.25
    """

    def __init__(self, start, end, power: float):
        super().__init__(start, end)
        self.power = power

    def __call__(self, pos: float):
        return self.start + (self.end - self.start) * pos ** self.power

    def __repr__(self) -> str:
        return f"SchedPoly({self.start!r}, {self.end!r}, {self.power!r})"


class combine_scheds:
    """Run `scheds[i]` over the fraction `pcts[i]` of training (the fractions sum to 1).

    >>> f = combine_scheds([0.5, 0.5], [SchedLin(0, 1), SchedLin(1, 0)]); f(0.25), f(0.75)
    (0.5, 0.5)
    """

    def __init__(self, pcts: Sequence[float], scheds: Sequence[Sched]):
        if len(pcts) != len(scheds) or not math.isclose(sum(pcts), 1.0) or any(p < 0 for p in pcts):
            raise ValueError(f"combine_scheds needs one non-negative fraction per schedule, summing to 1; got {list(pcts)}")
        self.pcts, self.scheds = list(pcts), list(scheds)
        self.bounds = np.cumsum([0.0, *pcts])

    def __call__(self, pos: float):
        pos = min(max(pos, 0.0), 1.0)
        pcts, bounds = self.pcts, self.bounds
        i = min(int(np.searchsorted(bounds, pos, side="right")) - 1, len(self.scheds) - 1)
        while i > 0 and pcts[i] == 0:
            i -= 1
        width = bounds[i + 1] - bounds[i]
        return self.scheds[i]((pos - bounds[i]) / width if width > 0 else 1.0)

    def __repr__(self) -> str:
        return f"combine_scheds({self.pcts}, {self.scheds})"


def combined_cos(pct: float, start, middle, end) -> Sched:
    """Cosine from `start` to `middle` over `pct` of training, then to `end` (one-cycle shape).

    >>> sched = combined_cos(0.25, 1e-3, 1e-2, 0.0)   # warm up for a quarter of training, then anneal
    >>> round(sched(0.25), 6), round(sched(1.0), 6)
    (0.01, 0.0)
    """
    return combine_scheds([pct, 1 - pct], [SchedCos(start, middle), SchedCos(middle, end)])


_HYPER_KEYS = {"lr": "lr", "wd": "weight_decay", "weight_decay": "weight_decay"}
GROUP_KEY, NO_WD_KEY = "cadence_group", "cadence_no_wd"  # Learner(wd_bn_bias=False) splits each group in two


def param_groups(opt: torch.optim.Optimizer) -> list[list[dict]]:
    """The parameter groups as the splitter made them, each a list of the optimizer's groups: one, or two
    (decayed, and normalisation / bias parameters without weight decay) with `Learner(wd_bn_bias=False)`."""
    found: dict[Any, list[dict]] = {}
    for i, group in enumerate(opt.param_groups):
        found.setdefault(group.get(GROUP_KEY, ("own", i)), []).append(group)
    return list(found.values())


def n_groups(opt: torch.optim.Optimizer) -> int:
    """How many parameter groups the splitter made (what one lr per group counts)."""
    return len(param_groups(opt))


def set_hyper(opt: torch.optim.Optimizer, name: str, value) -> None:
    """Set hyper-parameter `name` on every parameter group (`value` scalar or one per group).

    `mom` sets `betas[0]` (Adam family) or `momentum` (SGD built with momentum; one built without keeps none, as
    fastai's SGD with `mom=0` takes no momentum step); `wd` sets `weight_decay`, except on
    the parameters `Learner(wd_bn_bias=False)` keeps from decaying.
    """
    groups = param_groups(opt)
    values = np.broadcast_to(np.asarray(value, dtype=float), (len(groups),))
    key = _HYPER_KEYS.get(name, name)
    for parts, v in zip(groups, values.tolist()):
        for group in parts:
            if name in ("mom", "beta1"):
                if "betas" in group:
                    group["betas"] = (v, group["betas"][1])
                elif group.get("momentum") or getattr(opt, "defaults", {}).get("momentum"):
                    group["momentum"] = v  # an SGD built without momentum stays without
            elif not (key == "weight_decay" and group.get(NO_WD_KEY)):
                group[key] = v


def get_hyper(opt: torch.optim.Optimizer, name: str) -> list[float]:
    """Current value of a hyper-parameter on every parameter group."""
    firsts = [parts[0] for parts in param_groups(opt)]
    if name == "mom":
        return [g["betas"][0] if "betas" in g else g.get("momentum", 0.0) for g in firsts]
    return [g[_HYPER_KEYS.get(name, name)] for g in firsts]


class ParamScheduler(Callback):
    """Set optimizer hyper-parameters from schedules before every training batch.

    The position is optimizer steps over steps planned, so it does not change with gradient
    accumulation or world size, and a resumed run continues where it stopped: on another number of processes or
    batch size (another number of steps per epoch), the rest of the interrupted epoch (which keeps its batches)
    moves the position by its share of that epoch's batches, and the later epochs by steps of the new size. A step
    a callback
    cancels (`CancelBatchException`, `CancelStepException` where a step was due) still moves it, as
    fastai's schedule moves with every batch, so the fit ends where the schedule does; an fp16 step
    skipped for overflow does not (it is retried with a smaller loss scale).
    The values set (for the last parameter group) are kept per batch in `hps`, which is also
    `learn.recorder.hps`, for `learn.recorder.plot_sched()`.

    >>> learn.fit(2, cbs=ParamScheduler({"lr": SchedCos(1e-2, 1e-5)}))
    """

    order = Order.SCHEDULE
    run_valid = False
    optional_state_keys = frozenset({"n_epoch", "steps_per_epoch", "shift"})   # checkpoints before they were saved

    def __init__(self, scheds: dict[str, Sched]):
        self.scheds = scheds
        self.hps: dict[str, list[float]] = {}
        self.cancelled_steps, self._restored = 0, False   # steps due that callbacks cancelled, this fit
        self._saved: dict[str, Any] = {}   # a resumed run's plan, as its checkpoint holds it
        self._shift = 0   # steps added to the position: the epochs after a resume on another number of steps
        self._by_batches: int | None = None   # the epoch whose position is its share of batches (that resume's)

    def before_fit(self):
        if self.learn.steps_per_epoch is None:
            raise ValueError("a schedule over the fit (fit_one_cycle, fit_flat_cos, ...) needs the number of batches "
                             "per epoch, and the train loader has no length (an IterableDataset without __len__): "
                             "give the dataset a __len__, or train with fit(n, lr)")
        self.total_steps = max(self.learn.n_epoch * self.learn.steps_per_epoch, 1)
        self.hps = {name: [] for name in self.scheds}
        self.learn.recorder.hps = self.hps
        if not self._restored:
            self.cancelled_steps = 0
        self._shift, self._by_batches = 0, None
        if self._restored and self._other_layout():
            if getattr(self.learn.dls.train, "start_batch", 0):   # the rest of an epoch begun in the saved size
                self._by_batches = self.learn.epoch
            else:   # a whole epoch of the new size next: its steps from the epoch's boundary
                self._shift = self._boundary_shift()
        elif self._restored:
            self._shift = self._saved.get("shift") or 0   # a resume on another size before this one
        self._restored = False
        self._step_before, self._cancelled = self.learn.step, False   # as each batch starts (after_batch sets them)

    def _other_layout(self) -> bool:
        """Whether the resumed fit was saved with another number of steps per epoch (processes, batch size); a
        saved n_epoch that differs is warned (that schedule is another one)."""
        saved, learn = self._saved, self.learn
        if saved.get("n_epoch") not in (None, learn.n_epoch):
            if learn.strategy.is_main:
                warnings.warn(f"resuming a fit of {saved['n_epoch']} epochs as one of {learn.n_epoch}: the schedule "
                              f"is that of {learn.n_epoch} epochs from here, so its values jump; resume with "
                              f"fit({saved['n_epoch']}) to continue the saved one", stacklevel=2)
            return False
        return saved.get("steps_per_epoch") not in (None, learn.steps_per_epoch)

    def _boundary_shift(self) -> int:
        """The shift that puts the position at the start of `learn.epoch` in steps of the new size."""
        learn = self.learn
        return learn.epoch * learn.steps_per_epoch - (learn.step + self.cancelled_steps)

    def before_epoch(self):
        if self._by_batches is not None and self.learn.epoch > self._by_batches:   # the first epoch of the new size
            self._shift, self._by_batches = self._boundary_shift(), None

    def before_batch(self):
        learn = self.learn
        if self._by_batches is None:
            pos = (learn.step + self.cancelled_steps + self._shift) / self.total_steps
        else:   # the interrupted epoch, in the batches it was saved with
            pos = (learn.epoch + learn.iter / max(learn.n_iter or 1, 1)) / learn.n_epoch
        opt, hps = self.learn.opt, self.hps
        for name, sched in self.scheds.items():
            value = sched(pos)
            set_hyper(opt, name, value)
            hps[name].append(value)  # a float, or one value per group (plot_sched reads the last)

    def after_cancel_batch(self):
        self._cancelled = True

    def after_cancel_step(self):
        self._cancelled = True

    def after_batch(self):
        # GradAccum cancels the batches inside a window too; those owe no step (sync_gradients is False there)
        if self._cancelled and self.learn.sync_gradients and self.learn.step == self._step_before:
            self.cancelled_steps += 1
        self._step_before, self._cancelled = self.learn.step, False

    def state_dict(self) -> dict[str, Any]:
        # the interrupted epoch still runs in its saved size: the saved plan, else this fit's
        plan = self._saved if self._by_batches is not None else {"shift": self._shift,
                                                                 "steps_per_epoch": self.learn.steps_per_epoch}
        return {"cancelled_steps": self.cancelled_steps, "n_epoch": self.learn.n_epoch,
                "shift": plan.get("shift") or 0, "steps_per_epoch": plan["steps_per_epoch"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resumed run's count and plan; kept through the next `before_fit`."""
        self.cancelled_steps, self._restored = state["cancelled_steps"], True
        self._saved = {k: state.get(k) for k in self.optional_state_keys}
