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
           "refuse_presliced"]

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
        dp_replicate_size: replicated data-parallel groups; with tp_size > 1 only 1 (HSDP under TP is not in cadence).
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
        if self.tp_size > 1 and self.dp_replicate_size > 1:
            raise ValueError(f"dp_replicate_size={self.dp_replicate_size} with tp_size={self.tp_size}: replicated FSDP "
                             f"groups (HSDP) under tensor parallelism are not in cadence yet; use dp_shard_size="
                             f"{self.dp_replicate_size * self.dp_shard_size} and dp_replicate_size=1")
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
    def sp_enabled(self) -> bool:
        return False

    def check_processes(self, num_processes: int) -> None:
        """The sizes must multiply to the number of processes; the message shows the arithmetic."""
        if self.total_size != num_processes:
            raise ValueError(f"ParallelismConfig: dp_replicate_size={self.dp_replicate_size} x dp_shard_size="
                             f"{self.dp_shard_size} x tp_size={self.tp_size} x cp_size={self.cp_size} = "
                             f"{self.total_size}, not the {num_processes} processes launched: make the product "
                             f"{num_processes} (e.g. dp_shard_size={max(1, num_processes // self.tp_size)} for "
                             f"tp_size={self.tp_size})")


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
                                  "parallelize": config.parallelize}
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
    """A model with DTensor parameters before `prepare` (`from_pretrained(tp_plan="auto")`, Accelerate's way) is
    refused: `prepare` slices it, and slicing twice would fail inside torch."""
    if config is None or not config.tp_enabled:
        return
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError(f"{type(model).__name__} is already sliced (DTensor parameters, e.g. from_pretrained("
                         f"tp_plan='auto')): under cadence prepare slices it. Build or load the plain model and give "
                         f"the plan as ParallelismConfig(parallelize=fn), a model.parallelize(tp_mesh) method, or the "
                         f"Hugging Face config's base_model_tp_plan")


class ParallelismProperties:
    """Mixed into `Accelerator`: needs `self.strategy`, `self.parallelism_config`, `self.device`."""

    @property
    def torch_device_mesh(self) -> Any:
        """The (dp, tp) DeviceMesh the model is sliced and sharded on; None without parallelism or in one process.
        `mesh["tp"]` is what `from_pretrained(..., tp_plan="auto", device_mesh=...)` takes; dp is Accelerate's
        flattened data-parallel dimension."""
        if self.parallelism_config is None or not env.is_initialized():
            return None
        mesh = getattr(self.strategy, "device_mesh", None) or getattr(self, "_device_mesh", None)
        if mesh is None:
            tp = self.parallelism_config.tp_size
            mesh = self._device_mesh = env.device_mesh(self.device.type, (env.world_size() // tp, tp), ("dp", "tp"))
            if hasattr(self.strategy, "device_mesh"):   # model_parallel slices and shards on this same mesh
                self.strategy.device_mesh = mesh
        return mesh

    def _mesh_rank(self, dim: str) -> int:
        mesh = self.torch_device_mesh
        return 0 if mesh is None else mesh.get_local_rank(dim)

    @property
    def tensor_parallel_rank(self) -> int:
        """This process's place in its tensor-parallel group (0 without TP)."""
        return self._mesh_rank("tp")

    @property
    def data_parallel_shard_rank(self) -> int:
        """This process's data-parallel group: the shard of the data (and of FSDP's parameters) it holds."""
        return self._mesh_rank("dp")

    @property
    def data_parallel_rank(self) -> int:
        """The replicated data-parallel rank: 0 (with TP only sharded dp groups exist), the process index under DDP."""
        if self.parallelism_config is not None and self.parallelism_config.dp_replicate_enabled:
            return self.process_index
        return 0

    def _metrics_group(self) -> Any:
        """The group the loaders shard over when it is not every process (tensor parallelism): the dp group."""
        if self.parallelism_config is None or not self.parallelism_config.tp_enabled or not env.is_initialized():
            return None
        return self.torch_device_mesh.get_group("dp")
