"""`accelerator.clip_grad_norm_` on every engine: clip by the global norm, return that norm.

Most engines clip through the strategy (`Strategy.clip_grad_norm`: gradients unscaled, the norm
taken over every shard). An engine that clips inside its own step (DeepSpeed: ZeRO-2/3 keep the
gradients in partitions, not in `p.grad`) owns the clipping: its config's `gradient_clipping` applies
to every step, as in DeepSpeed, and a call clips this step only, at the smaller of `max_norm` and the
config's value (a one-time warning when both are set and differ; DeepSpeed clips by the L2 norm only, so
another `norm_type` is warned about once and not used). The engine takes the optimizer step right here,
so the norm returned is the one it computed and clipped by in this very step; the `optimizer.step()` that
follows in the script is then a no-op. Accelerate steps such an engine even earlier (inside `backward`),
returns the same norm and clips by the config alone.

>>> if accelerator.sync_gradients:
...     norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)   # the norm before clipping, on any engine
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import nn

from ..distributed.grad_norm import clip_by_total_norm
from ..distributed.strategy import OwnsClipping

__all__ = ["clip_grad_norm", "clip_part", "refuse_part_under_own_clipping"]

_WARNED: set[str] = set()


def clip_grad_norm(strategy: Any, model: nn.Module, engine_opt: torch.optim.Optimizer, opt: Any, max_norm: float,
                   norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of the prepared `model` to `max_norm`; the global norm before clipping. `engine_opt` is the
    optimizer the strategy returned for it, `opt` the PreparedOptimizer the script steps."""
    if not isinstance(strategy, OwnsClipping):
        return strategy.clip_grad_norm(model, engine_opt, max_norm, norm_type)
    if not max_norm > 0:
        raise ValueError(f"clip_grad_norm_ max_norm must be > 0 under {type(strategy).__name__} (its engine reads 0 "
                         f"as no clipping), got {max_norm}: pass a positive max_norm, or inf for the norm alone")
    if norm_type != 2.0 and opt.accelerator.is_main_process:
        _warn_once("norm_type", f"{type(strategy).__name__} clips by the global L2 norm only: norm_type={norm_type} "
                                f"is not used, the norm clipped by and returned is the L2 norm")
    if not opt.accelerator.sync_gradients or opt.stepped_early:
        # mid-window (no step, no norm yet: Accelerate returns the last one), or this window's step is taken
        return _as_tensor(strategy.last_grad_norm())
    full = [p.grad for p in strategy.unwrap(model).parameters() if p.grad is not None]
    fallback = torch.nn.utils.get_total_norm(full, 2.0) if full else None   # engines keeping whole gradients
    with strategy.clipping_once(max_norm) as own:
        if 0 < own != max_norm and max_norm < math.inf and opt.accelerator.is_main_process:
            _warn_once("config", f"the DeepSpeed config sets gradient_clipping={own} and clip_grad_norm_ asks for "
                                 f"{max_norm}: a step with the call is clipped at the smaller, {min(own, max_norm)}, "
                                 f"every other step at {own} (set gradient_clipping to \"auto\" or 0 to clip only "
                                 f"where the script asks)")
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


def _warn_once(kind: str, message: str) -> None:
    """One warning of each kind, on the main process (a training loop calls clip_grad_norm_ every step)."""
    if kind not in _WARNED:
        _WARNED.add(kind)
        warnings.warn(message, stacklevel=4)


def _as_tensor(norm: float | torch.Tensor | None) -> torch.Tensor:
    if norm is None:
        return torch.tensor(float("nan"))
    return norm.detach().float() if isinstance(norm, torch.Tensor) else torch.tensor(float(norm))
