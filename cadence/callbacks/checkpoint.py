"""Checkpoints that resume exactly: Checkpoint callback, `save_state` / `load_state`, `save_model`.

A checkpoint is a directory::

    model.safetensors      the user's module (loadable with safetensors.torch.load_file)
    optimizer.pt           optimizer state (loaded with torch.load(weights_only=True))
    state.json             counters, callback states, sampler position, world size
    rng-rank<r>.pt         python, numpy and torch RNG states of each rank

It is written under a temporary name and renamed when complete; the `latest` pointer is
updated last, so a crash mid-save leaves the previous checkpoint as `latest`.

>>> learn.fit(10, cbs=Checkpoint(every_n_steps=200, keep_last=3))
>>> learn.fit(10, cbs=Checkpoint(every_n_steps=200, keep_last=3), resume="latest")   # after a crash
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from .. import __version__
from ..distributed.data import DistributedDL
from ..distributed.env import is_main_process, rank, world_size
from ..distributed.ops import broadcast, wait_for_everyone
from ..trainer.callback import Callback, Order
from ..serialization import (atomic_path, check_state_dict, load_torch, load_weights, save_torch,
                                     save_weights)

FORMAT = 1
LATEST = "latest"


# ---------------------------------------------------------------------------- RNG
def rng_state() -> dict[str, Any]:
    """This process's python, numpy and torch (CPU and CUDA) random states, as plain tensors and numbers."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached": float(cached)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------- the resumable loader
def make_resumable(learn: Any) -> DistributedDL | None:
    """Make `learn.dls.train` a loader whose position can be saved and restored; returns the one replaced.

    Under distribution it already is a DistributedDL. A plain torch DataLoader is wrapped in a
    one-process DistributedDL (same batches; shuffling from a seed kept in the checkpoint).
    """
    dl = learn.dls.train
    if isinstance(dl, DataLoader):
        learn.dls.train = DistributedDL(dl, rank=0, world_size=1)
        return dl
    return None


# ---------------------------------------------------------------------------- saving
def _callback_states(learn: Any) -> dict[str, Any]:
    states = {}
    for cb in learn.cbs:
        if callable(getattr(cb, "state_dict", None)):
            states[cb.name] = cb.state_dict()
    return states


def _train_state(learn: Any, epoch_complete: bool) -> dict[str, Any]:
    dl = learn.dls.train
    sampler = dl.state_dict() if isinstance(dl, DistributedDL) else None  # its position, any world size resumes it
    done = sampler["batches_done"] if sampler else len(dl) if epoch_complete else learn.iter + 1
    return {"format": FORMAT, "cadence_version": __version__, "epoch": learn.epoch, "batches_done": done,
            "epoch_complete": epoch_complete, "step": learn.step, "train_iter": learn.train_iter,
            "n_epoch": learn.n_epoch, "world_size": world_size(), "sampler": sampler,
            "model_class": type(learn.strategy.unwrap(learn.model)).__name__, "callbacks": _callback_states(learn)}


def save_state(learn: Any, directory: str | os.PathLike, epoch_complete: bool = True) -> Path:
    """Write a complete checkpoint of `learn` to `directory` (every rank must call it).

    Written to a temporary directory first and renamed when complete; an existing checkpoint
    at `directory` is replaced only then.

    >>> learn.save_state("checkpoints/before-finetune")
    """
    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.tmp")
    if is_main_process():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    wait_for_everyone()
    model_state = learn.strategy.model_state_dict(learn.model)  # collectives for sharded engines: all ranks
    opt_state = learn.strategy.optimizer_state_dict(learn.model, learn.opt)
    save_torch(rng_state(), tmp / f"rng-rank{rank()}.pt")
    if is_main_process():
        save_weights(model_state, tmp / "model.safetensors")
        save_torch(opt_state, tmp / "optimizer.pt")
        state = _train_state(learn, epoch_complete)
        with atomic_path(tmp / "state.json") as f:
            f.write_text(json.dumps(state, indent=1))
    wait_for_everyone()  # every rank's files are in place before the rename makes the checkpoint visible
    if is_main_process():
        _replace_dir(tmp, directory)
    wait_for_everyone()
    return directory


def _replace_dir(src: Path, dst: Path) -> None:
    old = dst.with_name(f".{dst.name}.old")
    if dst.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
    os.replace(src, dst)
    shutil.rmtree(old, ignore_errors=True)


