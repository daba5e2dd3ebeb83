"""The DataLoader a DistributedDL iterates: the given loader rebuilt around the batches it plans.

The rebuilt loader keeps the given one's settings (`loader_settings`: workers, collation, memory pinning); its
batching is the rebuilder's: a `PlannedBatches` sampler, filled with this rank's batches before each epoch.

>>> DataLoader(dl.dataset, batch_sampler=PlannedBatches(flat=False), **loader_settings(dl))
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, Sampler

__all__ = ["LOADER_SETTINGS", "loader_settings", "PlannedBatches"]

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
