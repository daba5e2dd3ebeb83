"""Gradient averaging through shared memory, for DDP on CPU when every rank runs on one machine.

gloo's all-reduce sends each gradient through the loopback network and synchronizes through its
own threads; processes on one machine can instead read each other's gradients in place. Each rank
owns a small shared-memory region (two chunk-sized slots and a counter): it writes its chunk of
gradient divided by the world size into a slot, raises its counter, waits for every counter, and
sums the slots in rank order. Every rank adds the same numbers in the same order, so the replicas
stay bitwise identical; on 2 ranks the result is bitwise gloo's (a/2 + b/2 either way). Slots
alternate between two buffers, so one wait per chunk suffices: a rank can only overwrite a slot
after every rank has announced the next chunk, which it does after reading this one.

The wait ends, like a collective, at the process-group timeout or when a peer process is gone.
It relies on x86's store ordering (a counter seen raised means the slot written before it is
visible), so `available()` answers False elsewhere and DDP keeps its own all-reduce. It also
answers False, on every rank alike, when the regions would take more than half of the free space in
/dev/shm (Docker's default is 64 MB; DataLoader workers share tensors there too), and the regions
are reserved when made, so a full /dev/shm later cannot crash training with SIGBUS. A region's name
ends with its maker's pid: one left by a process killed while setting up is removed by the next job.

>>> hook = SharedMemoryAllReduce()          # collective: every rank, after init_process_group
>>> ddp_model.register_comm_hook(hook, SharedMemoryAllReduce.hook)
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
import platform
import time
import uuid
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from . import env

__all__ = ["SharedMemoryAllReduce", "SharedMemoryUnavailable"]


class SharedMemoryUnavailable(RuntimeError):
    """Raised on every rank alike when the regions cannot be made: the caller keeps gloo's all-reduce."""

_SHM_DIR = "/dev/shm"
DEFAULT_CHUNK_MB = 4.0
_HEADER = 64                          # bytes before the slots: the counter, kept on its own cache line
_X86 = ("x86_64", "amd64", "i386", "i686")
_SPINS_BEFORE_SLEEP = 200
_LIVENESS_CHECK_S = 1.0


