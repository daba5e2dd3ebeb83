"""Regression and language-model metrics (fastai's names), exact over the whole validation set on any number of processes.

`mse`, `rmse`, `mae`, `msle`, `exp_rmspe`, `PearsonCorrCoef` and `Perplexity` keep running sums (float64);
`SpearmanCorrCoef` needs every prediction (it ranks them), gathers them, and wraps scipy.

>>> learn = Learner(dls, model, loss_func=nn.MSELoss(), metrics=[mse, mae, PearsonCorrCoef()])
>>> learn = Learner(dls, lm, loss_func=nn.CrossEntropyLoss(), metrics=Perplexity())
"""

from __future__ import annotations

from typing import Any

import torch

from .metrics import AccumMetric, AvgLoss, SumMetric, _ratio, _with_count, makes_metric, sum_metric

Tensor = torch.Tensor


def _flat(pred: Tensor, targ: Tensor) -> tuple[Tensor, Tensor]:
    pred, targ = pred.reshape(-1).double(), targ.reshape(-1).double()
    if len(pred) != len(targ):
        raise ValueError(f"{len(pred)} predictions but {len(targ)} targets: a regression metric compares them "
                         f"item by item (flattened)")
    return pred, targ


def _sq_err(pred: Tensor, targ: Tensor) -> Tensor:
    pred, targ = _flat(pred, targ)
    return _with_count((pred - targ).pow(2).sum(), targ)


def _abs_err(pred: Tensor, targ: Tensor) -> Tensor:
    pred, targ = _flat(pred, targ)
    return _with_count((pred - targ).abs().sum(), targ)


def _sq_log_err(pred: Tensor, targ: Tensor) -> Tensor:
    pred, targ = _flat(pred, targ)
    return _with_count((torch.log1p(pred) - torch.log1p(targ)).pow(2).sum(), targ)


def _sq_pct_err(pred: Tensor, targ: Tensor) -> Tensor:
    pred, targ = (t.exp() for t in _flat(pred, targ))
    return _with_count(((targ - pred) / targ).pow(2).sum(), targ)


def _sqrt_ratio(s: Tensor) -> Tensor:
    return torch.sqrt(s[0] / s[1])


@sum_metric(_sq_err, _ratio)
def mse(pred: Tensor, targ: Tensor) -> Tensor:
    """Mean squared error.

    >>> mse(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]))
    tensor(2.)
    """
    return _ratio(_sq_err(pred, targ)).float()


@sum_metric(_sq_err, _sqrt_ratio)
def rmse(pred: Tensor, targ: Tensor) -> Tensor:
    """Root mean squared error (column `rmse`; a row reads fastai's name `_rmse` as the same column).

    >>> rmse(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]))
    tensor(1.4142)
    """
    return torch.sqrt(_ratio(_sq_err(pred, targ))).float()


@sum_metric(_abs_err, _ratio)
def mae(pred: Tensor, targ: Tensor) -> Tensor:
    """Mean absolute error.

    >>> mae(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]))
    tensor(1.)
    """
    return _ratio(_abs_err(pred, targ)).float()


@sum_metric(_sq_log_err, _ratio)
def msle(pred: Tensor, targ: Tensor) -> Tensor:
    """Mean squared logarithmic error: the mean of (log(1 + pred) - log(1 + targ))².

    >>> msle(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]))
    tensor(0.1305)
    """
    return _ratio(_sq_log_err(pred, targ)).float()


@sum_metric(_sq_pct_err, _sqrt_ratio)
def exp_rmspe(pred: Tensor, targ: Tensor) -> Tensor:
    """Root mean squared percentage error of exp(pred) against exp(targ) (targets trained in log space).

    Its column is `exp_rmspe`; a row reads fastai's name `_exp_rmspe` as the same column.

    >>> exp_rmspe(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.1]))
    tensor(0.0673)
    """
    return torch.sqrt(_ratio(_sq_pct_err(pred, targ))).float()


def _pearson_sums(pred: Tensor, targ: Tensor) -> Tensor:
    x, y = _flat(pred, targ)
    return torch.stack([x.new_tensor(float(len(x))), x.sum(), y.sum(), (x * x).sum(), (y * y).sum(), (x * y).sum()])


def _pearson(s: Tensor) -> Tensor:
    n, sx, sy, sxx, syy, sxy = s
    return (n * sxy - sx * sy) / torch.sqrt((n * sxx - sx * sx) * (n * syy - sy * sy))


class PearsonCorrCoef(SumMetric):
    """Pearson's correlation between predictions and targets (flattened), from running sums.

    >>> Learner(dls, model, loss_func=nn.MSELoss(), metrics=PearsonCorrCoef())
    """

    def __init__(self):
        super().__init__("pearsonr", _pearson_sums, _pearson)


@makes_metric
def SpearmanCorrCoef(**kwargs) -> AccumMetric:
    """Spearman's rank correlation (scipy's `spearmanr`) over every prediction of the set.

    >>> learn = Learner(dls, model, loss_func=nn.MSELoss(), metrics=SpearmanCorrCoef())
    """
    try:
        import scipy.stats  # noqa: F401  (checked now, before any training)
    except ImportError as e:
        raise ModuleNotFoundError("SpearmanCorrCoef wraps scipy's spearmanr, and scipy is not installed: "
                                  "pip install scipy") from e

    return AccumMetric(_spearman, "spearmanr", flatten=True, to_np=True, **kwargs)


@makes_metric
def R2Score(sample_weight: Any = None) -> AccumMetric:
    """scikit-learn's `r2_score` (coefficient of determination) over every prediction of the set, flattened.

    fastai's `R2Score`; its column is `r2_score`.

    >>> learn = Learner(dls, model, loss_func=nn.MSELoss(), metrics=R2Score())
    """
    from .metrics_classification import _sklearn

    return _sklearn("r2_score", "R2Score", is_class=False, sample_weight=sample_weight)


def _spearman(pred, targ, **kwargs) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(pred, targ, **kwargs)[0])


def _exp_ratio(s: Tensor) -> Tensor:
    return torch.exp(s[0] / s[1])


class Perplexity(AvgLoss):
    """exp of the mean validation loss (for a cross-entropy language model).

    >>> Learner(dls, lm, loss_func=nn.CrossEntropyLoss(), metrics=Perplexity())
    """

    def __init__(self):
        super().__init__("perplexity")
        self.finish = _exp_ratio
