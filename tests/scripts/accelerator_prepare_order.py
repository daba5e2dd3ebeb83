"""Launched on 2 processes (DDP or --use_fsdp) by tests/accelerate/test_accelerate_ports.py.

The optimizer is built over the plain model, then prepared with it in one call, optimizer first
(`together`), in a call of its own after `prepare(model)` (`apart`), or in a call of its own before it
(`optimizer-first`). Either way it ends up stepping
the parameters the strategy's wrapped model trains (FSDP's sharded ones), the training matches the
same steps in one process, and `save_state` / `load_state` carry its momentum. Prints "ORDER OK" on
the main process.

    cadence launch --num_processes 2 [--use_fsdp] accelerator_prepare_order.py together|apart|optimizer-first CHECKPOINT_DIR
"""

import copy
import sys

import torch
import torch.nn.functional as F

from cadence import Accelerator, broadcast, set_seed

mode, checkpoint = sys.argv[1], sys.argv[2]
set_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
reference = copy.deepcopy(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
accelerator = Accelerator()
if mode == "together":
    optimizer, model = accelerator.prepare(optimizer, model)       # the optimizer first
elif mode == "optimizer-first":
    optimizer = accelerator.prepare(optimizer)                     # before its model: bound when the model comes
    model = accelerator.prepare(model)
else:
    model = accelerator.prepare_model(model)
    optimizer = accelerator.prepare_optimizer(optimizer)           # still over the plain model's parameters
trained = {id(p) for p in model.parameters()}
assert all(id(p) in trained for g in optimizer.param_groups for p in g["params"]), "optimizer holds stale parameters"

ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
g = torch.Generator().manual_seed(1)


def train(steps):
    for _ in range(steps):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)   # the same global batch everywhere
        mine = slice(accelerator.process_index * 4, accelerator.process_index * 4 + 4)
        accelerator.backward(F.mse_loss(model(x[mine]), y[mine]))
        optimizer.step(); optimizer.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step(); ref_opt.zero_grad()


train(3)
accelerator.save_state(checkpoint)
saved_reference, saved_ref_opt, data_state = copy.deepcopy(reference), copy.deepcopy(ref_opt.state_dict()), g.get_state()
train(2)                                  # weights and momentum move on; load_state takes both back
accelerator.load_state(checkpoint)
reference.load_state_dict(saved_reference.state_dict())
ref_opt.load_state_dict(saved_ref_opt)
g.set_state(data_state)
train(2)                                  # the same two steps again: equal only if the momentum came back
full = accelerator.get_state_dict(model)
if accelerator.is_main_process:
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6)
    print("ORDER OK")
broadcast(0)
