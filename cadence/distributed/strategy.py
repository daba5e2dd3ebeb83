"""The Strategy interface every engine adapter implements, and `SingleDevice`.

The Learner's loop only calls these methods, so DDP, FSDP, DeepSpeed and XLA slot in
without an `if` in the loop. A strategy owns the device, the wrapping of model and
optimizer, and how backward and step run (precision included).

>>> strategy = SingleDevice("cpu")
>>> model, opt = strategy.wrap(model, opt)
>>> strategy.backward(loss); stepped = strategy.step(opt)
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch
from torch import nn

from .env import default_device
from .ops import gather, reduce
from .precision import FullPrecision


class Strategy:
    """Base class: one process, one device. Subclasses override what their engine changes."""

    name = "single"

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else default_device()
        self.precision: FullPrecision = FullPrecision()

    # lifecycle
    def setup(self) -> None:
        """Create process groups / select the device. Nothing to do on one device."""

    def teardown(self) -> None:
        """Undo `setup`."""

    # model and data
    def wrap(self, model: nn.Module, opt: torch.optim.Optimizer | None) -> tuple[nn.Module, Any]:
        """Return (model, opt) ready to train on this strategy's device."""
        return model.to(self.device), opt

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside whatever `wrap` returned."""
        return model

    def shard(self, dl):
        """The part of `dl` this process iterates; all of it on one device."""
        return dl

    # one optimisation step
    def set_precision(self, precision: FullPrecision) -> None:
        """Use a precision plugin (see `precision.make_precision`); the MixedPrecision callback calls this."""
        self.precision = precision

    def forward_context(self) -> ContextManager:
        """Context the forward pass and loss run in (autocast for mixed precision)."""
        return self.precision.forward_context()

    def backward(self, loss: torch.Tensor, model: nn.Module | None = None, sync: bool = True) -> None:
        """Backward of `loss`; with `sync=False` gradients stay local (accumulation micro-batches)."""
        if sync:
            self.precision.backward(loss)
        else:
            with self.no_sync(model):
                self.precision.backward(loss)

    def step(self, opt: torch.optim.Optimizer) -> bool:
        """Step the optimizer; False when the step was skipped (e.g. fp16 overflow)."""
        return self.precision.step(opt)

    def no_sync(self, model: nn.Module) -> ContextManager:
        """Context in which backward does not synchronise gradients across processes."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, opt: torch.optim.Optimizer, max_norm: float,
                       norm_type: float = 2.0) -> torch.Tensor:
        """Unscale, then clip the gradients of the whole model to `max_norm`; returns the norm before clipping."""
        self.precision.unscale(opt)
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)

    def clip_grad_value(self, model: nn.Module, opt: torch.optim.Optimizer, value: float) -> None:
        """Unscale, then clamp every gradient element to [-value, value]."""
        self.precision.unscale(opt)
        torch.nn.utils.clip_grad_value_(model.parameters(), value)

    # collectives over the processes of this strategy (identity on one process)
    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of `t` over processes."""
        return reduce(t, "sum")

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every process's `t` concatenated on dim 0, in rank order."""
        return gather(t)

    # state
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full (unsharded) state dict of the user's module, on every rank."""
        return self.unwrap(model).state_dict()

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        self.unwrap(model).load_state_dict(state)

    def optimizer_state_dict(self, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
        return opt.state_dict()

    def load_optimizer_state_dict(self, model: nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
        opt.load_state_dict(state)


class SingleDevice(Strategy):
    """Train on one device: CPU, one GPU or MPS (the default strategy)."""
