"""`accelerate.utils.operations` under cadence: nested-tensor helpers and the collectives with Accelerate's signatures.

The collectives run on `cadence.distributed.ops` and keep Accelerate's names, defaults and one-process
behaviour (`reduce(t, "mean")` returns a copy of `t`); `cadence.reduce` / `cadence.broadcast` are cadence's own
(`op=`, `src=`).

>>> reduce(torch.tensor([1.0, 2.0]), reduction="sum")     # one process: a copy
tensor([1., 2.])
>>> find_batch_size({"input_ids": torch.ones(4, 7)})
4
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .. import nested
from ..distributed import env, ops

__all__ = ["is_torch_tensor", "is_namedtuple", "honor_type", "recursively_apply", "send_to_device", "find_batch_size",
           "ignorant_find_batch_size", "concatenate", "listify", "find_device", "convert_to_fp32",
           "convert_outputs_to_fp32", "broadcast", "broadcast_object_list", "gather", "pad_across_processes", "reduce"]

_REDUCTIONS = ("mean", "sum", "max", "min", "none")


def is_torch_tensor(tensor: Any) -> bool:
    """True for a `torch.Tensor`.

    >>> is_torch_tensor(torch.ones(1)), is_torch_tensor([1.0])
    (True, False)
    """
    return isinstance(tensor, torch.Tensor)


def is_namedtuple(data: Any) -> bool:
    """True for an instance of a `namedtuple` class.

    >>> is_namedtuple(torch.return_types.max((torch.ones(1), torch.zeros(1)))), is_namedtuple((1, 2))
    (True, False)
    """
    return isinstance(data, tuple) and hasattr(data, "_fields") and hasattr(data, "_asdict")


def honor_type(obj: Any, generator: Any) -> Any:
    """The items of `generator` in a container of `obj`'s type (list, tuple or namedtuple).

    >>> honor_type((1, 2), (x * 10 for x in (1, 2)))
    (10, 20)
    """
    return type(obj)(*generator) if is_namedtuple(obj) else type(obj)(generator)


def recursively_apply(func: Callable, data: Any, *args: Any, test_type: Callable[[Any], bool] = is_torch_tensor,
                      error_on_other_type: bool = False, **kwargs: Any) -> Any:
    """`func(leaf, *args, **kwargs)` on every leaf of nested lists, tuples and mappings for which `test_type(leaf)`.

    Other leaves are kept as they are, or raise TypeError when `error_on_other_type`.

    >>> recursively_apply(lambda t, k: t * k, {"a": torch.ones(2), "b": [torch.ones(1)], "c": "x"}, 3)
    {'a': tensor([3., 3.]), 'b': [tensor([3.])], 'c': 'x'}
    """
    def leaf(o: Any) -> Any:
        if test_type(o):
            return func(o, *args, **kwargs)
        if error_on_other_type:
            raise TypeError(f"{getattr(func, '__name__', func)} works on nested lists/tuples/dicts of objects that pass "
                            f"{getattr(test_type, '__name__', test_type)}; got a {type(o).__name__}")
        return o
    return ops.map_leaves(leaf, data)


def send_to_device(tensor: Any, device: torch.device | str | int, non_blocking: bool = False,
                   skip_keys: str | list[str] | None = None) -> Any:
    """Every tensor (anything with a `.to`) in nested lists, tuples and mappings moved to `device`.

    The values of a mapping's `skip_keys` (a key or a list of keys) stay where they are.

    >>> send_to_device({"x": torch.ones(1), "meta": torch.zeros(1)}, "cpu", non_blocking=True, skip_keys="meta")
    {'x': tensor([1.]), 'meta': tensor([0.])}
    """
    return nested.send_to_device(tensor, device, non_blocking=non_blocking, skip_keys=skip_keys)


def find_batch_size(data: Any) -> int:
    """The first dimension of the first tensor in nested lists, tuples and mappings.

    >>> find_batch_size([{"x": torch.ones(3, 2)}, torch.ones(5)])
    3
    """
    if isinstance(data, (tuple, list, Mapping)):
        if len(data) == 0:
            raise ValueError(f"find_batch_size: cannot find a batch size in an empty {type(data).__name__}")
        return find_batch_size(next(iter(data.values())) if isinstance(data, Mapping) else data[0])
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"find_batch_size: finds the batch size of tensors, got a {type(data).__name__}")
    return data.shape[0]


def ignorant_find_batch_size(data: Any) -> int | None:
    """`find_batch_size`, or None where it raises ValueError or TypeError.

    >>> ignorant_find_batch_size(["no tensor"]) is None
    True
    """
    try:
        return find_batch_size(data)
    except (ValueError, TypeError):
        return None


def concatenate(data: list, dim: int = 0) -> Any:
    """A list of batches of the same structure (tensors in nested lists, tuples, dicts) as one batch, tensors
    concatenated along `dim`; a list of one non-tensor item gives that item.

    >>> concatenate([{"x": torch.ones(1, 2)}, {"x": torch.zeros(1, 2)}])
    {'x': tensor([[1., 1.],
            [0., 0.]])}
    """
    first = data[0]
    if isinstance(first, (tuple, list)):
        return honor_type(first, (concatenate([d[i] for d in data], dim=dim) for i in range(len(first))))
    if isinstance(first, Mapping):
        return type(first)({k: concatenate([d[k] for d in data], dim=dim) for k in first})
    if isinstance(first, torch.Tensor):
        return torch.cat(data, dim=dim)
    if isinstance(data, (tuple, list)) and len(data) == 1:
        return first
    raise TypeError(f"concatenate: concatenates tensors (in nested lists/tuples/dicts), got a {type(first).__name__}")


def listify(data: Any) -> Any:
    """Every tensor in nested lists, tuples and mappings as (nested) Python numbers; bfloat16 read as float32.

    >>> listify({"loss": torch.tensor(0.5, dtype=torch.bfloat16), "ids": torch.tensor([1, 2])})
    {'loss': 0.5, 'ids': [1, 2]}
    """
    def to_list(t: torch.Tensor) -> Any:
        t = t.detach().cpu()
        return (t.float() if t.dtype == torch.bfloat16 else t).tolist()
    return recursively_apply(to_list, data)


def find_device(data: Any) -> torch.device | None:
    """The device of the first tensor in nested lists, tuples and mappings (None when there is none).

    >>> find_device({"meta": "x", "ids": [torch.ones(1)]})
    device(type='cpu')
    """
    if isinstance(data, torch.Tensor):
        return data.device
    items = data.values() if isinstance(data, Mapping) else data if isinstance(data, (tuple, list)) else ()
    return next((d for d in map(find_device, items) if d is not None), None)


def _is_half(t: Any) -> bool:
    return (isinstance(t, torch.Tensor) or hasattr(t, "dtype")) and t.dtype in (torch.float16, torch.bfloat16)


def convert_to_fp32(tensor: Any) -> Any:
    """Every float16 / bfloat16 tensor in nested lists, tuples and mappings as float32; the rest unchanged.

    >>> convert_to_fp32({"logits": torch.ones(1, dtype=torch.bfloat16), "ids": torch.ones(1, dtype=torch.long)})
    {'logits': tensor([1.]), 'ids': tensor([1])}
    """
    return recursively_apply(lambda t: t.float(), tensor, test_type=_is_half)


def convert_outputs_to_fp32(model_forward: Callable) -> Callable:
    """`model_forward` whose float16 / bfloat16 outputs come back as float32 (its `__wrapped__` is `model_forward`).

    >>> net = nn.Linear(2, 2).to(torch.bfloat16)
    >>> net.forward = convert_outputs_to_fp32(net.forward)
    >>> net(torch.ones(1, 2, dtype=torch.bfloat16)).dtype
    torch.float32
    """
    @functools.wraps(model_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return convert_to_fp32(model_forward(*args, **kwargs))
    return forward


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Process `from_process`'s tensors (nested in lists, tuples, dicts; the same shapes everywhere), in place on every
    process. One process: `tensor` as it is. For other objects: `broadcast_object_list`.

    >>> broadcast(torch.tensor([float(rank())]), from_process=1)    # on 2 processes: tensor([1.]) on both
    """
    if not env.is_initialized():
        return tensor

    def one(t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, src=from_process)
        return t
    return recursively_apply(one, tensor, error_on_other_type=True)


