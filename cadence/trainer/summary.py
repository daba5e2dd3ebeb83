"""`learn.summary()`: the model's layers with output shapes and parameter counts, its freezing and its callbacks.

>>> print(learn.summary())
Sequential (input: 64 x 1 x 8 x 8)
...
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .data import to_device
from .model_output import call_model
from .schedule import n_groups


class Summary(str):
    """A string that shows as itself in a notebook or REPL (no quotes, real line breaks)."""

    def __repr__(self) -> str:
        return str(self)


def _shape(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return " x ".join(map(str, x.shape)) or "scalar"
    if isinstance(x, (list, tuple)):
        return ", ".join(_shape(v) for v in x)
    if isinstance(x, Mapping):
        return ", ".join(f"{k}: {_shape(v)}" for k, v in x.items())
    return type(x).__name__


def _inputs(learn, batch: Any) -> tuple | dict:
    """The model's inputs of one batch, split as the training loop splits it: a tuple, or a dict of keyword inputs."""
    b = to_device(batch, learn.strategy.device)
    if isinstance(b, (list, tuple)):
        n = learn.dls.n_inp or len(b) - 1 or 1
        return tuple(b[:n])
    if isinstance(b, Mapping):
        return learn._split_named(b)[0]
    return (b,)


def _output_shapes(learn, module: nn.Module, xb: tuple | dict) -> dict[nn.Module, str]:
    """Each leaf module's output shape for one forward pass (eval mode, no gradients; the mode is restored)."""
    shapes: dict[nn.Module, str] = {}
    leaves = [m for m in module.modules() if not list(m.children())]

    def record(m: nn.Module, inputs: Any, output: Any) -> None:  # returns None: the output stays as it is
        shapes.setdefault(m, _shape(output))

    hooks = [m.register_forward_hook(record) for m in leaves]
    was_training = learn.model.training
    try:
        learn.model.eval()
        with torch.no_grad(), learn._forward_context():
            call_model(learn.model, xb)
    finally:
        learn.model.train(was_training)
        for h in hooks:
            h.remove()
    return shapes


def summary(learn) -> Summary:
    """Layers (leaf modules) with their output shape for one training batch, parameters and whether they train;
    totals; optimizer, loss function, frozen parameter groups and callbacks."""
    module = learn.strategy.unwrap(learn.model)
    dl = learn.dls.train if learn.dls.train is not None and len(learn.dls.train) else learn.dls.valid
    if dl is None:
        raise ValueError("summary() runs one batch through the model: the Learner's DataLoaders hold no batch")
    xb = _inputs(learn, next(iter(dl)))
    shapes = _output_shapes(learn, module, xb)
    rows = [("Layer (type)", "Output Shape", "Param #", "Trainable")]
    for name, m in module.named_modules():
        if list(m.children()):
            continue
        params = list(m.parameters(recurse=False))
        trainable = "" if not params else str(all(p.requires_grad for p in params)) if len({p.requires_grad for p in params}) == 1 else "partly"
        rows.append((f"{type(m).__name__} ({name})" if name else type(m).__name__, shapes.get(m, "(not called)"),
                     f"{sum(p.numel() for p in params):,}", trainable))
    widths = [max(len(r[i]) for r in rows) + 2 for i in range(4)]
    rule = "=" * sum(widths)
    lines = [f"{type(module).__name__} (input: {_shape(xb)})", rule,
             "".join(c.ljust(w) for c, w in zip(rows[0], widths)).rstrip(), rule]
    lines += ["".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows[1:]]
    total = sum(p.numel() for p in module.parameters())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    groups = n_groups(learn.opt)
    frozen = (f"Model frozen up to parameter group #{learn.frozen_idx} (of {groups})" if learn.frozen_idx
              else f"Model unfrozen ({groups} parameter group{'s' if groups > 1 else ''})")
    lines += [rule, f"Total params: {total:,}", f"Total trainable params: {trainable:,}",
              f"Total non-trainable params: {total - trainable:,}", "",
              f"Optimizer used: {type(learn.opt).__name__}", f"Loss function: {learn.loss_func!r}", "", frozen, "",
              "Callbacks:", *(f"  - {type(cb).__name__}" for cb in learn.cbs)]
    return Summary("\n".join(lines))
