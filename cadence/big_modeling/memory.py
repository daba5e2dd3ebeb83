"""Accelerate's model-memory helpers: `compute_module_sizes`, `get_balanced_memory`, `find_tied_parameters`,
`set_module_tensor_to_device`, `load_state_dict`, with Accelerate's arguments and results.

>>> with init_empty_weights():
...     model = BigModel()
>>> get_balanced_memory(model, max_memory={0: "10GiB", 1: "10GiB", "cpu": "30GiB"}, no_split_module_classes=["Block"])
{0: 5405000000.0, 1: 10737418240, 'cpu': 30000000000}
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import nn

from .weights import checkpoint_refs, read_tensor

__all__ = ["compute_module_sizes", "get_balanced_memory", "find_tied_parameters", "set_module_tensor_to_device",
           "load_state_dict", "dtype_byte_size"]

_INTEGRAL = ("torch.uint", "torch.int", "torch.bool")


def dtype_byte_size(dtype: torch.dtype) -> float:
    """Bytes one element of `dtype` takes, as Accelerate counts them (a bool is 1/8).

    >>> dtype_byte_size(torch.float16), dtype_byte_size(torch.bool)
    (2, 0.125)
    """
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"`dtype` is not a valid dtype: {dtype!r}")
    return 1 / 8 if dtype == torch.bool else dtype.itemsize


def _as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A dtype from "float16", "torch.float16" or the dtype itself."""
    if isinstance(dtype, str):
        found = getattr(torch, dtype.replace("torch.", ""), None)
        if not isinstance(found, torch.dtype):
            raise ValueError(f"{dtype!r} is not a torch dtype (e.g. 'float16', torch.bfloat16)")
        return found
    return dtype


def compute_module_sizes(model: nn.Module, dtype: str | torch.dtype | None = None,
                         special_dtypes: dict[str, str | torch.dtype] | None = None,
                         buffers_only: bool = False) -> dict[str, float]:
    """Bytes under every module and tensor name ("" is the whole model), as Accelerate computes them: a tied weight
    counts once; with `dtype`, a floating-point tensor counts at the smaller of its own and `dtype`'s size;
    `special_dtypes` gives some tensors their own dtype. A defaultdict (an unknown name is 0).

    >>> dict(compute_module_sizes(nn.Linear(4, 2)))
    {'': 40, 'weight': 32, 'bias': 8}
    """
    dtype_size = dtype_byte_size(_as_dtype(dtype)) if dtype is not None else None
    special = {k: dtype_byte_size(_as_dtype(v)) for k, v in (special_dtypes or {}).items()}
    tensors = (model.named_buffers() if buffers_only else
               [*model.named_parameters(), *model.named_buffers()])
    sizes: dict[str, float] = defaultdict(int)
    for name, tensor in tensors:
        own = dtype_byte_size(tensor.dtype)
        if name in special:
            itemsize = special[name]
        elif dtype_size is None or str(tensor.dtype).startswith(_INTEGRAL):
            itemsize = own
        else:
            itemsize = min(dtype_size, own)
        parts = name.split(".")
        for i in range(len(parts) + 1):
            sizes[".".join(parts[:i])] += tensor.numel() * itemsize
    return sizes


def get_balanced_memory(model: nn.Module, max_memory: dict[int | str, int | str] | None = None,
                        no_split_module_classes: Iterable[str] | str | None = None,
                        dtype: str | torch.dtype | None = None,
                        special_dtypes: dict[str, str | torch.dtype] | None = None,
                        low_zero: bool = False) -> dict[int | str, float]:
    """A `max_memory` for `infer_auto_device_map` that spreads the model evenly over the GPUs, as Accelerate's.

    Each GPU but the last gets the model's size / the number of GPUs, plus a margin (1.25 x the largest of the
    no-split blocks and the mean size of the last-level modules); the last keeps its whole budget. `low_zero`
    leaves on GPU 0 only what the others cannot hold (room for `generate`'s work). Without GPUs in `max_memory`
    (default: what `get_max_memory()` finds), `max_memory` comes back as given, in bytes.

    >>> get_balanced_memory(model, {0: 10**6, 1: 10**6, "cpu": 10**7}, no_split_module_classes=["Block"])
    {0: 167240.0, 1: 1000000, 'cpu': 10000000}
    """
    from ..utils.modeling import get_max_memory  # cadence.utils gathers this module: imported when called

    user_not_set = max_memory is None
    max_memory = get_max_memory(None if max_memory is None else dict(max_memory))
    gpus = sorted(k for k, v in max_memory.items() if isinstance(k, int) and v > 0)
    if not gpus:
        return max_memory
    if len(gpus) == 1:
        low_zero = False   # nothing to move off a single GPU; keep 10% of it free when its size was not given
        if user_not_set:
            max_memory[gpus[0]] *= 0.9
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    per_gpu = sizes[""] // (len(gpus) - 1 if low_zero else len(gpus))
    no_split = [no_split_module_classes] if isinstance(no_split_module_classes, str) else \
        list(no_split_module_classes or [])
    block = _first_block_sizes(sizes, dict(model.named_modules()), no_split) if no_split else 0
    modules_only = {n: v for n, v in sizes.items() if n not in set(_leaves(sizes))}
    last_level = _leaves(modules_only)
    mean_leaves = int(sum(modules_only[n] for n in last_level) / max(len(last_level), 1))
    per_gpu += int(1.25 * max(block, mean_leaves))
    for idx in gpus[:-1]:   # the last GPU keeps its whole budget, in case the margin is short
        max_memory[idx] = min(max_memory[0] if low_zero and idx == 0 else per_gpu, max_memory[idx])
    if low_zero:
        rest = sum(max_memory[i] for i in range(1, len(gpus)))
        max_memory[0] = min(max(0, sizes[""] - rest), max_memory[0])
    return max_memory


