"""Launched on 2 processes (DDP or --use_fsdp) by tests/accelerate/test_accelerate_ports.py.

prepare(optimizer, model): the optimizer, given first and built over the plain model, ends up
stepping the parameters the strategy's wrapped model trains (FSDP's sharded ones), and the
training matches the same steps in one process. Prints "ORDER OK" on the main process.
"""

import copy

import torch
import torch.nn.functional as F

from cadence import Accelerator, broadcast, set_seed

set_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
reference = copy.deepcopy(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
accelerator = Accelerator()
optimizer, model = accelerator.prepare(optimizer, model)       # the optimizer first
trained = {id(p) for p in model.parameters()}
assert all(id(p) in trained for g in optimizer.param_groups for p in g["params"]), "optimizer holds stale parameters"

ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)
for _ in range(5):
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)   # the same global batch everywhere
    mine = slice(accelerator.process_index * 4, accelerator.process_index * 4 + 4)
    accelerator.backward(F.mse_loss(model(x[mine]), y[mine]))
    optimizer.step(); optimizer.zero_grad()
    F.mse_loss(reference(x), y).backward()
    ref_opt.step(); ref_opt.zero_grad()
full = accelerator.get_state_dict(model)
if accelerator.is_main_process:
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6)
    print("ORDER OK")
broadcast(0)
