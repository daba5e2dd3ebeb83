"""What a fit checks before it starts: that the model has something to train, and that a process a launcher started
among several is not about to train alone.

>>> check_trainable(model); warn_if_launched_alone()     # Learner.fit does both
"""

from __future__ import annotations

import os
import warnings

from torch import nn

__all__ = ["check_trainable", "warn_if_launched_alone"]

_warned: list[bool] = []   # the launched-alone warning, once per process


def check_trainable(model: nn.Module) -> None:
    """ValueError when no parameter of `model` requires a gradient (every one frozen): nothing to train."""
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("fit: no parameter of the model requires a gradient (all frozen), so there is nothing to "
                         "train; unfreeze the ones to train (learn.unfreeze(), or requires_grad_(True) on them)")


def warn_if_launched_alone() -> None:
    """A fit outside `distrib_ctx` in a process a launcher started among several trains alone on all the data (no
    process group): said once, by the launcher's first process."""
    import torch.distributed as dist

    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if launched > 1 and not dist.is_initialized() and not _warned and os.environ.get("RANK", "0") == "0":
        _warned.append(True)
        warnings.warn(f"this process is one of {launched} launched, and the fit runs outside distrib_ctx: each "
                      f"process trains alone on all the data, without the launcher's settings (engine, mixed "
                      f"precision, accumulation); wrap the fit in `with learn.distrib_ctx():`", stacklevel=3)
