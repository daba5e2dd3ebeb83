"""TensorBoardTracker: scalars in TensorBoard event files, one directory per run.

>>> learn.fit(3, cbs=Tracker("tensorboard", dir="runs", project="digits"))   # tensorboard --logdir runs
"""

from __future__ import annotations

import json
from typing import Any

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
        """Numbers as scalars; as Accelerate's tracker does, text as text and a dict of numbers as one chart."""
        for tag, value in values.items():
            if isinstance(value, str):
                self.writer.add_text(tag, value, global_step=step)
            elif isinstance(value, dict):
                self.writer.add_scalars(tag, value, global_step=step)
            else:
                self.writer.add_scalar(tag, value, global_step=step)

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def state_dict(self) -> dict[str, Any]:
        """The run's directory; flushes first, so a checkpoint never points past what is on disk."""
        if self.writer is not None:
            self.writer.flush()
        return super().state_dict()
