"""The learning-rate finder: `LRFinder` and the suggestion functions `valley`, `slide`, `minimum`, `steep`.

`Learner.lr_find` trains with an exponentially growing learning rate, records the smoothed
loss, restores the model, and asks each suggestion function for a rate. A suggestion function
takes `(lrs, losses, num_it)` (tensors, the first tenth and the last five points dropped, as
fastai does) and returns `(lr, (x, y))`: the suggestion and the point to mark on the plot.

>>> learn.lr_find(suggest_funcs=(valley, slide, minimum, steep))
SuggestedLRs(valley=0.0021, slide=0.0035, minimum=0.012, steep=0.0006)
"""

from __future__ import annotations

import collections
import math
import warnings
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .callback import Callback, Order
from .events import CancelFitException, CancelValidateException
from .schedule import SchedExp, get_hyper, set_hyper

Suggestion = Callable[[torch.Tensor, torch.Tensor, int], tuple[float, tuple[float, float]]]


def valley(lrs: torch.Tensor, losses: torch.Tensor, num_it: int) -> tuple[float, tuple[float, float]]:
    """fastai's default: inside the longest run of decreasing loss, the rate about half-way along it.

    >>> suggested = learn.lr_find(num_it=10, suggest_funcs=(valley, steep), show_plot=False)
    >>> suggested._fields
    ('valley', 'steep')
    """
    values = losses.tolist()
    run, end = [1] * len(values), 0   # run[i]: longest decreasing subsequence ending at i
    for i in range(1, len(values)):
        run[i] = 1 + max((run[j] for j in range(i) if values[j] > values[i]), default=0)
        if run[i] > run[end]:
            end = i
    start = end - run[end] if end else 0
    third = (end - start) / 3
    idx = start + int(third) + int(third / 2)
    return float(lrs[idx]), (float(lrs[idx]), float(losses[idx]))


def slide(lrs: torch.Tensor, losses: torch.Tensor, num_it: int, lr_diff: int = 15, thresh: float = 0.005,
          adjust_value: float = 1.0) -> tuple[float, tuple[float, float]]:
    """Walk left from the end until the loss gradient `lr_diff` points apart differs by at most `thresh`.

    >>> suggested = learn.lr_find(num_it=10, suggest_funcs=(slide,), show_plot=False)
    >>> suggested._fields
    ('slide',)
    """
    grads = np.gradient(losses.numpy())
    right = -1
    left = right - min(lr_diff, len(grads) - 1)
    found = float(lrs[left])
    while left >= -len(grads) and abs(grads[right] - grads[left]) > thresh:
        found = float(lrs[left])
        right, left = right - 1, left - 1
    lr = found * adjust_value
    return lr, (lr, float(np.interp(np.log10(lr), np.log10(lrs.numpy()), losses.numpy())))


def minimum(lrs: torch.Tensor, losses: torch.Tensor, num_it: int) -> tuple[float, tuple[float, float]]:
    """A tenth of the rate where the loss was lowest.

    >>> suggested = learn.lr_find(num_it=10, suggest_funcs=(minimum,), show_plot=False)
    >>> suggested._fields
    ('minimum',)
    """
    idx = int(losses.argmin())
    return float(lrs[idx]) / 10, (float(lrs[idx]), float(losses[idx]))


def steep(lrs: torch.Tensor, losses: torch.Tensor, num_it: int) -> tuple[float, tuple[float, float]]:
    """The rate where the loss fell fastest (against log lr).

    >>> suggested = learn.lr_find(num_it=10, suggest_funcs=(steep,), show_plot=False)
    >>> suggested._fields
    ('steep',)
    """
    slopes = (losses[1:] - losses[:-1]) / (lrs[1:].log() - lrs[:-1].log())
    idx = int(slopes.argmin())
    return float(lrs[idx]), (float(lrs[idx]), float(losses[idx]))


def SuggestedLRs(names: Sequence[str]) -> type:
    """The named tuple `lr_find` returns: one field per suggestion function (`.valley`, `.steep`, ...).

    >>> SuggestedLRs(["valley", "steep"])(1e-3, 1e-2).steep
    0.01
    """
    return collections.namedtuple("SuggestedLRs", list(names))


