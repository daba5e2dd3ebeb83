"""Metrics as accumulators: state added up batch by batch, a value computed once over the set.

Pass plain functions (`accuracy`, `rmse`, any `fn(preds, targs)`) or Metric objects to
`Learner(metrics=...)`. Built-in metrics keep running sums, so the value equals a direct
computation over the whole validation set; any other function sees all predictions and
targets at once (`AccumMetric`). Under distribution `sync` combines the state of every rank.

>>> learn = Learner(dls, model, loss_func=F.cross_entropy, metrics=[accuracy, top_k_accuracy, my_f1])
>>> accuracy(torch.tensor([[0.1, 0.9]]), torch.tensor([1]))
tensor(1.)
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Callable

import torch

Tensor = torch.Tensor
Reducer = Callable[[Tensor], Tensor]


class Metric:
    """Base class: `reset()` before a pass, `accumulate(learn)` per batch, `value` at the end."""

    name: str = "metric"

    def reset(self) -> None:
        raise NotImplementedError

    def accumulate(self, learn: Any) -> None:
        raise NotImplementedError

    @property
    def value(self) -> float | None:
        raise NotImplementedError

    def sync(self, all_sum: Reducer, all_gather: Reducer) -> None:
        """Combine this metric's state across processes (called once before `value`)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class SumMetric(Metric):
    """A metric computed from running sums: `totals(preds, targs)` per batch, `finish(sums)` at the end.

    >>> SumMetric("mae", lambda p, t: torch.stack([(p - t).abs().sum(), torch.tensor(t.numel())]),
    ...           lambda s: s[0] / s[1])
    """

    def __init__(self, name: str, totals: Callable[[Tensor, Tensor], Tensor], finish: Callable[[Tensor], Tensor]):
        self.name, self.totals, self.finish = name, totals, finish
        self.sums: Tensor | None = None

    def reset(self) -> None:
        self.sums = None

    def accumulate(self, learn: Any) -> None:
        batch_sums = self.totals(learn.pred.detach(), *learn.yb).double()
        self.sums = batch_sums if self.sums is None else self.sums + batch_sums

    @property
    def value(self) -> float | None:
        return None if self.sums is None else float(self.finish(self.sums))

    def sync(self, all_sum: Reducer, all_gather: Reducer) -> None:
        if self.sums is not None:
            self.sums = all_sum(self.sums)


class AccumMetric(Metric):
    """Any `func(preds, targs)`, computed once on all predictions and targets of the pass.

    >>> from sklearn.metrics import f1_score
    >>> AccumMetric(lambda p, t: f1_score(t, p.argmax(-1), average="macro"), name="f1")
    """

    def __init__(self, func: Callable[..., Any], name: str | None = None):
        if not callable(func):
            raise TypeError(f"a metric must be callable as func(preds, targs), got {func!r}")
        self.func, self.name = func, name or _func_name(func)
        self.preds: list[Tensor] = []
        self.targs: list[Tensor] = []

    def reset(self) -> None:
        self.preds, self.targs = [], []

    def accumulate(self, learn: Any) -> None:
        self.preds.append(learn.pred.detach())
        self.targs.append(learn.yb[0].detach())

    @property
    def value(self) -> float | None:
        if not self.preds:
            return None
        out = self.func(torch.cat(self.preds), torch.cat(self.targs))
        return out.item() if isinstance(out, Tensor) else float(out)

    def sync(self, all_sum: Reducer, all_gather: Reducer) -> None:
        if self.preds:
            self.preds, self.targs = [all_gather(torch.cat(self.preds))], [all_gather(torch.cat(self.targs))]


class AvgLoss(SumMetric):
    """The mean loss over all samples of a pass (each batch weighted by its size)."""

    def __init__(self, name: str = "loss"):
        super().__init__(name, None, lambda s: s[0] / s[1])

    def accumulate(self, learn: Any) -> None:
        bs, loss = batch_size(learn.yb or learn.xb), learn.loss
        sums = torch.stack([loss.double() * bs, loss.new_tensor(bs, dtype=torch.float64)])
        self.sums = sums if self.sums is None else self.sums + sums


