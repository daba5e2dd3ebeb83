"""`PartialState` (which process am I, and the helpers that depend on it) and `GradientState`.

Both read cadence's environment (`cadence.distributed.env`); creating a `PartialState` creates
the process group when the launcher started several processes.

>>> state = PartialState()
>>> with state.split_between_processes(prompts) as mine:     # contiguous parts, the first ones one longer
...     outputs = [generate(p) for p in mine]
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import weakref
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Callable, ClassVar, Iterator, TypeVar

import torch

from ..distributed import env, ops
from ..distributed.precision import PRECISIONS
from .plugins import DeepSpeedPlugin, distributed_type_of

__all__ = ["PartialState", "AcceleratorState", "GradientState", "shared_precision", "remember_first_accelerator",
           "is_initialized"]

T = TypeVar("T")
_UNSET = object()


class PartialState:
    """This process's place in the run: index, count, device; and the main-process helpers.

    >>> state = PartialState()
    >>> state.process_index, state.num_processes, state.device
    (0, 1, device(type='cpu'))
    """

    # Accelerate's AcceleratorState is one per process: its first Accelerator fixes the mixed precision. cadence
    # keeps a state per Accelerator and this one value per process (see `shared_precision`).
    _first_precision: ClassVar[str | None] = None
    # What this process's first Accelerator decided, which a later `AcceleratorState()` reads as Accelerate's
    # one shared state gives it: {"mixed_precision": ..., "distributed_type": ...}; None before any Accelerator.
    _first_accelerator: ClassVar[dict[str, Any] | None] = None

    def __init__(self, cpu: bool = False, backend: str | None = None, timeout: timedelta | None = None):
        env.setup_distrib(backend, timeout.total_seconds() if timeout is not None else None)
        self.device = torch.device("cpu") if cpu else env.default_device()
        self._launched = (os.environ.get("CADENCE_STRATEGY") or "ddp").lower()
        self.distributed_type = distributed_type_of(self._launched, self.device, self.num_processes)
        self.fsdp_plugin: Any = None
        self.dynamo_plugin: Any = None        # an Accelerator's state holds its TorchDynamoPlugin
        self.parallelism_config: Any = None   # an Accelerator's state holds its ParallelismConfig
        self.torch_tp_plugin: Any = None      # as Accelerate's without one: cadence's TP is the ParallelismConfig's
        self._deepspeed_plugin: Any = _UNSET
        self.mixed_precision: str | None = None   # an Accelerator's state says it (Accelerate's AcceleratorState)
        self.debug = os.environ.get("ACCELERATE_DEBUG_MODE", "").lower() in ("1", "true", "yes")
        self.initialized = True
        self.fork_launched = False   # cadence's notebook launcher starts fresh processes, never forks

    @classmethod
    def _reset_state(cls, reset_partial_state: bool = False) -> None:
        """Forget the mixed precision this process's first Accelerator fixed, so that the next Accelerator may set
        another, and what an Accelerator under ZeRO-3 told transformers (Accelerate's `AcceleratorState._reset_state()`,
        which drops the plugin that told it; for tests and notebooks).

        >>> AcceleratorState._reset_state(True)
        """
        PartialState._first_precision = None
        PartialState._first_accelerator = None
        if "transformers" in sys.modules:   # nor is transformers still told ZeRO-3 is on (`zero3_init_flag`)
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()

    @property
    def deepspeed_plugin(self) -> DeepSpeedPlugin | None:
        """The DeepSpeed plugin when the run uses DeepSpeed (`cadence launch --use_deepspeed`), else None."""
        if self._deepspeed_plugin is _UNSET:
            self._deepspeed_plugin = DeepSpeedPlugin.from_launcher() if self._launched == "deepspeed" else None
        return self._deepspeed_plugin

    @deepspeed_plugin.setter
    def deepspeed_plugin(self, plugin: DeepSpeedPlugin | None) -> None:
        self._deepspeed_plugin = plugin

    @property
    def is_fsdp2(self) -> bool:
        """True when the run is FSDP with `FullyShardedDataParallelPlugin(fsdp_version=2)`, as Accelerate says it.

        >>> Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)).state.is_fsdp2   # under FSDP
        True
        """
        return self.distributed_type == "FSDP" and getattr(self.fsdp_plugin, "fsdp_version", None) == 2

    @property
    def backend(self) -> str | None:
        """The process group's backend ("gloo", "nccl", ...); None in one process."""
        return torch.distributed.get_backend() if env.is_initialized() else None

    @property
    def default_device(self) -> torch.device:
        return env.default_device()

    def set_device(self) -> None:
        """Make this process's GPU the current one (nothing to do on a CPU)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def destroy_process_group(self, group: Any = None) -> None:
        """Destroy `group` (default: the whole run's, after which this process works alone), as at the end of
        Accelerate's inference scripts; the launcher's workers then end as they do without it.

        >>> PartialState().destroy_process_group()
        """
        if group is None:
            env.teardown_distrib()
        elif env.is_initialized():
            torch.distributed.destroy_process_group(group)

    @property
    def process_index(self) -> int:
        return env.rank()

    @property
    def local_process_index(self) -> int:
        return env.local_rank()

    @property
    def num_processes(self) -> int:
        return env.world_size()

    @property
    def use_distributed(self) -> bool:
        return env.world_size() > 1

    @property
    def is_main_process(self) -> bool:
        return env.is_main_process()

    @property
    def is_local_main_process(self) -> bool:
        return env.is_local_main_process()

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    def wait_for_everyone(self) -> None:
        """Barrier over every process."""
        ops.wait_for_everyone()

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """Run the block on the main process first, then on the others."""
        return ops.main_process_first()

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """Run the block on each machine's local main process first, then on the others."""
        return ops.local_main_process_first()

    def on_main_process(self, function: Callable[..., T]) -> Callable[..., T | None]:
        """Decorator: run `function` on the main process only."""
        return ops.on_main_process(function)

    def on_local_main_process(self, function: Callable[..., T]) -> Callable[..., T | None]:
        """Decorator: run `function` on each machine's local main process only."""
        return ops.on_local_main_process(function)

    def on_last_process(self, function: Callable[..., T]) -> Callable[..., T | None]:
        """Decorator: run `function` on the last process only."""
        return self.on_process(function, self.num_processes - 1)

    def on_process(self, function: Callable[..., T] | None = None, process_index: int | None = None) -> Any:
        """Decorator: run `function` on process `process_index` only (`@state.on_process(process_index=1)`)."""
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        if process_index is None:
            raise ValueError("on_process needs process_index, e.g. @accelerator.on_process(process_index=1)")
        return ops._only_if(lambda: self.process_index == process_index, function)

    def on_local_process(self, function: Callable[..., T] | None = None, local_process_index: int | None = None
                         ) -> Any:
        """Decorator: run `function` on local process `local_process_index` of every machine only.

        >>> @accelerator.on_local_process(local_process_index=1)
        ... def print_once_per_machine(): print("here")
        """
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        if local_process_index is None:
            raise ValueError("on_local_process needs local_process_index, "
                             "e.g. @accelerator.on_local_process(local_process_index=1)")
        return ops._only_if(lambda: self.local_process_index == local_process_index, function)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the main process only."""
        ops.main_print(*args, **kwargs)

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This process's contiguous part of `inputs` (a list, tuple, tensor, or a dict of them).

        Parts differ by at most one item, the first processes taking the longer ones; with
        `apply_padding` every part has the same length, the short ones repeating their last item,
        so the results can be gathered.

        >>> with PartialState().split_between_processes(["a", "b", "c"]) as part:   # 2 processes
        ...     part            # ['a', 'b'] on process 0, ['c'] on process 1
        """
        yield _split(inputs, self.process_index, self.num_processes, apply_padding)

    def __repr__(self) -> str:
        """Accelerate's: the kind of run and this process's place; an Accelerator's state adds its precision."""
        backend = f"  Backend: {self.backend}" if self.backend else ""
        text = (f"Distributed environment: {self.distributed_type}{backend}\nNum processes: {self.num_processes}\n"
                f"Process index: {self.process_index}\nLocal process index: {self.local_process_index}\n"
                f"Device: {self.device}\n")
        if self.mixed_precision is not None:
            text += f"\nMixed precision type: {self.mixed_precision}\n"
        if self.mixed_precision is not None and self.deepspeed_plugin is not None:
            text += f"ds_config: {self.deepspeed_plugin.deepspeed_config}\n"
        return text


class _AcceleratorStateType(type):
    """`isinstance(accelerator.state, AcceleratorState)` is True: an Accelerator's state is a `PartialState` whose
    `mixed_precision` it set."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return type.__instancecheck__(cls, obj) or (isinstance(obj, PartialState) and obj.mixed_precision is not None)


class AcceleratorState(PartialState, metaclass=_AcceleratorStateType):
    """Accelerate's `AcceleratorState()`: this process's state with the settings of its first Accelerator
    (`mixed_precision`, `distributed_type`; while that Accelerator lives, its `deepspeed_plugin`, `fsdp_plugin`,
    `dynamo_plugin` and `parallelism_config`), as Accelerate's one shared state gives them; before any Accelerator,
    `mixed_precision` is None. An Accelerator's own state is `accelerator.state`.

    >>> accelerator = Accelerator(mixed_precision="bf16")
    >>> AcceleratorState().mixed_precision
    'bf16'
    """

    def __init__(self, cpu: bool = False, backend: str | None = None, timeout: timedelta | None = None):
        super().__init__(cpu, backend, timeout)
        first = PartialState._first_accelerator or {}
        self.mixed_precision = first.get("mixed_precision")
        self.distributed_type = first.get("distributed_type", self.distributed_type)
        accelerators = first["state"]() if "state" in first else None
        if accelerators is not None:   # its plugins, as Accelerate's one shared state holds them
            self.fsdp_plugin, self.dynamo_plugin = accelerators.fsdp_plugin, accelerators.dynamo_plugin
            self.parallelism_config, self.deepspeed_plugin = (accelerators.parallelism_config,
                                                              accelerators.deepspeed_plugin)


def shared_precision(requested: str | None, distributed_type: str) -> str:
    """An Accelerator's mixed precision, as Accelerate's one AcceleratorState per process decides it.

    The process's first Accelerator takes `requested` (None: `cadence launch --mixed_precision`, else "no"); a
    later one without `mixed_precision` shares that first one's, and one with another is refused (ValueError,
    Accelerate's words). Under DeepSpeed the engine's config decides (`preparation.deepspeed_precision`).

    >>> Accelerator(mixed_precision="bf16"); Accelerator().mixed_precision
    'bf16'
    """
    first = PartialState._first_precision
    if first is None or distributed_type == "DEEPSPEED":
        return requested or os.environ.get("CADENCE_MIXED_PRECISION", "no")
    if requested is not None and requested != first and requested in PRECISIONS:
        raise ValueError(
            f"AcceleratorState has already been initialized and cannot be changed, restart your runtime completely and "
            f"pass `mixed_precision='{requested}'` to `Accelerator()`. (This process's first Accelerator set "
            f"mixed_precision='{first}', and as in Accelerate every later one shares it: leave mixed_precision out, "
            f"or pass '{first}'. A test or notebook may call AcceleratorState._reset_state() to start over.)")
    return requested or first


def remember_first_accelerator(state: PartialState) -> None:
    """Record the first Accelerator's precision (once it is built) for `shared_precision`, and with its
    distributed type for the states created after it (`AcceleratorState().mixed_precision`); its engine plugins
    while it lives (`AcceleratorState().deepspeed_plugin`: the config its engine was built from), held weakly, so
    that a plugin which told transformers ZeRO-3 is on goes with its Accelerator."""
    if PartialState._first_precision is None and state.distributed_type != "DEEPSPEED":
        PartialState._first_precision = state.mixed_precision
    if PartialState._first_accelerator is None:
        PartialState._first_accelerator = {"mixed_precision": state.mixed_precision,
                                           "distributed_type": state.distributed_type, "state": weakref.ref(state)}


def is_initialized() -> bool:
    """Whether this process has built an Accelerator (Accelerate's `accelerate.state.is_initialized()`).

    >>> Accelerator(); is_initialized()
    True
    """
    return PartialState._first_accelerator is not None


def _split(inputs: Any, index: int, n: int, pad: bool) -> Any:
    if isinstance(inputs, Mapping):
        return type(inputs)({k: _split(v, index, n, pad) for k, v in inputs.items()})
    if not isinstance(inputs, (list, tuple, torch.Tensor)):
        raise TypeError(f"split_between_processes splits lists, tuples, tensors and dicts of them, "
                        f"got {type(inputs).__name__}")
    size, extra = divmod(len(inputs), n)
    start = index * size + min(index, extra)
    part = inputs[start:start + size + (index < extra)]
    longest = math.ceil(len(inputs) / n)
    if pad and 0 < len(part) < longest:
        filler = part[-1:] if isinstance(part, torch.Tensor) else [part[-1]]
        part = torch.cat([part, filler]) if isinstance(part, torch.Tensor) else type(part)([*part, *filler])
    return part


class GradientState:
    """Whether this micro-step synchronises gradients, and which prepared loader is being iterated.

    As Accelerate's: `active_dataloader` is the innermost prepared loader being iterated (None outside
    any, `in_dataloader` False); `end_of_dataloader` is True while it yields its last batch and False
    again once the loop is over; `remainder` is the number of samples in its last, short batch over
    all processes (-1 outside a loader and with `drop_last`).

    >>> for batch in accelerator.prepare(DataLoader(range(5), batch_size=2)):
    ...     accelerator.gradient_state.remainder, accelerator.gradient_state.end_of_dataloader
    (1, False)
    (1, False)
    (1, True)
    """

    def __init__(self, num_steps: int = 1):
        self.num_steps = num_steps
        self.sync_gradients = True
        self._loaders: list[Any] = []

    @property
    def plugin_kwargs(self) -> dict[str, Any]:
        """The accumulation plugin's options as Accelerate's `GradientAccumulationPlugin.to_kwargs()` gives them."""
        return {"num_steps": self.num_steps}

    @property
    def adjust_scheduler(self) -> bool:
        """Accelerate's reading of `plugin_kwargs` (False unless set there); cadence's prepared schedulers step once
        per optimizer step either way."""
        return self.plugin_kwargs.get("adjust_scheduler", False)

    @property
    def sync_with_dataloader(self) -> bool:
        """True: a loader's last batch always ends the accumulation window."""
        return True

    @property
    def active_dataloader(self) -> Any:
        return self._loaders[-1] if self._loaders else None

    @property
    def in_dataloader(self) -> bool:
        return bool(self._loaders)

    @property
    def end_of_dataloader(self) -> bool:
        return bool(self._loaders) and self._loaders[-1].end_of_dataloader

    @property
    def remainder(self) -> int:
        dl = self.active_dataloader
        if dl is None or getattr(dl, "drop_last", True):
            return -1
        try:
            return dl.total_dataset_length % dl.total_batch_size
        except (TypeError, ValueError):   # a stream without length, or batches without a fixed size
            return -1

    def _enter(self, dl: Any) -> None:
        self._loaders.append(dl)

    def _leave(self, dl: Any) -> None:
        if dl in self._loaders:
            self._loaders.remove(dl)
