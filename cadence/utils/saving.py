"""Accelerate's `accelerate.utils.save` / `load`: `torch.save` once per run (or per machine), `torch.load` that
reads tensors, numpy arrays and RNG states without unpickling code (`weights_only=True` unless told otherwise).

>>> save({"w": torch.ones(2)}, "weights.pt")          # written by the main process only
>>> load("weights.pt")["w"]
tensor([1., 1.])
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from ..accelerate.saving import save_object
from ..distributed import env

__all__ = ["save", "load"]

_NUMPY = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), getattr(np, "_core", np).multiarray._reconstruct]


def save(obj: Any, f: str | os.PathLike, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
    """Write `obj` to `f` on the main process (each machine's with `save_on_each_node`): `torch.save`, or
    safetensors for a dict of tensors with `safe_serialization`."""
    writer = env.is_local_main_process() if save_on_each_node else env.is_main_process()
    save_object(obj, f, safe_serialization, writer)


def load(f: str | os.PathLike, map_location: Any = None, **kwargs: Any) -> Any:
    """`torch.load(f, map_location, weights_only=True, **kwargs)`, numpy arrays allowed (RNG states)."""
    kwargs.setdefault("weights_only", True)
    with torch.serialization.safe_globals(_NUMPY):
        return torch.load(f, map_location=map_location, **kwargs)
