"""Accelerate's `cpu_offload`, `disk_offload` and `load_checkpoint_in_model`, on `dispatch_model`'s streaming, and
`cpu_offload_with_hook` (a whole model moved to the device when called, back to the CPU when told).

>>> model = cpu_offload(model, execution_device="cuda")          # weights in CPU memory, loaded per module
>>> model = disk_offload(model, "offload", execution_device="cuda")
>>> load_checkpoint_in_model(model, "export/")                   # weights in place, no hooks
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch import nn

from ..serialization import check_state_dict
from .device_map import DISK, Device, device_of, normalize_device
from .dispatch import _move, dispatch_model, with_tied_aliases
from .weights import checkpoint_refs, read_tensor

__all__ = ["cpu_offload", "disk_offload", "load_checkpoint_in_model", "cpu_offload_with_hook", "UserCpuOffloadHook"]


def cpu_offload(model: nn.Module, execution_device: Device | None = None) -> nn.Module:
    """Keep `model`'s weights in CPU memory, each module's loaded onto `execution_device` for its forward only.

    `execution_device` defaults to the first GPU, else the CPU. It is `dispatch_model` with every weight
    on "cpu".

    >>> cpu_offload(model, execution_device="cpu")(torch.ones(1, 4)).shape
    torch.Size([1, 2])
    """
    return dispatch_model(model, {"": "cpu"}, main_device=execution_device if execution_device is not None
                          else _default_device())


class UserCpuOffloadHook:
    """What `cpu_offload_with_hook` returns: `offload()` moves the model back to the CPU, `remove()` takes the hook
    off (the model stays where it is).

    >>> model, hook = cpu_offload_with_hook(model, "cuda"); model(x); hook.offload()
    """

    def __init__(self, model: nn.Module, handle: Any):
        self.model, self.handle = model, handle

    def offload(self) -> None:
        self.model.to("cpu")

    def remove(self) -> None:
        self.handle.remove()


def cpu_offload_with_hook(model: nn.Module, execution_device: Device | torch.device | None = None,
                          prev_module_hook: UserCpuOffloadHook | None = None
                          ) -> tuple[nn.Module, UserCpuOffloadHook]:
    """Move `model` to the CPU, hooked so that each call moves it whole to `execution_device` (Accelerate's).

    The default device is the first GPU, else the CPU. The model (and its inputs) stay there until
    `hook.offload()`; a `prev_module_hook` is offloaded just before this model runs, so that a pipeline of models
    keeps one on the GPU at a time (`cpu_offload_with_hook(m2, "cuda", prev_module_hook=hook_1)`).

    >>> model, hook = cpu_offload_with_hook(model, execution_device="cpu")
    >>> model(torch.ones(1, 4)).shape
    torch.Size([1, 2])
    >>> hook.offload()
    """
    device = _default_device() if execution_device is None else torch.device(
        "cuda", execution_device) if isinstance(execution_device, int) else torch.device(execution_device)
    model.to("cpu")
    handle = model.register_forward_pre_hook(functools.partial(_to_execution_device, device, prev_module_hook),
                                             with_kwargs=True)
    return model, UserCpuOffloadHook(model, handle)


def _to_execution_device(device: torch.device, prev: UserCpuOffloadHook | None, module: nn.Module, args: tuple,
                         kwargs: dict) -> tuple[tuple, dict]:
    if prev is not None and _device(prev.model) != torch.device("cpu"):
        prev.offload()
    if _device(module) != device:   # already there: the model stays, its inputs still move (Accelerate's)
        module.to(device)
    return _move(args, device), _move(kwargs, device)


def _device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def disk_offload(model: nn.Module, offload_dir: str | os.PathLike, execution_device: Device | None = None
                 ) -> nn.Module:
    """Write `model`'s weights to `offload_dir`, each module's loaded onto `execution_device` for its forward only.

    The weights are safetensors files; `execution_device` defaults to the first GPU, else the CPU.

    >>> disk_offload(model, "offload", execution_device="cpu")(torch.ones(1, 4)).shape
    torch.Size([1, 2])
    """
    return dispatch_model(model, {"": DISK}, main_device=execution_device if execution_device is not None
                          else _default_device(), offload_dir=offload_dir)


def load_checkpoint_in_model(model: nn.Module, checkpoint: str | os.PathLike,
                             device_map: dict[str, Device] | None = None, dtype: torch.dtype | None = None,
                             strict: bool = False) -> None:
    """Load the weights of `checkpoint` into `model` in place, as Accelerate's (no hooks, nothing returned).

    `checkpoint`: a safetensors or torch file, a directory, a sharded index. The weights go to the
    devices `device_map` names (default: where each weight is, the CPU for a meta one), floating-point
    ones cast to `dtype`. `dispatch_model` (or `load_checkpoint_and_dispatch`) makes a model spread over
    devices run. `strict`: refuse a checkpoint whose names or shapes differ from the model's; otherwise
    the model's weights it lacks stay as they are and names the model lacks are ignored.

    >>> torch.save(model.state_dict(), "weights.pt")
    >>> with init_empty_weights():
    ...     empty = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> load_checkpoint_in_model(empty, "weights.pt")
    >>> torch.equal(empty[0].weight, model[0].weight)
    True
    """
    refs = with_tied_aliases(model, checkpoint_refs(checkpoint))
    if strict:
        check_state_dict(model, refs, source=str(checkpoint))
    device_map = {k: normalize_device(v) for k, v in (device_map or {}).items()}
    if DISK in device_map.values():
        raise ValueError("load_checkpoint_in_model keeps weights in memory; for weights on 'disk' use "
                         "load_checkpoint_and_dispatch(model, checkpoint, device_map=..., offload_folder=...)")
    loaded: dict[int, torch.Tensor] = {}   # id(tensor) -> its new value: tied weights stay tied
    for module_name, module in model.named_modules():
        for slots in (module._parameters, module._buffers):
            for attr, current in slots.items():
                full = f"{module_name}.{attr}" if module_name else attr
                if current is None or full not in refs:
                    continue
                if id(current) not in loaded:
                    loaded[id(current)] = _loaded(refs[full], current, device_of(full, device_map), dtype)
                slots[attr] = loaded[id(current)]


def _loaded(ref, current: torch.Tensor, device: Device | None, dtype: torch.dtype | None) -> torch.Tensor:
    if device is None:
        device = "cpu" if current.is_meta else current.device
    value = read_tensor(ref, torch.device("cuda", device) if isinstance(device, int) else device)
    if dtype is not None and value.is_floating_point():
        value = value.to(dtype)
    return nn.Parameter(value, requires_grad=current.requires_grad) if isinstance(current, nn.Parameter) else value


def _default_device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
