"""Hugging Face Accelerate's `save_state` layout: `load_state` of a checkpoint Accelerate wrote, so a run moved to
cadence resumes, and the files `save_state(safe_serialization=False)` writes in that layout (`accelerate_files`), so
Accelerate's `load_state` reads them too.

Accelerate's layout (one process or DDP; FSDP and DeepSpeed write their own, refused here)::

    model.safetensors or pytorch_model.bin      the first model (`model_1.safetensors`, ... the others)
    optimizer.bin, optimizer_1.bin, ...         each prepared optimizer's state_dict, in prepare order
    scheduler.bin, scheduler_1.bin, ...         each prepared scheduler's state_dict
    custom_checkpoint_0.pkl, ...                each object given to register_for_checkpointing
    random_states_<process>.pkl                 python's, numpy's and torch's RNG states, and `accelerator.step`
    scaler.pt                                   the fp16 GradScaler's state

Every file is a pickle (torch.save). None is unpickled in full, since a pickle can run code: each is read with
`torch.load(weights_only=True)` (tensors, numbers, strings and plain containers) and, as Accelerate's own reader
does, numpy arrays allowed (the numpy RNG state is one). A file holding any other object is refused, the file and
the objects named. The loaders start their epoch from the beginning, as Accelerate's plain loaders do after
`load_state` (a script skips the batches done with `skip_first_batches`); `sampler.bin` (a pickled sampler) and
`dl_state_dict.bin` (a StatefulDataLoader's position) are not read, with a warning.
Weights saved under DDP (`module.` names) or from a compiled model (`_orig_mod.`) load into the plain model.

>>> load_accelerate_checkpoint(accelerator, "accelerate_run/checkpoints/checkpoint_3")
"""

from __future__ import annotations

import codecs
import contextlib
import os
import pickle
import random
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..serialization import check_state_dict, load_weights, strip_compile_prefix
from ..tied_weights import tied_names
from .preparation import owning_model
from .state_hooks import run_load_hooks

__all__ = ["is_accelerate_checkpoint", "load_accelerate_checkpoint", "accelerate_files"]

# numpy arrays are numbers, not code: what Accelerate's reader allows too (the numpy RNG state is an array)
_NUMPY_ARRAYS = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), codecs.encode,
                 (np._core if hasattr(np, "_core") else np.core).multiarray._reconstruct]
_NOT_READ = ("sampler*.bin", "dl_state_dict*.bin")