def save_model(learn: Any, directory: str | os.PathLike, max_shard_size: int | str = "2GB") -> Path:
    """Write the weights only, in the Hugging Face layout: `model.safetensors`, or shards and an index.

    >>> learn.save_model("export", max_shard_size="500MB")   # model-00001-of-00003.safetensors, ... + index
    """
    directory = Path(directory)
    state = learn.strategy.model_state_dict(learn.model)
    if is_main_process():
        directory.mkdir(parents=True, exist_ok=True)
        shards = _split_shards(state, _parse_size(max_shard_size))
        if len(shards) == 1:
            save_weights(shards[0], directory / "model.safetensors")
        else:
            weight_map = {}
            for i, shard in enumerate(shards, 1):
                name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_weights(shard, directory / name)
                weight_map.update(dict.fromkeys(shard, name))
            index = {"metadata": {"total_size": sum(_nbytes(t) for t in state.values())}, "weight_map": weight_map}
            with atomic_path(directory / "model.safetensors.index.json") as f:
                f.write_text(json.dumps(index, indent=1))
    wait_for_everyone()
    return directory


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _parse_size(size: int | str) -> int:
    """"2GB" -> 2_000_000_000 (also KB, MB, GiB, MiB ...); ints pass through."""
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    text = size.strip().upper()
    for unit, factor in units.items():
        if text.endswith(unit) and text[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(text[: -len(unit)]) * factor)
    raise ValueError(f"max_shard_size must be bytes or a size such as '2GB' or '500MB', got {size!r}")


