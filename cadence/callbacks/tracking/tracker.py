"""The `Tracker` callback: feeds TensorBoard, W&B, CSV or your own `GeneralTracker`, chosen by name.

One run per job, opened and written by the main process only. Steps are optimizer steps
(`learn.step`), so the numbering does not change with world size or gradient accumulation,
and a resumed run (the Tracker's `state_dict` restored by Checkpoint) continues it.

>>> learn = Learner(dls, model, loss_func=F.cross_entropy, metrics=accuracy,
...                 cbs=Tracker(["tensorboard", "csv"], project="digits", config={"arch": "mlp"}))
>>> learn.fit(3, lr=1e-2)       # runs/digits/<time>/: events.out.tfevents.*, metrics.csv, hparams.yaml
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any

from ...trainer.callback import Callback, Order
from ...trainer.metrics import batch_size
from .base import GeneralTracker, new_run_dir, plain
from .csv import CSVTracker
from .tensorboard import TensorBoardTracker
from .wandb import WandbTracker


def _named_trackers() -> dict[str, type[GeneralTracker]]:
    return {cls.name: cls for cls in (TensorBoardTracker, WandbTracker, CSVTracker)}


# the package each named tracker writes through; "all" means the named trackers whose package is installed
_TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "csv": None}


def tracker_kinds(kinds: Any) -> list[Any]:
    """`kinds` as a list, names for Accelerate's `LoggerType`s, "all" (`log_with="all"`) replaced by every installed
    named tracker.

    >>> tracker_kinds("all")      # with tensorboard installed, wandb not
    ['tensorboard', 'csv']
    """
    import importlib.util

    kinds = [] if kinds is None else list(kinds) if isinstance(kinds, (list, tuple)) else [kinds]
    kinds = [k.value if isinstance(k, enum.Enum) else k for k in kinds]   # Accelerate's LoggerType members
    if "all" not in kinds:
        return kinds
    installed = [n for n, pkg in _TRACKER_PACKAGES.items() if pkg is None or importlib.util.find_spec(pkg) is not None]
    expanded = [k for k in kinds if k != "all"]
    return expanded + [n for n in installed if n not in expanded]


def _named_tracker_class(kind: Any) -> type[GeneralTracker] | None:
    """The class a tracker name stands for; None for a `GeneralTracker` instance; an error for anything else."""
    if isinstance(kind, GeneralTracker):
        return None
    if isinstance(kind, type) and issubclass(kind, GeneralTracker):
        raise TypeError(f"pass an instance, e.g. Tracker({kind.__name__}(...)), not the class {kind.__name__}")
    kinds = _named_trackers()
    if kind not in kinds:
        raise ValueError(f"unknown tracker {kind!r}; use one of {sorted(kinds)}, 'all' or a GeneralTracker instance")
    return kinds[kind]


def make_tracker(kind: Any, project: str | None, run_name: str | None, config: dict, dir: str | Path | None):
    cls = _named_tracker_class(kind)
    return kind if cls is None else cls(project=project, run_name=run_name, config=config, dir=dir)


def check_tracker_kinds(kinds: list[Any]) -> None:
    """Refuse an unknown tracker name now, before any run starts, naming the ones there are."""
    for kind in kinds:
        _named_tracker_class(kind)


class Tracker(Callback):
    """Log training to TensorBoard, W&B, a CSV file, or your own `GeneralTracker`s.

    Args:
        kinds: "tensorboard", "wandb", "csv", a `GeneralTracker` instance, or a list of these;
            "all": every one of the named trackers whose package is installed.
        project, run_name, config, dir: given to the trackers built from names. `config` (a dict)
            is stored with what the learner knows: n_epoch, lr, batch_size, optimizer, world_size.

    The trackers built from names write into one directory per run, `dir/project/run_name`
    (`dir` defaults to `runs`, `run_name` to the start time): event files, `metrics.csv`,
    `hparams.yaml` and W&B's `wandb/` side by side. W&B's files go under `$WANDB_DIR` instead when
    that is set and `dir` is not (as `wandb.init` and Accelerate do). `lr` in the stored
    hyperparameters is the peak rate of the fit's schedule (`lr_max` of `fit_one_cycle`).

    Logged per optimizer step: `train/loss` (mean loss of the step's micro-batches on the main
    process), `train/lr` (last parameter group), `train/grad_norm` (when a callback sets
    `learn.grad_norm`). Per epoch, at the epoch's last step: `train/epoch_loss`, `valid/loss`,
    `valid/<metric>` as the Recorder combined them over processes. Other processes log
    nothing, and `lr_find` is not tracked.

    >>> learn.fit(3, cbs=Tracker(["tensorboard", "wandb"], project="digits", config={"arch": "resnet18"}))
    """

    order = Order.REPORT
    run_lr_find = False  # the sweep is thrown away: nothing of it is logged
    run_valid = False

    def __init__(self, kinds: Any, project: str | None = None, run_name: str | None = None,
                 config: dict[str, Any] | None = None, dir: str | Path | None = None):
        if config is not None and not isinstance(config, dict):
            raise TypeError(f"config must be a dict of hyperparameters, got {type(config).__name__}")
        kinds = tracker_kinds(kinds)
        if not kinds:
            raise ValueError('Tracker needs at least one tracker, e.g. Tracker("tensorboard")')
        self.config = dict(config or {})
        self.trackers: list[GeneralTracker] = [make_tracker(k, project, run_name, self.config, dir) for k in kinds]
        # trackers built here from a name write into one directory per run; instances keep their own settings
        self._named = [t for k, t in zip(kinds, self.trackers) if not isinstance(k, GeneralTracker)]
        self.project, self.run_name, self.dir = project, run_name, dir
        names = [t.name for t in self.trackers]
        if len(set(names)) != len(names):
            raise ValueError(f"two trackers share a name in {names}; give each GeneralTracker subclass its own `name`")
        self.active, self._last_step = False, 0
        self._loss_sum, self._loss_n = None, 0

    def before_fit(self):
        self.active = self.learn.strategy.is_main
        if not self.active:
            return
        learn = self.learn
        self._last_step, self._loss_sum, self._loss_n = learn.step, None, 0
        hparams = {"n_epoch": learn.n_epoch, "lr": learn.opt.param_groups[-1]["lr"],
                   "batch_size": getattr(learn.dls.train, "batch_size", None), "optimizer": type(learn.opt).__name__,
                   "world_size": learn.strategy.dp_size, **self.config}
        shared = new_run_dir(self.dir, self.project, self.run_name, lambda path: path.exists() and any(path.iterdir()))
        for t in self._named:
            t.run_dir = shared
        for t in self.trackers:
            t.start(learn.step)
            t.store_init_configuration(plain({**hparams, **t.config}))

    def after_step(self):
        """Sum the micro-batch losses; log once the optimizer step was really taken."""
        if not self.active:
            return
        learn, loss = self.learn, self.learn.loss
        if loss is not None:
            n = batch_size(learn.yb or learn.xb)
            loss = loss.double() * n
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
            self._loss_n += n
        if learn.step == self._last_step:
            return
        self._last_step = learn.step
        values = {"train/lr": float(learn.opt.param_groups[-1]["lr"])}
        if self._loss_sum is not None:
            values["train/loss"] = (self._loss_sum / self._loss_n).item()
        grad_norm = getattr(learn, "grad_norm", None)
        if grad_norm is not None:
            values["train/grad_norm"] = float(grad_norm)
        self._loss_sum, self._loss_n = None, 0
        self._log(values)

    def after_epoch(self):
        if not self.active or not self.learn.recorder.values:
            return
        row = self.learn.recorder.values[-1]
        values = {"train/epoch_loss": row.get("train_loss"), "valid/loss": row.get("valid_loss"),
                  # Recorder(train_metrics=True) names the columns train_<metric> and valid_<metric>
                  **{f"valid/{k}": row.get(k, row.get(f"valid_{k}")) for k in self.learn.recorder.metric_keys},
                  **{f"train/{k}": row.get(f"train_{k}") for k in self.learn.recorder.metric_keys}}
        self._log({k: float(v) for k, v in values.items() if v is not None})

    def after_fit(self):
        if not self.active:
            return
        self.active = False
        for t in self.trackers:
            t.finish()

    def _log(self, values: dict[str, float]) -> None:
        if values:
            for t in self.trackers:
                t.log(values, self.learn.step)

    def state_dict(self) -> dict[str, Any]:
        """Per tracker (by name), what a resumed run needs; Checkpoint saves it."""
        return {"trackers": {t.name: t.state_dict() for t in self.trackers}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next fit continue the runs in `state` (same directories, same W&B run id)."""
        states = state.get("trackers", {})
        for t in self.trackers:
            if states.get(t.name):
                t.load_state_dict(states[t.name])

    def __repr__(self) -> str:
        return f"Tracker({[t.name for t in self.trackers]})"
