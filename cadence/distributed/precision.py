"""Precision plugins: how a strategy runs the forward pass, backward and step for a number format.

A strategy holds one plugin (`strategy.precision`); the `MixedPrecision` callback is the user's
switch that sets it. Engines that do mixed precision themselves (FSDP, DeepSpeed) read
`precision.name` and configure their own.

>>> plugin = make_precision("fp16", "cpu")
>>> with plugin.forward_context(): loss = loss_func(model(x), y)
>>> plugin.backward(loss); plugin.unscale(opt); stepped = plugin.step(opt)
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

PRECISIONS = ("no", "fp16", "bf16")


class FullPrecision:
    """fp32: no autocast, no scaling."""

    name = "no"

    def forward_context(self) -> ContextManager:
        return contextlib.nullcontext()

    # `plugin.backward(loss)` is `loss.backward()`: the plain Tensor method, no wrapper frame per step
    backward = staticmethod(torch.Tensor.backward)

    def unscale(self, opt: torch.optim.Optimizer) -> None:
        """Make the gradients true gradients (before clipping); nothing to do without a scaler."""

    def step(self, opt: torch.optim.Optimizer) -> bool:
        opt.step()
        return True

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore."""


class AutocastPrecision(FullPrecision):
    """bf16 (or fp16 without scaling): the forward pass and loss under `torch.autocast`."""

    def __init__(self, dtype: torch.dtype, device_type: str):
        self.dtype, self.device_type = dtype, device_type
        self.name = "bf16" if dtype == torch.bfloat16 else "fp16"

    def forward_context(self) -> ContextManager:
        return torch.autocast(self.device_type, dtype=self.dtype)


class ScaledPrecision(AutocastPrecision):
    """fp16 with a GradScaler: the loss is scaled for backward; a step with inf/NaN gradients is skipped.

    `skipped_steps` counts the skipped steps; the scaler's state is part of `state_dict`.
    """

    def __init__(self, device_type: str, **scaler_kwargs):
        super().__init__(torch.float16, device_type)
        self.scaler = torch.amp.GradScaler(device_type, **scaler_kwargs)
        self.skipped_steps = 0
        self._unscaled: set[int] = set()   # optimizers whose gradients are unscaled since the last update

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.scaler.scale(loss).backward(**kwargs)

    def unscale(self, opt: torch.optim.Optimizer) -> None:
        if id(opt) not in self._unscaled:
            self.scaler.unscale_(opt)
            self._unscaled.add(id(opt))

    def step(self, opt: torch.optim.Optimizer) -> bool:
        scale = self.scaler.get_scale()
        self.scaler.step(opt)
        self.scaler.update()   # forgets every optimizer's unscaling
        self._unscaled.clear()
        stepped = self.scaler.get_scale() >= scale  # the scale shrinks exactly when the step was skipped
        self.skipped_steps += not stepped
        return stepped

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state["skipped_steps"]


def make_precision(name: str, device: torch.device | str, **scaler_kwargs) -> FullPrecision:
    """The plugin for "no", "bf16" or "fp16" on `device` (fp16 comes with a GradScaler)."""
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {name!r}")
    device_type = torch.device(device).type
    if name == "bf16":
        return AutocastPrecision(torch.bfloat16, device_type)
    if name == "fp16":
        return ScaledPrecision(device_type, **scaler_kwargs)
    return FullPrecision()


def fsdp_mixed_precision(precision: FullPrecision):
    """FSDP2's MixedPrecisionPolicy for `precision`: parameters in bf16/fp16 for compute, gradients reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision.name == "no":
        return MixedPrecisionPolicy()
    dtype = torch.bfloat16 if precision.name == "bf16" else torch.float16
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def sharded_scaler(precision: FullPrecision) -> FullPrecision:
    """fp16: the GradScaler must agree across shards on whether a step overflowed (ShardedGradScaler)."""
    scaler = getattr(precision, "scaler", None)
    if scaler is not None and not type(scaler).__name__.startswith("Sharded"):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        precision.scaler = ShardedGradScaler(precision.device_type, init_scale=scaler.get_scale())
    return precision