def _split_shards(state: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    shards, current, size = [], {}, 0
    for name, t in state.items():
        if current and size + _nbytes(t) > limit:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += _nbytes(t)
    return shards + [current] if current or not shards else shards


# ---------------------------------------------------------------------------- loading
def _is_complete(directory: Path) -> bool:
    return (directory / "state.json").is_file() and (directory / "model.safetensors").is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoint directories under `root`, oldest step first."""
    found = [d for d in root.glob("step-*") if d.is_dir() and _is_complete(d)]
    return sorted(found, key=lambda d: int(d.name.split("-")[1]))


def resolve(root: Path, which: str | os.PathLike) -> Path:
    """The checkpoint directory `which` names: "latest", a directory name under `root`, or a path."""
    if str(which) == LATEST:
        pointer = root / LATEST
        target = root / pointer.read_text().strip() if pointer.is_file() else None
        if target is None or not _is_complete(target):
            candidates = complete_checkpoints(root)
            if not candidates:
                raise FileNotFoundError(f"resume='latest' but {root} holds no complete checkpoint; "
                                        f"start without resume, or pass the checkpoint's path")
            target = candidates[-1]
        return target
    path = Path(which)
    path = path if path.is_dir() else root / path
    if not _is_complete(path):
        raise FileNotFoundError(f"no complete checkpoint at {path} (needs state.json and model.safetensors)")
    return path


def load_state(learn: Any, directory: str | os.PathLike) -> dict[str, Any]:
    """Restore weights, optimizer, counters, callback states, RNG and data position from a checkpoint.

    The checkpoint is checked against the model before anything is loaded. Returns state.json.

    >>> learn.load_state("checkpoints/step-00000200")
    """
    directory = Path(directory)
    state = json.loads((directory / "state.json").read_text())
    if state.get("format") != FORMAT:
        raise ValueError(f"{directory} has checkpoint format {state.get('format')}; this cadence reads {FORMAT}")
    weights = load_weights(directory / "model.safetensors")
    check_state_dict(learn.strategy.unwrap(learn.model), weights, source=str(directory))
    learn.strategy.load_model_state_dict(learn.model, weights)
    if (directory / "optimizer.pt").is_file():
        learn.strategy.load_optimizer_state_dict(learn.model, learn.opt, load_torch(directory / "optimizer.pt"))
    _load_callback_states(learn, state["callbacks"])
    _load_rng(directory, state)
    _restore_position(learn, state)
    return state


def _load_callback_states(learn: Any, states: dict[str, Any]) -> None:
    for cb in learn.cbs:
        if cb.name in states and callable(getattr(cb, "load_state_dict", None)):
            cb.load_state_dict(states[cb.name])


def _load_rng(directory: Path, state: dict[str, Any]) -> None:
    file = directory / f"rng-rank{rank()}.pt"
    if file.is_file():
        set_rng_state(load_torch(file))
    else:
        warnings.warn(f"{directory} has no RNG state for rank {rank()} (saved with {state['world_size']} "
                      f"processes); random numbers will differ from the original run", stacklevel=3)


def _restore_position(learn: Any, state: dict[str, Any]) -> None:
    """Counters, and where the training loader continues (the rest of the epoch, or the next one)."""
    learn.step, learn.train_iter = state["step"], state["train_iter"]
    learn.epoch = state["epoch"] + 1 if state["epoch_complete"] else state["epoch"]
    dl, sampler = learn.dls.train, state["sampler"]
    if isinstance(dl, DistributedDL) and sampler is not None:  # on any number of processes; the loop
        dl.load_state_dict({**sampler, "epoch_complete": state["epoch_complete"]})  # numbers from dl.start_batch


# ---------------------------------------------------------------------------- the callback
class Checkpoint(Callback):
    """Save checkpoints during `fit`: every `every_n_steps` optimizer steps and/or after every epoch.

    `keep_last` keeps only the newest n (the best one by `monitor` is never pruned); `monitor`
    (a Recorder column such as "valid_loss" or "accuracy", with `mode` "min"/"max") tracks the
    best epoch and points `best` at it. Checkpoints go to `dir` (relative to `learn.path`) as
    `step-<step>/`; `fit(..., resume="latest")` continues from the newest complete one.

    >>> learn.fit_one_cycle(10, 1e-2, cbs=Checkpoint(every_n_steps=200, keep_last=3, monitor="accuracy", mode="max"),
    ...                     resume="latest")
    """

    order = Order.CHECKPOINT

    def __init__(self, dir: str | os.PathLike = "checkpoints", every_n_steps: int | None = None,
                 every_epoch: bool = True, keep_last: int | None = None, monitor: str | None = None,
                 mode: str = "min"):
        if every_n_steps is not None and (not isinstance(every_n_steps, int) or every_n_steps < 1):
            raise ValueError(f"every_n_steps must be a positive int or None, got {every_n_steps!r}")
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be a positive int or None, got {keep_last!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        self.dir, self.every_n_steps, self.every_epoch = Path(dir), every_n_steps, every_epoch
        self.keep_last, self.monitor, self.mode = keep_last, monitor, mode
        self.best: float | None = None
        self.best_name: str | None = None
        self._replaced: DataLoader | None = None
        self._epoch_ran = False  # training and validation of the current epoch are done

    @property
    def root(self) -> Path:
        """The checkpoint directory: `dir`, relative to `learn.path`."""
        return self.dir if self.dir.is_absolute() else self.learn.path / self.dir

    def prepare(self) -> None:
        """Make the train loader resumable (before a resume loads its position, or before `before_fit`)."""
        if self._replaced is None:
            self._replaced = make_resumable(self.learn)

    def before_fit(self):
        if self.monitor is not None and self.monitor not in self.learn.recorder.metric_names:
            raise ValueError(f"Checkpoint(monitor={self.monitor!r}): not a recorded value; "
                             f"choose one of {self.learn.recorder.metric_names[1:-1]}")
        self.prepare()
        self._last_saved_step = self.learn.step

    def after_batch(self):
        learn = self.learn
        if (learn.training and self.every_n_steps and learn.step != self._last_saved_step
                and learn.step % self.every_n_steps == 0):
            self._save(epoch_complete=False)

    def before_epoch(self):
        self._epoch_ran = False

    def after_train(self):
        self._epoch_ran = self.learn.dls.valid is None

    def after_validate(self):
        self._epoch_ran = True

    def after_epoch(self):
        if self._epoch_ran and (self.every_epoch or self.monitor is not None):
            self._save(epoch_complete=True)
        self._epoch_ran = False

    def after_cancel_fit(self):
        """EarlyStopping cancels in `after_epoch`, before this callback's turn: still save that epoch."""
        self.after_epoch()

    def after_fit(self):
        if self._replaced is not None:
            self.learn.dls.train, self._replaced = self._replaced, None

    def _save(self, epoch_complete: bool) -> None:
        name = f"step-{self.learn.step:08d}"
        self._update_best(name, epoch_complete)
        save_state(self.learn, self.root / name, epoch_complete)
        if is_main_process():
            with atomic_path(self.root / LATEST) as f:
                f.write_text(name)
            self._prune()
        wait_for_everyone()
        self._last_saved_step = self.learn.step

    def _update_best(self, name: str, epoch_complete: bool) -> None:
        if self.monitor is None or not epoch_complete:
            return
        value = self.learn.recorder.values[-1].get(self.monitor)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return
        if self.best is None or (value < self.best if self.mode == "min" else value > self.best):
            self.best, self.best_name = value, name

    def _prune(self) -> None:
        if self.best_name is not None:
            with atomic_path(self.root / "best") as f:
                f.write_text(self.best_name)
        if self.keep_last is None:
            return
        for old in complete_checkpoints(self.root)[:-self.keep_last]:
            if old.name != self.best_name:
                shutil.rmtree(old, ignore_errors=True)

    def resume(self, which: str | os.PathLike) -> dict[str, Any]:
        """Load checkpoint `which` ("latest", a name under `dir`, or a path) into the learner."""
        self.prepare()
        target = broadcast(str(resolve(self.root, which)) if is_main_process() else None)
        return load_state(self.learn, target)

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_name": self.best_name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_name = state["best"], state["best_name"]
