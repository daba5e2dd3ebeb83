"""Build a model without allocating its weights: `init_empty_weights`, `init_on_device`.

>>> with init_empty_weights():
...     model = BigModel()            # parameters on the meta device: no memory, shapes and dtypes kept
>>> model = load_checkpoint_and_dispatch(model, "export/", device_map="auto")
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def init_on_device(device: str | torch.device, include_buffers: bool = False) -> Iterator[None]:
    """Create every parameter built inside the block on `device` (and buffers too with `include_buffers`).

    Parameters are moved as each module registers them, so at most one layer's weights exist
    elsewhere at a time. It patches `nn.Module.register_parameter` for the block: not thread-safe.

    >>> with init_on_device("meta"):
    ...     layer = nn.Linear(4096, 4096)         # layer.weight.is_meta
    """
    device = torch.device(device)
    if include_buffers:
        with torch.device(device):  # every factory call inside lands on `device`
            yield
        return
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device != device:
            moved = type(param)(param.to(device), requires_grad=param.requires_grad)
            moved.__dict__.update(param.__dict__)  # attributes some libraries attach to parameters
            module._parameters[name] = moved

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def init_empty_weights(include_buffers: bool = False) -> contextlib.AbstractContextManager:
    """Parameters built inside the block live on the meta device (no memory); buffers stay real by default.

    >>> with init_empty_weights():
    ...     model = BigModel()
    """
    return init_on_device("meta", include_buffers=include_buffers)


__all__ = ["init_on_device", "init_empty_weights"]
