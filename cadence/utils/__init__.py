"""`accelerate.utils` under cadence: `from accelerate.utils import X` becomes `from cadence.utils import X`.

The names are implemented in `cadence.accelerate` (plugins, kwargs handlers, helpers) and
`cadence.distributed` (collectives); this module only gathers them where Accelerate's users look.

>>> from cadence.utils import DistributedDataParallelKwargs, DDPCommunicationHookType, ProfileKwargs, set_seed
>>> from cadence.utils import broadcast, gather, reduce, send_to_device, find_batch_size, is_torch_version
>>> from cadence.utils import compile_regions     # each repeated block compiled once, in place

Accelerate's names without a cadence counterpart (fp8, Megatron-LM, ...) raise ImportError saying what to use
instead (`cadence.utils.unavailable`).
"""

from ..accelerate import __all__ as _ACCELERATE
from ..accelerate import *  # noqa: F403 (every name of cadence.accelerate, as accelerate.utils has them)
from ..big_modeling import infer_auto_device_map
from ..big_modeling.memory import (compute_module_sizes, dtype_byte_size, find_tied_parameters, get_balanced_memory,
                                   load_state_dict, set_module_tensor_to_device)
from ..big_modeling.offload import load_checkpoint_in_model
from ..compile import compile_regions, compile_regions_deepspeed, has_compiled_regions
from ..distributed.ops import wait_for_everyone
from .config import write_basic_config
from .constants import *  # noqa: F403 (the file names of a saved model)
from .constants import __all__ as _CONSTANTS
from .dataclasses import KwargsHandler
from .environment import *  # noqa: F403 (str_to_bool, parse_flag_from_env)
from .environment import __all__ as _ENVIRONMENT
from .modeling import (check_device_map, convert_file_size_to_int, extract_model_from_parallel, get_max_memory,
                       is_compiled_module, is_peft_model, named_module_tensors, retie_parameters)
from .offload import load_offloaded_weight, offload_state_dict, offload_weight, save_offload_index
from .operations import *  # noqa: F403 (Accelerate's operations: the collectives and nested-tensor helpers)
from .operations import __all__ as _OPERATIONS
from .saving import load, save
from .sizes import calculate_maximum_sizes, convert_bytes
from .unavailable import module_getattr
from .versions import compare_versions, is_torch_version

__all__ = [*_ACCELERATE, *_OPERATIONS, *_CONSTANTS, *_ENVIRONMENT, "KwargsHandler", "wait_for_everyone", "extract_model_from_parallel",
           "is_compiled_module", "is_peft_model", "get_max_memory", "convert_file_size_to_int", "compare_versions",
           "is_torch_version", "write_basic_config", "infer_auto_device_map", "load_checkpoint_in_model",
           "compute_module_sizes", "dtype_byte_size", "find_tied_parameters", "get_balanced_memory", "load_state_dict",
           "set_module_tensor_to_device", "compile_regions", "compile_regions_deepspeed", "has_compiled_regions",
           "calculate_maximum_sizes", "check_device_map", "convert_bytes", "named_module_tensors", "retie_parameters", "offload_weight",
           "offload_state_dict", "save_offload_index", "load_offloaded_weight", "save", "load"]

__getattr__ = module_getattr(__name__)   # Accelerate's names cadence has no counterpart for: what to use instead
