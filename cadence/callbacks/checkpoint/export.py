"""`save_model`: the weights alone, in the Hugging Face layout, from any engine.

>>> learn.save_model("export", max_shard_size="500MB")   # model-00001-of-00003.safetensors, ... + index
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ...serialization import atomic_path, parse_size, save_weights


def save_model(learn: Any, directory: str | os.PathLike, max_shard_size: int | str = "2GB") -> Path:
    """Write the weights only, in the Hugging Face layout: `model.safetensors`, or shards and an index.

    Every rank must call it (sharded engines gather the weights); the main process writes.

    >>> learn.save_model("export", max_shard_size="500MB")   # model-00001-of-00003.safetensors, ... + index
    """
    directory = Path(directory)
    limit = parse_size(max_shard_size, "max_shard_size")
    state = learn.strategy.model_state_dict(learn.model)
    if learn.strategy.is_main:
        directory.mkdir(parents=True, exist_ok=True)
        shards = _split_shards(state, limit)
        if len(shards) == 1:
            save_weights(shards[0], directory / "model.safetensors")
        else:
            weight_map = {}
            for i, shard in enumerate(shards, 1):
                name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_weights(shard, directory / name)
                weight_map.update(dict.fromkeys(shard, name))
            index = {"metadata": {"total_size": sum(_nbytes(t) for t in state.values())}, "weight_map": weight_map}
            with atomic_path(directory / "model.safetensors.index.json") as f:
                f.write_text(json.dumps(index, indent=1))
    learn.strategy.barrier()
    return directory


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
