"""Which device each part of a model goes to: sizes, memory budgets, `infer_auto_device_map`.

A device map is `{module or tensor name: device}`, the device an int (a GPU index), "cpu",
"disk", or another torch device name; "" names the whole model. A tensor goes where its longest
named prefix says.

>>> infer_auto_device_map(model, max_memory={0: "10GiB", "cpu": "30GiB"}, no_split_module_classes=["Block"])
{'embed': 0, 'blocks.0': 0, ..., 'blocks.30': 'cpu', 'head': 'disk'}
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable
from itertools import chain

import torch
from torch import nn

from ..disk import parse_size

DISK = "disk"
Device = int | str


def named_tensors(model: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """Every parameter and buffer by every name it has (a tied weight appears under each)."""
    return chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))


def module_sizes(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, int]:
    """Bytes under every module and tensor name ("" is the whole model); a tied weight counts once, at its first name.

    `dtype`: the size once floating-point weights are loaded in that dtype.

    >>> module_sizes(nn.Linear(4, 2))
    {'': 40, 'weight': 32, 'bias': 8}
    """
    sizes: dict[str, int] = defaultdict(int)
    seen: set[int] = set()
    for name, t in named_tensors(model):
        if id(t) in seen:
            continue
        seen.add(id(t))
        itemsize = dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size()
        parts = name.split(".")
        for i in range(len(parts) + 1):
            sizes[".".join(parts[:i])] += t.numel() * itemsize
    return dict(sizes)


def memory_budgets(max_memory: dict | None = None) -> list[tuple[Device, int]]:
    """[(device, bytes)] in the order a device map fills them: GPUs by index, other accelerators, "cpu", "disk".

    Left out of `max_memory` (or all of it when None): each GPU's free memory and the available RAM;
    "disk" is unlimited unless given.

    >>> memory_budgets({"cpu": "1GB"})
    [('cpu', 1000000000), ('disk', ...)]
    """
    if max_memory is None:
        max_memory = {**{i: torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())},
                      "cpu": _available_ram()}
    budgets = {}
    for key, size in max_memory.items():
        device = normalize_device(key)
        budgets[device] = parse_size(size, f"max_memory[{key!r}]")
    budgets.setdefault(DISK, 2**62)
    order = lambda d: (0, d) if isinstance(d, int) else (2, 0) if d == "cpu" else (3, 0) if d == DISK else (1, 0)
    return sorted(budgets.items(), key=lambda item: order(item[0]))


def normalize_device(key: Device | torch.device) -> Device:
    """A device as device maps hold it: an int for a GPU ("cuda:1", torch.device("cuda", 1), 1), else its name.

    >>> normalize_device("cuda:1"), normalize_device(torch.device("cpu")), normalize_device("disk")
    (1, 'cpu', 'disk')
    """
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if key == DISK:
        return DISK
    try:
        device = torch.device(key)
    except (RuntimeError, TypeError):
        raise ValueError(f"{key!r} is not a device: use a GPU index (0), 'cuda:1', 'cpu', 'mps' or 'disk'") from None
    if device.type == "cuda":
        return device.index or 0
    return device.type


def _available_ram() -> int:
    try:
        import psutil

        return psutil.virtual_memory().available
    except ImportError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def infer_auto_device_map(model: nn.Module, max_memory: dict | None = None,
                          no_split_module_classes: Iterable[str | type] | None = None,
                          dtype: torch.dtype | None = None) -> dict[str, Device]:
    """Fill the devices in order (GPUs, "cpu", "disk") with the model's modules, splitting a module that does not fit.

    A module of a class in `no_split_module_classes` (names or classes: the blocks with residual
    connections) is never split across devices. Works on a model built under `init_empty_weights`.

    >>> infer_auto_device_map(model, max_memory={"cpu": "200MB", "disk": "10GB"}, no_split_module_classes=["Block"])
    {'embed': 'cpu', 'blocks.0': 'cpu', 'blocks.1': 'disk', 'head': 'disk'}
    """
    no_split = tuple(no_split_module_classes or ())
    budgets = memory_budgets(max_memory)
    sizes = module_sizes(model, dtype)
    modules = dict(model.named_modules(remove_duplicate=False))
    queue = _parts(model, "")
    assigned: dict[str, Device] = {}
    device_i, used = 0, 0
    while queue:
        name = queue.pop(0)
        size = sizes.get(name, 0)
        device, budget = budgets[device_i]
        if used + size <= budget:
            assigned[name], used = device, used + size
        elif name in modules and _splittable(modules[name], no_split):
            queue[:0] = _parts(modules[name], name)
        elif device_i + 1 < len(budgets):
            device_i, used = device_i + 1, 0
            queue.insert(0, name)
        else:
            raise ValueError(f"{name or 'the model'} ({size:,} bytes) does not fit in max_memory {max_memory}: "
                             f"allow more memory, or room on 'disk'")
    return compact_device_map(model, assigned)


def _parts(module: nn.Module, prefix: str) -> list[str]:
    """The names a module splits into: its own tensors and its children."""
    join = (lambda n: f"{prefix}.{n}") if prefix else (lambda n: n)
    own = [join(n) for n, _ in chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False))]
    return own + [join(n) for n, _ in module.named_children()]


def _splittable(module: nn.Module, no_split: tuple) -> bool:
    names = {c for c in no_split if isinstance(c, str)}
    classes = tuple(c for c in no_split if isinstance(c, type))
    return bool(_parts(module, "")) and type(module).__name__ not in names and not isinstance(module, classes)


def device_of(name: str, device_map: dict[str, Device]) -> Device | None:
    """The device `device_map` gives tensor `name`: its longest named prefix's (None if no prefix is named)."""
    parts = name.split(".")
    for i in range(len(parts), -1, -1):
        prefix = ".".join(parts[:i])
        if prefix in device_map:
            return device_map[prefix]
    return None


def compact_device_map(model: nn.Module, device_map: dict[str, Device]) -> dict[str, Device]:
    """The same placement with as few entries as possible: a module whose tensors all go to one device is one entry."""
    devices = {name: device_of(name, device_map) for name, _ in named_tensors(model)}
    missing = sorted(n for n, d in devices.items() if d is None)
    if missing:
        raise ValueError(f"the device map places no device for {missing[:10]}; name those tensors or a module holding them")
    out: dict[str, Device] = {}

    def visit(module: nn.Module, prefix: str) -> None:
        under = {d for n, d in devices.items() if not prefix or n == prefix or n.startswith(prefix + ".")}
        if len(under) == 1:
            out[prefix] = under.pop()
            return
        join = (lambda n: f"{prefix}.{n}") if prefix else (lambda n: n)
        for n, _ in chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False)):
            out[join(n)] = devices[join(n)]
        for n, child in module.named_children():
            if any(True for _ in named_tensors(child)):
                visit(child, join(n))

    visit(model, "")
    return out


__all__ = ["infer_auto_device_map", "normalize_device", "module_sizes", "memory_budgets", "compact_device_map", "device_of", "DISK"]
