"""The random states a resumed run needs to draw the same numbers: python, numpy, torch (CPU and CUDA),
and the engine's device where it has its own generator (XLA's, through `Strategy.device_rng_state`).

>>> state = rng_state(learn.strategy); ...; set_rng_state(state, learn.strategy)     # the same draws again
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state(strategy: Any = None) -> dict[str, Any]:
    """This process's python, numpy and torch (CPU and CUDA) random states, and the device's of `strategy`
    (if it has one of its own), as plain tensors and numbers."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()  # its 625 numbers as one tensor: a resume unpickles them 3x faster
    state = {"python": (version, torch.tensor(internal, dtype=torch.int64), gauss), "torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached": float(cached)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    device = strategy.device_rng_state() if strategy is not None else {}
    if device:
        state["device"] = device
    return state


def set_rng_state(state: dict[str, Any], strategy: Any = None) -> None:
    """Restore what `rng_state` returned (the device's part through `strategy`)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal.tolist() if torch.is_tensor(internal) else internal), gauss))  # or a tuple
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "device" in state and strategy is not None:
        strategy.set_device_rng_state(state["device"])
