"""Where this process sits in a job: rank, world size, device. Pure functions over the
environment (torchrun, SLURM, Open MPI) and `torch.distributed`; nothing here has side effects
except `setup_distrib` / `teardown_distrib`.

>>> rank(), world_size(), is_main_process()      # in a plain `python script.py`
(0, 1, True)
"""

from __future__ import annotations

import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from cadence.distributed.lifecycle import install_exit_guard

DEFAULT_TIMEOUT_S = 600.0

# variable names, most specific first: torchrun / cadence launch, SLURM, Open MPI
_RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")
_WORLD_VARS = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
_LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")
_NODE_RANK_VARS = ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID")


def _env_int(names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return default


def is_initialized() -> bool:
    """True when a `torch.distributed` process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """Global rank of this process (0 in a single process).

    >>> rank()   # in a single process
    0
    """
    return dist.get_rank() if is_initialized() else _env_int(_RANK_VARS, 0)


def world_size() -> int:
    """Number of processes in the job (1 in a single process).

    >>> world_size()   # in a single process
    1
    """
    return dist.get_world_size() if is_initialized() else _env_int(_WORLD_VARS, 1)


def local_rank() -> int:
    """Rank of this process on its machine.

    >>> local_rank()   # in a single process
    0
    """
    return _env_int(_LOCAL_RANK_VARS, 0)


def node_rank() -> int:
    """Rank of this process's machine."""
    return _env_int(_NODE_RANK_VARS, 0)


def is_main_process() -> bool:
    """True on global rank 0.

    >>> is_main_process()   # in a single process
    True
    """
    return rank() == 0


def is_local_main_process() -> bool:
    """True on local rank 0 (one per machine).

    >>> is_local_main_process()   # in a single process
    True
    """
    return local_rank() == 0


def is_distributed() -> bool:
    """True when more than one process takes part.

    >>> is_distributed()   # in a single process
    False
    """
    return world_size() > 1


def default_device(local: int | None = None) -> torch.device:
    """The accelerator this process should use: `cuda:<local_rank>`, else `mps`, else `cpu`.

    >>> default_device()            # on a machine without GPU
    device(type='cpu')
    """
    if os.environ.get("CADENCE_USE_CPU", "") in ("1", "true", "True"):
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() if local is None else local)
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def timeout() -> timedelta:
    """Process-group timeout: `$CADENCE_TIMEOUT` seconds (set by `cadence launch --timeout`), else 600 s."""
    value = os.environ.get("CADENCE_TIMEOUT", DEFAULT_TIMEOUT_S)
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise ValueError(f"CADENCE_TIMEOUT={value!r}: the collective timeout must be a positive, finite number of "
                         f"seconds (`cadence launch --timeout 600`)")
    return timedelta(seconds=seconds)


def setup_distrib(backend: str | None = None, timeout_s: float | None = None) -> bool:
    """Create the default process group when launched on several processes (fastai's name).

    Returns True when this call created the group, so the caller knows to destroy it.
    gloo on CPU, nccl on CUDA; the timeout is always finite.

    >>> created = setup_distrib()      # no-op (False) in a single process
    """
    if is_initialized() or _env_int(_WORLD_VARS, 1) < 2:
        return False
    device = default_device()
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _export_torchrun_vars()
    wait = timedelta(seconds=timeout_s) if timeout_s is not None else timeout()
    store, rank_, size = next(dist.rendezvous("env://", timeout=wait))
    dist.init_process_group(backend=backend, store=dist.PrefixStore(_store_prefix(), store),
                            rank=rank_, world_size=size, timeout=wait)
    install_exit_guard()        # plain torchrun: never reach interpreter finalization with this group alive
    return True


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]):
    """`init_device_mesh` whose sub-groups keep the run's timeout (torch gives them its 30-minute default, so a
    rank hung in a collective of one mesh dimension would hold the job for half an hour).

    >>> mesh = device_mesh("cpu", (2, 2), ("dp", "tp"))    # 4 processes launched
    """
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    for dim in range(len(shape)):
        dist.distributed_c10d._set_pg_timeout(timeout(), mesh.get_group(dim))
    return mesh


def _store_prefix() -> str:
    """Keys of this group in the rendezvous store: unique per restart of the job and per group of the process.

    torchrun's agent keeps one store across `--max_restarts` restarts; a restarted worker that
    used the old prefix would read the addresses of the dead workers it replaces.
    """
    return f"cadence/restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/group{_next_generation()}"


def _next_generation() -> int:
    """How many groups this process created before: a fresh store prefix for each one.

    torch reuses the key prefix of a destroyed default group, so a second group would read the
    first one's stale addresses (and fail to connect); every rank creates its groups in the same
    order, so the count agrees across ranks.
    """
    generation = int(os.environ.get("CADENCE_GROUP_GENERATION", "0"))
    os.environ["CADENCE_GROUP_GENERATION"] = str(generation + 1)
    return generation


def _export_torchrun_vars() -> None:
    """SLURM / Open MPI jobs: give `init_process_group` the variables torchrun would have set."""
    os.environ.setdefault("RANK", str(_env_int(_RANK_VARS, 0)))
    os.environ.setdefault("WORLD_SIZE", str(_env_int(_WORLD_VARS, 1)))
    os.environ.setdefault("LOCAL_RANK", str(local_rank()))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")


def teardown_distrib() -> None:
    """Destroy the default process group if there is one (fastai's name).

    >>> teardown_distrib()   # nothing to destroy in a single process
    """
    if is_initialized():
        dist.destroy_process_group()
