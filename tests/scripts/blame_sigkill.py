"""Launched on 2 processes: a training loop whose gradients are all-reduced over gloo; rank 1 SIGKILLs itself
after step 5 while rank 0 goes on into step 6's all-reduce, which fails on the connection rank 1's death closed
("Connection reset by peer").

Each rank prints `STARTED <pid>`; rank 1 prints `KILLING <pid>` just before it dies.
"""

import os
import signal

import torch
import torch.distributed as dist
from torch import nn

KILL_STEP = 5

dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"STARTED {os.getpid()}", flush=True)
torch.manual_seed(0)
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1, 10_000):
    x = torch.randn(8, 4)
    nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad()
    if rank == 1 and step == KILL_STEP:
        print(f"KILLING {os.getpid()}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
