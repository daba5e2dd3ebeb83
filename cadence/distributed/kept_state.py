"""The model's and optimizer's state kept for a while and put back: `lr_find`'s sweep trains, then restores them.

Most engines' state dicts copy and load back (`kept_in_memory`); DeepSpeed's partitioned state only loads from its
own checkpoint (`kept_on_disk`, in the Learner's model_dir, as fastai's `lr_find` keeps `_tmp`).

>>> restore = kept_in_memory(model, opt); learn.fit(1); restore()      # the weights and moments of before
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

__all__ = ["kept_in_memory", "kept_on_disk"]


def kept_in_memory(model: nn.Module, opt: Any) -> Callable[[], None]:
    """A copy of `model`'s and `opt`'s state dicts, loaded back by the returned function."""
    saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())

    def restore() -> None:
        model.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
    return restore


def kept_on_disk(strategy: Any, model: nn.Module, opt: Any, directory: Path) -> Callable[[], None]:
    """The engine's own checkpoint of `model` and `opt`, written to `directory` now (every rank its part), read
    back and removed by the returned function (every rank calls both). `directory` is the Learner's model_dir, which
    every process reads as its checkpoints are (one shared disk across machines)."""
    directory = Path(directory)
    if strategy.is_main:
        shutil.rmtree(directory, ignore_errors=True)  # what a sweep that raised left behind
    strategy.barrier()
    strategy.save_checkpoint(directory, model, opt)

    def restore() -> None:
        strategy.barrier()  # every rank's part written
        strategy.load_checkpoint(directory, model, opt)  # a load that fails leaves the state of before on disk
        strategy.barrier()
        if strategy.is_main:
            shutil.rmtree(directory, ignore_errors=True)
    return restore
