"""Launched on 2 processes: rank 1 stops responding in after_batch at step 3; rank 0 goes on to time out.

Each rank prints `STARTED <pid>` (for tests that look for leftover workers); rank 1 prints
`HANGING AT <unix time>` when it stops responding.
"""

import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import Callback, DataLoaders, Learner
from cadence.distributed.env import rank

HANG_STEP = 3


class HangOnRank1(Callback):
    def after_batch(self):
        if rank() == 1 and self.step == HANG_STEP:
            stop_responding()


def stop_responding():
    print(f"HANGING AT {time.time()}", flush=True)
    while True:
        time.sleep(1)


print(f"STARTED {os.getpid()}", flush=True)
x = torch.randn(64, 4)
dls = DataLoaders(DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4), device="cpu")
learn = Learner(dls, nn.Linear(4, 1), loss_func=nn.MSELoss(), cbs=HangOnRank1())
with learn.distrib_ctx():
    learn.fit(100)
