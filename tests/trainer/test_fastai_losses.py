"""fastai's flattened losses, `dls.test_dl` and fastai's `_rmse` / `_exp_rmspe` names. Expected values are what fastai
2.8.12 printed for the same tensors."""

import pickle

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import cadence
from cadence import (BCEWithLogitsLossFlat, CrossEntropyLossFlat, DataLoaders, EpochRecord, LabelSmoothingCrossEntropy,
                     LabelSmoothingCrossEntropyFlat, Learner, MSELossFlat, exp_rmspe, load_learner, rmse)

X3 = torch.arange(30.).reshape(2, 5, 3).sin()
T3 = torch.tensor([[0, 1, 2, 0, 1], [2, 2, 1, 0, 0]])
XB = torch.arange(12.).reshape(4, 3).cos()
TB = torch.tensor([[1, 0, 1], [0, 0, 1], [1, 1, 0], [0, 1, 0]])


def r(t):
    return round(float(t), 4)


def test_the_flat_losses_give_fastais_values():
    assert [r(CrossEntropyLossFlat()(X3, T3)), r(CrossEntropyLossFlat(axis=1)(X3.transpose(1, 2), T3)),
            r(BCEWithLogitsLossFlat()(XB, TB)), r(MSELossFlat()(torch.tensor([[1.], [2.], [4.]]), torch.tensor([1, 3, 2]))),
            r(LabelSmoothingCrossEntropy()(XB, torch.tensor([0, 1, 2, 1]))), r(LabelSmoothingCrossEntropyFlat()(X3, T3)),
            r(BCEWithLogitsLossFlat(pos_weight=torch.tensor([1., 2., 3.]))(XB, TB))] == \
        [1.2112, 1.2112, 0.5913, 1.6667, 1.3365, 1.2175, 0.9706]
    assert BCEWithLogitsLossFlat(thresh=0.2).decodes(XB).int().tolist() == [[1, 1, 0], [0, 0, 1], [1, 1, 0], [0, 0, 0]]
    assert CrossEntropyLossFlat().decodes(X3).tolist() == [[2, 0, 2, 0, 2], [0, 2, 0, 2, 0]]
    per_item = CrossEntropyLossFlat()
    per_item.reduction = "none"
    assert [round(v, 4) for v in per_item(X3, T3).tolist()] == \
        [1.7583, 1.452, 0.6923, 0.4874, 1.1484, 2.076, 0.5042, 1.325, 2.1364, 0.5317]
    assert repr(CrossEntropyLossFlat()) == "FlattenedLoss of CrossEntropyLoss()"
    with pytest.raises(ValueError, match="`flatten` must be False when using `pos_weight`"):
        BCEWithLogitsLossFlat(pos_weight=torch.ones(3), flatten=True)


@pytest.fixture
def dls():
    torch.manual_seed(0)
    x = torch.randn(40, 3)
    y = (x[:, 0] > 0).long()
    return DataLoaders.from_dsets(TensorDataset(x[:32], y[:32]), TensorDataset(x[32:], y[32:]), bs=8, device="cpu")


def test_get_preds_uses_the_losss_activation_and_decodes(dls, tmp_path):
    torch.manual_seed(0)
    learn = Learner(dls, nn.Linear(3, 2), loss_func=CrossEntropyLossFlat(), path=tmp_path)
    with learn.no_logging(), learn.no_bar():
        learn.fit(1, 1e-2)
    probs, targs, decoded, losses = learn.get_preds(with_decoded=True, with_loss=True)
    x = dls.valid_ds.tensors[0]
    with torch.no_grad():
        logits = learn.model(x)
    assert torch.allclose(probs, logits.softmax(-1)) and torch.equal(decoded, logits.argmax(-1))
    assert torch.allclose(losses, nn.functional.cross_entropy(logits, targs, reduction="none"))
    assert learn.loss_func.reduction == "mean"                  # set back after the per-item losses
    loaded = load_learner(learn.export(), trust_pickle=True)    # the loss pickles with the export
    assert isinstance(loaded.loss_func, CrossEntropyLossFlat) and pickle.loads(pickle.dumps(loaded.loss_func)).axis == -1


def test_test_dl_reads_new_items_with_the_valid_loaders_settings(dls):
    learn = Learner(dls, nn.Linear(3, 2), loss_func=BCEWithLogitsLossFlat())
    new = torch.randn(10, 3)
    tdl = dls.test_dl(new)
    assert (tdl.bs, len(tdl), tdl.shuffle, tdl.n) == (8, 2, False, 10)
    assert torch.equal(torch.cat(list(tdl)), new)                # inputs alone, in order, the last batch whole
    preds, targs = learn.get_preds(dl=tdl)
    with torch.no_grad():
        assert targs is None and torch.allclose(preds, learn.model(new).sigmoid())   # BCEWithLogitsLossFlat's activation
    without = [b for b in dls.test_dl(dls.valid_ds)]             # the validation set without its targets
    assert [b.shape for b in without] == [torch.Size([8, 3])] and torch.equal(without[0], dls.valid_ds.tensors[0])
    xb, yb = next(iter(dls.test_dl(dls.valid_ds, with_labels=True, bs=3)))
    assert xb.shape == (3, 3) and torch.equal(yb, dls.valid_ds.tensors[1][:3])
    assert len(dls.test_dl([torch.zeros(3)] * 5)) == 1
    with pytest.raises(ValueError, match=r"dls.test_dl: the validation loader, a list, has no batch size; pass one"):
        DataLoaders([(new, None)], [(new, None)]).test_dl(new)


def test_fastais_rmse_column_names_read_cadences_columns(dls):
    learn = Learner(dls, nn.Linear(3, 1), loss_func=MSELossFlat(), metrics=[rmse, exp_rmspe])
    assert learn.recorder.metric_names == ["epoch", "train_loss", "valid_loss", "rmse", "exp_rmspe", "time"]
    assert [learn.recorder.column(n) for n in ("_rmse", "_exp_rmspe", "rmse", "valid_loss", "_mae")] == \
        ["rmse", "exp_rmspe", "rmse", "valid_loss", None]
    with learn.no_logging(), learn.no_bar():
        learn.fit(1, 1e-2)
    row = learn.recorder.values[-1]
    assert row["_rmse"] == row["rmse"] == row.get("_rmse") and "_exp_rmspe" in row and row["_exp_rmspe"] == row[3]
    record = EpochRecord({"epoch": 0, "train_loss": 1.0, "train_rmse": 0.5, "valid_loss": 2.0, "valid_rmse": 0.7})
    assert (record["train__rmse"], record["valid__rmse"], record.get("_rmse")) == (0.5, 0.7, None)


def test_savemodelcallback_monitors_fastais_rmse_name(dls, tmp_path):
    learn = Learner(dls, nn.Linear(3, 1), loss_func=MSELossFlat(), metrics=rmse, path=tmp_path)
    with learn.no_logging(), learn.no_bar():
        learn.fit(2, 1e-2, cbs=[cadence.SaveModelCallback(monitor="_rmse", comp=np.less)])
    assert (tmp_path / "models" / "model" / "model.safetensors").is_file()
