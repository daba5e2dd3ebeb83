"""docs/notebooks.md's code, whole: `python docs/examples/notebooks.py` (or the same lines in notebook cells; a
few seconds on a CPU). The page shows the section between the `--8<--` markers; tests/test_docs_examples.py runs
this file and checks what the page says: two processes trained, and rank 0's result came back."""

import torch
from torch import nn
from torch.utils.data import TensorDataset

from cadence import DataLoaders, Learner, accuracy, rank, world_size

torch.manual_seed(0)
x = torch.randn(1024, 2)
ds = TensorDataset(x, (x.sum(1) > 0).long())   # the class is whether x0 + x1 > 0
dls = DataLoaders.from_dsets(ds, TensorDataset(x[:256], ds.tensors[1][:256]), bs=64)
model = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2))

# --8<-- [start:launch]
from cadence import notebook_launcher

def train():
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=accuracy)
    with learn.distrib_ctx(in_notebook=True):
        learn.fit_one_cycle(3, 1e-2)
        print(f"rank {rank()} of {world_size()} trained")
    return learn.validate()

result = notebook_launcher(train, num_processes=2)
# --8<-- [end:launch]
print(f"result on the notebook's side: valid loss {result[0]:.3f}, accuracy {result[1]:.3f}")
