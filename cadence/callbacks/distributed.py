"""The bridge from the Learner to cadence.distributed: `distrib_ctx`, `to_distributed`, `DistributedTrainer`.

Entering distribution swaps the learner's loaders for `DistributedDL` shards, wraps the model
and optimizer with the strategy, and makes the strategy run backward and step. Validation
drops the samples DistributedDL added as padding, so loss and metrics count each sample once;
the Recorder combines them over processes. Leaving restores the loaders, the user's module and
the single-device strategy, and destroys the process group only if it was created here.

>>> with learn.distrib_ctx():        # DDP over however many processes were launched
...     learn.fit_one_cycle(3, 1e-2)
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader

from ..compile import uncompile
from ..distributed.data import DistributedDL
from ..distributed.env import world_size
from ..distributed.ops import map_tensors
from ..distributed.registry import get_strategy, strategy_class
from ..distributed.strategy import ConfiguredAtFit
from ..trainer.callback import Callback, Order
from ..trainer.gather import GatherPreds
from .accumulate import GradAccum
from .precision import MixedPrecision


class DistributedTrainer(Callback):
    """Keeps a distributed fit honest: shards any other loader validated on, drops padding from metrics.

    >>> with learn.distrib_ctx():   # distrib_ctx adds it; one process here
    ...     print(any(isinstance(cb, DistributedTrainer) for cb in learn.cbs))
    True
    """

    order = Order.DISTRIBUTED

    def __init__(self, strategy: Any, old_strategy: Any, old_loaders: tuple, launcher_cbs: list):
        self.strategy, self.old_strategy, self.old_loaders = strategy, old_strategy, old_loaders
        self.launcher_cbs = launcher_cbs  # added from `cadence launch` settings; removed on detach
        self._shards: dict[int, DistributedDL] = {}
        self._fit_configured = False
        self._padding_only: torch.Tensor | None = None  # the batch is padding alone: its rows go after the loss
        if strategy.loss_context() is not None:  # entered by the loop around pred + loss; absent, it costs nothing
            self.forward_context = strategy.loss_context

    def before_fit(self):
        self._fit_configured = False

    def before_train(self):
        """Once per fit, after every callback's before_fit: an engine that needs the fit's facts gets them."""
        learn = self.learn
        if isinstance(self.strategy, ConfiguredAtFit) and not self._fit_configured:
            self.strategy.configure_fit(micro_batch_size=getattr(learn.dls.train, "batch_size", None),
                                        total_steps=learn.n_epoch * learn.steps_per_epoch)
            self._fit_configured = True

    def before_validate(self):
        """`validate(dl)` / `get_preds(dl)` on a plain loader: iterate this rank's shard of it."""
        dl = self.learn.dl
        if isinstance(dl, DataLoader):
            if id(dl) not in self._shards:
                self._shards[id(dl)] = self.strategy.shard(dl)
            self.learn.dl = self._shards[id(dl)]

    def before_batch(self):
        """In validation, run the model on the batch's real samples only (DistributedDL pads the last shard).

        Dropped before the forward, so every rank runs the model once per batch: under FSDP and ZeRO-3 a forward is
        a collective (it gathers the parameters), and a model computing its own loss gets its real samples. A batch
        of padding alone (a validation set smaller than the number of processes) runs whole and keeps zero rows
        after its loss (`after_loss`)."""
        learn = self.learn
        self._padding_only = None
        dl = learn.dl
        if learn.training or not isinstance(dl, DistributedDL) or dl.last_batch is None:
            return
        keep = dl.real_mask(dl.rank, *dl.last_batch)
        if bool(keep.all()):
            return
        if not bool(keep.any()):
            self._padding_only = keep
            return
        real = _rows(keep, learn)
        learn.xb, learn.yb = map_tensors(real, learn.xb), map_tensors(real, learn.yb)  # tuples or dicts of tensors

    def after_loss(self):
        """A batch of padding alone keeps zero rows and a loss of 0 that weighs nothing: every rank still counts a
        batch, so every rank combines its metrics."""
        keep, learn = self._padding_only, self.learn
        if keep is None or learn.training:
            return
        real = _rows(keep, learn)
        learn.xb, learn.yb, learn.pred = (map_tensors(real, t) for t in (learn.xb, learn.yb, learn.pred))
        learn.loss = None if learn.loss is None else torch.zeros_like(learn.loss.detach())


