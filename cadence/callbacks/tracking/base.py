"""Experiment tracking: the `GeneralTracker` interface every tracker implements, and the run directory.

Your own tracker is a `GeneralTracker` subclass, fed by the `Tracker` callback (tracker.py):

>>> class PrintTracker(GeneralTracker):
...     name = "print"
...     def log(self, values, step): print(step, values)
>>> learn.fit(1, cbs=Tracker(PrintTracker()))
"""

from __future__ import annotations

import importlib
import numbers
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any, Callable


def require_package(module: str, extra: str) -> None:
    """Import `module` or fail with the `pip install` line that provides it."""
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"this tracker needs {module}, which is not installed; "
                          f'install it with: pip install "cadence[{extra}]"') from e


def plain(value: Any) -> Any:
    """`value` as JSON/YAML-safe data: numbers, strings, bools, None, lists and dicts of them; anything else as str."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return str(value)


class GeneralTracker:
    """One experiment-tracking backend. Subclass it and override `log` (and whatever else you need).

    The `Tracker` callback calls, on the main process only: `start(step)` at the start of
    fit, then `store_init_configuration(hparams)`, `log(values, step)` per optimizer step and
    per epoch, and `finish()` at the end of fit. `state_dict()` / `load_state_dict()` carry
    what a resumed run needs (a run id, a directory); after `load_state_dict`, the next
    `start` continues that run instead of opening a new one.

    >>> class ListTracker(GeneralTracker):
    ...     name = "list"
    ...     def __init__(self): super().__init__(); self.rows = []
    ...     def log(self, values, step): self.rows.append((step, values))
    """

    name: str = "general"
    requires: tuple[str, str] | None = None   # (module, cadence extra that installs it), checked at construction
    requires_logging_directory: bool = False   # Accelerate's: whether the tracker writes under a logging directory
    main_process_only: bool = True             # Accelerate's: whether only the main process runs the tracker

    def __init__(self, project: str | None = None, run_name: str | None = None, config: dict | None = None,
                 dir: str | Path | None = None):
        if self.requires is not None:
            require_package(*self.requires)
        self.project, self.run_name, self.dir = project, run_name, dir
        self.config: dict[str, Any] = dict(config or {})
        self._resume: dict[str, Any] | None = None
        self.run_dir: Path | None = None  # set by `Tracker`: the one directory of this run, shared by its trackers

    @property
    def tracker(self) -> Any:
        """What this tracker writes through, as Accelerate's `tracker.tracker` (TensorBoard's `SummaryWriter`,
        the W&B run); a tracker writing its own files returns itself."""
        return self

    def __repr__(self) -> str:
        """Says what to do with a tracker: `cbs=` takes callbacks, and `Tracker` is the one that feeds trackers."""
        cls = type(self).__name__
        own = f" or Tracker({self.name!r})" if type(self).__module__.startswith("cadence.") else ""
        return f"<{cls} {self.name!r}: a tracker, not a callback; in cbs= pass Tracker({cls}(...)){own}>"

    def start(self, step: int) -> None:
        """Open the run; `step` optimizer steps are already done (0, or the resume point)."""

    def store_init_configuration(self, config: dict[str, Any]) -> None:
        """Store the run's hyperparameters."""

    def log(self, values: dict[str, float], step: int) -> None:
        """Record `values` (name -> number) at optimizer step `step`."""
        raise NotImplementedError(f"{type(self).__name__} must define log(values, step)")

    def finish(self) -> None:
        """Close the run (flush files, end the W&B run)."""

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue this one (JSON-serializable)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next `start` continue the run described by `state`."""
        self._resume = dict(state) if state else None

    def _take_resume(self) -> dict[str, Any] | None:
        """The state to resume from, once: the fit after that opens a new run."""
        resume, self._resume = self._resume, None
        return resume

    def _continued_dir(self, saved: Any) -> Path | None:
        """The run directory a checkpoint's tracker state names (`saved`), if this run may continue it; else None,
        with a warning: the caller opens a new run directory.

        A checkpoint's state.json may come from anywhere (a copy, another machine, a hand edit), so a resumed
        tracker writes only where this run's tracker would: inside its log root (`dir`, default `runs`, or the
        `run_dir` it was given), `..` and symbolic links resolved. Outside it, the directory is ignored rather
        than the resume refused: the training goes on, the old logs stay untouched where they are, and the new
        run directory takes nothing from anyone. A checkpoint moved with its logs (a project copied to another
        machine) names its old absolute path: the run directory of that name in this log root
        (`dir/project/<name>`) is continued when it is there.

        >>> CSVTracker(dir="runs")._continued_dir("/etc")        # None, with a warning
        """
        base = Path(self.dir if self.dir is not None else "runs")
        roots, parents = [base.resolve()], [base / (self.project or "")]
        if self.run_dir is not None:
            parents.append(Path(self.run_dir).parent)
            if not Path(self.run_dir).resolve().is_relative_to(roots[0]):
                roots.append(Path(self.run_dir).resolve())

        def inside(path: Path) -> bool:
            return any(path.is_relative_to(root) for root in roots)

        if isinstance(saved, str) and saved:
            path = Path(saved).resolve()
            if inside(path):
                return path
            name = Path(saved).name
            for parent in parents:
                moved = (parent / name).resolve()
                if name not in ("", ".", "..") and moved.is_dir() and inside(moved):
                    return moved
        warnings.warn(f"the checkpoint's state.json names {saved!r} as the {self.name} tracker's run directory "
                      f"(callbacks.tracker.trackers.{self.name}.dir), outside this run's log root "
                      f"({' or '.join(map(str, roots))}): it is left untouched and this run logs into a new run "
                      f"directory. To continue those logs, resume with the tracker's dir= set to a directory holding "
                      f"them", stacklevel=3)
        return None


class FileTracker(GeneralTracker):
    """A tracker writing files into one directory per run: `dir/project/run_name` (`dir` defaults to `runs`).

    A new run never writes into a directory holding another run's `marker` files: it gets a
    `_1`, `_2`, ... suffix. A resumed run reopens the directory in its state when that lies in this run's
    log root (`_continued_dir`), and otherwise opens a new one.
    """

    marker: str = "*"
    requires_logging_directory = True

    def start(self, step: int) -> None:
        resume = self._take_resume()
        continued = self._continued_dir(resume.get("dir")) if resume else None
        self.resumed = continued is not None
        self.log_dir = continued or self.run_dir or new_run_dir(self.dir, self.project, self.run_name,
                                                                lambda path: any(path.glob(self.marker)))
        self.log_dir = self.log_dir.resolve()
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def state_dict(self) -> dict[str, Any]:
        log_dir = getattr(self, "log_dir", None)
        return {"dir": str(log_dir)} if log_dir is not None else {}


def new_run_dir(dir: str | Path | None, project: str | None, run_name: str | None,
                taken: Callable[[Path], bool]) -> Path:
    """`dir/project/run_name` (`dir` defaults to `runs`, the name to the time), with a `_1`, `_2`, ... suffix
    while `taken(path)` says another run already wrote there."""
    root = Path(dir if dir is not None else "runs") / (project or "")
    name = run_name or datetime.now().strftime("%Y%m%d-%H%M%S")
    path, n = root / name, 0
    while taken(path):
        n += 1
        path = root / f"{name}_{n}"
    return path
