"""What a state.json may hold: every value that steers a resumed run is checked before anything is loaded.

A checkpoint directory may come from anywhere (a copy, a shared disk, a hand edit): a value of the
wrong type or out of range is refused with the file, the field and what was expected, instead of
training nothing, training the wrong part of the data, or failing later in a raw TypeError.

>>> check_state(state, Path("checkpoints/step-00000200/state.json"))   # ValueError naming a bad field
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def refuse(file: Path, field: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"{file}: {field} is {value!r}: expected {expected}. The file was edited or damaged; "
                      f"resume from another checkpoint")


def _is_int(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def check_int(file: Path, field: str, value: Any, least: int = 0) -> None:
    if not _is_int(value, least):
        raise refuse(file, field, value, f"an int >= {least}")


def _check_bool(file: Path, field: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise refuse(file, field, value, "true or false")


def check_state(state: dict[str, Any], file: Path) -> None:
    """Raise ValueError naming `file` and the field when a value of `state` (a parsed state.json) is unusable."""
    for field in ("epoch", "step", "train_iter"):
        check_int(file, field, state[field])
    check_int(file, "world_size", state["world_size"], least=1)
    _check_bool(file, "epoch_complete", state["epoch_complete"])
    n_epoch = state.get("n_epoch")
    if n_epoch is not None:
        check_int(file, "n_epoch", n_epoch, least=1)
        if state["epoch"] >= n_epoch:
            raise refuse(file, "epoch", state["epoch"], f"less than n_epoch ({n_epoch}), the fit's length")
    _check_sampler(file, state["sampler"])
    callbacks = state["callbacks"]
    if not isinstance(callbacks, dict):
        raise refuse(file, "callbacks", callbacks, "an object holding each callback's state")
    for name, value in callbacks.items():
        if not isinstance(value, dict):
            raise refuse(file, f"callbacks.{name}", value, "an object (the callback's state_dict)")


def _check_sampler(file: Path, sampler: Any) -> None:
    """The training loader's position (`DistributedDL.state_dict`), or None for a loader that has none."""
    if sampler is None:
        return
    if not isinstance(sampler, dict):
        raise refuse(file, "sampler", sampler, "an object (the training loader's position) or null")
    seed = sampler.get("seed")
    if seed is not None and not _is_int(abs(seed) if isinstance(seed, int) else seed, 0):
        raise refuse(file, "sampler.seed", seed, "an int or null")
    for key, least in (("epoch", 0), ("batches_done", 0), ("world_size", 1), ("samples_done", 0)):
        if key in sampler or key in ("epoch", "batches_done"):
            check_int(file, f"sampler.{key}", sampler.get(key), least)
    if sampler.get("batch_size") is not None:
        check_int(file, "sampler.batch_size", sampler["batch_size"], least=1)
    if "epoch_complete" in sampler:
        _check_bool(file, "sampler.epoch_complete", sampler["epoch_complete"])
