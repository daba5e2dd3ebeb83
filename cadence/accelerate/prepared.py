"""What `Accelerator.prepare` returns for loaders, optimizers and schedulers.

- `PreparedDataLoader`: this process's `DistributedDL` shard, batches on the device; while it is
  iterated the accelerator knows it (for `gather_for_metrics`) and whether this is the last batch. It has
  a DataLoader's attributes, with the values Accelerate's prepared loader gives (`sampler`, `batch_sampler`, ...).
- `PreparedOptimizer`: steps through the strategy (GradScaler included), and does nothing, `zero_grad`
  included, on accumulation micro-steps.
- `PreparedScheduler`: steps once per optimizer step really taken (none on micro-steps or on an
  fp16 step skipped for overflow).

>>> model, opt, dl, sched = accelerator.prepare(model, opt, dl, sched)
>>> for batch in dl:                              # dl.end_of_dataloader on the last batch
...     with accelerator.accumulate(model): ...   # opt.step() / sched.step() / opt.zero_grad() every batch
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Iterator

import torch
from torch.utils.data import BatchSampler, SequentialSampler

from ..distributed import sampling
from ..distributed.data import DistributedDL
from ..loader_settings import LOADER_SETTINGS
from .utils import synchronize_rng_states

__all__ = ["PreparedDataLoader", "BatchSamplerShard", "PreparedOptimizer", "PreparedScheduler", "EngineScheduler"]

# what Accelerate's prepared loader takes over from the loader given to `prepare`: the settings any rebuilt loader
# keeps, its generator and `in_order`
_LOADER_SETTINGS = (*LOADER_SETTINGS, "generator", "in_order")


class PreparedDataLoader:
    """A `DistributedDL` that tells the accelerator's `GradientState` when it is iterated and on its last batch.

    DataLoader attributes have Accelerate's values: a map-style loader is rebuilt around a batch sampler
    (`batch_sampler`: this process's `BatchSamplerShard` on several processes, the loader's own on one;
    `sampler` a SequentialSampler), a stream keeps its loader's; `collate_fn`, `num_workers`, `generator`, ...
    are the given loader's. `batch_size` (this process's) and `drop_last` stay the given loader's, where
    Accelerate's rebuilt loader says None and False (`GradientState.remainder` reads `drop_last`, and split_batches
    scripts read the per-process batch size). `end_of_dataloader` and `remainder` stay as the last iteration left them. `isinstance(dl, DataLoader)` is False: `prepare` and the Learner's callbacks would shard a
    DataLoader again. Everything else (`set_epoch`, `dataset`, `state_dict`) is the DistributedDL's.
    """

    def __init__(self, loader: DistributedDL, gradient_state: Any, rng_types: list[str] = ()):
        self.base, self.gradient_state = loader, gradient_state
        self.rng_types = list(rng_types)   # random states copied from the main process when an iteration starts
        self.end_of_dataloader = False
        self.remainder = -1   # Accelerate's: samples in the last step over all processes (-1: full, or unknown yet)
        self.resumed_at = 0   # the batch this pass started at (load_state / skip_first_batches moved it on)
        self._skipped = 0     # batches skip_first_batches left out of the next pass (its `len` leaves them out)
        self._before_backward: int | None = None   # batches a resumed pass yielded before its first backward

    def __len__(self) -> int:
        return max(len(self.base) - self._skipped, 0)

    def __getattr__(self, name: str) -> Any:
        if name == "base":  # not set yet (unpickling)
            raise AttributeError(name)
        if name in _LOADER_SETTINGS:
            return getattr(self.base.dl, name)
        return getattr(self.base, name)

    @property
    def _rebuilt(self) -> bool:
        """Whether Accelerate rebuilds this loader around a batch sampler (a map-style one; a stream keeps its own)."""
        return not self.base.iterable

    @property
    def sampler(self) -> Any:
        if not self._rebuilt:
            return self.base.dl.sampler
        if sampling.sampler_yields_batches(self.base.dl):
            return BatchSamplerShard(self.base) if self.base.world_size > 1 else self.base.dl.sampler
        return SequentialSampler(self.base.dl.dataset)

    @property
    def batch_sampler(self) -> Any:
        if not self._rebuilt:
            return self.base.dl.batch_sampler
        if sampling.sampler_yields_batches(self.base.dl):
            return None
        return BatchSamplerShard(self.base) if self.base.world_size > 1 else self.base.dl.batch_sampler

    @property
    def total_batch_size(self) -> int:
        """Samples per step over all processes (Accelerate's): the batch size given to the loader with
        `split_batches`, else that batch size times the number of processes.

        >>> accelerator.prepare(DataLoader(ds, batch_size=8)).total_batch_size     # 16 on 2 processes
        """
        size = self.base.batch_size or getattr(self.base.dl.batch_sampler, "batch_size", None)
        if size is None:
            raise ValueError("total_batch_size: this loader's batch sampler has no batch_size, so its batches have "
                             "no fixed size")
        return size * self.base.world_size   # with split_batches the loader holds the per-process share

    @property
    def total_dataset_length(self) -> int:
        """The length of the whole dataset, every process's part together (Accelerate's).

        >>> accelerator.prepare(DataLoader(range(10), batch_size=4)).total_dataset_length
        10
        """
        dataset = self.base.dataset
        return dataset.total_length if hasattr(dataset, "total_length") else len(dataset)

    def skip_batches(self, n: int) -> None:
        """Start the next iteration at batch `n` without loading the skipped items (past the end: an empty pass);
        until it starts, `len` counts the batches left, as the loader Accelerate's `skip_first_batches` returns."""
        top = len(self.base) if self._sized else n
        self.base.skip_batches(min(n, top))
        self._skipped = min(n, top)

    def __iter__(self) -> Iterator[Any]:
        if self.rng_types:
            synchronize_rng_states(self.rng_types)
        self.gradient_state._enter(self)
        self.resumed_at, self._skipped = self.base.start_batch, 0
        self._before_backward = 0 if self.resumed_at else None
        self.end_of_dataloader, self.remainder = False, self._remainder()
        try:
            for batch, last in self._flagged():
                self.end_of_dataloader = last
                if last and not self._sized:
                    self.remainder = self._last_step_samples()
                if self._before_backward is not None:
                    self._before_backward += 1
                yield batch
        finally:
            self.gradient_state._leave(self)

    def _remainder(self) -> int:
        """Accelerate's at an iteration's start: the samples of the last step, over all processes, when it is short
        (0 when full; -1 with drop_last or no fixed length)."""
        if self.base.dl.drop_last or not self._sized:
            return -1
        try:
            return self.total_dataset_length % self.total_batch_size
        except (TypeError, ValueError):
            return -1

    def _last_step_samples(self) -> int:
        """A stream without length, at its last batch: the real samples of that step over all processes."""
        masks = self.base.last_batch_masks(list(range(self.base.world_size)))
        return -1 if masks is None else int(sum(int(m.sum()) for m in masks))

    def take_skipped_before_backward(self) -> int:
        """At the first backward of a pass that started mid-epoch: how many of its batches went by untrained
        before it (a loop skipping the batches done itself, though the loader already continues); then 0."""
        n, self._before_backward = self._before_backward, None
        return max((n or 0) - 1, 0)

    @property
    def _sized(self) -> bool:
        return not self.base.iterable or self.base.sized

    def _flagged(self) -> Iterator[tuple[Any, bool]]:
        """Each batch with whether it is the last: counted from the length, or, for a stream without one,
        known by loading the next batch first (as Accelerate does)."""
        if self._sized:
            last = len(self.base) - 1
            for i, batch in enumerate(self.base, self.base.start_batch):
                yield batch, i == last
            return
        it = iter(self.base)
        current, record = next(it, _END), self.base.batch_record()
        while current is not _END:
            upcoming = next(it, _END)
            ahead = self.base.batch_record()
            # while `current` is used, the loader describes it (for gather_for_metrics, state_dict), not the next one
            self.base.restore_batch_record(record)
            yield current, upcoming is _END
            current, record = upcoming, ahead
        self.base.restore_batch_record(record)   # the pass is over: the epoch is complete

    def __repr__(self) -> str:
        size = f"{len(self)} batches" if self._sized else "a stream without length"
        return f"PreparedDataLoader({size}, rank {self.base.rank} of {self.base.world_size})"


