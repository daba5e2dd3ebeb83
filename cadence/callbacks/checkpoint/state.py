"""What a checkpoint holds besides the engine's files, and how a Learner is saved to and restored from one.

A checkpoint is a directory::

    model.safetensors, optimizer.pt   the engine's format (FSDP: sharded/ written by every rank)
    rng-rank<r>.pt                    python, numpy and torch random states of each rank
    callbacks.tensors                 the tensors of callback states (the Recorder's per-step history),
                                      in the safetensors layout (not named *.safetensors: no weights)
    state.json                        counters, callback states, sampler position, world size, the engine
                                      and mesh of a sharded checkpoint ("mesh": `checkpoint_layout`) and
                                      the list of the other files (all must be there); written last

state.json stays the same size however long the run: per-step histories travel as tensors in
callbacks.tensors (a state_dict value that is a tensor goes there), so a save costs the same
at step 20,000 as at step 1,000.

>>> learn.save_state("checkpoints/before-finetune")
>>> learn.load_state("checkpoints/before-finetune")
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from ...version import __version__
from ...distributed.data import DistributedDL
from ...distributed.staging import Staging
from ...distributed.env import rank, world_size
from ...distributed.model_parallel import checkpoint_layout
from ...trainer.callback import legacy_name
from ...distributed.staging import host_copy
from ...serialization import (STAGED, atomic_path, commit_dir, load_torch, load_weights, recover_dir, save_torch,
                               sibling, staging_dir, write_safetensors, writing)
from .layout import check_engine_reads
from .rng import rng_state, set_rng_state
from .store import STATE_FILE
from .validate import check_callback_states, check_state
from .writer import BackgroundWrite

FORMAT = 2  # 2: callback tensors in callbacks.tensors, the files listed; 1 (all in state.json) still loads
READS = (1, 2)
TENSORS_FILE = "callbacks.tensors"
_TENSOR_REF = "__cadence_tensor__"  # what stands in state.json for a tensor of callbacks.tensors
REQUIRED_KEYS = ("format", "epoch", "epoch_complete", "step", "train_iter", "world_size", "sampler", "callbacks")


def make_resumable(learn: Any) -> DataLoader | None:
    """Make `learn.dls.train` a loader whose position can be saved and restored; returns the one replaced.

    Under distribution it already is a DistributedDL. A plain torch DataLoader is wrapped in a
    one-process DistributedDL that draws each epoch as the loader itself would (`draw_like_loader`):
    the same batches and the same random numbers after them, so adding a Checkpoint changes nothing
    in the run; the random states each epoch was drawn from go into the checkpoint.
    """
    dl = learn.dls.train
    if isinstance(dl, DataLoader):
        learn.dls.train = DistributedDL(dl, rank=0, world_size=1, draw_like_loader=True)
        return dl
    return None


# ---------------------------------------------------------------------------- saving
def save_state(learn: Any, directory: str | os.PathLike, epoch_complete: bool = True,
               io_timeout: float | None = None) -> Path:
    """Write a complete checkpoint of `learn` to `directory` (every rank must call it).

    Every rank writes into a staged directory; the main process writes `state.json` last and
    renames the whole directory into place (replacing an existing checkpoint there only then).
    The writes stream from the model's memory (no second copy of it); a write that takes longer
    than `io_timeout` seconds fails naming the checkpoint (`writer.BackgroundWrite`).

    >>> learn.save_state("checkpoints/before-finetune")
    """
    directory = Path(directory)
    BackgroundWrite(stage_state(learn, directory, epoch_complete), learn.strategy, io_timeout, directory).start().wait()
    return directory


class StagedSave:
    """A checkpoint taken at one step and ready to write: `write` (this rank's files; any thread, no collective
    on the training's group) then `commit` (the main process, once every rank's `write` is done)."""

    def __init__(self, directory: Path, engine_write: Callable[[], None] | None, rng: dict, state: dict | None,
                 tensors: dict[str, torch.Tensor]):
        self.directory, self.staged = directory, sibling(directory, STAGED)
        self.engine_write, self.rng, self.state, self.tensors = engine_write, rng, state, tensors

    def write(self) -> None:
        with writing(self.directory, "checkpoint", self.staged):  # a failed write names the directory, its free space
            if self.engine_write is not None:
                self.engine_write()
            save_torch(self.rng, self.staged / f"rng-rank{rank()}.pt")
            if self.tensors:
                with atomic_path(self.staged / TENSORS_FILE) as tmp:
                    write_safetensors(self.tensors, tmp)

    def commit(self) -> None:
        with writing(self.directory, "checkpoint", self.staged):
            state = {**self.state, "files": _files(self.staged)}
            with atomic_path(self.staged / STATE_FILE) as f:
                f.write_text(json.dumps(state, indent=1))
            commit_dir(self.staged, self.directory)


def stage_state(learn: Any, directory: Path, epoch_complete: bool, copy: bool = False,
                staging: Staging | None = None, fresh: bool = False) -> StagedSave:
    """Every rank, at the step it saves: the staged directory made, the state taken (the engine's collectives
    included). `copy`: tensors copied to host memory, so training may go on while the save is written; with
    `staging`, the parameters and optimizer state by the writer, the caller waiting (`staging.wait()`) before
    anything writes them (`Strategy.checkpoint_writer`); callback states, RNG and position are taken now.
    `fresh`: no directory and no staged save has `directory`'s name (the Checkpoint callback's names): every rank
    makes the staged directory itself, with no barrier; otherwise the main process clears the way first."""
    strategy, staged = learn.strategy, sibling(directory, STAGED)
    with writing(directory, "checkpoint", staged):
        if fresh:
            staged.mkdir(parents=True, exist_ok=True)
        else:
            if strategy.is_main:
                recover_dir(directory)
                staging_dir(directory)
            strategy.barrier()
        engine_write = strategy.checkpoint_writer(staged, learn.model, learn.opt, copy=copy,
                                                  staging=staging)
    state, tensors = None, {}
    if strategy.is_main:
        state = _train_state(learn, epoch_complete)
        state["callbacks"], tensors = _split_tensors(state["callbacks"])
        state = json.loads(json.dumps(state))  # the values of now: callbacks go on changing their own lists
        if copy:
            tensors = host_copy(tensors)
    own = {cb.name: cb.rank_state_dict() for cb in learn.cbs if callable(getattr(cb, "rank_state_dict", None))}
    return StagedSave(directory, engine_write, {**rng_state(strategy), **({"callbacks": own} if own else {})},
                      state, tensors)


def _files(directory: Path) -> list[str]:
    """Every file under `directory` (relative paths): state.json lists them, completeness checks them."""
    return [p.relative_to(directory).as_posix() for p in sorted(directory.rglob("*")) if p.is_file()]


def _split_tensors(obj: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """(`obj` with each tensor replaced by a reference, the tensors by reference name)."""
    if isinstance(obj, torch.Tensor):
        return {_TENSOR_REF: prefix}, {prefix: obj}
    tensors: dict[str, torch.Tensor] = {}
    if isinstance(obj, dict):
        out = {}
        for key, value in obj.items():
            out[key], found = _split_tensors(value, f"{prefix}.{key}" if prefix else str(key))
            tensors.update(found)
        return out, tensors
    if isinstance(obj, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in obj):
        out = []
        for i, value in enumerate(obj):
            item, found = _split_tensors(value, f"{prefix}.{i}")
            out.append(item)
            tensors.update(found)
        return out, tensors
    return obj, tensors


def _join_tensors(obj: Any, tensors: dict[str, torch.Tensor], file: Path) -> Any:
    """The inverse of `_split_tensors`: references replaced by the tensors of `file`."""
    if isinstance(obj, dict):
        if set(obj) == {_TENSOR_REF}:
            if obj[_TENSOR_REF] not in tensors:
                raise ValueError(f"{file} lacks the tensor {obj[_TENSOR_REF]!r} that state.json names; "
                                 f"resume from another checkpoint")
            return tensors[obj[_TENSOR_REF]]
        return {key: _join_tensors(value, tensors, file) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_join_tensors(value, tensors, file) for value in obj]
    return obj


def _train_state(learn: Any, epoch_complete: bool) -> dict[str, Any]:
    dl = learn.dls.train
    sampler = ({"world_size": dl.world_size, "batch_size": dl.batch_size, **dl.state_dict()}
               if isinstance(dl, DistributedDL) else None)
    return {"format": FORMAT, "cadence_version": __version__, "epoch": learn.epoch, "epoch_complete": epoch_complete,
            "step": learn.step, "train_iter": learn.train_iter, "n_epoch": learn.n_epoch, "world_size": world_size(),
            "sampler": sampler, "model_class": type(learn.strategy.unwrap(learn.model)).__name__,
            "mesh": checkpoint_layout(learn.strategy),
            "callbacks": {cb.name: cb.state_dict() for cb in learn.cbs if callable(getattr(cb, "state_dict", None))}}


# ---------------------------------------------------------------------------- loading
def read_state(directory: str | os.PathLike, tensors: bool = True) -> dict[str, Any]:
    """The checkpoint's state.json, checked; ValueError naming the file when it is corrupt or incomplete.
    `tensors=False`: the callbacks' tensors stay references (not read)."""
    file = Path(directory) / STATE_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{directory} has no {STATE_FILE}: it is not a complete cadence checkpoint")
    try:
        state = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is corrupt ({e}); resume from another checkpoint") from None
    missing = [k for k in REQUIRED_KEYS if k not in state] if isinstance(state, dict) else list(REQUIRED_KEYS)
    if missing:
        raise ValueError(f"{file} lacks {missing}: it is not a complete cadence checkpoint; "
                         f"resume from another checkpoint")
    if state["format"] not in READS:
        raise ValueError(f"{file} has checkpoint format {state['format']!r}; this cadence ({__version__}) reads {READS}")
    check_state(state, file)
    tensors_file = Path(directory) / TENSORS_FILE
    if tensors and tensors_file.is_file():
        state["callbacks"] = _join_tensors(state["callbacks"], load_weights(tensors_file), tensors_file)
    return state


