"""Launched on 2 processes: plain torch DDP over gloo that never destroys its process group.

The shape that used to die with SIGABRT at interpreter exit; rank 0 prints `PLAIN DONE`.
"""

import torch
import torch.distributed as dist
from torch import nn

from cadence.distributed.env import setup_distrib

setup_distrib()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(20):
    x = torch.randn(16, 32)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
if dist.get_rank() == 0:
    print("PLAIN DONE", flush=True)
