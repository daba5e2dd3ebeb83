"""Checkpoints that resume exactly and are never lost: the Checkpoint callback, `save_state` / `load_state`, `save_model`.

One concept per module: `store` (the directory rules: staged writes, fresh names, tombstones,
`latest`), `state` (what a checkpoint holds and how a Learner is saved and restored),
`validate` (what a state.json may hold), `lock` (one job per directory), `rng` (random
states), `preemption` (signals to a checkpoint and a requeue status), `export` (weights in
the Hugging Face layout), `writer` (a save written by a thread of every rank, committed once
all agree), `memory` (peak host memory of a save), `callback` (when to save, what to keep, resume).

>>> learn.fit(10, cbs=Checkpoint(every_n_steps=200, keep_last=3), resume="auto")
"""

from .callback import Checkpoint
from .export import save_model
from .rng import rng_state, set_rng_state
from .state import FORMAT, load_state, make_resumable, read_state, save_state
from .store import BEST, LATEST, CheckpointStore, complete_checkpoints, resolve

__all__ = ["Checkpoint", "save_model", "rng_state", "set_rng_state", "FORMAT", "load_state", "make_resumable",
           "read_state", "save_state", "BEST", "LATEST", "CheckpointStore", "complete_checkpoints", "resolve"]
