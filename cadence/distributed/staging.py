"""A save's copy to host memory that overlaps the next step: what only the optimizer step writes is copied later.

An asynchronous save must copy the state it writes, since training goes on. Most of that state
(the parameters and the optimizer's per-parameter state) is written by nothing but the optimizer
step: the next batch's data loading, forward and backward read it and leave it as it is. So those
tensors are copied by the writer's thread while the next step computes, and the training loop
waits for the copy (`Staging.wait`) only before the next optimizer step or whatever else could write
them. Everything else (buffers the forward updates, such as BatchNorm's running statistics,
tensors of other objects) is copied at once, at the save point. The late copy goes into host memory
kept from the save before (`HostBuffers`): allocating it anew costs page faults that, on a CPU host,
take ten times the copy itself.

>>> staging = Staging(model, opt)
>>> write = strategy.checkpoint_writer(staged_dir, model, opt, copy=True, staging=staging)  # copies the rest now
>>> threading.Thread(target=write).start()            # copies the parameters and optimizer state, then writes
>>> staging.wait()                                    # the loop, before the optimizer step
"""

from __future__ import annotations

import copy
import os
import threading
import time
from collections.abc import Mapping
from typing import Any, Callable, TypeVar

import torch
from torch import nn

from ..streaming import tensors_in
from .ops import map_tensors

T = TypeVar("T")


def addressable(t: torch.Tensor) -> bool:
    """Whether this process reads `t`'s memory itself (a data pointer): not an XLA device's, which only a transfer to
    the CPU reads (its storage has no data pointer; `storage_key` raises)."""
    return getattr(t, "_local_tensor", t).device.type != "xla"


def layout_key(t: torch.Tensor) -> tuple:
    """What identifies a tensor's memory and layout: views of one memory with one layout are one tensor."""
    if not t.numel():
        return (id(t),)
    return (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype, t.device)


def storage_key(t: torch.Tensor) -> int:
    """The address of the memory `t` views (a DTensor: its local shard's)."""
    local = getattr(t, "_local_tensor", t)
    return local.untyped_storage().data_ptr()


def view_like(t: torch.Tensor, storage: torch.UntypedStorage) -> torch.Tensor:
    """`t`'s view (offset, size, stride, dtype) of `storage` instead of its own memory, as a leaf with its
    `requires_grad` and, for an `nn.Parameter`, its class.

    >>> view_like(opt_state["exp_avg"], copied_storage)   # the same tensor, on the copy
    """
    view = torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(), t.size(), t.stride())
    return nn.Parameter(view, t.requires_grad) if isinstance(t, nn.Parameter) else view.requires_grad_(t.requires_grad)


def host_copy(state: T, only: Callable[[torch.Tensor], bool] | None = None, into: HostBuffers | None = None) -> T:
    """`state` (nested dicts and lists) with every tensor copied to host memory; tensors viewing the same memory
    (tied weights) stay one tensor, so a file written from the copy is the file written from `state`.
    `only`: copy just the tensors it says True for (views of one memory alike), leave the others as they are.
    `into`: host memory kept from an earlier copy of the same tensors, reused.

    >>> weights, opt_state = host_copy((model.state_dict(), opt.state_dict()))
    """
    copies: dict[tuple, torch.Tensor] = {}

    def one(t: torch.Tensor) -> torch.Tensor:
        if only is not None and not only(t):
            return t
        key = layout_key(t)
        if key not in copies:
            copies[key] = t.detach().to("cpu", copy=True) if into is None else into.copy(t, key)
        return copies[key]
    return map_tensors(one, state)


class Staging:
    """Where a save's late copy stands: `late` holds the memory of the tensors only the optimizer step writes
    (`step_written`); the writer's thread copies them and calls `done`; the loop `wait`s before it writes them.
    `waited_s`: how long the loop waited (counted as held by the save)."""

    def __init__(self, model: nn.Module | None = None, opt: torch.optim.Optimizer | None = None,
                 buffers: HostBuffers | None = None):
        self.late = step_written(model, opt) if model is not None else set()
        self.buffers = buffers  # where the late copy goes (None: fresh memory)
        self.waited_s = 0.0
        self._done = threading.Event()

    def is_late(self, t: torch.Tensor) -> bool:
        return t.numel() > 0 and storage_key(t) in self.late

    def done(self) -> None:
        """The late copy is made (or failed: the writer reports that); the loop may write the tensors."""
        self._done.set()

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        """Block until the late copy is made; the time is added to `waited_s`."""
        if not self._done.is_set():
            start = time.perf_counter()
            self._done.wait()
            self.waited_s += time.perf_counter() - start


