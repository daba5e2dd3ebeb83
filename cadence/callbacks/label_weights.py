"""Weighing accumulated micro-batches by what a model's own loss averages over: its labels, not its samples.

A Hugging Face model given `labels` returns the mean loss over the labels it predicts (those not -100; a causal
LM's shifted by one). Micro-batches padded to different lengths hold different numbers of them, so a window whose
micro-batches were weighed by their samples is not the big batch's mean. `GradAccum` reads a window's batches
ahead (`WindowAhead`), counts each one's labels (`label_items`) and weighs it by its share of the window's: as
transformers' Trainer does with `num_items_in_batch`.

>>> label_items({"input_ids": ids, "labels": torch.tensor([[5, 6, -100]])}, shifted=True)
tensor(1)
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["label_items", "shifts_labels", "WindowAhead"]

IGNORE_INDEX = -100  # what transformers' losses skip


def label_items(batch: Any, shifted: bool) -> torch.Tensor | None:
    """How many labels of `batch` a Hugging Face model's loss averages over: its `shift_labels` (a padding-free
    collator's), else its `labels` (without each row's first, `shifted`: a causal LM predicts the next token), not
    counting -100; None for a batch without labels. A tensor where the labels are (no host sync on a device).

    >>> label_items({"labels": torch.tensor([1, 0, 1])}, shifted=False)
    tensor(3)
    """
    if not isinstance(batch, Mapping):
        return None
    labels = batch.get("shift_labels")
    if labels is None:
        labels = batch.get("labels")
        if isinstance(labels, torch.Tensor) and shifted and labels.dim() > 1:
            labels = labels[..., 1:]
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point():  # regression targets: one per sample
        return None
    return (labels != IGNORE_INDEX).sum()


def shifts_labels(model: Any) -> bool:
    """Whether `model` (unwrapped) is a transformers causal LM, whose loss shifts the labels by one (transformers'
    own rule: its loss function is `ForCausalLMLoss`, and it is not an encoder-decoder).

    >>> shifts_labels(GPT2LMHeadModel(GPT2Config()))
    True
    """
    if "transformers" not in sys.modules:
        return False
    get_base = getattr(model, "get_base_model", None)  # peft
    model = get_base() if callable(get_base) else model
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
        loss_function = getattr(model, "loss_function", None)
    except Exception:  # an older transformers, or a model whose loss it does not know
        return False
    config = getattr(model, "config", None)
    return loss_function is ForCausalLMLoss and not getattr(config, "is_encoder_decoder", False)


class WindowAhead:
    """`dl` read one accumulation window ahead: before a window's first batch is yielded, all its batches are read
    and `weigh(batches)` called on them (the window ends where `ends` says). Everything else is `dl`'s.

    >>> learn.dl = WindowAhead(learn.dl, ends=[False, True], weigh=print)
    """

    def __init__(self, dl: Any, ends: list[bool], weigh: Any):
        self.inner, self._ends, self._weigh = dl, ends, weigh

    def __getattr__(self, name: str) -> Any:
        if name == "inner" or name.startswith("__"):  # not set yet (a copy or an unpickling): not the loader's
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        i = getattr(self.inner, "start_batch", 0)
        it = iter(self.inner)
        while True:
            window = []
            for batch in it:
                window.append(batch)
                if i + len(window) > len(self._ends) or self._ends[i + len(window) - 1]:
                    break
            if not window:
                return
            self._weigh(i, window)
            yield from window
            i += len(window)
