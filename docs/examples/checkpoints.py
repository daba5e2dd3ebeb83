"""docs/checkpoints.md's code, whole: `python docs/examples/checkpoints.py` (a few seconds on a CPU; writes
checkpoints/ and ckpt/ under the current directory). Run it again and the fit resumes from checkpoints/latest.
The page shows the section between the `--8<--` markers; tests/test_docs_examples.py runs this file twice."""

import torch
from torch import nn
from torch.utils.data import TensorDataset

from cadence import Accelerator, Checkpoint, DataLoaders, Learner, accuracy

torch.manual_seed(0)
x = torch.randn(512, 2)
ds = TensorDataset(x, (x.sum(1) > 0).long())   # the class is whether x0 + x1 > 0
learn = Learner(DataLoaders.from_dsets(ds, ds, bs=64), nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2)),
                loss_func=nn.CrossEntropyLoss(), metrics=accuracy)
accelerator = Accelerator()
model, optimizer = accelerator.prepare(nn.Linear(2, 2), torch.optim.SGD(learn.model.parameters(), lr=0.1))

# --8<-- [start:async]
learn.fit(10, cbs=Checkpoint(every_n_steps=200, keep_last=3, async_save=True), resume="auto")
accelerator.save_state("ckpt", async_save=True)   # finished by the next save_state / load_state / end_training
# --8<-- [end:async]
accelerator.end_training()
print(f"trained to step {learn.step}")
