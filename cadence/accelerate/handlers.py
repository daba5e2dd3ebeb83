"""The configuration objects an Accelerate script passes to `Accelerator`, under Accelerate's names.

`kwargs_handlers` carry options for one part of the run: DDP's wrapper (and its communication hook),
the fp16 GradScaler, the process group, the profiler. `ProjectConfiguration` says where checkpoints and logs go. `DummyOptim` /
`DummyScheduler` stand for an optimizer and a schedule a DeepSpeed config names itself.

>>> accelerator = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True),
...                                            InitProcessGroupKwargs(timeout=timedelta(seconds=60))],
...                           project_config=ProjectConfiguration("runs", automatic_checkpoint_naming=True, total_limit=3))
"""

from __future__ import annotations

import dataclasses
import enum
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch

__all__ = ["KwargsHandler", "AutocastKwargs", "DDPCommunicationHookType",
           "DistributedDataParallelKwargs", "ProfileKwargs", "GradScalerKwargs", "InitProcessGroupKwargs",
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


class DDPCommunicationHookType(str, enum.Enum):
    """Accelerate's names for DDP's communication hooks (`torch.distributed.algorithms.ddp_comm_hooks`).

    NO: DDP's own averaging; FP16 / BF16: gradients sent in half precision; POWER_SGD /
    BATCHED_POWER_SGD: low-rank compression (`comm_state_option` gives PowerSGDState's options).

    >>> DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.BF16).comm_hook.value
    'bf16'
    """

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Options for `torch.nn.parallel.DistributedDataParallel` (only those changed are passed on).

    `comm_hook` is a `DDPCommunicationHookType` (or a hook function, with `comm_state`);
    `comm_wrapper` (FP16 / BF16) compresses what that hook sends, as in Accelerate. The DDP
    strategy registers the hook; an engine that is not DDP refuses these options.

    >>> Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    >>> DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.POWER_SGD,
    ...                               comm_wrapper=DDPCommunicationHookType.BF16,
    ...                               comm_state_option={"matrix_approximation_rank": 2})
    """

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = True   # cadence's default (bench/ddp.py); torch's is False
    static_graph: bool = False
    comm_hook: Any = DDPCommunicationHookType.NO
    comm_wrapper: Any = DDPCommunicationHookType.NO
    comm_state_option: dict = field(default_factory=dict)
    comm_state: Any = None

    def __post_init__(self):
        if self.comm_hook is not None and not callable(self.comm_hook):   # None: DDP's own all-reduce over gloo/NCCL
            self.comm_hook = _hook_type(self.comm_hook, "comm_hook")
        self.comm_wrapper = _hook_type(self.comm_wrapper, "comm_wrapper")
        if self.comm_wrapper not in (DDPCommunicationHookType.NO, DDPCommunicationHookType.FP16,
                                     DDPCommunicationHookType.BF16):
            raise ValueError(f"comm_wrapper={self.comm_wrapper.value!r}: a wrapper compresses to 'fp16' or 'bf16'")
        if self.comm_wrapper != DDPCommunicationHookType.NO and self.comm_hook == DDPCommunicationHookType.NO:
            raise ValueError(f"comm_wrapper={self.comm_wrapper.value!r} wraps a comm_hook: give one too "
                             f"(e.g. comm_hook=DDPCommunicationHookType.POWER_SGD), or drop the wrapper")
        power_sgd = (DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.BATCHED_POWER_SGD)
        if self.comm_state_option and self.comm_hook not in power_sgd:
            raise ValueError("comm_state_option holds PowerSGD's options: use it with comm_hook='power_sgd' "
                             "or 'batched_power_sgd'")

    def to_kwargs(self) -> dict[str, Any]:
        """DDP's options that differ from the defaults, the hook as a function with its state.

        >>> DistributedDataParallelKwargs(comm_hook="bf16").to_kwargs()["comm_hook"].__name__
        'bf16_compress_hook'
        """
        options = super().to_kwargs()
        for name in ("comm_wrapper", "comm_state_option"):
            options.pop(name, None)
        if isinstance(self.comm_hook, DDPCommunicationHookType) and self.comm_hook != DDPCommunicationHookType.NO:
            options["comm_hook"], options["comm_state"] = _torch_hook(self)
        return options


def _hook_type(value: Any, what: str) -> DDPCommunicationHookType:
    try:
        return DDPCommunicationHookType(value.value if isinstance(value, enum.Enum) else value)
    except ValueError:
        raise ValueError(f"{what}={value!r} does not exist; choose one of "
                         f"{[t.value for t in DDPCommunicationHookType]}") from None


def _torch_hook(kwargs: DistributedDataParallelKwargs) -> tuple[Callable, Any]:
    """torch's hook function and state for Accelerate's hook type and wrapper."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    kind = DDPCommunicationHookType
    hooks = {kind.FP16: default_hooks.fp16_compress_hook, kind.BF16: default_hooks.bf16_compress_hook,
             kind.POWER_SGD: powerSGD_hook.powerSGD_hook, kind.BATCHED_POWER_SGD: powerSGD_hook.batched_powerSGD_hook}
    wrappers = {kind.FP16: default_hooks.fp16_compress_wrapper, kind.BF16: default_hooks.bf16_compress_wrapper}
    hook = hooks[kwargs.comm_hook]
    if kwargs.comm_wrapper in wrappers:
        hook = wrappers[kwargs.comm_wrapper](hook)
    state = kwargs.comm_state
    if kwargs.comm_hook in (kind.POWER_SGD, kind.BATCHED_POWER_SGD) and state is None:
        state = powerSGD_hook.PowerSGDState(None, **kwargs.comm_state_option)
    return hook, state


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
class AutocastKwargs(KwargsHandler):
    """Options for the mixed-precision `torch.autocast`: `enabled`, `cache_enabled` (torch's meaning).

    In `kwargs_handlers` they apply to prepared models' forward; `accelerator.autocast(autocast_handler=...)`
    applies one to a block. In fp32 there is no autocast to adjust, as in Accelerate.

    >>> accelerator = Accelerator(cpu=True, mixed_precision="bf16",
    ...                           kwargs_handlers=[AutocastKwargs(cache_enabled=False)])
    >>> with accelerator.autocast(autocast_handler=AutocastKwargs(enabled=False)):
    ...     torch.is_autocast_enabled("cpu")       # this block runs in fp32
    False
    """

    enabled: bool = True
    cache_enabled: bool | None = None

    def autocast(self, precision: Any) -> Any:
        """The autocast context of `precision` (a cadence precision plugin) with these options."""
        if not hasattr(precision, "dtype"):   # fp32: nothing autocasts
            return precision.forward_context()
        options = {"cache_enabled": self.cache_enabled} if self.cache_enabled is not None else {}
        return torch.autocast(precision.device_type, dtype=precision.dtype, enabled=self.enabled, **options)

    def apply_to(self, precision: Any) -> Any:
        """`precision`, its forward context (what prepared models run in) taking these options."""
        precision.forward_context = lambda: self.autocast(precision)
        return precision


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Options for creating the process group: backend and timeout.

    >>> Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=120))])
    """

    backend: str | None = None
    timeout: timedelta | None = None


@dataclass
class ProfileKwargs(KwargsHandler):
    """Options for `accelerator.profile()`: torch.profiler's, plus where to write a Chrome trace.

    `activities`: "cpu", "cuda", "xpu", ... (default: torch's choice); `schedule_option`: the keys of
    `torch.profiler.schedule` (wait, warmup, active, repeat, skip_first); `output_trace_dir`: each
    process writes `profile_<process index>.json` there (Accelerate's name) when the block ends.

    >>> accelerator = Accelerator(kwargs_handlers=[ProfileKwargs(record_shapes=True, output_trace_dir="trace")])
    >>> with accelerator.profile() as prof: train_one_epoch()
    >>> accelerator.print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))
    """

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def build(self) -> torch.profiler.profile:
        """The `torch.profiler.profile` these options describe (not started)."""
        activities = None
        if self.activities is not None:
            known = {name.lower(): a for name, a in torch.profiler.ProfilerActivity.__members__.items()}
            unknown = [a for a in self.activities if a not in known]
            if unknown:
                raise ValueError(f"ProfileKwargs(activities={self.activities!r}): {unknown} unknown; choose from {sorted(known)}")
            activities = [known[a] for a in self.activities]
        schedule = torch.profiler.schedule(**self.schedule_option) if self.schedule_option is not None else None
        return torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=self.on_trace_ready,
                                      record_shapes=self.record_shapes, profile_memory=self.profile_memory,
                                      with_stack=self.with_stack, with_flops=self.with_flops,
                                      with_modules=self.with_modules)

    def trace_path(self, process_index: int) -> str | None:
        """Where process `process_index` writes its Chrome trace (None: nowhere)."""
        if self.output_trace_dir is None:
            return None
        return os.path.join(self.output_trace_dir, f"profile_{process_index}.json")


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

    @property
    def defaults(self) -> dict[str, Any]:
        """The hyper-parameters, under torch's name: what fills the config optimizer's "auto" values."""
        return {"lr": self.lr, "weight_decay": self.weight_decay, **self.kwargs}


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
