"""get_preds, validate, tta and loss_not_reduced on one process, against fastai's documented behaviour."""

import collections

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

from cadence import DataLoaders, Learner


def data(n=40):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    return x, (x @ torch.randn(6, 3, generator=g)).argmax(1)


def learner(train, valid=None):
    torch.manual_seed(0)
    learn = Learner(DataLoaders(train, valid, device="cpu"), nn.Sequential(nn.Linear(6, 3)),
                    loss_func=nn.CrossEntropyLoss())
    learn.remove_cb(learn.progress)
    return learn


@pytest.mark.parametrize("make", [
    lambda ds: DataLoader(ds, batch_size=16, shuffle=True, drop_last=True),   # 40 items: 32 in two full batches
    lambda ds: DataLoader(ds, batch_size=None, sampler=BatchSampler(RandomSampler(ds), 16, drop_last=True)),
    lambda ds: DataLoader(ds, batch_sampler=BatchSampler(RandomSampler(ds), 16, drop_last=True)),
], ids=["shuffle drop_last", "batch sampler as sampler", "batch sampler"])
def test_get_preds_gives_every_item_once_in_dataset_order(make):
    x, y = data()
    dl = make(TensorDataset(x, y))
    learn = learner(dl)
    inps, preds, targs, decoded, losses = learn.get_preds(dl=dl, with_input=True, with_decoded=True, with_loss=True)
    with torch.no_grad():
        out = learn.model(x)
    assert torch.equal(inps, x) and torch.equal(targs, y)         # all 40, in the data set's order
    assert torch.allclose(preds, out) and torch.equal(decoded, out.argmax(1))
    assert torch.allclose(losses, nn.functional.cross_entropy(out, y, reduction="none"))
    assert torch.equal(learn.get_preds(ds_idx=0)[1], y)             # fastai's ds_idx: 0 is the train set


def test_validate_and_get_preds_take_ds_idx_or_a_loader_first():
    x, y = data()
    train = DataLoader(TensorDataset(x[:24], y[:24]), batch_size=8, shuffle=True)
    valid = DataLoader(TensorDataset(x[24:], y[24:]), batch_size=8)
    learn = learner(train, valid)
    assert torch.equal(learn.get_preds()[1], y[24:]) and torch.equal(learn.get_preds(0)[1], y[:24])
    assert torch.equal(learn.get_preds(valid)[1], y[24:])
    with torch.no_grad():
        want = nn.functional.cross_entropy(learn.model(x[:24]), y[:24]).item()
    res = learn.validate(0)
    assert res["valid_loss"] == pytest.approx(want, rel=1e-6) and res[0] == res["valid_loss"]   # fastai's position
    with pytest.raises(IndexError, match="this row has 1 values \\(valid_loss\\); got position 1"):
        res[1]
    with pytest.raises(ValueError, match="takes 0 \\(train\\) or 1 \\(valid\\), got 2"):
        learn.get_preds(2)


def test_loss_not_reduced_for_a_module_and_a_function():
    x, y = data()
    for loss_func in (nn.CrossEntropyLoss(), nn.functional.cross_entropy):
        learn = learner(DataLoader(TensorDataset(x, y), batch_size=8))
        learn.loss_func = loss_func
        with learn.loss_not_reduced():
            assert learn.loss_func(learn.model(x), y).shape == (40,)
        assert learn.loss_func(learn.model(x), y).shape == ()


def test_tta_averages_augmented_passes_and_lerps_with_the_plain_one():
    x, y = data()
    dl = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    learn = learner(dl)
    with torch.no_grad():
        plain, shifted = learn.model(x), learn.model(x + 1)
    preds, targs = learn.tta(dl=dl, n=3, batch_tfms=lambda t: t + 1)          # fastai's beta=0.25
    assert torch.equal(targs, y) and torch.allclose(preds, torch.lerp(shifted, plain, 0.25), atol=1e-6)
    (aug, p), _ = learn.tta(dl=dl, n=2, batch_tfms=lambda t: t + 1, beta=None)
    assert torch.allclose(aug, shifted, atol=1e-6) and torch.allclose(p, plain, atol=1e-6)
    best, _ = learn.tta(dl=dl, n=2, batch_tfms=lambda t: t + 1, use_max=True)
    assert torch.allclose(best, torch.maximum(shifted, plain), atol=1e-6)
    with pytest.raises(ValueError, match="batch_tfms"):
        learn.tta(dl=dl)


Out = collections.namedtuple("Out", "logits hidden")


class TwoOutputs(nn.Module):
    """Logits and the hidden features, as many models return (a namedtuple, as torchvision's Inception)."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(6, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = self.body(x)
        return Out(self.head(h), h)


class OwnLoss(nn.Module):
    """Keyword inputs in, a dict with its loss and logits out, as a Hugging Face model."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(6, 3)

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"logits": logits, "loss": None if labels is None else nn.functional.cross_entropy(logits, labels)}


def test_predict_and_get_preds_keep_a_tuple_output_and_take_keyword_inputs():
    x, y = data()
    torch.manual_seed(0)
    learn = Learner(DataLoaders(DataLoader(TensorDataset(x, y), batch_size=8),
                                DataLoader(TensorDataset(x, y), batch_size=8), device="cpu"),
                    TwoOutputs(), loss_func=lambda out, t: nn.functional.cross_entropy(out[0], t))
    logits, hidden = out = learn.predict(x[3])                          # one item: no batch dimension
    assert isinstance(out, Out)
    assert torch.equal(logits, learn.model(x[3:4])[0][0]) and torch.equal(hidden, learn.model(x[3:4])[1][0])
    (all_logits, all_hidden), targs = preds, _ = learn.get_preds()
    assert isinstance(preds, Out)
    assert torch.equal(all_logits, learn.model(x)[0].detach()) and all_hidden.shape == (40, 4) and torch.equal(targs, y)
    own = Learner(DataLoaders([], None, device="cpu"), OwnLoss(), loss_func=None)
    assert torch.equal(own.predict({"x": x[5]}), own.model.net(x[5:6])[0].detach())   # the logits, one item
