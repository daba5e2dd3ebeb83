"""`save_model`: the weights alone, in the Hugging Face layout, from any engine.

What `from_pretrained` reads: each tied weight stored once under the name transformers keeps (the
alias is named in the file's metadata, so cadence's loaders restore it), the weights in their master
precision (fp32 under a bf16 engine), and a transformers model's `config.json`. A peft model writes
its adapter in peft's layout, or, with `merge_adapter=True`, the base model with the adapter merged in.

>>> learn.save_model("export", max_shard_size="500MB")   # model-00001-of-00003.safetensors, ... + index
>>> learn.save_model("lora")                             # a PeftModel: adapter_config.json + adapter_model.safetensors
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...distributed.strategy import tied_names
from ...serialization import atomic_path, parse_size, save_weights


def save_model(learn: Any, directory: str | os.PathLike, max_shard_size: int | str = "2GB",
               merge_adapter: bool = False) -> Path:
    """Write the weights only, in the Hugging Face layout: `model.safetensors`, or shards and an index.

    Every rank must call it (sharded engines gather the weights); the main process writes. A peft
    `PeftModel` writes its adapter (`PeftModel.from_pretrained(base, directory)` reads it); with
    `merge_adapter=True`, the base model with the adapter merged in (`AutoModel...from_pretrained(directory)`).

    >>> learn.save_model("export", max_shard_size="500MB")   # model-00001-of-00003.safetensors, ... + index
    >>> learn.save_model("merged", merge_adapter=True)       # a LoRA fine-tune as a plain transformers model
    """
    directory = Path(directory)
    limit = parse_size(max_shard_size, "max_shard_size")
    module = learn.strategy.unwrap(learn.model)
    is_peft = _is_peft_model(module)
    if merge_adapter and not is_peft:
        raise ValueError(f"save_model(merge_adapter=True) merges a peft adapter, and this model "
                         f"({type(module).__name__}) has none: call save_model without merge_adapter")
    state = learn.strategy.model_state_dict(learn.model)
    if learn.strategy.is_main:
        directory.mkdir(parents=True, exist_ok=True)
        if is_peft and not merge_adapter:
            module.save_pretrained(str(directory), state_dict=state, safe_serialization=True)
        else:
            if merge_adapter:
                module = learn.strategy.plain_copy(learn.model, state).merge_and_unload()
                state = module.state_dict()
            _write_weights(state, tied_names(module), directory, limit)
            _write_config(module, directory)
    learn.strategy.barrier()
    return directory


def _is_peft_model(module: nn.Module) -> bool:
    peft = sys.modules.get("peft")  # a PeftModel exists only once peft was imported: never import it here
    return peft is not None and isinstance(module, peft.PeftModel)


def _write_weights(state: dict[str, torch.Tensor], aliases: dict[str, str], directory: Path, limit: int) -> None:
    """`model.safetensors`, or shards and their index; a tied weight stored once, in the file of its kept name."""
    stored = {k: v for k, v in state.items() if k not in aliases}
    shards = _split_shards(stored, limit)
    if len(shards) == 1:
        save_weights(_with_aliases(shards[0], aliases), directory / "model.safetensors")
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_weights(_with_aliases(shard, aliases), directory / name)
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": sum(_nbytes(t) for t in stored.values())}, "weight_map": weight_map}
    with atomic_path(directory / "model.safetensors.index.json") as f:
        f.write_text(json.dumps(index, indent=1))


def _with_aliases(shard: dict[str, torch.Tensor], aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """The shard plus each alias of a weight it holds, as that very tensor: `save_weights` stores it once and names the
    alias in the file's metadata (transformers ignores it and ties the weights itself; cadence's loaders read it)."""
    return {**shard, **{alias: shard[source] for alias, source in aliases.items() if source in shard}}


def _write_config(module: nn.Module, directory: Path) -> None:
    """A transformers model's config.json (and generation_config.json), which `from_pretrained` needs."""
    for config in (getattr(module, "config", None), getattr(module, "generation_config", None)):
        if hasattr(config, "save_pretrained"):
            config.save_pretrained(str(directory))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _split_shards(state: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    shards, current, size = [], {}, 0
    for name, t in state.items():
        if current and size + _nbytes(t) > limit:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += _nbytes(t)
    return shards + [current] if current or not shards else shards
