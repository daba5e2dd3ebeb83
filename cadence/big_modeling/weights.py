"""Where each weight of a checkpoint lives on disk, and reading one weight at a time.

A checkpoint is a `.safetensors` file, a directory with `model.safetensors` or a sharded
`model.safetensors.index.json` (the Hugging Face layout `learn.save_model` writes), or that index
file itself; a torch file (`.pt`, `.bin`) is memory-mapped. Safetensors weights are read with
plain file reads at their offsets, not through a memory map, so a weight read and dropped leaves
nothing behind in the process's resident memory.

>>> refs = checkpoint_refs("export/")                  # {name: TensorRef}, reads only the headers
>>> w = read_tensor(refs["layers.0.weight"])            # one tensor, on the CPU
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..serialization import REPLACED, SAVE_ID_KEY, file_aliases, save_weights, sibling, strip_compile_prefix

INDEX_NAME, SINGLE_NAME = "model.safetensors.index.json", "model.safetensors"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass(frozen=True)
class TensorRef:
    """One tensor inside a safetensors file: where its bytes are and what they are."""

    path: str
    start: int
    end: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def safetensors_refs(path: str | os.PathLike) -> dict[str, TensorRef]:
    """Every tensor of one safetensors file, from its header alone (tied names written by cadence included)."""
    return refs_and_metadata(path)[0]


def refs_and_metadata(path: str | os.PathLike) -> tuple[dict[str, TensorRef], dict[str, str]]:
    """`safetensors_refs` and the string entries of the file's header (`__metadata__`)."""
    path = str(path)
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + length
    refs = {}
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which cadence cannot read")
        start, end = info["data_offsets"]
        refs[name] = TensorRef(path, base + start, base + end, _DTYPES[info["dtype"]], tuple(info["shape"]))
    for alias, name in file_aliases(path, metadata, set(refs)).items():
        refs[alias] = refs[name]
    return refs, metadata


def read_tensor(ref: "TensorRef | torch.Tensor", device: str | torch.device = "cpu") -> torch.Tensor:
    """The tensor `ref` points to, read into fresh memory (a torch tensor, e.g. memory-mapped, is copied)."""
    if isinstance(ref, torch.Tensor):
        return ref.to(device, copy=True)
    out = torch.empty(ref.shape, dtype=ref.dtype)
    if ref.nbytes:
        with open(ref.path, "rb") as f:
            f.seek(ref.start)
            f.readinto(memoryview(out.view(-1).view(torch.uint8).numpy()))
    return out.to(device)


def checkpoint_refs(checkpoint: str | os.PathLike) -> dict[str, "TensorRef | torch.Tensor"]:
    """{name: where the tensor is} for a checkpoint file, directory or index (see the module docstring).

    Names saved from a `torch.compile`d model lose their `_orig_mod.` segment.
    """
    path = Path(checkpoint)
    if path.is_dir():
        for name in (INDEX_NAME, SINGLE_NAME):
            if (path / name).is_file():
                return checkpoint_refs(path / name)
        found = sorted(p.name for p in path.iterdir())[:10]
        raise FileNotFoundError(f"{path} has neither {SINGLE_NAME} nor {INDEX_NAME} (it has {found}); "
                                f"pass the weights file itself, or write them with learn.save_model({str(path)!r})")
    if not path.is_file():
        interrupted = sibling(path, REPLACED)
        if interrupted.is_dir():
            raise FileNotFoundError(f"checkpoint {path} does not exist: a save into it was interrupted while it swapped "
                                    f"the new export in ({interrupted} is the previous one); the next save_model into "
                                    f"{path} finishes it, as does cadence.serialization.recover_dir({str(path)!r})")
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.name.endswith(".index.json"):
        return strip_compile_prefix(_sharded_refs(path))
    if path.suffix == ".safetensors":
        return strip_compile_prefix(safetensors_refs(path))
    if path.suffix in (".pt", ".pth", ".bin"):
        return strip_compile_prefix(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    raise ValueError(f"checkpoint {path}: expected a .safetensors file, a directory with {SINGLE_NAME} or "
                     f"{INDEX_NAME}, an index json, or a torch file (.pt, .bin)")


def _sharded_refs(index: Path) -> dict[str, TensorRef]:
    """{name: TensorRef} of a sharded checkpoint, each name from the shard its index names, checked first.

    ValueError naming the shard when it lacks a tensor the index puts there, or when it carries
    another save's id than the index (shards of two `save_model` calls, or copied from two exports).
    """
    try:
        index_json = json.loads(index.read_text())
        weight_map = index_json["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{index} is not a readable index (no weight_map: {e!r}); save the model again") from None
    save_id = (index_json.get("metadata") or {}).get(SAVE_ID_KEY)
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    refs = {}
    for file, names in by_file.items():
        shard = index.parent / file
        if not shard.is_file():
            raise FileNotFoundError(f"{shard}, named by {index}, does not exist: the export is incomplete; save it again")
        found, metadata = refs_and_metadata(shard)
        shard_id = metadata.get(SAVE_ID_KEY)
        absent = [n for n in names if n not in found]
        if absent or (save_id is not None and shard_id != save_id):
            what = (f"lacks {absent[:5]}, which the index puts there" if absent else
                    f"was written by another save than {index.name} (save id {shard_id} against {save_id})")
            raise ValueError(f"{shard} does not match its index: it {what}. The export mixes files of two saves "
                             f"(an interrupted save, or files copied from two exports): save the model again")
        refs.update({n: found[n] for n in names})
    return refs


def offload_to_folder(tensors: dict[str, torch.Tensor], folder: str | os.PathLike, name: str) -> dict[str, TensorRef]:
    """Write `tensors` to `folder/<name>.safetensors` (atomically) and return where each now lives."""
    file = Path(folder) / f"{name}.safetensors"
    save_weights(tensors, file)
    return safetensors_refs(file)


__all__ = ["TensorRef", "checkpoint_refs", "read_tensor", "safetensors_refs", "offload_to_folder"]
