"""`accelerate.optimizer` under cadence: `AcceleratedOptimizer` is what `accelerator.prepare(optimizer)` returns.

>>> from cadence.optimizer import AcceleratedOptimizer
>>> model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
>>> isinstance(optimizer, AcceleratedOptimizer)
True
"""

from .accelerate.prepared import PreparedOptimizer as AcceleratedOptimizer

__all__ = ["AcceleratedOptimizer"]
