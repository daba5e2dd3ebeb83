"""GatherPreds: the callback behind `Learner.get_preds`, collecting outputs batch by batch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch

from .callback import Callback, Order
from ..nested import leaves, map_tensors
from .data import to_detach
from .model_output import prediction


def _pad_to(t: torch.Tensor, shape: list[int], pad_index: Any) -> torch.Tensor:
    """`t` grown to `shape` (no smaller in any dim), the new entries `pad_index`, its own at the start of each dim;
    a dtype that cannot hold `pad_index` (a bool attention mask, uint8 for -100) is padded with 0 / False."""
    if list(t.shape) == shape:
        return t
    unsigned = not (t.is_floating_point() or t.is_complex()) and t.dtype != torch.bool and torch.iinfo(t.dtype).min == 0
    out = t.new_full(shape, 0 if t.dtype == torch.bool or (unsigned and pad_index < 0) else pad_index)
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


def _tensors_only(b: Any) -> Any:
    """`b` with its leaves that are not tensors (a model's key/value cache, a None) made None, in dicts (the key
    kept, so every batch and every process has the same structure) as in tuples and lists: what cannot be joined
    across batches or gathered across processes."""
    if isinstance(b, torch.Tensor):
        return b
    if isinstance(b, Mapping):
        return {k: _tensors_only(v) for k, v in b.items()}
    if isinstance(b, (tuple, list)):
        parts = [_tensors_only(v) for v in b]
        if all(p is None for p in parts):   # a batch's list of strings: nothing to join
            return None
        return type(b)(*parts) if hasattr(b, "_fields") else type(b)(parts)
    return None


def _mixed(where: str) -> ValueError:
    return ValueError(f"get_preds: an output (a model output's field, a target or an input) is None {where} and a "
                      f"tensor elsewhere: it cannot be joined; return a tensor every time, or None every time")


def _cat(chunks: list[Any], dim: int = 0, pad_index: Any = -100) -> Any:
    """Concatenate a list of batches (tensors, or tuples or dicts of tensors) along `dim`; tensors whose other
    dims differ (sequences padded per batch) are first padded to the largest with `pad_index`, at the end.

    >>> _cat([torch.ones(2, 3), torch.ones(1, 5)]).shape      # the first batch's rows end in 2 x -100
    torch.Size([3, 5])
    """
    first = chunks[0]
    if isinstance(first, (tuple, list)):
        parts = [_cat([c[i] for c in chunks], dim, pad_index) for i in range(len(first))]
        return type(first)(*parts) if hasattr(first, "_fields") else type(first)(parts)   # namedtuples too
    if isinstance(first, Mapping):
        return {k: _cat([c[k] for c in chunks], dim, pad_index) for k in first}
    if first is None or any(c is None for c in chunks):   # a leaf `_tensors_only` emptied
        if all(c is None for c in chunks):
            return None
        raise _mixed("in some batches")
    if first.ndim > dim and len({c.shape[:dim] + c.shape[dim + 1:] for c in chunks}) > 1:
        shape = [max(c.shape[i] for c in chunks) for i in range(first.ndim)]
        chunks = [_pad_to(c, shape[:dim] + [c.shape[dim]] + shape[dim + 1:], pad_index) for c in chunks]
    return torch.cat(chunks, dim)


def _pad_across(gather: Callable, t: torch.Tensor, dim: int, pad_index: Any) -> torch.Tensor:
    """`t` padded as `_cat` pads, to the largest size any process has in each dim but `dim` (`gather` is the
    strategy's: every process calls it)."""
    if t.ndim <= dim:
        return t
    sizes = gather(torch.tensor([t.shape], device=t.device))
    shape = sizes.max(0).values.tolist()
    shape[dim] = t.shape[dim]
    return _pad_to(t, shape, pad_index)


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
    along `concat_dim` (fastai's: the batch dimension of the model's output). Batches whose other dims differ
    (each padded to its own longest sequence) are padded with `pad_index` to the largest of every batch on every
    process, as transformers' Trainer pads its evaluation outputs (`padding_index`).

    >>> gatherer = GatherPreds(pad_index=0); learn.validate(cbs=gatherer); preds, targs = gatherer.result()
    """

    order = Order.RECORD + 1
    run_train = False

    def __init__(self, with_input: bool = False, with_loss: bool = False, concat_dim: int = 0, pad_index: Any = -100):
        self.with_input, self.with_loss, self.concat_dim, self.pad_index = with_input, with_loss, concat_dim, pad_index
        self.inputs, self.preds, self.targs, self.losses = [], [], [], []

    def after_batch(self):
        learn = self.learn
        # a ModelOutput's logits, as under loss_func=None; no cache or other non-tensor leaf is kept or gathered
        self.preds.append(_tensors_only(to_detach(prediction(learn.pred), cpu=False)))
        if learn.yb:
            self.targs.append(_tensors_only(learn.yb[0] if len(learn.yb) == 1 else learn.yb))
        if self.with_input:
            xb = learn.xb[0] if type(learn.xb) is tuple and len(learn.xb) == 1 else learn.xb
            self.inputs.append(_tensors_only(xb))
        if self.with_loss:
            self.losses.append(per_item_loss(learn.loss_func, learn.pred, learn.yb).detach())

    def after_validate(self):
        """Combine every process's batches (padding already dropped), in rank order: the loader's order; padded
        to the same size on every process first (the ranks' last batches may be padded to different lengths)."""
        dim, pad, strategy_gather = self.concat_dim, self.pad_index, self.learn.strategy.gather
        gather, order = _along(strategy_gather, dim), self._stream_order()
        joined = {name: _cat(getattr(self, name), dim, pad) for name in ("inputs", "preds", "targs", "losses")
                  if getattr(self, name)}
        if joined:
            self._check_none_everywhere_or_nowhere(joined)   # one collective for every group
        for name, one in joined.items():
            one = map_tensors(lambda t: gather(_pad_across(strategy_gather, t, dim, pad)), one)
            if order is not None:
                one = map_tensors(lambda t: t.index_select(dim, order.to(t.device)), one)
            setattr(self, name, [one])

    def _check_none_everywhere_or_nowhere(self, joined: Any) -> None:
        """Every process gathers the same tensors: a leaf None on every process stays None (nothing gathered), one
        None on some processes only is refused on all of them alike (gathering it on the others would hang)."""
        found = leaves(joined)
        strategy = self.learn.strategy
        device = getattr(strategy, "device", None) or torch.device("cpu")
        nones = strategy.gather(torch.tensor([[leaf is None for leaf in found]], dtype=torch.long, device=device))
        if nones.shape[1:] != (len(found),) or bool((nones.any(0) & ~nones.all(0)).any()):
            raise _mixed("on some processes")   # or structures that differ: every process sees the same nones

    def _stream_order(self) -> torch.Tensor | None:
        """The permutation that puts the gathered rows (rank by rank) in the order the loader dealt them from
        (`DistributedDL.gathered_order`: a stream's); None where rank order is the data's order, or the loader is
        not sharded."""
        gathered_order = getattr(self.learn.dl, "gathered_order", None)
        return gathered_order() if gathered_order is not None else None

    def result(self, act: Callable | None = None) -> tuple:
        """(inputs?, preds, targs, losses?) concatenated over all batches."""
        if not self.preds:
            raise ValueError("get_preds saw no batches: the data loader is empty")
        dim, pad = self.concat_dim, self.pad_index
        preds = _cat(self.preds, dim, pad)
        out = [act(preds) if act is not None else preds, _cat(self.targs, dim, pad) if self.targs else None]
        if self.with_input:
            out.insert(0, _cat(self.inputs, dim, pad))
        if self.with_loss:
            out.append(_cat(self.losses, dim, pad))
        return tuple(out)