class LRFinder(Callback):
    """Train with an exponentially growing learning rate, record the smoothed loss, restore everything after.

    Used through `learn.lr_find()`. It decides to stop after the Recorder saw the batch (order STOP),
    so `recorder.lrs` and `recorder.losses` hold every batch of the sweep. Under distribution it records
    the loss averaged over the processes. Callbacks whose `run_lr_find` is False (Checkpoint, SaveModel,
    EarlyStopping, trackers: what acts on the run's results) are detached for the sweep.

    >>> suggested = learn.lr_find(num_it=10, show_plot=False)   # adds an LRFinder for one sweep
    >>> suggested._fields
    ('valley',)
    """

    order = Order.STOP
    run_valid = False

    def __init__(self, start_lr: float = 1e-7, end_lr: float = 10.0, num_it: int = 100, stop_div: bool = True,
                 beta: float = 0.98):
        if not 0 < start_lr < end_lr:
            raise ValueError(f"lr_find needs 0 < start_lr < end_lr, got {start_lr} and {end_lr}")
        if not isinstance(num_it, int) or num_it < 2:
            raise ValueError(f"lr_find needs num_it >= 2 (batches to try), got {num_it!r}")
        self.sched, self.num_it, self.stop_div, self.beta = SchedExp(start_lr, end_lr), num_it, stop_div, beta
        self.lrs: list[float] = []
        self.losses: list[float] = []

    def before_fit(self):
        learn = self.learn  # the engine keeps the state (DeepSpeed's on disk, as fastai's `_tmp`: in model_dir)
        self.restore = learn.strategy.keep_training_state(learn.model, learn.opt,
                                                          learn.path / learn.model_dir / "_lr_find")
        self.best, self.avg = math.inf, 0.0

    def before_batch(self):
        set_hyper(self.learn.opt, "lr", self.sched(self.learn.train_iter / self.num_it))

    def after_batch(self):
        n = len(self.losses) + 1
        self.avg = self.beta * self.avg + (1 - self.beta) * self._mean_loss()
        smooth = self.avg / (1 - self.beta ** n)
        self.lrs.append(get_hyper(self.learn.opt, "lr")[-1])
        self.losses.append(smooth)
        self.best = min(self.best, smooth)
        if (self.stop_div and (smooth > 4 * self.best or not math.isfinite(smooth))) or self.learn.train_iter >= self.num_it:
            raise CancelFitException()

    def _mean_loss(self) -> float:
        """The batch's loss, averaged over the data-parallel processes: every process records the same sweep,
        so all stop at the same batch and suggest the same rates."""
        strategy = self.learn.strategy
        if strategy.dp_size == 1:
            return float(self.learn.loss)
        return float(strategy.all_sum(self.learn.loss.detach().float().reshape(1))) / strategy.dp_size

    def before_validate(self):
        raise CancelValidateException()

    def after_fit(self):
        self.restore()
        self.learn.strategy.zero_grad(self.learn.opt)

    def suggest(self, suggest_funcs: Sequence[Suggestion]) -> tuple[Any, list[tuple[float, float]]]:
        """(SuggestedLRs, the point each function marks) over the recorded sweep, trimmed as fastai does."""
        lrs, losses = self.trimmed()
        if len(lrs) < 2:
            raise ValueError(f"lr_find recorded {len(self.lrs)} batch(es), too few to suggest a rate: "
                             f"use more data or a larger num_it")
        results = [fn(lrs, losses, self.num_it) for fn in suggest_funcs]
        names = [getattr(fn, "__name__", type(fn).__name__) for fn in suggest_funcs]
        return SuggestedLRs(names)(*(r[0] for r in results)), [r[1] for r in results]

    def trimmed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The sweep without the first num_it // 10 points and the last 5 (fastai's choice); whole when that
        would leave fewer than 3 points (a short sweep)."""
        lrs, losses = self.lrs[self.num_it // 10:-5], self.losses[self.num_it // 10:-5]
        if len(lrs) < 3:
            lrs, losses = self.lrs, self.losses
        return torch.tensor(lrs, dtype=torch.float64), torch.tensor(losses, dtype=torch.float64)

    def plot(self, suggestions: Any = None, points: Sequence[tuple[float, float]] = ()):
        """Smoothed loss against learning rate on a log scale, each suggestion marked (needs matplotlib)."""
        from .plots import pyplot

        fig, ax = pyplot().subplots()
        ax.plot(*self.trimmed())
        ax.set(xscale="log", xlabel="learning rate", ylabel="loss")
        if suggestions is not None:
            for name, (x, y) in zip(suggestions._fields, points):
                ax.plot(x, y, "o", label=f"{name}: {getattr(suggestions, name):.2e}")
            ax.legend()
        return fig


def show_or_explain(finder: LRFinder, suggestions: Any, points: list) -> None:
    """Plot the sweep, or (without matplotlib) say how to get the plot; the suggestions stand either way."""
    from .plots import has_matplotlib

    if has_matplotlib():
        finder.plot(suggestions, points)
    else:
        warnings.warn(f"lr_find: matplotlib is not installed, so there is no plot (pip install matplotlib, then "
                      f"learn.lr_finder.plot()); the suggestions are {suggestions}", stacklevel=3)