_END = object()


class BatchSamplerShard(BatchSampler):
    """Accelerate's `dl.batch_sampler` on several processes: this process's batches of the given batch sampler.

    `batch_sampler` is the loader's own; `num_processes`, `process_index`, `batch_size`, `drop_last`, `total_length`
    (batches of the whole epoch) and `len` (this process's) as Accelerate's. Iterating gives the dataset indices of
    this process's batches in the current epoch, as planned (a loader that draws like a plain one draws an epoch
    when it is iterated).
    """

    def __init__(self, loader: DistributedDL):  # no super().__init__: a view
        self.loader = loader
        self.batch_sampler = loader.dl.sampler if sampling.sampler_yields_batches(loader.dl) else loader.dl.batch_sampler
        self.num_processes, self.process_index = loader.world_size, loader.rank
        self.split_batches, self.even_batches = False, True
        self.batch_size = getattr(self.batch_sampler, "batch_size", None)
        self.drop_last = getattr(self.batch_sampler, "drop_last", False)

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[list[int]]:
        idxs, lens = self.loader.get_idxs(), self.loader.plan.lens[self.loader.rank]
        starts = self.loader.plan.starts[self.loader.rank]
        return iter([idxs[s:s + n] for s, n in zip(starts, lens)])


class PreparedOptimizer(torch.optim.Optimizer):
    """The user's optimizer, stepped by the strategy; `step` and `zero_grad` wait for the end of an accumulation window.

    `step_was_skipped` is True after a step the fp16 GradScaler skipped (inf/NaN gradients).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, accelerator: Any):  # no super().__init__: a view
        self.optimizer, self.accelerator = optimizer, accelerator
        self.step_was_skipped = False
        self.stepped_early = False   # `clip_grad_norm_` took this window's step (an engine that clips in its step)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict; under DeepSpeed, as Accelerate, its engine's optimizer's (this rank's ZeRO
        partitions, which `load_state_dict` reads back on the same number of processes)."""
        return self._stepped().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Load what `state_dict` gave (under DeepSpeed this rank's partitions: ZeRO's loader takes one per rank)."""
        stepped = self._stepped()
        if isinstance(state_dict, dict) and "state_dict_list" in inspect.signature(stepped.load_state_dict).parameters:
            state_dict = [state_dict] * self.accelerator.num_processes   # each rank reads its own entry: its own
        stepped.load_state_dict(state_dict)

    def _stepped(self) -> Any:
        """What steps this optimizer: a DeepSpeed engine's optimizer wrapping it (ZeRO rewires its parameter groups
        to flat partitions, which its own torch `state_dict` cannot number), else the optimizer itself."""
        wrapper = getattr(getattr(self.accelerator.strategy, "engine", None), "optimizer", None)
        return wrapper if getattr(wrapper, "optimizer", None) is self.optimizer else self.optimizer

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.accelerator.sync_gradients:
            if _takes_set_to_none(self.optimizer.zero_grad):
                self.optimizer.zero_grad(set_to_none=set_to_none)
            else:  # DeepSpeed's fused optimizers (a config's optimizer) have none
                self.optimizer.zero_grad()
            self.accelerator.strategy.end_of_step()

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("a prepared optimizer steps through the strategy and takes no closure; "
                             "compute the loss and call accelerator.backward(loss) before optimizer.step()")
        if self.stepped_early:
            self.stepped_early = False
        elif self.accelerator.sync_gradients:
            self.step_was_skipped = not self.accelerator.strategy.step(self.optimizer)

    def step_now(self) -> None:
        """Take this window's step now; the next `step()` call is then a no-op (see `accelerate.clipping`)."""
        self.step_was_skipped = not self.accelerator.strategy.step(self.optimizer)
        self.stepped_early = True

    def train(self) -> None:
        """The optimizer's own `train()` (schedule-free optimizers switch their weights for training)."""
        self._call("train")

    def eval(self) -> None:
        """The optimizer's own `eval()` (schedule-free optimizers switch to their averaged weights)."""
        self._call("eval")

    def _call(self, name: str) -> None:
        """The optimizer's mode switch; an engine that keeps its own master weights (DeepSpeed) switches those and
        copies them into the model. An optimizer without modes has nothing to switch."""
        through_engine = getattr(self.accelerator.strategy, "call_optimizer", None)
        if through_engine is not None:
            through_engine(name)
        elif callable(getattr(self.optimizer, name, None)):
            getattr(self.optimizer, name)()

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"


