"""docs/index.md's code, whole: `python docs/examples/index.py`, or `cadence launch --num_processes 2
docs/examples/index.py` (a few seconds on a CPU). The page shows the section between the `--8<--` markers;
tests/test_docs_examples.py runs this file and checks the accuracy it prints."""

import torch
from torch.utils.data import TensorDataset


def make_ds(n: int) -> TensorDataset:
    """n points in the plane; the class is whether x0 + x1 > 0."""
    x = torch.randn(n, 2)
    return TensorDataset(x, (x.sum(1) > 0).long())


torch.manual_seed(0)
train_ds, valid_ds = make_ds(1024), make_ds(256)
model = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

# --8<-- [start:quickstart]
from torch import nn
from cadence import DataLoaders, Learner, accuracy

learn = Learner(DataLoaders.from_dsets(train_ds, valid_ds, bs=64), model,
                loss_func=nn.CrossEntropyLoss(), metrics=accuracy)
with learn.distrib_ctx():            # one process, or every process `cadence launch` started
    learn.fit_one_cycle(3, lr_max=1e-2)
# --8<-- [end:quickstart]
print(f"validation accuracy: {learn.validate()[1]:.3f}")
