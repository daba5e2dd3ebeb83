"""Metrics as accumulators: state added up batch by batch, a value computed once over the set.

Pass plain functions (`accuracy`, `rmse`, any `fn(preds, targs)`) or Metric objects to
`Learner(metrics=...)`. Built-in metrics keep running sums, so the value equals a direct
computation over the whole validation set; any other function sees all predictions and
targets at once (`AccumMetric`). Under distribution `sync` combines the state of every rank.
More metrics: metrics_classification.py (F1Score, RocAuc, ...) and metrics_regression.py (mse, ...).

>>> learn = Learner(dls, model, loss_func=F.cross_entropy, metrics=[accuracy, top_k_accuracy, my_f1])
>>> accuracy(torch.tensor([[0.1, 0.9]]), torch.tensor([1]))
tensor(1.)
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Callable

import torch

from .callback import class2attr
from .events import CancelException
from .model_output import describe

Tensor = torch.Tensor
Reducer = Callable[[Tensor], Tensor]


class Metric:
    """Base class (fastai's): `reset()` before a pass, `accumulate(learn)` per batch, `value` at the end.

    `name` (the column) is the class's name, snake-cased, without a trailing "Metric" (fastai's). On several
    processes the Recorder also calls `sync` (see there); on one process a metric needs no more than this:

    >>> class Count(Metric):
    ...     def reset(self): self.n = 0
    ...     def accumulate(self, learn): self.n += len(learn.yb[0])
    ...     @property
    ...     def value(self): return self.n
    >>> learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=Count())   # column "count"
    """

    @property
    def name(self) -> str:
        own = self.__dict__   # "name": a metric pickled (exported) before `name` became this property
        return own.get("_name") or own.get("name") or class2attr(self, "Metric")

    @name.setter
    def name(self, value: str) -> None:
        self._name = value

    def reset(self) -> None:
        raise NotImplementedError

    def accumulate(self, learn: Any) -> None:
        raise NotImplementedError

    @property
    def value(self) -> float | None:
        raise NotImplementedError

    def sync(self, all_sum: Reducer, all_gather: Reducer) -> None:
        """Make this process's state that of every process (`all_sum(t)`: `t` summed over them, `all_gather(t)`:
        concatenated); called before `value`, on several processes only. The base class cannot know how."""
        raise unsyncable(self)

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


class AvgMetric(SumMetric):
    """fastai's AvgMetric: `func(preds, *targs)` on each batch, averaged over the pass, weighted by batch size.

    What a plain function passed in `metrics=` becomes, as in fastai (cheap: nothing is kept but two sums). For a
    metric that must see the whole set at once (F1, AUC), use `AccumMetric`.

    >>> learn = Learner(dls, model, loss_func=nn.MSELoss(), metrics=AvgMetric(lambda p, t: (p - t).abs().max()))
    """

    def __init__(self, func: Callable[..., Any]):
        if not callable(func):
            raise TypeError(f"AvgMetric takes a function func(preds, targs), got {func!r}")
        super().__init__(_func_name(func), None, _ratio)
        self.func = func

    def accumulate(self, learn: Any) -> None:
        bs, pred = batch_size(learn.yb or learn.xb), learn.pred.detach()
        if bs == 0:  # a process's batch of padding alone: nothing to average (a mean over it would be NaN)
            value = 0.0
        else:
            value = self.func(pred, *learn.yb)
        if isinstance(value, Tensor) and value.numel() != 1:
            raise _about_metric(TypeError(
                f"metric {self.name} returned a tensor of shape {tuple(value.shape)}; a plain function in metrics= "
                f"must return one number per batch (fastai's AvgMetric): wrap it as AccumMetric({self.name}) to "
                f"compute it over the whole set"))
        if isinstance(value, Metric):
            raise _about_metric(TypeError(f"metric {self.name} returned a metric ({value!r}): it builds one, pass it "
                                          f"called, metrics={self.name}()"))
        value = value.detach().double().reshape(()).to(pred.device) if isinstance(value, Tensor) else torch.tensor(
            float(value), dtype=torch.float64, device=pred.device)
        sums = torch.stack([value * bs, value.new_tensor(float(bs))])
        self.sums = sums if self.sums is None else self.sums + sums


_ACTIVATIONS = (None, "no", "sigmoid", "softmax", "binarysoftmax")


class AccumMetric(Metric):
    """Any `func(preds, targs)`, computed once on all predictions and targets of the pass.

    Under distribution every rank's predictions are gathered first, so the value is exactly the
    one over the whole set. fastai's options shape what is kept per batch:

    - `activation`: "sigmoid", "softmax" (over `dim_argmax`, default -1) or "binarysoftmax"
      (softmax, then the last column: the positive class's probability); None/"no" keeps `pred`.
    - `dim_argmax`: without an activation, keep `pred.argmax(dim_argmax)` (the predicted class).
    - `thresh`: then keep `pred >= thresh` (multi-label decisions).
    - `flatten`: flatten predictions and targets to 1-d (False by default: the function sees the model's output
      as it is).
    - `to_np`: pass numpy arrays; `invert_arg`: call `func(targs, preds)` (scikit-learn's order).
    Other keyword arguments go to `func`.

    >>> from sklearn.metrics import f1_score
    >>> AccumMetric(f1_score, dim_argmax=-1, flatten=True, to_np=True, invert_arg=True, average="macro")
    >>> AccumMetric(lambda p, t: (p == t).float().mean(), name="acc", dim_argmax=-1)
    """

    def __init__(self, func: Callable[..., Any], name: str | None = None, *, dim_argmax: int | None = None,
                 activation: str | None = None, thresh: float | None = None, flatten: bool = False,
                 to_np: bool = False, invert_arg: bool = False, **kwargs: Any):
        if not callable(func):
            raise TypeError(f"a metric must be callable as func(preds, targs), got {func!r}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"AccumMetric's second argument is the metric's name, got {name!r}; "
                            f"pass dim_argmax=, activation=, thresh= by keyword")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {_ACTIVATIONS[1:]} or None, got {activation!r}")
        self.func, self.name = func, name or _func_name(func)
        self.dim_argmax, self.activation, self.thresh, self.flatten = dim_argmax, activation, thresh, flatten
        self.to_np, self.invert_arg, self.kwargs = to_np, invert_arg, kwargs
        self.preds: list[Tensor] = []
        self.targs: list[Tensor] = []

    def reset(self) -> None:
        self.preds, self.targs = [], []

    def transform(self, pred: Tensor, targ: Tensor) -> tuple[Tensor, Tensor]:
        """What is kept of one batch: the prediction after activation / argmax / threshold, maybe flattened."""
        dim = -1 if self.dim_argmax is None else self.dim_argmax
        if self.activation in ("softmax", "binarysoftmax"):
            pred = torch.softmax(pred.float(), dim=dim)
            if self.activation == "binarysoftmax":
                pred = pred[:, -1]
        elif self.activation == "sigmoid":
            pred = torch.sigmoid(pred.float())
        elif self.dim_argmax is not None:
            pred = pred.argmax(dim=self.dim_argmax)
        if self.thresh is not None:
            pred = pred >= self.thresh
        if self.flatten:
            pred, targ = pred.reshape(-1), targ.reshape(-1)
            if len(pred) != len(targ):
                raise _about_metric(ValueError(f"metric {self.name}: {len(pred)} predictions but {len(targ)} targets "
                                               f"after flattening; check dim_argmax / activation against the model's "
                                               f"output"))
        return pred, targ

    def accumulate(self, learn: Any) -> None:
        pred, targ = self.transform(learn.pred.detach(), learn.yb[0].detach())
        self.preds.append(pred)
        self.targs.append(targ)

    @property
    def value(self) -> float | None:
        if not self.preds:
            return None
        preds, targs = torch.cat(self.preds), torch.cat(self.targs)
        if self.to_np:
            preds, targs = preds.cpu().numpy(), targs.cpu().numpy()
        out = self.func(targs, preds, **self.kwargs) if self.invert_arg else self.func(preds, targs, **self.kwargs)
        return out.item() if isinstance(out, Tensor) else float(out)

    def sync(self, all_sum: Reducer, all_gather: Reducer) -> None:
        if self.preds:
            self.preds, self.targs = [_gather(all_gather, self.preds)], [_gather(all_gather, self.targs)]


def _gather(all_gather: Reducer, chunks: list[Tensor]) -> Tensor:
    """Every rank's chunks, concatenated in rank order (booleans travel as bytes: not every backend sends bool)."""
    t = torch.cat(chunks)
    return all_gather(t.to(torch.uint8)).bool() if t.dtype == torch.bool else all_gather(t)


class AvgLoss(SumMetric):
    """The mean loss over all samples of a pass (each batch weighted by its size).

    >>> AvgLoss().name   # the Recorder's valid_loss
    'loss'
    """

    def __init__(self, name: str = "loss"):
        super().__init__(name, None, _ratio)

    def accumulate(self, learn: Any) -> None:
        bs, loss = batch_size(learn.yb or learn.xb), learn.loss
        sums = torch.stack([loss.double() * bs, loss.new_tensor(bs, dtype=torch.float64)])
        self.sums = sums if self.sums is None else self.sums + sums


class AvgSmoothLoss(Metric):
    """Exponential moving average of the loss, debiased (fastai's smooth loss).

    >>> AvgSmoothLoss(beta=0.9).name
    'smooth_loss'
    """

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


class ValueMetric(Metric):
    """A value computed elsewhere (a callback, say), reported as a metric: `func()` read once per epoch (fastai's).

    >>> learn = Learner(dls, model, loss_func=F.cross_entropy, metrics=ValueMetric(lambda: tracker.best, "best"))
    """

    def __init__(self, func: Callable[[], Any], metric_name: str | None = None):
        if not callable(func):
            raise TypeError(f"ValueMetric takes a function of no arguments returning the value, got {func!r}")
        self.func, self.name = func, metric_name or _func_name(func)

    def reset(self) -> None:
        pass

    def accumulate(self, learn: Any) -> None:
        pass

    @property
    def value(self) -> float | None:
        out = self.func()
        return out.item() if isinstance(out, Tensor) else out

    def sync(self, all_sum: Reducer, all_gather: Reducer) -> None:
        """The function's value is this process's; make it the same on every process if it matters."""


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


def unsyncable(m: Metric) -> NotImplementedError:
    """The error for a metric without `sync` on several processes: what it is, and what to write."""
    return NotImplementedError(
        f"metric {m.name!r} ({type(m).__name__}) cannot be combined across processes: each process saw only its part "
        f"of the data, and cadence cannot tell how to merge the state of a Metric subclass. Give "
        f"{type(m).__name__} a method sync(self, all_sum, all_gather) that makes its state that of all processes "
        f"(keep counts as tensors on the batch's device, then e.g. `self.c = all_sum(self.c)`; `all_gather(t)` "
        f"concatenates every process's `t`), or pass a plain function or AccumMetric(func), which cadence syncs; if "
        f"accumulate already reads every process's batch (learn.to_detach(learn.pred) gathers), a sync that does "
        f"nothing is right")


def check_syncable(metrics: list[Metric]) -> None:
    """Raise `unsyncable` for the first metric that keeps the base class's `sync` (before a fit on N processes)."""
    for m in metrics:
        if type(m).sync is Metric.sync:
            raise unsyncable(m)


def makes_metric(fn: Callable) -> Callable:
    """Mark `fn` as a function that builds a metric (`F1Score(average="macro")`): `metrics=fn` uncalled is refused
    with a message saying to call it."""
    fn.makes_metric = True
    return fn


def _about_metric(e: Exception) -> Exception:
    """Mark an error cadence raises about a metric itself: `accumulate` and `value_of` pass it on as it is."""
    e.about_metric = True
    return e


def accumulate(m: Metric, learn: Any) -> None:
    """`m.accumulate(learn)`; a failure is raised as it is (its type kept: an out-of-memory or distributed error stays
    one), with a note naming the metric and the batch's pred and targets."""
    try:
        m.accumulate(learn)
    except Exception as e:
        if getattr(e, "about_metric", False) or isinstance(e, CancelException):
            raise
        _note(e, metric_failure(m, "on a batch", learn.pred, learn.yb))
        raise


def value_of(m: Metric) -> float | None:
    """`m.value`; a failure is raised as it is, with a note naming the metric (and for `AccumMetric`, what it kept of
    the pass)."""
    try:
        return m.value
    except Exception as e:
        if getattr(e, "about_metric", False) or isinstance(e, CancelException):
            raise
        kept = (_joined(m.preds), (_joined(m.targs),)) if isinstance(m, AccumMetric) else (None, None)
        _note(e, metric_failure(m, "computing its value over the pass", *kept))
        raise


def _joined(chunks: list[Tensor]) -> Any:
    try:
        return torch.cat(chunks)
    except Exception:  # batches of different shapes: each as it is
        return tuple(chunks)


def _note(e: BaseException, note: str) -> None:
    if note not in getattr(e, "__notes__", ()):   # a metric inside a metric: said once
        e.add_note(note)


def metric_failure(m: Metric, when: str, pred: Any, yb: Any) -> str:
    """The note added to the error metric `m` raised: its name, the shapes and dtypes of what it got, and a hint.

    >>> metric_failure(accuracy_metric, "on a batch", pred, (targ,))
    "(in metric 'accuracy', failed on a batch: with pred tensor of shape (32, 2) ... Check that the metric fits ...)"
    """
    got = "" if pred is None else f": with pred {describe(pred)} and targets {describe(yb)}"
    hint = ""
    targ = yb[0] if isinstance(yb, tuple) and yb else None
    if isinstance(pred, Tensor) and isinstance(targ, Tensor) and pred.ndim > 1 and targ.shape == pred.shape \
            and targ.is_floating_point():
        hint = (" The targets have the predictions' shape (one-hot or multi-label): accuracy and error_rate "
                "take class indices (targets.argmax(-1)); multi-label targets take accuracy_multi.")
    return (f"(in metric {m.name!r}, failed {when}{got}. Check that the metric fits the model's output and the "
            f"targets.{hint})")


def _func_name(func: Callable) -> str:
    inner = func.func if isinstance(func, functools.partial) else func
    return getattr(inner, "__name__", type(inner).__name__)


def sum_metric(totals: Callable[..., Tensor], finish: Callable[[Tensor], Tensor]) -> Callable:
    """Decorator: mark `fn(preds, targs, **kw)` as computable from running sums for `Learner(metrics=...)`.

    >>> @sum_metric(totals=lambda pred, targ: torch.stack([(pred.argmax(-1) == targ).sum(), torch.tensor(len(targ))]),
    ...             finish=lambda t: t[0] / t[1])
    ... def my_accuracy(pred, targ): return (pred.argmax(-1) == targ).float().mean()
    >>> learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=my_accuracy)
    """

    def mark(fn: Callable) -> Callable:
        fn.as_metric = lambda **kw: SumMetric(fn.__name__, functools.partial(totals, **kw), finish)
        return fn

    return mark


def _ratio(s: Tensor) -> Tensor:
    return s[0] / s[1]


def _one_minus_ratio(s: Tensor) -> Tensor:
    return 1 - s[0] / s[1]


def _with_count(total: Tensor, targ: Tensor) -> Tensor:
    return torch.stack([total.double(), torch.tensor(float(targ.numel()), dtype=torch.float64, device=targ.device)])


def _correct_count(pred: Tensor, targ: Tensor, axis: int = -1) -> Tensor:
    return _with_count((pred.argmax(dim=axis) == targ).sum(), targ)


def _topk_count(pred: Tensor, targ: Tensor, k: int = 5, axis: int = -1) -> Tensor:
    topk = pred.topk(k=min(k, pred.shape[axis]), dim=axis).indices
    return _with_count((topk == targ.unsqueeze(axis)).any(dim=axis).sum(), targ)


@sum_metric(_correct_count, _ratio)
def accuracy(pred: Tensor, targ: Tensor, axis: int = -1) -> Tensor:
    """Fraction of samples whose arg-max prediction equals the target.

    >>> accuracy(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1]))
    tensor(0.5000)
    """
    return _ratio(_correct_count(pred, targ, axis)).float()


@sum_metric(_correct_count, _one_minus_ratio)
def error_rate(pred: Tensor, targ: Tensor, axis: int = -1) -> Tensor:
    """1 - accuracy.

    >>> error_rate(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1]))
    tensor(0.5000)
    """
    return 1 - _ratio(_correct_count(pred, targ, axis)).float()


@sum_metric(_topk_count, _ratio)
def top_k_accuracy(pred: Tensor, targ: Tensor, k: int = 5, axis: int = -1) -> Tensor:
    """Fraction of samples whose target is among the k highest predictions (`partial(top_k_accuracy, k=3)`).

    >>> top_k_accuracy(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.2, 0.7]]), torch.tensor([1, 0]), k=2)
    tensor(0.5000)
    """
    return _ratio(_topk_count(pred, targ, k, axis)).float()


def as_metric(m: Any) -> Metric:
    """Turn what a user passed in `metrics=` into a fresh Metric; TypeError if it cannot be one (a metric's class,
    or a function that builds a metric such as `F1Score`, passed uncalled: it says to call it)."""
    if isinstance(m, Metric):
        return m
    if not callable(m):
        raise TypeError(f"metrics must be callables fn(preds, targs) or Metric objects; got {m!r} "
                        f"({type(m).__name__}). Pass e.g. metrics=[accuracy] or metrics=AccumMetric(my_fn).")
    inner, kwargs = (m.func, m.keywords) if isinstance(m, functools.partial) else (m, {})
    if isinstance(inner, type) or getattr(inner, "makes_metric", False):
        name = getattr(inner, "__name__", repr(inner))
        call = f"{name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
        what = "the class" if isinstance(inner, type) else "the function that builds the metric"
        raise TypeError(f"metrics={name} passes {what}, not a metric: call it, metrics={call}")
    if hasattr(inner, "as_metric"):
        return inner.as_metric(**kwargs)
    return AvgMetric(m)
