"""DataParallel: fastai's single-process `nn.DataParallel` over the visible GPUs, as a strategy.

One process drives every GPU; batches are split along dim 0. With fewer than two GPUs the model
is left as it is, so `parallel_ctx` is harmless on a laptop.

>>> with learn.parallel_ctx():        # the same as learn.distrib_ctx(strategy="dp")
...     learn.fit(1)
"""

from __future__ import annotations

import torch
from torch import nn

from .precision import FullPrecision
from .strategy import MakeOpt, Strategy

__all__ = ["DataParallel"]


class DataParallel(Strategy):
    """Wrap the model in `nn.DataParallel` when two or more GPUs exist (`device_ids`: which ones)."""

    name = "dp"

    def __init__(self, device: torch.device | str | None = None, device_ids: list[int] | None = None):
        super().__init__(device)
        self.device_ids = device_ids

    def setup(self, model: nn.Module, make_opt: MakeOpt, precision: FullPrecision | None = None
              ) -> tuple[nn.Module, torch.optim.Optimizer]:
        model, opt = super().setup(model, make_opt, precision)
        if torch.cuda.device_count() >= 2:
            model = nn.DataParallel(model, device_ids=self.device_ids)
        return model, opt

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside the DataParallel wrapper (so saved weights carry no `module.` prefix)."""
        model = super().unwrap(model)
        return super().unwrap(model.module) if isinstance(model, nn.DataParallel) else model
