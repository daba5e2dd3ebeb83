"""DataLoaders, device transfer, schedules."""

import math
from collections import namedtuple

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from cadence import (AvgSmoothLoss, DataLoaders, Learner, SchedCos, SchedExp, SchedLin, SchedNo, combine_scheds,
                     to_device)
from cadence.trainer.schedule import get_hyper, set_hyper


def test_to_device_walks_tuples_lists_dicts_and_namedtuples():
    Pair = namedtuple("Pair", "a b")
    batch = {"x": torch.ones(2), "rest": [torch.zeros(1), (torch.ones(1), "label")], "pair": Pair(torch.ones(1), 3)}
    out = to_device(batch, torch.device("meta"))
    assert out["x"].device.type == "meta" and out["rest"][0].device.type == "meta"
    assert out["rest"][1][0].device.type == "meta" and out["rest"][1][1] == "label"
    assert isinstance(out["pair"], Pair) and out["pair"].a.device.type == "meta" and out["pair"].b == 3
    xy = (torch.ones(1), torch.zeros(1))
    assert to_device(xy, "cpu") is xy  # already on the device: no copy of the batch
    sub = [torch.nn.Parameter(torch.ones(1)), torch.zeros(1)]  # a tensor subclass is a tensor too
    assert to_device(sub, "cpu") is sub and to_device(sub, "meta")[0].device.type == "meta"
    for batch in ([torch.ones(1), torch.zeros(1)], (torch.ones(1, device="meta"), torch.ones(1))):
        out = to_device(batch, "meta")
        assert type(out) is type(batch) and [t.device.type for t in out] == ["meta", "meta"]


def test_from_dsets_shuffles_train_only_and_keeps_kwargs():
    ds = TensorDataset(torch.arange(10).float()[:, None], torch.arange(10))
    dls = DataLoaders.from_dsets(ds, ds, bs=4, drop_last=True, device="cpu")
    assert len(dls.train) == 2 and len(dls.valid) == 3  # drop_last only for training
    assert [int(y) for _, yb in dls.valid for y in yb] == list(range(10))
    torch.manual_seed(0)
    assert sorted(int(y) for _, yb in dls.train for y in yb) != list(range(8))  # a shuffled subset
    with pytest.raises(ValueError, match="bs"):
        DataLoaders.from_dsets(ds, bs=0)
    with pytest.raises(TypeError, match="takes a loader: a torch DataLoader or a list of batches.*got int"):
        DataLoaders(3)


def test_dataloaders_refuses_samples_and_datasets_naming_what_it_takes():
    with pytest.raises(TypeError, match=r"DataLoaders\(train=...\) takes a loader.*first element 1 \(int\) is a sample"):
        DataLoaders([1, 2, 3])
    with pytest.raises(TypeError, match=r"DataLoaders\(valid=...\).*from_dsets.*got the dataset TensorDataset"):
        DataLoaders([(torch.ones(2), torch.ones(2))], TensorDataset(torch.ones(3)))


def test_n_inp_splits_inputs_from_targets():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 1)

        def forward(self, a, b):
            return self.lin(torch.cat([a, b], 1))

    x = torch.randn(16, 1)
    batches = [(x[i:i + 4], x[i:i + 4] * 2, x[i:i + 4] * 3) for i in range(0, 16, 4)]
    learn = Learner(DataLoaders(batches, batches, device="cpu", n_inp=2), TwoInputs(), loss_func=nn.MSELoss())
    with learn.no_bar():
        learn.fit(1)
    assert len(learn.recorder.losses) == 4
    with pytest.raises(ValueError, match="n_inp must be a positive int"):
        DataLoaders(batches, device="cpu", n_inp=0)


def test_schedules():
    assert SchedLin(0, 10)(0.25) == 2.5
    assert SchedCos(0, 10)(0.5) == pytest.approx(5) and SchedCos(0, 10)(1) == pytest.approx(10)
    assert SchedNo(3, 9)(0.7) == 3
    assert SchedExp(1e-4, 1e-2)(0.5) == pytest.approx(1e-3)
    f = combine_scheds([0.3, 0.7], [SchedLin(0, 1), SchedLin(1, 0)])
    assert f(0.0) == 0 and f(0.3) == pytest.approx(1) and f(0.65) == pytest.approx(0.5) and f(1.0) == pytest.approx(0)
    with pytest.raises(ValueError, match="summing to 1"):
        combine_scheds([0.5, 0.6], [SchedNo(0, 0), SchedNo(0, 0)])


def test_set_hyper_per_group_and_momentum_names():
    params = [nn.Parameter(torch.ones(1)), nn.Parameter(torch.ones(1))]
    adam = torch.optim.AdamW([{"params": [params[0]]}, {"params": [params[1]]}])
    set_hyper(adam, "lr", [0.1, 0.2])
    set_hyper(adam, "mom", 0.8)
    set_hyper(adam, "wd", 0.5)
    assert get_hyper(adam, "lr") == [0.1, 0.2] and get_hyper(adam, "mom") == [0.8, 0.8]
    assert [g["weight_decay"] for g in adam.param_groups] == [0.5, 0.5]
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    set_hyper(sgd, "mom", 0.7)
    assert sgd.param_groups[0]["momentum"] == 0.7


def test_avg_smooth_loss_is_the_debiased_moving_average():
    class L:
        loss = None

    m, learn, vals = AvgSmoothLoss(beta=0.9), L(), [1.0, 2.0, 3.0]
    for v in vals:
        learn.loss = torch.tensor(v)
        m.accumulate(learn)
    ema = 0.0
    for v in vals:
        ema = 0.9 * ema + 0.1 * v
    assert m.value == pytest.approx(ema / (1 - 0.9 ** 3))
    assert not math.isnan(m.value)
