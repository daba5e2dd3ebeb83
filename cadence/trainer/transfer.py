"""Transfer learning: `freeze_to` / `freeze` / `unfreeze` over the parameter groups, `fine_tune`, `BnFreeze`.

The groups are the optimizer's parameter groups, which the Learner's `splitter` made (one group
without a splitter). Freezing sets `requires_grad=False` on the groups' parameters; torch's
optimizers skip a parameter without a gradient, and the strategy is told (`trainable_changed`)
because DDP fixes at wrap time which parameters it all-reduces. As fastai's, every freeze/unfreeze starts the
optimizer's state afresh (Adam's moments and step counts), and the normalisation layers of frozen groups (BatchNorm,
InstanceNorm, LayerNorm: fastai's `norm_types`) keep training (`train_bn=True`): their parameters stay trainable and
BatchNorm's running statistics keep updating, unless `BnFreeze` puts them in eval mode.

>>> learn = Learner(dls, model, loss_func=F.cross_entropy, splitter=lambda m: [m[:-1].parameters(), m[-1].parameters()])
>>> learn.fine_tune(3, base_lr=2e-3)          # 1 epoch with the body frozen, then 3 with everything
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Self

import torch
from torch import nn

from .callback import Callback, Order
from .callback_methods import listify
from .schedule import n_groups, param_groups

_BN_TYPES = (nn.modules.batchnorm._BatchNorm,)
_TRAIN_BN_TYPES = (*_BN_TYPES, nn.modules.instancenorm._InstanceNorm, nn.LayerNorm)  # fastai's norm_types


_NORM_TYPES = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm, nn.LayerNorm, nn.GroupNorm,
               nn.RMSNorm)


def norm_bias_params(model: nn.Module) -> set[int]:
    """ids of the parameters fastai keeps from weight decay (`wd_bn_bias=False`): those of normalisation layers
    (torch's, and any module class named ...Norm, such as Hugging Face's LlamaRMSNorm) and every bias."""
    out = set()
    for m in model.modules():
        norm = isinstance(m, _NORM_TYPES) or type(m).__name__.endswith("Norm")
        out.update(id(p) for name, p in m.named_parameters(recurse=False) if norm or name == "bias")
    return out


def _train_bn_params(model: nn.Module) -> set[int]:
    """ids of the parameters `train_bn` keeps training in frozen groups: those of fastai's `norm_types` layers."""
    return {id(p) for m in model.modules() if isinstance(m, _TRAIN_BN_TYPES) for p in m.parameters(recurse=False)}


def _clear_state(opt: Any) -> None:
    """fastai's `opt.clear_state()`: a torch optimizer's per-parameter state (moments, step counts) dropped, made
    afresh at its next step. An engine's own optimizer (DeepSpeed's, which keeps its state in flat partitions) keeps
    it."""
    if isinstance(opt, torch.optim.Optimizer):
        opt.state.clear()