class AvgSmoothLoss(Metric):
    """Exponential moving average of the loss, debiased (fastai's smooth loss)."""

    def __init__(self, beta: float = 0.98, name: str = "smooth_loss"):
        self.beta, self.name = beta, name
        self.reset()

    def reset(self) -> None:
        self.count, self.val = 0, 0.0

    def accumulate(self, learn: Any) -> None:
        self.count += 1
        self.val = self.beta * self.val + (1 - self.beta) * float(learn.loss)

    @property
    def value(self) -> float | None:
        return self.val / (1 - self.beta ** self.count) if self.count else None

    def sync(self, all_sum: Reducer, all_gather: Reducer) -> None:
        """Each rank keeps its own running view; the reported loss is averaged elsewhere."""


def batch_size(b: Any) -> int:
    """Number of samples in a batch: the length of its first tensor (in tuples, lists and dicts)."""
    while not isinstance(b, torch.Tensor):
        if isinstance(b, (list, tuple)):
            b = b[0]
        elif isinstance(b, Mapping):  # a dict batch: its first entry
            b = next(iter(b.values()))
        else:
            return len(b)
    return b.shape[0]  # Tensor.__len__ is a Python call


def _func_name(func: Callable) -> str:
    inner = func.func if isinstance(func, functools.partial) else func
    return getattr(inner, "__name__", type(inner).__name__)


def sum_metric(totals: Callable[..., Tensor], finish: Callable[[Tensor], Tensor]) -> Callable:
    """Decorator: mark `fn(preds, targs, **kw)` as computable from running sums for `Learner(metrics=...)`."""

    def mark(fn: Callable) -> Callable:
        fn.as_metric = lambda **kw: SumMetric(fn.__name__, functools.partial(totals, **kw), finish)
        return fn

    return mark


def _ratio(s: Tensor) -> Tensor:
    return s[0] / s[1]


def _with_count(total: Tensor, targ: Tensor) -> Tensor:
    return torch.stack([total.double(), torch.tensor(float(targ.numel()), dtype=torch.float64, device=targ.device)])


def _correct_count(pred: Tensor, targ: Tensor, axis: int = -1) -> Tensor:
    return _with_count((pred.argmax(dim=axis) == targ).sum(), targ)


def _topk_count(pred: Tensor, targ: Tensor, k: int = 5, axis: int = -1) -> Tensor:
    topk = pred.topk(k=min(k, pred.shape[axis]), dim=axis).indices
    return _with_count((topk == targ.unsqueeze(axis)).any(dim=axis).sum(), targ)


def _sq_err(pred: Tensor, targ: Tensor) -> Tensor:
    return _with_count((pred.reshape(targ.shape).double() - targ.double()).pow(2).sum(), targ)


@sum_metric(_correct_count, _ratio)
def accuracy(pred: Tensor, targ: Tensor, axis: int = -1) -> Tensor:
    """Fraction of samples whose arg-max prediction equals the target."""
    return _ratio(_correct_count(pred, targ, axis)).float()


@sum_metric(_correct_count, lambda s: 1 - s[0] / s[1])
def error_rate(pred: Tensor, targ: Tensor, axis: int = -1) -> Tensor:
    """1 - accuracy."""
    return 1 - _ratio(_correct_count(pred, targ, axis)).float()


@sum_metric(_topk_count, _ratio)
def top_k_accuracy(pred: Tensor, targ: Tensor, k: int = 5, axis: int = -1) -> Tensor:
    """Fraction of samples whose target is among the k highest predictions (`partial(top_k_accuracy, k=3)`)."""
    return _ratio(_topk_count(pred, targ, k, axis)).float()


@sum_metric(_sq_err, lambda s: torch.sqrt(s[0] / s[1]))
def rmse(pred: Tensor, targ: Tensor) -> Tensor:
    """Root mean squared error."""
    return torch.sqrt(_ratio(_sq_err(pred, targ))).float()


def as_metric(m: Any) -> Metric:
    """Turn what a user passed in `metrics=` into a fresh Metric; TypeError if it cannot be one."""
    if isinstance(m, Metric):
        return m
    if not callable(m):
        raise TypeError(f"metrics must be callables fn(preds, targs) or Metric objects; got {m!r} "
                        f"({type(m).__name__}). Pass e.g. metrics=[accuracy] or metrics=AccumMetric(my_fn).")
    inner, kwargs = (m.func, m.keywords) if isinstance(m, functools.partial) else (m, {})
    if hasattr(inner, "as_metric"):
        return inner.as_metric(**kwargs)
    return AccumMetric(m)
