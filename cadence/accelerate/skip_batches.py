"""Accelerate's top-level `skip_first_batches(dataloader, num_batches)`, for prepared and plain loaders.

>>> for batch in skip_first_batches(train_dl, resume_step):   # the rest of an interrupted epoch
...     train_step(batch)
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator

from torch.utils.data import DataLoader, IterableDataset, Sampler

from ..loader_settings import loader_settings
from .prepared import PreparedDataLoader

__all__ = ["skip_first_batches"]


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """`dataloader` without its first `num_batches` batches.

    A prepared loader is `accelerator.skip_first_batches`'s: its next iteration starts there, the skipped
    items not loaded. A plain map-style `DataLoader` gives a new `DataLoader` whose batch sampler skips them
    (not loaded either), on every iteration, as Accelerate's; over an `IterableDataset` the first batches are
    loaded and dropped.

    >>> [b.tolist() for b in skip_first_batches(torch.utils.data.DataLoader(range(6), batch_size=2), 2)]
    [[4, 5]]
    """
    if not isinstance(num_batches, int) or num_batches < 0:
        raise ValueError(f"skip_first_batches(num_batches={num_batches!r}): give a count of batches, 0 or more")
    if isinstance(dataloader, PreparedDataLoader):
        dataloader.skip_batches(num_batches)
        return dataloader
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"skip_first_batches takes a torch DataLoader or a loader returned by prepare, "
                        f"got {type(dataloader).__name__}")
    if isinstance(dataloader.dataset, IterableDataset):
        return _SkipIterable(dataloader, num_batches)
    return DataLoader(dataloader.dataset, batch_sampler=_SkipBatchSampler(dataloader.batch_sampler, num_batches),
                      generator=dataloader.generator, **loader_settings(dataloader))


class _SkipBatchSampler(Sampler):
    """`batch_sampler`'s batches after the first `skip`."""

    def __init__(self, batch_sampler: Any, skip: int):
        self.batch_sampler, self.skip = batch_sampler, skip

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.batch_sampler), self.skip, None)

    def __len__(self) -> int:
        return max(len(self.batch_sampler) - self.skip, 0)


class _SkipIterable:
    """A loader over an iterable dataset, its first `skip` batches loaded and dropped."""

    def __init__(self, dataloader: DataLoader, skip: int):
        self.dataloader, self.skip = dataloader, skip

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.dataloader), self.skip, None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dataloader, name)
