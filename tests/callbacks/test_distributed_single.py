"""distrib_ctx and parallel_ctx in a single process: the same script runs unchanged with `python train.py`."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from cadence import DistributedDL, Learner, accuracy
from cadence.distributed.strategy import SingleDevice


def test_distrib_ctx_in_one_process_trains_and_restores(dls):
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=accuracy)
    train, valid = dls.train, dls.valid
    with learn.no_bar(), learn.distrib_ctx():
        assert isinstance(learn.dls.train, DistributedDL) and learn.model is model
        learn.fit(1)
        inside = learn.validate()
    assert learn.dls.train is train and learn.dls.valid is valid
    assert isinstance(learn.strategy, SingleDevice) and learn.model is model
    assert not any(type(cb).__name__ == "DistributedTrainer" for cb in learn.cbs)
    assert learn.validate() == pytest.approx(inside)


def test_to_distributed_twice_is_refused(dls):
    learn = Learner(dls, nn.Linear(8, 3), loss_func=nn.CrossEntropyLoss())
    learn.to_distributed()
    with pytest.raises(ValueError, match="already distributed"):
        learn.to_distributed()
    learn.detach_distributed()
    assert isinstance(learn.dls.train, DataLoader)


def test_unknown_strategy_name(dls):
    learn = Learner(dls, nn.Linear(8, 3), loss_func=nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="unknown strategy 'dpp'; choose one of"):
        learn.to_distributed(strategy="dpp")
    assert isinstance(learn.dls.train, DataLoader)


def test_parallel_ctx_is_a_no_op_without_two_gpus(dls):
    # this machine has no GPU: DataParallel needs two; the wrapping itself cannot be exercised here
    model = nn.Linear(8, 3)
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss())
    with learn.no_bar(), learn.parallel_ctx():
        assert learn.model is model
        learn.fit(1)
    assert learn.model is model
