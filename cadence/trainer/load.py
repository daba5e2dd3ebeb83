"""`load_learner()`: a Learner for inference from a directory that `learn.export()` wrote (the format: export.py).

>>> learn = load_learner("path/export.pkl", trust_pickle=True)   # a file you made or trust
>>> learn = load_learner("path/export.pkl", model=get_model(), loss_func=nn.CrossEntropyLoss())   # no unpickling
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..serialization import REPLACED, check_state_dict, load_weights, recover_dir, sibling
from ..tied_weights import retie, tied_names
from .data import DataLoaders
from .export import DEFAULT_NAME, FORMER_NAME, MANIFEST, PICKLE, WEIGHTS
from .learner import Learner


def _no_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
    raise ValueError("this Learner was loaded for inference without a loss function: "
                     "pass load_learner(path, ..., loss_func=...) to compute losses")


def load_learner(path: str | os.PathLike, trust_pickle: bool = False, model: nn.Module | None = None,
                 loss_func: Callable | None = None, cpu: bool = True) -> Learner:
    """A Learner for inference (`predict`, `get_preds(dl=...)`) from a directory written by `learn.export`.

    With `model` (your own instance of the architecture) only the safetensors weights are read.
    Without it the model is rebuilt from `learner.pkl`, which needs `trust_pickle=True`. `cpu`
    puts the model on the CPU (else the default device).

    >>> learn = load_learner(learn.path/"export.pkl", trust_pickle=True)
    >>> learn.predict(x)
    """
    path = Path(path)
    if not path.exists() and sibling(path, REPLACED).is_dir():
        with contextlib.suppress(FileNotFoundError):  # another process finished it first
            recover_dir(path)  # an export killed between its two renames: the new one, complete, moves in
    _check_exported(path)
    state = load_weights(path / WEIGHTS)
    extra: dict[str, Any] = {}
    if model is None or (loss_func is None and trust_pickle):
        extra = _unpickle(path, trust_pickle)
    if model is None:
        model = extra["model"]
        check_state_dict(model, state, source=str(path / WEIGHTS))
        aliases = tied_names(model)  # assign gives each tied name its own Parameter: one again after
        model.load_state_dict(state, assign=True)
        retie(model, aliases)
    else:
        check_state_dict(model, state, source=str(path / WEIGHTS))
        model.load_state_dict(state)
    if loss_func is None:  # the exported one: None when the model computes its loss (export.json says so too)
        loss_func = extra["loss_func"] if "loss_func" in extra else None if _computed_its_loss(path) else _no_loss
    dls = DataLoaders([], None, device="cpu" if cpu else None, n_inp=extra.get("n_inp"))
    settings = {k: extra[k] for k in _SETTINGS if k in extra}  # an export before they were kept: the defaults
    return Learner(dls, model, loss_func=loss_func, **settings)


def _check_exported(path: Path) -> None:
    """Refuse, saying what is there instead, a path that is not a directory `learn.export()` wrote."""
    if not path.exists():
        other = path.parent / {DEFAULT_NAME: FORMER_NAME, FORMER_NAME: DEFAULT_NAME}.get(path.name, path.name)
        hint = ""
        if other != path and (other / WEIGHTS).is_file():
            hint = (f"; {other} is an export (learn.export() wrote its default name {FORMER_NAME!r} before "
                    f"{DEFAULT_NAME!r}, fastai's): load_learner({str(other)!r}, ...)")
        raise FileNotFoundError(f"{path} does not exist: pass the directory learn.export() wrote "
                                f"(learn.path/{DEFAULT_NAME!r} by default){hint}")
    if path.is_file():
        raise FileNotFoundError(f"{path} is a file, not the directory learn.export() writes (model.safetensors, "
                                f"learner.pkl, export.json): a file fastai's export wrote cannot be loaded by cadence")
    if not (path / WEIGHTS).is_file():
        raise FileNotFoundError(f"no {WEIGHTS} in the directory {path}: pass the directory learn.export() wrote")


_SETTINGS = ("metrics", "opt_func", "splitter", "lr", "wd", "wd_bn_bias", "train_bn", "moms")


def _computed_its_loss(path: Path) -> bool:
    """Whether the exported Learner had no loss_func (its model computes its loss), from the plain-JSON manifest."""
    try:
        return json.loads((path / MANIFEST).read_text()).get("loss_func") == "None"
    except (OSError, ValueError, AttributeError):
        return False


def _unpickle(path: Path, trust_pickle: bool) -> dict[str, Any]:
    if not trust_pickle:
        raise ValueError(f"rebuilding the model needs {path / PICKLE}, a pickle: unpickling runs whatever code the "
                         f"file names, so cadence does it only when you say you trust the file: "
                         f"load_learner({str(path)!r}, trust_pickle=True). Without unpickling, pass your own model: "
                         f"load_learner({str(path)!r}, model=MyModel(), loss_func=...) reads only the safetensors weights")
    return torch.load(path / PICKLE, map_location="cpu", weights_only=False)
