"""Epoch plans: which positions of an epoch's sample stream each rank takes at each step.

The stream is the epoch's sample order: `length` dataset indices (a permutation, a sampler's
draw, or a batch sampler's batches laid end to end). A position p >= length is padding and
stands for the item at p % length. A plan gives every rank the same number of batches; step t
of the plan is one global batch (rank 0's batch t, rank 1's batch t, ...).

>>> plan = contiguous(length=50, world_size=4, batch_size=12, drop_last=False)   # fastai's layout
>>> plan.batch(3, 1).tolist(), len(plan)
([51], 2)
>>> resplit(plan, start=1, world_size=2).batch(0, 1).tolist()     # the rest of the epoch on 2 ranks
[12, 25]
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

__all__ = ["Plan", "contiguous", "strided", "dispatched", "round_robin", "interleaved", "resplit", "shifted"]


@dataclass
class Plan:
    """`shards[r]`: rank r's positions, its batches end to end; `lens[r]`: the length of each of them."""

    length: int
    shards: list[torch.Tensor]
    lens: list[list[int]]
    starts: list[list[int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        assert len({len(lens) for lens in self.lens}) <= 1, "every rank must have the same number of batches"
        self.starts = [[0, *itertools.accumulate(lens)][:-1] for lens in self.lens]

    @property
    def world_size(self) -> int:
        return len(self.shards)

    def __len__(self) -> int:
        return len(self.lens[0]) if self.lens else 0

    def batch(self, rank: int, step: int) -> torch.Tensor:
        """Positions of `rank`'s batch at `step`."""
        start = self.starts[rank][step]
        return self.shards[rank][start:start + self.lens[rank][step]]

    def real_mask(self, rank: int, start: int, length: int) -> torch.Tensor:
        """False where `rank`'s shard positions start..start+length are padding."""
        return self.shards[rank][start:start + length] < self.length

    def global_batch(self, step: int) -> torch.Tensor:
        """The real positions of `step`, rank by rank."""
        pos = torch.cat([self.batch(r, step) for r in range(self.world_size)])
        return pos[pos < self.length]


def _batch_lens(n: int, batch_size: int, drop_last: bool) -> list[int]:
    full, rest = divmod(n, batch_size)
    return [batch_size] * full + ([rest] if rest and not drop_last else [])


def contiguous(length: int, world_size: int, batch_size: int, drop_last: bool) -> Plan:
    """fastai's layout: rank r takes the r-th of world_size chunks of ceil(length / world_size) positions."""
    per_rank = math.ceil(length / world_size)
    lens = _batch_lens(per_rank, batch_size, drop_last)
    used = sum(lens)
    return Plan(length, [torch.arange(r * per_rank, r * per_rank + used) for r in range(world_size)],
                [list(lens) for _ in range(world_size)])


def _from(plan: Plan, offset: int, length: int) -> Plan:
    """`plan`, laid over the positions after the first `offset` of a stream of `length`."""
    return Plan(length, [s + offset for s in plan.shards], plan.lens)


def strided(length: int, world_size: int, batch_size: int, drop_last: bool, offset: int = 0) -> Plan:
    """Accelerate's layout: the loader's batches dealt in turn (batch j to rank j % world_size).

    On several ranks the stream is padded to whole steps of world_size full batches by wrapping
    around to its start (drop_last: the incomplete step is dropped instead).

    >>> strided(10, 2, 3, drop_last=False).shards[1].tolist()     # rank 1: [3, 4, 5], then 9 and two repeats
    [3, 4, 5, 9, 10, 11]
    """
    if offset:
        return _from(strided(length - offset, world_size, batch_size, drop_last), offset, length)
    step = world_size * batch_size
    if drop_last:
        used = length // step * step
    else:
        used = math.ceil(length / step) * step if world_size > 1 else length
    lens = _batch_lens(used, batch_size, False)
    starts = list(itertools.accumulate([0, *lens]))
    return Plan(length, [torch.cat([torch.arange(starts[j], starts[j] + lens[j]) for j in range(r, len(lens), world_size)])
                         if lens[r::world_size] else torch.zeros(0, dtype=torch.long) for r in range(world_size)],
                [lens[r::world_size] for r in range(world_size)])


def dispatched(length: int, world_size: int, batch_size: int, drop_last: bool, offset: int = 0) -> Plan:
    """Accelerate's layout for a stream (its DataLoaderDispatcher): steps of world_size x batch_size positions, rank r
    taking the r-th slice; a short last step of m positions gives every rank ceil(m / world_size), completed from the
    stream's start (drop_last: dropped).

    >>> dispatched(7, 2, 2, drop_last=False).shards[1].tolist()      # rank 1: [2, 3], then 6 and 7 (item 0)
    [2, 3, 6, 7]
    """
    n = length - offset
    full, m = divmod(n, world_size * batch_size)
    k = 0 if drop_last else math.ceil(m / world_size)
    starts = [t * world_size * batch_size for t in range(full)] + ([full * world_size * batch_size] if k else [])
    sizes = [batch_size] * full + ([k] if k else [])
    shards = [torch.cat([torch.arange(s + r * b, s + (r + 1) * b) for s, b in zip(starts, sizes)])
              if sizes else torch.zeros(0, dtype=torch.long) for r in range(world_size)]
    return _from(Plan(n, shards, [list(sizes) for _ in range(world_size)]), offset, length)


def round_robin(batch_lens: list[int], world_size: int) -> Plan:
    """A batch sampler's batches dealt in turn: step t is batches t*world_size ... (t+1)*world_size - 1.

    The batch count is padded to a multiple of world_size by repeating the first batches.
    """
    length, n = sum(batch_lens), len(batch_lens)
    offsets = [0, *itertools.accumulate(batch_lens)]
    padded = math.ceil(n / world_size) * world_size if n else 0
    shards, lens = [[] for _ in range(world_size)], [[] for _ in range(world_size)]
    for j in range(padded):
        src, lap = j % n, j // n
        start = offsets[src] + lap * length  # a repeat is padding: position >= length
        shards[j % world_size].append(torch.arange(start, start + batch_lens[src]))
        lens[j % world_size].append(batch_lens[src])
    return Plan(length, [torch.cat(s) if s else torch.zeros(0, dtype=torch.long) for s in shards], lens)


def _split(pos: torch.Tensor, parts: int, length: int) -> list[torch.Tensor]:
    """`pos` cut into `parts` pieces in order, sizes differing by at most one; an empty piece gets a padding copy."""
    size, extra = divmod(len(pos), parts)
    cuts = list(itertools.accumulate([size + (i < extra) for i in range(parts)]))
    pieces = [pos[a:b] for a, b in zip([0, *cuts[:-1]], cuts)]
    return [p if len(p) else pos[:1] + length for p in pieces]


def resplit(plan: Plan, start: int, world_size: int) -> Plan:
    """Steps `start`.. of `plan` on `world_size` ranks: each step's real positions cut into world_size parts.

    Every global batch keeps its samples (padding dropped); steps before `start` are empty, so
    step numbers stay those of `plan`.
    """
    shards, lens = [[] for _ in range(world_size)], [[0] * start for _ in range(world_size)]
    for step in range(start, len(plan)):
        for r, piece in enumerate(_split(plan.global_batch(step), world_size, plan.length)):
            shards[r].append(piece)
            lens[r].append(len(piece))
    empty = torch.zeros(0, dtype=torch.long)
    return Plan(plan.length, [torch.cat(s) if s else empty for s in shards], lens)


def interleaved(length: int, world_size: int, batch_size: int, drop_last: bool, offset: int = 0) -> Plan:
    """A stream's items dealt one by one from `offset`: rank r takes offset + r, offset + r + world_size, ...

    Every rank gets ceil((length - offset) / world_size) positions; the short ones end in padding.
    """
    per_rank = math.ceil(max(length - offset, 0) / world_size)
    lens = _batch_lens(per_rank, batch_size, drop_last)
    used = sum(lens)
    return Plan(length, [torch.arange(offset + r, offset + r + used * world_size, world_size)
                         for r in range(world_size)], [list(lens) for _ in range(world_size)])


def shifted(plan: Plan, steps: int) -> Plan:
    """`plan` after `steps` empty steps: a resumed epoch's plan numbered like the original one."""
    return Plan(plan.length, plan.shards, [[0] * steps + lens for lens in plan.lens])
