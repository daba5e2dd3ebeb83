"""FSDP's sharded checkpoints (`state_dict_type="SHARDED_STATE_DICT"`): torch's distributed checkpoint, every rank
writing and reading its own shards, in the background for an asynchronous save.

A mixin of the FSDP strategy (and so of model_parallel's, which renames what it holds), beside the strategy itself:
it reads the strategy's `state_dict_type`, `_skeleton` (None on one process), `device` and `is_main`.

>>> with learn.distrib_ctx(strategy="fsdp"):                       # doctest: +SKIP
...     learn.fit(1, cbs=Checkpoint("ckpt", async_save=True))      # ckpt/epoch_1/sharded/ on every rank
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .staging import HostBuffers, Staging, host_copy

__all__ = ["ShardedCheckpoints", "SHARDED_DIR", "CHECKPOINT_GROUP_TIMEOUT"]

SHARDED_DIR = "sharded"
CHECKPOINT_GROUP_TIMEOUT = timedelta(hours=6)  # a checkpoint's own deadline is the Checkpoint's io_timeout


class ShardedCheckpoints:
    """Sharded saves and loads for a strategy whose model is FSDP2's (DTensor parameters)."""

    _checkpoint_group = None  # the gloo group torch's distributed checkpoint runs its collectives on
    _stager = None  # torch's stager of asynchronous saves, kept from one save to the next (its host memory)

    def checkpoint_writer(self, directory: Path, model: nn.Module, opt: torch.optim.Optimizer,
                          copy: bool = False, staging: Staging | None = None) -> Callable[[], None] | None:
        """SHARDED_STATE_DICT: every rank writes its shards in parallel under `directory/sharded/` (torch's
        distributed checkpoint; `copy`: its async save, the shards copied to host memory now, or with `staging`
        by the returned writer, first, `staging.done()` said once they are; the tensors outside `staging.late`
        are copied now). Its collectives run on a group of their own, so a write in the
        background never meets the training's collectives."""
        if self.state_dict_type == "FULL_STATE_DICT" or self._skeleton is None:
            return super().checkpoint_writer(directory, model, opt, copy, staging)
        import torch.distributed.checkpoint as dcp

        self.prepare_checkpoints()
        state, target = self._checkpoint_state(model, opt), Path(directory) / SHARDED_DIR
        if copy and staging is not None:
            return self._staged_write(host_copy(state, only=lambda t: not staging.is_late(t)), target, staging)
        if copy:
            return dcp.async_save(state, checkpoint_id=target, process_group=self._checkpoint_group).result
        return lambda: dcp.save(state, checkpoint_id=target, process_group=self._checkpoint_group)

    def prepare_checkpoints(self) -> None:
        """Sharded saves: torch's distributed checkpoint imported, its gloo group and host stager made, once (every
        rank: making a group is a collective). At a save point they cost 0.05-0.2 s of a first save."""
        super().prepare_checkpoints()
        if self.state_dict_type == "FULL_STATE_DICT" or self._skeleton is None or self._checkpoint_group is not None:
            return
        import torch.distributed as dist
        import torch.distributed.checkpoint  # noqa: F401 - imported now, not at the first save
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self._checkpoint_group = dist.new_group(backend="gloo", timeout=CHECKPOINT_GROUP_TIMEOUT)
        # kept: it reuses its host memory for the same shards at the next save. On a device, the copy runs on a
        # stream of its own (made here, on the main thread), so that it overlaps the computation
        on_device = self.device.type != "cpu"
        self._stager = DefaultStager(StagingOptions(use_pinned_memory=on_device, use_shared_memory=False,
                                                    use_async_staging=on_device, use_non_blocking_copy=on_device))

    def reserve_checkpoint_memory(self, buffers: HostBuffers, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        """Take ahead the host memory an asynchronous save copies into (its page faults cost more than the copy). On
        one process nothing is sharded: the base format, the model's and optimizer's copy reserved in `buffers`.
        Sharded: torch's stager takes its host copy of the shards now; it keeps it for them from save to save."""
        if self._skeleton is None:
            if self.is_main:
                buffers.reserve(model, opt)
        elif self.state_dict_type != "FULL_STATE_DICT":
            self.prepare_checkpoints()
            self._stage(self._checkpoint_state(model, opt))

    def _stage(self, state: dict) -> dict:
        """`state` copied to host memory by torch's stager (on a device, by its thread and stream: waited for)."""
        from concurrent.futures import Future

        staged = self._stager.stage(state)
        return staged.result() if isinstance(staged, Future) else staged

    def _staged_write(self, state: dict, target: Path, staging: Staging) -> Callable[[], None]:
        """What the writer's thread runs: the shards copied to host memory by torch's stager, `staging.done()`, then
        torch's save of the copy (its planning collectives on the checkpoint group, not the training's)."""
        import torch.distributed.checkpoint as dcp

        def write() -> None:
            try:
                staged = self._stage(state)
            finally:
                staging.done()
            dcp.save(staged, checkpoint_id=target, process_group=self._checkpoint_group)
        return write

    def load_checkpoint(self, directory: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        """Read a sharded or full checkpoint, written on any number of processes; a sharded one of either engine (this
        one's optimizer state per parameter group, model_parallel's per parameter: `DirectReader.load` reads both).

        Sharded: every rank plans and reads its own shards from the metadata (`no_dist`), with no collective: each
        DTensor knows which part of the whole it holds, so there is nothing to agree on, and torch's planning
        collectives (gathering every rank's plan, scattering them back, gathering the outcome) cost more than the
        reads on small or contended hosts. Each tensor saved whole is read straight into its shard (`DirectReader`: one
        copy, not torch's two). A rank that fails raises on its own; the launcher ends the others."""
        from .distcp_read import DirectReader, is_sharded

        if not is_sharded(Path(directory), SHARDED_DIR):  # and, where it lists its files, says so
            return super().load_checkpoint(directory, model, opt)
        reader = DirectReader(Path(directory) / SHARDED_DIR)
        reader.check()  # a shard file cut short is refused before anything loads
        state = self._checkpoint_state(model, opt)
        reader.load(state)  # every rank its own shards (`no_dist`); nothing unpickled but data
        self._set_checkpoint_state(model, opt, state)

    def _checkpoint_state(self, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
        """What the sharded checkpoint holds: {"model": ..., "optimizer": ...}, torch's sharded state dicts."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, opt_state = get_state_dict(model, opt)
        return {"model": model_state, "optimizer": opt_state}

    def _set_checkpoint_state(self, model: nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
        """`state` (from `_checkpoint_state`, loaded) into the model and optimizer. Its model part views the sharded
        parameters' and buffers' own memory, so torch's load wrote them in place: loading them again would copy
        every shard onto itself (a DTensor dispatch per tensor); only the optimizer's part is set then."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict, set_state_dict

        if _same_memory(state["model"], model.state_dict()):
            set_optimizer_state_dict(model, opt, state["optimizer"])
        else:
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _same_memory(loaded: dict, own: dict) -> bool:
    """Whether every tensor of `loaded` is, by name, a view of the same memory as `own`'s (DTensors: their shards)."""
    def where(t: Any) -> tuple | None:
        local = getattr(t, "_local_tensor", t)
        if not isinstance(local, torch.Tensor):
            return None
        return local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape), local.dtype
    return loaded.keys() == own.keys() and all(where(v) is not None and where(v) == where(own[k])
                                               for k, v in loaded.items())
