"""`accelerate.state` under cadence: `from accelerate.state import AcceleratorState` becomes
`from cadence.state import AcceleratorState`. After an Accelerator is built, `AcceleratorState()` reads its
settings, as Accelerate's one shared state does.

>>> from cadence.state import AcceleratorState, PartialState, is_initialized
>>> accelerator = Accelerator(mixed_precision="bf16")
>>> is_initialized(), AcceleratorState().mixed_precision, PartialState().num_processes
(True, 'bf16', 1)
"""

from .accelerate.dynamo import DynamoBackend
from .accelerate.plugins import DistributedType, GradientAccumulationPlugin
from .accelerate.state import AcceleratorState, GradientState, PartialState, is_initialized
from .utils.environment import parse_flag_from_env
from .utils.unavailable import module_getattr

__all__ = ["AcceleratorState", "PartialState", "GradientState", "is_initialized", "DistributedType", "DynamoBackend",
           "GradientAccumulationPlugin", "parse_flag_from_env"]

__getattr__ = module_getattr(__name__, {
    "SageMakerDistributedType": "SageMaker is not a cadence launcher; start the run with `cadence launch`",
    "ThreadLocalSharedDict": "cadence's states are plain objects: AcceleratorState() reads the first Accelerator's "
                             "settings",
}, "accelerate.state")