class TransferMethods:
    """Mixed into `Learner`: freezing parameter groups and fastai's `fine_tune`."""

    train_bn: bool = True   # Learner(train_bn=...)
    frozen_idx: int = 0

    def freeze_to(self, n: int) -> Self:
        """Freeze the first `n` parameter groups (all but the last `-n` when negative); train the rest.

        >>> learn.freeze_to(-2)      # train the last two groups
        """
        groups = param_groups(self.opt)
        idx = (n if n >= 0 else len(groups) + n) if isinstance(n, int) else -1
        if not 0 <= idx < len(groups):
            raise ValueError(f"freeze_to({n!r}): the optimizer has {len(groups)} parameter group(s), so n must be "
                             f"an int in [{-len(groups)}, {len(groups) - 1}] (at least one group keeps training); "
                             f"pass Learner(splitter=...) to split the model into groups")
        keep = _train_bn_params(self.model) if self.train_bn else set()
        for i, parts in enumerate(groups):
            for p in (p for group in parts for p in group["params"]):
                p.requires_grad_(i >= idx or id(p) in keep)
        self.frozen_idx = idx
        self.strategy.wait_for_staging()  # a save's copy of the weights in progress: DDP's rewrap broadcasts them
        _clear_state(self.opt)
        self.model, self.opt = self.strategy.trainable_changed(self.model, self.opt)
        return self

    def freeze(self) -> Self:
        """Train only the last parameter group (and normalisation layers, unless `learn.train_bn = False`).

        >>> learn.freeze(); learn.fit_one_cycle(1, 1e-2)
        """
        if n_groups(self.opt) == 1 and self.strategy.is_main:   # once per run, not once per process
            warnings.warn("freeze(): the model has one parameter group, so nothing is frozen; pass "
                          "Learner(splitter=...) to split it into body and head", stacklevel=2)
        return self.freeze_to(-1)

    def unfreeze(self) -> Self:
        """Train every parameter group."""
        return self.freeze_to(0)

    def fine_tune(self, epochs: int, base_lr: float = 2e-3, freeze_epochs: int = 1, lr_mult: float = 100,
                  pct_start: float = 0.3, div: float = 5.0, resume: str | Path | None = None, **kwargs: Any) -> None:
        """fastai's transfer-learning recipe: `freeze_epochs` one-cycle epochs with only the head training, then
        `epochs` with everything, at rates from `base_lr / 2 / lr_mult` (first group) to `base_lr / 2` (last).

        Other keyword arguments (wd, moms, cbs, div_final) go to both `fit_one_cycle` calls. `resume` (with a
        Checkpoint, as in `fit`) continues the part the checkpoint was taken in: one of the unfrozen part skips the
        frozen one, and after a resumed frozen part the unfrozen one starts afresh.

        >>> learn.fine_tune(3, base_lr=1e-3)
        >>> learn.fine_tune(3, cbs=Checkpoint(every_epoch=True), resume="auto")   # the same line after a kill
        """
        if not isinstance(epochs, int) or epochs < 1 or not isinstance(freeze_epochs, int) or freeze_epochs < 0:
            raise ValueError(f"fine_tune needs epochs >= 1 and freeze_epochs >= 0 (ints), got {epochs!r} and "
                             f"{freeze_epochs!r}")
        cbs = [cb() if isinstance(cb, type) else cb for cb in listify(kwargs.pop("cbs", None))]  # one per recipe
        if freeze_epochs and (resume is None or self._resumed_stage(resume, cbs) != UNFROZEN):
            self.freeze()
            self.fit_one_cycle(freeze_epochs, slice(base_lr), pct_start=0.99, cbs=[*cbs, FitStage(FROZEN)],
                               resume=resume, **kwargs)
            resume = None
        base_lr /= 2
        self.unfreeze()
        self.fit_one_cycle(epochs, slice(base_lr / lr_mult, base_lr), pct_start=pct_start, div=div,
                           cbs=[*cbs, FitStage(UNFROZEN)], resume=resume, **kwargs)

    def _resumed_stage(self, resume: str | Path, cbs: list) -> str | None:
        """The fine_tune part (FROZEN, UNFROZEN) of the checkpoint `resume` names; None when there is none."""
        with self.added_cbs(cbs):  # a Checkpoint given in cbs reads its directory relative to learn.path
            checkpoints = [cb for cb in self.cbs if callable(getattr(cb, "peek", None))]
            state = checkpoints[0].peek(resume) if checkpoints else None
        return None if state is None else state["callbacks"].get("fit_stage", {}).get("stage")


FROZEN, UNFROZEN = "fine_tune frozen", "fine_tune unfrozen"


class FitStage(Callback):
    """Names which part of a recipe of several fits this fit is (fine_tune's frozen and unfrozen parts).

    A checkpoint keeps the name, so a resume knows which part to continue.

    >>> learn.fit_one_cycle(1, cbs=[Checkpoint(), FitStage("warm-up")])
    Checkpoint: step-00000004 written: ...
    >>> import json; json.loads(open("checkpoints/step-00000004/state.json").read())["callbacks"]["fit_stage"]
    {'stage': 'warm-up'}
    """

    def __init__(self, stage: str):
        self.stage = stage

    def state_dict(self) -> dict[str, str]:
        return {"stage": self.stage}

    def load_state_dict(self, state: dict[str, str]) -> None:
        """The stage is this fit's own, whatever the checkpoint's."""


class BnFreeze(Callback):
    """Keep the running statistics of frozen BatchNorm layers fixed: they stay in eval mode while training.

    A BatchNorm layer is frozen when its parameters do not require gradients, i.e. after
    `learn.train_bn = False; learn.freeze()`.

    >>> learn.train_bn = False; learn.freeze(); learn.fit(1, cbs=BnFreeze())
    """

    order = Order.DEFAULT

    def before_train(self):
        for m in self.learn.model.modules():
            params = list(m.parameters(recurse=False)) if isinstance(m, _BN_TYPES) else []
            if params and not any(p.requires_grad for p in params):
                m.eval()
