"""Launched by tests/distributed/test_fit_outside_ctx.py: a fit outside distrib_ctx (`alone`) or inside it."""

import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

from cadence import DataLoaders, Learner

torch.manual_seed(0)
x = torch.randn(64, 4)
dls = DataLoaders.from_dsets(TensorDataset(x, (x[:, 0] > 0).long()), bs=16)
learn = Learner(dls, nn.Linear(4, 2), loss_func=nn.CrossEntropyLoss())
if sys.argv[1] == "alone":
    learn.fit(1)
    learn.fit(1)   # said once
else:
    with learn.distrib_ctx():
        learn.fit(1)
print(f"STEPS {learn.step}", flush=True)