class HostBuffers:
    """Host memory for the late copies of one fit's saves, reused from one save to the next (one save at a time:
    the next copy starts after the last write ended). A buffer not used by a save is dropped after it.

    >>> buffers = HostBuffers(); copy = buffers.copy(weight, key)   # the same memory at the next save
    """

    def __init__(self):
        self._by_key: dict[tuple, torch.Tensor] = {}
        self._used: dict[tuple, torch.Tensor] = {}
        self._files: dict[str, HostFile] = {}
        self._snapshots: dict[str, list[torch.UntypedStorage]] = {}
        self._late: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []  # (copy, storage): `copy_late`'s
        self._spare: dict[tuple[int, bool], list[torch.UntypedStorage]] = {}  # by (size, page-locked):
        # `reserve_storages`' memory not yet taken
        self._reserving: threading.Thread | None = None

    def file(self, name: str) -> HostFile:
        """An empty in-memory file for `name` (a file of the checkpoint), in the memory of the last save's `name`."""
        f = self._files.setdefault(name, HostFile())
        f.size = 0
        return f

    def snapshot(self, state: Any, name: str, late: Staging | None = None) -> Any | None:
        """A deep copy of `state` (a file's worth of nested dicts and lists, `name` its file) whose tensors' memory is
        host memory kept for the next snapshot of `name`: each storage copied once, so views, shared tensors and
        whole storages stay as they were and `torch.save` of the copy writes the bytes it writes of `state`.
        Every tensor becomes the same view of the copy with what torch.save writes of it (`requires_grad`, its
        Python attributes such as DeepSpeed's `ds_id`; the class of an `nn.Parameter`) and nothing else (no `.grad`),
        a view with autograd history too (DeepSpeed's slice of a master partition, which deepcopy refuses). GPU
        memory is copied into page-locked host memory (the copies queued, then waited for once). None where that
        cannot hold (a tensor on another device, a subclass, not strided, quantized, a lazy conjugate or negative;
        an object that cannot be deep-copied): the caller serializes `state` at once instead. `late`: the storages
        it says are late are copied by `copy_late` (the writer's thread), not now.

        >>> copy = buffers.snapshot(optimizer_state, "optim.pt"); ...training goes on...; torch.save(copy, f)
        """
        tensors = list(tensors_in(state))
        if any(t.device.type not in ("cpu", "cuda") or type(t) not in (torch.Tensor, nn.Parameter)
               or t.layout != torch.strided or t.is_quantized or t.is_conj() or t.is_neg() for t in tensors):
            return None
        kept, used, storages, deferred, queued = self._snapshots.get(name, []), [], {}, [], set()
        for t in tensors:
            storage = t.untyped_storage()
            if storage._cdata in storages:
                continue
            i, on_gpu = len(used), storage.device.type == "cuda"
            reuse = i < len(kept) and kept[i].nbytes() == storage.nbytes() and (not on_gpu or kept[i].is_pinned())
            copied = kept[i] if reuse else self._host_storage(storage.nbytes(), pinned=on_gpu)
            if late is not None and late.is_late(t):
                deferred.append((copied, storage))
            else:
                copied.copy_(storage, non_blocking=on_gpu)
                if on_gpu:
                    queued.add(storage.device)
            used.append(copied)
            storages[storage._cdata] = copied
        for device in queued:  # the copies were queued behind the work that computes the tensors
            torch.cuda.current_stream(device).synchronize()
        self._snapshots[name] = used
        memo: dict[Any, Any] = {"torch": storages}  # what deepcopy finds made: each tensor's view, by id
        for t in tensors:
            memo[id(t)] = view_like(t, storages[t.untyped_storage()._cdata])
        try:
            for t in tensors:  # the attributes once every view is made (one may name another tensor)
                if t.__dict__:
                    memo[id(t)].__dict__ = copy.deepcopy(t.__dict__, memo)
            snap = copy.deepcopy(state, memo)
        except Exception:  # an object whose deepcopy fails (torch.save may still pickle it)
            return None
        self._late.extend(deferred)
        return snap

    def copy_late(self) -> None:
        """Make the copies `snapshot` left for later (any thread; before the tensors are written again)."""
        late, self._late = self._late, []
        for copied, storage in late:
            copied.copy_(storage)
        self._spare.clear()  # what `reserve_storages` allocated and no snapshot took

    def _host_storage(self, nbytes: int, pinned: bool = False) -> torch.UntypedStorage:
        spare = self._spare.get((nbytes, pinned))
        return spare.pop() if spare else torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).untyped_storage()

    def reserve(self, model: nn.Module | None, opt: torch.optim.Optimizer | None) -> None:
        """Allocate (and fault in) the memory for the late copy of `model`'s parameters and `opt`'s state now, in a
        thread, so that the first save finds it ready; `ready` waits for it."""
        tensors = [t for t in _step_written_tensors(model, opt) if t.numel() and t.is_contiguous()
                   and getattr(t, "_local_tensor", None) is None]

        def allocate() -> None:
            for t in tensors:
                self._by_key[layout_key(t)] = torch.zeros(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        self._allocate(allocate)

    def reserve_storages(self, tensors: list[torch.Tensor]) -> None:
        """Allocate (and fault in) now, in a thread, host memory the size of each storage `tensors` view (page-locked
        for GPU memory), which the first `snapshot` of such a storage takes; `ready` waits for it.

        >>> buffers.reserve_storages(optimizer_partitions); buffers.ready(); buffers.snapshot(state, "optim.pt")
        """
        sizes = {t.untyped_storage()._cdata: (t.untyped_storage().nbytes(), t.is_cuda) for t in tensors
                 if t.device.type in ("cpu", "cuda") and t.numel()}

        def allocate() -> None:
            for nbytes, pinned in sizes.values():
                memory = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pinned).untyped_storage()
                self._spare.setdefault((nbytes, pinned), []).append(memory)
        self._allocate(allocate)

    def _allocate(self, allocate: Callable[[], None]) -> None:
        """Run `allocate` in a thread of its own (faulting in fresh pages takes a while); `ready` waits for it."""
        self._reserving = threading.Thread(target=allocate, name="checkpoint host memory", daemon=True)
        self._reserving.start()

    def ready(self) -> None:
        """Wait until the memory `reserve` allocates is there."""
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None

    def copy(self, t: torch.Tensor, key: tuple) -> torch.Tensor:
        """A host copy of `t` (`key`: what identifies its memory and layout), in the buffer of the last save's."""
        if not t.is_contiguous() or getattr(t, "_local_tensor", None) is not None:
            return t.detach().to("cpu", copy=True)
        buf = self._by_key.get(key)
        if buf is None:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        buf.copy_(t.detach())
        self._used[key] = buf
        return buf

    def settle(self) -> None:
        """After a save's late copy: keep only the buffers it used."""
        self._by_key, self._used = self._used, {}


