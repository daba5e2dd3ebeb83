"""Accelerate's test_utils regression model and dataset (y = a*x + b + noise), written for cadence's ported tests."""

import numpy as np
import torch


class RegressionDataset:
    """`length` items {"x": float32, "y": float32} with y = a*x + b + noise, reproducible from `seed`."""

    def __init__(self, a=2, b=3, length=64, seed=None):
        rng = np.random.default_rng(seed)
        self.length = length
        self.x = rng.normal(size=(length,)).astype(np.float32)
        self.y = a * self.x + b + rng.normal(scale=0.1, size=(length,)).astype(np.float32)

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


class RegressionModel(torch.nn.Module):
    """y = a*x + b with scalar parameters a and b."""

    def __init__(self, a=0, b=0):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(a).float())
        self.b = torch.nn.Parameter(torch.tensor(b).float())

    def forward(self, x=None):
        return x * self.a + self.b
