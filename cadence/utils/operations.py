"""`accelerate.utils.broadcast_object_list` under cadence."""

from __future__ import annotations

import torch.distributed as dist

from ..distributed import env

__all__ = ["broadcast_object_list"]


def broadcast_object_list(object_list: list, from_process: int = 0) -> list:
    """Fill `object_list` in place with process `from_process`'s items (any picklable objects) and return it;
    every process passes a list of the same length. One process: returned as it is.

    >>> broadcast_object_list([config] if accelerator.is_main_process else [None])[0]
    """
    if env.is_initialized():
        dist.broadcast_object_list(object_list, src=from_process)
    return object_list
