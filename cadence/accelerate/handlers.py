"""The configuration objects an Accelerate script passes to `Accelerator`, under Accelerate's names.

`kwargs_handlers` carry options for one part of the run: DDP's wrapper, the fp16 GradScaler, the
process group. `ProjectConfiguration` says where checkpoints and logs go. `DummyOptim` /
`DummyScheduler` stand for an optimizer and a schedule a DeepSpeed config names itself.

>>> accelerator = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True),
...                                            InitProcessGroupKwargs(timeout=timedelta(seconds=60))],
...                           project_config=ProjectConfiguration("runs", automatic_checkpoint_naming=True, total_limit=3))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

__all__ = ["KwargsHandler", "DistributedDataParallelKwargs", "GradScalerKwargs", "InitProcessGroupKwargs",
           "ProjectConfiguration", "DummyOptim", "DummyScheduler"]


class KwargsHandler:
    """Base of the kwargs handlers: `to_kwargs()` gives the options that differ from the defaults."""

    def to_kwargs(self) -> dict[str, Any]:
        """The fields whose value differs from the default, as a dict.

        >>> DistributedDataParallelKwargs(find_unused_parameters=True).to_kwargs()
        {'find_unused_parameters': True}
        """
        default = type(self)()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Options for `torch.nn.parallel.DistributedDataParallel` (only those changed are passed on).

    >>> Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    """

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = True   # cadence's default (bench/ddp.py); torch's is False
    static_graph: bool = False
    comm_hook: Callable | None = None
    comm_state: Any = None


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Options for the fp16 `torch.amp.GradScaler`.

    >>> Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024)])
    """

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Options for creating the process group: backend and timeout.

    >>> Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=120))])
    """

    backend: str | None = None
    timeout: timedelta | None = None


@dataclass
class ProjectConfiguration:
    """Where a run writes: `project_dir` (checkpoints under `project_dir/checkpoints`), `logging_dir` (trackers).

    With `automatic_checkpoint_naming`, `save_state()` writes `checkpoints/checkpoint_<iteration>` and
    keeps the newest `total_limit`; `iteration` is the number the next one gets.

    >>> ProjectConfiguration("runs/exp1", automatic_checkpoint_naming=True, total_limit=2)
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self):
        if self.total_limit is not None and (not isinstance(self.total_limit, int) or self.total_limit < 1):
            raise ValueError(f"ProjectConfiguration(total_limit={self.total_limit!r}): use a positive int or None")
        if self.logging_dir is None:
            self.logging_dir = self.project_dir


@dataclass
class DummyOptim:
    """Stands for the optimizer a DeepSpeed config names: the parameters and the values the config may leave "auto".

    `prepare` hands it to the strategy, which builds the engine's optimizer from it; a strategy
    that builds no optimizer from a config refuses it with what to do.

    >>> optimizer = DummyOptim(model.parameters(), lr=3e-4, weight_decay=0.01)
    """

    params: Any
    lr: float = 1e-3
    weight_decay: float = 0.0
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self.params = list(self.params)


@dataclass
class DummyScheduler:
    """Stands for the learning-rate schedule a DeepSpeed config names: its length and warm-up.

    >>> scheduler = DummyScheduler(optimizer, total_num_steps=1000, warmup_num_steps=100)
    """

    optimizer: Any
    total_num_steps: int | None = None
    warmup_num_steps: int = 0
    lr_scheduler_callable: Callable | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
