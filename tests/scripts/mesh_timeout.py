"""Launched on 2 processes with a short `--timeout` by tests/distributed/test_model_parallel.py: a (dp, tp) mesh
from `env.device_mesh`; rank 1 never joins an all-reduce over the dp sub-group, so rank 0's must time out
after the run's timeout (torch gives mesh sub-groups 30 minutes)."""

import time

import torch
import torch.distributed as dist

from cadence.distributed import env

env.setup_distrib()
mesh = env.device_mesh("cpu", (2, 1), ("dp", "tp"))
if env.rank() == 1:
    time.sleep(600)
dist.all_reduce(torch.ones(1), group=mesh.get_group("dp"))
