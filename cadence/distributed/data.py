"""DistributedDL: the part of a DataLoader one rank iterates, with fastai's sharding semantics.

A dataset of n items is cut into world_size contiguous chunks of ceil(n / world_size) items,
the last padded by wrapping around to the start; the batch size is kept, so every rank yields
the same number of batches. With shuffling, one permutation per epoch, drawn from a seed all
ranks share, is cut the same way. fastai's example: 50 items, batch size 12, 4 ranks; rank i
yields `arange(i*13, i*13+12) % 50`, then `tensor([i*13+12]) % 50`.

>>> ddl = DistributedDL(DataLoader(ds, batch_size=12, shuffle=True))   # rank, world size from the env
>>> for epoch in range(3):
...     ddl.set_epoch(epoch)
...     for xb, yb in ddl: ...
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import (DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler,
                              get_worker_info)

from . import env
from .ops import broadcast, map_tensors

__all__ = ["DistributedDL", "send_to_device"]


def send_to_device(batch: Any, device: torch.device | str) -> Any:
    """Move every tensor in a (nested tuple / list / dict) batch to `device`.

    >>> xb, yb = send_to_device((xb, yb), "cuda:0")
    """
    return map_tensors(lambda t: t.to(device, non_blocking=True), batch)


class _IndexSampler(Sampler[int]):
    """Yields the index list DistributedDL sets before each epoch (lives in the main process)."""

    def __init__(self) -> None:
        self.idxs: list[int] = []

    def __iter__(self) -> Iterator[int]:
        return iter(self.idxs)

    def __len__(self) -> int:
        return len(self.idxs)


class _RankStream(IterableDataset):
    """Items i < n of an iterable dataset with i % world_size == rank, padded with item 0 to `per_rank`.

    Positions before `start` are skipped; with several loader workers each takes whole batches
    in turn, which the DataLoader's round-robin puts back in order.
    """

    def __init__(self, dataset: IterableDataset, rank: int, world_size: int, n: int, batch_size: int):
        self.dataset, self.rank, self.world_size, self.n, self.batch_size = dataset, rank, world_size, n, batch_size
        self.per_rank = math.ceil(n / world_size)
        self.start = 0

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        n_workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        def mine(j: int) -> bool:
            return j >= self.start and ((j - self.start) // self.batch_size) % n_workers == worker
        first, j = None, 0
        for i, item in enumerate(itertools.islice(self.dataset, self.n)):
            first = item if i == 0 else first
            if i % self.world_size == self.rank:
                if mine(j):
                    yield item
                j += 1
        if j < self.per_rank and first is None:
            raise ValueError(f"the IterableDataset has __len__ {self.n} but yielded no item")
        yield from (first for k in range(j, self.per_rank) if mine(k))


def _loader_kwargs(dl: DataLoader) -> dict[str, Any]:
    """The settings of `dl` a rebuilt loader keeps."""
    kw = dict(batch_size=dl.batch_size, collate_fn=dl.collate_fn, num_workers=dl.num_workers,
              pin_memory=dl.pin_memory, drop_last=dl.drop_last, timeout=dl.timeout,
              worker_init_fn=dl.worker_init_fn, multiprocessing_context=dl.multiprocessing_context,
              persistent_workers=dl.persistent_workers, pin_memory_device=dl.pin_memory_device)
    if dl.num_workers > 0:
        kw["prefetch_factor"] = dl.prefetch_factor
    return kw


def _check_sampler(dl: DataLoader) -> bool:
    """True when `dl` shuffles; ValueError for samplers DistributedDL cannot reproduce on every rank."""
    if dl.batch_size is None and dl.batch_sampler is not None:
        raise ValueError("DistributedDL needs a DataLoader built with batch_size (and optionally shuffle), "
                         "not a custom batch_sampler; shard such a loader yourself")
    sampler = dl.sampler
    if isinstance(sampler, RandomSampler):
        if sampler.replacement or sampler.num_samples != len(dl.dataset):
            raise ValueError("DistributedDL shuffles without replacement over the whole dataset; "
                             "build the DataLoader with shuffle=True instead of RandomSampler(replacement/num_samples)")
        return True
    if not isinstance(sampler, SequentialSampler) and not isinstance(dl.dataset, IterableDataset):
        raise ValueError(f"DistributedDL supports shuffle=True or sequential loaders, got sampler "
                         f"{type(sampler).__name__}; shard this loader yourself")
    return False


class DistributedDL:
    """Wrap `dl` so this rank iterates its shard; see the module docstring for the semantics.

    Attributes a caller needs: `dataset_len` (n), `per_rank` (items in each shard),
    `n_padded` (per_rank * world_size), `epoch`, `start_batch`, `last_batch` ((start, length)
    of the batch yielded last, in shard positions). `len()` is the number of batches per rank.
    A shuffling DistributedDL built without `seed` while a process group exists is a collective:
    every rank must build it, and rank 0's seed is broadcast.

    >>> ddl = DistributedDL(DataLoader(range(50), batch_size=12), rank=1, world_size=4)
    >>> [b.tolist() for b in ddl]
    [[13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24], [25]]
    """

    def __init__(self, dl: DataLoader, rank: int | None = None, world_size: int | None = None,
                 device: torch.device | str | None = None, seed: int | None = None):
        if not isinstance(dl, DataLoader):
            raise TypeError(f"DistributedDL wraps a torch DataLoader, got {type(dl).__name__}")
        self.dl, self.device = dl, device
        self.rank = env.rank() if rank is None else rank
        self.world_size = env.world_size() if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        self.iterable = isinstance(dl.dataset, IterableDataset)
        self.shuffle = _check_sampler(dl)
        self.dataset_len = self._dataset_len()
        self.per_rank = math.ceil(self.dataset_len / self.world_size)
        self.n_padded = self.per_rank * self.world_size
        self.seed = self._shared_seed(seed) if self.shuffle else seed
        self.epoch, self.start_batch, self.last_batch = 0, 0, None
        self._started = False
        # the loader's own generator: iterating never draws from the global RNG (so a resumed run's
        # random numbers match the uninterrupted run's), and worker seeds follow (seed, epoch)
        self._generator = torch.Generator()
        self._loader = self._build_loader()

    @property
    def dataset(self) -> Any:
        return self.dl.dataset

    @property
    def batch_size(self) -> int | None:
        return self.dl.batch_size

    def _dataset_len(self) -> int:
        if not isinstance(self.dl.dataset, Sized):
            raise ValueError("DistributedDL can only give every rank the same number of batches when the "
                             "dataset's length is known: give the IterableDataset a __len__, or shard it yourself")
        return len(self.dl.dataset)

    def _shared_seed(self, seed: int | None) -> int:
        if seed is not None:
            return seed
        gen = self.dl.sampler.generator or self.dl.generator
        return int(broadcast(int(torch.randint(0, 2**31 - 1, (1,), generator=gen))))

    def _build_loader(self) -> DataLoader:
        bs = self.dl.batch_size or 1
        if self.iterable:
            self._stream = _RankStream(self.dl.dataset, self.rank, self.world_size, self.dataset_len, bs)
            return DataLoader(self._stream, generator=self._generator, **_loader_kwargs(self.dl))
        self._sampler = _IndexSampler()
        return DataLoader(self.dl.dataset, sampler=self._sampler, generator=self._generator, **_loader_kwargs(self.dl))

    # which samples each rank sees
    def order(self, epoch: int | None = None) -> list[int]:
        """Dataset indices of the whole epoch, before cutting: a permutation when shuffling, else 0..n-1."""
        n, epoch = self.dataset_len, self.epoch if epoch is None else epoch
        if not self.shuffle:
            return list(range(n))
        gen = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(n, generator=gen).tolist()

    def get_idxs(self, rank: int | None = None, epoch: int | None = None) -> list[int]:
        """Dataset indices of `rank`'s shard (default: this rank) for `epoch` (default: the current one), padding included.

        >>> DistributedDL(DataLoader(range(50), batch_size=12), rank=3, world_size=4).get_idxs()[-2:]
        [0, 1]
        """
        rank = self.rank if rank is None else rank
        if self.iterable:
            return [(i if i < self.dataset_len else 0) for i in range(rank, self.n_padded, self.world_size)]
        idxs = self.order(epoch)
        if idxs:
            idxs = (idxs * math.ceil(self.n_padded / len(idxs)))[:self.n_padded]
        return idxs[rank * self.per_rank:(rank + 1) * self.per_rank]

    def real_mask(self, rank: int, start: int, length: int) -> torch.Tensor:
        """Bool mask over `length` shard positions of `rank` from `start`: False where the item is padding."""
        pos = torch.arange(start, start + length)
        glob = rank + pos * self.world_size if self.iterable else rank * self.per_rank + pos
        return glob < self.dataset_len

    def sample_order(self, epoch: int | None = None) -> torch.Tensor:
        """Dataset index of each row `gather_for_metrics` returns for whole shards (every rank's shard, padding removed).

        >>> out = torch.empty_like(preds); out[ddl.sample_order()] = preds     # predictions in dataset order
        """
        shards = [torch.tensor(self.get_idxs(r, epoch), dtype=torch.long) for r in range(self.world_size)]
        return torch.cat([s[self.real_mask(r, 0, len(s))] for r, s in enumerate(shards)])

    def last_batch_idxs(self) -> torch.Tensor:
        """Dataset indices of the batch yielded last (padding included); gather them like the predictions.

        >>> idxs = gather_for_metrics(ddl.last_batch_idxs(), ddl)
        """
        if self.last_batch is None:
            raise ValueError("no batch has been yielded yet: iterate the DistributedDL first")
        start, length = self.last_batch
        return torch.tensor(self.get_idxs()[start:start + length], dtype=torch.long)

    # epochs and resuming
    def set_epoch(self, epoch: int) -> None:
        """Use `epoch`'s permutation for the next iteration (later iterations advance by themselves)."""
        self.epoch, self._started, self.last_batch = epoch, False, None

    def skip_batches(self, n: int) -> None:
        """Start the next iteration at batch `n` of the current epoch without loading the skipped items.

        >>> ddl.set_epoch(state["epoch"]); ddl.skip_batches(state["iter"])
        """
        if not 0 <= n <= len(self):
            raise ValueError(f"can skip between 0 and {len(self)} batches, got {n}")
        self.start_batch = n

    def state_dict(self) -> dict[str, int | None]:
        """Where iteration stands: the shared seed, the epoch and the batches of it already yielded.

        >>> state = ddl.state_dict()          # saved with a checkpoint; all ranks hold the same values
        """
        bs = self.dl.batch_size or 1
        done = 0 if self.last_batch is None else self.last_batch[0] // bs + 1
        return {"seed": self.seed, "epoch": self.epoch, "batches_done": done}

    def load_state_dict(self, state: dict[str, int | None]) -> None:
        """Continue where `state_dict` was taken: the next iteration yields the rest of that epoch.

        >>> ddl.load_state_dict(state); rest = list(ddl)
        """
        self.seed = state["seed"]
        self.set_epoch(state["epoch"])
        self.skip_batches(state["batches_done"])

    def __len__(self) -> int:
        bs = self.dl.batch_size or 1
        return self.per_rank // bs if self.dl.drop_last else math.ceil(self.per_rank / bs)

    def __iter__(self) -> Iterator[Any]:
        if self._started:
            self.epoch += 1
        self._started = True
        self._generator.manual_seed((self.seed or 0) + self.epoch)
        bs = self.dl.batch_size or 1
        start, self.start_batch = self.start_batch * bs, 0
        if self.iterable:
            self._stream.start = start
        else:
            self._sampler.idxs = self.get_idxs()[start:]
        for k, batch in enumerate(self._loader):
            pos = start + k * bs
            self.last_batch = (pos, min(bs, self.per_rank - pos))
            yield batch if self.device is None else send_to_device(batch, self.device)
