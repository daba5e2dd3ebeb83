"""Launched on 2 processes: rank 1 raises in the middle of a DDP epoch, while rank 0 is in the loop.

Rank 1 prints `RAISING AT <unix time>` just before it raises, so a test can time the shutdown.
"""

import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import Callback, DataLoaders, Learner
from cadence.distributed.env import rank


class FailMidEpoch(Callback):
    def after_batch(self):
        if self.training and self.iter == 2:
            step(self.iter)


def step(i: int) -> None:
    if rank() == 1:
        print(f"RAISING AT {time.time()}", flush=True)
        raise ValueError(f"launch_raise failed on purpose at step {i}")


x = torch.randn(64, 4)
dls = DataLoaders(DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4), device="cpu")
learn = Learner(dls, nn.Linear(4, 1), loss_func=nn.MSELoss(), cbs=FailMidEpoch())
with learn.distrib_ctx():
    learn.fit(2)
