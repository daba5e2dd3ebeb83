"""`Accelerator.save_state` / `load_state`: one checkpoint directory holding everything `prepare` returned.

Layout (the Learner's checkpoint files where they overlap)::

    model.safetensors, optimizer.pt   the first model and its optimizer, in the strategy's format
    model_<i>/                        every further model (and its optimizer) the same way
    scheduler_<i>.pt                  each prepared scheduler's state_dict
    custom_checkpoint_<i>.pt          each object given to register_for_checkpointing
    optimizer_<i>.pt                  each prepared optimizer bound to no model (a model's second optimizer)
    precision.pt                      the fp16 GradScaler's state
    rng-rank<r>.pt                    every process's RNG states
    state.json                        loader positions, step counter, the engine and mesh of sharded models
                                      ("mesh"); written last: marks a complete checkpoint

`safe_serialization=False` writes Accelerate's layout instead (`pytorch_model.bin`, `optimizer.bin`,
`random_states_0.pkl`, ...: see `accelerate_files`), which Accelerate's `load_state` reads too; as after
Accelerate's own, the loaders then start their epoch from the beginning.

Like the Learner's checkpoints it is written under a temporary name and renamed once every
process's files are in place, so a crash mid-save never leaves a half-written checkpoint behind
and never removes the last good one: with automatic naming, `total_limit` removes the oldest
checkpoints only once the new one is in place, and only folders that a `save_state` wrote (never a
symlink, never the user's own `checkpoint_<n>` folder). Files are read back with `weights_only=True`
and safetensors.

>>> save_accelerator_state(accelerator, "ckpt/epoch-3")
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

from ..callbacks.checkpoint import rng_state, set_rng_state
from ..callbacks.checkpoint.layout import check_engine_reads
from ..callbacks.checkpoint.writer import BackgroundWrite
from ..distributed.model_parallel import checkpoint_layout
from ..distributed.state_files import load_optimizer_file, save_optimizer_file
from ..distributed.staging import host_copy
from ..serialization import (DELETED, STAGED, atomic_path, check_state_dict, commit_dir, load_torch, load_weights,
                             remove_dir, save_torch, save_weights, sibling, staging_dir, writing)
from .accelerate_checkpoint import full_optimizer_state, accelerate_files, is_accelerate_checkpoint
from .preparation import owning_model
from .state_hooks import run_load_hooks, run_save_hooks

__all__ = ["save_accelerator_state", "load_accelerator_state", "automatic_checkpoint_dir", "latest_checkpoint_dir",
           "prune_checkpoints"]

FORMAT = 1
_NAME = re.compile(r"checkpoint_(\d+)$")


def _unit_dir(root: Path, i: int) -> Path:
    return root if i == 0 else root / f"model_{i}"


def _numbered(root: Path) -> list[Path]:
    found = [d for d in root.glob("checkpoint_*") if d.is_dir() and _NAME.fullmatch(d.name)]
    return sorted(found, key=lambda d: int(_NAME.fullmatch(d.name).group(1)))


def automatic_checkpoint_dir(project_dir: Path, iteration: int) -> Path:
    """`project_dir/checkpoints/checkpoint_<iteration>`; ValueError when that name is taken (a folder, a file or a
    symlink). Nothing is removed here: `save_accelerator_state` prunes to `total_limit` once the new checkpoint is in
    place (`prune_checkpoints`), so a failed save keeps every earlier one.

    >>> automatic_checkpoint_dir(Path("runs/exp1"), 3)
    PosixPath('runs/exp1/checkpoints/checkpoint_3')
    """
    root = project_dir / "checkpoints"
    target = root / f"checkpoint_{iteration}"
    if os.path.lexists(target):
        taken = max(int(m.group(1)) for m in map(_NAME.fullmatch, os.listdir(root)) if m)
        raise ValueError(f"{target} already exists; set ProjectConfiguration(iteration=...) past the numbers taken "
                         f"(the highest under {root} is {taken}) or choose another project_dir")
    return target


def _is_saved_checkpoint(directory: Path) -> bool:
    """Whether `directory` is a real folder (not a symlink) holding a complete checkpoint of a `save_state`:
    cadence's `state.json`, or Accelerate's files. Only these count towards `total_limit` and are ever removed."""
    if directory.is_symlink() or not directory.is_dir():
        return False
    if is_accelerate_checkpoint(directory):
        return True
    try:
        state = json.loads((directory / "state.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and isinstance(state.get("format"), int) and {"models", "step"} <= state.keys()


def prune_checkpoints(root: Path, total_limit: int, newest: Path) -> list[Path]:
    """Remove the oldest complete checkpoints under `root` (main process, after `newest` is in place) so that
    `total_limit` remain, `newest` among them; returns the removed ones. Folders that no `save_state` wrote and
    symlinks are left alone; one that cannot be removed is warned of, the save stands.

    >>> prune_checkpoints(Path("runs/exp1/checkpoints"), 2, Path("runs/exp1/checkpoints/checkpoint_7"))
    [PosixPath('runs/exp1/checkpoints/checkpoint_5')]
    """
    older = [d for d in _numbered(root) if d != newest and _is_saved_checkpoint(d)]
    removed = []
    for old in older[:max(len(older) + 1 - total_limit, 0)]:
        try:
            remove_dir(old)   # renamed to a hidden tombstone first: a kill never leaves half of it under its name
            removed.append(old)
        except OSError as e:
            warnings.warn(f"total_limit={total_limit}: could not remove the old checkpoint {old} ({e}); the new one "
                          f"{newest} is saved: remove {old} yourself", stacklevel=2)
    for tomb in root.glob(f".checkpoint_*{DELETED}"):   # what a killed removal left
        if _NAME.fullmatch(tomb.name[1:-len(DELETED)]) and tomb.is_dir() and not tomb.is_symlink():
            shutil.rmtree(tomb, ignore_errors=True)
    return removed


def latest_checkpoint_dir(project_dir: Path) -> Path:
    """The highest-numbered complete `checkpoint_<n>` under `project_dir/checkpoints` (cadence's or Accelerate's)."""
    found = [d for d in _numbered(project_dir / "checkpoints")
             if (d / "state.json").is_file() or is_accelerate_checkpoint(d)]
    if not found:
        raise FileNotFoundError(f"no complete checkpoint under {project_dir / 'checkpoints'}; "
                                f"call save_state() first or pass load_state(path)")
    return found[-1]


def save_accelerator_state(acc: Any, directory: str | os.PathLike, async_save: bool = False,
                           safe_serialization: bool = True) -> BackgroundWrite:
    """Write models, optimizers, schedulers, registered objects, precision, RNG and loader positions (every process
    calls it). Returns the write, committed already; with `async_save` the state is only copied to host memory
    and the write goes on in the background: `.wait()` (every process) finishes it and raises what failed.
    `safe_serialization=False`: Accelerate's layout, the weights in `pytorch_model.bin` (see the module docstring).

    >>> save_accelerator_state(accelerator, "ckpt/step-100", safe_serialization=False).committed
    True
    """
    directory, main = Path(directory), acc.is_main_process
    tmp = sibling(directory, STAGED)
    if main:
        staging_dir(directory)
    acc.wait_for_everyone()
    with writing(directory, "checkpoint", tmp if main else None):   # a failure before the write frees it too
        staged = (_take_state(acc, directory, tmp, async_save) if safe_serialization else
                  _take_accelerate_state(acc, directory, tmp, async_save))
    config = acc.project_configuration   # automatic naming: the oldest go once this one is in place, not before
    limit = config.total_limit if config.automatic_checkpoint_naming else None
    prune = None if limit is None else lambda: prune_checkpoints(directory.parent, limit, directory)
    write = BackgroundWrite(staged, acc.strategy, None, directory, on_commit=prune).start()
    if not async_save:
        write.wait()
    return write


def _take_state(acc: Any, directory: Path, tmp: Path, async_save: bool) -> "_StagedSave":
    """Run the save hooks and take what this process writes (copied to host memory with `async_save`)."""
    main = acc.is_main_process
    skipped = run_save_hooks(acc, str(tmp))   # what they write in the staged folder is committed with the rest
    writers = []
    for i, (model, opt) in enumerate(acc._units()):
        unit = _unit_dir(tmp, i)
        if main:
            unit.mkdir(parents=True, exist_ok=True)
        acc.wait_for_everyone()
        if i in skipped:   # a hook saved the weights its own way: the optimizer only
            if opt is not None and main:
                opt_state = acc.strategy.optimizer_state_dict(model, opt)
                opt_state = host_copy(opt_state) if async_save else opt_state
                writers.append(lambda opt_state=opt_state, unit=unit: save_optimizer_file(opt_state, unit))
        elif opt is not None:
            writers.append(acc.strategy.checkpoint_writer(unit, model, opt, copy=async_save))
        else:
            weights = acc.strategy.model_state_dict(model)
            if main:
                weights = host_copy(weights) if async_save else weights
                writers.append(lambda weights=weights, unit=unit: save_weights(weights, unit / "model.safetensors"))
    files = {f"rng-rank{acc.process_index}.pt": rng_state(acc.strategy)}
    state = None
    if main:
        files.update({f"scheduler_{i}.pt": sched.state_dict() for i, sched in enumerate(acc._schedulers)})
        files.update({f"custom_checkpoint_{i}.pt": obj.state_dict() for i, obj in enumerate(acc._custom_objects)})
        files.update({f"optimizer_{i}.pt": full_optimizer_state(acc, opt) for i, opt in enumerate(_standalone(acc))})
        files["precision.pt"] = acc.strategy.precision.state_dict()
        files = host_copy(files) if async_save else files
        state = {"format": FORMAT, "models": len(acc._models), "step": acc.step,
                 "dataloaders": [dl.base.state_dict() for dl in acc._dataloaders], "world_size": acc.num_processes,
                 "mesh": checkpoint_layout(acc.strategy)}
    return _StagedSave(directory, tmp, [w for w in writers if w is not None], files, state)


def _take_accelerate_state(acc: Any, directory: Path, tmp: Path, async_save: bool) -> "_StagedSave":
    """Run the save hooks and take Accelerate's files (no `state.json`: the folder is Accelerate's checkpoint)."""
    files = accelerate_files(acc, run_save_hooks(acc, str(tmp)))
    return _StagedSave(directory, tmp, [], host_copy(files) if async_save else files, None)


class _StagedSave:
    """What `save_accelerator_state` took: `write` (this process's files, any thread), `commit` (the main process)."""

    def __init__(self, directory: Path, tmp: Path, writers: list, files: dict[str, Any], state: dict | None):
        self.directory, self.tmp, self.writers, self.files, self.state = directory, tmp, writers, files, state

    def write(self) -> None:
        with writing(self.directory, "checkpoint", self.tmp):   # a full disk names the checkpoint, frees the staged copy
            for write in self.writers:
                write()
            for name, obj in self.files.items():
                save_torch(obj, self.tmp / name)

    def commit(self) -> None:
        if self.state is not None:   # None: Accelerate's layout, complete without it
            with atomic_path(self.tmp / "state.json") as f:
                f.write_text(json.dumps(self.state, indent=1))
        commit_dir(self.tmp, self.directory)


def load_accelerator_state(acc: Any, directory: str | os.PathLike) -> dict[str, Any]:
    """Read what `save_accelerator_state` wrote into the prepared objects; checked against the models first, and a
    sharded model against this Accelerator's engine (`layout.check_engine_reads`: the plain engine of one process
    does not read FSDP's or tensor parallelism's shards)."""
    directory = Path(directory)
    if not (directory / "state.json").is_file():
        raise FileNotFoundError(f"no complete checkpoint at {directory} (state.json missing)")
    state = json.loads((directory / "state.json").read_text())
    if state.get("format") != FORMAT or state["models"] != len(acc._models):
        raise ValueError(f"{directory} holds {state.get('models')} model(s) (format {state.get('format')}); "
                         f"this Accelerator prepared {len(acc._models)}: prepare the same objects as the saving run")
    _check_counts(directory, "scheduler", len(acc._schedulers))
    _check_counts(directory, "custom_checkpoint", len(acc._custom_objects))
    _check_counts(directory, "optimizer", len(_standalone(acc)))
    for i, (_, opt) in enumerate(acc._units()):
        if opt is not None:   # a model saved with its optimizer: in the engine's format
            check_engine_reads(acc.strategy, directory, state, "accelerator", unit=_unit_dir(directory, i))
    skipped = run_load_hooks(acc, str(directory))
    for i, (model, opt) in enumerate(acc._units()):
        unit = _unit_dir(directory, i)
        if i in skipped:   # a hook loaded the weights its own way: the optimizer only
            if opt is not None:
                acc.strategy.load_optimizer_state_dict(model, opt, load_optimizer_file(unit))
        elif opt is not None:
            acc.strategy.load_checkpoint(unit, model, opt)
        else:
            weights = load_weights(unit / "model.safetensors")
            check_state_dict(acc.strategy.unwrap(model), weights, source=str(unit))
            acc.strategy.load_model_state_dict(model, weights)
    for i, sched in enumerate(acc._schedulers):
        sched.load_state_dict(load_torch(directory / f"scheduler_{i}.pt"))
    for i, obj in enumerate(acc._custom_objects):
        obj.load_state_dict(load_torch(directory / f"custom_checkpoint_{i}.pt"))
    for i, opt in enumerate(_standalone(acc)):
        owner, opt_state = owning_model(acc, opt), load_torch(directory / f"optimizer_{i}.pt")
        if owner is not None:
            acc.strategy.load_optimizer_state_dict(owner, opt.optimizer, opt_state)
        else:
            opt.optimizer.load_state_dict(opt_state)
    acc.strategy.precision.load_state_dict(load_torch(directory / "precision.pt"))
    rng = directory / f"rng-rank{acc.process_index}.pt"
    if rng.is_file():
        set_rng_state(load_torch(rng), acc.strategy)
    moved = []
    for dl, dl_state in zip(acc._dataloaders, state["dataloaders"]):
        layout = dl_state.get("world_size", dl.base.world_size), dl_state.get("batch_size", dl.base.dl.batch_size)
        if layout == (dl.base.world_size, dl.base.dl.batch_size):
            _restore_position(dl, dl_state)
        else:   # a position counts batches dealt to the saving run's data-parallel processes
            moved.append(f"{layout[0]} x {layout[1]} then, {dl.base.world_size} x {dl.base.dl.batch_size} now")
    if moved and acc.is_main_process:
        warnings.warn(f"{directory} was saved with other loader layouts (data-parallel processes x batch size: "
                      f"{'; '.join(moved)}): those loaders' position is not restored, so each starts its epoch from "
                      f"the beginning, as Accelerate's loaders do after load_state; skip what the saving run had done "
                      f"with skip_first_batches(dl, n)", stacklevel=3)
    acc.step = state["step"]
    return state


def _standalone(acc: Any) -> list:
    """The prepared optimizers saved apart: those bound to no prepared model (a model's second optimizer, or one
    over parameters of no prepared model)."""
    bound = {id(opt) for opt in acc._stepper.values()}
    return [opt for opt in acc._optimizers if id(opt) not in bound]


def _check_counts(directory: Path, prefix: str, expected: int) -> None:
    saved = len(list(directory.glob(f"{prefix}_*.pt")))
    if saved != expected:
        raise ValueError(f"{directory} holds {saved} {prefix} file(s) but {expected} were prepared/registered; "
                         f"prepare and register the same objects, in the same order, as the saving run")


def _restore_position(dl: Any, state: dict[str, Any]) -> None:
    """Continue where the loader stood: the rest of its epoch, or the next epoch when that one was finished."""
    complete = state["epoch_complete"] if "epoch_complete" in state else state["batches_done"] >= len(dl)  # older
    # states lack the flag; a stream without length has one
    dl.base.load_state_dict({**state, "epoch_complete": complete})
