"""Reading the files of DeepSpeed's and torch's distributed checkpoints without running code from them.

A pickle can call any function it names, so a checkpoint a user resumes from is read as data only: DeepSpeed's
files by torch's `weights_only` unpickler (tensors, numbers, strings, plain containers) with only the four DeepSpeed
classes its own files hold added (`deepspeed_classes`), and the `.metadata` of torch's distributed checkpoint by an
unpickler that knows only that format's record classes (`read_dcp_metadata`). A file that names anything else is
refused before anything in it is built: a ValueError names the file and what it names.

>>> state = load_deepspeed_file("ckpt/step-00000200/deepspeed/mp_rank_00_model_states.pt", map_location="cpu")
>>> check_deepspeed_files(Path("ckpt/step-00000200/deepspeed"))   # before DeepSpeed's own converter reads them
>>> metadata = read_dcp_metadata(Path("ckpt/step-00000200/sharded/.metadata"))
"""

from __future__ import annotations

import contextlib
import pathlib
import pickle
import re
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .load_in_place import load_mapped


def deepspeed_classes() -> list[type]:
    """The classes DeepSpeed's own checkpoint files hold besides tensors and containers (ZeRO 0-3; fp32, bf16, fp16;
    DeepSpeed's schedulers keep plain numbers). Each only stores what it is given; none reads, writes or runs
    anything when built: the static and the dynamic loss scaler (`loss_scaler`: a scale, counters, a dtype), the
    ZeRO stage (an int enum) and a fragment's address in a flat partition (two ints, ZeRO-1/2 `param_slice_mappings`).

    >>> with torch.serialization.safe_globals(deepspeed_classes()): torch.load(file, weights_only=True)
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def _deepspeed_file(path: str | Path) -> Iterator[None]:
    """DeepSpeed's classes allowed to torch's weights_only unpickler; its refusal a ValueError naming `path`."""
    scoped = getattr(torch.serialization, "safe_globals", None)  # torch >= 2.5; on 2.4 allowed for the process
    if scoped is None:
        torch.serialization.add_safe_globals(deepspeed_classes())
    try:
        with scoped(deepspeed_classes()) if scoped is not None else contextlib.nullcontext():
            yield
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"a reference to {found[1].rstrip('.')}" if found else "objects other than tensors and plain data"
        raise ValueError(f"{path} holds {what}, which DeepSpeed's own checkpoint files never hold: unpickling it "
                         f"could run code from the file, so cadence refuses it. Resume from another checkpoint; if "
                         f"you made this file and trust it, load it yourself with DeepSpeed "
                         f"(engine.load_checkpoint(directory, tag='deepspeed'))") from None


def load_deepspeed_file(path: str | Path, map_location: Any = None, mmap: bool = False) -> Any:
    """`torch.load(path, weights_only=True)` of a file DeepSpeed wrote, its own classes (`deepspeed_classes`)
    allowed; anything else refused with a ValueError naming the file. `mmap`: the storages mapped from the file, not
    read (None for a file in torch's legacy format, which cannot be mapped).

    >>> state = load_deepspeed_file(optim_file, map_location="cpu", mmap=True)
    """
    with _deepspeed_file(path), _damaged_names(path):
        if mmap:
            return load_mapped(str(path), map_location)
        return torch.load(path, map_location=map_location, weights_only=True)


@contextlib.contextmanager
def _damaged_names(path: str | Path) -> Iterator[None]:
    """torch's reader failing on a truncated or damaged zip (its message names no file): a ValueError naming it."""
    try:
        yield
    except RuntimeError as e:
        if "PytorchStreamReader" not in str(e):
            raise
        raise ValueError(f"{path} is damaged ({str(e).splitlines()[0]}): it was cut short or changed after it was "
                         f"written; resume from another checkpoint") from e


def check_deepspeed_files(directory: Path) -> None:
    """Every file of DeepSpeed's checkpoint folder `directory` (but cadence's own `cadence.json`) read as
    `load_deepspeed_file` reads it, its tensors mapped, not read: what DeepSpeed's own readers (its universal
    converter) then unpickle unchecked is refused first, naming the file.

    >>> check_deepspeed_files(Path("ckpt/step-00000200/deepspeed")); to_universal(...)
    """
    for file in sorted(p for p in Path(directory).rglob("*") if p.is_file() and p.name != "cadence.json"):
        if not zipfile.is_zipfile(file) and not _is_legacy_torch_file(file):
            raise ValueError(f"{file} is not a torch file: DeepSpeed's checkpoint folder holds only its own files; "
                             f"the checkpoint is damaged or was changed: resume from another checkpoint")
        if load_deepspeed_file(file, "cpu", mmap=True) is None:
            load_deepspeed_file(file, "cpu")


def _is_legacy_torch_file(path: Path) -> bool:
    """Whether `path` starts as torch's legacy (pre-zip) format does: a pickle (protocol 2 or later)."""
    with open(path, "rb") as f:
        return f.read(1) == b"\x80"


def _dcp_classes() -> dict[tuple[str, str], Any]:
    """What the `.metadata` pickle of torch's distributed checkpoint names, by (module, name): its record classes
    (dataclasses and enums that only store their fields), `_StorageInfo` (a file name, offset and length), torch.Size,
    torch's lookup of a layout by name, a path (`storage_meta.checkpoint_id`: built, never opened) and OrderedDict."""
    from torch.distributed.checkpoint import filesystem, metadata

    records = [metadata.Metadata, metadata.MetadataIndex, metadata.StorageMeta, metadata.TensorProperties,
               metadata.TensorStorageMetadata, metadata.BytesStorageMetadata, metadata.ChunkStorageMetadata,
               metadata._MEM_FORMAT_ENCODING, filesystem._StorageInfo]
    found = {(c.__module__, c.__name__): c for c in records}
    found.update({("torch", "Size"): torch.Size, ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
                  ("pathlib", "PosixPath"): pathlib.PosixPath, ("collections", "OrderedDict"): OrderedDict})
    return found


class _Refused(pickle.UnpicklingError):
    """A name `_DcpMetadata` does not build."""


class _DcpMetadata(pickle.Unpickler):
    def __init__(self, file: Any):
        super().__init__(file)
        self._known = _dcp_classes()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._known:
            return self._known[module, name]
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):  # values, never called
            return value
        raise _Refused(f"{module}.{name}")


def read_dcp_metadata(path: Path) -> Any:
    """The `.metadata` of torch's distributed checkpoint at `path` (torch's `Metadata`), read by an unpickler that
    builds only that format's records (`_dcp_classes`) and torch's dtypes, layouts and memory formats; a file naming
    anything else is refused with a ValueError naming it, before anything of it is built.

    >>> read_dcp_metadata(Path("ckpt/step-00000200/sharded/.metadata")).storage_data
    """
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with open(path, "rb") as f:
            metadata = _DcpMetadata(f).load()
    except _Refused as e:
        raise ValueError(f"{path} holds a reference to {e}, which torch's checkpoint metadata never holds: "
                         f"unpickling it could run code from the file, so cadence refuses it; resume from "
                         f"another checkpoint") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError, IndexError,
            RuntimeError) as e:
        raise ValueError(f"{path} is truncated or corrupt ({e}); resume from another checkpoint") from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{path} holds a {type(metadata).__name__}, not torch's checkpoint metadata; resume from "
                         f"another checkpoint")
    return metadata
