"""The Learner's optimizer: built from `opt_func` over the splitter's groups, one learning rate per group.

Mixed into `Learner`. `wd_bn_bias=False` (fastai's default) puts normalisation and bias parameters in groups
of their own that never decay; a `slice` of rates spreads them geometrically over the groups.

>>> learn.opt_func = partial(torch.optim.SGD, momentum=0.9); learn.create_opt()
>>> learn.fit(1, lr=slice(1e-5, 1e-3))      # one rate per splitter group
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from .schedule import GROUP_KEY, NO_WD_KEY, n_groups, set_hyper
from .transfer import norm_bias_params


class OptimizerMethods:
    """Mixed into `Learner`: `create_opt` and the learning rates per parameter group."""

    def create_opt(self) -> torch.optim.Optimizer:
        """(Re)build `learn.opt` from `opt_func` over the current model (parameter groups from `splitter`).

        Under `distrib_ctx` the engine builds it over the parameters it holds (`Strategy.new_optimizer`); an engine
        that steps an optimizer of its own (DeepSpeed) refuses: call it before `distrib_ctx`.

        >>> learn.opt_func = partial(torch.optim.SGD, momentum=0.9); learn.create_opt()
        """
        self.opt = self.strategy.new_optimizer(self.model, self._make_opt)
        return self.opt

    def _make_opt(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer over `model`'s parameters: what a strategy calls once it has wrapped the model."""
        groups = [list(g) for g in self.splitter(model)] if self.splitter else [list(model.parameters())]
        if self.wd_bn_bias:
            params = [{"params": g} for g in groups] if self.splitter else groups[0]
        else:  # fastai's default: normalisation and bias parameters in groups of their own, never decayed
            params = _without_wd_on_norm_bias(groups, norm_bias_params(model))
        opt = self.opt_func(params, lr=float(self._group_lrs(self.lr, len(groups))[-1]))
        self._opt_built_with = self.opt_func
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"opt_func must return a torch.optim.Optimizer, got {type(opt).__name__}; "
                            f"use e.g. opt_func=torch.optim.AdamW or functools.partial(torch.optim.SGD, momentum=0.9)")
        set_hyper(opt, "lr", self._group_lrs(self.lr, n_groups(opt)))
        if self.wd is not None:
            set_hyper(opt, "wd", self.wd)
        return opt

    @staticmethod
    def _group_lrs(lr: float | slice | list, n_groups: int) -> np.ndarray:
        """One learning rate per parameter group: a float for all, a slice spread geometrically, or a list."""
        _check_lr(lr)
        if isinstance(lr, slice):
            if lr.start is None:
                return np.array([lr.stop / 10] * (n_groups - 1) + [lr.stop], dtype=float)
            return np.geomspace(lr.start, lr.stop, n_groups) if n_groups > 1 else np.array([lr.stop], dtype=float)
        lrs = np.broadcast_to(np.asarray(lr, dtype=float), (n_groups,)) if np.ndim(lr) == 0 else np.asarray(lr, float)
        if lrs.shape != (n_groups,):
            raise ValueError(f"got {len(lrs)} learning rates for {n_groups} parameter groups")
        return lrs


def _without_wd_on_norm_bias(groups: list[list[nn.Parameter]], no_wd: set[int]) -> list[dict]:
    """Each splitter group as up to two optimizer groups tagged with its index: the rest, then `no_wd`'s
    parameters with weight decay 0 (which `set_hyper(opt, "wd", ...)` leaves alone)."""
    out = []
    for i, group in enumerate(groups):
        decayed, kept = [p for p in group if id(p) not in no_wd], [p for p in group if id(p) in no_wd]
        if decayed:
            out.append({"params": decayed, GROUP_KEY: i})
        if kept:
            out.append({"params": kept, GROUP_KEY: i, NO_WD_KEY: True, "weight_decay": 0.0})
    return out


def check_opt_func(opt_func: Any) -> None:
    if callable(opt_func):
        return
    match = [n for n in dir(torch.optim) if isinstance(opt_func, str) and n.lower() == opt_func.lower()]
    hint = f"opt_func=torch.optim.{match[0]}" if match else "opt_func=torch.optim.AdamW"
    raise TypeError(f"opt_func must be a function or class that builds the optimizer, got {opt_func!r}: pass e.g. "
                    f"{hint}, or functools.partial(torch.optim.SGD, momentum=0.9)")


def _check_lr(lr: Any) -> None:
    """ValueError naming `lr` unless it is a number >= 0, a slice of them, or a list of them."""
    def is_rate(x: Any) -> bool:
        return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) and x >= 0

    if isinstance(lr, slice):
        ok = is_rate(lr.stop) and (lr.start is None or is_rate(lr.start)) and lr.step is None
    elif isinstance(lr, (list, tuple, np.ndarray)):
        ok = len(lr) > 0 and all(is_rate(x) for x in np.asarray(lr, dtype=object).ravel())
    else:
        ok = is_rate(lr)
    if ok:
        return
    hint = "learn.lr_find() suggests one"
    if isinstance(lr, str):
        try:
            hint = f"the number {float(lr)!r}, not a string" if math.isfinite(float(lr)) else hint
        except ValueError:
            pass
    raise ValueError(f"the learning rate must be a finite number >= 0, slice(start, stop) for discriminative rates "
                     f"or a list of rates, got {lr!r}; pass e.g. lr=1e-3 ({hint})")


def default_lr(opt_func: Callable, otherwise: float | None = 1e-3) -> float | None:
    """An lr bound in `opt_func=partial(Adam, lr=...)` is the Learner's default (as in fastai); else `otherwise`."""
    if isinstance(opt_func, functools.partial) and "lr" in opt_func.keywords:
        return opt_func.keywords["lr"]
    return otherwise
