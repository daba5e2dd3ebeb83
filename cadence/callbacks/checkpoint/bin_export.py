"""`save_model(..., safe_serialization=False)`: the weights as `torch.save` files, in Accelerate's and transformers'
layout.

`pytorch_model.bin`, or, above `max_shard_size`, `pytorch_model-00001-of-0000N.bin` shards and their
`pytorch_model.bin.index.json` (`{"metadata": {"total_size": ...}, "weight_map": {name: file}}`), cut as
Accelerate cuts them (huggingface_hub's rule): tensors in order, a new shard when the next one would pass
the limit, a tensor bigger than the limit alone in its shard, the names of one storage (tied weights) in
the shard of the first. `load_checkpoint_in_model`, transformers' `from_pretrained` and `torch.load`
read them. `save_model` writes them into its staged directory, swapped in whole (`export.py`).

>>> write_bin_weights(model.state_dict(), staged, max_shard_size="200MB")
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ...disk import parse_size
from ...serialization import atomic_path, save_torch

__all__ = ["write_bin_weights", "WEIGHTS_NAME", "WEIGHTS_INDEX_NAME"]

WEIGHTS_NAME, WEIGHTS_INDEX_NAME = "pytorch_model.bin", "pytorch_model.bin.index.json"


def write_bin_weights(state: dict[str, torch.Tensor], directory: Path, max_shard_size: int | str) -> list[str]:
    """Write `state` (CPU tensors) into the new directory `directory` as above; returns the weight files' names."""
    shards = _split(state, parse_size(max_shard_size, "max_shard_size"))
    names = [WEIGHTS_NAME] if len(shards) == 1 else \
        [f"pytorch_model-{i:05d}-of-{len(shards):05d}.bin" for i in range(1, len(shards) + 1)]
    for name, keys in zip(names, shards):
        save_torch({k: state[k] for k in keys}, directory / name, host_tags=False)
    if len(shards) > 1:
        index = {"metadata": {"total_size": _total_size(state)},
                 "weight_map": {k: name for name, keys in zip(names, shards) for k in keys}}
        with atomic_path(directory / WEIGHTS_INDEX_NAME) as f:
            f.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return names


def _storage_key(t: torch.Tensor) -> tuple:
    return t.device, t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


def _split(state: dict[str, torch.Tensor], limit: int) -> list[list[str]]:
    """The names in each shard: the first name of each storage decides its shard, the others follow it there."""
    first_of: dict[tuple, str] = {}
    followers: dict[str, list[str]] = {}
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, t in state.items():
        key = _storage_key(t)
        if key in first_of:
            followers[first_of[key]].append(name)
            continue
        first_of[key], followers[name] = name, []
        nbytes = t.untyped_storage().nbytes()
        if nbytes > limit:
            shards.append([name])
            continue
        if size + nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current or not shards:
        shards.append(current)
    return [[k for name in shard for k in (name, *followers[name])] for shard in shards]


def _total_size(state: dict[str, torch.Tensor]) -> int:
    storages = {_storage_key(t): t.untyped_storage().nbytes() for t in state.values()}
    return sum(storages.values())
