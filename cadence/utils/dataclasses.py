"""`accelerate.utils.dataclasses` under cadence: the configuration dataclasses, enums and kwargs handlers."""

from ..accelerate.handlers import (DDPCommunicationHookType, DistributedDataParallelKwargs, DummyOptim, DummyScheduler,
                                   GradScalerKwargs, InitProcessGroupKwargs, KwargsHandler, ProfileKwargs,
                                   ProjectConfiguration)
from ..accelerate.plugins import (DataLoaderConfiguration, DeepSpeedPlugin, DistributedType,
                                  FullyShardedDataParallelPlugin, GradientAccumulationPlugin)

__all__ = ["DDPCommunicationHookType", "DistributedDataParallelKwargs", "DummyOptim", "DummyScheduler",
           "GradScalerKwargs", "InitProcessGroupKwargs", "KwargsHandler", "ProfileKwargs", "ProjectConfiguration",
           "DataLoaderConfiguration", "DeepSpeedPlugin", "DistributedType", "FullyShardedDataParallelPlugin",
           "GradientAccumulationPlugin"]
