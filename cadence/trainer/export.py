"""`learn.export()`: a trained Learner for inference, weights as safetensors (`load_learner` reads it back: load.py).

An export is a directory, `learn.path/"export.pkl"` by default (fastai's name, so fastbook's
`learn.export(); load_learner(learn.path/"export.pkl")` works; exports from before cadence named the
default `export/` and load the same way):

    model.safetensors   the weights (loading them runs no code)
    learner.pkl         the model's structure (on the meta device: no weights), the loss function, n_inp, and
                        what training on needs as fastai keeps it (metrics, opt_func, splitter, lr, wd,
                        wd_bn_bias, train_bn, moms), pickled: unpickling runs whatever code the file names
    export.json         what the directory holds (plain JSON)

`load_learner(path, model=MyModel())` reads only the weights. Rebuilding the model from
`learner.pkl` needs `trust_pickle=True`, said explicitly by the caller, because a pickle can
run arbitrary code; cadence never unpickles silently.

The directory is written staged and swapped in whole (`serialization.replacing_dir`, as `save_model`):
a kill at any moment leaves the previous export or the new one under its name.

>>> learn.export()                                               # path/export.pkl/
>>> learn = load_learner("path/export.pkl", trust_pickle=True)   # a file you made or trust
>>> learn = load_learner("path/export.pkl", model=get_model(), loss_func=nn.CrossEntropyLoss())   # no unpickling
"""

from __future__ import annotations

import copy
import io
import json
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..serialization import REPLACED, recover_dir, replacing_dir, save_weights, sibling

FORMAT = 1
WEIGHTS, PICKLE, MANIFEST = "model.safetensors", "learner.pkl", "export.json"
DEFAULT_NAME, FORMER_NAME = "export.pkl", "export"   # fastai's name (a directory here); the default before it