@functools.lru_cache(maxsize=None)
def _takes_set_to_none_of(zero_grad: Any) -> bool:
    parameters = inspect.signature(zero_grad).parameters
    return "set_to_none" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _takes_set_to_none(zero_grad: Any) -> bool:
    """Whether an optimizer's `zero_grad` takes `set_to_none` (looked up once per optimizer class)."""
    return _takes_set_to_none_of(getattr(zero_grad, "__func__", zero_grad))


class PreparedScheduler:
    """The user's LR scheduler, stepped with the optimizer steps really taken, as Accelerate steps it.

    A schedule sized from the whole loader before `prepare` (Accelerate's idiom:
    `num_training_steps=len(train_dl) * epochs`) ends with the training on any number of
    processes: each optimizer step moves it `num_processes` times (once with `split_batches`,
    where the loader's batch is already the global one); a OneCycle schedule stops at its
    `total_steps`. Accumulating micro-steps and steps skipped for an fp16 overflow do not move it.
    With `step_with_optimizer=False` every `step()` call steps it once (a schedule per epoch, say).

    >>> sched = accelerator.prepare(OneCycleLR(opt, 1e-3, total_steps=epochs * len(train_dl)))
    """

    def __init__(self, scheduler: Any, optimizers: list[PreparedOptimizer], accelerator: Any,
                 step_with_optimizer: bool = True):
        self.scheduler, self.optimizers, self.accelerator = scheduler, optimizers, accelerator
        self.step_with_optimizer = step_with_optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.accelerator.sync_gradients or any(opt.step_was_skipped for opt in self.optimizers):
            return
        total = getattr(self.scheduler, "total_steps", None)
        for _ in range(1 if self.accelerator.split_batches else self.accelerator.num_processes):
            if total is not None and self.scheduler.last_epoch >= total:
                return                                  # OneCycleLR refuses to step past its end
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)


class EngineScheduler:
    """A `DummyScheduler` prepared: the DeepSpeed engine steps the schedule with its optimizer, so `step` does
    nothing (Accelerate's DeepSpeedSchedulerWrapper); the rates are the engine's.

    >>> sched = accelerator.prepare(DummyScheduler(opt, total_num_steps=1000, warmup_num_steps=100))
    >>> sched.get_last_lr()
    """

    def __init__(self, engine: Any):
        self.engine = engine

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: the engine stepped the schedule at its optimizer step."""

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.engine.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        scheduler = self.engine.lr_scheduler
        return scheduler.state_dict() if scheduler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.engine.lr_scheduler is not None:
            self.engine.lr_scheduler.load_state_dict(state_dict)
