"""How a fit moves its hyper-parameters: `fit_one_cycle`, `fit_flat_cos`, `fit_sgdr` and `lr_find` (fastai's names).

Each builds a `ParamScheduler` and calls `fit` with the peak learning rate, so what a tracker
records as the run's `lr` is the rate the schedule reaches.

>>> learn.fit_one_cycle(3, lr_max=1e-2)
>>> learn.fit_flat_cos(3, lr=1e-2)
>>> learn.fit_sgdr(3, cycle_len=1, lr_max=1e-2)          # 1 + 2 + 4 epochs
>>> learn.lr_find(suggest_funcs=(valley, slide))
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from .callback import Callback, Order
from .epoch_record import EpochRecord
from .lr_find import LRFinder, Suggestion, show_or_explain, valley
from .schedule import ParamScheduler, SchedCos, combine_scheds, combined_cos, n_groups


def _as_list(cbs: Any) -> list:
    if cbs is None:
        return []
    return list(cbs) if isinstance(cbs, (list, tuple)) else [cbs]


class FitPolicies:
    """Mixed into `Learner`: fits whose learning rate (and momentum) follow a schedule."""

    def _peak_lrs(self, lr: Any):
        """One peak rate per parameter group, from `lr` (float, slice or list) or the Learner's default."""
        return self._group_lrs(self.lr if lr is None else lr, n_groups(self.opt))

    def fit_one_cycle(self, n_epoch: int, lr_max: float | slice | None = None, div: float = 25.0,
                      div_final: float = 1e5, pct_start: float = 0.25, wd: float | None = None,
                      moms: tuple[float, float, float] | None = None, cbs: Any = None,
                      reset_opt: bool = False, resume: str | Path | None = None, start_epoch: int = 0) -> None:
        """Train with the one-cycle policy: lr warms up to `lr_max` then anneals; momentum does the reverse
        (through `moms`, default the Learner's `moms`, as fastai's).

        `start_epoch` skips the epochs before it, the schedule going on from where they would have left it;
        `reset_opt=True` builds a new optimizer first, as `fit(reset_opt=True)`.

        >>> learn.fit_one_cycle(3, lr_max=1e-2)
        >>> learn.fit_one_cycle(10, lr_max=1e-2, start_epoch=4)
        """
        lr_max = self._peak_lrs(lr_max)
        scheds = {"lr": combined_cos(pct_start, lr_max / div, lr_max, lr_max / div_final)}
        scheds["mom"] = combined_cos(pct_start, *(self.moms if moms is None else moms))
        self.fit(n_epoch, lr=lr_max, wd=wd, cbs=[ParamScheduler(scheds), *_as_list(cbs)], reset_opt=reset_opt,
                 resume=resume, start_epoch=start_epoch)

    def fit_flat_cos(self, n_epoch: int, lr: float | slice | None = None, div_final: float = 1e5,
                     pct_start: float = 0.75, wd: float | None = None, cbs: Any = None,
                     reset_opt: bool = False, resume: str | Path | None = None, start_epoch: int = 0) -> None:
        """Train at a flat `lr` for `pct_start` of the steps, then anneal it by cosine to `lr / div_final`.

        >>> learn.fit_flat_cos(5, lr=1e-2)
        """
        if not 0 <= pct_start <= 1:
            raise ValueError(f"pct_start is the fraction of training at the flat rate, in [0, 1]; got {pct_start}")
        lr = self._peak_lrs(lr)
        scheds = {"lr": combined_cos(pct_start, lr, lr, lr / div_final)}
        self.fit(n_epoch, lr=lr, wd=wd, cbs=[ParamScheduler(scheds), *_as_list(cbs)], reset_opt=reset_opt,
                 resume=resume, start_epoch=start_epoch)

    def fit_sgdr(self, n_cycles: int, cycle_len: int, lr_max: float | slice | None = None,
                 cycle_mult: int = 2, wd: float | None = None, cbs: Any = None,
                 reset_opt: bool = False, resume: str | Path | None = None, start_epoch: int = 0) -> None:
        """Cosine annealing with warm restarts: `n_cycles` cycles, the first `cycle_len` epochs, each
        `cycle_mult` times longer than the one before; the rate restarts at `lr_max` and anneals to 0.

        >>> learn.fit_sgdr(3, cycle_len=1, lr_max=1e-2)     # 1 + 2 + 4 = 7 epochs
        """
        for name, value in (("n_cycles", n_cycles), ("cycle_len", cycle_len), ("cycle_mult", cycle_mult)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"fit_sgdr needs {name} to be a positive int, got {value!r}")
        lens = [cycle_len * cycle_mult ** i for i in range(n_cycles)]
        lr_max = self._peak_lrs(lr_max)
        scheds = {"lr": combine_scheds([n / sum(lens) for n in lens], [SchedCos(lr_max, 0) for _ in lens])}
        self.fit(sum(lens), lr=lr_max, wd=wd, cbs=[ParamScheduler(scheds), *_as_list(cbs)], reset_opt=reset_opt,
                 resume=resume, start_epoch=start_epoch)

    def lr_find(self, start_lr: float = 1e-7, end_lr: float = 10.0, num_it: int = 100, stop_div: bool = True,
                show_plot: bool = True, suggest_funcs: Sequence[Suggestion] = (valley,)) -> Any:
        """Try learning rates from `start_lr` to `end_lr` over `num_it` batches, restore the model, suggest rates.

        Returns a named tuple with one field per suggestion function (`valley`, `slide`, `minimum`,
        `steep`, or your own `fn(lrs, losses, num_it) -> (lr, (x, y))`). The sweep is
        `learn.lr_finder` until the next fit (fastai's callbacks tell lr_find's fit by it); without matplotlib there is no plot, and a warning says how to get one. Callbacks that
        act on the run's results (Checkpoint, SaveModel, EarlyStopping, trackers) sit the sweep out.

        >>> lr = learn.lr_find().valley
        >>> learn.lr_find(suggest_funcs=(minimum, steep))
        SuggestedLRs(minimum=0.012, steep=0.0006)
        """
        if not suggest_funcs or not all(callable(f) for f in suggest_funcs):
            raise TypeError(f"suggest_funcs must be a non-empty sequence of functions such as (valley, steep), "
                            f"got {suggest_funcs!r}")
        finder = LRFinder(start_lr, end_lr, num_it, stop_div)
        n_epoch = math.ceil(num_it / max(len(self.dls.train), 1))
        with self.no_bar(), self.no_logging(), self.removed_cbs([cb for cb in self.cbs if not cb.run_lr_find]):
            self.fit(n_epoch, cbs=finder)
        self.lr_finder = finder
        suggestions, points = finder.suggest(suggest_funcs)
        if show_plot:
            show_or_explain(finder, suggestions, points)
        return suggestions