def _first_block_sizes(sizes: dict[str, float], modules: dict[str, nn.Module], no_split: list[str]) -> float:
    """The largest of the sizes of the first module of each no-split class (Accelerate's margin)."""
    first: dict[str, float] = {}
    for name, size in sizes.items():
        cls = type(modules[name]).__name__ if name in modules else None
        if name and cls in no_split and cls not in first:
            first[cls] = size
    return max(first.values(), default=0)


def _leaves(sizes: dict[str, float]) -> list[str]:
    """The names in `sizes` with no name below them."""
    parents = {n.rsplit(".", 1)[0] for n in sizes if "." in n}
    return [n for n in sizes if n and n not in parents]


def find_tied_parameters(model: nn.Module, **kwargs) -> list[list[str]]:
    """Groups of parameter names that are one tensor (sorted names), as Accelerate's.

    >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)); model[1].weight = model[0].weight
    >>> find_tied_parameters(model)
    [['0.weight', '1.weight']]
    """
    first: dict[int, str] = {}
    groups: dict[str, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            groups.setdefault(first[id(param)], [first[id(param)]]).append(name)
        else:
            first[id(param)] = name
    return [sorted(names) for names in groups.values()]


def set_module_tensor_to_device(module: nn.Module, tensor_name: str, device: int | str | torch.device,
                                value: torch.Tensor | None = None, dtype: str | torch.dtype | None = None,
                                fp16_statistics: torch.Tensor | None = None,
                                tied_params_map: dict[int, dict] | None = None, non_blocking: bool = False,
                                clear_cache: bool = True) -> None:
    """Put parameter or buffer `tensor_name` ("layer.0.weight") of `module` on `device`, with `value` if given
    (needed for a meta tensor), cast to `dtype` or else to the current tensor's dtype (integers stay), as Accelerate's.
    A parameter stays a parameter of its class with its `requires_grad`; `tied_params_map` ({data_ptr: {device:
    tensor}}) reuses a tied weight already placed there.

    >>> with init_empty_weights():
    ...     layer = nn.Linear(2, 2)
    >>> set_module_tensor_to_device(layer, "bias", "cpu", value=torch.zeros(2))
    >>> layer.bias
    Parameter containing:
    tensor([0., 0.], requires_grad=True)
    """
    if fp16_statistics is not None:
        raise ValueError("set_module_tensor_to_device: fp16_statistics (bitsandbytes 8-bit weights) is not supported "
                         "by cadence; leave it None")
    *path, attr = tensor_name.split(".")
    for part in path:
        child = getattr(module, part, None)
        if not isinstance(child, nn.Module):
            raise ValueError(f"{module.__class__.__name__} has no submodule {part!r} (in {tensor_name!r})")
        module = child
    if attr not in module._parameters and attr not in module._buffers:
        raise ValueError(f"{module.__class__.__name__} does not have a parameter or a buffer named {attr!r}")
    is_buffer = attr in module._buffers
    slots = module._buffers if is_buffer else module._parameters
    old = slots[attr]
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    for key in (value, old):
        placed = (tied_params_map or {}).get(key.data_ptr(), {}) if key is not None else {}
        if device in placed:
            slots[attr] = placed[device]
            return
    if old.is_meta and device.type != "meta" and value is None:
        raise ValueError(f"{tensor_name} is on the meta device: pass value=... to put it on {device}")
    if value is not None:
        if value.shape != old.shape:
            raise ValueError(f"value for {tensor_name!r} has shape {tuple(value.shape)}, the tensor has "
                             f"{tuple(old.shape)}")
        if dtype is None:
            value = value.to(old.dtype, non_blocking=non_blocking)
        elif not str(value.dtype).startswith(_INTEGRAL):
            value = value.to(_as_dtype(dtype), non_blocking=non_blocking)
    with torch.no_grad():
        new = (old if value is None else value).to(device, non_blocking=non_blocking)
        if value is None and dtype is not None and device.type == "meta" and not str(old.dtype).startswith(_INTEGRAL):
            new = new.to(_as_dtype(dtype))
    if new is old:   # already there: the same parameter stays (an optimizer holding it keeps it)
        return
    slots[attr] = new if is_buffer else type(old)(new, requires_grad=old.requires_grad)
    new = slots[attr]
    if clear_cache and device.type == "cuda":
        torch.cuda.empty_cache()
    if tied_params_map is not None:
        for key in (old, value):
            if key is not None and key.data_ptr() in tied_params_map:
                tied_params_map[key.data_ptr()].setdefault(device, new)
                break


def load_state_dict(checkpoint_file: str | os.PathLike, device_map: dict[str, int | str] | None = None
                    ) -> dict[str, torch.Tensor]:
    """The tensors of one checkpoint file (safetensors, or a torch file read with `weights_only=True`: no code in a
    pickle runs), each on the device `device_map` gives its module ("disk" and unnamed ones: the CPU).

    >>> load_state_dict("export/model.safetensors", device_map={"": "cpu"})["head.weight"].shape
    torch.Size([4, 16])
    """
    from .device_map import device_of, normalize_device

    if not os.path.isfile(checkpoint_file):
        raise FileNotFoundError(f"load_state_dict: {checkpoint_file} is not a file (pass one .safetensors or .bin)")
    device_map = {k: normalize_device(v) for k, v in (device_map or {}).items()}
    out = {}
    for name, ref in checkpoint_refs(checkpoint_file).items():
        device = device_of(name, device_map)
        device = "cpu" if device in (None, "disk") else device
        out[name] = read_tensor(ref, torch.device("cuda", device) if isinstance(device, int) else device)
    return out