def is_accelerate_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds a checkpoint of Accelerate's `save_state` (its RNG file, no cadence `state.json`).

    >>> is_accelerate_checkpoint("accelerate_run/checkpoints/checkpoint_3")
    True
    """
    directory = Path(directory)
    return not (directory / "state.json").is_file() and any(directory.glob("random_states_*.pkl"))


def load_accelerate_checkpoint(acc: Any, directory: str | os.PathLike) -> None:
    """Read Accelerate's files into the prepared models, optimizers, schedulers, registered objects, RNGs and
    `acc.step`. The load hooks run first (a hook may load a model itself); then the numbers of files are checked
    against what was prepared, before cadence loads any of them.

    >>> load_accelerate_checkpoint(accelerator, "accelerate_run/checkpoints/checkpoint_3")
    """
    directory = Path(directory)
    _refuse_sharded(directory)
    skipped = run_load_hooks(acc, str(directory))
    # Accelerate numbers the weight files over the models its save hooks left, as it loads them
    models = [m for i, m in enumerate(acc._models) if i not in skipped]
    files = [_weights_file(directory, i) for i in range(len(models))]
    _check_count(directory, r"(pytorch_)?model(_\d+)?\.(safetensors|bin)", len(models), "model")
    _check_count(directory, r"optimizer(_\d+)?\.bin", len(acc._optimizers), "optimizer")
    _check_count(directory, r"scheduler(_\d+)?\.bin", len(acc._schedulers), "scheduler")
    _check_count(directory, r"custom_checkpoint_\d+\.pkl", len(acc._custom_objects), "custom_checkpoint")
    for model, path in zip(models, files):
        _load_model(acc, model, path)
    for i, opt in enumerate(acc._optimizers):
        owner = owning_model(acc, opt)
        state = _read(directory / _numbered("optimizer", i, ".bin"))
        if owner is not None:
            acc.strategy.load_optimizer_state_dict(owner, opt.optimizer, state)
        else:
            opt.optimizer.load_state_dict(state)
    for i, sched in enumerate(acc._schedulers):
        sched.load_state_dict(_read(directory / _numbered("scheduler", i, ".bin")))
    for i, obj in enumerate(acc._custom_objects):
        obj.load_state_dict(_read(directory / f"custom_checkpoint_{i}.pkl"))
    scaler = getattr(acc.strategy.precision, "scaler", None)
    if scaler is not None and (directory / "scaler.pt").is_file():
        scaler.load_state_dict(_read(directory / "scaler.pt"))
    _load_rng(acc, directory / f"random_states_{acc.process_index}.pkl")
    not_read = sorted(p.name for pattern in _NOT_READ for p in directory.glob(pattern))
    if not_read:
        warnings.warn(f"{directory}: {', '.join(not_read)} not read (a pickled sampler, a loader's position); the "
                      f"loaders start their epoch from the beginning: skip the batches already done with "
                      f"accelerator.skip_first_batches", stacklevel=3)


def accelerate_files(acc: Any, skipped: set[int]) -> dict[str, Any]:
    """{file name: object} this process writes for Accelerate's `save_state(safe_serialization=False)`, named as
    Accelerate names them: `pytorch_model.bin` (the weights of each model no save hook handled, with DDP's
    `module.` names under DDP, as Accelerate's), `optimizer.bin`, `scheduler.bin`, `custom_checkpoint_<i>.pkl`,
    `scaler.pt` (fp16) and `random_states_<process>.pkl` (python, numpy and torch RNG states and `acc.step`).
    Every process calls it (a sharded model's weights are gathered); all but the main one write only their RNG file.

    >>> sorted(accelerate_files(accelerator, set()))
    ['optimizer.bin', 'pytorch_model.bin', 'random_states_0.pkl']
    """
    main = acc.is_main_process
    models = [m for i, m in enumerate(acc._models) if i not in skipped]
    weights = [_accelerate_names(m, acc.strategy.model_state_dict(m)) for m in models]
    optimizers = [full_optimizer_state(acc, opt) for opt in acc._optimizers]
    files: dict[str, Any] = {}
    if main:
        files.update({_numbered("pytorch_model", i, ".bin"): w for i, w in enumerate(weights)})
        files.update({_numbered("optimizer", i, ".bin"): o for i, o in enumerate(optimizers)})
        files.update({_numbered("scheduler", i, ".bin"): s.state_dict() for i, s in enumerate(acc._schedulers)})
        files.update({f"custom_checkpoint_{i}.pkl": o.state_dict() for i, o in enumerate(acc._custom_objects)})
        scaler = getattr(acc.strategy.precision, "scaler", None)
        if scaler is not None:
            files["scaler.pt"] = scaler.state_dict()
    states = {"step": acc.step, "random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
              "torch_manual_seed": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    files[f"random_states_{acc.process_index}.pkl"] = states
    return files


def _accelerate_names(model: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Accelerate saves the prepared model's own state dict: under DDP, names start with `module.`."""
    ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    return {f"module.{k}": v for k, v in weights.items()} if ddp else weights


def full_optimizer_state(acc: Any, opt: Any) -> dict:
    owner = owning_model(acc, opt)
    return acc.strategy.optimizer_state_dict(owner, opt.optimizer) if owner is not None else opt.optimizer.state_dict()


def _numbered(stem: str, i: int, suffix: str) -> str:
    """Accelerate's file names: `optimizer.bin` for the first, `optimizer_1.bin` for the second, ..."""
    return f"{stem}{'' if i == 0 else f'_{i}'}{suffix}"


def _weights_file(directory: Path, i: int) -> Path:
    for name in (_numbered("model", i, ".safetensors"), _numbered("pytorch_model", i, ".bin")):
        if (directory / name).is_file():
            return directory / name
    raise FileNotFoundError(f"{directory} has no weights for prepared model {i} "
                            f"({_numbered('model', i, '.safetensors')} or {_numbered('pytorch_model', i, '.bin')}); "
                            f"prepare the same models, in the same order, as the Accelerate run that saved it")


def _check_count(directory: Path, pattern: str, expected: int, what: str) -> None:
    saved = sum(1 for p in directory.iterdir() if re.fullmatch(pattern, p.name))
    if saved != expected:
        raise ValueError(f"{directory} holds {saved} {what} file(s) but {expected} were prepared/registered; prepare "
                         f"and register the same objects, in the same order, as the Accelerate run that saved it")


def _refuse_sharded(directory: Path) -> None:
    engine_files = [p.name for p in directory.iterdir()
                    if p.name.startswith("pytorch_model_fsdp") or (p.is_dir() and p.name.startswith("pytorch_model"))]
    if engine_files:
        raise ValueError(f"{directory} was written by Accelerate under FSDP or DeepSpeed ({', '.join(engine_files)}); "
                         f"cadence reads the checkpoints of Accelerate's unsharded runs (one process or DDP): save one "
                         f"with Accelerate's save_model and load the weights with load_checkpoint_in_model")


@contextlib.contextmanager
def _numpy_arrays_allowed():
    scoped = getattr(torch.serialization, "safe_globals", None)   # torch >= 2.5; before it, arrays are refused
    with scoped(_NUMPY_ARRAYS) if scoped is not None else contextlib.nullcontext():
        yield


def _read(path: Path) -> Any:
    """`torch.load(weights_only=True)`, numpy arrays allowed; ValueError naming the file and what it holds besides."""
    try:
        with _numpy_arrays_allowed():
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        found = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", lambda p: ["other objects"])(path)
        raise ValueError(f"{path} holds Python objects cadence does not unpickle ({', '.join(found)}): unpickling "
                         f"them could run code from the file. If you trust it, load it yourself, e.g. "
                         f"obj.load_state_dict(torch.load(path, weights_only=False)), and leave it out of "
                         f"load_state (rename the file)") from None
    except (RuntimeError, EOFError) as e:
        raise ValueError(f"{path} is truncated or corrupt ({e}); load another checkpoint") from None


def _load_model(acc: Any, model: nn.Module, path: Path) -> None:
    module = acc.strategy.unwrap(model)
    weights = load_weights(path) if path.suffix == ".safetensors" else strip_compile_prefix(_read(path))
    weights = _tied_filled(module, _unprefixed(weights, module, "module."))
    check_state_dict(module, weights, source=str(path))
    acc.strategy.load_model_state_dict(model, weights)


def _unprefixed(weights: dict[str, torch.Tensor], module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """DDP's `module.` names (Accelerate saves the wrapper's state dict) as the plain model's."""
    names = module.state_dict().keys()
    if weights and all(k.startswith(prefix) for k in weights) and not any(k.startswith(prefix) for k in names):
        return {k[len(prefix):]: v for k, v in weights.items()}
    return weights


def _tied_filled(module: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every name of a tied weight, where the file holds one of them (Accelerate's safetensors keep one name)."""
    groups: dict[str, list[str]] = {}
    for alias, source in tied_names(module).items():
        groups.setdefault(source, [source]).append(alias)
    filled = dict(weights)
    for names in groups.values():
        stored = next((n for n in names if n in weights), None)
        if stored is not None:
            filled.update({n: weights[stored] for n in names if n not in weights})
    return filled


def _load_rng(acc: Any, path: Path) -> None:
    """This process's random states and `acc.step` (Accelerate keeps going without them, and says so)."""
    if not path.is_file():
        warnings.warn(f"{path.name} not found in {path.parent}: the random states are not restored "
                      f"(the Accelerate run had fewer processes)", stacklevel=4)
        return
    states = _read(path)
    acc.step = states.get("step", acc.step)
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if "torch_cuda_manual_seed" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])
