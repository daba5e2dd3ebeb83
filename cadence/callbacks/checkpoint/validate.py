"""What a state.json may hold: every value that steers a resumed run is checked before anything is loaded.

A checkpoint directory may come from anywhere (a copy, a shared disk, a hand edit): a value of the
wrong type or out of range is refused with the file, the field and what was expected, instead of
training nothing, training the wrong part of the data, or failing later in a raw TypeError.

>>> check_state(state, Path("checkpoints/step-00000200/state.json"))   # ValueError naming a bad field
"""

from __future__ import annotations

import numbers
from pathlib import Path
from typing import Any

import torch

from .store import is_checkpoint_name


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
        check_int(file, "n_epoch", n_epoch)  # 0: saved by hand before any fit
        if n_epoch and state["epoch"] >= n_epoch:
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
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise refuse(file, "sampler.seed", seed, "an int or null")
    for key, least in (("epoch", 0), ("batches_done", 0), ("world_size", 1), ("samples_done", 0)):
        if key in sampler or key in ("epoch", "batches_done"):
            check_int(file, f"sampler.{key}", sampler.get(key), least)
    if sampler.get("batch_size") is not None:
        check_int(file, "sampler.batch_size", sampler["batch_size"], least=1)
    if "epoch_complete" in sampler:
        _check_bool(file, "sampler.epoch_complete", sampler["epoch_complete"])


def check_checkpoint_state(own: dict[str, Any], file: Path, field: str) -> None:
    """The Checkpoint callback's state (at `field`): its history names only checkpoints, since pruning deletes
    what it names (never a path: `../x` or `/x` would be deleted outside the directory)."""
    history = own.get("history", [])
    if not isinstance(history, list):
        raise refuse(file, f"{field}.history", history, "a list of checkpoint names")
    for i, name in enumerate(history):
        if not is_checkpoint_name(name):
            raise refuse(file, f"{field}.history[{i}]", name, "a checkpoint name such as 'step-00000200'; it is not "
                         "a checkpoint name, and pruning would delete it")
    if own.get("best_name") is not None and not is_checkpoint_name(own["best_name"]):
        raise refuse(file, f"{field}.best_name", own["best_name"], "a checkpoint name or null")
    best = own.get("best")
    if best is not None and (isinstance(best, bool) or not isinstance(best, (int, float))):
        raise refuse(file, f"{field}.best", best, "a number or null")


_NONE = type(None)


def check_callback_states(saved: dict[str, Any], cbs: list[Any], file: Path, per_rank: bool = False) -> None:
    """Refuse, before anything is loaded, a saved callback state that its live callback could not load.

    Each state in `saved` (by callback name) of one of cadence's callbacks is checked against the live callback's
    own `state_dict()` (`rank_state_dict()` with `per_rank`): every key the live one has is there (but
    its `optional_state_keys`), each value of the live one's kind: true/false, a number, a string, a list (or tensor), an
    object; null where the live one is a number or a string; a live value not set yet (None) takes anything.
    A callback of the user's own loads its state as its `load_state_dict` does (its schema is its own). ValueError
    naming `file`, the callback and the key.

    >>> check_callback_states(state["callbacks"], learn.cbs, Path("ckpt/state.json"))  # ValueError: a bad key
    """
    method = "rank_state_dict" if per_rank else "state_dict"
    for cb in cbs:
        if (cb.name not in saved or not callable(getattr(cb, method, None))
                or not type(cb).__module__.startswith("cadence.")):
            continue
        state = saved[cb.name]
        if not isinstance(state, dict):
            raise _refuse_callback(file, cb.name, "", f"is {_shown(state)}: expected an object (its state)")
        for key, live in getattr(cb, method)().items():
            if key not in state:
                if key not in getattr(cb, "optional_state_keys", ()):
                    raise _refuse_callback(file, cb.name, f".{key}", "is missing")
                continue
            expected = _accepted(live)
            value = state[key]
            if expected is not None and (not isinstance(value, expected[1])
                                         or isinstance(value, bool) and bool not in expected[1]):
                raise _refuse_callback(file, cb.name, f".{key}", f"is {_shown(value)}: expected {expected[0]}")


def _accepted(live: Any) -> tuple[str, tuple[type, ...]] | None:
    """(what a saved value standing for `live` may be, said and as types); None: a kind not checked."""
    if isinstance(live, bool):
        return "true or false", (bool,)
    if isinstance(live, numbers.Real):
        return "a number or null", (int, float, _NONE)
    if isinstance(live, str):
        return "a string or null", (str, _NONE)
    if isinstance(live, (list, tuple, torch.Tensor)):
        return "a list", (list, tuple, torch.Tensor)
    if isinstance(live, dict):
        return "an object", (dict,)
    return None


def _shown(value: Any) -> str:
    text = repr(value) if not isinstance(value, torch.Tensor) else f"a tensor of {value.numel()} values"
    return text if len(text) <= 80 else text[:77] + "..."


def _refuse_callback(file: Path, name: str, key: str, problem: str) -> ValueError:
    return ValueError(f"{file}: callbacks.{name}{key} {problem}: this run's {name} callback cannot load it. "
                      f"The file was edited, damaged or written for other callbacks; resume from another checkpoint, "
                      f"or remove the {name} callback from this run")