def load_state(learn: Any, directory: str | os.PathLike) -> dict[str, Any]:
    """Restore weights, optimizer, counters, callback states, RNG and data position from a checkpoint.

    state.json and the RNG file are read, the callbacks' states checked against the live callbacks
    (`validate.check_callback_states`), the engine against the one that wrote a sharded checkpoint
    (`layout.check_engine_reads`) and the weights against the model before anything is loaded.
    Returns state.json.

    >>> learn.load_state("checkpoints/step-00000200")
    """
    directory = Path(directory)
    state = read_state(directory)
    check_engine_reads(learn.strategy, directory, state, "learner")
    rng = _read_rng(directory, state)
    own = (rng or {}).get("callbacks", {})  # what differs per process (the Recorder's smoothed loss): this rank's
    for states in (state["callbacks"], own):
        _adopt_legacy_names(states, learn.cbs)
    check_callback_states(state["callbacks"], learn.cbs, directory / STATE_FILE)
    check_callback_states(own, learn.cbs, directory / f"rng-rank{rank()}.pt", per_rank=True)
    learn.strategy.wait_for_staging()
    learn.strategy.load_checkpoint(directory, learn.model, learn.opt)
    for cb in learn.cbs:
        if cb.name in state["callbacks"] and callable(getattr(cb, "load_state_dict", None)):
            cb.load_state_dict(state["callbacks"][cb.name])
        if cb.name in own and callable(getattr(cb, "load_rank_state_dict", None)):
            cb.load_rank_state_dict(own[cb.name])
    if rng is not None:
        set_rng_state(rng, learn.strategy)
    _restore_position(learn, state)
    return state


