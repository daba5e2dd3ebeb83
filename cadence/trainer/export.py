"""`learn.export()` / `load_learner()`: a trained Learner for inference, weights as safetensors.

An export is a directory:

    model.safetensors   the weights (loading them runs no code)
    learner.pkl         the model's structure (on the meta device: no weights), the loss function and n_inp,
                        pickled: unpickling runs whatever code the file names
    export.json         what the directory holds (plain JSON)

`load_learner(path, model=MyModel())` reads only the weights. Rebuilding the model from
`learner.pkl` needs `trust_pickle=True`, said explicitly by the caller, because a pickle can
run arbitrary code; cadence never unpickles silently.

>>> learn.export("export")                                   # path/export/
>>> learn = load_learner("path/export", trust_pickle=True)   # a file you made or trust
>>> learn = load_learner("path/export", model=get_model(), loss_func=nn.CrossEntropyLoss())   # no unpickling
"""

from __future__ import annotations

import copy
import io
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..serialization import check_state_dict, load_weights, save_weights
from .data import DataLoaders

if TYPE_CHECKING:
    from .learner import Learner

FORMAT = 1
WEIGHTS, PICKLE, MANIFEST = "model.safetensors", "learner.pkl", "export.json"


def _skeleton(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and saved buffers are on the meta device (no memory, no values).

    Buffers outside the state dict (non-persistent) keep their values: the weights file does not hold them.
    """
    memo = {id(t): (nn.Parameter(torch.empty_like(t, device="meta"), t.requires_grad) if isinstance(t, nn.Parameter)
                    else torch.empty_like(t, device="meta"))
            for t in model.state_dict(keep_vars=True).values()}
    return copy.deepcopy(model, memo)


def _pickled(learn: "Learner", module: nn.Module) -> bytes:
    buffer = io.BytesIO()
    try:
        torch.save({"model": _skeleton(module), "loss_func": learn.loss_func, "n_inp": learn.dls.n_inp}, buffer)
    except Exception as e:
        raise TypeError(f"export could not pickle the model or the loss function ({type(e).__name__}: {e}); define "
                        f"their classes and functions at module level (not lambdas or local classes), and under a "
                        f"sharding engine call export after the distrib_ctx block") from e
    return buffer.getvalue()


def export(learn: "Learner", fname: str | os.PathLike = "export") -> Path:
    """Write `learn.path / fname` (see the module docstring); every process calls it, the main one writes."""
    strategy = learn.strategy
    target = Path(fname) if Path(fname).is_absolute() else learn.path / fname
    module = strategy.unwrap(learn.model)
    state = strategy.model_state_dict(learn.model)   # a collective for sharded engines: every rank
    if strategy.is_main:
        pickled = _pickled(learn, module)             # fails before anything is written
        tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_weights(state, tmp / WEIGHTS)
        (tmp / PICKLE).write_bytes(pickled)
        (tmp / MANIFEST).write_text(json.dumps({
            "format": FORMAT, "model_class": f"{type(module).__module__}.{type(module).__qualname__}",
            "loss_func": repr(learn.loss_func), "files": {WEIGHTS: "safetensors weights", PICKLE: "pickled structure"}},
            indent=2))
        _replace_dir(tmp, target)
    strategy.barrier()
    return target


def _replace_dir(new: Path, target: Path) -> None:
    """Put directory `new` at `target`; an existing export there is removed only once `new` is in place."""
    old = target.with_name(f".{target.name}.old{os.getpid()}")
    if target.exists():
        target.rename(old)
    new.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def _no_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
    raise ValueError("this Learner was loaded for inference without a loss function: "
                     "pass load_learner(path, ..., loss_func=...) to compute losses")


def load_learner(path: str | os.PathLike, trust_pickle: bool = False, model: nn.Module | None = None,
                 loss_func: Callable | None = None, cpu: bool = True) -> "Learner":
    """A Learner for inference (`predict`, `get_preds(dl=...)`) from a directory written by `learn.export`.

    With `model` (your own instance of the architecture) only the safetensors weights are read.
    Without it the model is rebuilt from `learner.pkl`, which needs `trust_pickle=True`. `cpu`
    puts the model on the CPU (else the default device).

    >>> learn = load_learner("models/export", trust_pickle=True)
    >>> learn.predict(x)
    """
    from .learner import Learner

    path = Path(path)
    if not (path / WEIGHTS).is_file():
        raise FileNotFoundError(f"no {WEIGHTS} in {path}: pass the directory written by learn.export()")
    state = load_weights(path / WEIGHTS)
    extra: dict[str, Any] = {}
    if model is None or (loss_func is None and trust_pickle):
        extra = _unpickle(path, trust_pickle)
    if model is None:
        model = extra["model"]
        check_state_dict(model, state, source=str(path / WEIGHTS))
        model.load_state_dict(state, assign=True)
    else:
        check_state_dict(model, state, source=str(path / WEIGHTS))
        model.load_state_dict(state)
    loss_func = loss_func or extra.get("loss_func") or _no_loss
    dls = DataLoaders([], None, device="cpu" if cpu else None, n_inp=extra.get("n_inp"))
    return Learner(dls, model, loss_func=loss_func)


def _unpickle(path: Path, trust_pickle: bool) -> dict[str, Any]:
    if not trust_pickle:
        raise ValueError(f"rebuilding the model needs {path / PICKLE}, a pickle: unpickling runs whatever code the "
                         f"file names, so cadence does it only when you say you trust the file: "
                         f"load_learner({str(path)!r}, trust_pickle=True). Without unpickling, pass your own model: "
                         f"load_learner({str(path)!r}, model=MyModel(), loss_func=...) reads only the safetensors weights")
    return torch.load(path / PICKLE, map_location="cpu", weights_only=False)
