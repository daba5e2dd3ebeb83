"""`accelerate.accelerator` under cadence: `from accelerate.accelerator import Accelerator` becomes
`from cadence.accelerator import Accelerator` (the class is `cadence.Accelerator`).

>>> from cadence.accelerator import Accelerator, AcceleratorState
>>> accelerator = Accelerator(mixed_precision="bf16")
>>> AcceleratorState().mixed_precision
'bf16'
"""

from .accelerate import (Accelerator, AcceleratorState, GradientState, PartialState)
from .accelerate.enums import LoggerType, PrecisionType, RNGType
from .accelerate.plugins import DistributedType
from .optimizer import AcceleratedOptimizer
from .scheduler import AcceleratedScheduler

__all__ = ["Accelerator", "AcceleratorState", "PartialState", "GradientState", "AcceleratedOptimizer",
           "AcceleratedScheduler", "DistributedType", "LoggerType", "PrecisionType", "RNGType"]
