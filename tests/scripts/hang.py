"""Launched on 2 processes: rank 1 stops responding in after_batch at step 3; rank 0 goes on to time out.

Each rank prints `STARTED <pid>` (for tests that look for leftover workers). With the argument
`sigterm-marker <dir>`, a rank that gets SIGTERM writes `<dir>/rank<N>.sigterm` and exits 143
(a stand-in for fit's own preemption handling).
"""

import os
import signal
import sys
import time
from pathlib import Path

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
    while True:
        time.sleep(1)


def on_sigterm(signum, frame):
    Path(sys.argv[2], f"rank{rank()}.sigterm").write_text(str(os.getpid()))
    os._exit(128 + signum)


if sys.argv[1:2] == ["sigterm-marker"]:
    signal.signal(signal.SIGTERM, on_sigterm)
print(f"STARTED {os.getpid()}", flush=True)
x = torch.randn(64, 4)
dls = DataLoaders(DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4), device="cpu")
learn = Learner(dls, nn.Linear(4, 1), loss_func=nn.MSELoss(), cbs=HangOnRank1())
with learn.distrib_ctx():
    learn.fit(100)
