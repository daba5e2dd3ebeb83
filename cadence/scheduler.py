"""`accelerate.scheduler` under cadence: `AcceleratedScheduler` is what `accelerator.prepare(scheduler)` returns.

>>> from cadence.scheduler import AcceleratedScheduler
>>> optimizer, scheduler = accelerator.prepare(optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1))
>>> isinstance(scheduler, AcceleratedScheduler)
True
"""

from .accelerate.prepared import PreparedScheduler as AcceleratedScheduler

__all__ = ["AcceleratedScheduler"]
