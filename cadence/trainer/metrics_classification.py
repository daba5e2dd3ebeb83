"""Classification metrics (fastai's names): exact over the whole validation set, on one process or many.

`accuracy_multi` and `Dice` keep running sums. The others wrap scikit-learn's functions as
`AccumMetric`s, which gather every prediction before computing; scikit-learn must be installed,
and a missing one is reported when the metric is built, before any training.

>>> learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=[F1Score(average="macro"), RocAuc()])
>>> learn = Learner(dls, model, loss_func=nn.BCEWithLogitsLoss(), metrics=[partial(accuracy_multi, thresh=0.3)])
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .metrics import AccumMetric, SumMetric, _ratio, _with_count, makes_metric, sum_metric

Tensor = torch.Tensor


def _sklearn_metric(name: str, wrapper: str) -> Callable:
    """`sklearn.metrics.<name>`, or ModuleNotFoundError naming the metric and the pip line."""
    try:
        import sklearn.metrics as skm
    except ImportError as e:
        raise ModuleNotFoundError(f"{wrapper} wraps scikit-learn's {name}, and scikit-learn is not installed: "
                                  f"pip install scikit-learn") from e
    return getattr(skm, name)


def skm_to_cadence(func: Callable, is_class: bool = True, thresh: float | None = None, axis: int = -1,
                   activation: str | None = None, **kwargs: Any) -> AccumMetric:
    """Any scikit-learn metric `func(y_true, y_pred, **kwargs)` as a metric (fastai's `skm_to_fastai`).

    Classification (`is_class`): predictions are the arg-max over `axis`, or with `thresh` the
    sigmoid of the output compared with `thresh`. Otherwise the raw outputs, flattened.

    >>> from sklearn.metrics import cohen_kappa_score
    >>> learn.metrics = [skm_to_cadence(cohen_kappa_score, weights="quadratic")]
    """
    if activation is None:
        activation = "sigmoid" if is_class and thresh is not None else "no"
    return AccumMetric(func, dim_argmax=axis if is_class and thresh is None else None, activation=activation,
                       thresh=thresh, flatten=True, to_np=True, invert_arg=True, **kwargs)


def _sklearn(name: str, wrapper: str, **kwargs: Any) -> AccumMetric:
    return skm_to_cadence(_sklearn_metric(name, wrapper), **kwargs)


@makes_metric
def F1Score(axis: int = -1, labels: Any = None, pos_label: Any = 1, average: str = "binary",
            sample_weight: Any = None) -> AccumMetric:
    """scikit-learn's `f1_score` of the arg-max predictions. `F1Score(average="macro")` for several classes.

    >>> learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=F1Score(average="macro"))
    """
    return _sklearn("f1_score", "F1Score", axis=axis, labels=labels, pos_label=pos_label, average=average,
                    sample_weight=sample_weight)


@makes_metric
def FBeta(beta: float, axis: int = -1, labels: Any = None, pos_label: Any = 1, average: str = "binary",
          sample_weight: Any = None) -> AccumMetric:
    """scikit-learn's `fbeta_score` of the arg-max predictions (fastai's `FBeta`): `beta` > 1 weighs recall more.

    >>> learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=FBeta(beta=2, average="macro"))
    """
    return _sklearn("fbeta_score", "FBeta", axis=axis, beta=beta, labels=labels, pos_label=pos_label,
                    average=average, sample_weight=sample_weight)


@makes_metric
def Precision(axis: int = -1, labels: Any = None, pos_label: Any = 1, average: str = "binary",
              sample_weight: Any = None) -> AccumMetric:
    """scikit-learn's `precision_score` of the arg-max predictions.

    >>> learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=Precision())
    """
    return _sklearn("precision_score", "Precision", axis=axis, labels=labels, pos_label=pos_label, average=average,
                    sample_weight=sample_weight)


@makes_metric
def Recall(axis: int = -1, labels: Any = None, pos_label: Any = 1, average: str = "binary",
           sample_weight: Any = None) -> AccumMetric:
    """scikit-learn's `recall_score` of the arg-max predictions.

    >>> learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=Recall())
    """
    return _sklearn("recall_score", "Recall", axis=axis, labels=labels, pos_label=pos_label, average=average,
                    sample_weight=sample_weight)


@makes_metric
def MatthewsCorrCoef(axis: int = -1, sample_weight: Any = None, **kwargs: Any) -> AccumMetric:
    """scikit-learn's `matthews_corrcoef` of the arg-max predictions.

    >>> learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=MatthewsCorrCoef())
    """
    return _sklearn("matthews_corrcoef", "MatthewsCorrCoef", axis=axis, sample_weight=sample_weight, **kwargs)


@makes_metric
def BalancedAccuracy(axis: int = -1, sample_weight: Any = None, adjusted: bool = False) -> AccumMetric:
    """scikit-learn's `balanced_accuracy_score` (mean recall over classes) of the arg-max predictions.

    >>> learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=BalancedAccuracy())
    """
    return _sklearn("balanced_accuracy_score", "BalancedAccuracy", axis=axis, sample_weight=sample_weight,
                    adjusted=adjusted)


@makes_metric
def RocAuc(axis: int = -1, average: str = "macro", sample_weight: Any = None, max_fpr: float | None = None,
           multi_class: str = "ovr") -> AccumMetric:
    """Area under the ROC curve for single-label classification with several classes (softmax of the output).

    >>> Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=RocAuc())
    """
    return AccumMetric(_sklearn_metric("roc_auc_score", "RocAuc"), dim_argmax=axis, activation="softmax",
                       to_np=True, invert_arg=True, average=average, sample_weight=sample_weight, max_fpr=max_fpr,
                       multi_class=multi_class)


@makes_metric
def RocAucBinary(axis: int = -1, average: str = "macro", sample_weight: Any = None, max_fpr: float | None = None,
                 multi_class: str = "raise") -> AccumMetric:
    """Area under the ROC curve for two classes: the model outputs two logits per item (the positive one last).

    >>> learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=RocAucBinary())
    """
    return AccumMetric(_sklearn_metric("roc_auc_score", "RocAucBinary"), dim_argmax=axis, activation="binarysoftmax",
                       flatten=True, to_np=True, invert_arg=True, average=average, sample_weight=sample_weight,
                       max_fpr=max_fpr, multi_class=multi_class)


@makes_metric
def RocAucMulti(average: str = "macro", sample_weight: Any = None, max_fpr: float | None = None) -> AccumMetric:
    """Area under the ROC curve for multi-label targets (one logit per label, sigmoid).

    >>> learn = Learner(dls, model, loss_func=nn.BCEWithLogitsLoss(), metrics=RocAucMulti())
    """
    return AccumMetric(_sklearn_metric("roc_auc_score", "RocAucMulti"), activation="sigmoid", to_np=True,
                       invert_arg=True, average=average, sample_weight=sample_weight, max_fpr=max_fpr)


def _multi_correct(pred: Tensor, targ: Tensor, thresh: float = 0.5, sigmoid: bool = True) -> Tensor:
    if sigmoid:
        pred = pred.sigmoid()
    return _with_count(((pred > thresh) == targ.bool()).sum(), targ)


@sum_metric(_multi_correct, _ratio)
def accuracy_multi(pred: Tensor, targ: Tensor, thresh: float = 0.5, sigmoid: bool = True) -> Tensor:
    """Multi-label accuracy: the fraction of (item, label) decisions `sigmoid(pred) > thresh` that match `targ`.

    >>> Learner(..., loss_func=nn.BCEWithLogitsLoss(), metrics=partial(accuracy_multi, thresh=0.3))
    """
    return _ratio(_multi_correct(pred, targ, thresh, sigmoid)).float()


class Dice(SumMetric):
    """Dice coefficient of binary segmentation: 2 |pred ∩ targ| / (|pred| + |targ|), pred the arg-max over `axis`.

    >>> Learner(dls, unet, loss_func=nn.CrossEntropyLoss(), metrics=Dice())
    """

    def __init__(self, axis: int = 1):
        super().__init__("dice", self._totals, _dice)
        self.axis = axis

    def _totals(self, pred: Tensor, targ: Tensor) -> Tensor:
        pred = pred.argmax(dim=self.axis).reshape(-1).double()
        targ = targ.reshape(-1).double()
        return torch.stack([(pred * targ).sum(), (pred + targ).sum()])


def _dice(s: Tensor) -> Tensor:
    return 2 * s[0] / s[1]
