"""Small data sets and models shared by the single-process tests."""

import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import DataLoaders


def make_data(n_train=64, n_valid=32, n_in=8, n_out=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_train + n_valid, n_in, generator=g)
    w = torch.randn(n_in, n_out, generator=g)
    y = (x @ w).argmax(1)
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


@pytest.fixture
def dsets():
    return make_data()


@pytest.fixture
def dls(dsets):
    train, valid = dsets
    return DataLoaders(DataLoader(train, batch_size=16, shuffle=False), DataLoader(valid, batch_size=16), device="cpu")


@pytest.fixture
def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def make_learner(dls, path, cbs=(), model=None):
    """A Learner without the progress display, with the `model` fixture's network (same seed) unless given."""
    from cadence import Learner, accuracy

    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=accuracy, path=path, cbs=list(cbs))
    learn.remove_cb(learn.progress)
    return learn


def edit_state(checkpoint, change):
    """Change a checkpoint's state.json in place: `change(state)` edits the parsed dict."""
    file = checkpoint / "state.json"
    state = json.loads(file.read_text())
    change(state)
    file.write_text(json.dumps(state))
