"""`accelerate.parallelism_config` under cadence: `ParallelismConfig`, the sizes of tensor and data parallelism.

>>> from cadence.parallelism_config import ParallelismConfig
>>> ParallelismConfig(tp_size=2, dp_shard_size=2).dp_cp_dim_names
['dp_shard']
"""

from .accelerate.parallelism import ParallelismConfig

__all__ = ["ParallelismConfig"]
