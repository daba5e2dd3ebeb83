"""Every metric of issue 13 against scikit-learn / scipy / a direct computation on the whole validation set.

Launched on 2 processes by tests/trainer/test_metrics_more.py (37 validation items: the last shard is
padded, and the metrics must count each item once); the same file runs the cases on one process
there too. Prints `CHECK <case> ok` on rank 0 per passed case.
"""

import functools
import math
import sys

import numpy as np
import scipy.stats
import sklearn.metrics as skm
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import (AccumMetric, BalancedAccuracy, DataLoaders, Dice, F1Score, Learner, MatthewsCorrCoef,
                     PearsonCorrCoef, Perplexity, Precision, Recall, RocAuc, RocAucBinary, RocAucMulti,
                     SpearmanCorrCoef, accuracy_multi, exp_rmspe, mae, mse, msle, rmse)
from cadence.distributed.env import rank, setup_distrib

N_VALID, BS, N_IN = 37, 8, 6


def inputs():
    """The same validation inputs and a generator for the targets' noise, on every rank."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(N_VALID, N_IN, generator=g), g


def multiclass():
    """3 classes: arg-max metrics with macro averaging, RocAuc (softmax), Perplexity, an AccumMetric."""
    x, g = inputs()
    y = (x @ torch.randn(N_IN, 3, generator=g) + torch.randn(N_VALID, 3, generator=g)).argmax(1)
    metrics = [F1Score(average="macro"), Precision(average="micro"), Recall(average="weighted"), MatthewsCorrCoef(),
               BalancedAccuracy(), RocAuc(), Perplexity(),
               AccumMetric(lambda p, t: (p == t).double().mean(), "agree", dim_argmax=-1, flatten=True)]

    def expected(out, y):
        cls, prob = out.argmax(1).numpy(), torch.softmax(out, 1).numpy()
        return {"f1_score": skm.f1_score(y, cls, average="macro"),
                "precision_score": skm.precision_score(y, cls, average="micro"),
                "recall_score": skm.recall_score(y, cls, average="weighted"),
                "matthews_corrcoef": skm.matthews_corrcoef(y, cls),
                "balanced_accuracy_score": skm.balanced_accuracy_score(y, cls),
                "roc_auc_score": skm.roc_auc_score(y, prob, multi_class="ovr"),
                "perplexity": math.exp(nn.functional.cross_entropy(out, y).item()),
                "agree": float((cls == y.numpy()).mean())}

    return x, y, nn.Linear(N_IN, 3), nn.CrossEntropyLoss(), metrics, expected


def binary():
    """2 logits per item: binary F1 / precision / recall, RocAucBinary, Dice."""
    x, g = inputs()
    y = (x[:, 0] + 0.5 * torch.randn(N_VALID, generator=g) > 0).long()
    metrics = [F1Score(), Precision(), Recall(), RocAucBinary(), Dice()]

    def expected(out, y):
        cls, pos = out.argmax(1).numpy(), torch.softmax(out, 1)[:, 1].numpy()
        y = y.numpy()
        return {"f1_score": skm.f1_score(y, cls), "precision_score": skm.precision_score(y, cls),
                "recall_score": skm.recall_score(y, cls), "roc_auc_score": skm.roc_auc_score(y, pos),
                "dice": 2 * (cls * y).sum() / (cls.sum() + y.sum())}

    return x, y, nn.Linear(N_IN, 2), nn.CrossEntropyLoss(), metrics, expected


def multilabel():
    """4 labels, sigmoid: accuracy_multi at a threshold, RocAucMulti, an AccumMetric with activation and thresh."""
    x, g = inputs()
    y = (x @ torch.randn(N_IN, 4, generator=g) > 0).float()
    f1_flat = AccumMetric(skm.f1_score, "f1_flat", activation="sigmoid", thresh=0.5, flatten=True, to_np=True,
                          invert_arg=True)
    metrics = [functools.partial(accuracy_multi, thresh=0.4), RocAucMulti(), f1_flat]

    def expected(out, y):
        prob = torch.sigmoid(out).numpy()
        return {"accuracy_multi": float(((prob > 0.4) == y.numpy().astype(bool)).mean()),
                "roc_auc_score": skm.roc_auc_score(y.numpy(), prob, average="macro"),
                "f1_flat": skm.f1_score(y.numpy().reshape(-1), (prob >= 0.5).reshape(-1))}

    return x, y, nn.Linear(N_IN, 4), nn.BCEWithLogitsLoss(), metrics, expected


def regression():
    """Positive outputs and targets: mse, rmse, mae, msle, exp_rmspe, Pearson (running sums) and Spearman."""
    x, g = inputs()
    y = (x[:, :1] * 0.7 + 0.3 * torch.randn(N_VALID, 1, generator=g)).abs()
    metrics = [mse, rmse, mae, msle, exp_rmspe, PearsonCorrCoef(), SpearmanCorrCoef()]

    def expected(out, y):
        p, t = out.numpy().reshape(-1).astype(np.float64), y.numpy().reshape(-1).astype(np.float64)
        return {"mse": skm.mean_squared_error(t, p), "rmse": math.sqrt(skm.mean_squared_error(t, p)),
                "mae": skm.mean_absolute_error(t, p), "msle": skm.mean_squared_log_error(t, p),
                "exp_rmspe": math.sqrt(np.mean(((np.exp(t) - np.exp(p)) / np.exp(t)) ** 2)),
                "pearsonr": scipy.stats.pearsonr(p, t)[0], "spearmanr": scipy.stats.spearmanr(p, t)[0]}

    return x, y, nn.Sequential(nn.Linear(N_IN, 1), nn.Softplus()), nn.MSELoss(), metrics, expected


CASES = {"multiclass": multiclass, "binary": binary, "multilabel": multilabel, "regression": regression}


def check(case: str, distributed: bool) -> None:
    """Validate with the case's metrics (under distrib_ctx if `distributed`) and compare with the reference."""
    x, y, model, loss_func, metrics, expected = CASES[case]()
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.normal_(p)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=BS), DataLoader(TensorDataset(x, y), batch_size=BS),
                      device="cpu")
    learn = Learner(dls, model, loss_func=loss_func, metrics=metrics)
    with learn.no_bar():
        if distributed:
            with learn.distrib_ctx():
                got = learn.validate()
        else:
            got = learn.validate()
    with torch.no_grad():
        want = expected(model(x), y)
    assert set(want) <= set(got.keys()), (sorted(want), got.keys())
    for name, value in want.items():
        assert math.isclose(got[name], value, rel_tol=1e-5, abs_tol=1e-7), (case, name, got[name], value)


def main():
    setup_distrib()
    for case in sys.argv[1:] or CASES:
        check(case, distributed=True)
        if rank() == 0:
            print(f"CHECK {case} ok", flush=True)


if __name__ == "__main__":
    main()
