"""Accelerate's `calculate_maximum_sizes` and `convert_bytes`: how big a model and its largest layer are.

>>> total, (largest, names) = calculate_maximum_sizes(model)
>>> convert_bytes(total), names
('232 bytes', ['0'])
"""

from __future__ import annotations

from torch import nn

from ..big_modeling.memory import compute_module_sizes

__all__ = ["calculate_maximum_sizes", "convert_bytes"]


def convert_bytes(size: float) -> str:
    """`size` bytes in the largest unit under 1024 of it, rounded to 2 decimals (Accelerate's words).

    >>> convert_bytes(1 << 20), convert_bytes(1536)
    ('1.0 MB', '1.5 KB')
    """
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024:
            return f"{round(size, 2)} {unit}"
        size /= 1024
    return f"{round(size, 2)} PB"


def calculate_maximum_sizes(model: nn.Module) -> tuple[int, tuple[int, list[str]]]:
    """(the model's size in bytes, (its largest layer's size, the names of the layers that large)); a layer is a
    module without children or one of the model's `_no_split_modules` classes (transformers), as in Accelerate.

    >>> calculate_maximum_sizes(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
    (232, (160, ['0']))
    """
    sizes = compute_module_sizes(model)
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    todo = [*model.named_parameters(recurse=False), *model.named_children(), *model.named_buffers(recurse=False)]
    largest, names = 0, []
    while todo:
        name, item = todo.pop(0)
        children = list(item.named_children()) if isinstance(item, nn.Module) else []
        if children and type(item).__name__ not in no_split:
            todo = [(f"{name}.{n}", c) for n, c in children] + todo
        elif sizes[name] > largest:
            largest, names = sizes[name], [name]
        elif sizes[name] == largest:
            names.append(name)
    return sizes[""], (largest, names)