class HostFile:
    """A file serialized into host memory (what `torch.save` writes into), written to disk later; its memory is kept
    for the next save of the same file (`HostBuffers.file`), so later saves fault in no fresh pages.

    >>> f = HostFile(); torch.save(state, f); ...; f.write_to(path)  # what torch.save(state, open(path, "wb")) writes
    """

    def __init__(self):
        self._memory = bytearray()
        self.size = 0

    def write(self, data) -> int:
        with memoryview(data) as view, view.cast("B") as chunk:
            written = chunk.nbytes
            self._memory[self.size:self.size + written] = chunk  # in place where the last save's bytes were
        self.size += written
        return written

    def flush(self) -> None:
        """Nothing to flush: the bytes are in memory until `write_to`."""

    def write_to(self, path: str | os.PathLike) -> None:
        """The bytes written so far into `path`, on disk (fsync) when it returns."""
        with open(path, "wb") as f, memoryview(self._memory) as view, view[:self.size] as data:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def step_written(model: nn.Module, opt: torch.optim.Optimizer | None) -> set[int]:
    """The memory of what only the optimizer step writes: `model`'s parameters and `opt`'s per-parameter state (what
    is in memory the writer's thread can read: XLA's engine copies its tensors to the CPU at the save point)."""
    return {storage_key(t) for t in _step_written_tensors(model, opt) if t.numel() and addressable(t)}


def _step_written_tensors(model: nn.Module | None, opt: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    tensors = [*model.parameters()] if model is not None else []
    per_param = getattr(opt, "state", None)  # an engine's own optimizer may keep it elsewhere: then copied at once
    if isinstance(per_param, Mapping):
        tensors += [v for state in per_param.values() if isinstance(state, Mapping)
                    for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors
