"""`LocalSGD`: each process takes its own optimizer steps; the weights are averaged every `local_sgd_steps` steps.

Gradients are not all-reduced inside the block (the model's `no_sync()`), which saves the
communication of every step. Data parallel engines only (DDP, or one process where it does
nothing); a sharded engine (FSDP, DeepSpeed) holds no whole copy of the weights to average and
is refused.

>>> with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=8) as local_sgd:
...     for batch in train_dl:
...         with accelerator.accumulate(model):
...             accelerator.backward(model(**batch).loss); optimizer.step(); optimizer.zero_grad()
...             local_sgd.step()
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .plugins import DistributedType

__all__ = ["LocalSGD"]

_SHARDED = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA)


class LocalSGD:
    """Accelerate's `LocalSGD` (`from cadence.local_sgd import LocalSGD`).

    Args:
        accelerator: the `Accelerator` that prepared `model`.
        model: the prepared model.
        local_sgd_steps: optimizer steps between two averagings of the weights.
        enabled: False runs the block as plain data-parallel training.
    """

    def __init__(self, accelerator: Any, model: nn.Module, local_sgd_steps: int, enabled: bool = True):
        if accelerator.distributed_type in _SHARDED:
            raise NotImplementedError(f"LocalSGD averages whole weights: it runs under DDP (or one process), not "
                                      f"{accelerator.distributed_type.value}")
        if enabled and (not isinstance(local_sgd_steps, int) or local_sgd_steps < 1):
            raise ValueError(f"LocalSGD(local_sgd_steps={local_sgd_steps!r}): give a positive int")
        self.enabled = enabled and accelerator.distributed_type != DistributedType.NO
        self.accelerator, self.model, self.local_sgd_steps = accelerator, model, local_sgd_steps
        self.num_steps = 0
        self._no_sync: Any = None

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._no_sync = self.model.no_sync()
            self._no_sync.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self._average()
            self._no_sync.__exit__(*exc)

    def step(self) -> None:
        """Count one optimizer step; average the weights every `local_sgd_steps`."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average()

    @torch.no_grad()
    def _average(self) -> None:
        self.accelerator.wait_for_everyone()
        for param in self.model.parameters():
            param.copy_(self.accelerator.reduce(param.detach(), reduction="mean"))
