"""The order of a prepared loader's batches: Accelerate's, so a script seeded the same way sees the same batches.

Accelerate 1.15 (its default `DataLoaderConfiguration`) on
- one process: leaves the loader as it is; each epoch is drawn by the loader itself (from torch's
  global RNG unless the sampler has a generator). cadence draws it the same way, at the same moment.
- several processes: gives a shuffling sampler without a generator one, seeded from torch's global
  RNG at `prepare` (every rank then uses rank 0's state), and deals the loader's batches to the ranks
  in turn, the last step completed from the start of the epoch (`sharding.strided`).
- `use_seedable_sampler=True`: each epoch's permutation is seeded with `data_seed` (else torch's
  initial seed, the one `set_seed` set) plus the epoch; the batches are dealt the same way, and the loader's
  iterator draws its base seed from torch's RNG at an epoch's first batch, as Accelerate's does.

A stream (IterableDataset) is split as Accelerate splits it: steps of `batch_size` x processes consecutive items,
each process taking its slice, a short last step completed from the stream's start (by default as its
DataLoaderDispatcher does, with `dispatch_batches=False` as its IterableDatasetShard), so `gather_for_metrics`
gives the items in the stream's order. A custom batch sampler, a stream with `batch_size=None`, a sampler without
its own generator on several processes and `data_seed` without `use_seedable_sampler` keep cadence's order
(`DistributedDL`).

>>> set_seed(42); model, opt, dl = accelerator.prepare(model, opt, DataLoader(ds, batch_size=8, shuffle=True))
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from ..distributed import sampling
from ..distributed.data import DistributedDL
from ..distributed.ops import broadcast

__all__ = ["shard_loader"]


def shard_loader(dl: DataLoader, strategy: Any, config: Any) -> DistributedDL:
    """This process's part of `dl` as the strategy cuts the data (its rank and number of data-parallel ranks),
    in Accelerate's order where Accelerate's rule applies (see the module docstring)."""
    if isinstance(dl.dataset, IterableDataset) and dl.batch_size is not None:
        return _split_stream(dl, strategy, config)
    with sampling.replayed(dl, sampling.capture(dl)):   # the strategy's own seed draw leaves no trace in the RNGs
        sharded = strategy.shard(dl)
    if not isinstance(sharded, DistributedDL):           # one device: a one-process shard
        sharded = DistributedDL(dl, rank=0, world_size=1)
    where = {"rank": sharded.rank, "world_size": sharded.world_size, "group": sharded.group}
    if sharded.iterable or sharded.kind == "batch_sampler":
        return _seeded(sharded, config.data_seed)
    where["layout"] = "strided" if sharded.world_size > 1 else "contiguous"
    if config.use_seedable_sampler and sharded.kind == "shuffle":
        seed = config.data_seed if config.data_seed is not None else torch.initial_seed()
        return DistributedDL(dl, seed=seed, loader_base_seed=True, **where)
    if config.data_seed is not None:
        return _seeded(sharded, config.data_seed)
    if sharded.world_size > 1 and sharded.kind != "sequential":
        sampler = dl.sampler
        if not hasattr(sampler, "generator"):
            return sharded
        if sampler.generator is None:
            sampler.generator = torch.Generator().manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
        sampler.generator.set_state(broadcast({"state": sampler.generator.get_state()})["state"])
    return DistributedDL(dl, draw_like_loader=True, read_ahead=1, **where)   # Accelerate's loader reads one ahead


def _split_stream(dl: DataLoader, strategy: Any, config: Any) -> DistributedDL:
    """A stream with a batch size split over the strategy's data-parallel ranks (those its `shard` cuts the data for)
    as Accelerate's DataLoaderDispatcher splits it, or with `dispatch_batches=False` on several processes as its
    IterableDatasetShard (a short last step completed to a whole one)."""
    world_size = strategy.dp_size
    layout = "strided" if config.dispatch_batches is False and world_size > 1 else "dispatched"
    return DistributedDL(dl, rank=strategy.dp_rank, world_size=world_size, layout=layout)


def _seeded(sharded: DistributedDL, seed: int | None) -> DistributedDL:
    if seed is not None:
        sharded.seed = seed
    return sharded
