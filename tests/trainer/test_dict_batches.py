"""Dict batches (Hugging Face style) in the Learner: a model computing its own loss, or loss_func over named targets."""

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from cadence import DataLoaders, Learner, accuracy
from helpers import REPO

sys.path.insert(0, str(REPO / "examples"))
from accelerate_nlp import TinyClassifier, token_data  # noqa: E402  the example's Hugging Face-style model


def _dls(**kw):
    return DataLoaders(DataLoader(token_data(256), batch_size=32, shuffle=True),
                       DataLoader(token_data(70, seed=1), batch_size=32), device="cpu", **kw)


def test_model_computing_its_own_loss_trains_and_is_evaluated_on_its_logits():
    torch.manual_seed(0)
    learn = Learner(_dls(), TinyClassifier(), loss_func=None, metrics=accuracy, lr=3e-2)
    learn.fit(6)
    first, last = learn.recorder.values[0], learn.recorder.values[-1]
    assert last["train_loss"] < first["train_loss"] and last["accuracy"] > 0.8
    # the recorded valid loss is the model's own loss over the whole validation set
    model, total = learn.model.eval(), 0.0
    with torch.no_grad():
        for b in DataLoader(token_data(70, seed=1), batch_size=70):
            total = model(**b).loss.item()
            expected_acc = (model(**b).logits.argmax(1) == b["labels"]).float().mean().item()
    assert last["valid_loss"] == pytest.approx(total, rel=1e-5) and last["accuracy"] == pytest.approx(expected_acc)
    preds, targs = learn.get_preds()
    assert preds.shape == (70, 2) and torch.equal(targs, torch.stack([d["labels"] for d in token_data(70, seed=1)]))
    with pytest.raises(ValueError, match=r"with_loss=True\): the model computes its own loss.*no loss per item"):
        learn.get_preds(with_loss=True)


def test_loss_func_over_named_targets():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = TinyClassifier()

        def forward(self, input_ids, attention_mask):
            return self.inner(input_ids, attention_mask).logits

    torch.manual_seed(0)
    learn = Learner(_dls(target_keys="labels"), Net(), loss_func=F.cross_entropy, metrics=accuracy, lr=3e-2)
    learn.fit(6)
    assert learn.recorder.values[-1]["accuracy"] > 0.8
    inps, preds, targs = learn.get_preds(with_input=True)
    assert set(inps) == {"input_ids", "attention_mask"} and inps["input_ids"].shape == (70, 12) and len(targs) == 70


def test_bad_dict_batches_say_what_to_change():
    learn = Learner(_dls(target_keys=["label"]), TinyClassifier(), loss_func=F.cross_entropy)
    with pytest.raises(ValueError, match=r"none of the target keys \['label'\].*labels"):
        learn.fit(1)
    class LogitsOnly(TinyClassifier):
        def forward(self, input_ids, attention_mask, labels=None):
            return {"logits": super().forward(input_ids, attention_mask).logits}

    learn = Learner(_dls(), LogitsOnly(), loss_func=None)
    with pytest.raises(ValueError, match="no `loss`"):
        learn.fit(1)
    with pytest.raises(ValueError, match="target_keys"):
        _dls(target_keys=[])


@pytest.mark.slow
def test_dict_batches_under_distrib_ctx_count_every_validation_item_once():
    from helpers import run_launch

    proc = run_launch("dict_batches_ddp.py", nproc=2, timeout=300)
    assert proc.stdout.count("DICT OK") == 1, proc.stdout
