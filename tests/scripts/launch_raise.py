"""Launched on 2 processes: rank 1 raises mid-run while rank 0 waits in a collective.

Rank 1 prints `RAISING AT <unix time>` just before it raises, so a test can time the shutdown.
"""

import time

import torch
import torch.distributed as dist

from cadence.distributed.env import rank, setup_distrib

setup_distrib()
dist.all_reduce(torch.ones(1))


def step(i: int) -> None:
    if rank() == 1 and i == 2:
        print(f"RAISING AT {time.time()}", flush=True)
        raise ValueError(f"launch_raise failed on purpose at step {i}")


for i in range(5):
    step(i)
    dist.all_reduce(torch.ones(1))
