"""Metric failures keep their type and name the metric and what it got (a note); a metric passed uncalled is refused;
fastai's FBeta and R2Score. Expected metric values are what fastai 2.8.12 printed."""

import functools
import re

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from cadence import DataLoaders, Dice, F1Score, FBeta, Learner, R2Score, RocAuc, accuracy


def data(y, bs=32):
    torch.manual_seed(0)
    x = torch.randn(160, 5)
    return DataLoaders.from_dsets(TensorDataset(x[:128], y[:128]), TensorDataset(x[128:], y[128:]), bs=bs, device="cpu")


def classes():
    torch.manual_seed(0)
    return (torch.randn(160, 5)[:, 0] > 0).long()


def test_accuracy_on_one_hot_targets_names_the_metric_and_the_shapes():
    learn = Learner(data(nn.functional.one_hot(classes()).float()), nn.Linear(5, 2), loss_func=nn.BCEWithLogitsLoss(),
                    metrics=accuracy)
    with pytest.raises(RuntimeError) as e, learn.no_logging():   # the metric's own error, its type kept
        learn.fit(1, 1e-2)
    assert type(e.value) is RuntimeError and str(e.value) == (
        "The size of tensor a (32) must match the size of tensor b (2) at non-singleton dimension 1")
    assert e.value.__notes__ == [
        "(in metric 'accuracy', failed on a batch: with pred tensor of shape (32, 2) (torch.float32) and targets "
        "(tensor of shape (32, 2) (torch.float32)). Check that the metric fits the model's output and the targets. The "
        "targets have the predictions' shape (one-hot or multi-label): accuracy and error_rate take class indices "
        "(targets.argmax(-1)); multi-label targets take accuracy_multi.)",
        "(raised in callback Recorder during event after_batch)"]


def test_a_metric_failing_on_the_whole_set_names_what_it_kept():
    torch.manual_seed(0)
    learn = Learner(data(torch.randint(0, 3, (160,))), nn.Linear(5, 3), loss_func=nn.CrossEntropyLoss(),
                    metrics=F1Score())
    with pytest.raises(ValueError, match=re.escape("Target is multiclass but average='binary'.")) as e:
        learn.validate()
    assert e.value.__notes__[0] == (
        "(in metric 'f1_score', failed computing its value over the pass: with pred tensor of shape (32,) "
        "(torch.int64) and targets (tensor of shape (32,) (torch.int64)). Check that the metric fits the model's "
        "output and the targets.)")


@pytest.mark.parametrize("metric, message", [
    (F1Score, "metrics=F1Score passes the function that builds the metric, not a metric: call it, metrics=F1Score()"),
    (functools.partial(FBeta, beta=2), "metrics=FBeta passes the function that builds the metric, not a metric: call "
                                       "it, metrics=FBeta(beta=2)"),
    (RocAuc, "metrics=RocAuc passes the function that builds the metric, not a metric: call it, metrics=RocAuc()"),
    (Dice, "metrics=Dice passes the class, not a metric: call it, metrics=Dice()"),
])
def test_a_metric_passed_uncalled_is_refused_when_the_learner_is_built(metric, message):
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        Learner(data(classes()), nn.Linear(5, 2), loss_func=nn.CrossEntropyLoss(), metrics=metric)
    learn = Learner(data(classes()), nn.Linear(5, 2), loss_func=nn.CrossEntropyLoss())
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        learn.metrics = [accuracy, metric]


def test_a_plain_function_returning_a_metric_says_to_call_it():
    def make_f1(*args):
        return F1Score()

    learn = Learner(data(classes()), nn.Linear(5, 2), loss_func=nn.CrossEntropyLoss(), metrics=make_f1)
    with pytest.raises(TypeError, match=re.escape("metric make_f1 returned a metric (AccumMetric('f1_score')): it "
                                                  "builds one, pass it called, metrics=make_f1()")):
        learn.validate()


class _Fake:
    def __init__(self, pred, targ):
        self.pred, self.yb, self.training = pred, (targ,), False


def test_fbeta_and_r2score_give_fastais_values_and_names():
    pred, targ = torch.arange(24.).reshape(8, 3).sin(), torch.tensor([0, 1, 2, 2, 1, 0, 1, 2])
    rp, rt = torch.tensor([[1.], [2.], [3.5], [4.]]), torch.tensor([1.5, 2., 3., 5.])
    got = []
    for m, p, t in [(FBeta(2, average="macro"), pred, targ), (FBeta(0.5, average="micro"), pred, targ),
                    (R2Score(), rp, rt)]:
        m.reset()
        m.accumulate(_Fake(p, t))
        got.append((m.name, round(m.value, 6)))
    assert got == [("fbeta_score", 0.243056), ("fbeta_score", 0.25), ("r2_score", 0.791304)]   # fastai 2.8.12


def test_r2score_in_a_learner_is_its_column():
    torch.manual_seed(0)
    x = torch.randn(160, 5)
    learn = Learner(data(x[:, :1] * 2), nn.Linear(5, 1), loss_func=nn.MSELoss(), metrics=[R2Score(), FBeta(1)])
    assert learn.recorder.metric_names == ["epoch", "train_loss", "valid_loss", "r2_score", "fbeta_score", "time"]
