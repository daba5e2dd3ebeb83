"""Clip gradients by their total norm over every shard, whatever tensors hold them.

Gradients that are DTensors (FSDP2's shards, tensor-parallel slices) are grouped by mesh: torch's foreach
clipping takes one mesh at a time, and each group's norm is made whole (`full_tensor`) before the groups'
norms are combined.

>>> norm = clip_by_total_norm(model.parameters(), max_norm=1.0)    # the norm before clipping
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

__all__ = ["clip_by_total_norm"]


def clip_by_total_norm(params: Iterable[nn.Parameter], max_norm: float, norm_type: float = 2.0,
                       combine: Callable[[torch.Tensor, float], torch.Tensor] | None = None) -> torch.Tensor:
    """Clip the gradients of `params` by their total norm; returns that norm (before clipping). `combine(norm,
    norm_type)` widens the norm first (over pipeline stages: a stage holding no gradient still takes part)."""
    from torch.distributed.tensor import DTensor

    by_mesh: dict[object, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.nn.utils.get_total_norm(norms, norm_type) if norms else torch.tensor(0.0)
    if combine is not None:
        total = combine(total, norm_type)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