def broadcast_object_list(object_list: list, from_process: int = 0) -> list:
    """Fill `object_list` in place with process `from_process`'s items (any picklable objects) and return it;
    every process passes a list of the same length. One process: returned as it is.

    >>> broadcast_object_list([config] if accelerator.is_main_process else [None])[0]
    """
    if env.is_initialized():
        dist.broadcast_object_list(object_list, src=from_process)
    return object_list


def gather(tensor: Any) -> Any:
    """Every process's tensors (nested in lists, tuples, dicts) concatenated on dim 0, in process order; 0-d tensors
    give one row each. One process: `tensor` as it is, whatever it holds.

    >>> gather(torch.tensor([rank()]))      # on 2 processes: tensor([0, 1])
    """
    return ops.gather(tensor) if env.is_initialized() else tensor


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    """Pad each tensor (nested in lists, tuples, dicts) along `dim` with `pad_index` to the largest size any process
    has, so that they can be gathered.

    >>> pad_across_processes(torch.ones(rank() + 1))     # on 2 processes: rank 0 gets tensor([1., 0.])
    """
    return ops.pad_across_processes(tensor, dim, pad_index, pad_first)


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Every tensor (nested in lists, tuples, dicts) reduced over the processes, as new tensors.

    `reduction`: "mean", "sum", "max", "min", or "none" (summed over the processes, as Accelerate does). One process:
    copies, unreduced and unscaled. As in Accelerate, `scale` multiplies the result on XLA only, and the mean of an
    integer tensor over several processes is refused (RuntimeError).

    >>> reduce(torch.tensor([rank() + 1.0]), reduction="sum")    # on 2 processes: tensor([3.])
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduce: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not env.is_initialized():
        return recursively_apply(torch.clone, tensor, error_on_other_type=True)
    if reduction == "mean":
        recursively_apply(_refuse_integer_mean, tensor, error_on_other_type=True)
    out = ops.reduce(tensor, op="sum" if reduction == "none" else reduction)
    if scale != 1.0 and dist.get_backend() == "xla":
        ops.map_tensors(lambda t: t.mul_(scale), out)
    return out


def _refuse_integer_mean(t: torch.Tensor) -> None:
    if not (t.is_floating_point() or t.is_complex()):
        raise RuntimeError(f"reduce(reduction='mean') of a {t.dtype} tensor: its mean is not a {t.dtype}; "
                           f"reduce tensor.float(), or use reduction='sum'")
