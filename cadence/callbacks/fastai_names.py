"""fastai's callback names on cadence's callbacks, with fastai's arguments.

Each is the cadence callback of the same feature, taking fastai's arguments:

>>> learn.fit(5, cbs=[SaveModelCallback(fname="best"), EarlyStoppingCallback(patience=2), CSVLogger(),
...                   GradientAccumulation(n_acc=64), GradientClip(1.0), TensorBoardCallback("runs/tb"),
...                   WandbCallback()])
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from ..trainer.callback import Callback, Order
from ..trainer.recorder import format_time
from .accumulate import GradAccum
from .clip import GradClip
from .early_stop import EarlyStopping, SaveModel, TerminateOnNaN
from .tracking import TensorBoardTracker, Tracker, WandbTracker

__all__ = ["SaveModelCallback", "EarlyStoppingCallback", "GradientAccumulation", "GradientClip", "CSVLogger",
           "TensorBoardCallback", "WandbCallback", "TerminateOnNaNCallback"]


class EarlyStoppingCallback(EarlyStopping):
    """fastai's `EarlyStoppingCallback(monitor, comp, min_delta, patience, reset_on_fit)`: `EarlyStopping`.

    >>> learn.fit(2, cbs=EarlyStoppingCallback(patience=3))
    >>> len(learn.recorder.values)
    2
    """


class TerminateOnNaNCallback(TerminateOnNaN):
    """fastai's `TerminateOnNaNCallback()`: `TerminateOnNaN`, which stops the fit at the first non-finite loss.

    >>> learn.fit(5, cbs=TerminateOnNaNCallback())
    """


class SaveModelCallback(SaveModel):
    """fastai's `SaveModelCallback`: `SaveModel` with fastai's order of arguments.

    That order is `monitor, comp, min_delta, fname, every_epoch, at_end, with_opt, reset_on_fit`.

    >>> learn.fit(2, cbs=SaveModelCallback(fname="epoch", every_epoch=True))
    >>> sorted(p.name for p in (learn.path / learn.model_dir).iterdir())
    ['epoch_0', 'epoch_1']
    """

    def __init__(self, monitor: str = "valid_loss", comp: Callable | None = None, min_delta: float = 0.0,
                 fname: str = "model", every_epoch: bool | int = False, at_end: bool = False, with_opt: bool = False,
                 reset_on_fit: bool = True, mode: str | None = None):
        super().__init__(monitor, mode=mode, fname=fname, every_epoch=every_epoch, with_opt=with_opt, at_end=at_end,
                         min_delta=min_delta, reset_on_fit=reset_on_fit, comp=comp)


class GradientAccumulation(GradAccum):
    """fastai's `GradientAccumulation(n_acc=32)`: one optimizer step per `n_acc` samples.

    It is `GradAccum(samples=n_acc)`: a partial window at an epoch's end is stepped (see docs/fastai.md).

    >>> GradientAccumulation(n_acc=64).samples       # learn.fit(1, cbs=...): batches of 16, a step every 4
    64
    """

    def __init__(self, n_acc: int = 32):
        super().__init__(samples=n_acc)


class GradientClip(GradClip):
    """fastai's `GradientClip(max_norm=1.0, norm_type=2.0)`: clip the gradients' global norm (`GradClip`).

    >>> learn.fit(1, cbs=GradientClip(0.5))
    """

    def __init__(self, max_norm: float = 1.0, norm_type: float = 2.0):
        super().__init__(max_norm=max_norm, norm_type=norm_type)


class TensorBoardCallback(Tracker):
    """fastai's `TensorBoardCallback(log_dir)`: the `Tracker`'s scalars in TensorBoard event files.

    They go to `log_dir` (default: `runs/<time>`). Scalars only: `trace_model`, `log_preds` and `projector`
    are refused.

    >>> learn.fit(3, cbs=TensorBoardCallback("runs/baseline"))     # tensorboard --logdir runs
    """

    def __init__(self, log_dir: str | os.PathLike | None = None, trace_model: bool = False, log_preds: bool = False,
                 projector: bool = False):
        asked = [n for n, v in (("trace_model", trace_model), ("log_preds", log_preds), ("projector", projector)) if v]
        if asked:
            raise ValueError(f"TensorBoardCallback({asked[0]}=True): cadence's TensorBoard logging writes scalars "
                             f"(losses, lr, metrics) only; drop {', '.join(asked)}")
        tracker = TensorBoardTracker()
        if log_dir is not None:
            tracker.run_dir = Path(log_dir)
        super().__init__(tracker)


class _RunTracker(WandbTracker):
    """`WandbCallback`'s W&B tracker: logs into the run `wandb.init()` opened, as fastai's does; else opens its own
    (`wandb.init(dir=$WANDB_DIR)` by W&B's defaults) and finishes it with the fit. A run it did not open stays open."""

    def start(self, step: int) -> None:
        import wandb

        self.owned = wandb.run is None
        if self.owned:
            super().start(step)
        else:
            self._take_resume()   # the user's run is the run: nothing of a checkpoint's to reopen
            self.run, self.run_id = wandb.run, wandb.run.id

    def finish(self) -> None:
        if getattr(self, "owned", True):
            super().finish()
        self.run = None


_WATCH = ("gradients", "parameters", "all", None)


class WandbCallback(Tracker):
    """fastai's `WandbCallback(log=None, ...)`: losses, learning rate and metrics to a W&B run (`Tracker("wandb")`).

    As fastai's, it logs into the run `wandb.init(project=...)` opened (and leaves it open); without one it
    opens a run with W&B's defaults (files under `$WANDB_DIR`, else `./wandb`) and finishes it at the end of
    fit. The keys are cadence's tracker's (`train/loss`, `train/lr`, `valid/loss`, `valid/<metric>`, counted
    in optimizer steps), the learner's hyperparameters go to `run.config`; main process only, `lr_find` not
    logged. `log="gradients"`, `"parameters"` or `"all"` is `run.watch(learn.model, log=log)` for the fit.
    Prediction samples, model and dataset artifacts are not logged: `log_preds`, `log_preds_every_epoch`,
    `log_model`, `log_dataset`, `model_name`, `dataset_name` and `valid_dl` are refused (`n_preds`, `seed` and
    `reorder` only tune those samples, and are ignored).

    >>> import wandb
    >>> run = wandb.init(project="digits", mode="offline")   # as in fastai: open the run (offline: no account)
    >>> learn.fit(1, cbs=WandbCallback())
    >>> wandb.run is run                                      # logged into it, and left it open
    True
    >>> run.finish()
    """

    def __init__(self, log: str | None = None, log_preds: bool = False, log_preds_every_epoch: bool = False,
                 log_model: bool = False, model_name: str | None = None, log_dataset: bool | str | os.PathLike = False,
                 dataset_name: str | None = None, valid_dl: Any = None, n_preds: int = 36, seed: int = 12345,
                 reorder: bool = True):
        if log not in _WATCH:
            raise ValueError(f"WandbCallback(log={log!r}): use one of {_WATCH} (what run.watch logs of the model)")
        asked = [n for n, v in (("log_preds", log_preds), ("log_preds_every_epoch", log_preds_every_epoch),
                                ("log_model", log_model), ("model_name", model_name), ("log_dataset", log_dataset),
                                ("dataset_name", dataset_name), ("valid_dl", valid_dl))
                 if v is not None and v is not False]
        if asked:
            raise ValueError(f"WandbCallback({asked[0]}=...): cadence's W&B logging writes the losses, learning rate "
                             f"and metrics only, no prediction samples, model or dataset artifacts; drop "
                             f"{', '.join(asked)} (log artifacts yourself with wandb.Artifact and run.log_artifact)")
        super().__init__(_RunTracker())
        self.watch_log, self.n_preds, self.seed, self.reorder = log, n_preds, seed, reorder
        self._watched: Any = None

    def before_fit(self):
        super().before_fit()
        if self.active and self.watch_log is not None:
            self._watched = self.learn.model
            self.trackers[0].run.watch(self._watched, log=self.watch_log)

    def after_fit(self):
        run = self.trackers[0].run
        if self._watched is not None and run is not None:
            run.unwatch(self._watched)   # no hooks left on the model, logging into a run that may be finished
        self._watched = None
        super().after_fit()

    def __repr__(self) -> str:
        return f"WandbCallback(log={self.watch_log!r})"


class CSVLogger(Callback):
    """fastai's `CSVLogger(fname="history.csv", append=False)`: each epoch's results as a row of a CSV file.

    The file is `learn.path/fname`, its header `recorder.metric_names` (epoch, train_loss, valid_loss,
    metrics, time); the main process writes each row through at once. `append=True` adds to the file (a
    header line before each fit's rows, as fastai). `read_log()` reads it with pandas.

    >>> learn.fit(2, cbs=CSVLogger())
    >>> (learn.path / "history.csv").read_text().splitlines()[0]
    'epoch,train_loss,valid_loss,accuracy,time'
    """

    order = Order.REPORT
    run_lr_find = False

    def __init__(self, fname: str | os.PathLike = "history.csv", append: bool = False):
        self.fname, self.append = Path(fname), append
        self.file: Any = None

    @property
    def path(self) -> Path:
        return self.learn.path / self.fname

    def read_log(self) -> Any:
        """The file as a pandas DataFrame (pandas is not a cadence dependency: `pip install pandas`)."""
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError(f"read_log needs pandas (pip install pandas); or read {self.path} with the csv "
                              f"module") from e
        return pd.read_csv(self.path)

    def before_fit(self):
        if not self.learn.strategy.is_main:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = self.path.open("a" if self.append else "w")
        self._write(self.learn.recorder.metric_names)
        # a resumed run's Recorder holds the epochs before the interruption: a new file gets them again (an appended
        # one has them)
        self._written = len(self.learn.recorder.values) if self.append else 0
        self._write_rows()

    def before_epoch(self):
        self._write_rows()

    def _write_rows(self) -> None:
        """The rows recorded and not written yet, each cell under its column: a resumed run's earlier epochs, those
        `fit(start_epoch=)` skipped (their epoch and time: fastai's `0,00:00`, here the time under `time`), the
        epoch just ended (a cancelled one's, `[]` in fastai, blank but for its epoch and time)."""
        if self.file is not None:
            recorder = self.learn.recorder
            for row in recorder.values[self._written:]:
                cells = {**row.as_dict(), **({"time": format_time(row["time"])} if "time" in row.keys() else {})}
                self._write(["" if cells.get(name) is None else cells[name] for name in recorder.metric_names])
            self._written = len(recorder.values)

    def after_epoch(self):
        self._write_rows()

    def after_fit(self):
        if self.file is not None:
            self.file.close()
            self.file = None

    def _write(self, values: list) -> None:
        self.file.write(",".join(str(v) for v in values) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())
