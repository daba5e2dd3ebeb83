"""A block that fails on rank 0 while rank 1 goes on into a collective (as a rank refusing its own checkpoint file
does while the others load theirs): the run must stop with rank 0's error, not wait in the gather of the weights
at the block's exit until the collective timeout. argv[1]: the strategy ("fsdp" or "deepspeed")."""

import sys
import time

import torch
from torch import nn

from torch.utils.data import TensorDataset

from cadence import DataLoaders, Learner
from cadence.distributed.env import rank

strategy = sys.argv[1]
kwargs = {"zero_stage": 3} if strategy == "deepspeed" else {}
x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
dls = DataLoaders.from_dsets(TensorDataset(x, x[:, :1]), TensorDataset(x[:8], x[:8, :1]), bs=8)
learn = Learner(dls, nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), loss_func=nn.MSELoss(),
                opt_func=torch.optim.SGD, lr=0.01)
with learn.no_bar(), learn.distrib_ctx(strategy=strategy, **kwargs):
    learn.fit(1)
    if rank() == 0:
        raise ValueError("rank 0 refused its checkpoint file")
    time.sleep(1)
    learn.strategy.barrier()
