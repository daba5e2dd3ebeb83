"""Big models: build without memory, spread over GPUs, CPU and disk, load sharded checkpoints (Accelerate's names).

>>> from cadence.big_modeling import init_empty_weights, load_checkpoint_and_dispatch
>>> with init_empty_weights():
...     model = BigModel()
>>> model = load_checkpoint_and_dispatch(model, "export/", device_map="auto", max_memory={"cpu": "8GB"},
...                                      no_split_module_classes=["Block"])
>>> model.hf_device_map
{'embed': 'cpu', 'blocks.0': 'cpu', ..., 'blocks.11': 'disk', 'head': 'disk'}
"""

from .device_map import compact_device_map, infer_auto_device_map, memory_budgets, module_sizes
from .dispatch import dispatch_model, load_checkpoint_and_dispatch
from .init import init_empty_weights, init_on_device
from .memory import (compute_module_sizes, dtype_byte_size, find_tied_parameters, get_balanced_memory, load_state_dict,
                     set_module_tensor_to_device)
from .offload import UserCpuOffloadHook, cpu_offload, cpu_offload_with_hook, disk_offload, load_checkpoint_in_model
from .weights import checkpoint_refs, read_tensor

__all__ = ["init_empty_weights", "init_on_device", "infer_auto_device_map", "dispatch_model",
           "load_checkpoint_and_dispatch", "module_sizes", "memory_budgets", "compact_device_map",
           "checkpoint_refs", "read_tensor", "compute_module_sizes", "get_balanced_memory", "find_tied_parameters",
           "set_module_tensor_to_device", "load_state_dict", "dtype_byte_size", "cpu_offload_with_hook",
           "UserCpuOffloadHook", "cpu_offload", "disk_offload", "load_checkpoint_in_model"]
