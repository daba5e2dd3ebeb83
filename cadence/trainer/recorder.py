"""Recorder: what happened during training, per optimizer step and per epoch.

Always attached as `learn.recorder`. As in fastai, the training loss it records and shows is
the smoothed loss (an exponential moving average of the batch losses, beta 0.98, debiased,
carried over the whole fit): `recorder.losses` holds it after every training batch and the
`train_loss` column its value at the end of the epoch.

>>> learn.fit(2)
>>> learn.recorder.values[-1]      # [train_loss, valid_loss, accuracy], as fastai's; by name too: ...["accuracy"]
>>> learn.recorder.losses[:3], learn.recorder.lrs[:3]     # per training batch
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from .callback import Callback, Order
from .epoch_record import EpochRecord, column
from .metrics import AvgLoss, Metric, accumulate, as_metric, check_syncable, value_of


class SmoothLoss:
    """fastai's smoothed loss: an exponential moving average of the batch losses, debiased.

    `val = beta * val + (1 - beta) * loss` per batch, read as `val / (1 - beta ** count)`. Kept in float64 so that a resumed run continues it exactly.

    >>> s = SmoothLoss(0.98); s.update([1.0, 0.0])
    [1.0, 0.494949...]
    """

    def __init__(self, beta: float = 0.98):
        if not 0 <= beta < 1:
            raise ValueError(f"the smoothing factor beta must be in [0, 1), got {beta!r}")
        self.beta = beta
        self.reset()

    def reset(self) -> None:
        self.val, self.count = 0.0, 0

    def update(self, losses: list[float]) -> list[float]:
        """Feed batch losses in order; returns the debiased value after each."""
        out, beta = [], self.beta
        for loss in losses:
            self.count += 1
            self.val = beta * self.val + (1 - beta) * loss
            out.append(self.val / (1 - beta ** self.count))
        return out

    @property
    def value(self) -> float | None:
        return self.val / (1 - self.beta ** self.count) if self.count else None

    def restore(self, value: float, count: int, raw: float | None = None) -> None:
        """Continue from a debiased `value` after `count` batches (what `recorder.losses` holds), or from the moving
        average itself (`raw`, `val` as saved: bitwise the run's own)."""
        self.count, self.val = count, value * (1 - self.beta ** count) if raw is None else raw


class Recorder(Callback):
    """Records per-batch smoothed training loss and lr, and per-epoch train loss, valid loss, metrics and time.

    As fastai's: `values` holds one row per epoch, the list `[train_loss, valid_loss, *metrics]` (an
    `EpochRecord`, which names its columns too: `values[-1]["accuracy"]`, `values[-1]["epoch"]`); `iters` the
    number of training batches done at each of them; `log` the row being built, `[epoch, train_loss, ...]`,
    with the time (as `mm:ss`) once the epoch ends; `learn.final_record` is the last row.

    Args:
        metrics: computed on the validation set (and, with `train_metrics`, on the training batches).
        add_time: add the epoch's duration as the last column, "time".
        train_metrics: also compute the metrics on the training batches; the columns are then
            fastai's `train_loss, train_<metric>..., valid_loss, valid_<metric>...`.
        beta: smoothing of the training loss (fastai's 0.98).

    On N processes loss and metric state are combined with `learn.strategy.all_sum` / `gather` (each metric's
    `sync`) before values are read; a fit refuses at once a metric that cannot be (a `Metric` subclass without
    `sync`). `recorder.losses` is each process's own smoothed loss (as in fastai), `train_loss` its mean.

    >>> learn = Learner(dls, model, loss_func=F.cross_entropy, metrics=accuracy)
    >>> learn.remove_cb(learn.recorder).add_cb(Recorder([accuracy], train_metrics=True, add_time=False))
    """

    optional_state_keys = frozenset({"iters", "smooth_val"})   # checkpoints before they were recorded

    order = Order.RECORD

    def __init__(self, metrics: list[Any] | None = None, add_time: bool = True, train_metrics: bool = False,
                 beta: float = 0.98):
        self.metrics = metrics or []
        self.add_time, self.train_metrics = add_time, train_metrics
        self.train_loss, self.valid_loss = AvgLoss("train_loss"), AvgLoss("valid_loss")
        self.smooth = SmoothLoss(beta)
        self.values: list[EpochRecord] = []
        self.iters: list[int] = []  # training batches done (this fit) when each row of `values` was recorded
        self.log: list = []  # the current epoch's row as it is built (fastai's), its time formatted at the end
        self._log_valid = False  # between the epoch's training and its validation, whose values go to `log`
        self._valid_values: dict[str, float | None] | None = None  # that pass's values, once read
        self.losses: list[float] = []
        self.raw_losses: list[float] = []  # this process's batch losses before smoothing (since the fit or resume began)
        self.lrs: list[float] = []
        self._batch_losses: list[torch.Tensor | float] = []  # floats on the CPU, tensors on an accelerator
        self._float_losses = True
        self._resumed, self._smooth_val, self._cancelled = False, None, False
        self._train_values: dict[str, float | None] = {}
        self._live: tuple[int, SmoothLoss | None] = (0, None)  # smooth_loss read mid-epoch: batches folded in, state
        self._as_tensor = {key: _GrowingTensor() for key in ("losses", "lrs", "epoch_losses")}
        self._hps: dict[str, list] = {}  # per batch, what a ParamScheduler set: a float or one value per group

    @property
    def metrics(self) -> list[Metric]:
        """The metrics computed each validation (settable: `learn.metrics = [...]` sets them)."""
        return self._metrics

    @metrics.setter
    def metrics(self, metrics: list[Any]) -> None:
        self._metrics: list[Metric] = [as_metric(m) for m in metrics]
        self.metric_keys = _unique([m.name for m in self._metrics])

    @property
    def metric_names(self) -> list[str]:
        """Columns of one epoch's results, in order (fastai's names; a repeated name gets `_2`, `_3`, ...)."""
        names = self.metric_keys
        if self.train_metrics:
            cols = ["train_loss", *(f"train_{n}" for n in names), "valid_loss", *(f"valid_{n}" for n in names)]
        else:
            cols = ["train_loss", "valid_loss", *names]
        return ["epoch", *cols, *(["time"] if self.add_time else [])]

    def column(self, name: str) -> str | None:
        """The column of `metric_names` that `name` designates, fastai's names included (`"_rmse"` -> `"rmse"`,
        `"_exp_rmspe"` -> `"exp_rmspe"`); None when it is not recorded. Monitoring callbacks look names up so.

        >>> Learner(dls, model, loss_func=nn.MSELoss(), metrics=rmse).recorder.column("_rmse")
        'rmse'
        """
        return column(name, self.metric_names)

    @property
    def smooth_loss(self) -> float | None:
        """The smoothed training loss so far (fastai's `learn.smooth_loss`), read as late as asked."""
        if not self._batch_losses:
            return self.smooth.value
        done, live = self._live
        if live is None:
            done, live = 0, SmoothLoss(self.smooth.beta)
            live.val, live.count = self.smooth.val, self.smooth.count
        live.update([float(x) for x in self._batch_losses[done:]])
        self._live = (len(self._batch_losses), live)
        return live.value

    @property
    def hps(self) -> dict[str, list[float]]:
        """Per training batch, the last parameter group's value of each hyper-parameter a ParamScheduler set
        (fastai's: `hps["lr"][0]` is a number for discriminative rates too).

        >>> learn.fit_one_cycle(1, slice(1e-3, 1e-1)); learn.recorder.hps["lr"][0]
        np.float64(0.004)
        """
        return {key: [_last(v) for v in values] for key, values in self._hps.items()}

    @hps.setter
    def hps(self, hps: dict[str, list]) -> None:
        self._hps = hps  # ParamScheduler's own dict, which it fills batch by batch

    def _sync(self, metrics: Any) -> None:
        """Combine each metric's state over the data-parallel processes; on one process it is whole already."""
        strategy = self.learn.strategy
        if strategy.dp_size > 1:
            for m in metrics:
                m.sync(strategy.all_sum, strategy.gather)

    def _on_cpu(self) -> bool:
        return self.learn.strategy.device.type == "cpu"

    def before_fit(self):
        # On an accelerator a batch loss stays a tensor (reading it would wait for the device). On the
        # CPU reading it costs nothing, and a float is cheaper to keep than thousands of small tensors.
        self._float_losses = self._on_cpu()
        self._live = (0, None)
        if self.learn.strategy.dp_size > 1:  # before any training, not at the first validation's end
            check_syncable(self.metrics)
        if self._resumed:  # load_state_dict restored the history of the interrupted run
            if self.losses:  # the smoothed loss continues where the saved run's stood
                self.smooth.restore(self.losses[-1], len(self.losses), self._smooth_val)
            else:
                self.smooth.reset()
            return
        self.losses, self.raw_losses, self.lrs, self.values, self.iters = [], [], [], [], []
        self._batch_losses = []
        self.smooth.reset()

    def before_epoch(self):
        self._live = (0, None)
        self.start_time = time.perf_counter()
        self.log, self._valid_values, self._cancelled = [self.learn.epoch], None, False
        self.train_loss.reset()
        self._train_values = {}
        self.valid_loss.reset()  # a validation cancelled this epoch leaves its values empty, not the last epoch's
        for m in self.metrics:
            m.reset()
        if not self._resumed:  # a resumed epoch keeps the losses of its first part
            self._batch_losses = []
        self._resumed = False

    def before_train(self):
        if self.train_metrics:
            for m in self.metrics:
                m.reset()

    def state_dict(self) -> dict[str, Any]:
        """History so far, and the current epoch's batch losses (a checkpoint may fall mid-epoch).

        The per-batch lists are float64 tensors (a checkpoint keeps them out of its JSON), each
        extended by the batches since the last call: a checkpoint's cost does not grow with the run.
        """
        t = self._as_tensor
        return {"values": [row.as_dict() for row in self.values], "iters": list(self.iters), "lrs": t["lrs"](self.lrs),
                **self.rank_state_dict()}

    def rank_state_dict(self) -> dict[str, Any]:
        """What differs per process: its own smoothed losses, the current epoch's batch losses and the moving
        average (bitwise); a checkpoint keeps each process's in its own file, and a resume restores each its own."""
        t = self._as_tensor
        return {"losses": t["losses"](self.losses), "epoch_losses": t["epoch_losses"](self._batch_losses),
                "smooth_val": self.smooth.val}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` (lists, as checkpoints of format 1 hold them, load too; their `epoch_sizes`, which
        weighted the unsmoothed epoch mean, is not needed). A checkpoint written before `iters` was recorded
        gets it spread evenly over the epochs it holds (exact when every epoch had as many batches)."""
        self.lrs = _as_list(state["lrs"])
        self.load_rank_state_dict(state)
        self.values = [EpochRecord(row) for row in state["values"]]
        n = len(self.values)
        self.iters = list(state.get("iters") or [len(self.losses) * (i + 1) // n for i in range(n)])
        self._resumed = True

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `rank_state_dict()` (this process's own; `load_state_dict` restored the main process's first)."""
        self.losses = _as_list(state["losses"])
        self._smooth_val = state.get("smooth_val")  # the moving average itself (absent: from `losses`)
        losses = _as_list(state["epoch_losses"])
        device = self.learn.strategy.device
        self._batch_losses = losses if self._on_cpu() else [torch.tensor(x, device=device) for x in losses]

    def before_validate(self):
        if self.learn.inner_pass:  # get_preds(inner=True) inside fit: nothing of it is recorded
            return
        self.valid_loss.reset()
        for m in self.metrics:
            m.reset()

    def after_batch(self):
        learn = self.learn
        loss = learn._loss  # what `learn.loss` holds, maybe not yet detached: item() needs no detach
        if loss is None:  # batch cancelled before its loss
            return
        if learn.training:
            self._batch_losses.append(loss.item() if self._float_losses else loss.detach())
            self.lrs.append(learn.opt.param_groups[-1]["lr"])
            if self.train_metrics and learn.yb:
                for m in self.metrics:
                    accumulate(m, learn)
        elif learn.yb and not learn.inner_pass:
            self.valid_loss.accumulate(learn)
            for m in self.metrics:
                accumulate(m, learn)

    def after_train(self):
        """Smooth the epoch's batch losses into `losses`; `train_loss` is the smoothed value (mean over processes)."""
        strategy = self.learn.strategy
        if self._batch_losses:
            self._flush_losses()
        if self.smooth.count:
            # the mean over processes; on one process the value itself, kept on the host (on XLA a round trip
            # through the device would run and compile a graph of its own at every epoch's end)
            self.train_loss.sums = torch.tensor([self.smooth.value, 1.0], dtype=torch.float64,
                                                device=strategy.device if strategy.dp_size > 1 else None)
            self._sync([self.train_loss])
        self._train_values = {"train_loss": self.train_loss.value}
        if self.train_metrics:
            self._sync(self.metrics)
            self._train_values.update({f"train_{key}": value_of(m) for key, m in zip(self.metric_keys, self.metrics)})
        self.log += self._train_values.values()
        self._log_valid = True

    def _flush_losses(self) -> None:
        """Move the batch losses not yet in `losses` there, smoothed (one per entry of `lrs`)."""
        raw = (self._batch_losses if self._float_losses
               else torch.stack(self._batch_losses).double().cpu().tolist())
        raw = [float(x) for x in raw]
        self._live = (0, None)
        self.raw_losses.extend(raw)
        self.losses.extend(self.smooth.update(raw))
        self._batch_losses = []

    def after_cancel_epoch(self):
        """An epoch cancelled mid-training skips after_train: keep its batch losses all the same."""
        if self._batch_losses:
            self._flush_losses()
        self._cancelled = True

    after_cancel_fit = after_cancel_epoch  # lr_find, TerminateOnNaN: `losses` and `lrs` keep the same length

    def after_validate(self):
        learn = self.learn
        if learn.inner_pass:
            return
        self._sync([self.valid_loss, *self.metrics])
        if self._log_valid and learn.dl is learn.dls.valid:  # the epoch's validation
            self._valid_values = self.valid_values()  # read once: a ValueMetric computes its value when read
            self.log += self._valid_values.values()
            self._log_valid = False

    def after_epoch(self):
        if self._cancelled:  # fastai's row: what the epoch recorded before CancelEpochException ([] in training)
            row = EpochRecord({"epoch": self.learn.epoch, **self._train_values, **(self._valid_values or {})})
        else:
            valid = self.valid_values() if self._valid_values is None else self._valid_values
            row = EpochRecord({"epoch": self.learn.epoch, "train_loss": None, **self._train_values, **valid})
        if self.add_time:
            row["time"] = time.perf_counter() - self.start_time
        self.values.append(row)
        self.iters.append(len(self.losses))
        self.learn.final_record, self._log_valid = row, False
        self.log = [row["epoch"], *row, *([format_time(row["time"])] if self.add_time else [])]
        if self.learn.log_epochs and self.learn.strategy.is_main:
            self.learn.logger(self.log)  # fastai's; the progress display shows it its way

    def valid_values(self) -> dict[str, float | None]:
        """valid_loss and every metric of the epoch's validation pass (`valid_<name>` with `train_metrics`); none
        without a validation set."""
        return {} if self.learn.dls.valid is None else self.pass_values()

    def pass_values(self) -> dict[str, float | None]:
        """valid_loss and every metric of the last validation pass, over whatever loader it read."""
        prefix = "valid_" if self.train_metrics else ""
        return {"valid_loss": self.valid_loss.value,
                **{prefix + key: value_of(m) for key, m in zip(self.metric_keys, self.metrics)}}

    def plot_loss(self, skip_start: int = 5, with_valid: bool = True, log: bool = False, show_epochs: bool = False,
                  ax: Any = None):
        """Training loss per batch and validation loss per epoch (needs matplotlib), fastai's: `log` on log-log
        axes, `show_epochs` a dotted line at each epoch's end, into `ax` (a matplotlib Axes) if given.

        >>> learn.recorder.plot_loss(log=True, show_epochs=True)
        """
        ax = _axes() if ax is None else ax
        (ax.loglog if log else ax.plot)(range(skip_start, len(self.losses)), self.losses[skip_start:], label="train")
        if show_epochs:
            for end in self.iters:
                ax.axvline(end, color="grey", ls=":")
        valid = [(i, v["valid_loss"]) for i, v in zip(self.iters, self.values)
                 if v.get("valid_loss") is not None and i >= skip_start]
        if with_valid and valid:
            ax.plot(*zip(*valid), label="valid")
        ax.set(xlabel="batch", ylabel="loss", title="learning curve")
        ax.legend()
        return ax.figure

    def plot_lr(self):
        """The learning rate of the last parameter group, per training batch (needs matplotlib)."""
        ax = _axes()
        ax.plot(self.lrs)
        ax.set(xlabel="batch", ylabel="learning rate")
        return ax.figure

    def plot_sched(self, keys: list[str] | None = None):
        """Every hyper-parameter a ParamScheduler set (lr, mom, ...), per training batch (needs matplotlib).

        >>> learn.fit_one_cycle(3); learn.recorder.plot_sched()     # lr and momentum side by side
        """
        hps = self.hps
        keys = list(hps) if keys is None else keys
        if not keys:
            raise ValueError("no schedule recorded: plot_sched shows what a ParamScheduler set "
                             "(fit_one_cycle, fit_flat_cos, fit_sgdr or fit(cbs=ParamScheduler(...)))")
        fig, axs = _pyplot().subplots(1, len(keys), figsize=(4 * len(keys), 3), squeeze=False)
        for ax, key in zip(axs[0], keys):
            ax.plot(hps[key])
            ax.set(xlabel="batch", ylabel=key)
        return fig

    def plot_lr_find(self, skip_end: int = 5, return_fig: bool = True, suggestions: Any = None, nms: Any = None):
        """fastai's: the last `lr_find`'s smoothed loss against its learning rate (log scale), the last
        `skip_end` batches left out, each point of `suggestions` (`(lr, loss)` pairs) marked and named by `nms`.

        >>> learn.lr_find(show_plot=False); learn.recorder.plot_lr_find()
        """
        if not self.lrs:
            raise ValueError("plot_lr_find plots the last lr_find's sweep, and nothing is recorded: call "
                             "learn.lr_find() first")
        end = max(len(self.lrs) - skip_end, 1) if skip_end else None   # a short sweep still shows its first point
        plt = _pyplot()
        fig, ax = plt.subplots(1, 1)
        ax.plot(self.lrs[:end], self.losses[:end])
        ax.set(ylabel="Loss", xlabel="Learning Rate", xscale="log")
        if suggestions:
            colors = plt.rcParams["axes.prop_cycle"].by_key()["color"][1:]
            for (x, y), name, color in zip(suggestions, nms or [None] * len(suggestions), colors):
                ax.plot(x, y, "o", label=name, c=color)
            ax.legend(loc="best")
        return fig if return_fig else None


class _GrowingTensor:
    """A float64 copy of a list that only grows, extended by its new items at each call (0-d tensors
    are read in one transfer); a list replaced or shortened is copied afresh."""

    def __init__(self):
        self.source: list | None = None
        self.tensor = torch.zeros(0, dtype=torch.float64)

    def __call__(self, items: list) -> torch.Tensor:
        if items is not self.source or len(items) < len(self.tensor):
            self.source, self.tensor = items, torch.zeros(0, dtype=torch.float64)
        new = items[len(self.tensor):]
        if new:
            tail = (torch.stack(new).double().cpu().reshape(-1) if isinstance(new[0], torch.Tensor)
                    else torch.tensor(new, dtype=torch.float64))
            self.tensor = torch.cat([self.tensor, tail])
        return self.tensor


def format_time(seconds: float) -> str:
    """fastai's `format_time`: `mm:ss`, or `h:mm:ss` from an hour on.

    >>> format_time(75), format_time(3725)
    ('01:15', '1:02:05')
    """
    t = int(seconds)
    h, m, s = t // 3600, t // 60 % 60, t % 60
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def _last(value: Any) -> Any:
    """A hyper-parameter's value for the last parameter group: `value` itself when it is one number."""
    return np.asarray(value).reshape(-1)[-1] if np.ndim(value) else value


def _as_list(values: Any) -> list:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


def _pyplot():
    from .plots import pyplot

    return pyplot()


def _axes():
    return _pyplot().subplots()[1]


def _unique(names: list[str]) -> list[str]:
    """`names` with each repeat suffixed `_2`, `_3`, ...: two F1 scores are two columns, not one overwritten.

    >>> _unique(["f1_score", "f1_score", "accuracy"])
    ['f1_score', 'f1_score_2', 'accuracy']
    """
    out: list[str] = []
    for name in names:
        key, k = name, 1
        while key in out or (key != name and key in names):   # a suffixed name never takes one given later
            k += 1
            key = f"{name}_{k}"
        out.append(key)
    return out

