"""Saving and loading weights and optimizer state: safetensors, `weights_only` loads, atomic writes (used by every layer).

>>> save_weights(model.state_dict(), "models/stage1.safetensors")
>>> state = load_weights("models/stage1.safetensors")
>>> check_state_dict(model, state)        # ValueError listing missing/unexpected keys, shape mismatches
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import load_file, save_file
from torch import nn

_ALIASES_KEY = "cadence_aliases"


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; rename it onto `path` only if the block succeeds.

    >>> with atomic_path("out.pt") as tmp: torch.save(obj, tmp)
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_weights(state: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Write a state dict as safetensors, atomically. Tied (shared) tensors are stored once.

    The file loads with `safetensors.torch.load_file`; `load_weights` restores the tied names.
    """
    tensors, aliases, seen = {}, {}, {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.dtype, t.device) if t.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        tensors[name] = t.detach().contiguous().cpu()
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={_ALIASES_KEY: json.dumps(aliases)})


def load_weights(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read a safetensors file written by `save_weights` (or anyone else) into a state dict."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        aliases = json.loads((f.metadata() or {}).get(_ALIASES_KEY, "{}"))
    state = load_file(str(path), device=str(device))
    for alias, name in aliases.items():
        state[alias] = state[name]
    return state


def _full_shape(t: torch.Tensor) -> torch.Size:
    """A tensor's shape, or the whole parameter's for a DeepSpeed ZeRO-3 partition (`ds_shape`)."""
    return getattr(t, "ds_shape", t.shape)


def check_state_dict(model: nn.Module, state: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Raise ValueError, before anything is loaded, when `state` does not fit `model`."""
    expected = model.state_dict(keep_vars=True)  # parameters themselves: a ZeRO-3 partition knows its full shape
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [f"{k}: {tuple(state[k].shape)} in {source}, {tuple(_full_shape(expected[k]))} in model"
              for k in expected if k in state and state[k].shape != _full_shape(expected[k])]
    if missing or unexpected or shapes:
        lines = [f"the {source} does not fit this model (is it from another architecture?)"]
        for title, items in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", shapes)):
            if items:
                lines.append(f"  {title}: " + ", ".join(items[:20]) + (" ..." if len(items) > 20 else ""))
        raise ValueError("\n".join(lines))


def save_torch(obj, path: str | os.PathLike) -> None:
    """`torch.save` to `path` atomically."""
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def load_torch(path: str | os.PathLike, map_location="cpu"):
    """`torch.load` with `weights_only=True`: tensors and plain containers only, never arbitrary objects."""
    return torch.load(path, map_location=map_location, weights_only=True)
