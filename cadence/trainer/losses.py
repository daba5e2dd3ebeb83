"""fastai's flattened losses: torch's losses that first move the class axis last and flatten input and target.

`CrossEntropyLossFlat`, `BCEWithLogitsLossFlat`, `MSELossFlat`, `LabelSmoothingCrossEntropy` and
`LabelSmoothingCrossEntropyFlat` keep fastai's arguments and semantics (`BaseLoss`: `axis`, `flatten`,
`floatify`, `is_2d`), and their `activation` / `decodes`, which `get_preds` (its default `act`, and
`with_decoded=True`) and `predict` use as fastai's do.

>>> learn = Learner(dls, model, loss_func=CrossEntropyLossFlat())      # (bs, classes) or (bs, seq, classes)
>>> probs, targs, classes = learn.get_preds(with_decoded=True)         # softmax, then the arg-max class
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Tensor = torch.Tensor


class BaseLoss:
    """`loss_cls(*args, **kwargs)` called on flattened input and target (fastai's `BaseLoss`).

    The class axis `axis` is moved last; with `flatten` the input becomes `(-1, n_classes)` (`is_2d`) or 1-d and
    the target 1-d; `floatify` makes the target float, and int8/16/32 targets become int64. `reduction` reads and
    sets the wrapped loss's (what `loss_not_reduced` and `get_preds(with_loss=True)` switch). `activation` and
    `decodes` do nothing here; the subclasses define them.

    >>> loss = BaseLoss(nn.CrossEntropyLoss, axis=1)   # class axis 1: (bs, classes, h, w) images
    >>> loss(torch.zeros(2, 3, 4, 4), torch.zeros(2, 4, 4, dtype=torch.long))
    tensor(1.0986)
    """

    def __init__(self, loss_cls: Any, *args: Any, axis: int = -1, flatten: bool = True, floatify: bool = False,
                 is_2d: bool = True, **kwargs: Any):
        self.axis, self.flatten, self.floatify, self.is_2d = axis, flatten, floatify, is_2d
        self.func = loss_cls(*args, **kwargs)

    def __repr__(self) -> str:
        return f"FlattenedLoss of {self.func}"

    @property
    def reduction(self) -> str:
        return self.func.reduction

    @reduction.setter
    def reduction(self, value: str) -> None:
        self.func.reduction = value

    def _contiguous(self, x: Any) -> Any:
        return x.transpose(self.axis, -1).contiguous() if isinstance(x, Tensor) else x

    def __call__(self, inp: Tensor, targ: Tensor, **kwargs: Any) -> Tensor:
        inp, targ = self._contiguous(inp), self._contiguous(targ)
        if self.floatify and targ.dtype != torch.float16:
            targ = targ.float()
        if targ.dtype in (torch.int8, torch.int16, torch.int32):
            targ = targ.long()
        if self.flatten:
            inp = inp.reshape(-1, inp.shape[-1]) if self.is_2d else inp.reshape(-1)
        return self.func(inp, targ.reshape(-1) if self.flatten else targ, **kwargs)

    def to(self, device: Any) -> "BaseLoss":
        """Move the wrapped loss's tensors (a class `weight`, `pos_weight`) to `device`."""
        if isinstance(self.func, nn.Module):
            self.func.to(device)
        return self

    def activation(self, x: Tensor) -> Tensor:
        return x

    def decodes(self, x: Tensor) -> Tensor:
        return x


class CrossEntropyLossFlat(BaseLoss):
    """`nn.CrossEntropyLoss` over flattened input and target; softmax activation, arg-max decoding (fastai's).

    >>> CrossEntropyLossFlat()(torch.zeros(2, 5, 3), torch.zeros(2, 5, dtype=torch.long))   # (bs, seq, classes)
    tensor(1.0986)
    """

    y_int = True

    def __init__(self, *args: Any, axis: int = -1, weight: Tensor | None = None, ignore_index: int = -100,
                 reduction: str = "mean", **kwargs: Any):
        super().__init__(nn.CrossEntropyLoss, *args, axis=axis, weight=weight, ignore_index=ignore_index,
                         reduction=reduction, **kwargs)

    def decodes(self, x: Tensor) -> Tensor:
        return x.argmax(dim=self.axis)

    def activation(self, x: Tensor) -> Tensor:
        return F.softmax(x, dim=self.axis)


class BCEWithLogitsLossFlat(BaseLoss):
    """`nn.BCEWithLogitsLoss` over flattened input and float target; sigmoid activation, `x > thresh` decoding.

    With `pos_weight` nothing is flattened (its shape follows the labels), as in fastai.

    >>> BCEWithLogitsLossFlat()(torch.zeros(4, 3), torch.ones(4, 3, dtype=torch.long))
    tensor(0.6931)
    """

    def __init__(self, *args: Any, axis: int = -1, floatify: bool = True, thresh: float = 0.5, **kwargs: Any):
        if kwargs.get("pos_weight") is not None:
            if kwargs.get("flatten") is True:
                raise ValueError("`flatten` must be False when using `pos_weight` to avoid a RuntimeError due to "
                                 "shape mismatch")
            kwargs["flatten"] = False
        super().__init__(nn.BCEWithLogitsLoss, *args, axis=axis, floatify=floatify, is_2d=False, **kwargs)
        self.thresh = thresh

    def decodes(self, x: Tensor) -> Tensor:
        return x > self.thresh

    def activation(self, x: Tensor) -> Tensor:
        return torch.sigmoid(x)


def MSELossFlat(*args: Any, axis: int = -1, floatify: bool = True, **kwargs: Any) -> BaseLoss:
    """`nn.MSELoss` over flattened input and float target: a `(bs, 1)` output against `(bs,)` targets (fastai's).

    >>> MSELossFlat()(torch.tensor([[1.0], [2.0]]), torch.tensor([1, 4]))
    tensor(2.)
    """
    return BaseLoss(nn.MSELoss, *args, axis=axis, floatify=floatify, is_2d=False, **kwargs)


class LabelSmoothingCrossEntropy(nn.Module):
    """Cross entropy with label smoothing `eps` (fastai's): `eps / c` of the loss spread over the `c` classes.

    >>> LabelSmoothingCrossEntropy(eps=0.1)(torch.tensor([[2.0, 0.0]]), torch.tensor([0]))
    tensor(0.2269)
    """

    y_int = True

    def __init__(self, eps: float = 0.1, weight: Tensor | None = None, reduction: str = "mean"):
        super().__init__()
        self.eps, self.weight, self.reduction = eps, weight, reduction

    def forward(self, output: Tensor, target: Tensor) -> Tensor:
        c = output.size()[1]
        log_preds = F.log_softmax(output, dim=1)
        if self.reduction == "sum":
            loss = -log_preds.sum()
        else:
            loss = -log_preds.sum(dim=1)
            if self.reduction == "mean":
                loss = loss.mean()
        return loss * self.eps / c + (1 - self.eps) * F.nll_loss(log_preds, target.long(), weight=self.weight,
                                                                 reduction=self.reduction)

    def activation(self, out: Tensor) -> Tensor:
        return F.softmax(out, dim=-1)

    def decodes(self, out: Tensor) -> Tensor:
        return out.argmax(dim=-1)


class LabelSmoothingCrossEntropyFlat(BaseLoss):
    """`LabelSmoothingCrossEntropy` over flattened input and target (fastai's).

    >>> LabelSmoothingCrossEntropyFlat(eps=0.1)(torch.tensor([[[2.0, 0.0]]]), torch.tensor([[0]]))
    tensor(0.2269)
    """

    y_int = True

    def __init__(self, *args: Any, axis: int = -1, eps: float = 0.1, reduction: str = "mean", **kwargs: Any):
        super().__init__(LabelSmoothingCrossEntropy, *args, axis=axis, eps=eps, reduction=reduction, **kwargs)

    def activation(self, out: Tensor) -> Tensor:
        return F.softmax(out, dim=-1)

    def decodes(self, out: Tensor) -> Tensor:
        return out.argmax(dim=-1)
