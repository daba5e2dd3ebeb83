"""`learn.save` / `learn.load`: the weights and the optimizer state as one unit, `models/<name>/`.

    models/stage1/model.safetensors    the user's module (loads with safetensors.torch.load_file)
    models/stage1/optimizer.pt         the optimizer state (torch.load(weights_only=True))

The pair is written into a staged directory and renamed into place, so a kill at any moment
leaves the previous pair or the new one, never a mix. The directory is checked before the
weights are gathered; a failed write names it and its free space and leaves no staged
directory. `load` also reads the layout of cadence 0.1 (`models/stage1.safetensors` +
`models/stage1.opt.pt`).

>>> learn.save("stage1"); learn.load("stage1")
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from ..disk import check_writable
from ..serialization import (STAGED, check_state_dict, commit_dir, load_torch, load_weights, recover_dir, save_torch,
                             save_weights, sibling, staging_dir, writing)

MODEL_FILE, OPTIMIZER_FILE = "model.safetensors", "optimizer.pt"


def save(learn: Any, name: str | Path, with_opt: bool = True) -> Path:
    """Write `path/model_dir/<name>/` (the main process writes; under a sharded engine every rank must call it)."""
    target = _target(learn, name)
    if Path(name).suffix in (".pth", ".pt", ".pkl") and learn.strategy.is_main:
        warnings.warn(f"learn.save({str(name)!r}) writes a directory, {target}/ ({MODEL_FILE}, {OPTIMIZER_FILE}), "
                      f"not fastai's single .pth file; load it with learn.load({str(name)!r}) (see docs/fastai.md)",
                      stacklevel=3)
    strategy = learn.strategy
    if strategy.is_main:
        check_writable(target.parent, "model directory")  # before the (collective) gathering of the weights
    weights = strategy.model_state_dict(learn.model)
    opt_state = strategy.optimizer_state_dict(learn.model, learn.opt) if with_opt else None
    if strategy.is_main:
        with writing(target, "saved model", sibling(target, STAGED)):
            recover_dir(target)
            staged = staging_dir(target)
            save_weights(weights, staged / MODEL_FILE)
            if opt_state is not None:
                save_torch(opt_state, staged / OPTIMIZER_FILE)
            commit_dir(staged, target)
    return target  # no barrier: under DDP a save called on the main process alone must not wait; `load` waits


def load(learn: Any, name: str | Path, with_opt: bool = True, strict: bool = True, device: Any = None) -> None:
    """Read what `save` wrote (or the 0.1 file pair) to `device` (default the CPU); both files are read and checked
    before anything is loaded.

    Every process calls it: they wait for the main one, which first finishes or drops a save that was killed.
    """
    strategy = learn.strategy
    target = _target(learn, name)
    if strategy.is_main:
        recover_dir(target)  # a save killed between its two renames is finished first
    strategy.barrier()
    weights_file, opt_file = _files(target, name)
    device = "cpu" if device is None else device
    weights = load_weights(weights_file, device)
    opt_state = None
    if with_opt and opt_file.is_file():
        opt_state = load_torch(opt_file, map_location=device)
    elif with_opt:
        warnings.warn(f"no optimizer state at {opt_file} (saved with with_opt=False?); the optimizer starts fresh; "
                      f"pass with_opt=False to load only the weights", stacklevel=3)
    strategy.wait_for_staging()  # an asynchronous save still copying the weights (SaveModel loads in after_fit)
    if strict:
        check_state_dict(strategy.state_template(learn.model), weights, source=str(weights_file))
        strategy.load_model_state_dict(learn.model, weights)
    else:
        strategy.load_model_state_dict(learn.model, _matching(strategy.state_template(learn.model), weights,
                                                              weights_file, strategy.is_main), strict=False)
    if opt_state is not None:
        strategy.load_optimizer_state_dict(learn.model, learn.opt, opt_state)


def _matching(template: Any, weights: dict, source: Path, main: bool) -> dict:
    """`learn.load(strict=False)`: the saved weights the model has a place for, the rest said once (fastai's
    `load_state_dict(strict=False)`: a new head keeps its fresh weights). A shape that differs is still an error."""
    names = template.state_dict()
    kept = {k: v for k, v in weights.items() if k in names}
    missing, unexpected = sorted(set(names) - set(kept)), sorted(set(weights) - set(kept))
    if main and (missing or unexpected):
        warnings.warn(f"learn.load(strict=False) from {source}: {len(missing)} of the model's weights not in the file "
                      f"keep their values {missing[:8]}{'...' if len(missing) > 8 else ''}; {len(unexpected)} in the "
                      f"file not in the model are ignored {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}",
                      stacklevel=4)
    return kept


def _target(learn: Any, name: str | Path) -> Path:
    """`path/model_dir/<name>` (an absolute `name` stays as it is); for loading, also a path that exists as given."""
    target = learn.path / learn.model_dir / name
    return Path(name) if not target.exists() and Path(name).exists() else target


def _files(target: Path, name: str | Path) -> tuple[Path, Path]:
    """(weights, optimizer) of a saved directory, or of the 0.1 pair `<name>.safetensors` + `<name>.opt.pt`."""
    if (target / MODEL_FILE).is_file():
        return target / MODEL_FILE, target / OPTIMIZER_FILE
    single = target if target.suffix == ".safetensors" else target.with_name(f"{target.name}.safetensors")
    if single.is_file():
        return single, single.with_suffix(".opt.pt")
    saved = sorted(p.name for p in target.parent.glob("*") if (p / MODEL_FILE).is_file() or p.suffix == ".safetensors")
    raise FileNotFoundError(f"nothing saved at {target}; saved in {target.parent}: {saved}")
