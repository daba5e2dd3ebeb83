"""The one place that maps strategy names to classes: "ddp", "fsdp", "deepspeed", "xla".

>>> strategy = get_strategy("ddp", sync_bn=False)
>>> get_strategy(None)      # $CADENCE_STRATEGY, set by `cadence launch`; "ddp" when unset
"""

from __future__ import annotations

import importlib
import os

from .strategy import Strategy

# name -> "module:Class", imported on first use so optional engines cost nothing until asked for
STRATEGIES = {
    "ddp": "cadence.distributed.ddp:DDP",
}


def get_strategy(name: str | Strategy | None = None, **kwargs) -> Strategy:
    """A Strategy instance from its name (or `$CADENCE_STRATEGY`, default "ddp"), built with `kwargs`.

    A Strategy instance passes through unchanged.
    """
    if isinstance(name, Strategy):
        return name
    name = (name or os.environ.get("CADENCE_STRATEGY") or "ddp").lower()
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {sorted(STRATEGIES)}")
    module, cls = STRATEGIES[name].split(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)
