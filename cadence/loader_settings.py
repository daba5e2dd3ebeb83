"""A torch DataLoader rebuilt around the same data: the settings it keeps, and one with another batch size.

Shared by `trainer/` (fastai's `dls.train.bs = 8`) and `distributed/` (DistributedDL's rebuilt loader), which may
not import each other.

>>> DataLoader(dl.dataset, batch_sampler=planned, **loader_settings(dl))   # workers, collation, pinning kept
>>> rebatched(DataLoader(range(10), batch_size=4, shuffle=True), 3).batch_size
3
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import BatchSampler, DataLoader, IterableDataset

__all__ = ["LOADER_SETTINGS", "loader_settings", "rebatched"]

# the DataLoader settings a rebuilt loader keeps (its sampling, batching and generator are the rebuilder's)
LOADER_SETTINGS = ("collate_fn", "num_workers", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
                   "persistent_workers", "pin_memory_device", "prefetch_factor")


def loader_settings(dl: DataLoader) -> dict[str, Any]:
    """The settings of `dl` a rebuilt loader keeps: workers, collation, memory pinning (its batching is the rebuilder's).

    >>> DataLoader(dl.dataset, batch_size=8, sampler=dl.sampler, **loader_settings(dl))
    """
    kw = {name: getattr(dl, name) for name in LOADER_SETTINGS}
    if dl.num_workers == 0:   # a prefetch factor without workers is refused
        del kw["prefetch_factor"]
    return kw


def rebatched(dl: DataLoader, bs: int, name: str = "dl") -> DataLoader:
    """`dl` rebuilt to yield batches of `bs` items: the same data set, sampler (its generator and kind: shuffled,
    in order, weighted, ...), `drop_last`, generator and settings (`loader_settings`). A loader cadence cannot
    rebuild so (a DataLoader subclass, one without automatic batching, one with its own batch sampler) is refused
    with what to do instead; `name` is how the message calls it (`dls.train`).

    >>> dl = rebatched(DataLoader(range(10), batch_size=4, shuffle=True, drop_last=True), 3)
    >>> dl.batch_size, len(dl), type(dl.sampler).__name__
    (3, 3, 'RandomSampler')
    """
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
        raise ValueError(f"{name}.bs must be a positive int (the items in each batch), got {bs!r}")
    cannot = f"{name}.bs = {bs}: cadence cannot rebuild this loader with another batch size"
    build = f"build a new DataLoader with batch_size={bs} and use it in its place"
    if type(dl) is not DataLoader:
        raise TypeError(f"{cannot}: it is a {type(dl).__name__}, not a torch DataLoader; {build}")
    batches = dl.batch_sampler
    if dl.batch_size is None and batches is None:
        raise ValueError(f"{cannot}: it yields what its sampler gives, one at a time (batch_size=None); {build}")
    if dl.batch_size is None and type(batches) is not BatchSampler:
        raise ValueError(f"{cannot}: its batches come from its batch_sampler, a {type(batches).__name__}, which sets "
                         f"their size; give that sampler the new size and use a DataLoader built with it in this "
                         f"one's place")
    kw = loader_settings(dl)
    if dl.batch_size is None:   # a plain BatchSampler given as batch_sampler=
        return DataLoader(dl.dataset, batch_sampler=BatchSampler(batches.sampler, bs, batches.drop_last),
                          generator=dl.generator, **kw)
    sampler = None if isinstance(dl.dataset, IterableDataset) else dl.sampler   # a stream takes no sampler
    return DataLoader(dl.dataset, batch_size=bs, sampler=sampler, drop_last=dl.drop_last, generator=dl.generator, **kw)
