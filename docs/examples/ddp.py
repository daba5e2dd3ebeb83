"""docs/ddp.md's code, whole: `cadence launch --num_processes 2 docs/examples/ddp.py` (add `--cpu` without GPUs),
or `python docs/examples/ddp.py` on one process; a few seconds on a CPU, writing data.pt under the current
directory. The page shows the section between the `--8<--` markers; tests/test_docs_examples.py launches this
file on 2 processes and checks what the page says."""

from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from cadence import DataLoaders, accuracy, world_size


def download_data():
    """Stands in for a download: writes the data set unless it is there already, returns where it is."""
    if not Path("data.pt").exists():
        x = torch.randn(1024, 2, generator=torch.Generator().manual_seed(0))
        torch.save((x, (x.sum(1) > 0).long()), "data.pt")   # the class is whether x0 + x1 > 0
    return "data.pt"


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2))

# --8<-- [start:data]
from cadence import Learner, rank0_first
path = rank0_first(download_data)          # rank 0 first, the others then read what it wrote
# --8<-- [end:data]
x, y = torch.load(path)
dls = DataLoaders.from_dsets(TensorDataset(x[:768], y[:768]), TensorDataset(x[768:], y[768:]), bs=64)
# --8<-- [start:fit]
learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=accuracy)
with learn.distrib_ctx():                  # DDP over however many processes were launched
    learn.fit_one_cycle(3, 1e-2)
# --8<-- [end:fit]
    preds, targs = learn.get_preds()       # the whole validation set, in order, on every rank
print(f"processes {world_size()}: get_preds {len(preds)} items, targets in order {torch.equal(targs, y[768:])}, "
      f"accuracy {learn.validate()[1]:.3f}")
