"""`save_model`: the weights alone, in the Hugging Face layout, from any engine.

What `from_pretrained` reads: each tied weight stored once under the name transformers keeps (the
alias is named in the file's metadata, so cadence's loaders restore it), the weights in their master
precision (fp32 under a bf16 engine), and a transformers model's `config.json`. A peft model writes
its adapter in peft's layout, or, with `merge_adapter=True`, the base model with the adapter merged in.
`safe_serialization=False` writes `torch.save` files instead (`pytorch_model.bin`, or its shards and index:
`bin_export.py`), as Accelerate's and transformers' `save_model` / `save_pretrained` do; an export of one
format replaces the other's files.

An export appears whole or not at all: it is written into a staged directory next to its target and
swapped in (`serialization.commit_dir`), so a kill or a full disk at any moment leaves the previous
export or the new one, never shards of two saves. Other files already in the directory (a
tokenizer) are carried into the new one (hard links, no copy). Every shard and the index carry the
same save id, so a loader can tell shards of two saves apart.

>>> learn.save_model("export", max_shard_size="500MB")   # model-00001-of-00003.safetensors, ... + index
>>> learn.save_model("lora")                             # a PeftModel: adapter_config.json + adapter_model.safetensors
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...disk import parse_size
from ...serialization import SAVE_ID_KEY, atomic_path, replacing_dir, save_weights
from ...tied_weights import tied_names
from .bin_export import WEIGHTS_INDEX_NAME, WEIGHTS_NAME, write_bin_weights

SINGLE_NAME, INDEX_NAME = "model.safetensors", "model.safetensors.index.json"


def save_model(learn: Any, directory: str | os.PathLike, max_shard_size: int | str = "2GB",
               merge_adapter: bool = False, safe_serialization: bool = True, wait: bool = True,
               adapter_only: bool = True) -> Path:
    """Write the weights only, in the Hugging Face layout: `model.safetensors`, or shards and an index.

    Every rank must call it (sharded engines gather the weights); the main process writes, and every rank returns
    once the export is written (`wait=False`: the others return at once, and under DDP or on one device the main
    process alone may call it, as Accelerate's `save_model` allows). `adapter_only=False`: a peft model's whole
    state under its own names (`base_model.model....`), as Accelerate's `save_model` writes it. A peft
    `PeftModel` writes its adapter (`PeftModel.from_pretrained(base, directory)` reads it); with
    `merge_adapter=True`, the base model with the adapter merged in (`AutoModel...from_pretrained(directory)`).

    >>> learn.save_model("export", max_shard_size="500MB")   # model-00001-of-00003.safetensors, ... + index
    >>> learn.save_model("merged", merge_adapter=True)       # a LoRA fine-tune as a plain transformers model
    """
    directory = Path(directory)
    limit = parse_size(max_shard_size, "max_shard_size")
    _check_target(directory)
    # the whole user's model (a pipeline rank holds stages of it): its config, ties and peft-ness name the export
    module = learn.strategy.state_template(learn.model)
    is_peft = _is_peft_model(module)
    if merge_adapter and not is_peft:
        raise ValueError(f"save_model(merge_adapter=True) merges a peft adapter, and this model "
                         f"({type(module).__name__}) has none: call save_model without merge_adapter")
    state = learn.strategy.model_state_dict(learn.model)
    if learn.strategy.is_main:
        with replacing_dir(directory, "export") as staged:  # a killed or failed save: the previous export stays
            if is_peft and adapter_only and not merge_adapter:
                module.save_pretrained(str(staged), state_dict=state, safe_serialization=safe_serialization)
            else:
                if merge_adapter:
                    module = learn.strategy.plain_copy(learn.model, state).merge_and_unload()
                    state = module.state_dict()
                if safe_serialization:
                    _write_weights(state, tied_names(module), staged, limit, uuid.uuid4().hex)
                else:  # torch.save keeps a tied weight's storage once by itself
                    write_bin_weights(state, staged, limit)
                _write_config(module, staged, state)
            _carry_other_files(directory, staged)
    if wait:
        learn.strategy.barrier()
    return directory


def _is_peft_model(module: nn.Module) -> bool:
    peft = sys.modules.get("peft")  # a PeftModel exists only once peft was imported: never import it here
    return peft is not None and isinstance(module, peft.PeftModel)


def _write_weights(state: dict[str, torch.Tensor], aliases: dict[str, str], directory: Path, limit: int,
                   save_id: str) -> None:
    """`model.safetensors`, or shards and their index, all stamped with `save_id`; a tied weight stored once, in
    the file of its kept name."""
    stored = {k: v for k, v in state.items() if k not in aliases}
    shards = _split_shards(stored, limit)
    stamp = {SAVE_ID_KEY: save_id}
    if len(shards) == 1:
        save_weights(_with_aliases(shards[0], aliases), directory / SINGLE_NAME, metadata=stamp)
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_weights(_with_aliases(shard, aliases), directory / name, metadata=stamp)
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": sum(_nbytes(t) for t in stored.values()), **stamp}, "weight_map": weight_map}
    with atomic_path(directory / INDEX_NAME) as f:
        f.write_text(json.dumps(index, indent=1))


def _with_aliases(shard: dict[str, torch.Tensor], aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """The shard plus each alias of a weight it holds, as that very tensor: `save_weights` stores it once and names the
    alias in the file's metadata (transformers ignores it and ties the weights itself; cadence's loaders read it)."""
    return {**shard, **{alias: shard[source] for alias, source in aliases.items() if source in shard}}


def _write_config(module: nn.Module, directory: Path, state: dict[str, torch.Tensor]) -> None:
    """A transformers model's config.json (and generation_config.json), which `from_pretrained` needs, naming the
    model's class (`architectures`) and the dtype of the weights written (`dtype`), as `save_pretrained` does: a
    bf16 engine's fp32 weights load back as fp32."""
    config = getattr(module, "config", None)
    if hasattr(config, "save_pretrained"):
        config = copy.copy(config)  # the model's own config is left as it is
        base = module.get_base_model() if _is_peft_model(module) else module
        transformers = sys.modules.get("transformers")
        if transformers is not None and isinstance(base, transformers.PreTrainedModel):  # not a wrapper of the user's
            config.architectures = [type(base).__name__.removeprefix("FSDP")]  # FSDP2 renames the class it wraps
        dtype = next((t.dtype for t in state.values() if t.is_floating_point()), None)
        if dtype is not None:
            config.dtype = str(dtype).removeprefix("torch.")
        config.save_pretrained(str(directory))
    generation = getattr(module, "generation_config", None)
    if hasattr(generation, "save_pretrained"):
        generation.save_pretrained(str(directory))


