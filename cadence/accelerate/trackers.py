"""`Accelerator.init_trackers` / `log` / `end_training` on cadence's trackers (TensorBoard, W&B, CSV, your own).

Runs open and write on the main process only; elsewhere every call does nothing.

>>> accelerator = Accelerator(log_with=["tensorboard", "csv"], project_dir="runs")  # or "all": every installed one
>>> accelerator.init_trackers("digits", config={"lr": 1e-3})
>>> accelerator.log({"train/loss": loss.item()}, step=step)
>>> accelerator.end_training()
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..callbacks.tracking.base import GeneralTracker, new_run_dir, plain
from ..callbacks.tracking.tracker import check_tracker_kinds, make_tracker, tracker_kinds

__all__ = ["TrackerSet"]


class _NoTracker(GeneralTracker):
    """What `get_tracker` returns off the main process: every call does nothing."""

    name = "none"

    def log(self, values: dict[str, float], step: int) -> None:
        """Nothing to log off the main process."""


class TrackerSet:
    """The trackers named by `log_with`, opened by `init` on the main process: `accelerator.trackers`, which
    reads as Accelerate's list of trackers (index, iterate, `len`; empty before `init_trackers` and elsewhere
    than on the main process).

    >>> accelerator.init_trackers("digits")
    >>> accelerator.trackers[0].name, len(accelerator.trackers)
    ('tensorboard', 1)
    """

    def __init__(self, log_with: Any, logging_dir: str | None):
        self.kinds = tracker_kinds(log_with)
        check_tracker_kinds(self.kinds)
        self.logging_dir = logging_dir
        self.trackers: list[GeneralTracker] = []
        self.next_step = 0

    def init(self, project_name: str, config: dict | None, init_kwargs: dict[str, dict], is_main: bool) -> None:
        if not self.kinds:
            raise ValueError("init_trackers needs trackers: Accelerator(log_with=['tensorboard', 'csv', ...])")
        if config is not None and not isinstance(config, dict):
            raise TypeError(f"config must be a dict of hyperparameters, got {type(config).__name__}")
        if not is_main:
            return
        # trackers named here write into one run directory, as the Tracker callback's do
        shared = new_run_dir(self.logging_dir, project_name, None, lambda path: path.exists() and any(path.iterdir()))
        for kind in self.kinds:
            options = init_kwargs.get(getattr(kind, "name", kind), {})
            tracker = make_tracker(kind, project_name, options.get("run_name"), dict(config or {}), self.logging_dir)
            if not isinstance(kind, GeneralTracker):
                if not tracker.requires_logging_directory:   # W&B: its own place ($WANDB_DIR) first, as Accelerate's;
                    tracker.dir = None                       # project_dir is no explicit `dir` that would override it
                if not options.get("run_name"):
                    tracker.run_dir = shared
            tracker.start(0)
            if config:
                tracker.store_init_configuration(plain(config))
            self.trackers.append(tracker)

    def log(self, values: dict[str, Any], step: int | None) -> None:
        step = self.next_step if step is None else step
        self.next_step = step + 1
        # one-element tensors as numbers; each tracker skips (with a warning) what it cannot log
        numbers = {k: v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v for k, v in values.items()}
        for tracker in self.trackers:
            tracker.log(numbers, step)

    def __iter__(self) -> Iterator[GeneralTracker]:
        """The open trackers, as Accelerate's `accelerator.trackers` list (`for t in accelerator.trackers: t.name`)."""
        return iter(self.trackers)

    def __len__(self) -> int:
        return len(self.trackers)

    def __getitem__(self, index: int | slice) -> GeneralTracker | list[GeneralTracker]:
        return self.trackers[index]

    def __repr__(self) -> str:
        return repr(self.trackers)

    def get(self, name: str, unwrap: bool) -> Any:
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        if self.trackers:
            raise ValueError(f"no tracker named {name!r}; the trackers are {[t.name for t in self.trackers]}")
        return _NoTracker()

    def finish(self) -> None:
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
