"""Accelerate's stand-alone helpers: `set_seed`, `find_executable_batch_size`, `synchronize_rng_states`,
`gather_object`, `patch_environment`, `tqdm`, `release_memory`.

>>> set_seed(42)
>>> @find_executable_batch_size(starting_batch_size=256)
... def train(batch_size): ...
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import random
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ..distributed import env, ops

__all__ = ["set_seed", "find_executable_batch_size", "synchronize_rng_states", "gather_object", "patch_environment",
           "tqdm", "release_memory"]

# what a failed allocation says on the devices torch supports (Accelerate checks the same messages)
_OUT_OF_MEMORY = ("out of memory", "DefaultCPUAllocator: can't allocate memory",
                  "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED", "CUDNN_STATUS_ALLOC_FAILED")


def set_seed(seed: int, device_specific: bool = False) -> None:
    """Seed python's, numpy's and torch's random generators (every device); `device_specific` adds the rank.

    >>> set_seed(42)                          # the same numbers on every process
    >>> set_seed(42, device_specific=True)    # different numbers per process (data augmentation)
    """
    if not isinstance(seed, int):
        raise TypeError(f"set_seed takes an int, got {seed!r}")
    seed = seed + env.rank() if device_specific else seed
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _is_out_of_memory(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and any(m in str(e) for m in _OUT_OF_MEMORY))


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def find_executable_batch_size(function: Callable | None = None, starting_batch_size: int = 128) -> Callable:
    """Decorator: call `function(batch_size, ...)`, halving `batch_size` after every out-of-memory error.

    The decorated function is called without the batch size; it fails with RuntimeError once
    the batch size reaches zero.

    >>> @find_executable_batch_size(starting_batch_size=128)
    ... def train(batch_size, model):
    ...     dl = DataLoader(ds, batch_size=batch_size); ...
    >>> train(model)
    """
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size)
    if not isinstance(starting_batch_size, int) or starting_batch_size < 1:
        raise ValueError(f"starting_batch_size must be a positive int, got {starting_batch_size!r}")

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        batch_size = starting_batch_size
        _release_memory()
        while batch_size > 0:
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as e:
                if not _is_out_of_memory(e):
                    raise
                _release_memory()
                batch_size //= 2
        raise RuntimeError(f"no executable batch size found: {function.__name__} ran out of memory down to "
                           f"batch size 1 (started at {starting_batch_size})")
    return run


def synchronize_rng_states(rng_types: list[str], generator: torch.Generator | None = None) -> None:
    """Give every process the main process's random state for each of `rng_types` ("torch", "cuda", "generator").

    >>> synchronize_rng_states(["torch"])      # the same dropout masks and random crops on every process from here on
    """
    for rng_type in rng_types:
        name = getattr(rng_type, "value", rng_type)
        if name not in _RNG:
            raise ValueError(f"synchronize_rng_states: cadence synchronises {sorted(_RNG)}, not {name!r}")
        if name == "generator" and generator is None:
            raise ValueError("synchronize_rng_states(['generator']) needs the generator: pass generator=...")
        get, put = _RNG[name]
        put(generator, ops.broadcast(get(generator), src=0))


_RNG = {"torch": (lambda g: torch.get_rng_state(), lambda g, s: torch.set_rng_state(s)),
        "cuda": (lambda g: torch.cuda.get_rng_state(), lambda g, s: torch.cuda.set_rng_state(s)),
        "generator": (lambda g: g.get_state(), lambda g, s: g.set_state(s))}


def gather_object(obj: Any) -> list:
    """Every process's picklable `obj` in process order; lists are concatenated (Accelerate's `gather_object`).

    >>> gather_object([f"rank {rank()}"])       # ['rank 0', 'rank 1'] on 2 processes
    """
    parts = ops.gather_object(obj)
    return [x for part in parts for x in part] if all(isinstance(p, (list, tuple)) for p in parts) else parts


@contextlib.contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set environment variables (upper-cased names) for the block, restoring the previous values after.

    >>> with patch_environment(master_port="29501"): notebook_launcher(train, num_processes=2)
    """
    before = {k.upper(): os.environ.get(k.upper()) for k in kwargs}
    os.environ.update({k.upper(): str(v) for k, v in kwargs.items()})
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """`tqdm.auto.tqdm`, shown on the local main process only unless `main_process_only=False`.

    >>> for batch in tqdm(train_dl): ...
    """
    from tqdm.auto import tqdm as _tqdm

    if main_process_only:
        kwargs["disable"] = kwargs.get("disable", False) or not env.is_local_main_process()
    return _tqdm(*args, **kwargs)


def release_memory(*objects: Any) -> list[None]:
    """Drop the references in `objects`, collect garbage, empty the device cache; returns Nones to rebind.

    >>> model, optimizer = release_memory(model, optimizer)
    """
    _release_memory()
    return [None] * len(objects)