def _adopt_legacy_names(states: dict[str, Any], cbs: list[Any]) -> None:
    """A checkpoint written before callbacks took fastcore's names keeps a state under the old name
    (`reduce_l_r_on_plateau`): it is the callback's now-named state."""
    for cb in cbs:
        old = legacy_name(cb)
        if cb.name not in states and old in states:
            states[cb.name] = states.pop(old)


def _read_rng(directory: Path, state: dict[str, Any]) -> dict[str, Any] | None:
    file = directory / f"rng-rank{rank()}.pt"
    if file.is_file():
        return load_torch(file)
    warnings.warn(f"{directory} has no RNG state for rank {rank()} (saved with {state['world_size']} "
                  f"processes); random numbers will differ from the original run", stacklevel=4)
    return None


def _restore_position(learn: Any, state: dict[str, Any]) -> None:
    """Counters, and where the training loader continues (the rest of the epoch, or the next one)."""
    learn.step, learn.train_iter = state["step"], state["train_iter"]
    learn.epoch = state["epoch"] + 1 if state["epoch_complete"] else state["epoch"]
    dl, position = learn.dls.train, state["sampler"]
    if isinstance(dl, DistributedDL) and position is not None:
        if state["epoch_complete"]:
            position = {**position, "epoch": position["epoch"] + 1, "batches_done": 0, "epoch_complete": False}
        dl.load_state_dict(position)  # the loop numbers the batches from dl.start_batch
