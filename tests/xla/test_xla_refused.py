"""strategy="xla" in an environment without torch_xla (the main one): refused before any work, saying how to install."""

import importlib.util

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from cadence.distributed.registry import get_strategy
from cadence.trainer.data import DataLoaders
from cadence.trainer.learner import Learner


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is installed here")
def test_xla_without_torch_xla_says_how_to_install():
    ds = TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
    learn = Learner(DataLoaders(DataLoader(ds, batch_size=4)), torch.nn.Linear(2, 1), loss_func=torch.nn.MSELoss())
    before = {k: v.clone() for k, v in learn.model.state_dict().items()}
    with pytest.raises(ImportError, match=r'strategy "xla" needs torch_xla.*pip install "cadence\[xla\]".*make setup-xla'):
        with learn.distrib_ctx(strategy="xla"):
            learn.fit(1)
    assert all(torch.equal(before[k], v) for k, v in learn.model.state_dict().items())  # nothing trained
    assert learn.strategy.name == "single"
    with pytest.raises(ImportError, match="torch_xla"):
        get_strategy("xla")


def test_cadence_env_reports_no_xla_runtime_here():
    from cadence.distributed.config import environment_report

    assert "XLA runtime: none (torch_xla not installed)" in environment_report()
