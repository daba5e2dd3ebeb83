"""Where a DistributedDL's iteration stands: epochs, skipping, and a state_dict that resumes on any number of processes.

Mixed into `DistributedDL`. A state_dict taken on N processes resumes on M: the rest of the epoch keeps
its global batches (each step the same samples, cut into M parts), so every remaining sample is seen
exactly once; a stream continues after the items all ranks consumed.

>>> state = ddl.state_dict()                 # saved with a checkpoint
>>> ddl.load_state_dict(state); rest = list(ddl)
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from . import sampling


class Resumable:
    """Mixed into `DistributedDL`: `set_epoch`, `skip_batches`, `state_dict` and `load_state_dict`."""

    def set_epoch(self, epoch: int) -> None:
        """Use `epoch`'s permutation for the next iteration (later iterations advance by themselves)."""
        self.epoch, self._started, self.last_batch, self._source = epoch, False, None, None
        self._steps_done, self._complete = 0, False

    def skip_batches(self, n: int) -> None:
        """Start the next iteration at batch `n` of the current epoch without loading the skipped items.

        >>> ddl.set_epoch(state["epoch"]); ddl.skip_batches(state["iter"])
        """
        top = math.inf if self._unsized else len(self)
        if not 0 <= n <= top:
            raise ValueError(f"can skip between 0 and {top} batches, got {n}")
        self.start_batch = self._steps_done = n

    def _samples_done(self, steps: int) -> int:
        """Items of a stream consumed by all ranks after `steps` steps of the current epoch."""
        base = self._source or {"samples_done": 0, "batches_done": 0}
        return base["samples_done"] + (steps - base["batches_done"]) * (self.dl.batch_size or 1) * self.world_size

    def state_dict(self) -> dict[str, Any]:
        """Where iteration stands: the shared seed, the epoch, the batches of it already yielded, the layout.

        `world_size` and `batch_size` describe the layout the epoch was cut with (the original
        one in an epoch resumed on another number of processes); for an IterableDataset
        `samples_done` counts the items of the stream all ranks consumed.

        >>> state = ddl.state_dict()          # saved with a checkpoint; all ranks hold the same values
        """
        src = self._source or {"world_size": self.world_size, "batch_size": self.dl.batch_size}
        state = {"seed": self.seed, "epoch": self.epoch, "batches_done": self._steps_done,
                 "epoch_complete": self._complete, "world_size": src["world_size"], "batch_size": src["batch_size"]}
        if self.iterable:
            state["samples_done"] = self._samples_done(self._steps_done)
        if self.draw_like_loader:
            state["drawn"] = self._drawn if self._drawn is not None and self._drawn["epoch"] == self.epoch else None
            state["generators"] = sampling.capture(self.dl)["generators"]  # later epochs go on drawing from them
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state_dict` was taken, on this or another number of processes.

        The next iteration yields the rest of that epoch (or the next epoch when it was complete).
        From another layout (world size or batch size) the rest of a map-style epoch keeps its
        global batches, cut into this run's number of parts; a stream continues after the items
        already consumed with this loader's batch size. Either says what changed in a warning.
        Dicts from older versions (seed, epoch, batches_done) load as this layout.

        >>> ddl.load_state_dict(state); rest = list(ddl)
        """
        epoch, done = state["epoch"], state["batches_done"]
        self.seed = state["seed"]
        self.set_epoch(epoch)
        if self.draw_like_loader and "generators" not in state:  # saved by a seeded DistributedDL (cadence < 0.2):
            self.draw_like_loader = False                           # its orders come from that seed
        if self.draw_like_loader:
            sampling.check_state(state.get("drawn"), state["generators"])
            self._drawn = state.get("drawn")
            sampling.set_generator_states(self.dl, state["generators"])
        layout = {"world_size": state.get("world_size", self.world_size),
                  "batch_size": state.get("batch_size", self.dl.batch_size), "batches_done": done}
        layout["samples_done"] = state.get("samples_done", done * (layout["batch_size"] or 1) * layout["world_size"])
        if done > 0 and (layout["world_size"], layout["batch_size"]) != (self.world_size, self.dl.batch_size):
            self._source = layout  # an epoch begun on another layout: its rest keeps that layout's global batches
        if state.get("epoch_complete"):
            self.set_epoch(epoch + 1)
            return
        if self._source is not None and self.rank == 0:
            warnings.warn(self._layout_change(layout), stacklevel=2)
        self.start_batch = self._steps_done = done  # all batches done but not the epoch: an empty rest, then the
        # loop still ends that epoch (validation) before the next

    def _layout_change(self, src: dict[str, Any]) -> str:
        """What a resume on another layout changes, for the warning."""
        def per_step(world_size: int, bs: int | None) -> str:
            return f"batch {bs} x {world_size} processes ({bs * world_size} per step)" if bs else \
                f"one batch of the batch sampler to each of {world_size} processes"
        head = f"resuming epoch {self.epoch} saved with {per_step(src['world_size'], src['batch_size'])} " \
               f"on {self.world_size} processes"
        later = f"later epochs use {per_step(self.world_size, self.dl.batch_size)}"
        if self.iterable:
            return (f"{head}: it continues after the {src['samples_done']} items already seen, "
                    f"batch {self.dl.batch_size or 1} per process; {later}")
        sizes = sorted({n for lens in self.plan.lens for n in lens[src["batches_done"]:]}, reverse=True)
        return (f"{head}: its remaining steps keep their global batches, now {'/'.join(map(str, sizes)) or 0} "
                f"samples per process; {later}")
