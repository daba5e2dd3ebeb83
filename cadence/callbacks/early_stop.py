"""Stop, slow down or keep the best model by watching a value: EarlyStopping, ReduceLROnPlateau, SaveModel, TerminateOnNaN.

`EarlyStopping`, `ReduceLROnPlateau` and `SaveModel` watch one column of the Recorder's per-epoch results
(`learn.recorder.metric_names`), which under distribution is already combined over processes,
so every rank takes the same decision at the same epoch. `TerminateOnNaN` combines the
per-rank finiteness of the loss with one tiny `all_sum` per training batch, so every rank
stops at the same step even when only one of them sees a NaN.

>>> learn.fit(20, cbs=[EarlyStopping("valid_loss", patience=3), SaveModel("accuracy"), TerminateOnNaN()])
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..distributed.ops import main_print
from ..trainer.callback import Callback, Order
from ..trainer.events import CancelFitException

_MODES = ("min", "max")


def _resolve_mode(monitor: str, mode: str | None, comp: Callable | None) -> str:
    """'min' or 'max': from `mode`, from a fastai-style `comp` (np.less, operator.gt, ...), or from the name."""
    if mode is not None and comp is not None:
        raise ValueError("pass either mode ('min'/'max') or comp (e.g. np.less), not both")
    if comp is not None:
        if not callable(comp):
            raise TypeError(f"comp must be a comparison such as np.less or np.greater, got {comp!r}")
        return "min" if comp(0.0, 1.0) else "max"
    if mode is None:
        return "min" if "loss" in monitor or "error" in monitor else "max"
    if mode not in _MODES:
        raise ValueError(f"mode must be 'min' or 'max' (or None to infer it from the name), got {mode!r}")
    return mode


class MonitorCallback(Callback):
    """Base class: after each epoch, compare `monitor` in the Recorder's last row with the best so far.

    `mode` is "min" or "max" (default: "min" when the name contains "loss" or "error", else
    "max"); a value improves when it beats the best by more than `min_delta`. Sets `new_best`
    in `after_epoch` for subclasses. Detached during `lr_find` (`run_lr_find = False`).

    >>> class PrintBest(MonitorCallback):
    ...     def after_epoch(self):
    ...         super().after_epoch()
    ...         if self.new_best: print(self.epoch, self.best)
    """

    order = Order.STOP
    run_lr_find = False
    _state_attrs: tuple[str, ...] = ("best", "best_epoch")  # what a resumed run needs (Checkpoint saves it)

    def __init__(self, monitor: str = "valid_loss", mode: str | None = None, min_delta: float = 0.0,
                 reset_on_fit: bool = True, comp: Callable | None = None):
        if not isinstance(monitor, str):
            raise TypeError(f"monitor must be the name of a recorded value such as 'valid_loss', got {monitor!r}")
        if min_delta < 0:
            raise ValueError(f"min_delta must be >= 0 (the direction comes from mode), got {min_delta}")
        self.monitor, self.min_delta, self.reset_on_fit = monitor, float(min_delta), reset_on_fit
        self.mode = _resolve_mode(monitor, mode, comp)
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.new_best, self.measured, self._restored = False, False, False

    def before_fit(self):
        self.new_best = False
        available = self.available_names()
        if self.learn.recorder.column(self.monitor) not in available:   # fastai's `_rmse` is the column `rmse`
            raise ValueError(f"{type(self).__name__} monitors {self.monitor!r}, which is not recorded; "
                             f"choose one of {available}")
        if self._restored:
            self._restored = False
        elif self.reset_on_fit or self.best is None:
            self.reset()

    def available_names(self) -> list[str]:
        """The Recorder columns that can be monitored in this fit (validation ones need a validation set)."""
        names = [n for n in self.learn.recorder.metric_names if n not in ("epoch", "time")]
        return names if self.learn.dls.valid is not None else ["train_loss"]

    def reset(self) -> None:
        self.best, self.best_epoch = (math.inf if self.mode == "min" else -math.inf), None

    def improved(self, value: float | None) -> bool:
        """Whether `value` beats the best by more than `min_delta`."""
        if value is None or math.isnan(value):
            return False
        return value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta

    def after_epoch(self):
        value = self.learn.recorder.values[-1].get(self.monitor)
        self.measured = value is not None  # None: not measured this epoch (its validation cancelled)
        self.new_best = self.improved(value)
        if self.new_best:
            self.best, self.best_epoch = value, self.learn.epoch

    def state_dict(self) -> dict[str, Any]:
        return {attr: getattr(self, attr) for attr in self._state_attrs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a resumed run's state; kept through the next `before_fit` even with `reset_on_fit`."""
        for attr in self._state_attrs:
            setattr(self, attr, state[attr])
        self._restored = True

    def __repr__(self) -> str:
        return f"{type(self).__name__}(monitor={self.monitor!r}, mode={self.mode!r}, min_delta={self.min_delta})"


