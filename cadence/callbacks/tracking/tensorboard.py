"""TensorBoardTracker: scalars in TensorBoard event files, one directory per run.

>>> learn.fit(3, cbs=Tracker("tensorboard", dir="runs", project="digits"))   # tensorboard --logdir runs
"""

from __future__ import annotations

import json
import numbers
import warnings
from typing import Any

import numpy as np
import torch

from .base import FileTracker


class TensorBoardTracker(FileTracker):
    """Write scalars with `torch.utils.tensorboard.SummaryWriter` into `dir/project/run_name`.

    Hyperparameters are stored as JSON text under the tag `hparams`. A resumed run appends to
    the same directory and hides events logged after the resume point (a crashed run's tail),
    so every step appears once.

    >>> learn.fit(1, cbs=Tracker(TensorBoardTracker(run_name="baseline", dir="runs")))
    """

    name = "tensorboard"
    marker = "events.out.tfevents.*"
    requires = ("tensorboard", "tensorboard")
    writer = None

    @property
    def tracker(self) -> Any:
        """The `SummaryWriter` (None before `start` and after `finish`), as Accelerate's tracker gives it."""
        return self.writer

    def start(self, step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        super().start(step)
        self.step0 = step
        # events at steps above the resume point came from after the checkpoint: purge them
        self.writer = SummaryWriter(str(self.log_dir), purge_step=step + 1 if self.resumed else None)

    def store_init_configuration(self, config: dict[str, Any]) -> None:
        text = json.dumps(config, indent=2, sort_keys=True)
        self.writer.add_text("hparams", f"```\n{text}\n```", global_step=self.step0)

    def log(self, values: dict[str, Any], step: int) -> None:
        """Numbers (and one-element tensors or arrays) as scalars; as Accelerate's tracker does, text as text and a
        dict of numbers as one chart. A value that is none of these (a vector, a list, None) is skipped, with one
        warning per tag: the run goes on.

        >>> tracker.log({"loss": 0.5, "acc": torch.tensor(0.9), "vec": torch.ones(3)}, step=1)   # warns of 'vec'
        """
        for tag, value in values.items():
            if isinstance(value, str):
                self.writer.add_text(tag, value, global_step=step)
            elif isinstance(value, dict):
                scalars = {k: _scalar(v) for k, v in value.items()}
                for k in (k for k, v in scalars.items() if v is None):
                    self._skip(f"{tag}/{k}", value[k])
                if any(v is not None for v in scalars.values()):
                    self.writer.add_scalars(tag, {k: v for k, v in scalars.items() if v is not None}, global_step=step)
            elif (scalar := _scalar(value)) is not None:
                self.writer.add_scalar(tag, scalar, global_step=step)
            else:
                self._skip(tag, value)

    def _skip(self, tag: str, value: Any) -> None:
        warned = vars(self).setdefault("_warned", set())
        if tag not in warned:
            warned.add(tag)
            warnings.warn(f"TensorBoardTracker: {tag!r} is not logged: TensorBoard takes numbers, one-element "
                          f"tensors, text or dicts of numbers, got {_describe(value)}", stacklevel=5)

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def state_dict(self) -> dict[str, Any]:
        """The run's directory; flushes first, so a checkpoint never points past what is on disk."""
        if self.writer is not None:
            self.writer.flush()
        return super().state_dict()


def _scalar(value: Any) -> float | None:
    """`value` as a number TensorBoard logs, or None: a real number, or a real tensor or array of one element."""
    if isinstance(value, numbers.Real):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return value.item()
    if isinstance(value, np.ndarray) and value.size == 1 and np.isrealobj(value):
        return value.item()
    return None


def _describe(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"{type(value).__name__} of shape {tuple(shape)}" if shape is not None else repr(value)[:80]
