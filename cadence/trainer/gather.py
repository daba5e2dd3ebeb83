"""GatherPreds: the callback behind `Learner.get_preds`, collecting outputs batch by batch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch

from .callback import Callback, Order
from .data import apply_to_tensors, to_detach


def _cat(chunks: list[Any], dim: int = 0) -> Any:
    """Concatenate a list of batches (tensors, or tuples or dicts of tensors) along `dim`."""
    first = chunks[0]
    if isinstance(first, (tuple, list)):
        parts = [_cat([c[i] for c in chunks], dim) for i in range(len(first))]
        return type(first)(*parts) if hasattr(first, "_fields") else type(first)(parts)   # namedtuples too
    if isinstance(first, Mapping):
        return {k: _cat([c[k] for c in chunks], dim) for k in first}
    return torch.cat(chunks, dim)


def _along(gather: Callable, dim: int) -> Callable:
    """`gather`, which joins the processes' tensors along dim 0, joining them along `dim` instead."""
    if dim == 0:
        return gather
    return lambda t: gather(t.movedim(dim, 0)).movedim(0, dim)


def per_item_loss(loss_func: Callable, pred: torch.Tensor, yb: tuple) -> torch.Tensor:
    """`loss_func` with `reduction='none'`: an attribute of nn losses, or a keyword of functional ones."""
    if hasattr(loss_func, "reduction"):
        saved, loss_func.reduction = loss_func.reduction, "none"
        try:
            return loss_func(pred, *yb)
        finally:
            loss_func.reduction = saved
    try:
        return loss_func(pred, *yb, reduction="none")
    except TypeError as e:
        raise ValueError("get_preds(with_loss=True) needs a loss_func that supports reduction='none' "
                         "(an nn loss module, or a function with a `reduction` keyword)") from e


class GatherPreds(Callback):
    """Keep every validation batch's predictions, targets and optionally inputs and per-item losses, concatenated
    along `concat_dim` (fastai's: the batch dimension of the model's output)."""

    order = Order.RECORD + 1
    run_train = False

    def __init__(self, with_input: bool = False, with_loss: bool = False, concat_dim: int = 0):
        self.with_input, self.with_loss, self.concat_dim = with_input, with_loss, concat_dim
        self.inputs, self.preds, self.targs, self.losses = [], [], [], []

    def after_batch(self):
        learn = self.learn
        self.preds.append(to_detach(learn.pred, cpu=False))
        if learn.yb:
            self.targs.append(learn.yb[0] if len(learn.yb) == 1 else learn.yb)
        if self.with_input:
            self.inputs.append(learn.xb[0] if type(learn.xb) is tuple and len(learn.xb) == 1 else learn.xb)
        if self.with_loss:
            self.losses.append(per_item_loss(learn.loss_func, learn.pred, learn.yb).detach())

    def after_validate(self):
        """Combine every process's batches (padding already dropped), in rank order: the loader's order."""
        dim = self.concat_dim
        gather = _along(self.learn.strategy.gather, dim)
        for name in ("inputs", "preds", "targs", "losses"):
            chunks = getattr(self, name)
            if chunks:
                setattr(self, name, [apply_to_tensors(gather, _cat(chunks, dim))])

    def result(self, act: Callable | None = None) -> tuple:
        """(inputs?, preds, targs, losses?) concatenated over all batches."""
        if not self.preds:
            raise ValueError("get_preds saw no batches: the data loader is empty")
        dim = self.concat_dim
        preds = _cat(self.preds, dim)
        out = [act(preds) if act is not None else preds, _cat(self.targs, dim) if self.targs else None]
        if self.with_input:
            out.insert(0, _cat(self.inputs, dim))
        if self.with_loss:
            out.append(_cat(self.losses, dim))
        return tuple(out)