def _skeleton(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and saved buffers are on the meta device (no memory, no values).

    Buffers outside the state dict (non-persistent) keep their values: the weights file does not hold them.
    """
    memo = {id(t): (nn.Parameter(torch.empty_like(t, device="meta"), t.requires_grad) if isinstance(t, nn.Parameter)
                    else torch.empty_like(t, device="meta"))
            for t in model.state_dict(keep_vars=True).values()}
    skeleton = copy.deepcopy(model, memo)
    _drop_unpicklable_hooks(skeleton)
    return skeleton


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
          "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def _drop_unpicklable_hooks(model: nn.Module) -> None:
    """Remove the hooks of `model` that cannot be pickled (a local function, such as the one transformers'
    `gradient_checkpointing_enable` registers to make inputs require gradients), naming them in a warning."""
    dropped = []
    for name, module in model.named_modules():
        for kind in _HOOKS:
            hooks = getattr(module, kind, None)
            for key, hook in list((hooks or {}).items()):
                try:
                    pickle.dumps(hook)
                except Exception:
                    del hooks[key]
                    dropped.append(f"{name or 'model'}: {getattr(hook, '__qualname__', repr(hook))}")
    if dropped:
        warnings.warn(f"export leaves out hooks that cannot be pickled ({'; '.join(dropped)}); the loaded model runs "
                      f"without them", stacklevel=4)


def _pickled(learn, module: nn.Module) -> bytes:
    buffer = io.BytesIO()
    settings = _settings(learn)
    try:
        torch.save({"model": _skeleton(module), "loss_func": learn.loss_func, "n_inp": learn.dls.n_inp, **settings},
                   buffer)
    except Exception as e:
        raise TypeError(f"export could not pickle the model or the loss function ({type(e).__name__}: {e}); define "
                        f"their classes and functions at module level (not lambdas or local classes), and under a "
                        f"sharding engine call export after the distrib_ctx block") from e
    return buffer.getvalue()


def _settings(learn) -> dict:
    """The Learner's arguments that `load_learner` gives back (fastai pickles the whole Learner), the metrics without
    what their last pass accumulated; one that cannot be pickled (a lambda) is left out, with a warning: the
    loaded Learner then has the default."""
    metrics = [copy.copy(m) for m in learn.metrics if _picklable(m, f"metric {m.name}")]
    for m in metrics:
        m.reset()
    settings = {"metrics": metrics, "opt_func": learn.opt_func, "splitter": learn.splitter, "lr": learn.lr,
                "wd": learn.wd, "wd_bn_bias": learn.wd_bn_bias, "train_bn": learn.train_bn, "moms": learn.moms}
    return {name: value for name, value in settings.items() if _picklable(value, name)}


def _picklable(value: Any, name: str) -> bool:
    try:
        pickle.dumps(value)
    except Exception as e:
        warnings.warn(f"export: the Learner's {name} cannot be pickled ({type(e).__name__}: {e}); load_learner will "
                      f"leave it out (or give the default). Define it at module level (not a lambda) to keep it",
                      stacklevel=4)
        return False
    return True


def export(learn, fname: str | os.PathLike = DEFAULT_NAME) -> Path:
    """Write `learn.path / fname` (see the module docstring); every process calls it, the main one writes."""
    strategy = learn.strategy
    target = Path(fname) if Path(fname).is_absolute() else learn.path / fname
    module = strategy.unwrap(learn.model)
    state = strategy.model_state_dict(learn.model)   # a collective for sharded engines: every rank
    failure = None
    if strategy.is_main:
        _warn_former_default(fname, target)
        try:
            _refuse_file(target)
            _write(learn, module, state, target)
        except Exception as e:
            failure = e
    # every process learns how the main one's write ended (a barrier would leave the others waiting there while a
    # failed main process goes on to the next collective, distrib_ctx's exit, and the run would hang unexplained)
    said = strategy.broadcast([None if failure is None else f"{type(failure).__name__}: {failure}"])[0]
    if failure is not None:
        raise failure
    if said is not None:
        raise RuntimeError(f"export failed on the main process ({said.splitlines()[0][:300]})")
    return target


def _refuse_file(target: Path) -> None:
    """Refuse to export over a file (an export is a directory): at fastai's default name it is most likely
    fastai's own pickle, which cadence neither replaces nor hides. A file an earlier cadence hid at the ".old" name
    while exporting over it is given back its name when that is free (`recover_dir`), else named here."""
    recover_dir(target)
    if target.is_file():
        raise FileExistsError(f"export: {target} is a file, not a cadence export (a directory): probably a fastai "
                              f"export pickle, left as it is. Pass another name, learn.export('name'), or move the file")
    hidden = sibling(target, REPLACED)
    if hidden.is_file():
        raise FileExistsError(f"export: {hidden} is a file, not an export cadence moved aside: probably a fastai "
                              f"export pickle an earlier cadence version hid there while exporting over it, left as "
                              f"it is. Move or rename it, then export again")


def _warn_former_default(fname: str | os.PathLike, target: Path) -> None:
    """Say so when the default name is written beside an export under the former default name, which a script
    loading `load_learner("export")` would read, older than this one."""
    former = target.parent / FORMER_NAME
    if str(fname) == DEFAULT_NAME and (former / WEIGHTS).is_file():
        warnings.warn(f"learn.export() writes {target} (fastai's name {DEFAULT_NAME!r}; the default was "
                      f"{FORMER_NAME!r} before): {former} is an older export, left as it was. Load the new one with "
                      f"load_learner({str(target)!r}), or pass learn.export({FORMER_NAME!r}) to keep the former name",
                      stacklevel=4)


def _write(learn, module: nn.Module, state: dict[str, torch.Tensor], target: Path) -> None:
    pickled = _pickled(learn, module)             # fails before anything is written
    manifest = {"format": FORMAT, "model_class": f"{type(module).__module__}.{type(module).__qualname__}",
                "loss_func": repr(learn.loss_func),
                "files": {WEIGHTS: "safetensors weights", PICKLE: "pickled structure"}}
    with replacing_dir(target, "export") as staged:
        save_weights(state, staged / WEIGHTS)
        _write_synced(staged / PICKLE, pickled)
        _write_synced(staged / MANIFEST, json.dumps(manifest, indent=2).encode())


def _write_synced(path: Path, data: bytes) -> None:
    """Write `data` and fsync it: on disk before the export it belongs to is swapped in."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
