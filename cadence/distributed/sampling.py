"""The epoch's sample stream of a map-style DataLoader, drawn the same way on every rank.

A loader built with `shuffle=True` gives `randperm(n)` from (seed + epoch); a sequential one
`0..n-1`; any other sampler or batch sampler (WeightedRandomSampler, a bucketing batch
sampler) is iterated with every random source it may use (its own generator, torch's, numpy's
and Python's global ones) seeded from (seed + epoch), and the global states restored after.

A one-process DistributedDL with `draw_like_loader` instead lists the sampler from the live random
sources, exactly as the plain loader would (`listed`), after `capture` kept their states, so that
a resumed epoch redraws the same order (`replayed`) without touching the live ones.

>>> order, batch_lens = draw(DataLoader(ds, sampler=WeightedRandomSampler(w, 100)), seed=7, epoch=0)
"""

from __future__ import annotations

import base64
import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

__all__ = ["kind", "draw", "random_source", "sampler_yields_batches", "generators", "capture", "set_generator_states",
           "listed", "replayed", "left_after"]


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


def listed(dl: DataLoader) -> tuple[torch.Tensor, list[int] | None]:
    """One epoch of `dl`'s sampler (or batch sampler) as it stands, drawing from whatever RNG it uses."""
    if kind(dl) == "batch_sampler":
        batches = [list(b) for b in _batch_source(dl)]
        return torch.tensor([i for b in batches for i in b], dtype=torch.long), [len(b) for b in batches]
    return torch.tensor(list(dl.sampler), dtype=torch.long), None


def draw(dl: DataLoader, seed: int | None, epoch: int) -> tuple[torch.Tensor, list[int] | None]:
    """The epoch's dataset indices in order and, for a custom batch sampler, the length of each of its batches."""
    how = kind(dl)
    if how == "sequential":
        return torch.arange(len(dl.dataset)), None
    assert seed is not None, "a random order needs the seed shared by all ranks"
    if how == "shuffle":
        return torch.randperm(len(dl.dataset), generator=torch.Generator().manual_seed(seed + epoch)), None
    source = dl.sampler if how == "sampler" else _batch_source(dl)
    if callable(getattr(source, "set_epoch", None)):
        source.set_epoch(epoch)
    with _seeded(seed + epoch, [source, getattr(source, "sampler", None)]):
        return listed(dl)


def random_source(dl: DataLoader) -> torch.Generator | None:
    """The generator the user gave the loader's sampler or the loader, if any (a shared seed is drawn from it)."""
    for obj in (dl.sampler, getattr(dl.batch_sampler, "sampler", None), dl.batch_sampler, getattr(dl.sampler, "sampler", None)):
        gen = getattr(obj, "generator", None)
        if isinstance(gen, torch.Generator):
            return gen
    return dl.generator


# ---------------------------------------------------------------- drawing as the loader itself would
def generators(dl: DataLoader) -> list[torch.Generator]:
    """The distinct torch generators `dl` draws from (its own, its sampler's, its batch sampler's), in a fixed order."""
    found: list[torch.Generator] = []
    for obj in (dl, dl.sampler, getattr(dl.sampler, "sampler", None), dl.batch_sampler,
                getattr(dl.batch_sampler, "sampler", None)):
        gen = getattr(obj, "generator", None)
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
            found.append(gen)
    return found


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def check_state(drawn: Any, states: Any) -> None:
    """ValueError naming the field unless `drawn` (None or {"epoch", "rng"} from `capture`) and `states`
    (generator states) are what a DistributedDL with `draw_like_loader` saved: a damaged or edited file."""
    def bad(field: str) -> ValueError:
        return ValueError(f"the loader position's {field} is not what cadence saved (the checkpoint was edited or "
                          f"damaged): resume from another checkpoint")

    def check_states(field: str, value: Any) -> None:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise bad(field)
        try:
            for v in value:
                _decode(v)
        except ValueError:
            raise bad(field) from None

    check_states("generators", states)
    if drawn is None:
        return
    if not isinstance(drawn, dict) or not isinstance(drawn.get("epoch"), int) or not isinstance(drawn.get("rng"), dict):
        raise bad("drawn")
    rng = drawn["rng"]
    check_states("drawn.rng.torch", [rng.get("torch")])
    check_states("drawn.rng.generators", rng.get("generators"))
    for key in ("numpy", "python"):
        if key in rng and not isinstance(rng[key], list):
            raise bad(f"drawn.rng.{key}")


def capture(dl: DataLoader) -> dict[str, Any]:
    """Every random state an epoch of `dl` may draw from, JSON-ready: torch's global one, `dl`'s generators,
    and numpy's and Python's global ones for samplers other than torch's (they may use those)."""
    state: dict[str, Any] = {"torch": _encode(torch.get_rng_state()),
                             "generators": [_encode(g.get_state()) for g in generators(dl)]}
    if kind(dl) in ("sampler", "batch_sampler"):
        name, keys, pos, has_gauss, cached = np.random.get_state()
        version, internal, gauss = random.getstate()
        state.update(numpy=[name, keys.tolist(), pos, has_gauss, cached], python=[version, list(internal), gauss])
    return state


def set_generator_states(dl: DataLoader, states: list[str]) -> None:
    """Put `dl`'s generators back in the states `capture` (or `[_encode(g.get_state())]`) recorded."""
    gens = generators(dl)
    if len(gens) != len(states):
        raise ValueError(f"the loader draws from {len(gens)} torch generator(s) but the saved state has {len(states)}: "
                         f"build the loader as in the run that was saved")
    for gen, text in zip(gens, states):
        try:
            gen.set_state(_decode(text))
        except (RuntimeError, ValueError):
            raise ValueError("a saved generator state does not fit the loader's generator (the checkpoint was "
                             "edited or damaged, or the loader is another one): resume from another checkpoint") from None


@contextlib.contextmanager
def replayed(dl: DataLoader, state: dict[str, Any]) -> Iterator[None]:
    """Every random source as `capture` recorded it; all restored on exit (drawing here changes nothing outside)."""
    saved = capture(dl)
    saved_np, saved_py = np.random.get_state(), random.getstate()
    try:
        torch.set_rng_state(_decode(state["torch"]))
        set_generator_states(dl, state["generators"])
        if "numpy" in state:
            name, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
            version, internal, gauss = state["python"]
            random.setstate((version, tuple(internal), gauss))
        yield
    finally:
        torch.set_rng_state(_decode(saved["torch"]))
        set_generator_states(dl, saved["generators"])
        np.random.set_state(saved_np)
        random.setstate(saved_py)


def left_after(dl: DataLoader, state: dict[str, Any], batches: int) -> None:
    """Put `dl`'s generators where its sampler, drawing from the states `capture` recorded, leaves them once its
    loader asked for `batches` batches: a torch sampler draws lazily, and only one asked past its end (after a short
    batch, or its last) draws what it draws at its end (RandomSampler's second permutation)."""
    with replayed(dl, state):
        source = dl.batch_sampler if dl.batch_sampler is not None else dl.sampler
        size, it = getattr(source, "batch_size", None), iter(source)
        for _ in range(batches):
            batch = next(it, None)
            if batch is None or (size is not None and len(batch) < size):
                for _ in it:
                    pass
                break
        after = [g.get_state() for g in generators(dl)]
    for gen, gen_state in zip(generators(dl), after):
        gen.set_state(gen_state)
