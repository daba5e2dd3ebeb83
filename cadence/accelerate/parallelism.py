"""Accelerate's `ParallelismConfig`: tensor parallelism inside FSDP2 through the `Accelerator`, on cadence's
`model_parallel` strategy (`cadence.distributed.model_parallel.ModelParallel`).

The sizes have Accelerate's names; their product is the number of processes. `tp_size` > 1 slices the model
over a "tp" mesh dimension when `prepare` sees it (by `parallelize=fn(model, tp_mesh)`, cadence's addition, the
model's own `parallelize(tp_mesh)`, or a Hugging Face model's `base_model_tp_plan`), then FSDP2 shards it over
the `dp_shard_size` data-parallel groups. The ranks of one tp group see the same batches, so
`gather_for_metrics` gathers over the data-parallel group only: each sample once.

>>> from cadence import Accelerator
>>> from cadence.utils import ParallelismConfig
>>> accelerator = Accelerator(parallelism_config=ParallelismConfig(tp_size=2, dp_shard_size=2, parallelize=fn))
>>> model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)   # sliced, then sharded
>>> accelerator.torch_device_mesh["tp"], accelerator.tensor_parallel_rank
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from ..distributed import env
from ..distributed.model_parallel import parallelism_sizes

__all__ = ["ParallelismConfig", "ParallelismProperties", "parallel_engine", "launched_parallelism_config",
           "refuse_presliced", "accelerate_mesh"]

_NAMES = ("dp_replicate", "dp_shard", "tp", "cp")


@dataclass
class ParallelismConfig:
    """How the processes divide the work between tensor and data parallelism, with Accelerate's names.

    `dp_replicate_size x dp_shard_size x tp_size x cp_size` must equal the number of processes. A size left out is the one `cadence launch --parallelism_config_<name>_size`
    (or the config file's `parallelism_config` block) gave, else 1; `dp_shard_size` left out everywhere is the rest
    of the processes (cadence's reading: `tp_size=2` on 4 processes is 2 dp groups; Accelerate would refuse).

    Args:
        tp_size: processes per tensor-parallel group (they hold slices of the same layers and see the same batches).
        dp_shard_size: data-parallel groups, FSDP2-sharded (with tp_size 1 and no tensor parallelism: plain FSDP2).
        dp_replicate_size: replicated data-parallel groups (with tp_size > 1: HSDP under TP, FSDP2 shards within a
            replica over dp_shard_size processes and averages across replicas).
        cp_size, sp_size: context and DeepSpeed sequence parallelism; 1 only (shard sequences with SequenceParallel
            in the tensor-parallel plan).
        parallelize: cadence's addition, `fn(model, tp_mesh)` slicing the model with `parallelize_module`.

    >>> ParallelismConfig(tp_size=2, dp_shard_size=2).total_size
    4
    """

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    sp_size: int | None = None
    cp_backend: str | None = None
    sp_backend: str | None = None
    tp_handler: Any = None
    cp_handler: Any = None
    sp_handler: Any = None
    parallelize: Callable | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        launched = parallelism_sizes(json.loads(os.environ.get("CADENCE_PARALLELISM_CONFIG") or "{}"))
        if launched.get("pp_size", 1) > 1:
            raise ValueError(f"pp_size={launched['pp_size']} (the launcher's parallelism_config): pipeline parallelism runs "
                             f"forward, loss and backward inside its schedule, which a hand-written Accelerator loop cannot "
                             f"hand over; train with the Learner (learn.distrib_ctx(strategy='model_parallel', pp_size=...)) "
                             f"or launch without --parallelism_config_pp_size")
        self._dp_shard_given = self.dp_shard_size is not None or "dp_shard_size" in launched
        for name in _NAMES:
            size = getattr(self, f"{name}_size")
            size = launched.get(f"{name}_size", 1) if size is None else size
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"ParallelismConfig {name}_size={size!r}: give a whole number >= 1")
            setattr(self, f"{name}_size", size)
        if (self.sp_size or 1) != 1:
            raise ValueError(f"sp_size={self.sp_size}: Accelerate's sequence parallelism (DeepSpeed's) is not in cadence; "
                             f"put SequenceParallel in the tensor-parallel plan and use tp_size")
        self.sp_size = 1
        if self.cp_size != 1:
            raise ValueError(f"cp_size={self.cp_size}: context parallelism is not available in cadence yet (and torch "
                             f"has no CPU implementation of sharded attention); shard long sequences with sequence "
                             f"parallelism instead (SequenceParallel in the parallelize plan), cp_size=1")
        if self.parallelize is not None and not callable(self.parallelize):
            raise TypeError(f"parallelize must be a function fn(model, tp_mesh), got {type(self.parallelize).__name__}")

    @property
    def total_size(self) -> int:
        return self.dp_replicate_size * self.dp_shard_size * self.tp_size * self.cp_size

    @property
    def data_parallel_size(self) -> int:
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def non_data_parallel_size(self) -> int:
        return self.tp_size * self.cp_size

    @property
    def tp_enabled(self) -> bool:
        return self.tp_size > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard_size > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate_size > 1

    @property
    def cp_enabled(self) -> bool:
        return False

    @property
    def dp_dim_names(self) -> list[str]:
        """The enabled data-parallel mesh dimensions (Accelerate's names): each sees different batches."""
        return [name for name in ("dp_replicate", "dp_shard") if getattr(self, f"{name}_size") > 1]

    @property
    def non_dp_dim_names(self) -> list[str]:
        """The enabled dimensions whose ranks see the same batches: "tp"."""
        return ["tp"] if self.tp_enabled else []

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        """The dimensions FSDP shards the model over (flattened as "dp_shard_cp")."""
        return ["dp_shard"] if self.dp_shard_enabled else []

    @property
    def dp_cp_dim_names(self) -> list[str]:
        """The dimensions a loss is averaged over (flattened as "dp_cp"): the data-parallel ones here."""
        return self.dp_dim_names

    @property
    def fsdp_dim_names(self) -> list[str]:
        """The mesh dimensions FSDP applies over, replication included."""
        return (["dp_replicate"] if self.dp_replicate_enabled else []) + ["dp_shard_cp"]

    @property
    def active_mesh_dims(self) -> list[str]:
        return self.dp_dim_names + self.non_dp_dim_names

    @property
    def sp_enabled(self) -> bool:
        return False

    def check_processes(self, num_processes: int) -> None:
        """The sizes must multiply to the number of processes; the message shows the arithmetic and a fix that
        exists: a tp_size (then dp_replicate_size) that divides the processes, else the dp_shard_size filling them."""
        if self.total_size == num_processes:
            return
        n = num_processes
        product = (f"ParallelismConfig: dp_replicate_size={self.dp_replicate_size} x dp_shard_size={self.dp_shard_size}"
                   f" x tp_size={self.tp_size} x cp_size={self.cp_size} = {self.total_size}, not the {n} processes "
                   f"launched")
        fixed = self.dp_replicate_size * self.tp_size * self.cp_size  # what dp_shard_size multiplies
        if n % self.tp_size:
            fix = (f"tp_size={self.tp_size} does not divide the {n} processes, and tp_size must divide the number of "
                   f"processes: pick tp_size from {_divisors(n)} (dp_shard_size left out is the rest of the processes)")
        elif n % fixed:
            rest = n // (self.tp_size * self.cp_size)
            fix = (f"dp_replicate_size={self.dp_replicate_size} must divide the {rest} processes left by tp_size="
                   f"{self.tp_size}: one of {_divisors(rest)}")
        else:
            fix = (f"make dp_shard_size {n // fixed} (or leave it out: the rest of the processes) for "
                   f"dp_replicate_size={self.dp_replicate_size} x tp_size={self.tp_size}")
        raise ValueError(f"{product}: {fix}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def parallel_engine(config: ParallelismConfig, engine: Any, options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The strategy for `config` (and its options) given what `strategy=` / the plugins chose (`engine`, `options`).

    tp_size > 1: "model_parallel", an fsdp_plugin's options applied over dp; tp_size 1 and dp_shard_size > 1: FSDP2;
    otherwise what was chosen without it (DDP by default). One process: the plain model, whatever the sizes.
    """
    world = env.world_size()
    if world == 1 and config.total_size > 1:
        return engine, options   # cadence's reading: the plain model in one process (Accelerate refuses)
    if config.total_size == 1 and world > 1:   # Accelerate's reading: every process a data-parallel replica
        config.dp_replicate_size = world
    elif not config._dp_shard_given and world % config.total_size == 0:   # dp = the rest, as in distrib_ctx
        config.dp_shard_size = world // config.total_size
    config.check_processes(world)
    if engine == "deepspeed" or (engine is not None and engine not in ("fsdp", "model_parallel")):
        if config.tp_enabled or config.dp_shard_enabled:
            raise ValueError(f"parallelism_config with strategy {getattr(engine, 'name', engine)!r}: cadence's tensor "
                             f"parallelism runs inside FSDP2; drop strategy= / deepspeed_plugin=, or the sizes")
        return engine, options
    if config.tp_enabled:
        return "model_parallel", {**options, "tp_size": config.tp_size, "dp_shard_size": config.dp_shard_size,
                                  "dp_replicate_size": config.dp_replicate_size, "parallelize": config.parallelize}
    if config.dp_shard_enabled:
        if config.dp_replicate_enabled:
            raise ValueError(f"dp_replicate_size={config.dp_replicate_size} x dp_shard_size={config.dp_shard_size} "
                             f"(HSDP): use FullyShardedDataParallelPlugin(sharding_strategy='HYBRID_SHARD') instead")
        return "fsdp", options
    return engine, options


def launched_parallelism_config() -> ParallelismConfig | None:
    """The launcher's sizes (`--use_parallelism_config`, or a config file's parallelism_config block), else None."""
    return ParallelismConfig() if os.environ.get("CADENCE_PARALLELISM_CONFIG") else None


def refuse_presliced(model: Any, config: ParallelismConfig | None) -> None:
    """A model with DTensor parameters before `prepare` (`from_pretrained(tp_plan="auto")`) needs a parallelism_config
    with tp_size > 1: only model_parallel takes a sliced model."""
    if config is not None and config.tp_enabled:
        return
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError(f"{type(model).__name__} is already sliced (DTensor parameters, e.g. from_pretrained("
                         f"tp_plan='auto')), but the Accelerator has no tensor parallelism: pass the plain model with "
                         f"Accelerator(parallelism_config=ParallelismConfig(tp_size=...)), and prepare slices it")


def accelerate_mesh(device_type: str, config: ParallelismConfig) -> tuple[Any, Any]:
    """Accelerate's device mesh for `config`: the enabled dimensions in its order (dp_replicate, dp_shard, tp) and
    "dp", "dp_shard_cp", "dp_cp" flattened from them, as Accelerate's `ParallelismConfig.build_device_mesh` makes it.

    model_parallel slices and shards on this mesh as it is; for it a "dp_shard" of size 1 stands next to a
    "dp_replicate" under TP (HSDP), and a "dp" of size 1 before "tp" when no data-parallel dimension is enabled.
    Returns the mesh and the data-parallel process group (cadence's own code keeps off torch's deprecated slicing
    of a flattened dimension from the root mesh; users' `mesh["dp_cp"]` is Accelerate's way).
    """
    import torch.distributed as dist

    sizes = {"dp_replicate": config.dp_replicate_size, "dp_shard": config.dp_shard_size, "tp": config.tp_size}
    names = config.active_mesh_dims
    if config.tp_enabled and config.dp_replicate_enabled and not config.dp_shard_enabled:
        names.insert(1, "dp_shard")
    dp_dims = [n for n in names if n.startswith("dp_")]
    if not dp_dims:
        names, sizes["dp"] = ["dp", *names], env.world_size() // config.tp_size
    mesh = env.device_mesh(device_type, tuple(sizes[n] for n in names), tuple(names))
    groups = {"dp": mesh["dp"].get_group()} if not dp_dims else {}
    shard_dims = ["dp_shard"] if "dp_shard" in names else []   # for `mesh[config.fsdp_dim_names]` under HSDP too
    for flat, dims in (("dp", dp_dims), ("dp_shard_cp", shard_dims), ("dp_cp", dp_dims)):
        if dims:
            groups[flat] = mesh[tuple(dims) if len(dims) > 1 else dims[0]]._flatten(flat).get_group()
            dist.distributed_c10d._set_pg_timeout(env.timeout(), groups[flat])   # as env.device_mesh does
    return mesh, groups["dp"]


class ParallelismProperties:
    """Mixed into `Accelerator`: needs `self.strategy`, `self.parallelism_config`, `self.device`."""

    @property
    def torch_device_mesh(self) -> Any:
        """Accelerate's DeviceMesh (`accelerate_mesh`): enabled dimensions dp_replicate, dp_shard, tp, and the flattened
        "dp", "dp_shard_cp", "dp_cp"; None without parallelism or in one process. `model_parallel` slices and shards
        on it; a model sliced before `prepare` must be sliced on its "tp" (transformers 5.24's `from_pretrained(
        tp_plan="auto")` builds its own mesh, the same one only with tp alone)."""
        if self.parallelism_config is None or not env.is_initialized():
            return None
        mesh = getattr(self, "_device_mesh", None)
        if mesh is None:
            mesh, self._dp_group = accelerate_mesh(self.device.type, self.parallelism_config)
            self._device_mesh = mesh
        if getattr(self.strategy, "device_mesh", False) is None:   # model_parallel, before it built its own
            self.strategy.device_mesh = mesh
        return mesh

    def _mesh_rank(self, dim: str) -> int:
        mesh = self.torch_device_mesh
        return 0 if mesh is None or dim not in mesh.mesh_dim_names else mesh.get_local_rank(dim)

    @property
    def tensor_parallel_rank(self) -> int:
        """This process's place in its tensor-parallel group (0 without TP)."""
        return self._mesh_rank("tp") if self.parallelism_config is not None and self.parallelism_config.tp_enabled else 0

    @property
    def data_parallel_shard_rank(self) -> int:
        """This process's place on "dp_shard": the shard of the data (and of FSDP's parameters) it holds; 0 when
        dp_shard_size is 1."""
        enabled = self.parallelism_config is not None and self.parallelism_config.dp_shard_enabled
        return self._mesh_rank("dp_shard") if enabled else 0

    @property
    def data_parallel_rank(self) -> int:
        """This process's replica on "dp_replicate"; 0 when dp_replicate_size is 1."""
        enabled = self.parallelism_config is not None and self.parallelism_config.dp_replicate_enabled
        return self._mesh_rank("dp_replicate") if enabled else 0

    def _metrics_group(self) -> Any:
        """The group the loaders shard over when it is not every process (tensor parallelism): the dp group."""
        if self.parallelism_config is None or not self.parallelism_config.tp_enabled or not env.is_initialized():
            return None
        self.torch_device_mesh   # built with its dp group
        return self._dp_group
