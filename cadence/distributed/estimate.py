"""`cadence estimate-memory`: model-state memory per process for DDP, FSDP and ZeRO 1-3, with and without offload.

Model states are parameters, gradients and Adam's state, counted per parameter as in the ZeRO paper
(Rajbhandari et al. 2020, section 3): mixed precision keeps 2-byte parameters and gradients and
K = 12 bytes of optimizer state (an fp32 master copy and two moments), (2 + 2 + 12)Ψ in all; ZeRO-1
partitions the 12, ZeRO-2 the gradients too, ZeRO-3 everything. DeepSpeed keeps its fp32 master even
in fp32 (4 + 4 + 12); DDP and FSDP2 keep fp32 parameters under autocast and torch's Adam (4 + 4 + 8).
Optimizer offload moves the optimizer state and the fp32 gradient partition to the CPU; parameter offload
(ZeRO-3) the parameters too. Activations, buffers and communication buckets are not model state.

The "DeepSpeed's estimate" column repeats DeepSpeed's `estimate_zero2/3_model_states_mem_needs`
(mixed precision): it adds the fp32 gradient partition DeepSpeed holds while it steps, ZeRO-3's largest
layer gathered whole, and, on the CPU, its 1.5x buffer factor per machine.

    cadence estimate-memory 1B --num_processes 8
    cadence estimate-memory mymodels:build_llama --num_processes 8 16
    cadence estimate-memory path/to/llama/ --num_processes 8      # a Hugging Face config.json, offline

>>> model_state_bytes(1e9, "ZeRO-3", 8, mixed=True).device / 2**30
1.862645149230957
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

ENGINES = ("DDP", "FSDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
OFFLOADS = {"ZeRO-1": ("optimizer",), "ZeRO-2": ("optimizer",), "ZeRO-3": ("optimizer", "optimizer+param"),
            "FSDP": ("optimizer+param",)}
_COUNT = re.compile(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([KMBGT]?)\s*", re.IGNORECASE)
_SUFFIXES = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


@dataclass
class Estimate:
    """Bytes of model state one process holds on its device and on the CPU."""

    device: float
    cpu: float


def _bytes_per_param(engine: str, mixed: bool) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) bytes per parameter."""
    if engine.startswith("ZeRO"):
        return (2, 2, 12) if mixed else (4, 4, 12)
    return 4, 4, 8  # torch: fp32 parameters (autocast casts per op), fp32 gradients, Adam's two moments


def model_state_bytes(num_params: float, engine: str, num_processes: int, mixed: bool = True,
                      offload: str = "none") -> Estimate:
    """Model-state bytes per process. `offload`: "none", "optimizer" (ZeRO 1-3) or "optimizer+param" (ZeRO-3, FSDP).

    >>> model_state_bytes(7.5e9, "DDP", 64).device / 1e9      # the ZeRO paper's baseline: 16 bytes per parameter
    120.0
    """
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is not one of {ENGINES}")
    if offload != "none" and offload not in OFFLOADS.get(engine, ()):
        raise ValueError(f"{engine} has no {offload!r} offload; it offers {OFFLOADS.get(engine, ('none',))}")
    p, g, o = _bytes_per_param(engine, mixed)
    n = num_processes
    sharded = {"DDP": 0, "ZeRO-1": o, "ZeRO-2": g + o, "ZeRO-3": p + g + o, "FSDP": p + g + o}[engine]
    replicated = p + g + o - sharded
    if offload == "none":
        return Estimate(num_params * (replicated + sharded / n), 0.0)
    # the optimizer steps on the CPU: its state and an fp32 partition of the gradients live there
    fp32_grads = 4 if mixed else g
    device = num_params * (p if engine in ("ZeRO-1", "ZeRO-2") else p / n)
    cpu = num_params * (o + fp32_grads) / n
    if offload == "optimizer+param":
        device, cpu = 0.0, cpu + num_params * p / n
    return Estimate(device, cpu)


def deepspeed_estimate(num_params: float, engine: str, num_processes: int, num_machines: int = 1,
                       offload: str = "none", largest_layer_params: int = 0) -> Estimate | None:
    """DeepSpeed's own estimate (mixed precision, zero.Init for ZeRO-3): device bytes per process, CPU bytes per machine.

    >>> deepspeed_estimate(1e9, "ZeRO-2", 8).device / 1e9
    4.25
    """
    per_machine = num_processes // num_machines
    if engine == "ZeRO-2":
        if offload == "none":
            return Estimate(2 * num_params + int(18 * num_params / num_processes), num_params * 4 * per_machine * 1.5)
        return Estimate(2 * num_params, num_params * max(4 * num_processes, 16) * 1.5)
    if engine != "ZeRO-3":
        return None
    layer = 4 * largest_layer_params
    if offload == "none":
        return Estimate(layer + int(18 * num_params / num_processes), largest_layer_params * 4 * per_machine * 1.5)
    if offload == "optimizer":
        return Estimate(layer + int(2 * num_params / num_processes), num_params * 16 / num_machines * 1.5)
    return Estimate(layer, num_params * 18 / num_machines * 1.5)


