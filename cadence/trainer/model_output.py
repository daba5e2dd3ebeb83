"""How a model is called and what its output holds: `call_model` runs it on a batch's inputs as the training loop
does, `model_loss` takes the prediction and loss of a model that computes its loss.

>>> pred, loss = model_loss(call_model(gpt2, {"input_ids": ids, "labels": ids}), training=True)   # logits, loss
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["call_model", "model_loss", "prediction", "describe"]


def call_model(model: Any, xb: tuple | Mapping) -> Any:
    """`model(**xb)` for a dict of keyword inputs (a Hugging Face batch), else `model(*xb)` (a tuple of inputs).

    >>> logits = call_model(model, (x,))
    >>> out = call_model(gpt2, {"input_ids": ids, "attention_mask": mask})
    """
    if type(xb) is tuple:   # the common case, tested first: the training loop calls this at every batch
        return model(*xb)
    return model(**xb) if isinstance(xb, Mapping) else model(*xb)


def model_loss(out: Any, training: bool) -> tuple[Any, torch.Tensor | None]:
    """(prediction, loss) from the output of a model that computes its own loss: its `logits` and `loss`.

    >>> pred, loss = model_loss(model(**batch), training=True)     # a Hugging Face ModelOutput, or a dict
    """
    get = out.get if isinstance(out, Mapping) else lambda k: getattr(out, k, None)
    loss, logits = get("loss"), get("logits")
    if loss is None and training:
        raise ValueError(f"loss_func=None, so the model must compute its loss, but its output ({describe(out)}) has "
                         f"no `loss`: give a loss_func, e.g. Learner(dls, model, loss_func=nn.CrossEntropyLoss()), "
                         f"or pass the labels in the batch (Hugging Face models need them)")
    return (out if logits is None else logits), loss


def prediction(out: Any) -> Any:
    """What `get_preds` keeps of a model's output: a Hugging Face `ModelOutput`'s `logits` (what `model_loss` gives
    under loss_func=None, so a causal LM's predictions are its logits whichever way its loss is computed); any other
    output (a tensor, a tuple, a dict, a ModelOutput without logits) as it is.

    >>> prediction(gpt2(ids)).shape          # CausalLMOutputWithPast(logits, past_key_values) -> the logits
    torch.Size([2, 16, 50257])
    """
    if any(c.__name__ == "ModelOutput" for c in type(out).__mro__):   # transformers, never imported here
        logits = out.get("logits")
        if logits is not None:
            return logits
    return out


def describe(x: Any) -> str:
    """A value's shape for an error message: tensors by shape and dtype, tuples and dicts by their items."""
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)} ({x.dtype})"
    if isinstance(x, (list, tuple)):
        return "(" + ", ".join(describe(v) for v in x) + ")"
    if isinstance(x, Mapping):
        return "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in x.items()) + "}"
    return type(x).__name__
