"""Launched on 2 processes: a short DDP fit under distrib_ctx that must end with exit code 0.

Rank 0 prints `FINISHED <sha1 of the final weights>`, so runs can be compared (one node or two).
"""

import hashlib

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import DataLoaders, Learner
from cadence.distributed.env import rank

torch.manual_seed(0)
x = torch.randn(64, 4)
dls = DataLoaders(DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4), device="cpu")
learn = Learner(dls, nn.Linear(4, 1), loss_func=nn.MSELoss(), opt_func=torch.optim.SGD, lr=0.05)
with learn.distrib_ctx():
    learn.fit(2)
if rank() == 0:
    weights = torch.cat([p.detach().flatten() for p in learn.model.parameters()])
    print(f"FINISHED {hashlib.sha1(weights.double().numpy().tobytes()).hexdigest()}", flush=True)