class SkipToEpoch(Callback):
    """`fit(start_epoch=k)`: after every callback's before_fit (GradAccum fixes the steps per epoch), start at
    epoch k with the counters of a run that did epochs 0..k-1.

    The Recorder gets fastai's row for each skipped epoch: an empty one (`[]`; by name its `epoch`, and a `time` of
    0 when the Recorder adds times) in `values`, and 0 batches in `iters`; the progress display prints it as fastai
    does, the epoch's number and `00:00`. No callback sees an event of a skipped epoch (fastai runs before_epoch and
    after_epoch for each, and its SaveModelCallback and EarlyStoppingCallback then fail on the empty row).
    """

    order = Order.DEFAULT

    def __init__(self, start_epoch: int):
        self.start_epoch = start_epoch

    def before_fit(self):
        learn, k = self.learn, self.start_epoch
        learn.epoch = k
        learn.step = k * (learn.steps_per_epoch or 0)
        learn.train_iter = k * (learn._batches_per_epoch or 0)

    def before_epoch(self):  # ordered before the Recorder, whose before_fit emptied its history
        recorder = getattr(self.learn, "recorder", None)
        if self.learn.epoch == self.start_epoch and recorder is not None and not recorder.values:
            timed = {"time": 0.0} if recorder.add_time else {}
            recorder.values[:0] = [EpochRecord({"epoch": e, **timed}) for e in range(self.start_epoch)]
            recorder.iters[:0] = [0] * self.start_epoch
