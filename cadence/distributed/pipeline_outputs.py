"""The pipeline's output on every rank: the last stage's predictions and loss, broadcast over the pp group.

The Learner's callbacks, metrics and `get_preds` expect `pred` and `loss` on every process, but only
the rank holding the last stage has them. The first batch of a kind (training or not, with targets or
not, the inputs' shapes) sends a header (the loss, pred's dtype and shape), then pred: two broadcasts.
Every rank then knows what that kind of batch gives, so later ones send a flag, the loss and pred (as
float32, which holds bf16 and fp16 exactly) in one broadcast. An output that does not have its kind's
layout (a model whose output shape depends on the values) clears the flag, and that batch is sent the
first way on every rank.

The other ranks post their receive of that one broadcast before the step (`expect`), so it completes in the
background while the schedule runs: the rank that finishes the step last (the first stage, under 1F1B) finds its
copy there instead of waiting for a round trip on the step's critical path.

>>> outputs.expect(kind, src=last_stage_rank, group=pp_group, device=device)   # before the step
>>> pred, loss = outputs.share(pred, loss, kind, src=last_stage_rank, group=pp_group, device=device)
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["LastStageOutputs"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool)
_MAX_DIMS = 8  # of the output broadcast from the last stage
_PACKABLE = (torch.float32, torch.bfloat16, torch.float16)  # outputs float32 carries exactly, with the loss


class LastStageOutputs:
    """Shares the last stage's `(pred, loss)`; remembers each kind of batch's output layout."""

    def __init__(self) -> None:
        self.layouts: dict[tuple, tuple] = {}   # kind -> (dtype, shape, has_loss)
        self._posted: tuple | None = None       # (kind, buffer, work) of a receive posted by `expect`

    def expect(self, kind: Any, src: int, group: Any, device: torch.device) -> None:
        """Before the step of a batch of `kind`: on ranks other than `src`, post the receive of its outputs when
        their layout is known (the broadcast runs while the step does; `share` waits for it)."""
        known = self.layouts.get(kind)
        if known is not None and dist.get_rank() != src:
            packed = torch.empty(math.prod(known[1]) + 2, dtype=torch.float32, device=device)
            self._posted = (kind, packed, dist.broadcast(packed, src=src, group=group, async_op=True))

    def share(self, pred: torch.Tensor | None, loss: torch.Tensor | None, kind: tuple, src: int, group: Any,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`pred` and `loss` of global rank `src` (None elsewhere) on every rank of `group`."""
        known = self.layouts.get(kind)
        if known is not None:
            posted, self._posted = self._posted, None
            if posted is not None and posted[0] != kind:
                raise RuntimeError(f"outputs of a {posted[0]!r} batch were expected, not of a {kind!r} one")
            got = _packed(pred, loss, known, src, group, device, posted)
            if got is not None:
                return got
        pred, loss = _with_header(pred, loss, src, group, device)
        if pred.dtype in _PACKABLE:
            self.layouts[kind] = (pred.dtype, tuple(pred.shape), loss is not None)
        return pred, loss


def _with_header(pred: torch.Tensor | None, loss: torch.Tensor | None, src: int, group: Any, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A header (whether there is a loss, its value, pred's dtype and shape), then pred: two broadcasts."""
    header = torch.zeros(4 + _MAX_DIMS, dtype=torch.float64, device=device)
    if pred is not None:
        if pred.ndim > _MAX_DIMS or pred.dtype not in _DTYPES:
            raise ValueError(f"the last stage's output ({pred.dtype}, {pred.ndim} dims) cannot be broadcast: a tensor "
                             f"of at most {_MAX_DIMS} dims and one of {_DTYPES}")
        header[:4] = torch.tensor([loss is not None, 0.0 if loss is None else float(loss),
                                   _DTYPES.index(pred.dtype), pred.ndim], dtype=torch.float64)
        header[4:4 + pred.ndim] = torch.tensor(pred.shape, dtype=torch.float64)
    dist.broadcast(header, src=src, group=group)
    has_loss, value, dtype, ndim = header[:4].tolist()
    if pred is None:
        shape = [int(d) for d in header[4:4 + int(ndim)].tolist()]
        pred = torch.empty(shape, dtype=_DTYPES[int(dtype)], device=device)
        loss = torch.tensor(value, dtype=torch.float32, device=device) if has_loss else None
    dist.broadcast(pred.contiguous(), src=src, group=group)
    return pred, loss


def _packed(pred: torch.Tensor | None, loss: torch.Tensor | None, layout: tuple, src: int, group: Any,
            device: torch.device, posted: tuple | None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """[matches, loss, pred as float32] in one broadcast (already posted by a receiver's `expect`); None on every
    rank when the output lacks `layout`."""
    dtype, shape, has_loss = layout
    if posted is not None:
        _, packed, work = posted
        work.wait()
    else:
        packed = torch.zeros(math.prod(shape) + 2, dtype=torch.float32, device=device)
        if pred is not None and tuple(pred.shape) == shape and pred.dtype == dtype and (loss is not None) == has_loss:
            packed[0] = 1.0
            if has_loss:
                packed[1] = loss
            packed[2:] = pred.reshape(-1)
        dist.broadcast(packed, src=src, group=group)
    if not packed[0]:
        return None
    if pred is None:
        pred = packed[2:].to(dtype).reshape(shape)
        loss = packed[1].clone() if has_loss else None
    return pred, loss
