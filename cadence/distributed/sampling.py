"""The epoch's sample stream of a map-style DataLoader, drawn the same way on every rank.

A loader built with `shuffle=True` gives `randperm(n)` from (seed + epoch); a sequential one
`0..n-1`; any other sampler or batch sampler (WeightedRandomSampler, a bucketing batch
sampler) is iterated with every random source it may use (its own generator, torch's, numpy's
and Python's global ones) seeded from (seed + epoch), and the global states restored after.

>>> order, batch_lens = draw(DataLoader(ds, sampler=WeightedRandomSampler(w, 100)), seed=7, epoch=0)
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

__all__ = ["kind", "draw", "random_source", "sampler_yields_batches"]


def sampler_yields_batches(dl: DataLoader) -> bool:
    """`DataLoader(ds, sampler=BatchSampler(...), batch_size=None)`: each "index" is a whole batch of indices,
    fetched as `dataset[indices]` (a pattern Accelerate's tests use)."""
    return dl.batch_size is None and dl.batch_sampler is None and isinstance(dl.sampler, BatchSampler)


def _batch_source(dl: DataLoader) -> Any:
    """What yields `dl`'s batches of indices: its batch sampler, or its sampler when that is a BatchSampler."""
    return dl.sampler if sampler_yields_batches(dl) else dl.batch_sampler


def kind(dl: DataLoader) -> str:
    """How `dl` orders an epoch: "sequential", "shuffle", "sampler" (any other) or "batch_sampler" (a custom one)."""
    if (dl.batch_size is None and dl.batch_sampler is not None) or sampler_yields_batches(dl):
        return "batch_sampler"
    sampler = dl.sampler
    if type(sampler) is SequentialSampler:
        return "sequential"
    if type(sampler) is RandomSampler and not sampler.replacement and sampler.num_samples == len(dl.dataset):
        return "shuffle"
    return "sampler"


@contextlib.contextmanager
def _seeded(seed: int, samplers: list[Any]) -> Iterator[None]:
    """Global torch / numpy / Python RNGs and the samplers' own generators seeded with `seed`; all restored on exit."""
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    generators = [(s, s.generator) for s in samplers if isinstance(getattr(s, "generator", None), torch.Generator)]
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    for s, _ in generators:
        s.generator = torch.Generator().manual_seed(seed)
    try:
        yield
    finally:
        for s, gen in generators:
            s.generator = gen
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


def _iterate(sampler: Any, seed: int, epoch: int) -> list:
    """The sampler's output for `epoch`: its `set_epoch` is called when it has one."""
    if callable(getattr(sampler, "set_epoch", None)):
        sampler.set_epoch(epoch)
    inner = getattr(sampler, "sampler", None)  # a BatchSampler's sampler draws the randomness
    with _seeded(seed + epoch, [sampler, inner]):
        return list(sampler)


def draw(dl: DataLoader, seed: int | None, epoch: int) -> tuple[torch.Tensor, list[int] | None]:
    """The epoch's dataset indices in order and, for a custom batch sampler, the length of each of its batches."""
    how = kind(dl)
    if how == "sequential":
        return torch.arange(len(dl.dataset)), None
    assert seed is not None, "a random order needs the seed shared by all ranks"
    if how == "shuffle":
        return torch.randperm(len(dl.dataset), generator=torch.Generator().manual_seed(seed + epoch)), None
    if how == "sampler":
        return torch.tensor(_iterate(dl.sampler, seed, epoch), dtype=torch.long), None
    batches = [list(b) for b in _iterate(_batch_source(dl), seed, epoch)]
    flat = [i for b in batches for i in b]
    return torch.tensor(flat, dtype=torch.long), [len(b) for b in batches]


def random_source(dl: DataLoader) -> torch.Generator | None:
    """The generator the user gave the loader's sampler or the loader, if any (a shared seed is drawn from it)."""
    for obj in (dl.sampler, getattr(dl.batch_sampler, "sampler", None), dl.batch_sampler, getattr(dl.sampler, "sampler", None)):
        gen = getattr(obj, "generator", None)
        if isinstance(gen, torch.Generator):
            return gen
    return dl.generator
