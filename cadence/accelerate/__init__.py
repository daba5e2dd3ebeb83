"""Hugging Face Accelerate's API on cadence's engines: change `from accelerate import ...` to `from cadence import ...`.

Accelerate's modules have their cadence counterparts: `cadence.utils` (`accelerate.utils`),
`cadence.logging`, `cadence.local_sgd`; this package implements them all.

>>> from cadence import Accelerator
>>> accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
>>> model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
"""

from .accelerator import Accelerator
from .dynamo import DynamoBackend, TorchDynamoPlugin
from .enums import LoggerType, PrecisionType, RNGType
from .handlers import (AutocastKwargs, DDPCommunicationHookType, DistributedDataParallelKwargs, DummyOptim,
                       DummyScheduler, GradScalerKwargs, InitProcessGroupKwargs, ProfileKwargs, ProjectConfiguration)
from .imports import *  # noqa: F403 (the is_*_available checks, listed in imports.__all__)
from .imports import __all__ as _IMPORTS
from .local_sgd import LocalSGD
from .parallelism import ParallelismConfig
from .plugins import (DataLoaderConfiguration, DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin,
                      GradientAccumulationPlugin)
from .prepared import PreparedDataLoader, PreparedOptimizer, PreparedScheduler
from .state import AcceleratorState, GradientState, PartialState
from .utils import (find_executable_batch_size, gather_object, patch_environment, release_memory, set_seed,
                    synchronize_rng_states, tqdm)

__all__ = ["Accelerator", "PartialState", "AcceleratorState", "GradientState", "DistributedDataParallelKwargs", "GradScalerKwargs",
           "InitProcessGroupKwargs", "ProjectConfiguration", "DummyOptim", "DummyScheduler", "PreparedDataLoader",
           "PreparedOptimizer", "PreparedScheduler", "find_executable_batch_size", "set_seed",
           "DistributedType", "DataLoaderConfiguration", "GradientAccumulationPlugin", "FullyShardedDataParallelPlugin",
           "DeepSpeedPlugin", "DDPCommunicationHookType", "ProfileKwargs", "LocalSGD", "synchronize_rng_states",
           "gather_object", "patch_environment", "tqdm", "release_memory", "ParallelismConfig", "AutocastKwargs",
           "LoggerType", "PrecisionType", "RNGType", "TorchDynamoPlugin", "DynamoBackend", *_IMPORTS]
