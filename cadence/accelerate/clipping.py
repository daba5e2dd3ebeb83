"""`accelerator.clip_grad_norm_` on every engine: clip by the global norm, return that norm.

Most engines clip through the strategy (`Strategy.clip_grad_norm`: gradients unscaled, the norm
taken over every shard). An engine that clips inside its own step (DeepSpeed: ZeRO-2/3 keep the
gradients in partitions, not in `p.grad`) owns the clipping: it is given `max_norm`
(`configure_clipping`, so a config's "auto" clipping is what the script asks for) and takes the
optimizer step right here, so the norm returned is the one it computed and clipped by in this very
step; the `optimizer.step()` that follows in the script is then a no-op. Accelerate steps such an
engine even earlier (inside `backward`) and returns the same norm.

>>> if accelerator.sync_gradients:
...     norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)   # the norm before clipping, on any engine
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..distributed.grad_norm import clip_by_total_norm
from ..distributed.strategy import OwnsClipping

__all__ = ["clip_grad_norm", "clip_part", "refuse_part_under_own_clipping"]


def clip_grad_norm(strategy: Any, model: nn.Module, engine_opt: torch.optim.Optimizer, opt: Any, max_norm: float,
                   norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of the prepared `model` to `max_norm`; the global norm before clipping. `engine_opt` is the
    optimizer the strategy returned for it, `opt` the PreparedOptimizer the script steps."""
    if not isinstance(strategy, OwnsClipping):
        return strategy.clip_grad_norm(model, engine_opt, max_norm, norm_type)
    strategy.configure_clipping(max_norm, norm_type)
    if not opt.accelerator.sync_gradients or opt.stepped_early:
        # mid-window (no step, no norm yet: Accelerate returns the last one), or this window's step is taken
        return _as_tensor(strategy.last_grad_norm())
    full = [p.grad for p in strategy.unwrap(model).parameters() if p.grad is not None]
    fallback = torch.nn.utils.get_total_norm(full, norm_type) if full else None   # engines keeping whole gradients
    opt.step_now()
    norm = strategy.last_grad_norm()
    return _as_tensor(norm if norm is not None else fallback)


def clip_part(strategy: Any, engine_opt: torch.optim.Optimizer, params: list, max_norm: float,
              norm_type: float = 2.0) -> torch.Tensor:
    """Clip only `params`, part of a prepared model, by their own global norm (over every shard); that norm.
    The rest of the model's gradients stay as they are (Accelerate's, torch's `clip_grad_norm_` over them)."""
    refuse_part_under_own_clipping(strategy)
    strategy.precision.unscale(engine_opt)
    return clip_by_total_norm(params, max_norm, norm_type)


def refuse_part_under_own_clipping(strategy: Any) -> None:
    if isinstance(strategy, OwnsClipping):
        raise ValueError(f"{type(strategy).__name__} clips the whole model inside its own step, so clipping part of "
                         f"it is not possible: pass all of the model's parameters (model.parameters()), or clip "
                         f"under DDP or FSDP")


def _as_tensor(norm: float | torch.Tensor | None) -> torch.Tensor:
    if norm is None:
        return torch.tensor(float("nan"))
    return norm.detach().float() if isinstance(norm, torch.Tensor) else torch.tensor(float(norm))
