"""Hugging Face Accelerate's API on cadence's engines: change `from accelerate import ...` to `from cadence import ...`.

>>> from cadence import Accelerator
>>> accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
>>> model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
"""

from .accelerator import Accelerator
from .handlers import (DistributedDataParallelKwargs, DummyOptim, DummyScheduler, GradScalerKwargs,
                       InitProcessGroupKwargs, ProjectConfiguration)
from .prepared import PreparedDataLoader, PreparedOptimizer, PreparedScheduler
from .state import GradientState, PartialState
from .utils import find_executable_batch_size, set_seed

__all__ = ["Accelerator", "PartialState", "GradientState", "DistributedDataParallelKwargs", "GradScalerKwargs",
           "InitProcessGroupKwargs", "ProjectConfiguration", "DummyOptim", "DummyScheduler", "PreparedDataLoader",
           "PreparedOptimizer", "PreparedScheduler", "find_executable_batch_size", "set_seed"]
