"""Prints what `accelerator.state.fsdp_plugin` holds when the launcher chose FSDP (no plugin given to the
Accelerator). Launched by tests/accelerate/test_accelerate_fsdp_plugin.py."""

import json

from cadence import Accelerator

acc = Accelerator()
plugin = acc.state.fsdp_plugin
print(f"RANK {acc.process_index} " + json.dumps({
    "distributed_type": str(acc.distributed_type), "plugin": type(plugin).__name__, "is_fsdp2": acc.state.is_fsdp2,
    "state_dict_type": getattr(plugin, "state_dict_type", None),
    "wrap": getattr(plugin, "transformer_cls_names_to_wrap", None),
    "offload": getattr(plugin, "cpu_offload", None)}), flush=True)