def _rows(keep: torch.Tensor, learn: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """A tensor's rows that `keep` marks, along the batch dimension (`get_preds(concat_dim=)`'s where a tensor has
    it there: inputs may be batch-first when outputs are sequence-first)."""
    dim = next((cb.concat_dim for cb in learn.cbs if isinstance(cb, GatherPreds)), 0)

    def real(t: torch.Tensor) -> torch.Tensor:
        at = dim if t.dim() > dim and t.shape[dim] == len(keep) else 0
        return t[(slice(None),) * at + (keep.to(t.device),)]
    return real


def _shard(strategy: Any, dl: Any) -> Any:
    return strategy.shard(dl) if isinstance(dl, DataLoader) else dl


def _precision(cbs: list, device: torch.device) -> Any:
    """The precision plugin a MixedPrecision callback asks for (engines that fix it at wrap time need it now)."""
    mixed = [cb for cb in cbs if isinstance(cb, MixedPrecision)]
    return mixed[0].plugin_for(device) if mixed else None


def _transfer_optimizer_state(learn: Any, old_opt: torch.optim.Optimizer, strategy: Any) -> None:
    """Carry what the optimizer learned before distribution (a loaded checkpoint) into the new one."""
    if old_opt is not learn.opt and old_opt.state:
        strategy.load_optimizer_state_dict(learn.model, learn.opt, old_opt.state_dict())


def _recompile(learn: Any) -> None:
    """Compile the user's module again inside the new wrapper (a graph traced outside DDP lacks DDP's bucket splits)."""
    if learn.compile_options is not None:
        learn.compile(**learn.compile_options)


def to_distributed(learn: Any, strategy: Any = None, sync_bn: bool = True, **strategy_kwargs) -> Any:
    """Set `learn` up for distributed training (see `Learner.to_distributed`)."""
    if any(isinstance(cb, DistributedTrainer) for cb in learn.cbs):
        raise ValueError("this Learner is already distributed; call learn.detach_distributed() first")
    strategy = get_strategy(strategy, **_with_sync_bn(strategy, sync_bn, strategy_kwargs))
    strategy.setup_environment()
    bridge = DistributedTrainer(strategy, learn.strategy, (learn.dls.train, learn.dls.valid), _launcher_cbs(learn))
    model, old_opt = uncompile(learn.strategy.unwrap(learn.model)), learn.opt  # engines copy it (FSDP's skeleton)
    precision = _precision([*learn.cbs, *bridge.launcher_cbs], strategy.device)
    try:
        learn.model, learn.opt = strategy.setup(model, learn._make_opt, precision)
    except BaseException:   # refused (a config that contradicts the Learner): the process as it was, no group left
        strategy.teardown()
        raise
    _transfer_optimizer_state(learn, old_opt, strategy)
    learn.dls.train, learn.dls.valid = _shard(strategy, learn.dls.train), _shard(strategy, learn.dls.valid)
    learn.strategy = strategy
    _recompile(learn)
    learn.add_cbs([bridge, *bridge.launcher_cbs])
    return learn


def _with_sync_bn(strategy: Any, sync_bn: bool, kwargs: dict) -> dict:
    """fastai's `distrib_ctx(sync_bn=True)` is DDP's option: pass it only to an engine that takes it, and only with
    several processes (on one there is nothing to synchronise: BatchNorm stays, without a warning)."""
    cls = strategy_class(strategy)
    if cls is not None and "sync_bn" in inspect.signature(cls).parameters:
        return {"sync_bn": sync_bn and world_size() > 1, **kwargs}
    return kwargs


def _launcher_cbs(learn: Any) -> list[Callback]:
    """Callbacks for `cadence launch --mixed_precision / --gradient_accumulation_steps`, unless the script has its own."""
    cbs: list[Callback] = []
    precision = os.environ.get("CADENCE_MIXED_PRECISION", "no")
    if precision != "no" and not any(isinstance(cb, MixedPrecision) for cb in learn.cbs):
        cbs.append(MixedPrecision(precision))
    steps = int(os.environ.get("CADENCE_GRADIENT_ACCUMULATION_STEPS", "1"))
    if steps > 1 and not any(isinstance(cb, GradAccum) for cb in learn.cbs):
        cbs.append(GradAccum(steps=steps))
    return cbs


def detach_distributed(learn: Any, gather: bool = True) -> Any:
    """Undo `to_distributed`: original loaders, the user's module and an optimizer over it, single-device strategy.

    `gather=False` (a block that failed on several processes): the user's module as the engine left it, its
    weights not gathered, since a gather is a collective and the other processes may be anywhere else."""
    bridges = [cb for cb in learn.cbs if isinstance(cb, DistributedTrainer)]
    if not bridges:
        return learn
    bridge = bridges[0]
    learn.remove_cbs([bridge, *bridge.launcher_cbs])
    learn.sync_gradients = True
    if gather:
        learn.model, learn.opt = bridge.strategy.release(learn.model, learn.opt, learn._make_opt)
    else:
        learn.model = bridge.strategy.unwrap(learn.model)
    learn.dls.train, learn.dls.valid = (_handed_back(old, now) for old, now in
                                        zip(bridge.old_loaders, (learn.dls.train, learn.dls.valid)))
    learn.strategy = bridge.old_strategy
    _recompile(learn)
    bridge.strategy.teardown()
    return learn


def _handed_back(old: Any, now: Any) -> Any:
    """The loader `detach_distributed` gives back for `old`: `old`, or the loader a `bs` set inside the block
    (`learn.dls.train.bs = 8`) rebuilt it into, as fastai's `dls.train` keeps a new batch size after the block."""
    rebuilt = (now._next_dl or now.dl) if isinstance(now, DistributedDL) else None
    return old if rebuilt is None else rebuilt


@contextlib.contextmanager
def distrib_ctx(learn: Any, sync_bn: bool = True, in_notebook: bool = False, strategy: Any = None,
                **strategy_kwargs) -> Iterator[Any]:
    """Context manager form of `to_distributed` / `detach_distributed` (see `Learner.distrib_ctx`)."""
    to_distributed(learn, strategy=strategy, sync_bn=sync_bn, **strategy_kwargs)
    try:
        yield learn
    except BaseException:
        # on several processes the others may be in another collective (a rank that refused its checkpoint file
        # while the rest load theirs): gathering the weights would wait for them until the collective timeout
        detach_distributed(learn, gather=world_size() == 1)
        raise
    detach_distributed(learn)


__all__ = ["DistributedTrainer", "distrib_ctx", "to_distributed", "detach_distributed"]
