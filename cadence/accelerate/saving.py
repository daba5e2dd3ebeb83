"""`Accelerator.save`: one file per run, written by the main process (torch.save or safetensors).

>>> accelerator.save(accelerator.unwrap_model(model).state_dict(), "weights.safetensors", safe_serialization=True)
>>> unwrapped.save_pretrained(out_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save)
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..serialization import save_torch, save_weights

__all__ = ["save_object"]


def save_object(obj: Any, f: str | os.PathLike, safe_serialization: bool, is_main_process: bool) -> None:
    """Write `obj` to `f` when `is_main_process`: `torch.save`, or safetensors (a dict of tensors only) when
    `safe_serialization`; tensors are written from the CPU."""
    if safe_serialization and not (isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values())):
        raise TypeError(f"save(..., safe_serialization=True) writes a dict of tensors, got {type(obj).__name__}; "
                        f"use safe_serialization=False for other objects")
    if not is_main_process:
        return
    if safe_serialization:
        save_weights(obj, f)
    elif isinstance(f, (str, os.PathLike)):
        save_torch(obj, f, host_tags=False)  # under a temporary name, renamed when complete; torch.save's tags
    else:
        torch.save(obj, f)      # a file object
