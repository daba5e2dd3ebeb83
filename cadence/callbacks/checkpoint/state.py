"""What a checkpoint holds besides the engine's files, and how a Learner is saved to and restored from one.

A checkpoint is a directory::

    model.safetensors, optimizer.pt   the engine's format (FSDP: sharded/ written by every rank)
    rng-rank<r>.pt                    python, numpy and torch random states of each rank
    state.json                        counters, callback states, sampler position, world size; written last

>>> learn.save_state("checkpoints/before-finetune")
>>> learn.load_state("checkpoints/before-finetune")
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from ... import __version__
from ...distributed.data import DistributedDL
from ...distributed.env import rank, world_size
from ...serialization import STAGED, atomic_path, commit_dir, load_torch, recover_dir, save_torch, sibling, staging_dir
from .rng import rng_state, set_rng_state
from .store import STATE_FILE

FORMAT = 1
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
def save_state(learn: Any, directory: str | os.PathLike, epoch_complete: bool = True) -> Path:
    """Write a complete checkpoint of `learn` to `directory` (every rank must call it).

    Every rank writes into a staged directory; the main process writes `state.json` last and
    renames the whole directory into place (replacing an existing checkpoint there only then).

    >>> learn.save_state("checkpoints/before-finetune")
    """
    directory, strategy = Path(directory), learn.strategy
    staged = sibling(directory, STAGED)
    if strategy.is_main:
        recover_dir(directory)
        staging_dir(directory)
    strategy.barrier()
    strategy.save_checkpoint(staged, learn.model, learn.opt)  # collectives for sharded engines: every rank
    save_torch(rng_state(), staged / f"rng-rank{rank()}.pt")
    strategy.barrier()  # every rank's files are in before state.json marks the checkpoint complete
    if strategy.is_main:
        with atomic_path(staged / STATE_FILE) as f:
            f.write_text(json.dumps(_train_state(learn, epoch_complete), indent=1))
        commit_dir(staged, directory)
    strategy.barrier()
    return directory


def _train_state(learn: Any, epoch_complete: bool) -> dict[str, Any]:
    dl = learn.dls.train
    sampler = ({"world_size": dl.world_size, "batch_size": dl.batch_size, **dl.state_dict()}
               if isinstance(dl, DistributedDL) else None)
    return {"format": FORMAT, "cadence_version": __version__, "epoch": learn.epoch, "epoch_complete": epoch_complete,
            "step": learn.step, "train_iter": learn.train_iter, "n_epoch": learn.n_epoch, "world_size": world_size(),
            "sampler": sampler, "model_class": type(learn.strategy.unwrap(learn.model)).__name__,
            "callbacks": {cb.name: cb.state_dict() for cb in learn.cbs if callable(getattr(cb, "state_dict", None))}}


# ---------------------------------------------------------------------------- loading
def read_state(directory: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's state.json, checked; ValueError naming the file when it is corrupt or incomplete."""
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
    if state["format"] != FORMAT:
        raise ValueError(f"{file} has checkpoint format {state['format']}; this cadence ({__version__}) reads {FORMAT}")
    return state


def load_state(learn: Any, directory: str | os.PathLike) -> dict[str, Any]:
    """Restore weights, optimizer, counters, callback states, RNG and data position from a checkpoint.

    state.json and the RNG file are read and the weights checked against the model before
    anything is loaded. Returns state.json.

    >>> learn.load_state("checkpoints/step-00000200")
    """
    directory = Path(directory)
    state = read_state(directory)
    rng = _read_rng(directory, state)
    learn.strategy.load_checkpoint(directory, learn.model, learn.opt)
    for cb in learn.cbs:
        if cb.name in state["callbacks"] and callable(getattr(cb, "load_state_dict", None)):
            cb.load_state_dict(state["callbacks"][cb.name])
    if rng is not None:
        set_rng_state(rng)
    _restore_position(learn, state)
    return state


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
