"""MixedPrecision removed from a Learner takes its precision off the strategy: a later fit without it runs in fp32."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import Callback, DataLoaders, Learner
from cadence.callbacks.precision import MixedPrecision


def learner(cbs=()):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 6, generator=g)
    y = (x @ torch.randn(6, 3, generator=g)).argmax(1)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=8), DataLoader(TensorDataset(x, y), batch_size=8),
                      device="cpu")
    torch.manual_seed(0)
    learn = Learner(dls, Probe(), loss_func=nn.CrossEntropyLoss(), lr=0.1, cbs=list(cbs))
    learn.remove_cb(learn.progress)
    return learn


class Probe(nn.Module):
    """Records the dtype its layer computes in (bf16 / fp16 under autocast)."""

    def __init__(self):
        super().__init__()
        self.layer, self.dtypes = nn.Linear(6, 3), set()

    def forward(self, x):
        out = self.layer(x)
        self.dtypes.add(out.dtype)
        return out


class InfiniteLossAt(Callback):
    """An infinite loss on one training batch: under fp16 its step is skipped (GradScaler), in fp32 it is taken."""

    def after_loss(self):
        if self.training and self.iter == 1:
            self.learn.loss_grad = self.loss_grad * float("inf")


def test_removing_mixed_precision_after_a_fit_leaves_the_strategy_in_fp32():
    learn = learner([MixedPrecision("fp16")])
    learn.fit(1)
    assert learn.strategy.precision.name == "fp16" and learn.model.dtypes == {torch.float16}
    learn.remove_cb(MixedPrecision)
    assert learn.strategy.precision.name == "no"
    learn.model.dtypes.clear()
    learn.fit(1, cbs=InfiniteLossAt())
    assert learn.model.dtypes == {torch.float32}
    assert learn.step == 4   # every step taken: no GradScaler left to skip the overflowing one


def test_a_mixed_precision_given_to_fit_alone_is_gone_after_it():
    learn = learner()
    learn.fit(1, cbs=MixedPrecision("fp16"))
    assert learn.strategy.precision.name == "no"
    learn.model.dtypes.clear()
    learn.validate()
    assert learn.model.dtypes == {torch.float32}


def test_a_removed_then_added_again_callback_sets_its_precision_again_outside_fit():
    cb = MixedPrecision("bf16")
    learn = learner([cb])
    learn.fit(1)
    learn.remove_cb(cb)
    learn.add_cb(cb)
    learn.model.dtypes.clear()
    learn.validate()   # no fit in between: the callback's forward_context sets it
    assert learn.model.dtypes == {torch.bfloat16} and learn.strategy.precision is cb.plugin


def test_removing_one_callback_keeps_another_ones_precision():
    old, new = MixedPrecision("fp16"), MixedPrecision("bf16")
    learn = learner([old])
    learn.fit(1)
    learn.remove_cb(old).add_cb(new)
    learn.fit(1)
    learn.remove_cb(old)   # not attached any more: nothing changes
    assert learn.strategy.precision is new.plugin
    learn.to_fp32()
    assert learn.strategy.precision.name == "no"


def test_a_launchers_mixed_precision_leaves_with_distrib_ctx(monkeypatch):
    monkeypatch.setenv("CADENCE_MIXED_PRECISION", "bf16")
    learn = learner()
    with learn.distrib_ctx():
        learn.fit(1)
        inner = learn.strategy
        assert inner.precision.name == "bf16"
    assert inner.precision.name == "no" and learn.strategy.precision.name == "no"
    monkeypatch.delenv("CADENCE_MIXED_PRECISION")
    probe = learn.strategy.unwrap(learn.model)
    probe.dtypes.clear()
    learn.fit(1)
    assert probe.dtypes == {torch.float32}
