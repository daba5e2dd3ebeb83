"""`save_model`: the weights alone, in the Hugging Face layout, from any engine.

An export appears whole or not at all: it is written into a staged directory next to its target and
swapped in (`serialization.commit_dir`), so a kill or a full disk at any moment leaves the previous
export or the new one, never shards of two saves. Other files already in the directory (a
tokenizer, config.json) are carried into the new one (hard links, no copy). Every shard and the
index carry the same save id, so a loader can tell shards of two saves apart.

>>> learn.save_model("export", max_shard_size="500MB")   # model-00001-of-00003.safetensors, ... + index
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from ...serialization import SAVE_ID_KEY, atomic_path, commit_dir, parse_size, recover_dir, save_weights, staging_dir

SINGLE_NAME, INDEX_NAME = "model.safetensors", "model.safetensors.index.json"


def save_model(learn: Any, directory: str | os.PathLike, max_shard_size: int | str = "2GB") -> Path:
    """Write the weights only, in the Hugging Face layout: `model.safetensors`, or shards and an index.

    Every rank must call it (sharded engines gather the weights); the main process writes.

    >>> learn.save_model("export", max_shard_size="500MB")   # model-00001-of-00003.safetensors, ... + index
    """
    directory = Path(directory)
    limit = parse_size(max_shard_size, "max_shard_size")
    _check_target(directory)
    state = learn.strategy.model_state_dict(learn.model)
    if learn.strategy.is_main:
        recover_dir(directory)  # a save killed between its two renames is finished first
        staged = staging_dir(directory)
        try:
            save_id = uuid.uuid4().hex
            shards = _split_shards(state, limit)
            if len(shards) == 1:
                save_weights(shards[0], staged / SINGLE_NAME, metadata={SAVE_ID_KEY: save_id})
            else:
                weight_map = {}
                for i, shard in enumerate(shards, 1):
                    name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                    save_weights(shard, staged / name, metadata={SAVE_ID_KEY: save_id})
                    weight_map.update(dict.fromkeys(shard, name))
                index = {"metadata": {"total_size": sum(_nbytes(t) for t in state.values()), SAVE_ID_KEY: save_id},
                         "weight_map": weight_map}
                with atomic_path(staged / INDEX_NAME) as f:
                    f.write_text(json.dumps(index, indent=1))
            _carry_other_files(directory, staged)
        except BaseException as e:
            shutil.rmtree(staged, ignore_errors=True)  # a full disk gets its space back now, not at the next save
            if isinstance(e, (OSError, SafetensorError)):
                free = shutil.disk_usage(directory.parent if not directory.is_dir() else directory).free
                raise OSError(f"save_model could not write the export to {directory} ({e}); {free / 2**20:,.1f} MiB "
                              f"free there. The previous export in it, if any, is untouched") from e
            raise
        commit_dir(staged, directory)
    learn.strategy.barrier()
    return directory


def _check_target(directory: Path) -> None:
    """ValueError, before any work, for a target that cannot be swapped whole: a file, or the working directory."""
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"save_model: {directory} is a file; give a directory for the export")
    if directory.exists() and Path.cwd().resolve().is_relative_to(directory.resolve()):
        raise ValueError(f"save_model: {directory} holds the working directory; an export is swapped in whole, "
                         f"so give it a directory of its own, e.g. save_model('export')")


def _export_files(directory: Path) -> set[str]:
    """The names in `directory` that belong to an export (weights, shards, index): the new save replaces them."""
    names = {SINGLE_NAME, INDEX_NAME}
    try:
        names |= set(json.loads((directory / INDEX_NAME).read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return names | {p.name for p in directory.glob("model-*-of-*.safetensors")}


def _carry_other_files(directory: Path, staged: Path) -> None:
    """Hard-link (copy where links cannot be made) everything in `directory` but its export into `staged`."""
    if not directory.is_dir():
        return
    exported = _export_files(directory)
    shutil.copytree(directory, staged, symlinks=True, dirs_exist_ok=True, copy_function=_link_or_copy,
                    ignore=lambda folder, names: exported if Path(folder) == directory else ())


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
