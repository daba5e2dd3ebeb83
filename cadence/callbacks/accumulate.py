"""GradAccum: accumulate the gradients of several micro-batches before one optimizer step.

Each micro-batch's loss is scaled by its share of the window's samples, so a window gives the
gradient of one step on the concatenated batch; a partial window at the end of an epoch is
scaled by its true size and stepped. A model that computes its loss from `labels` (Hugging Face:
the mean over the labels that are not -100) is weighed by its share of the window's labels instead,
the window's batches read ahead to count them (`label_weights`), as transformers' Trainer does: the
big batch's mean over tokens, however each micro-batch was padded (each process its own window). Under DDP the micro-batches before the last run without
gradient synchronisation, forward included (one all-reduce per window). An engine that
accumulates itself (the OwnsAccumulation ability: DeepSpeed) is configured instead and steps every
micro-batch; GradAccum still marks each window's end (`sync_gradients`) and scales the losses. `learn.step` counts optimizer steps, so schedules and trackers do
not change with the accumulation.

>>> learn.fit(3, cbs=GradAccum(steps=4))        # batch 8 x 4 = one step of batch 32
>>> learn.fit(3, cbs=GradAccum(samples=64))     # fastai's way: step once 64 samples were seen
"""

from __future__ import annotations

from typing import Any

import torch

from ..distributed.strategy import OwnsAccumulation
from ..trainer.callback import Callback, Order
from ..trainer.data import n_batches
from ..trainer.events import CancelBatchException
from .label_weights import WindowAhead, label_items, shifts_labels


def batch_sizes(dl: Any) -> list[int] | None:
    """Size of every batch `dl` yields, from its length and batch size; None when it cannot be known."""
    if isinstance(getattr(dl, "batch_lens", None), list):  # a DistributedDL knows each batch (0: skipped on resume)
        return dl.batch_lens
    bs = getattr(dl, "batch_size", None)
    n = getattr(dl, "per_rank", None)  # a DistributedDL's shard
    if n is None:
        try:
            n = len(dl.dataset)
        except (AttributeError, TypeError):
            return None
    if not bs:
        return None
    full, rest = divmod(n, bs)
    return [bs] * full + ([rest] if rest and not getattr(dl, "drop_last", False) else [])


def plan_windows(sizes: list[int], steps: int | None = None, samples: int | None = None) -> tuple[list[bool], list[float]]:
    """For every batch: does it end a window, and its loss scale (its share of the window's samples).

    >>> plan_windows([8, 8, 8, 4], steps=2)
    ([False, True, False, True], [0.5, 0.5, 0.6666666666666666, 0.3333333333333333])
    """
    ends, scales, window = [], [], []
    for i, size in enumerate(sizes):
        window.append(size)
        full = len(window) == steps if steps else sum(window) >= samples
        if full or i == len(sizes) - 1:
            total = sum(window) or 1  # a window of batches a resumed epoch skipped
            scales += [s / total for s in window]
            ends += [False] * (len(window) - 1) + [True]
            window = []
    return ends, scales


class GradAccum(Callback):
    """Step once every `steps` micro-batches, or once `samples` samples were seen (give one of them).

    >>> with learn.no_bar(): learn.fit(1, cbs=GradAccum(steps=2))   # 4 batches
    >>> learn.step
    2
    """

    order = Order.ACCUMULATE
    run_valid = False

    def __init__(self, steps: int | None = None, samples: int | None = None):
        if (steps is None) == (samples is None):
            raise ValueError("GradAccum takes steps (e.g. GradAccum(steps=4)) or samples (GradAccum(samples=64))")
        for name, v in (("steps", steps), ("samples", samples)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"GradAccum {name} must be a positive int, got {v!r}")
        self.steps, self.samples = steps, samples
        self.engine_owned = False  # the strategy accumulates itself (DeepSpeed): configured, and stepped every batch
        self._shifted = False  # the model is a causal LM: its loss skips each row's first label

    def before_fit(self):
        strategy = self.learn.strategy
        self.engine_owned = isinstance(strategy, OwnsAccumulation)
        if self.engine_owned:
            if self.steps is None:
                raise ValueError(f"{strategy.name} accumulates a fixed number of micro-batches: use GradAccum(steps=...)")
            strategy.configure_accumulation(self.steps)
        self._plan(self.learn.dls.train)
        self.learn.steps_per_epoch = sum(self.ends)

    def before_train(self):
        learn = self.learn
        self._plan(learn.dl)
        if learn.loss_func is None:  # the model's own loss: weigh each micro-batch by the labels it averages over
            self._shifted = shifts_labels(learn.strategy.unwrap(learn.model))
            learn.dl = WindowAhead(learn.dl, self.ends, self._weigh_by_labels)

    def _weigh_by_labels(self, first: int, window: list) -> None:
        """The loss scales of the window starting at batch `first`: each batch's share of the window's labels
        (the planned share of its samples where a batch has no labels, or the window none)."""
        counts = [label_items(batch, self._shifted) for batch in window]
        if any(c is None for c in counts):
            return
        total = sum(counts).clamp(min=1)  # tensors where the batches are: no host sync per micro-batch
        self.scales[first:first + len(window)] = [c / total for c in counts]

    def _plan(self, dl: Any) -> None:
        if n_batches(dl) is None:
            raise ValueError("GradAccum plans its windows over an epoch's batches, and the train loader has no "
                             "length (an IterableDataset without __len__): give the dataset a __len__")
        sizes = batch_sizes(dl)
        if sizes is None:
            if self.samples is not None:
                raise ValueError("GradAccum(samples=...) needs a loader with a dataset length and batch_size; "
                                 "use GradAccum(steps=...) instead")
            sizes = [1] * len(dl)  # unknown sizes: weigh micro-batches equally
        if len(sizes) != len(dl):
            sizes = [1] * len(dl)
        self.ends, self.scales = plan_windows(sizes, self.steps, self.samples)

    def before_batch(self):
        self.learn.sync_gradients = self.ends[self.learn.iter]  # set before the forward: DDP decides there

    def after_loss(self):
        scale = self.scales[self.learn.iter]
        if isinstance(scale, torch.Tensor) or scale != 1.0:
            self.learn.loss_grad = self.learn.loss_grad * scale

    def before_step(self):
        if not self.ends[self.learn.iter] and not self.engine_owned:
            raise CancelBatchException()  # keep the gradients: no step, no zero_grad

    def after_train(self):
        self.learn.sync_gradients = True
        if isinstance(self.learn.dl, WindowAhead):
            self.learn.dl = self.learn.dl.inner

    def after_fit(self):
        self.learn.sync_gradients = True
