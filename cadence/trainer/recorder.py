"""Recorder: what happened during training, per optimizer step and per epoch.

Always attached as `learn.recorder`.

>>> learn.fit(2)
>>> learn.recorder.values[-1]      # {'epoch': 1, 'train_loss': ..., 'valid_loss': ..., 'accuracy': ..., 'time': ...}
>>> learn.recorder.losses[:3], learn.recorder.lrs[:3]     # per training batch
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from .callback import Callback, Order
from .metrics import AvgLoss, Metric, as_metric, batch_size


class Recorder(Callback):
    """Records per-batch training loss and lr, and per-epoch train loss, valid loss, metrics and time.

    Metrics are computed on the validation set. Loss and metric state are combined over
    processes with `learn.strategy.all_sum` / `gather` before values are read (the identity
    on one process).
    """

    order = Order.RECORD

    def __init__(self, metrics: list[Any] | None = None):
        self.metrics: list[Metric] = [as_metric(m) for m in (metrics or [])]
        self.train_loss, self.valid_loss = AvgLoss("train_loss"), AvgLoss("valid_loss")
        self.values: list[dict[str, float | None]] = []
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self._batch_losses: list[torch.Tensor | float] = []  # floats on the CPU, tensors on an accelerator
        self._float_losses = True
        self._batch_sizes: list[int] = []
        self._resumed = False
        self._as_tensor = {key: _GrowingTensor() for key in ("losses", "lrs", "epoch_losses", "epoch_sizes")}
        self.hps: dict[str, list] = {}  # per batch, the values a ParamScheduler set (plot_sched)

    @property
    def metric_names(self) -> list[str]:
        """Columns of one epoch's results, in order."""
        return ["epoch", "train_loss", "valid_loss", *(m.name for m in self.metrics), "time"]

    def _on_cpu(self) -> bool:
        return self.learn.strategy.device.type == "cpu"

    def before_fit(self):
        # On an accelerator a batch loss stays a tensor (reading it would wait for the device). On the
        # CPU reading it costs nothing, and a float is cheaper to keep than thousands of small tensors.
        self._float_losses = self._on_cpu()
        if self._resumed:  # load_state_dict restored the history of the interrupted run
            return
        self.losses, self.lrs, self.values = [], [], []
        self._batch_losses, self._batch_sizes = [], []

    def before_epoch(self):
        self.start_time = time.perf_counter()
        self.train_loss.reset()
        if not self._resumed:  # a resumed epoch keeps the losses of its first part
            self._batch_losses, self._batch_sizes = [], []
        self._resumed = False

    def state_dict(self) -> dict[str, Any]:
        """History so far, and the current epoch's batch losses (a checkpoint may fall mid-epoch).

        The per-batch lists are float64 tensors (a checkpoint keeps them out of its JSON), each
        extended by the batches since the last call: a checkpoint's cost does not grow with the run.
        """
        t = self._as_tensor
        return {"values": self.values, "losses": t["losses"](self.losses), "lrs": t["lrs"](self.lrs),
                "epoch_losses": t["epoch_losses"](self._batch_losses),
                "epoch_sizes": t["epoch_sizes"](self._batch_sizes)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` (lists, as checkpoints of format 1 hold them, load too)."""
        self.values, self.losses, self.lrs = state["values"], _as_list(state["losses"]), _as_list(state["lrs"])
        losses = _as_list(state["epoch_losses"])
        device = self.learn.strategy.device
        self._batch_losses = losses if self._on_cpu() else [torch.tensor(x, device=device) for x in losses]
        self._batch_sizes = [int(n) for n in _as_list(state["epoch_sizes"])]
        self._resumed = True

    def before_validate(self):
        self.valid_loss.reset()
        for m in self.metrics:
            m.reset()

    def after_batch(self):
        learn = self.learn
        loss = learn._loss  # what `learn.loss` holds, maybe not yet detached: item() needs no detach
        if loss is None:  # batch cancelled before its loss
            return
        if learn.training:
            b = learn.yb or learn.xb
            first = b[0] if type(b) is tuple else b  # xb is a dict for dict batches without targets
            self._batch_losses.append(loss.item() if self._float_losses else loss.detach())
            self._batch_sizes.append(first.shape[0] if type(first) is torch.Tensor else batch_size(first))
            self.lrs.append(learn.opt.param_groups[-1]["lr"])
        elif learn.yb:
            self.valid_loss.accumulate(learn)
            for m in self.metrics:
                m.accumulate(learn)

    def after_train(self):
        """Turn the epoch's batch losses into `losses` and the size-weighted train loss."""
        if not self._batch_losses:
            return
        losses = self._flush_losses()
        sizes = torch.tensor(self._batch_sizes, dtype=torch.float64, device=losses.device)
        self.train_loss.sums = torch.stack([(losses * sizes).sum(), sizes.sum()])
        self.train_loss.sync(self.learn.strategy.all_sum, self.learn.strategy.gather)
        self._batch_sizes = []

    def _flush_losses(self) -> torch.Tensor:
        """Move the batch losses not yet in `losses` there (one per entry of `lrs`); returns them as float64."""
        losses = (torch.tensor(self._batch_losses, dtype=torch.float64) if self._float_losses
                  else torch.stack(self._batch_losses).double())
        self.losses.extend(losses.float().cpu().tolist())
        self._batch_losses = []
        return losses

    def after_cancel_epoch(self):
        """An epoch cancelled mid-training skips after_train: keep its batch losses all the same."""
        if self._batch_losses:
            self._flush_losses()

    after_cancel_fit = after_cancel_epoch  # lr_find, TerminateOnNaN: `losses` and `lrs` keep the same length

    def after_validate(self):
        strategy = self.learn.strategy
        for m in (self.valid_loss, *self.metrics):
            m.sync(strategy.all_sum, strategy.gather)

    def after_epoch(self):
        row = {"epoch": self.learn.epoch, "train_loss": self.train_loss.value, **self.valid_values(),
               "time": time.perf_counter() - self.start_time}
        self.values.append(row)

    def valid_values(self) -> dict[str, float | None]:
        """valid_loss and every metric of the last validation pass."""
        if self.learn.dls.valid is None:
            return {}
        return {"valid_loss": self.valid_loss.value, **{m.name: m.value for m in self.metrics}}

    def plot_loss(self, skip_start: int = 5, with_valid: bool = True):
        """Training loss per batch and validation loss per epoch (needs matplotlib).

        >>> learn.recorder.plot_loss()
        """
        ax = _axes()
        ax.plot(range(skip_start, len(self.losses)), self.losses[skip_start:], label="train")
        per_epoch = len(self.losses) / max(len(self.values), 1)
        valid = [(per_epoch * (i + 1), v["valid_loss"]) for i, v in enumerate(self.values) if v.get("valid_loss") is not None]
        if with_valid and valid:
            ax.plot(*zip(*valid), label="valid")
        ax.set(xlabel="batch", ylabel="loss")
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
        keys = list(self.hps) if keys is None else keys
        if not keys:
            raise ValueError("no schedule recorded: plot_sched shows what a ParamScheduler set "
                             "(fit_one_cycle, fit_flat_cos, fit_sgdr or fit(cbs=ParamScheduler(...)))")
        fig, axs = _pyplot().subplots(1, len(keys), figsize=(4 * len(keys), 3), squeeze=False)
        for ax, key in zip(axs[0], keys):
            ax.plot([float(np.asarray(v).reshape(-1)[-1]) for v in self.hps[key]])
            ax.set(xlabel="batch", ylabel=key)
        return fig


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


def _as_list(values: Any) -> list:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


def _pyplot():
    from .plots import pyplot

    return pyplot()


def _axes():
    return _pyplot().subplots()[1]
