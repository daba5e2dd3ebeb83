"""WandbTracker: a Weights & Biases run (online, or offline with `WANDB_MODE=offline`).

>>> learn.fit(3, cbs=Tracker("wandb", project="digits", config={"arch": "mlp"}))
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .base import GeneralTracker


class WandbTracker(GeneralTracker):
    """Log to a W&B run: `wandb.init(project=, name=, dir=, **init_kwargs)` at the start of fit.

    W&B's local files (its `wandb/` folder) go, first match wins: under the `dir` given to this tracker
    (given to `Tracker(..., dir=)`: that run's directory `dir/project/run_name`); else under `$WANDB_DIR`, as
    `wandb.init` and Accelerate do; else under the `Tracker`'s run directory (`runs/project/run_name`), or
    the working directory for a tracker used on its own. The state holds the run id: a resumed fit reopens
    that run (`resume="allow"`), its local files in the directory of the state when that lies in this run's
    log root (`GeneralTracker._continued_dir`).

    >>> learn.fit(1, cbs=Tracker(WandbTracker(project="digits", entity="my-team", tags=["baseline"])))
    """

    name = "wandb"
    requires = ("wandb", "wandb")
    main_process_only = False   # Accelerate's value: its methods need no main-process check (the run is opened there)

    def __init__(self, project: str | None = None, run_name: str | None = None, config: dict | None = None,
                 dir: str | Path | None = None, **init_kwargs: Any):
        super().__init__(project, run_name, config, dir)
        self.init_kwargs, self.run, self.run_id, self.run_dir = init_kwargs, None, None, None

    @property
    def tracker(self) -> Any:
        """The W&B run (None before `start` and after `finish`), as Accelerate's tracker gives it."""
        return self.run

    def start(self, step: int) -> None:
        import wandb

        resume = self._take_resume()
        kwargs = dict(project=self.project, name=self.run_name, **self.init_kwargs)
        wandb_dir = os.environ.get("WANDB_DIR") if self.dir is None else None   # an explicit dir wins
        own_dir = wandb_dir or (self.run_dir if self.run_dir is not None else self.dir)
        continued = self._continued_dir(resume["dir"]) if resume and resume.get("dir") is not None else None
        run_dir = str(continued) if continued else str(Path(own_dir).resolve()) if own_dir is not None else None
        if run_dir is not None:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            kwargs["dir"] = run_dir   # $WANDB_DIR too: W&B reads it once per process, this reads it per run
        if resume:
            kwargs.update(id=resume["id"], resume="allow")
        self.run = wandb.init(**kwargs)
        # $WANDB_DIR is not recorded: a resumed run goes where $WANDB_DIR then says, not checked against a log root
        self.run_id, self.run_dir = self.run.id, None if wandb_dir and not continued else run_dir

    def store_init_configuration(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None

    def state_dict(self) -> dict[str, Any]:
        """The run id (and the directory W&B writes to), so a resumed fit continues the same run."""
        return {"id": self.run_id, "dir": self.run_dir} if self.run_id is not None else {}
