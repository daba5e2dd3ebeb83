"""DDP: data-parallel training with `torch.nn.parallel.DistributedDataParallel`.

Every rank holds the whole model; gradients are averaged during backward. In a single
process (no process group) the model is left unwrapped, so the same script runs on one process.

>>> strategy = DDP(sync_bn=True)
>>> strategy.setup()
>>> model, opt = strategy.wrap(model, opt)
>>> train_dl = strategy.shard(train_dl)
>>> ...
>>> strategy.teardown()
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, ContextManager

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from . import env
from .data import DistributedDL
from .strategy import Strategy

__all__ = ["DDP"]

_SYNC_BN_DEVICES = ("cuda", "hpu", "xpu")


def _has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


class DDP(Strategy):
    """Wrap the model in DistributedDataParallel; BatchNorm becomes SyncBatchNorm when `sync_bn`.

    Extra keyword arguments go to DistributedDataParallel (e.g. `find_unused_parameters=True`).

    >>> model, opt = DDP(sync_bn=False).wrap(model, opt)
    """

    name = "ddp"

    def __init__(self, device: torch.device | str | None = None, sync_bn: bool = False, **ddp_kwargs: Any):
        super().__init__(device)
        self.sync_bn, self.ddp_kwargs = sync_bn, ddp_kwargs
        self.created_group = False

    def setup(self) -> None:
        """Create the process group if the launcher asked for several processes and none exists yet."""
        self.created_group = env.setup_distrib() or self.created_group

    def teardown(self) -> None:
        """Destroy the process group, only if `setup` created it."""
        if self.created_group:
            env.teardown_distrib()
            self.created_group = False

    def wrap(self, model: nn.Module, opt: torch.optim.Optimizer | None) -> tuple[nn.Module, Any]:
        """Move `model` to the device, convert BatchNorm if asked, wrap it in DDP; `opt` is returned as is.

        SyncBatchNorm conversion keeps the same Parameter objects, so an optimizer built on the
        original model keeps working. SyncBatchNorm runs on GPUs only: on cpu and mps the
        BatchNorm layers stay per-process, with a warning.
        """
        model = model.to(self.device)
        if self.sync_bn and _has_batchnorm(model):
            model = self._convert_sync_bn(model)
        if not env.is_initialized():
            return model, opt
        device_ids = [self.device] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, **self.ddp_kwargs), opt

    def _convert_sync_bn(self, model: nn.Module) -> nn.Module:
        if self.device.type in _SYNC_BN_DEVICES or self.device.type == torch._C._get_privateuse1_backend_name():
            return nn.SyncBatchNorm.convert_sync_batchnorm(model)
        if env.is_main_process():
            warnings.warn(f"sync_bn=True ignored on {self.device.type}: SyncBatchNorm needs a GPU, so BatchNorm "
                          "statistics stay per-process; pass sync_bn=False to silence this", stacklevel=3)
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside the DDP wrapper."""
        return model.module if isinstance(model, DistributedDataParallel) else model

    def no_sync(self, model: nn.Module) -> ContextManager:
        """Backward inside this context accumulates local gradients without an all-reduce."""
        return model.no_sync() if isinstance(model, DistributedDataParallel) else contextlib.nullcontext()

    def shard(self, dl: DataLoader) -> DistributedDL:
        """This rank's part of `dl` (fastai's sharding), batches moved to this strategy's device."""
        return DistributedDL(dl, device=self.device)