def _check_target(directory: Path) -> None:
    """ValueError, before any work, for a target that cannot be swapped whole: a file, or the working directory."""
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"save_model: {directory} is a file; give a directory for the export")
    if directory.exists() and Path.cwd().resolve().is_relative_to(directory.resolve()):
        raise ValueError(f"save_model: {directory} holds the working directory; an export is swapped in whole, "
                         f"so give it a directory of its own, e.g. save_model('export')")


def _export_files(directory: Path) -> set[str]:
    """The names in `directory` that belong to an export of either format (weights, shards, index): the new save
    replaces them (a loader would take a `model.safetensors` left there for the new `.bin` weights)."""
    names = {SINGLE_NAME, INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME}
    for index in (INDEX_NAME, WEIGHTS_INDEX_NAME):
        try:
            names |= set(json.loads((directory / index).read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
    return names | {p.name for pattern in ("model-*-of-*.safetensors", "pytorch_model-*-of-*.bin")
                    for p in directory.glob(pattern)}


def _carry_other_files(directory: Path, staged: Path) -> None:
    """Hard-link (copy where links cannot be made) everything in `directory` but its export into `staged`; a name
    the new export wrote (config.json, an adapter) keeps the new file."""
    if not directory.is_dir():
        return
    exported = _export_files(directory)

    def ignore(folder: str, names: list[str]) -> set[str]:
        written = {n for n in names if (staged / Path(folder).relative_to(directory) / n).is_file()}
        return written | (exported if Path(folder) == directory else set())

    shutil.copytree(directory, staged, symlinks=True, dirs_exist_ok=True, copy_function=_link_or_copy, ignore=ignore)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


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
