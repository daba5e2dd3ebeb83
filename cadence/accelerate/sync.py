"""Switching gradient synchronisation of a prepared model on and off, on any engine.

The strategy does the switching (`set_gradient_sync`: DDP's `require_backward_grad_sync`, FSDP2's
`set_requires_gradient_sync`, DeepSpeed's accumulation boundary); this module remembers the current
setting on the prepared model, so nested blocks restore what was there before (LocalSGD's
`model.no_sync()` around `accelerator.accumulate`), and gives every prepared model a `no_sync()`.

>>> with model.no_sync():                      # DDP, FSDP or a DeepSpeed engine, prepared by the Accelerator
...     accelerator.backward(model(**batch).loss)
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

from torch import nn

__all__ = ["gradient_sync", "set_gradient_sync", "no_sync", "trigger_sync_in_backward", "give_no_sync"]

_FLAG = "_cadence_gradient_sync"


def gradient_sync(model: nn.Module) -> bool:
    """Whether the next backward of `model` synchronises gradients (True unless switched off here)."""
    return model.__dict__.get(_FLAG, True)


def set_gradient_sync(strategy: Any, model: nn.Module, enabled: bool) -> None:
    strategy.set_gradient_sync(model, enabled)
    model.__dict__[_FLAG] = enabled


@contextlib.contextmanager
def no_sync(strategy: Any, model: nn.Module) -> Iterator[None]:
    """Forward and backward in this block keep gradients local; the setting before it comes back after."""
    before = gradient_sync(model)
    set_gradient_sync(strategy, model, False)
    try:
        yield
    finally:
        set_gradient_sync(strategy, model, before)


@contextlib.contextmanager
def trigger_sync_in_backward(strategy: Any, model: nn.Module) -> Iterator[None]:
    """The backward in this block synchronises gradients even though the forward ran under `no_sync`."""
    before = gradient_sync(model)
    set_gradient_sync(strategy, model, True)
    reducer = getattr(model, "reducer", None)
    if reducer is not None:  # DDP decided at forward time not to reduce: arm its reducer for this backward
        reducer.prepare_for_backward([])
    try:
        yield
    finally:
        set_gradient_sync(strategy, model, before)


def give_no_sync(strategy: Any, model: nn.Module) -> None:
    """Give the prepared `model` a `no_sync()` context manager working through `strategy`.

    DDP has one, FSDP2 modules have none, a DeepSpeed engine's refuses ZeRO-2/3: this one works on all.
    """
    model.__dict__["no_sync"] = _NoSync(strategy, model)


class _NoSync:
    """`model.no_sync` of a prepared model; a copy or an unpickled model (no longer prepared) gets a no-op."""

    def __init__(self, strategy: Any, model: nn.Module):
        self.strategy, self.model = weakref.ref(strategy), weakref.ref(model)

    def __call__(self) -> contextlib.AbstractContextManager[None]:
        strategy, model = self.strategy(), self.model()
        return no_sync(strategy, model) if strategy is not None and model is not None else contextlib.nullcontext()

    def __reduce__(self) -> tuple:
        return _no_op, ()


def _no_op() -> type[contextlib.nullcontext]:
    return contextlib.nullcontext
