"""DistributedDL: the part of a DataLoader one rank iterates, with fastai's sharding semantics.

A dataset of n items is cut into world_size contiguous chunks of ceil(n / world_size) items,
the last padded by wrapping around to the start; the batch size is kept, so every rank yields
the same number of batches. With shuffling, one permutation per epoch, drawn from a seed all
ranks share, is cut the same way. fastai's example: 50 items, batch size 12, 4 ranks; rank i
yields `arange(i*13, i*13+12) % 50`, then `tensor([i*13+12]) % 50`.

Any other sampler (WeightedRandomSampler, ...) is drawn on every rank from the shared seed and
its output cut the same way; a custom batch sampler's batches are dealt to the ranks in turn
(step t takes batches t*world_size ...), padded by repeating its first batches. An
IterableDataset is dealt item by item (item i to rank i % world_size); with `__len__` every rank
pads to the same count, without it the ranks agree at every step whether one still has data.

A state_dict taken on N processes resumes on M: the rest of the epoch keeps its global batches
(each step the same samples, cut into M parts), so every remaining sample is seen exactly once
(`data_resume.py`).

>>> ddl = DistributedDL(DataLoader(ds, batch_size=12, shuffle=True))   # rank, world size from the env
>>> for epoch in range(3):
...     ddl.set_epoch(epoch)
...     for xb, yb in ddl: ...
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from . import env, sampling, sharding
from ..loader_settings import loader_settings, rebatched
from ..nested import send_to_device
from .data_rebuild import PlannedBatches
from .data_resume import Resumable
from .ops import broadcast
from .streams import Collate, InterleavedStream, PlannedStream, SplitStream

__all__ = ["DistributedDL"]


def _has_len(dataset: Any) -> bool:
    """Whether `len(dataset)` works (some streams define a __len__ that raises TypeError)."""
    try:
        len(dataset)
    except TypeError:
        return False
    return True


class DistributedDL(Resumable):
    """Wrap `dl` so this rank iterates its shard; see the module docstring for the semantics.

    Attributes a caller needs: `dataset_len` (n, the items of an epoch), `per_rank` (items in
    this rank's shard), `n_padded`, `epoch`, `start_batch`, `last_batch` ((start, length) of the
    batch yielded last, in shard positions). `len()` is the number of batches per rank.
    A DistributedDL that draws random orders, built without `seed` while a process group exists,
    is a collective: every rank must build it, and rank 0's seed is broadcast. So is iterating
    an IterableDataset without `__len__` (one small all-gather per batch).

    `draw_like_loader=True` makes wrapping change nothing: each epoch's order is drawn as `dl`
    itself draws it, from the same random sources at the same moment (when the iteration starts),
    so batches and every later random number equal the plain loader's. The random states of that
    moment go into `state_dict`, so a resumed epoch redraws the same order. On several processes
    the sampler must draw from its own generator, in the same state on every rank (the caller's part).
    `layout="strided"` deals the loader's batches to the ranks in turn, as Accelerate does
    (`sharding.strided`), instead of fastai's contiguous chunks; a stream is then split as Accelerate's
    IterableDatasetShard splits it, and with `layout="dispatched"` as its DataLoaderDispatcher (`SplitStream`). `loader_base_seed=True` (with `seed`): an epoch
    started afresh draws its iterator's base seed (its workers' seeds) as `dl` would, from `dl.generator` or torch's
    RNG at the first batch, as Accelerate's seedable sampler leaves it; the order still comes from `seed`.
    An iteration left before its end leaves the sampler's generators as the loader would have: drawn only as far as
    its loader asked, which is the batches yielded, plus `read_ahead` (Accelerate's prepared loader reads one ahead)
    and its workers' prefetch; with several processes, as far as rank 0's (Accelerate shares rank 0's generator).

    >>> ddl = DistributedDL(DataLoader(range(50), batch_size=12), rank=1, world_size=4)
    >>> [b.tolist() for b in ddl]
    [[13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24], [25]]
    """

    def __init__(self, dl: DataLoader, rank: int | None = None, world_size: int | None = None,
                 device: torch.device | str | None = None, seed: int | None = None, draw_like_loader: bool = False,
                 group: Any = None, layout: str = "contiguous", loader_base_seed: bool = False, read_ahead: int = 0):
        if not isinstance(dl, DataLoader):
            raise TypeError(f"DistributedDL wraps a torch DataLoader, got {type(dl).__name__}")
        self.dl, self.device, self.group = dl, device, group  # group: the ranks that agree on a stream's end
        self.rank = env.rank() if rank is None else rank
        self.world_size = env.world_size() if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        self.iterable = isinstance(dl.dataset, IterableDataset)
        self.sized = _has_len(dl.dataset)
        self.kind = "iterable" if self.iterable else sampling.kind(dl)
        self.shuffle = self.kind == "shuffle"
        self.draw_like_loader, self.layout, self.loader_base_seed = draw_like_loader, layout, loader_base_seed
        self.read_ahead = read_ahead
        own_generator = isinstance(getattr(dl.sampler, "generator", None), torch.Generator) or self.kind == "sequential"
        if draw_like_loader and (seed is not None or (self.world_size != 1 and not own_generator)):
            raise ValueError(f"draw_like_loader=True draws each epoch as the loader itself would: without a seed, on "
                             f"one process unless the sampler draws from its own generator; got world_size="
                             f"{self.world_size}, seed={seed!r}, sampler {type(dl.sampler).__name__}")
        if layout not in ("contiguous", "strided", "dispatched") or (layout == "dispatched" and not self.iterable):
            raise ValueError(f"layout must be 'contiguous' or 'strided' (or 'dispatched' for a stream), got {layout!r}")
        self._split = self.iterable and layout != "contiguous" and dl.batch_size is not None  # Accelerate's stream
        self._random = self.kind in ("shuffle", "sampler", "batch_sampler")
        self.seed = self._shared_seed(seed) if self._random and not draw_like_loader else seed
        self._drawn: dict[str, Any] | None = None  # draw_like_loader: {"epoch", "rng"}: the states the epoch was drawn from
        self.start_batch = 0
        self._source: dict[str, int] | None = None  # the layout this epoch continues (a resume on N != M)
        self._next_dl: DataLoader | None = None      # `bs` set while an epoch was under way: the next epoch's loader
        self.set_epoch(0)
        self._cache: dict[tuple, tuple] = {}         # (epoch, source) -> (order, plan), the last two
        self._real_len: list[int] = []               # a stream without __len__: real items per rank so far
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

    @property
    def drop_last(self) -> bool:
        return self.dl.drop_last

    @property
    def bs(self) -> int | None:
        """fastai's `dl.bs`: this process's batch size, as under fastai's DDP. Setting it rebuilds the wrapped loader
        with that size (`rebatched`) for the epochs that start afterwards; an epoch under way keeps its batches.

        >>> ddl.bs = 8      # on every process: each yields batches of 8 from the next epoch on
        """
        dl = self._next_dl or self.dl
        return dl.batch_size if dl.batch_size is not None else getattr(dl.batch_sampler, "batch_size", None)

    @bs.setter
    def bs(self, bs: int) -> None:
        dl = rebatched(self.dl, bs, "DistributedDL")
        if self._complete or not (self._started or self._steps_done):   # no epoch under way (or resumed part way)
            self._rebuild(dl)
        else:
            self._next_dl = dl

    @property
    def n(self) -> int | None:
        """fastai's `dl.n`: the items of the data set, all processes' (None for a stream without a length)."""
        return len(self.dl.dataset) if self.sized else None

    def set_epoch(self, epoch: int) -> None:
        """Use `epoch`'s permutation (and a batch size set during the last epoch) for the next iteration."""
        super().set_epoch(epoch)
        if self._next_dl is not None:   # a batch size set during the last epoch: this one takes it
            self._rebuild(self._next_dl)

    def _rebuild(self, dl: DataLoader) -> None:
        self.dl, self._next_dl, self._cache = dl, None, {}
        self._loader = self._build_loader()

    def _shared_seed(self, seed: int | None) -> int:
        if seed is not None:
            return seed
        gen = sampling.random_source(self.dl)
        return int(broadcast(int(torch.randint(0, 2**31 - 1, (1,), generator=gen))))

    def _build_loader(self) -> DataLoader:
        kw = loader_settings(self.dl)
        unbatched = self.dl.batch_size is None and self.kind != "batch_sampler"
        if sampling.sampler_yields_batches(self.dl):  # dataset[indices], one batch of indices at a time
            self._batches = PlannedBatches(flat=False)
            return DataLoader(self.dl.dataset, sampler=self._batches, batch_size=None, generator=self._generator, **kw)
        if self.iterable:
            bs, args = self.dl.batch_size or 1, (self.dl.dataset, self.rank, self.world_size)
            self._stream = (SplitStream(*args, bs, self.dl.drop_last, self.layout) if self._split else
                            PlannedStream(self.dl.dataset, len(self.dl.dataset)) if self.sized else
                            InterleavedStream(*args, bs, self.dl.drop_last))
            kw.update(collate_fn=Collate(self.dl.collate_fn, unbatched), batch_size=None, persistent_workers=False)
            return DataLoader(self._stream, generator=self._generator, **kw)  # a worker keeps the stream it got
        self._batches = PlannedBatches(flat=unbatched)
        if unbatched:
            return DataLoader(self.dl.dataset, sampler=self._batches, batch_size=None, generator=self._generator, **kw)
        return DataLoader(self.dl.dataset, batch_sampler=self._batches, generator=self._generator, **kw)

    # the epoch's plan: which stream positions each rank takes at each step
    def _order(self) -> tuple[torch.Tensor, list[int] | None]:
        """The current epoch's stream: dataset indices in order (positions for a stream), and batch lengths."""
        if self._unsized:
            raise TypeError("an IterableDataset without __len__ has no plan before it is iterated")
        if self.iterable:
            return torch.arange(len(self.dl.dataset)), None
        if self.draw_like_loader and self._random:
            return self._order_as_loader()
        return sampling.draw(self.dl, self.seed, self.epoch)

    def _order_as_loader(self) -> tuple[torch.Tensor, list[int] | None]:
        """The epoch's order redrawn from the states it was drawn from; before the draw, stand-ins of the right length."""
        if self._drawn is not None and self._drawn["epoch"] == self.epoch:
            with sampling.replayed(self.dl, self._drawn["rng"]):
                return sampling.listed(self.dl)
        if self.kind == "batch_sampler":  # lengths unknown until drawn: only the number of batches is right
            n = len(self.dl.batch_sampler if self.dl.batch_sampler is not None else self.dl.sampler)
            return torch.arange(n), [1] * n
        return torch.arange(len(self.dl.sampler)), None

    def _draw_now(self) -> None:
        """draw_like_loader: draw the epoch from the live random sources (as the loader would), keeping their states."""
        rng = sampling.capture(self.dl)
        order, batch_lens = sampling.listed(self.dl)
        self._drawn = {"epoch": self.epoch, "rng": rng}
        self._cache[self._key(self.epoch, self._source)] = (order, self._make_plan(order, batch_lens, self._source))

    def _layout(self, order: torch.Tensor, batch_lens: list[int] | None, world_size: int,
                batch_size: int | None, offset: int = 0) -> sharding.Plan:
        if batch_lens is not None:
            return sharding.round_robin(batch_lens, world_size)
        if self._split:
            layout = sharding.dispatched if self.layout == "dispatched" else sharding.strided
            return layout(len(order), world_size, batch_size, self.dl.drop_last, offset)
        if self.iterable:
            return sharding.interleaved(len(order), world_size, batch_size or 1, self.dl.drop_last, offset)
        if self.layout == "strided":
            return sharding.strided(len(order), world_size, batch_size or 1, self.dl.drop_last)
        return sharding.contiguous(len(order), world_size, batch_size or 1, self.dl.drop_last)

    @property
    def plan(self) -> sharding.Plan:
        """The current epoch's plan (see cadence.distributed.sharding), as iterated (or to be)."""
        return self._planned(self.epoch, self._source)[1]

    def _planned(self, epoch: int, source: dict[str, int] | None) -> tuple[torch.Tensor, sharding.Plan]:
        """(order, plan) of `epoch` continuing `source`; the last two are cached."""
        key = self._key(epoch, source)
        if key not in self._cache:
            current, self.epoch = self.epoch, epoch
            try:
                order, batch_lens = self._order()
            finally:
                self.epoch = current
            last = dict(list(self._cache.items())[-1:])
            self._cache = {**last, key: (order, self._make_plan(order, batch_lens, source))}
        return self._cache[key]

    def _key(self, epoch: int, source: dict[str, int] | None) -> tuple:
        drawn = self._drawn is not None and self._drawn["epoch"] == epoch
        return epoch, None if source is None else tuple(sorted(source.items())), drawn

    def _upcoming(self) -> sharding.Plan:
        """The plan the next iteration yields: the next epoch's once this one was iterated to its end."""
        return self._planned(self.epoch + 1, None)[1] if self._complete else self.plan

    def _make_plan(self, order: torch.Tensor, batch_lens: list[int] | None, src: dict[str, int] | None) -> sharding.Plan:
        if src is None:
            return self._layout(order, batch_lens, self.world_size, self.dl.batch_size)
        if self.iterable:  # a stream continues after the items consumed, this loader's batch size per rank
            rest = self._layout(order, None, self.world_size, self.dl.batch_size, src["samples_done"])
            return sharding.shifted(rest, src["batches_done"])
        saved = self._layout(order, batch_lens, src["world_size"], src["batch_size"])
        return sharding.resplit(saved, src["batches_done"], self.world_size)

    @property
    def dataset_len(self) -> int:
        return self.plan.length

    @property
    def per_rank(self) -> int:
        return len(self.plan.shards[self.rank])

    @property
    def n_padded(self) -> int:
        return sum(len(s) for s in self.plan.shards)

    @property
    def batch_lens(self) -> list[int]:
        """This rank's batch lengths in the next iteration (a resumed epoch's skipped batches count 0)."""
        return list(self._upcoming().lens[self.rank])

    # which samples each rank sees
    def order(self, epoch: int | None = None) -> list[int]:
        """Dataset indices of the whole epoch, before cutting: a permutation when shuffling, else 0..n-1."""
        return self._with_epoch(epoch)[0].tolist()

    def _with_epoch(self, epoch: int | None) -> tuple[torch.Tensor, sharding.Plan]:
        """The order and plan of `epoch` (default: the current one, as iterated)."""
        if epoch is None or epoch == self.epoch:
            return self._planned(self.epoch, self._source)
        return self._planned(epoch, None)

    def get_idxs(self, rank: int | None = None, epoch: int | None = None) -> list[int]:
        """Dataset indices of `rank`'s shard (default: this rank) for `epoch` (default: the current one), padding included.

        For an IterableDataset the "index" is the item's position in the stream (padding: 0).

        >>> DistributedDL(DataLoader(range(50), batch_size=12), rank=3, world_size=4).get_idxs()[-2:]
        [0, 1]
        """
        rank = self.rank if rank is None else rank
        order, plan = self._with_epoch(epoch)
        pos = plan.shards[rank]
        if self.iterable:
            return torch.where(pos < plan.length, pos, 0).tolist()
        return order[pos % max(len(order), 1)].tolist()

    def real_mask(self, rank: int, start: int, length: int) -> torch.Tensor:
        """Bool mask over `length` shard positions of `rank` from `start`: False where the item is padding."""
        if self._counted:
            return torch.arange(start, start + length) < self._real_len[rank]
        return self.plan.real_mask(rank, start, length)

    def batch_record(self) -> tuple:
        """What the loader keeps of the batch it yielded last (where it lies, each rank's real items, the batches
        done, whether the epoch is over), which `gather_for_metrics` and `state_dict` read: a reader one batch
        ahead puts it back (`restore_batch_record`) while the batch before is in use."""
        return self.last_batch, getattr(self, "_last_counts", None), self._steps_done, self._complete

    def restore_batch_record(self, record: tuple) -> None:
        self.last_batch, self._last_counts, self._steps_done, self._complete = record

    def last_batch_masks(self, ranks: list[int]) -> list[torch.Tensor] | None:
        """For each of `ranks`, the real-item mask of its batch at the step this rank yielded last (None before one)."""
        if self.last_batch is None:
            return None
        if self._counted:
            return [torch.arange(n) < c for c, n in (self._last_counts[r] for r in ranks)]
        plan, t = self.plan, self._steps_done - 1
        return [plan.real_mask(r, plan.starts[r][t], plan.lens[r][t]) for r in ranks]

    def sample_order(self, epoch: int | None = None) -> torch.Tensor:
        """Dataset index of each row `gather_for_metrics` returns for whole shards (every rank's shard, padding removed).

        >>> out = torch.empty_like(preds); out[ddl.sample_order()] = preds     # predictions in dataset order
        """
        if self._unsized and not self._split:   # dealt item by item: rank r's real items are r, r + world_size, ...
            return torch.cat([torch.arange(r, r + n * self.world_size, self.world_size)
                              for r, n in enumerate(self._real_len)])
        order, plan = self._with_epoch(epoch)
        pos = torch.cat([s[s < plan.length] for s in plan.shards])
        return pos if self.iterable else order[pos]

    def gathered_order(self) -> torch.Tensor | None:
        """The permutation that puts the rows `gather_for_metrics` returns for whole shards (rank by rank) in the
        stream's order: a stream is dealt to the ranks item by item (or in slices of each step), so its gathered rows
        are interleaved. None where rows stay in rank order: one process, or a map-style data set.

        >>> preds = preds.index_select(0, ddl.gathered_order())     # a stream's predictions in its order
        """
        if not self.iterable or self.world_size == 1:
            return None
        return torch.argsort(self.sample_order())

    def last_batch_idxs(self) -> torch.Tensor:
        """Dataset indices of the batch yielded last (padding included); gather them like the predictions.

        >>> idxs = gather_for_metrics(ddl.last_batch_idxs(), ddl)
        """
        if self.last_batch is None:
            raise ValueError("no batch has been yielded yet: iterate the DistributedDL first")
        start, length = self.last_batch
        return torch.tensor(self.get_idxs()[start:start + length], dtype=torch.long)

    @property
    def _unsized(self) -> bool:
        return self.iterable and not self.sized

    @property
    def _counted(self) -> bool:
        """Whether each rank's real items are counted while iterating (a stream without length, or split)."""
        return self._unsized or self._split

    def __len__(self) -> int:
        if self._unsized:
            raise TypeError("a DistributedDL over an IterableDataset without __len__ has no length: "
                            "its ranks agree on the end of an epoch while iterating")
        return len(self._upcoming())

    def __iter__(self) -> Iterator[Any]:
        if self._started:
            self._settle_left_iteration()
            self.set_epoch(self.epoch + 1)
        self._started, self._complete = True, False
        self._generator.manual_seed((self.seed or 0) + self.epoch)
        first, self.start_batch = self.start_batch, 0
        batches = (self._iter_split(first) if self._split else self._iter_agreed(first) if self._unsized
                   else self._iter_planned(first))
        for batch in batches:
            yield batch if self.device is None else send_to_device(batch, self.device)
        self._complete = True

    def _settle_left_iteration(self) -> None:
        """draw_like_loader: an epoch drawn here and left before its end draws only as far as the loader asked."""
        drawn = self._drawn
        if self._complete or not self.draw_like_loader or drawn is None or drawn["epoch"] != self.epoch:
            return
        asked = self._steps_done + self.read_ahead + self.dl.num_workers * (self.dl.prefetch_factor or 0)
        sampling.left_after(self.dl, drawn["rng"], asked * self.world_size)   # rank 0's batch t is batch t*W

    def _iter_planned(self, first: int) -> Iterator[Any]:
        plan: list[sharding.Plan] = []

        def prepare() -> None:
            order, p = self._planned(self.epoch, self._source)
            plan.append(p)
            starts, lens = p.starts[self.rank], p.lens[self.rank]
            flat = p.shards[self.rank][starts[first] if first < len(p) else len(p.shards[self.rank]):]
            if not self.iterable:
                flat = order[flat % len(order)] if len(order) else flat
            flat, at = flat.tolist(), starts[first] if first < len(p) else 0
            batches = [flat[s - at:s - at + n] for s, n in zip(starts[first:], lens[first:])]
            if self.iterable:
                self._stream.batches = batches
            else:
                self._batches.batches = batches

        fresh = self.draw_like_loader and first == 0  # a resumed epoch draws nothing: its order was drawn before
        # as the plain loader: the iterator draws its base seed from the loader's generator (or torch's), then
        # the sampler draws the order; a resumed epoch's iterator draws from this loader's own generator
        from_loader = fresh or (self.loader_base_seed and first == 0)
        self._loader.generator = self.dl.generator if from_loader else self._generator
        lazy = fresh and self._random and not self.iterable
        if not self.iterable:  # (an iteration abandoned before its first batch left its own)
            self._batches.prepare = (lambda: (self._draw_now(), prepare())) if lazy else None
        if not lazy:
            prepare()
        for t, batch in enumerate(self._loader, first):
            starts, lens = plan[0].starts[self.rank], plan[0].lens[self.rank]
            self.last_batch, self._steps_done = (starts[t], lens[t]), t + 1
            yield batch[1] if self.iterable else batch

    def _iter_agreed(self, first: int) -> Iterator[Any]:
        """A stream without __len__: every step the ranks share how many real items each has; none left ends it."""
        self._stream.offset = self._samples_done(first)
        self._real_len, pos, pad = [0] * self.world_size, 0, None
        it = iter(self._loader)
        for t in itertools.count(first):
            got = next(it, None) if pad is None else None
            if got is not None and got[0] == 0:
                pad, got = got, None  # this rank's items ended: pad while others still have some
            counts = self._agree(0 if got is None else got[0])
            if max(counts) == 0:
                return
            if got is None:
                if pad is None:
                    raise ValueError(f"rank {self.rank} got no item of the IterableDataset while other ranks did: "
                                     f"every rank must iterate the same items (do not shard the dataset yourself)")
                got = (1, pad[1])
            self._real_len = [a + b for a, b in zip(self._real_len, counts)]
            self._last_counts = [(c, max(c, 1)) for c in counts]   # (real items, batch length) of each rank
            self.last_batch, self._steps_done = (pos, got[0]), t + 1
            pos += got[0]
            yield got[1]

    def _iter_split(self, first: int) -> Iterator[Any]:
        """Accelerate's split of a stream: every rank reads all of it, so each knows every rank's real items."""
        self._stream.offset = self._samples_done(first)
        self._real_len, pos = [0] * self.world_size, 0
        for t, ((counts, size), batch) in enumerate(self._loader, first):
            self._real_len = [a + c for a, c in zip(self._real_len, counts)]
            self._last_counts = [(c, size) for c in counts]
            self.last_batch, self._steps_done = (pos, size), t + 1
            pos += size
            yield batch

    def _agree(self, n: int) -> list[int]:
        """Every rank's `n` (one all-gather over `group`, the world by default); without a process group only this rank's."""
        if not env.is_initialized() or dist.get_world_size(self.group) != self.world_size:
            return [n if r == self.rank else 0 for r in range(self.world_size)]
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
        out = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(self.world_size)]
        dist.all_gather(out, torch.tensor([n], dtype=torch.long, device=device), group=self.group)
        return [int(o) for o in out]
