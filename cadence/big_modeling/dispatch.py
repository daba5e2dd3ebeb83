"""Run a model spread over GPUs, the CPU and the disk: `dispatch_model`, `load_checkpoint_and_dispatch`.

Every weight goes to the device its device map names. A weight whose device cannot run it (on
"disk", or on "cpu" when the model runs on a GPU) is *streamed*: it stays where it is stored (a
safetensors file, or CPU memory), its module holds a meta tensor, and hooks on that module load it
onto the execution device just before the module's forward and drop it right after, so only one
module's weights are in memory at a time. Inputs are moved to each module's device by the same
hooks, and the output comes back to the device of the input. For inference: gradients do not
reach streamed weights.

>>> with init_empty_weights():
...     model = BigModel()
>>> model = load_checkpoint_and_dispatch(model, "export/", device_map="auto",
...                                      max_memory={0: "20GiB", "cpu": "60GiB"}, offload_folder="offload")
>>> model.hf_device_map
{'embed': 0, 'blocks.0': 0, ..., 'blocks.40': 'cpu', 'blocks.41': 'disk', 'head': 'disk'}
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..serialization import check_state_dict
from .device_map import DISK, Device, device_of, infer_auto_device_map, named_tensors, normalize_device
from .memory import get_balanced_memory
from .weights import TensorRef, checkpoint_refs, offload_to_folder, read_tensor

Source = TensorRef | torch.Tensor


def dispatch_model(model: nn.Module, device_map: dict[str, Device], main_device: Device | None = None,
                   offload_dir: str | os.PathLike | None = None, weights: dict[str, Source] | None = None,
                   dtype: torch.dtype | None = None) -> nn.Module:
    """Place `model`'s weights as `device_map` says and hook its modules so that forward runs across them.

    The weights come from `weights` ({name: TensorRef or tensor}, what `load_checkpoint_and_dispatch`
    passes) or else from the model itself, whose "disk" weights are then written to `offload_dir`
    (safetensors). Streamed weights run on `main_device` (default: the first GPU in the map, else
    "cpu"). Sets `model.hf_device_map`.

    >>> model = dispatch_model(model, {"embed": "cpu", "blocks": "disk", "head": "cpu"}, offload_dir="offload")
    """
    device_map = {name: normalize_device(device) for name, device in device_map.items()}
    main = _torch_device(main_device if main_device is not None else _first_gpu(device_map.values()))
    plans = _plans(model, device_map)
    unsaved = [full for _, _, plan in plans for attr, (full, _, device) in plan.items()
               if device == DISK and not isinstance((weights or {}).get(full), TensorRef)]
    if unsaved and offload_dir is None:
        raise ValueError(f"{unsaved[:5]} go to 'disk' and are not in a safetensors file: pass offload_dir=... "
                         f"(a folder where they are written)")
    placed: dict[tuple[int, str], torch.Tensor] = {}  # (source id, device) -> tensor: tied weights stay tied
    for module_name, module, plan in plans:
        _dispatch_module(module_name, module, plan, main, weights, offload_dir, dtype, placed)
    model.register_forward_pre_hook(_remember_input_device, with_kwargs=True)
    model.register_forward_hook(_output_to_input_device)
    model.hf_device_map = dict(device_map)
    return model


def load_checkpoint_and_dispatch(model: nn.Module, checkpoint: str | os.PathLike,
                                 device_map: str | dict[str, Device] | None = "auto", max_memory: dict | None = None,
                                 no_split_module_classes: Iterable[str | type] | None = None,
                                 offload_folder: str | os.PathLike | None = None, dtype: torch.dtype | None = None,
                                 main_device: Device | None = None) -> nn.Module:
    """Load a checkpoint into `model` (built under `init_empty_weights`) over GPUs, CPU and disk, and dispatch it.

    `checkpoint`: a safetensors file, a directory with `model.safetensors` or a sharded index
    (`learn.save_model`'s layout), or the index json. `device_map="auto"` fills the devices in
    order within `max_memory` (see `infer_auto_device_map`), spread evenly over the GPUs first ("balanced" too,
    "balanced_low_0" keeping GPU 0 light; "sequential" does not spread: see `auto_device_map`); None loads
    everything on the CPU. Weights placed on "disk" are read from
    the checkpoint's own safetensors files when needed (no copy); a torch-format checkpoint's are
    written to `offload_folder` first. The checkpoint is checked against the model before anything loads.

    >>> model = load_checkpoint_and_dispatch(model, "export", max_memory={"cpu": "2GB"}, no_split_module_classes=["Block"])
    """
    refs = with_tied_aliases(model, checkpoint_refs(checkpoint))
    check_state_dict(model, refs, source=str(checkpoint))
    if device_map is None:
        device_map = {"": "cpu"}
    if isinstance(device_map, str):
        device_map = auto_device_map(model, device_map, max_memory, no_split_module_classes, dtype)
    return dispatch_model(model, device_map, main_device, offload_folder, refs, dtype)


def auto_device_map(model: nn.Module, device_map: str, max_memory: dict | None = None,
                    no_split_module_classes: Iterable[str | type] | None = None,
                    dtype: torch.dtype | None = None) -> dict[str, Device]:
    """The device map a named strategy gives, as Accelerate's `load_checkpoint_and_dispatch` computes it.

    "sequential" fills the devices in order within `max_memory`; "auto" and "balanced" first spread `max_memory`
    evenly over the GPUs (`get_balanced_memory`), "balanced_low_0" keeping GPU 0 as light as it can. Without GPUs
    all four are the same.

    >>> auto_device_map(model, "balanced", {0: "10GiB", 1: "10GiB", "cpu": "30GiB"}, ["Block"])
    {'embed': 0, 'blocks.0': 0, ..., 'blocks.6': 1, ..., 'head': 1}
    """
    if device_map not in ("auto", "balanced", "balanced_low_0", "sequential"):
        raise ValueError(f"device_map must be 'auto', 'balanced', 'balanced_low_0', 'sequential' or a dict of module "
                         f"names to devices, got {device_map!r}")
    if device_map != "sequential":
        names = [c if isinstance(c, str) else c.__name__ for c in no_split_module_classes or ()]
        given = None if max_memory is None else {normalize_device(k): v for k, v in max_memory.items()}
        balanced = get_balanced_memory(model, given, names, dtype, low_zero=device_map == "balanced_low_0")
        max_memory = {k: int(v) for k, v in balanced.items()}   # Accelerate's margins are floats
    return infer_auto_device_map(model, max_memory, no_split_module_classes, dtype)


def with_tied_aliases(model: nn.Module, weights: dict[str, Source]) -> dict[str, Source]:
    """`weights` plus every tied name of `model` that it lacks, pointing at its alias's weight.

    A checkpoint stores a tied tensor once (transformers' `save_pretrained` keeps `transformer.wte.weight`
    and drops `lm_head.weight`); the model's other names for it load the same tensor, so the tie
    survives dispatch. A name none of whose aliases is stored stays missing.

    >>> sorted(with_tied_aliases(gpt2, {"transformer.wte.weight": w, ...}))   # doctest: +SKIP
    ['lm_head.weight', 'transformer.wte.weight', ...]
    """
    names_by_tensor: dict[int, list[str]] = {}
    for name, t in named_tensors(model):
        names_by_tensor.setdefault(id(t), []).append(name)
    out = dict(weights)
    for names in names_by_tensor.values():
        stored = next((n for n in names if n in weights), None)
        if stored is not None:
            out.update({n: weights[stored] for n in names if n not in weights})
    return out


# ---------------------------------------------------------------------------- placement
def _plans(model: nn.Module, device_map: dict[str, Device]) -> list[tuple[str, nn.Module, dict]]:
    """Per module holding tensors itself: {attribute: (full name, "param"/"buffer", device)}; checks the map first."""
    plans = []
    for module_name, module in model.named_modules(remove_duplicate=False):
        plan = {}
        for attr, full, kind in _direct_slots(module, module_name):
            device = device_of(full, device_map)
            if device is None:
                raise ValueError(f"device_map has no device for {full!r}: name it, or a module that holds it")
            plan[attr] = (full, kind, device)
        if plan:
            plans.append((module_name, module, plan))
    return plans


def _dispatch_module(module_name: str, module: nn.Module, plan: dict, main: torch.device,
                     weights: dict[str, Source] | None, offload_dir: Any, dtype: torch.dtype | None,
                     placed: dict) -> None:
    """Place or stream the tensors `module` holds itself, then hook it."""
    stored_on = {device for _, _, device in plan.values()}
    execution = main if any(_streamed(d, main) for d in stored_on) else _torch_device(next(iter(stored_on)))
    streamed, to_write = {}, {}
    for attr, (full, kind, device) in plan.items():
        current = getattr(module, attr)
        source = _source(full, current, weights)
        if _streamed(device, main):
            meta = _meta_like(current, source, dtype)
            streamed[attr] = (kind, _cast(read_tensor(source), dtype) if device == "cpu" else source, meta)
            if device == DISK and not isinstance(source, TensorRef):
                to_write[attr] = source.detach()
            _set(module, attr, kind, meta)
        else:
            key = (id(source), str(execution))
            if key not in placed:
                tensor = read_tensor(source, execution) if weights is not None else current.detach().to(execution)
                placed[key] = _as_kind(tensor, kind, current, dtype)
            _set(module, attr, kind, placed[key])
    if to_write:  # this module's disk weights, from memory: one safetensors file in offload_dir
        written = offload_to_folder(to_write, offload_dir, module_name or "model")
        streamed.update({a: (k, written[a], m) for a, (k, _, m) in streamed.items() if a in written})
    _hook(module, execution, streamed, dtype)


def _first_gpu(devices: Iterable[Device]) -> Device:
    gpus = sorted(d for d in devices if isinstance(d, int) and not isinstance(d, bool))
    return gpus[0] if gpus else "cpu"


def _torch_device(device: Device | torch.device) -> torch.device:
    return torch.device("cuda", device) if isinstance(device, int) and not isinstance(device, bool) else torch.device(device)


def _streamed(device: Device, main: torch.device) -> bool:
    """True for weights stored where they cannot run: on disk, or in CPU memory while the model runs elsewhere."""
    return device == DISK or (device == "cpu" and main.type != "cpu")


def _direct_slots(module: nn.Module, prefix: str) -> list[tuple[str, str, str]]:
    """(attribute, full name, "param" or "buffer") of the tensors this module holds itself."""
    join = (lambda n: f"{prefix}.{n}") if prefix else (lambda n: n)
    return ([(n, join(n), "param") for n, p in module._parameters.items() if p is not None] +
            [(n, join(n), "buffer") for n, b in module._buffers.items() if b is not None])


def _source(full: str, current: torch.Tensor, weights: dict[str, Source] | None) -> Source:
    if weights is not None and full in weights:
        return weights[full]
    if current.is_meta:
        raise ValueError(f"{full} has no weights: it is on the meta device and the checkpoint does not have it "
                         f"(a buffer built under init_empty_weights(include_buffers=True)?)")
    return current


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def _meta_like(current: torch.Tensor, source: Source, dtype: torch.dtype | None) -> torch.Tensor:
    t = torch.empty(current.shape, dtype=source.dtype if dtype is None or not source.dtype.is_floating_point else dtype,
                    device="meta")
    return nn.Parameter(t, requires_grad=current.requires_grad) if isinstance(current, nn.Parameter) else t


def _as_kind(t: torch.Tensor, kind: str, current: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    t = _cast(t, dtype)
    return nn.Parameter(t, requires_grad=current.requires_grad) if kind == "param" else t


def _set(module: nn.Module, attr: str, kind: str, value: torch.Tensor) -> None:
    (module._parameters if kind == "param" else module._buffers)[attr] = value


# ---------------------------------------------------------------------------- hooks
def _hook(module: nn.Module, device: torch.device, streamed: dict, dtype: torch.dtype | None) -> None:
    """Move the inputs to `device`; load the streamed weights before forward and drop them after."""
    module.register_forward_pre_hook(functools.partial(_before_forward, device, streamed, dtype), with_kwargs=True)
    if streamed:
        module.register_forward_hook(functools.partial(_after_forward, streamed), always_call=True)


def _before_forward(device: torch.device, streamed: dict, dtype: torch.dtype | None, module: nn.Module,
                    args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    for attr, (kind, source, meta) in streamed.items():
        _set(module, attr, kind, _as_kind(read_tensor(source, device), kind, meta, dtype))
    return _move(args, device), _move(kwargs, device)


def _after_forward(streamed: dict, module: nn.Module, args: tuple, output: Any) -> None:
    for attr, (kind, _, meta) in streamed.items():
        _set(module, attr, kind, meta)


def _move(obj: Any, device: torch.device) -> Any:
    """Tensors inside `obj` moved to `device`, every container keeping its type.

    Tuples, lists, dicts, named tuples, dataclasses (a transformers `ModelOutput` is both a dict and a
    dataclass) and their nestings are rebuilt as the same class; a container none of whose tensors
    moves is returned itself, so a single-device model's outputs and caches pass untouched. Other
    objects (a transformers `Cache`, whose layers update it in place) are passed as they are.
    """
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = [f.name for f in dataclasses.fields(obj) if f.init]
        moved = {name: _move(getattr(obj, name), device) for name in fields}
        if all(moved[name] is getattr(obj, name) for name in fields):
            return obj
        return dataclasses.replace(obj, **moved)
    if isinstance(obj, Mapping):
        moved = {k: _move(v, device) for k, v in obj.items()}
        return obj if all(moved[k] is v for k, v in obj.items()) else type(obj)(moved)
    if isinstance(obj, (tuple, list)):
        items = [_move(o, device) for o in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        return type(obj)(*items) if isinstance(obj, tuple) and hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    items = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, (tuple, list)) else ()
    return next((t for t in map(_first_tensor, items) if t is not None), None)


def _remember_input_device(module: nn.Module, args: tuple, kwargs: dict) -> None:
    first = _first_tensor((args, kwargs))
    module._cadence_input_device = first.device if first is not None else None


def _output_to_input_device(module: nn.Module, args: tuple, output: Any) -> Any:
    device = getattr(module, "_cadence_input_device", None)
    return _move(output, device) if device is not None else output


__all__ = ["dispatch_model", "load_checkpoint_and_dispatch", "auto_device_map"]
