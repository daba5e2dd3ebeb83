"""Accelerate's stand-alone helpers: `set_seed`, `find_executable_batch_size`.

>>> set_seed(42)
>>> @find_executable_batch_size(starting_batch_size=256)
... def train(batch_size): ...
"""

from __future__ import annotations

import functools
import gc
import random
from typing import Any, Callable

import numpy as np
import torch

from ..distributed import env

__all__ = ["set_seed", "find_executable_batch_size"]

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
