"""Under torchrun: `strategy="xla"` (guard: refuses a world the XLA runtime does not see), or with `allreduce`
a plain torch_xla all-reduce across the processes (fails on the CPU today: pytorch/xla issue 9089)."""

import json
import os
import sys

import torch_xla

torch_xla.device()

import torch  # noqa: E402

if sys.argv[1] == "allreduce":
    import torch.distributed as dist
    import torch_xla.distributed.xla_backend  # noqa: F401

    dist.init_process_group("xla", init_method="xla://")
    t = torch.ones(2, device=torch_xla.device()) * (int(os.environ["RANK"]) + 1)
    dist.all_reduce(t)
    torch_xla.sync()
    print(json.dumps({"world": dist.get_world_size(), "sum": t.cpu().tolist()}))
else:
    from torch.utils.data import DataLoader, TensorDataset

    from cadence.trainer.data import DataLoaders
    from cadence.trainer.learner import Learner

    ds = TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
    learn = Learner(DataLoaders(DataLoader(ds, batch_size=4)), torch.nn.Linear(2, 1), loss_func=torch.nn.MSELoss())
    with learn.distrib_ctx(strategy="xla"):
        learn.fit(1)
