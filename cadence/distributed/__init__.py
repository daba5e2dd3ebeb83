"""cadence.distributed: the engines and the collectives; knows nothing of the Learner.

fastai users write `from cadence.distributed import *` as they wrote `from fastai.distributed import *`.

>>> from cadence.distributed import DistributedDL, setup_distrib, rank0_first, get_strategy
"""

from ..nested import send_to_device
from .data import DistributedDL
from .env import (default_device, is_distributed, is_initialized, is_local_main_process, is_main_process, local_rank,
                  node_rank, rank, setup_distrib, teardown_distrib, world_size)
from .notebook import debug_launcher, notebook_launcher
from .ops import (broadcast, gather, gather_for_metrics, gather_object, get_logger, local_main_process_first,
                  main_print, main_process_first, on_local_main_process, on_main_process, pad_across_processes,
                  rank0_first, reduce, wait_for_everyone)
from .registry import STRATEGIES, get_strategy
from .strategy import OwnsAccumulation, OwnsClipping, OwnsPrecision, OwnsStep, SingleDevice, Strategy

__all__ = [
    "DistributedDL", "send_to_device", "default_device", "is_distributed", "is_initialized", "is_local_main_process",
    "is_main_process", "local_rank", "node_rank", "rank", "setup_distrib", "teardown_distrib", "world_size",
    "debug_launcher", "notebook_launcher", "broadcast", "gather", "gather_for_metrics", "gather_object", "get_logger",
    "local_main_process_first", "main_print", "main_process_first", "on_local_main_process", "on_main_process",
    "pad_across_processes", "rank0_first", "reduce", "wait_for_everyone", "STRATEGIES", "get_strategy",
    "OwnsAccumulation", "OwnsClipping", "OwnsPrecision", "OwnsStep", "SingleDevice", "Strategy",
]
