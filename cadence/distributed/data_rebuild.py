"""The DataLoader a DistributedDL iterates: the given loader rebuilt around the batches it plans.

The rebuilt loader keeps the given one's settings (`loader_settings`, from `cadence/loader_settings.py`: workers,
collation, memory pinning); its batching is the rebuilder's: a `PlannedBatches` sampler, filled with this rank's
batches before each epoch.

>>> DataLoader(dl.dataset, batch_sampler=PlannedBatches(flat=False), **loader_settings(dl))
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import Sampler

__all__ = ["PlannedBatches"]


class PlannedBatches(Sampler[list[int]]):
    """Yields the batches DistributedDL sets before each epoch (lives in the main process)."""

    def __init__(self, flat: bool) -> None:
        self.batches: list[list[int]] = []
        self.flat = flat  # an unbatched loader takes one index at a time
        self.prepare: Any = None  # set: called (once) when iteration starts, to fill `batches` then

    def __iter__(self) -> Iterator[Any]:  # a generator: its body runs when the loader asks for the first index
        if self.prepare is not None:
            prepare, self.prepare = self.prepare, None
            prepare()
        for b in self.batches:
            yield b[0] if self.flat else b

    def __len__(self) -> int:
        return len(self.batches)
