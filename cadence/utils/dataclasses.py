"""`accelerate.utils.dataclasses` under cadence: the configuration dataclasses, enums and kwargs handlers."""

from ..accelerate.dynamo import DynamoBackend, TorchDynamoPlugin
from ..accelerate.enums import LoggerType, PrecisionType, RNGType
from ..accelerate.handlers import (AutocastKwargs, DDPCommunicationHookType, DistributedDataParallelKwargs,
                                   DummyOptim, DummyScheduler, GradScalerKwargs, InitProcessGroupKwargs,
                                   KwargsHandler, ProfileKwargs, ProjectConfiguration)
from ..accelerate.plugins import (DataLoaderConfiguration, DeepSpeedPlugin, DistributedType,
                                  FullyShardedDataParallelPlugin, GradientAccumulationPlugin)
from .unavailable import module_getattr

__all__ = ["AutocastKwargs", "LoggerType", "PrecisionType", "RNGType", "DDPCommunicationHookType",
           "DistributedDataParallelKwargs", "DummyOptim", "DummyScheduler",
           "GradScalerKwargs", "InitProcessGroupKwargs", "KwargsHandler", "ProfileKwargs", "ProjectConfiguration",
           "DataLoaderConfiguration", "DeepSpeedPlugin", "DistributedType", "FullyShardedDataParallelPlugin",
           "GradientAccumulationPlugin", "TorchDynamoPlugin", "DynamoBackend"]

__getattr__ = module_getattr(__name__)   # Accelerate's dataclasses cadence has not (FP8RecipeKwargs, ...): what instead
