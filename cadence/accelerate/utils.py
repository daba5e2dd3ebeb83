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
import inspect
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


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed python's, numpy's and torch's random generators (every device); `device_specific` adds the rank.

    `deterministic=True` also turns on `torch.use_deterministic_algorithms` (for the rest of the process; slower).

    >>> set_seed(42)                          # the same numbers on every process
    >>> set_seed(42, device_specific=True)    # different numbers per process (data augmentation)
    """
    if not isinstance(seed, int):
        raise TypeError(f"set_seed takes an int, got {seed!r}")
    seed = seed + env.rank() if device_specific else seed
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def _is_out_of_memory(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and any(m in str(e) for m in _OUT_OF_MEMORY))


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def find_executable_batch_size(function: Callable | None = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Callable[[], int] | None = None) -> Callable:
    """Decorator: call `function(batch_size, ...)`, reducing `batch_size` after every out-of-memory error.

    As in Accelerate 1.15: the size is multiplied by 0.9 (rounded down) after each failure, or set to
    what `reduce_batch_size_fn()` returns (no arguments, the new size); the size found is kept for the
    next call. The decorated function is called without the batch size; it fails with RuntimeError once
    the size reaches zero.

    >>> @find_executable_batch_size(starting_batch_size=128)
    ... def train(batch_size, model):
    ...     dl = DataLoader(ds, batch_size=batch_size); ...
    >>> train(model)                    # tries 128, 115, 103, ... until one fits
    >>> sizes = iter([64, 32, 16])
    >>> @find_executable_batch_size(starting_batch_size=128, reduce_batch_size_fn=lambda: next(sizes))
    ... def train(batch_size): ...      # tries 128, 64, 32, 16
    """
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    if not isinstance(starting_batch_size, int) or starting_batch_size < 1:
        raise ValueError(f"starting_batch_size must be a positive int, got {starting_batch_size!r}")
    batch_size = starting_batch_size

    def reduce() -> int:
        return reduce_batch_size_fn() if reduce_batch_size_fn is not None else int(batch_size * 0.9)

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        _refuse_a_given_batch_size(function, args)
        _release_memory()
        while batch_size > 0:
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as e:
                if not _is_out_of_memory(e):
                    raise
                _release_memory()
                batch_size = reduce()
        raise RuntimeError(f"no executable batch size found: {function.__name__} ran out of memory until the batch "
                           f"size reached zero (started at {starting_batch_size})")
    return run


def _refuse_a_given_batch_size(function: Callable, args: tuple) -> None:
    """TypeError when the caller passed more positional arguments than `function` takes after its batch size
    (the batch size itself, most likely: the decorator passes it)."""
    params = list(inspect.signature(function).parameters.values())
    if any(p.kind is p.VAR_POSITIONAL for p in params) or len(params) >= len(args) + 1:
        return
    given = ", ".join(f"{p.name}={value!r}" for p, value in zip(params[1:], args[1:]))
    raise TypeError(f"{function.__name__} was called with its batch size as the first argument; the decorator passes "
                    f"it: call {function.__name__}({given})")


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


def gather_object(object: Any) -> list:  # noqa: A002 (Accelerate's argument name)
    """Every process's picklable `object` in process order; lists are concatenated (Accelerate's `gather_object`).

    >>> gather_object([f"rank {rank()}"])       # ['rank 0', 'rank 1'] on 2 processes
    """
    parts = ops.gather_object(object)
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