def parse_count(text: str) -> int:
    """A parameter count: "1B", "7.5B", "350M", "1e9", "125000000".

    >>> parse_count("7.5B")
    7500000000
    """
    m = _COUNT.fullmatch(text)
    if not m:
        raise ValueError(f"{text!r} is neither a parameter count (e.g. 1B, 350M, 7e9), an existing directory holding a "
                         f"Hugging Face config.json (or the file) nor module:function")
    return int(float(m.group(1)) * _SUFFIXES[m.group(2).upper()])


def model_sizes(spec: str) -> tuple[int, int]:
    """(parameters, largest layer's parameters) of `spec`, counted as DeepSpeed's estimators count them.

    `spec`: a count ("7B"); a Hugging Face config, as a directory holding `config.json` or the json
    file itself (the model is built from it on the meta device; needs transformers, no download); or
    `module:function` returning an nn.Module, imported from the current directory or sys.path and
    built on the meta device. A tied parameter counts once; a layer is a module's own parameters.

    >>> model_sizes("torch.nn:Transformer")    # doctest: +SKIP
    (44140544, 2362368)
    >>> model_sizes("llama-config/")           # doctest: +SKIP
    (6738415616, 131072000)
    """
    path = Path(spec)
    if _COUNT.fullmatch(spec):
        return parse_count(spec), 0
    if path.is_dir() or path.suffix == ".json":
        model = _from_hf_config(path)
    elif ":" in spec:
        model = _from_function(spec)
    else:
        return parse_count(spec), 0  # refused, naming what it takes
    total = sum({id(p): p.numel() for p in model.parameters()}.values())  # shared parameters once
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return total, largest


def _from_function(spec: str) -> nn.Module:
    module_name, fn_name = spec.split(":", 1)
    if os.getcwd() not in sys.path:  # as `python -m` would: the user's own module beside them
        sys.path.insert(0, os.getcwd())
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load {spec!r} ({e}): give module:function, the function returning an nn.Module, "
                         f"with the module importable from the current directory") from None
    with torch.device("meta"):  # no memory, however large
        model = fn()
    if not isinstance(model, nn.Module):
        raise ValueError(f"{spec} returned {type(model).__name__}, not an nn.Module")
    return model


def _from_hf_config(path: Path) -> nn.Module:
    """The transformers model a config describes (its `architectures`, else a causal LM, else the base model), on meta."""
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        found = sorted(p.name for p in path.iterdir())[:10] if path.is_dir() else []
        raise ValueError(f"{file} does not exist{f' ({path} has {found})' if path.is_dir() else ''}: give a directory "
                         f"holding a Hugging Face config.json, the json file, a count (7B) or module:function")
    try:
        import transformers
    except ImportError:
        raise ValueError(f"{file} is a Hugging Face config, which needs transformers: pip install transformers") from None
    try:
        config = transformers.AutoConfig.from_pretrained(str(file))
    except (OSError, ValueError) as e:
        raise ValueError(f"{file} is not a Hugging Face model config ({e})") from None
    architecture = getattr(transformers, (config.architectures or [""])[0], None)
    with torch.device("meta"):  # no memory, however large
        if architecture is not None:
            return architecture(config)
        try:
            return transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:  # not a language model: its base model
            return transformers.AutoModel.from_config(config)


def table(num_params: int, num_processes: int, largest_layer_params: int = 0, num_machines: int = 1) -> str:
    """The Markdown table `cadence estimate-memory` prints: GiB per process, fp32 and mixed precision."""
    gib = lambda b: f"{b / 2**30:.2f}"
    lines = [f"Model states for {num_params:,} parameters on {num_processes} processes (GiB per process; "
             f"Adam; activations not included)", "",
             "| engine | offload | fp32: device | fp32: CPU | mixed: device | mixed: CPU | DeepSpeed's estimate (mixed): device / CPU per machine |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for engine in ENGINES:
        for offload in ("none", *OFFLOADS.get(engine, ())):
            fp32 = model_state_bytes(num_params, engine, num_processes, mixed=False, offload=offload)
            mixed = model_state_bytes(num_params, engine, num_processes, mixed=True, offload=offload)
            theirs = deepspeed_estimate(num_params, engine, num_processes, num_machines, offload, largest_layer_params)
            ds = f"{gib(theirs.device)} / {gib(theirs.cpu)}" if theirs else ""
            lines.append(f"| {engine} | {offload} | {gib(fp32.device)} | {gib(fp32.cpu)} | {gib(mixed.device)} | "
                         f"{gib(mixed.cpu)} | {ds} |")
    return "\n".join(lines)
