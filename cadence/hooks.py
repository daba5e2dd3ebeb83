"""`accelerate.hooks` under cadence: `ModelHook`s that run around a module's forward (`add_hook_to_module`,
`remove_hook_from_module`), as Accelerate's. cadence's big-model functions (`dispatch_model`,
`load_checkpoint_and_dispatch`, `cpu_offload`, `disk_offload`) place their own torch forward hooks;
`remove_hook_from_module` takes those off too, leaving the weights where they are.

>>> from cadence.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
>>> class Double(ModelHook):
...     def post_forward(self, module, output): return output * 2
>>> layer = add_hook_to_module(nn.Linear(2, 2, bias=False), Double())
>>> x = torch.ones(1, 2); torch.equal(layer(x), 2 * layer._old_forward(x))
True
>>> torch.equal(remove_hook_from_module(layer)(x), layer.weight.sum(1, keepdim=True).T)
True
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import nn

from .big_modeling.offload import UserCpuOffloadHook
from .utils.operations import send_to_device
from .utils.unavailable import module_getattr

__all__ = ["ModelHook", "SequentialHook", "AlignDevicesHook", "add_hook_to_module", "remove_hook_from_module",
           "remove_hook_from_submodules", "UserCpuOffloadHook"]


class ModelHook:
    """Code run around a module's forward: `pre_forward` may change the inputs, `post_forward` the output;
    `init_hook` / `detach_hook` run when the hook is added / removed. `no_grad`: run the forward under no_grad."""

    no_grad = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        return module


class SequentialHook(ModelHook):
    """Several hooks in turn: `pre_forward`s in order, then `post_forward`s in order."""

    def __init__(self, *hooks: ModelHook):
        self.hooks = hooks

    def init_hook(self, module: nn.Module) -> nn.Module:
        return functools.reduce(lambda m, h: h.init_hook(m), self.hooks, module)

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        return functools.reduce(lambda out, h: h.post_forward(module, out), self.hooks, output)

    def detach_hook(self, module: nn.Module) -> nn.Module:
        return functools.reduce(lambda m, h: h.detach_hook(m), self.hooks, module)


class AlignDevicesHook(ModelHook):
    """Run the module on `execution_device`: `init_hook` moves it there, `pre_forward` moves the inputs there (the
    `skip_keys` keyword arguments left as they are), and with `io_same_device` the output goes back to the first
    input's device. Offloading (`offload=True`) is cadence's `cpu_offload` / `disk_offload` / `dispatch_model`.

    >>> layer = add_hook_to_module(nn.Linear(2, 2), AlignDevicesHook("cpu", io_same_device=True))
    >>> layer.weight.device.type, layer(torch.ones(1, 2)).device.type
    ('cpu', 'cpu')
    """

    def __init__(self, execution_device: Any = None, offload: bool = False, io_same_device: bool = False,
                 weights_map: Any = None, offload_buffers: bool = False, place_submodules: bool = False,
                 skip_keys: str | list[str] | None = None, tied_params_map: dict | None = None):
        if offload or weights_map is not None or offload_buffers:
            raise ValueError("AlignDevicesHook(offload=True) is not in cadence: offload with cpu_offload(model), "
                             "disk_offload(model, folder) or dispatch_model(model, device_map), which hook the model "
                             "themselves")
        self.execution_device = torch.device(execution_device) if execution_device is not None else None
        self.io_same_device, self.place_submodules, self.skip_keys = io_same_device, place_submodules, skip_keys
        self.input_device: torch.device | None = None

    def init_hook(self, module: nn.Module) -> nn.Module:
        if self.execution_device is not None:
            tensors = module.parameters(recurse=self.place_submodules), module.buffers(recurse=self.place_submodules)
            for tensor in (t for group in tensors for t in group):
                tensor.data = tensor.data.to(self.execution_device)
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if self.io_same_device:
            first = next((a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)), None)
            self.input_device = first.device if first is not None else None
        if self.execution_device is None:
            return args, kwargs
        skip = [self.skip_keys] if isinstance(self.skip_keys, str) else list(self.skip_keys or [])
        moved = {k: v if k in skip else send_to_device(v, self.execution_device) for k, v in kwargs.items()}
        return send_to_device(args, self.execution_device), moved

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.io_same_device and self.input_device is not None:
            output = send_to_device(output, self.input_device)
        return output


def add_hook_to_module(module: nn.Module, hook: ModelHook, append: bool = False) -> nn.Module:
    """Run `hook` around `module`'s forward (`module._hf_hook`, the original forward `module._old_forward`); it
    replaces a hook already there, or with `append` runs after it (a `SequentialHook`)."""
    if not isinstance(hook, ModelHook):
        raise TypeError(f"add_hook_to_module takes a cadence.hooks.ModelHook, got {type(hook).__name__}")
    if append and getattr(module, "_hf_hook", None) is not None:
        hook = SequentialHook(module._hf_hook, hook)
    if getattr(module, "_hf_hook", None) is not None:
        module._hf_hook.detach_hook(module)
    if not hasattr(module, "_old_forward"):
        module._old_forward = module.forward
    module = hook.init_hook(module)
    module._hf_hook = hook

    @functools.wraps(module._old_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = module._hf_hook.pre_forward(module, *args, **kwargs)
        with torch.no_grad() if module._hf_hook.no_grad else contextlib.nullcontext():
            output = module._old_forward(*args, **kwargs)
        return module._hf_hook.post_forward(module, output)

    module.forward = forward
    return module


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Take `module`'s hook off (its `detach_hook` runs) and restore its forward, with the forward hooks cadence's
    big-model functions placed; `recurse`: its submodules' too. Weights stay where they are."""
    hook = module.__dict__.pop("_hf_hook", None)
    if hook is not None:
        hook.detach_hook(module)
    old = module.__dict__.pop("_old_forward", None)
    if old is not None:
        bound_class_forward = getattr(old, "__self__", None) is module and old.__func__ is type(module).forward
        if bound_class_forward:
            module.__dict__.pop("forward", None)
        else:
            module.forward = old
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for key in [k for k, f in hooks.items() if _placed_by_cadence(f)]:
            hooks.pop(key)
            module._forward_hooks_always_called.pop(key, None)
            module._forward_hooks_with_kwargs.pop(key, None)
            module._forward_pre_hooks_with_kwargs.pop(key, None)
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse=True)
    return module


def remove_hook_from_submodules(module: nn.Module) -> None:
    """`remove_hook_from_module` on every submodule of `module` (not on `module` itself)."""
    for child in module.children():
        remove_hook_from_module(child, recurse=True)


def _placed_by_cadence(function: Any) -> bool:
    return getattr(getattr(function, "func", function), "__module__", "").startswith("cadence.big_modeling")


_HOOKS = ("cadence's big-model functions place their own hooks: dispatch_model(model, device_map), "
          "cpu_offload(model), disk_offload(model, folder), cpu_offload_with_hook(model); remove_hook_from_module "
          "takes them off; write your own as a cadence.hooks.ModelHook")
__getattr__ = module_getattr(__name__, dict.fromkeys(
    ["CpuOffload", "LayerwiseCastingHook", "attach_align_device_hook",
     "attach_align_device_hook_on_blocks", "attach_execution_device_hook", "attach_layerwise_casting_hooks"],
    _HOOKS), "accelerate.hooks")
