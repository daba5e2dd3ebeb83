"""One rank's part of an IterableDataset, as whole batches (run inside the loader's workers).

Both streams yield `(n_real, items)`: a batch's items and how many of them are real (not
padding); `Collate` turns the items into the user's batch. With several loader workers each
takes whole batches in turn, which the DataLoader's round-robin puts back in order.

>>> stream = PlannedStream(ds, length=11); stream.batches = [[0, 3], [6, 9]]    # positions in the stream
>>> stream = InterleavedStream(ds, rank=1, world_size=2, batch_size=4, drop_last=False)
>>> stream = SplitStream(ds, rank=1, world_size=2, batch_size=2, drop_last=False, tail="dispatched")
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

__all__ = ["PlannedStream", "InterleavedStream", "SplitStream", "Collate"]


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (info.num_workers, info.id) if info is not None else (1, 0)


class Collate:
    """`(n_real, items)` -> `(n_real, collate_fn(items))`; an unbatched loader's single item is converted alone."""

    def __init__(self, collate_fn: Callable, unbatched: bool):
        self.collate_fn, self.unbatched = collate_fn, unbatched

    def __call__(self, element: tuple[int, list]) -> tuple[int, Any]:
        n_real, items = element
        return n_real, self.collate_fn(items[0] if self.unbatched else items)


class PlannedStream(IterableDataset):
    """The items at given stream positions, batch by batch; a position >= length stands for the first item."""

    def __init__(self, dataset: IterableDataset, length: int):
        self.dataset, self.length = dataset, length
        self.batches: list[list[int]] = []  # increasing positions, set before each epoch

    def __iter__(self) -> Iterator[tuple[int, list]]:
        n_workers, worker = _worker()
        items = enumerate(itertools.islice(self.dataset, self.length))
        cursor, first = -1, None

        def at(p: int) -> Any:
            nonlocal cursor, first
            item = None
            while cursor < p:
                cursor, item = next(items, (None, None))
                if cursor is None:
                    raise ValueError(f"the IterableDataset has __len__ {self.length} but ended after fewer items")
                first = item if cursor == 0 else first
            return item

        for j, batch in enumerate(self.batches):
            if j % n_workers != worker:
                continue
            real = [p for p in batch if p < self.length]
            out = [at(p) for p in real]
            if len(real) < len(batch):
                if first is None:
                    at(0)
                out += [first] * (len(batch) - len(real))
            yield len(real), out


class InterleavedStream(IterableDataset):
    """Positions offset + rank, offset + rank + world_size, ... of a stream of unknown length, in batches.

    After its last real batch every worker yields `(0, [first item])`: the padding a rank uses
    while other ranks still have batches (none when the stream is empty).
    """

    def __init__(self, dataset: IterableDataset, rank: int, world_size: int, batch_size: int, drop_last: bool):
        self.dataset, self.rank, self.world_size = dataset, rank, world_size
        self.batch_size, self.drop_last = batch_size, drop_last
        self.offset = 0  # stream positions already consumed by earlier steps (a resume)

    def __iter__(self) -> Iterator[tuple[int, list]]:
        n_workers, worker = _worker()
        first, batch, j = None, [], 0
        for p, item in enumerate(self.dataset):
            first = item if p == 0 else first
            if p < self.offset or (p - self.offset) % self.world_size != self.rank:
                continue
            batch.append(item)
            if len(batch) == self.batch_size:
                if j % n_workers == worker:
                    yield len(batch), batch
                batch, j = [], j + 1
        if batch and not self.drop_last and j % n_workers == worker:
            yield len(batch), batch
        if first is not None:
            yield 0, [first]


class SplitStream(IterableDataset):
    """Accelerate's split of a stream: steps of world_size x batch_size consecutive items, rank r taking the r-th
    slice of each, from position `offset`. A short last step of m items, unless drop_last, is completed from the
    stream's start: to a whole step (`tail="strided"`, Accelerate's IterableDatasetShard) or to ceil(m / world_size)
    items per rank (`"dispatched"`, its DataLoaderDispatcher, the default for streams). Every rank reads the whole
    stream, so each knows every rank's real items: it yields `((real items of each rank, batch length), items)`.
    """

    def __init__(self, dataset: IterableDataset, rank: int, world_size: int, batch_size: int, drop_last: bool,
                 tail: str):
        self.dataset, self.rank, self.world_size, self.batch_size = dataset, rank, world_size, batch_size
        self.drop_last, self.tail = drop_last, tail
        self.offset = 0  # stream positions already consumed by earlier steps (a resume)

    def __iter__(self) -> Iterator[tuple[tuple, list]]:
        n_workers, worker = _worker()
        step = self.world_size * self.batch_size
        head, items, j = [], [], 0   # head: the stream's first step, which completes a short last one
        for p, item in enumerate(self.dataset):
            if len(head) < step:
                head.append(item)
            if p < self.offset:
                continue
            items.append(item)
            if len(items) == step:
                if j % n_workers == worker:
                    yield self._slice(items, self.batch_size, head)
                items, j = [], j + 1
        if items and not self.drop_last and j % n_workers == worker:
            size = self.batch_size if self.tail == "strided" else math.ceil(len(items) / self.world_size)
            yield self._slice(items, size, head)

    def _slice(self, items: list, size: int, head: list) -> tuple[tuple, list]:
        real = len(items)
        items = items + list(itertools.islice(itertools.cycle(head), size * self.world_size - real))
        counts = tuple(min(max(real - r * size, 0), size) for r in range(self.world_size))
        return (counts, size), items[self.rank * size:(self.rank + 1) * size]
