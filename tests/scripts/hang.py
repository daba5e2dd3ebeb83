"""Launched on 2 processes: rank 1 stops responding in after_batch at step 3; rank 0 goes on to time out.

Each rank prints `STARTED <pid>` (for tests that look for leftover workers); rank 1 prints
`HANGING AT <unix time> <pid>` when it stops responding: by sleeping in a loop, or with `--sigstop`
by stopping itself (SIGSTOP, as a debugger or a frozen node would; it trains on if continued).
`--checkpoint DIR` adds a Checkpoint callback (its preemption handler catches SIGTERM).
"""

import argparse
import os
import signal
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import Callback, DataLoaders, Learner
from cadence.callbacks import Checkpoint
from cadence.distributed.env import rank

HANG_STEP = 3
parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint", default=None, help="directory of a Checkpoint callback (none without)")
parser.add_argument("--sigstop", action="store_true", help="rank 1 stops itself with SIGSTOP instead of sleeping")
args = parser.parse_args()


class HangOnRank1(Callback):
    def after_batch(self):
        if rank() == 1 and self.step == HANG_STEP:
            stop_responding()


def stop_responding():
    print(f"HANGING AT {time.time()} {os.getpid()}", flush=True)
    if args.sigstop:
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    while True:
        time.sleep(1)


print(f"STARTED {os.getpid()}", flush=True)
x = torch.randn(64, 4)
dls = DataLoaders(DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4), device="cpu")
cbs = [HangOnRank1()] + ([Checkpoint(args.checkpoint, every_epoch=False)] if args.checkpoint else [])
learn = Learner(dls, nn.Linear(4, 1), loss_func=nn.MSELoss(), cbs=cbs)
with learn.distrib_ctx():
    learn.fit(100)
