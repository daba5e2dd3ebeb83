"""Parameter schedules, `ParamScheduler`, the one-cycle policy and the learning-rate finder.

A schedule maps the training position `pos` in [0, 1] (optimizer steps taken / steps planned)
to a value; start and end may be arrays (one value per parameter group).

>>> sched = combine_scheds([0.25, 0.75], [SchedCos(1e-4, 1e-2), SchedCos(1e-2, 1e-7)])
>>> learn.fit(3, cbs=ParamScheduler({"lr": sched}))
>>> learn.fit_one_cycle(3, lr_max=1e-2)
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch

from .callback import Callback, Order
from .events import CancelFitException, CancelValidateException

Sched = Callable[[float], Any]


def SchedLin(start, end) -> Sched:
    """Linear from `start` to `end`."""
    return lambda pos: start + pos * (end - start)


def SchedCos(start, end) -> Sched:
    """Cosine annealing from `start` to `end`."""
    return lambda pos: start + (1 + math.cos(math.pi * (1 - pos))) * (end - start) / 2


def SchedNo(start, end) -> Sched:
    """Constant `start`."""
    return lambda pos: start


def SchedExp(start, end) -> Sched:
    """Exponential from `start` to `end` (used by the learning-rate finder)."""
    return lambda pos: start * (end / start) ** pos


def combine_scheds(pcts: Sequence[float], scheds: Sequence[Sched]) -> Sched:
    """Run `scheds[i]` over the fraction `pcts[i]` of training (the fractions sum to 1).

    >>> f = combine_scheds([0.5, 0.5], [SchedLin(0, 1), SchedLin(1, 0)]); f(0.25), f(0.75)
    (0.5, 0.5)
    """
    if len(pcts) != len(scheds) or not math.isclose(sum(pcts), 1.0) or any(p < 0 for p in pcts):
        raise ValueError(f"combine_scheds needs one non-negative fraction per schedule, summing to 1; got {list(pcts)}")
    bounds = np.cumsum([0.0, *pcts])

    def sched(pos: float):
        pos = min(max(pos, 0.0), 1.0)
        i = min(int(np.searchsorted(bounds, pos, side="right")) - 1, len(scheds) - 1)
        while i > 0 and pcts[i] == 0:
            i -= 1
        width = bounds[i + 1] - bounds[i]
        return scheds[i]((pos - bounds[i]) / width if width > 0 else 1.0)

    return sched


def combined_cos(pct: float, start, middle, end) -> Sched:
    """Cosine from `start` to `middle` over `pct` of training, then to `end` (one-cycle shape)."""
    return combine_scheds([pct, 1 - pct], [SchedCos(start, middle), SchedCos(middle, end)])


_HYPER_KEYS = {"lr": "lr", "wd": "weight_decay", "weight_decay": "weight_decay"}


def set_hyper(opt: torch.optim.Optimizer, name: str, value) -> None:
    """Set hyper-parameter `name` on every parameter group (`value` scalar or one per group).

    `mom` sets `betas[0]` (Adam family) or `momentum` (SGD); `wd` sets `weight_decay`.
    """
    values = np.broadcast_to(np.asarray(value, dtype=float), (len(opt.param_groups),))
    for group, v in zip(opt.param_groups, values.tolist()):
        if name in ("mom", "beta1"):
            if "betas" in group:
                group["betas"] = (v, group["betas"][1])
            elif "momentum" in group:
                group["momentum"] = v
        else:
            group[_HYPER_KEYS.get(name, name)] = v


def get_hyper(opt: torch.optim.Optimizer, name: str) -> list[float]:
    """Current value of a hyper-parameter on every parameter group."""
    if name == "mom":
        return [g["betas"][0] if "betas" in g else g.get("momentum", 0.0) for g in opt.param_groups]
    return [g[_HYPER_KEYS.get(name, name)] for g in opt.param_groups]


class ParamScheduler(Callback):
    """Set optimizer hyper-parameters from schedules before every training batch.

    The position is optimizer steps taken over steps planned, so it does not change with
    gradient accumulation or world size, and a resumed run continues where it stopped.

    >>> learn.fit(2, cbs=ParamScheduler({"lr": SchedCos(1e-2, 1e-5)}))
    """

    order = Order.SCHEDULE
    run_valid = False

    def __init__(self, scheds: dict[str, Sched]):
        self.scheds = scheds

    def before_fit(self):
        if self.learn.steps_per_epoch is None:
            raise ValueError("a schedule over the fit (fit_one_cycle, fit_flat_cos, ...) needs the number of batches "
                             "per epoch, and the train loader has no length (an IterableDataset without __len__): "
                             "give the dataset a __len__, or train with fit(n, lr)")
        self.total_steps = max(self.learn.n_epoch * self.learn.steps_per_epoch, 1)

    def before_batch(self):
        pos = self.learn.step / self.total_steps
        opt = self.learn.opt
        for name, sched in self.scheds.items():
            set_hyper(opt, name, sched(pos))


class SuggestedLRs(NamedTuple):
    """Learning rates suggested by `Learner.lr_find`."""

    valley: float
    steep: float
    minimum: float


class LRFinder(Callback):
    """Train with an exponentially growing learning rate, record the loss, restore everything after.

    Used through `learn.lr_find()`.
    """

    order = Order.SCHEDULE
    run_valid = False

    def __init__(self, start_lr: float = 1e-7, end_lr: float = 10.0, num_it: int = 100, stop_div: bool = True,
                 beta: float = 0.98):
        if not 0 < start_lr < end_lr:
            raise ValueError(f"lr_find needs 0 < start_lr < end_lr, got {start_lr} and {end_lr}")
        self.sched, self.num_it, self.stop_div, self.beta = SchedExp(start_lr, end_lr), num_it, stop_div, beta
        self.lrs: list[float] = []
        self.losses: list[float] = []

    def before_fit(self):
        model = self.learn.model
        self.saved = copy.deepcopy(model.state_dict()), copy.deepcopy(self.learn.opt.state_dict())
        self.best, self.avg = math.inf, 0.0

    def before_batch(self):
        set_hyper(self.learn.opt, "lr", self.sched(self.learn.train_iter / self.num_it))

    def after_batch(self):
        n = len(self.losses) + 1
        self.avg = self.beta * self.avg + (1 - self.beta) * float(self.learn.loss)
        smooth = self.avg / (1 - self.beta ** n)
        self.lrs.append(get_hyper(self.learn.opt, "lr")[-1])
        self.losses.append(smooth)
        self.best = min(self.best, smooth)
        if (self.stop_div and (smooth > 4 * self.best or not math.isfinite(smooth))) or n >= self.num_it:
            raise CancelFitException()

    def before_validate(self):
        raise CancelValidateException()

    def after_fit(self):
        self.learn.model.load_state_dict(self.saved[0])
        self.learn.opt.load_state_dict(self.saved[1])
        self.learn.opt.zero_grad(set_to_none=True)

    def suggestions(self) -> SuggestedLRs:
        """valley (fastai's default), steepest descent, and minimum-loss lr / 10."""
        if len(self.lrs) < 3:
            raise ValueError("lr_find recorded fewer than 3 steps; use more data or a larger num_it")
        # like fastai: ignore the noisy first tenth and the diverging last points
        trim = slice(len(self.lrs) // 10, -5 if len(self.lrs) > 20 else None)
        lrs, losses = np.array(self.lrs[trim]), np.array(self.losses[trim])
        i_min = int(np.argmin(losses))
        grads = np.gradient(losses, np.log(lrs))
        return SuggestedLRs(valley=float(lrs[_valley_index(losses)]), steep=float(lrs[int(np.argmin(grads[:i_min + 1]))]),
                            minimum=float(lrs[i_min] / 10))

    def plot(self, suggestion: float | None = None):
        """Loss against learning rate on a log scale (needs matplotlib)."""
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots()
        ax.plot(self.lrs, self.losses)
        ax.set(xscale="log", xlabel="learning rate", ylabel="loss")
        if suggestion is not None:
            ax.axvline(suggestion, color="red", linestyle="--", label=f"suggested {suggestion:.2e}")
            ax.legend()
        return fig


def _valley_index(losses: np.ndarray) -> int:
    """Middle of the longest run of decreasing loss (fastai's `valley` heuristic)."""
    n = len(losses)
    run = np.ones(n, dtype=int)
    prev = np.arange(n)
    for i in range(1, n):
        for j in range(i):
            if losses[i] < losses[j] and run[i] < run[j] + 1:
                run[i], prev[i] = run[j] + 1, j
    end = int(np.argmax(run))
    start = end
    while prev[start] != start:
        start = prev[start]
    return int(start + (end - start) * 2 // 3)
