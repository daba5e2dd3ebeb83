"""The Checkpoint callback: when to save, which checkpoints to keep, how a fit resumes, preemption.

>>> learn.fit(10, cbs=Checkpoint(every_n_steps=200, keep_last=3), resume="auto")
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from ...disk import check_writable
from ...distributed.ops import main_print
from ...distributed.staging import HostBuffers, Staging
from ...distributed.status import record_preempted
from ...trainer.callback import Callback, Order
from .lock import DirectoryLock
from .memory import PeakMemory
from .preemption import DEFAULT_SIGNALS, PreemptionWatch, parse_signals
from .state import load_state, make_resumable, read_state, stage_state
from .store import BEST, LATEST, STATE_FILE, CheckpointStore, resolve
from .validate import check_checkpoint_state
from .writer import BackgroundWrite, in_background

AUTO = "auto"


class Checkpoint(Callback):
    """Save checkpoints during `fit`: every `every_n_steps` optimizer steps and/or after every epoch.

    Checkpoints go to `dir` (relative to `learn.path`) as `step-<step>/`. The directory is checked
    writable and locked for the whole fit before anything runs: a second job on it is refused,
    naming the first. `keep_last` keeps the newest n that this run wrote in `dir` (the best one by
    `monitor` and the one `latest` names are never deleted; checkpoints another run wrote, and
    those of a run resumed from another directory, are never touched). `monitor` (a Recorder column such
    as "valid_loss" or "accuracy", with `mode` "min"/"max") points `best` at the best epoch.
    `fit(..., resume="auto")` continues from `latest` when there is one and starts fresh
    otherwise; "latest" requires one; a name or path picks one.

    `preempt_on` (default SIGTERM and SIGUSR1; None for none): on such a signal every rank saves
    at the next optimizer step and the process exits with 128 + the signal (143 for SIGTERM), the
    status a scheduler requeues on; the same command with `resume="auto"` then continues.

    `async_save=True`: the saving step takes the small state (buffers, RNG, callbacks, position) and
    training goes on; a thread of every rank copies the parameters and optimizer state to host memory
    (kept for the fit, reserved at its first step) while the next step's forward and backward run (the
    loop waits for that copy before the optimizer step, a load, a change of what trains, or the end of
    the training phase), then writes; the checkpoint becomes visible (renamed into place, `latest`
    moved) once every rank's part is written. One save at a time: the next waits for it, as do
    preemption and the end of the fit. A failed background write fails the run at the next
    step, naming the checkpoint. `io_timeout` (seconds, None for none): a save that takes longer
    fails, naming the checkpoint and the time; a slow one is said in the log every minute.

    >>> learn.fit_one_cycle(10, 1e-2, cbs=Checkpoint(every_n_steps=200, keep_last=3, monitor="accuracy", mode="max"),
    ...                     resume="auto")
    """

    optional_state_keys = frozenset({"history"})   # checkpoints of cadence < 0.2 kept no history

    order = Order.CHECKPOINT
    run_lr_find = False  # the sweep is thrown away: nothing of it is saved

    def __init__(self, dir: str | os.PathLike = "checkpoints", every_n_steps: int | None = None,
                 every_epoch: bool = True, keep_last: int | None = None, monitor: str | None = None,
                 mode: str = "min", preempt_on: Any = DEFAULT_SIGNALS, async_save: bool = False,
                 io_timeout: float | None = 3600):
        if every_n_steps is not None and (not isinstance(every_n_steps, int) or every_n_steps < 1):
            raise ValueError(f"every_n_steps must be a positive int or None, got {every_n_steps!r}")
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be a positive int or None, got {keep_last!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        if not isinstance(async_save, bool):
            raise ValueError(f"async_save must be True or False, got {async_save!r}")
        if io_timeout is not None and (isinstance(io_timeout, bool) or not isinstance(io_timeout, (int, float))
                                       or not 0 < io_timeout < math.inf):
            raise ValueError(f"io_timeout must be a positive, finite number of seconds, or None for no limit; got "
                             f"{io_timeout!r}")
        self.async_save, self.io_timeout = async_save, io_timeout
        self.dir, self.every_n_steps, self.every_epoch = Path(dir), every_n_steps, every_epoch
        self.keep_last, self.monitor, self.mode = keep_last, monitor, mode
        self.preempt_on = parse_signals(preempt_on)
        self.best: float | None = None
        self.best_name: str | None = None
        self.history: list[str] = []  # the checkpoints this run wrote in `root` and still keeps, oldest first
        self._run: tuple[int, Path] | None = None  # (learner id, root) of the run `history` belongs to
        self.resumed_from: Path | None = None
        self._replaced: DataLoader | None = None
        self._epoch_ran = False  # training and validation of the current epoch are done
        self._watch: PreemptionWatch | None = None
        self._pending: BackgroundWrite | None = None  # the save being written in the background
        self._step_hook: tuple[Any, Any] | None = None  # (optimizer, handle): waits for a save's copy before a step
        self._buffers: HostBuffers | None = None  # the host memory of the fit's async copies, reused save to save
        self._taken: set[str] = set()  # the checkpoint names under `root` (listed at `before_fit`, then this run's)
        self._deleting: list[threading.Event] = []  # pruned checkpoints' files being deleted (main process)
        self.saves: list[dict[str, Any]] = []  # what each save of this fit cost (`BackgroundWrite.stats`), in order

    @property
    def root(self) -> Path:
        """The checkpoint directory: `dir`, relative to `learn.path`."""
        return self.dir if self.dir.is_absolute() else self.learn.path / self.dir

    # ------------------------------------------------------------------ around the fit
    @contextlib.contextmanager
    def fit_context(self) -> Iterator[None]:
        """Around the whole fit (the Learner enters it), whatever ends it: the directory is locked, the
        preemption signals are handled, and the user's train loader is given back afterwards."""
        lock = self._lock_directory()
        try:
            self._watch = PreemptionWatch(self.preempt_on, self.learn.strategy.device)
            with self._watch.installed():
                try:
                    yield
                except BaseException:
                    if self._pending is not None:  # no collective to agree on: finish this rank's files only
                        self._pending.join_local(self.io_timeout)
                    raise
        finally:
            self._pending = self.learn.strategy.staging = self._buffers = None
            self._deleting = []  # after a failure the deletions go on; the next start removes what they leave
            if self._step_hook is not None:
                self._step_hook[1].remove()
                self._step_hook = None
            if self._replaced is not None:
                self.learn.dls.train, self._replaced = self._replaced, None
            self.resumed_from = None
            if lock is not None:
                lock.release()

    def _lock_directory(self) -> DirectoryLock | None:
        """The main process checks that `root` is writable and locks it; every rank raises what it found,
        so the other ranks of a refused job end with the same message instead of waiting for it."""
        strategy, lock, refused = self.learn.strategy, None, None
        if strategy.is_main:
            try:
                check_writable(self.root, "checkpoint directory")
                lock = DirectoryLock(self.root)
                lock.acquire()
            except (OSError, RuntimeError) as e:
                lock, refused = None, (type(e), str(e))
        refused = strategy.broadcast(refused)
        if refused is not None:
            kind, message = refused
            raise (kind if issubclass(kind, OSError) else RuntimeError)(message)
        return lock

    def prepare(self) -> None:
        """Before a resume or the first `before_fit`: drop what a killed save left, make the train loader resumable."""
        if self._replaced is None:
            if self.learn.strategy.is_main:
                CheckpointStore(self.root).clean()
            self._replaced = make_resumable(self.learn)

    def resume(self, which: str | os.PathLike) -> dict[str, Any] | None:
        """Load checkpoint `which` into the learner: "auto" (latest if any, else nothing: returns None),
        "latest", a name under `dir`, or a path."""
        self.prepare()
        target = self._target(which)
        if target is None:
            return None
        self._check_resumable(Path(target))
        state = load_state(self.learn, target)
        self.resumed_from = Path(target)
        main_print(f"Checkpoint: resumed from {target} (epoch {state['epoch']}, step {state['step']})")
        if not self._in_root(self.resumed_from):  # another directory's history is not this run's to prune
            self.history, self.best, self.best_name = [], None, None
        return state

    def peek(self, which: str | os.PathLike) -> dict[str, Any] | None:
        """The state.json of the checkpoint `resume(which)` would load (None: "auto" finds none), loading nothing
        (the callbacks' tensors stay references).

        >>> Checkpoint(every_epoch=True).peek("auto")        # (on a learner) where a resume would continue
        """
        strategy = self.learn.strategy
        target = self._target(which)
        if target is None:
            return None
        return strategy.broadcast(read_state(target, tensors=False) if strategy.is_main else None)

    def _target(self, which: str | os.PathLike) -> str | None:
        """The checkpoint `which` names, as the main process finds it, on every process."""
        strategy = self.learn.strategy
        target = None
        if strategy.is_main:
            target = CheckpointStore(self.root).find(LATEST) if which == AUTO else resolve(self.root, which)
        return strategy.broadcast(None if target is None else str(target))

    def _in_root(self, checkpoint: Path) -> bool:
        return checkpoint.parent.resolve() == self.root.resolve()

    def _check_resumable(self, target: Path) -> None:
        """Refuse, before anything is loaded, a checkpoint this fit cannot continue or whose history names
        anything but checkpoints (pruning deletes what the history names)."""
        file, state = target / STATE_FILE, read_state(target)
        resumes_at = state["epoch"] + state["epoch_complete"]
        if resumes_at > self.learn.n_epoch:
            raise ValueError(f"{file}: the checkpoint is at epoch {resumes_at} of {state.get('n_epoch', '?')}, beyond "
                             f"this fit's n_epoch={self.learn.n_epoch}: fit({state.get('n_epoch', resumes_at)}) "
                             f"continues it")
        own = state["callbacks"].get(self.name)
        if own is not None:
            check_checkpoint_state(own, file, f"callbacks.{self.name}")

    def before_fit(self):
        if self.monitor is not None and self.learn.recorder.column(self.monitor) is None:   # fastai's names too
            raise ValueError(f"Checkpoint(monitor={self.monitor!r}): not a recorded value; "
                             f"choose one of {self.learn.recorder.metric_names[1:-1]}")
        self.prepare()
        resumed_from, self.resumed_from = self.resumed_from, None
        run = (id(self.learn), self.root.resolve())
        if resumed_from is None and run != self._run:  # a fresh run: its own history (a later fit of the same
            self.history, self.best, self.best_name = [], None, None  # learner into the same directory goes on)
        self._run = run
        self._last_saved_step = self._last_checked_step = self.learn.step
        self.saves = []
        strategy = self.learn.strategy  # the names taken, listed once (the directory is locked: only this run adds)
        self._taken = set(strategy.broadcast(CheckpointStore(self.root).names() if strategy.is_main else None))
        strategy.prepare_checkpoints()  # what saves need made once now, not at the first save point
        if self.learn.strategy.is_main:
            self._warn_about_other_checkpoints(resumed_from)

    def _warn_about_other_checkpoints(self, resumed_from: Path | None) -> None:
        """Say so when the directory holds checkpoints this run did not write: they are kept, never pruned."""
        others = [d.name for d in CheckpointStore(self.root).complete() if d.name not in self.history]
        if not others:
            return
        listed = ", ".join(others[:5]) + (" ..." if len(others) > 5 else "")
        if resumed_from is None:
            why = ("this run starts fresh next to them (resume=\"auto\" would continue the run that wrote them; "
                   "give this run its own Checkpoint(dir=...) to keep runs apart)")
        elif not self._in_root(resumed_from):
            why = f"this run resumed {resumed_from}, from another directory, whose history is not this directory's"
        else:
            why = (f"they are not in the history of {resumed_from.name}, which this run resumed: they come from a "
                   f"later point of an interrupted run or from another run")
        warnings.warn(f"{self.root} holds checkpoints this run did not write ({listed}); {why}. They are kept and "
                      f"never pruned by this run; `latest` will name this run's checkpoints.", stacklevel=2)

    # ------------------------------------------------------------------ when to save
    def after_batch(self):
        learn = self.learn
        if not learn.training or learn.step == self._last_checked_step:
            return  # not at an optimizer step: accumulation goes on, or the step was skipped
        self._last_checked_step = learn.step
        if self.async_save and self._buffers is None:  # the optimizer's state exists now: its host copy's memory
            self._buffers = HostBuffers()
            learn.strategy.reserve_checkpoint_memory(self._buffers, learn.model, learn.opt)
        if self._pending is not None and self._pending.poll():
            self.saves.append(self._pending.stats)
            self._pending = None
        if self.every_n_steps and learn.step != self._last_saved_step and learn.step % self.every_n_steps == 0:
            self._save(epoch_complete=False)
        sig = self._watch.agreed() if self._watch is not None else None
        if sig is not None:
            if learn.step != self._last_saved_step:
                self._save(epoch_complete=False)
            self._finish_pending()
            main_print(f"Checkpoint: {sig.name} received: saved {self.history[-1]} in {self.root}; exiting with "
                       f"{128 + sig} so the job can be requeued. Run it again with fit(resume=\"auto\") to continue.")
            record_preempted(sig.name, learn.step, received=self._watch.received is not None)
            raise SystemExit(128 + sig)

    def before_epoch(self):
        self._epoch_ran = False

    def after_train(self):
        self.learn.strategy.wait_for_staging()  # validation may swap weights in (EMA-like callbacks)
        self._epoch_ran = self.learn.dls.valid is None

    def after_validate(self):
        self._epoch_ran = True

    def after_epoch(self):
        if self._epoch_ran and (self.every_epoch or self.monitor is not None):
            self._save(epoch_complete=True)
        self._epoch_ran = False

    def after_fit(self):
        self._finish_pending()

    def after_cancel_fit(self):
        """EarlyStopping cancels in `after_epoch`, before this callback's turn: still save that epoch."""
        self.after_epoch()

    # ------------------------------------------------------------------ saving and pruning
    def _save(self, epoch_complete: bool) -> None:
        started, memory, waited = time.perf_counter(), PeakMemory().start(), 0.0
        if self._pending is not None:
            main_print(f"Checkpoint: {self._pending.directory.name} is still being written; step {self.learn.step} "
                       f"waits for it before saving (one save at a time)")
            self._finish_pending()
            waited = time.perf_counter() - started
        strategy, store = self.learn.strategy, CheckpointStore(self.root)
        name = store.fresh_name(self.learn.step, self._taken)  # every rank alike: no collective at the save point
        self._taken.add(name)
        before = (list(self.history), self.best, self.best_name)
        self._update_best(name, epoch_complete)
        self.history.append(name)
        doomed = self._beyond_keep_last()
        self.history = [n for n in self.history if n not in doomed]  # what state.json records: the run after pruning
        if self.async_save and self._buffers is None:
            self._buffers = HostBuffers()
        if self._buffers is not None:
            self._buffers.ready()
        staging = Staging(self.learn.model, self.learn.opt, self._buffers) if self.async_save else None
        try:
            staged = stage_state(self.learn, self.root / name, epoch_complete, copy=self.async_save, staging=staging,
                                 fresh=True)  # a name from `fresh_name`, after `prepare` cleaned what saves left
            if self.async_save and staged.engine_write is None and not self.saves and self._pending is None:
                main_print(f"Checkpoint(async_save=True): the {strategy.name} engine writes its state itself, at the "
                           f"save point, before training goes on; the rest is written in the background")
            write = BackgroundWrite(staged, strategy, self.io_timeout, self.root / name,
                                    on_commit=lambda: self._point_and_prune(store, name, doomed), report=True,
                                    blocking=not self.async_save, since=started, memory=memory,
                                    waited_s=waited, staging=staging).start()
            if staging is not None:
                self._guard(staging)
            if not self.async_save:
                write.wait()
                self.saves.append(write.stats)
        except BaseException:
            memory.stop()
            self.history, self.best, self.best_name = before
            raise
        self._pending = write if self.async_save else None
        self._last_saved_step = self.learn.step

    def _point_and_prune(self, store: CheckpointStore, name: str, doomed: list[str]) -> None:
        """On the main process, once the checkpoint is in place: `latest` and `best` point at it, then the
        checkpoints beyond `keep_last` go: renamed away now, their files deleted by a writer thread (deleting
        large files takes the file system a while; the end of the fit waits for it)."""
        store.point(LATEST, name)
        if self.best_name is not None:
            store.point(BEST, self.best_name)
        tombs = [store.retire(old) for old in doomed if old not in (store.pointed(LATEST), store.pointed(BEST))]
        tombs = [t for t in tombs if t is not None]
        if tombs:
            def delete() -> None:  # a tombstone left (an error, a kill) is removed by `prepare` at the next start
                for tomb in tombs:
                    shutil.rmtree(tomb, ignore_errors=True)
            self._deleting.append(in_background(delete))

    def _guard(self, staging: Staging) -> None:
        """Until the save's copy of the parameters and optimizer state is made, whatever writes them waits for it:
        the optimizer's step (a hook on it, whoever steps), loads and `trainable_changed` (`wait_for_staging`)."""
        strategy, opt = self.learn.strategy, self.learn.opt
        strategy.staging = staging
        if strategy.steps_wait_for_staging:  # an engine whose own step waits (DeepSpeed's)
            return
        if self._step_hook is not None and self._step_hook[0] is not opt:
            self._step_hook[1].remove()
            self._step_hook = None
        if self._step_hook is None and callable(getattr(opt, "register_step_pre_hook", None)):
            self._step_hook = (opt, opt.register_step_pre_hook(lambda *_: strategy.wait_for_staging()))
        elif self._step_hook is None:  # an optimizer without step hooks: no overlap, the copy is waited for now
            strategy.wait_for_staging()

    def _finish_pending(self) -> None:
        """Wait (every rank) until the save in the background is written and visible, and the checkpoints it
        pruned are deleted."""
        self.learn.strategy.wait_for_staging()  # counted as the loop held by that save
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.wait()
            self.saves.append(pending.stats)
        for deleting in self._deleting:
            deleting.wait()
        self._deleting = []

    def _update_best(self, name: str, epoch_complete: bool) -> None:
        if self.monitor is None or not epoch_complete:
            return
        value = self.learn.recorder.values[-1].get(self.monitor)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return
        if self.best is None or (value < self.best if self.mode == "min" else value > self.best):
            self.best, self.best_name = value, name

    def _beyond_keep_last(self) -> list[str]:
        """This run's checkpoints older than the newest `keep_last`, except the best one."""
        if self.keep_last is None:
            return []
        return [n for n in self.history[:-self.keep_last] if n != self.best_name]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_name": self.best_name, "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_name = state["best"], state["best_name"]
        self.history = list(state.get("history", []))  # checkpoints of cadence < 0.2 kept no history