class SharedMemoryAllReduce:
    """DDP communication hook state: averages each gradient bucket through shared memory.

    `chunk_mb` bounds the memory: each rank maps two slots of that size (the buckets pass through
    in chunks), whatever the model's size.
    """

    def __init__(self, chunk_mb: float = DEFAULT_CHUNK_MB):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.chunk_bytes = _chunk_bytes(chunk_mb)
        self.timeout_s = _group_timeout().total_seconds()
        token, pid = [uuid.uuid4().hex if self.rank == 0 else None], os.getpid()
        dist.broadcast_object_list(token, src=0)
        self.pids: list[int] = [0] * self.world
        dist.all_gather_object(self.pids, pid)
        _remove_stale_regions()
        paths = [os.path.join(_SHM_DIR, f"cadence-ddp-{token[0]}-{r}-{p}") for r, p in enumerate(self.pids)]
        size, own = _HEADER + 2 * self.chunk_bytes, paths[self.rank]
        try:
            error = _reserve(own, size)
            made = torch.tensor([int(error is None)])
            dist.all_reduce(made, op=dist.ReduceOp.MIN)     # also: from here on every rank's region exists
            if not made.item():
                raise SharedMemoryUnavailable(
                    f"DDP averages gradients with gloo's all-reduce, not through shared memory: {size / 2**20:.0f} MiB "
                    f"could not be reserved in {_SHM_DIR} on every rank ({error or 'another rank ran out'})")
            regions = [torch.from_file(p, shared=True, size=size, dtype=torch.uint8) for p in paths]
            dist.barrier()                  # every rank mapped every region: the names can go
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(own)              # nothing is left in /dev/shm, however the run ends
        self.counters = [region[:8].view(torch.int64) for region in regions]
        self.slots = [region[_HEADER:].view(2, self.chunk_bytes) for region in regions]
        self.sequence = int(self.counters[self.rank].item())

    @staticmethod
    def available(device: torch.device, chunk_mb: float = DEFAULT_CHUNK_MB) -> bool:
        """True when this job can use it: CPU tensors, every rank on this x86 machine, room in /dev/shm.

        Collective once the other conditions hold (the ranks agree on the room); rank 0 warns when
        room is what is missing.
        """
        if not (device.type == "cpu" and env.is_initialized() and dist.get_world_size() > 1
                and int(os.environ.get("LOCAL_WORLD_SIZE", "0")) == dist.get_world_size()
                and platform.machine().lower() in _X86 and os.path.isdir(_SHM_DIR)):
            return False
        stat = os.statvfs(_SHM_DIR)
        free = torch.tensor([stat.f_bavail * stat.f_frsize], dtype=torch.int64)
        dist.all_reduce(free, op=dist.ReduceOp.MIN)         # every rank decides from the same number
        world, free = dist.get_world_size(), int(free.item())
        wanted = 2 * world * (_HEADER + 2 * _chunk_bytes(chunk_mb))
        if wanted > free and dist.get_rank() == 0:
            warnings.warn(f"DDP averages gradients with gloo's all-reduce, not through shared memory: {_SHM_DIR} has "
                          f"{free / 2**20:.1f} MiB free and {world} processes want {math.ceil(wanted / 2**20)} MiB "
                          f"free (their regions, with as much to spare). Give it more (Docker: --shm-size=1g), "
                          f"or pass comm_hook=None to choose gloo without this warning")
        return wanted <= free

    @staticmethod
    def hook(state, bucket):                # no annotations: DDP checks them against objects, not strings
        """The function DDP calls for each `dist.GradBucket`: average it in place, return a done Future."""
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(state.average_(bucket.buffer()))
        return future

    def average_(self, flat: torch.Tensor) -> torch.Tensor:
        """Replace the 1-D tensor `flat` by its mean over the ranks; every rank calls it with the same shape."""
        per_chunk = self.chunk_bytes // flat.element_size()
        for start in range(0, flat.numel(), per_chunk):
            self._average_chunk(flat[start:start + per_chunk])
        return flat

    def _average_chunk(self, part: torch.Tensor) -> None:
        slot = self.sequence % 2
        views = [s[slot, :part.numel() * part.element_size()].view(part.dtype) for s in self.slots]
        torch.div(part, self.world, out=views[self.rank])
        self.sequence += 1
        self.counters[self.rank].fill_(self.sequence)
        self._wait_for_all(self.sequence)
        torch.add(views[0], views[1], out=part)
        for view in views[2:]:
            part.add_(view)

    def _wait_for_all(self, sequence: int) -> None:
        start = last_check = time.monotonic()
        for peer, counter in enumerate(self.counters):
            spins = 0
            while int(counter.item()) < sequence:
                spins += 1
                if spins < _SPINS_BEFORE_SLEEP:
                    continue
                time.sleep(50e-6)           # give the core back: there may be more ranks than cores
                now = time.monotonic()
                if now - start > self.timeout_s:
                    raise RuntimeError(f"shared-memory gradient all-reduce timed out after {self.timeout_s:.0f} s "
                                       f"waiting for rank {peer} (the process-group timeout)")
                if now - last_check > _LIVENESS_CHECK_S:
                    last_check = now
                    self._check_alive(peer)

    def _check_alive(self, peer: int) -> None:
        try:
            os.kill(self.pids[peer], 0)
        except ProcessLookupError:
            raise RuntimeError(f"rank {peer} (pid {self.pids[peer]}) exited during the gradient all-reduce") from None


def _chunk_bytes(chunk_mb: float) -> int:
    return max(64, int(chunk_mb * 2**20) // 64 * 64)


def _remove_stale_regions() -> None:
    """Remove the regions of processes that died (SIGKILL) between making and unlinking them: the name ends with
    the maker's pid."""
    for path in glob.glob(os.path.join(_SHM_DIR, "cadence-ddp-*-*-*")):
        try:
            os.kill(int(path.rsplit("-", 1)[1]), 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        except (ValueError, PermissionError):
            pass                            # not ours, or a live process of another user


def _reserve(path: str, size: int) -> OSError | None:
    """Create `path` with `size` bytes allocated now (ENOSPC here, not SIGBUS at a write); the error, if any."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        return e
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        return e
    finally:
        os.close(fd)
    return None


def _group_timeout() -> timedelta:
    """The default process group's timeout (what a gloo collective would wait); cadence's setting if unreadable."""
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        return backend.options._timeout
    except (AttributeError, RuntimeError):
        return env.timeout()