class _Patient(MonitorCallback):
    """A MonitorCallback that acts once `monitor` has not improved for `patience` epochs in a row."""

    _state_attrs = (*MonitorCallback._state_attrs, "wait")

    def __init__(self, monitor: str, comp: Callable | None, min_delta: float, patience: int, reset_on_fit: bool,
                 mode: str | None):
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(f"patience must be a positive int (epochs without improvement), got {patience!r}")
        super().__init__(monitor, mode=mode, min_delta=min_delta, reset_on_fit=reset_on_fit, comp=comp)
        self.patience, self.wait = patience, 0

    def reset(self) -> None:
        super().reset()
        self.wait = 0

    def out_of_patience(self) -> bool:
        """Count this epoch (after `MonitorCallback.after_epoch`); True when the wait reached `patience`.
        An epoch that did not measure `monitor` is not counted; a NaN counts as no improvement."""
        if not self.measured:
            return False
        self.wait = 0 if self.new_best else self.wait + 1
        return self.wait >= self.patience


class EarlyStopping(_Patient):
    """Stop training when `monitor` has not improved for `patience` epochs (fastai's EarlyStoppingCallback).

    >>> learn.fit(50, cbs=EarlyStopping("valid_loss", min_delta=1e-3, patience=3))
    >>> learn.fit(50, cbs=EarlyStopping("accuracy", mode="max"))
    """

    def __init__(self, monitor: str = "valid_loss", comp: Callable | None = None, min_delta: float = 0.0,
                 patience: int = 1, reset_on_fit: bool = True, mode: str | None = None):
        super().__init__(monitor, comp, min_delta, patience, reset_on_fit, mode)

    def after_epoch(self):
        super().after_epoch()
        if self.out_of_patience():
            since = "the start" if self.best_epoch is None else f"epoch {self.best_epoch} ({self.monitor}={self.best:.6g})"
            main_print(f"EarlyStopping: no improvement in {self.monitor} for {self.wait} epoch(s) since {since}; "
                       f"stopping after epoch {self.learn.epoch}")
            raise CancelFitException()


class ReduceLROnPlateau(_Patient):
    """Divide the learning rate by `factor` when `monitor` has not improved for `patience` epochs.

    Every parameter group's rate, not below `min_lr` (fastai's ReduceLROnPlateau). Every rank reads the same combined value, so
    every rank changes its rate at the same epoch.

    >>> learn.fit(20, lr=1e-2, cbs=ReduceLROnPlateau("valid_loss", patience=2, factor=10, min_lr=1e-5))
    """

    def __init__(self, monitor: str = "valid_loss", comp: Callable | None = None, min_delta: float = 0.0,
                 patience: int = 1, factor: float = 10.0, min_lr: float = 0.0, reset_on_fit: bool = True,
                 mode: str | None = None):
        if not factor > 1:
            raise ValueError(f"factor divides the learning rate, so it must be > 1, got {factor!r}")
        super().__init__(monitor, comp, min_delta, patience, reset_on_fit, mode)
        self.factor, self.min_lr = float(factor), float(min_lr)

    def after_epoch(self):
        super().after_epoch()
        if not self.out_of_patience():
            return
        groups = self.learn.opt.param_groups
        old = groups[-1]["lr"]
        for g in groups:
            g["lr"] = max(g["lr"] / self.factor, self.min_lr)
        self.wait = 0
        if groups[-1]["lr"] < old:
            main_print(f"ReduceLROnPlateau: no improvement in {self.monitor} for {self.patience} epoch(s); "
                       f"lr reduced to {groups[-1]['lr']:.6g} after epoch {self.learn.epoch}")


class SaveModel(MonitorCallback):
    """Save the weights whenever `monitor` improves and load the best at the end of fit (fastai's SaveModelCallback).

    Weights go to `learn.save(fname)` (the directory `path/model_dir/<fname>/`), written by the
    main process; every process loads them at the end. `every_epoch=True` (or n) saves
    `<fname>_<epoch>` every (n-th) epoch instead and loads nothing; `at_end=True` saves the
    final weights as `<fname>` at the end instead of loading the best.

    >>> learn.fit(10, cbs=SaveModel("accuracy", fname="best"))     # learn.model now holds the best epoch
    """

    order = Order.REPORT  # after the Recorder, and before EarlyStopping may cancel the fit in the same after_epoch
    name = "save_model_callback"  # `learn.save_model` is the Learner's weights-only export
    _state_attrs = (*MonitorCallback._state_attrs, "saved")

    def __init__(self, monitor: str = "valid_loss", mode: str | None = None, fname: str = "model",
                 every_epoch: bool | int = False, with_opt: bool = False, at_end: bool = False, min_delta: float = 0.0,
                 reset_on_fit: bool = True, comp: Callable | None = None):
        if every_epoch and at_end:
            raise ValueError("every_epoch and at_end cannot both be set: every_epoch saves <fname>_<epoch> files, "
                             "at_end saves <fname> once")
        if not isinstance(every_epoch, (bool, int)) or every_epoch < 0:
            raise ValueError(f"every_epoch must be a bool or a positive int (save every n epochs), got {every_epoch!r}")
        super().__init__(monitor, mode=mode, min_delta=min_delta, reset_on_fit=reset_on_fit, comp=comp)
        self.fname, self.every_epoch, self.with_opt, self.at_end = fname, int(every_epoch), with_opt, at_end
        self.saved = False

    def reset(self) -> None:
        super().reset()
        self.saved = False

    def before_fit(self):
        if self.every_epoch:  # saves on a schedule: nothing is monitored
            self.new_best = False
        else:
            super().before_fit()

    def _save(self, name: str) -> None:
        """Write on the main process (`learn.load` at the end waits for it on every process)."""
        self.learn.save(name, with_opt=self.with_opt)  # every rank: sharded engines gather; the main process writes

    def after_epoch(self):
        if self.every_epoch:
            if self.learn.epoch % self.every_epoch == 0:
                self._save(f"{self.fname}_{self.learn.epoch}")
            return
        super().after_epoch()
        if self.new_best:
            main_print(f"SaveModel: better model found at epoch {self.learn.epoch} with {self.monitor}={self.best:.6g}")
            self._save(self.fname)
            self.saved = True

    def after_fit(self):
        if self.at_end:
            self._save(self.fname)
        elif not self.every_epoch and self.saved:
            self.learn.load(self.fname, with_opt=self.with_opt)


class TerminateOnNaN(Callback):
    """Stop training at the first training batch whose loss is NaN or infinite, on every process.

    Each training batch costs one `all_sum` of a 3-element tensor (a device sync on GPU). The
    message names the step and the last finite loss (the mean over processes).

    It runs before the Recorder (as fastai's does), so `recorder.losses` and the trackers never
    hold the non-finite loss.

    >>> learn.fit(5, cbs=TerminateOnNaN())
    TerminateOnNaN: loss is not finite on 1 of 2 process(es) at step 42 (epoch 1, batch 10); last finite loss 0.3172 at step 41
    """

    order = Order.GUARD
    run_valid = False
    name = "terminate_on_nan"

    def __init__(self):
        self.last_finite: tuple[float, int] | None = None  # (mean loss over processes, step)

    def before_fit(self):
        self.last_finite = None

    def after_batch(self):
        learn = self.learn
        loss = learn.loss
        # [processes with a non-finite loss, sum of finite losses, processes with a loss]: built on the device
        # (no sync before the collective), summed on every rank every batch
        local = torch.zeros(3, dtype=torch.float64, device=learn.strategy.device)
        if loss is not None:
            loss = loss.to(local)  # float64 on the strategy's device
            finite = torch.isfinite(loss)
            local = torch.stack([(~finite).to(local), torch.where(finite, loss, 0.0), local.new_ones(())])
        n_bad, loss_sum, n_loss = learn.strategy.all_sum(local).tolist()
        if n_bad == 0:
            if n_loss > 0:
                self.last_finite = (loss_sum / n_loss, learn.step)
            return
        last = "none" if self.last_finite is None else f"{self.last_finite[0]:.6g} at step {self.last_finite[1]}"
        main_print(f"TerminateOnNaN: loss is not finite on {int(n_bad)} of {int(n_loss)} process(es) at step "
                   f"{learn.step} (epoch {learn.epoch}, batch {learn.iter}); last finite loss {last}")
        raise CancelFitException()
