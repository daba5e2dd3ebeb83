"""Walking nested batches and outputs: tuples, lists (namedtuples too) and mappings of tensors and other leaves.

One walk for every layer (trainer/ and distributed/ both import it; neither imports the other), and
`send_to_device`, which moves a batch.

>>> map_tensors(lambda t: t * 2, {"x": torch.ones(2), "ids": [torch.zeros(1)], "name": "a"})
{'x': tensor([2., 2.]), 'ids': [tensor([0.])], 'name': 'a'}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


def map_leaves(fn: Callable[[Any], Any], data: Any) -> Any:
    """Apply `fn` to every leaf (anything but a tuple, list or mapping) of nested tuples, lists (namedtuples too) and
    mappings, keeping each container's type.

    >>> map_leaves(str, {"x": 1, "ids": [2, (3,)]})
    {'x': '1', 'ids': ['2', ('3',)]}
    """
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # a namedtuple takes its fields as arguments
        return type(data)(*(map_leaves(fn, o) for o in data))
    if isinstance(data, (tuple, list)):
        return type(data)(map_leaves(fn, o) for o in data)
    if isinstance(data, Mapping):
        return type(data)({k: map_leaves(fn, v) for k, v in data.items()})
    return fn(data)


def map_tensors(fn: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """Apply `fn` to every tensor in nested tuples, lists (namedtuples too) and mappings; other leaves unchanged.

    >>> map_tensors(lambda t: t[:1], (torch.arange(3), {"n": 2}))
    (tensor([0]), {'n': 2})
    """
    return map_leaves(lambda o: fn(o) if isinstance(o, torch.Tensor) else o, data)


def leaves(data: Any) -> list[Any]:
    """The leaves of `data` in the order `map_leaves` visits them.

    >>> leaves({"x": 1, "ids": [2, (3, None)]})
    [1, 2, 3, None]
    """
    if isinstance(data, Mapping):
        data = list(data.values())
    if isinstance(data, (tuple, list)):
        return [leaf for o in data for leaf in leaves(o)]
    return [data]


def send_to_device(batch: Any, device: torch.device | str | int, non_blocking: bool = True,
                   skip_keys: str | list[str] | None = None) -> Any:
    """Move every tensor (and any batch object with a `.to`, such as transformers' BatchEncoding) in a nested tuple /
    list / dict batch to `device`; the values of a mapping's `skip_keys` (a key or a list of keys) stay where they are.

    >>> xb, yb = send_to_device((xb, yb), "cuda:0")
    """
    skip = {skip_keys} if isinstance(skip_keys, str) else set(skip_keys or ())

    def move(o: Any) -> Any:
        if hasattr(o, "to"):
            try:
                return o.to(device, non_blocking=non_blocking)
            except TypeError:   # a `.to` without non_blocking
                return o.to(device)
        if isinstance(o, Mapping):
            return type(o)({k: v if k in skip else move(v) for k, v in o.items()})
        if isinstance(o, (tuple, list)):
            return type(o)(*map(move, o)) if hasattr(o, "_fields") else type(o)(map(move, o))
        return o
    return move(batch)
