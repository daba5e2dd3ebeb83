"""`accelerate.utils` under cadence: `from accelerate.utils import X` becomes `from cadence.utils import X`.

The names are implemented in `cadence.accelerate` (plugins, kwargs handlers, helpers) and
`cadence.distributed` (collectives); this module only gathers them where Accelerate's users look.

>>> from cadence.utils import DistributedDataParallelKwargs, DDPCommunicationHookType, ProfileKwargs, set_seed
"""

from ..accelerate import __all__ as _ACCELERATE
from ..accelerate import *  # noqa: F403 (every name of cadence.accelerate, as accelerate.utils has them)
from ..big_modeling import infer_auto_device_map
from ..big_modeling.offload import load_checkpoint_in_model
from ..distributed.data import send_to_device
from ..distributed.ops import broadcast, gather, pad_across_processes, reduce, wait_for_everyone
from .config import write_basic_config
from .dataclasses import KwargsHandler
from .modeling import extract_model_from_parallel, is_compiled_module, is_peft_model
from .operations import broadcast_object_list

__all__ = [*_ACCELERATE, "KwargsHandler", "send_to_device", "broadcast", "gather", "pad_across_processes", "reduce",
           "wait_for_everyone", "extract_model_from_parallel", "is_compiled_module", "is_peft_model",
           "broadcast_object_list", "write_basic_config", "infer_auto_device_map", "load_checkpoint_in_model"]
