"""`accelerate.utils.extract_model_from_parallel`, `is_compiled_module`, `is_peft_model`, `get_max_memory`,
`convert_file_size_to_int` and Accelerate's tensor helpers (`named_module_tensors`, `retie_parameters`,
`check_device_map`) under cadence."""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from ..big_modeling.device_map import _available_ram
from ..compile import unwrap_compiled
from ..disk import parse_size

__all__ = ["extract_model_from_parallel", "is_compiled_module", "is_peft_model", "get_max_memory",
           "convert_file_size_to_int", "named_module_tensors", "retie_parameters", "check_device_map"]

logger = logging.getLogger(__name__)


def extract_model_from_parallel(model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True,
                                recursive: bool = False) -> nn.Module:
    """The user's module inside DDP / DataParallel / a DeepSpeed engine (FSDP2 shards in place).

    A `torch.compile` wrapper (`OptimizedModule`) given is kept around the unwrapped module when
    `keep_torch_compile`, else dropped; `recursive` also replaces every submodule that wraps a `module` by it.

    >>> extract_model_from_parallel(accelerator.prepare(model)) is model
    True
    """
    from ..accelerate.preparation import restore_forward

    compiled = model if is_compiled_module(model) else None
    model = _unwrap(model)
    if recursive:
        _unwrap_children(model)
    if not keep_fp32_wrapper:
        restore_forward(model)
    if keep_torch_compile and compiled is not None:
        compiled._orig_mod = model
        return compiled
    return model


def _unwrap(model: nn.Module) -> nn.Module:
    while True:
        model = unwrap_compiled(model)
        inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _unwrap_children(module: nn.Module) -> None:
    for name, child in list(module.named_children()):
        inner = _unwrap(child)
        if inner is not child:
            setattr(module, name, inner)
        _unwrap_children(inner)


def is_compiled_module(module: nn.Module) -> bool:
    """True for a `torch.compile`d module (its `OptimizedModule` wrapper).

    >>> is_compiled_module(torch.compile(net)), is_compiled_module(net)
    (True, False)
    """
    return unwrap_compiled(module) is not module


def is_peft_model(model: nn.Module) -> bool:
    """True for a PEFT model (`peft.PeftModel`); answered without importing peft, which such a model already did.

    >>> is_peft_model(get_peft_model(base, LoraConfig(target_modules=["q_proj"]))), is_peft_model(base)
    (True, False)
    """
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def convert_file_size_to_int(size: int | str) -> int:
    """Bytes from an int or a size such as "5GB", "500MiB"; as in Accelerate, a lower-case "b" after a decimal unit
    means bits ("8Mb" is 1 000 000 bytes).

    >>> convert_file_size_to_int("1MiB"), convert_file_size_to_int("2GB"), convert_file_size_to_int("8Mb")
    (1048576, 2000000000, 1000000)
    """
    in_bits = isinstance(size, str) and size.endswith("b") and size.upper().endswith(("KB", "MB", "GB"))
    return parse_size(size, "size") // 8 if in_bits else parse_size(size, "size")


def get_max_memory(max_memory: dict[int | str, int | str] | None = None) -> dict[int | str, int]:
    """The memory a device map may fill, in bytes: by default each GPU's free memory and the available RAM ("cpu", or
    "mps" on Apple silicon); a given dict with its sizes in bytes, GPUs first, then "mps", "cpu", "disk".

    >>> get_max_memory({"cpu": "2GB", 0: "10GiB"})
    {0: 10737418240, 'cpu': 2000000000}
    """
    if max_memory is None:
        budget = {i: torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())}
        budget["mps" if torch.backends.mps.is_available() else "cpu"] = _available_ram()
        return budget
    unknown = [k for k in max_memory if not (isinstance(k, int) or k in ("mps", "cpu", "disk"))]
    if unknown:
        raise ValueError(f"get_max_memory: device {unknown[0]!r} is not one of: a GPU index (0, 1, ...), 'mps', 'cpu', "
                         f"'disk'")
    gpus = sorted(k for k in max_memory if isinstance(k, int))
    missing = [g for g in gpus if not 0 <= g < torch.cuda.device_count()]
    if missing:
        logger.warning(f"get_max_memory: GPU {missing} not available (this machine has {torch.cuda.device_count()})")
    order = gpus + [k for k in ("mps", "cpu", "disk") if k in max_memory]
    return {k: convert_file_size_to_int(max_memory[k]) for k in order}


def named_module_tensors(module: nn.Module, include_buffers: bool = True, recurse: bool = False,
                         remove_non_persistent: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """`module`'s parameters, then (with `include_buffers`) its buffers, less the non-persistent ones with
    `remove_non_persistent`; its own only unless `recurse`.

    >>> [name for name, _ in named_module_tensors(nn.BatchNorm1d(3))]
    ['weight', 'bias', 'running_mean', 'running_var', 'num_batches_tracked']
    """
    yield from module.named_parameters(recurse=recurse)
    if not include_buffers:
        return
    skipped = set()
    if remove_non_persistent:
        owners = module.named_modules() if recurse else [("", module)]
        skipped = {f"{p}.{b}" if p else b for p, m in owners for b in m._non_persistent_buffers_set}
    yield from ((name, b) for name, b in module.named_buffers(recurse=recurse) if name not in skipped)


def retie_parameters(model: nn.Module, tied_params: list[list[str]]) -> None:
    """Tie again each group of `tied_params` (`find_tied_parameters(model)`): every name of a group is set to the
    group's first parameter that is not on the meta device (a group all on meta is left as it is).

    >>> model.head.weight = nn.Parameter(model.head.weight.clone()); retie_parameters(model, [["embed.weight", "head.weight"]])
    >>> model.head.weight is model.embed.weight
    True
    """
    for group in tied_params:
        real = next((p for p in map(model.get_parameter, group) if p.device.type != "meta"), None)
        if real is None:
            continue
        for name in group:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, real)


def check_device_map(model: nn.Module, device_map: dict[str, int | str | torch.device]) -> None:
    """ValueError naming every weight of `model` that `device_map` gives no device; a warning for keys that name no
    module (Accelerate's checks).

    >>> check_device_map(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), {"0": "cpu"})
    Traceback (most recent call last):
    ValueError: The device_map provided does not give any device for the following parameters: 1.weight, 1.bias (...)
    """
    modules = dict(model.named_modules())
    unknown = [k for k in device_map if k != "" and k not in modules]
    if unknown:
        warnings.warn(f"The following device_map keys do not match any submodules in the model: {unknown}", UserWarning,
                      stacklevel=2)
    if "" in device_map:
        return
    uncovered = [n for n in model.state_dict() if not any(n == k or n.startswith(k + ".") for k in device_map)]
    if uncovered:
        raise ValueError(f"The device_map provided does not give any device for the following parameters: "
                         f"{', '.join(uncovered)} (add their modules, or \"\" for the whole model, to device_map)")
