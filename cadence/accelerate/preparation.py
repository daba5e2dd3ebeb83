"""How `Accelerator.prepare` hands the user's objects to the strategy, and the options it builds the strategy with.

- optimizers built over the plain model are pointed at the wrapped model's parameters (by name);
- with mixed precision a model's forward runs in the strategy's autocast, outputs back in fp32;
- `split_batches` loaders are rebuilt with the per-process batch size;
- kwargs handlers are sorted by kind; DDP's go to an engine that takes them.

>>> strategy = make_strategy("ddp", cpu=False, ddp=DistributedDataParallelKwargs(bucket_cap_mb=50))
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..distributed import ops
from ..distributed.registry import get_strategy, strategy_class
from .handlers import DistributedDataParallelKwargs, DummyOptim, GradScalerKwargs, InitProcessGroupKwargs

__all__ = ["sort_handlers", "make_strategy", "optimizes", "retarget", "owns_parameters", "autocast_forward",
           "restore_forward", "all_tensors", "split_loader"]

_HANDLERS = (DistributedDataParallelKwargs, GradScalerKwargs, InitProcessGroupKwargs)


def sort_handlers(kwargs_handlers: list | None) -> dict[type, Any]:
    found: dict[type, Any] = {}
    for h in kwargs_handlers or []:
        if not isinstance(h, _HANDLERS):
            raise TypeError(f"kwargs_handlers takes {[c.__name__ for c in _HANDLERS]} instances, got {h!r}")
        if type(h) in found:
            raise ValueError(f"two {type(h).__name__} in kwargs_handlers; merge them into one")
        found[type(h)] = h
    return found


def make_strategy(name: Any, cpu: bool, ddp: DistributedDataParallelKwargs | None) -> Any:
    """The registry's strategy; DDP's options go to an engine whose constructor takes them, with a warning otherwise."""
    options = dict(ddp.to_kwargs()) if ddp is not None else {}
    if cpu:
        options["device"] = "cpu"
    cls = strategy_class(name)
    if cls is not None:
        params = inspect.signature(cls).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        dropped = [k for k in options if k not in params and not takes_any]
        if dropped:
            warnings.warn(f"strategy {cls.__name__} takes no {dropped}; DistributedDataParallelKwargs options "
                          f"are DDP's and are ignored here", stacklevel=3)
        options = {k: v for k, v in options.items() if k not in dropped}
    elif options:
        raise ValueError("give a Strategy instance its options yourself, not through kwargs_handlers/cpu")
    return get_strategy(name, **options)


def optimizes(opt: Any, model: nn.Module) -> bool:
    """Does `opt` (a torch optimizer or a DummyOptim) hold parameters of `model`?"""
    groups = opt.param_groups if not isinstance(opt, DummyOptim) else (
        opt.params if opt.params and isinstance(opt.params[0], dict) else [{"params": opt.params}])
    mine = {id(p) for p in model.parameters()}
    return any(id(p) in mine for g in groups for p in g["params"])


def retarget(opt: Any, names: dict[int, str], params: dict[str, nn.Parameter]) -> None:
    """Point `opt`'s parameter groups at the wrapped model's parameters (FSDP replaces them by sharded ones)."""
    if isinstance(opt, DummyOptim):
        return
    for group in opt.param_groups:
        group["params"] = [params.get(names.get(id(p)), p) for p in group["params"]]


def owns_parameters(model: nn.Module, params: list, strategy: Any) -> bool:
    mine = {id(p) for p in strategy.unwrap(model).parameters()}
    return bool(params) and id(params[0]) in mine


def autocast_forward(module: nn.Module, context: Callable[[], Any]) -> None:
    """Run `module`'s forward in the precision context, outputs back in fp32 (Accelerate does the same)."""
    if "_cadence_plain_forward" in module.__dict__:
        return
    plain = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        with context():
            out = plain(*args, **kwargs)
        return ops.map_tensors(lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t, out)
    module._cadence_plain_forward = plain
    module.forward = forward


def restore_forward(module: nn.Module) -> None:
    plain = module.__dict__.pop("_cadence_plain_forward", None)
    if plain is not None:
        module.forward = plain


def all_tensors(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, dict):
        return all(all_tensors(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return all(all_tensors(v) for v in data)
    return False


def split_loader(dl: DataLoader, n: int) -> DataLoader:
    """`split_batches=True`: the loader's batch size is the global batch; each process takes 1/n of it."""
    if not dl.batch_size or dl.batch_size % n:
        raise ValueError(f"split_batches=True needs a batch size divisible by the {n} processes, "
                         f"got {dl.batch_size}; use a multiple of {n}")
    shuffle = isinstance(dl.sampler, torch.utils.data.RandomSampler)
    return DataLoader(dl.dataset, batch_size=dl.batch_size // n, shuffle=shuffle, collate_fn=dl.collate_fn,
                      drop_last=dl.drop_last, num_workers=dl.num_workers, pin_memory=dl.pin_memory)
