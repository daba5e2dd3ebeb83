"""Reading torch's distributed checkpoint (`.distcp` files) straight into the tensors it restores.

torch's `FileSystemReader` `torch.load`s every saved tensor from its slice of the file into fresh memory and then
copies it into the model's or optimizer's tensor: two copies of every byte and the unpickler's Python per tensor,
which on a host where a shard is read from the page cache costs more than the bytes. `DirectReader` reads a tensor
saved whole (its `torch.save` record stored, uncompressed, as torch writes it) with one `readinto` into the target's
own memory, when the target is a contiguous CPU tensor of the saved dtype, shape and layout; anything else (a part
of a saved tensor, on another world size; a device tensor; a stream transform; a non-tensor item) goes to torch's
reader as before. The bytes that land are the same either way.

The two sharded engines lay an optimizer's state out differently: `strategy="fsdp"` as torch's optimizer state dict
(`optimizer.param_groups.<group>.<hyper-parameter>`, each group listing its parameters), `strategy="model_parallel"`
flattened (`optimizer.param_groups.<parameter>.<hyper-parameter>`). The per-parameter state (`optimizer.state.
<parameter>.<key>`: AdamW's moments and step) is named alike in both; `load` reads the hyper-parameters of either layout
into the other (`optimizer_layout` tells them apart by `.metadata`), so each engine resumes the other's checkpoint.

Nothing read runs code from the checkpoint: `.metadata` (a pickle) is read by `safe_load.read_dcp_metadata`, which
builds only torch's metadata records, and the non-tensor items (an optimizer's hyper-parameters, each a `torch.save`
of its own) by `WeightsOnlyPlanner` with `weights_only=True` (torch's planner unpickles them unchecked).

>>> reader = DirectReader(directory / "sharded"); reader.check(); reader.load(state)
>>> dcp.load(state, storage_reader=reader, planner=WeightsOnlyPlanner(reader.path), no_dist=True)  # what load does
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import re
import struct
import sys
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType

from .load_in_place import read_exactly
from .safe_load import read_dcp_metadata

_STORAGE_DTYPES = {"DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
                   "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
                   "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
                   "BoolStorage": torch.bool}  # the names a pickled tensor's storage has, by dtype
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # a zip entry's local header: its name and extra lengths are the last two
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # a central directory entry: method [4], sizes [8:10], name, extra and
# comment lengths [10:13], local header offset [16]
_END = struct.Struct("<4s4H2LH")  # the end of the central directory: entries [4], its size [5] and offset [6]
_GROUPS = "optimizer.param_groups."  # the checkpoint's keys of an optimizer's hyper-parameters
_NESTED_PARAMS = re.compile(r"optimizer\.param_groups\.\d+\.params")  # a nested layout's group: its parameters
_MISSING = object()
_HEAD, _TAIL = 4096, 4096  # bytes read at each end of a saved tensor's record: its pickle and its zip directory


def is_sharded(directory: Path, folder: str) -> bool:
    """Whether `directory` holds a checkpoint sharded by torch's distributed checkpoint in `directory/folder`: the
    folder is there and, where the checkpoint lists its files (a Learner checkpoint's `state.json`), its `.metadata`
    is listed: a folder dropped into a checkpoint written in another format is not read.

    >>> is_sharded(Path("ckpt/step-00000200"), "sharded")
    """
    if not (directory / folder).is_dir():
        return False
    try:
        listed = json.loads((directory / "state.json").read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return True  # no list of files here (an Accelerator checkpoint's model folder)
    return not isinstance(listed, list) or f"{folder}/.metadata" in listed


class DirectReader(FileSystemReader):
    """torch's `FileSystemReader`, but a tensor saved whole is read into its target's memory in one copy.

    >>> reader = DirectReader(directory / "sharded"); reader.check(); reader.load(state)
    """

    _metadata: Any = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """torch's `FileSystemReader.read_metadata`, the pickle read as data (`read_dcp_metadata`), once: `check` and
        torch's load both ask."""
        if self._metadata is None:
            metadata = read_dcp_metadata(Path(self.path) / ".metadata")
            metadata.storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self._metadata = metadata
        return self._metadata

    def check(self) -> None:
        """ValueError naming the file, before anything is read, when a file ends before the bytes .metadata places in
        it (a copy cut short, a disk that filled), or .metadata places them outside this folder."""
        ends: dict[str, int] = {}
        for info in self.read_metadata().storage_data.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
        for name, end in sorted(ends.items()):
            file = Path(self.path) / name
            if Path(name).name != name or name in ("", ".."):
                raise ValueError(f"{Path(self.path) / '.metadata'} places data in {name!r}, not a file of its folder: "
                                 f"the checkpoint is damaged or was changed, resume from another checkpoint")
            size = file.stat().st_size if file.is_file() else None
            if size is None or size < end:
                raise ValueError(f"{file} is {'missing' if size is None else f'truncated ({size} bytes)'}: its .metadata "
                                 f"places {end} bytes there; the checkpoint is damaged, resume from another checkpoint")

    def optimizer_layout(self) -> str | None:
        """How the checkpoint lays its optimizer's hyper-parameters out: "nested" (torch's optimizer state dict, per
        parameter group: FSDP's), "flat" (per parameter, `flatten_optimizer_state_dict`: model_parallel's), or None
        (no optimizer). Only the nested layout has a group's `params` list (a flat key never ends in `.params`)."""
        keys = [k for k in self.read_metadata().state_dict_metadata if k.startswith(_GROUPS)]
        if not keys:
            return None
        return "nested" if any(_NESTED_PARAMS.fullmatch(k) for k in keys) else "flat"

    def load(self, state: dict) -> None:
        """`dcp.load(state)` from this folder, on this process alone (`no_dist`), its non-tensor items read
        weights-only (`WeightsOnlyPlanner`); a ValueError of a rank (a refused item, a truncated file) raised as it
        is, not inside torch's CheckpointException (a BaseException). `state["optimizer"]` (a sharded optimizer
        state, nested or flat) is filled from the checkpoint's optimizer state in either layout."""
        ours, saved = _layout(state.get("optimizer")), self.optimizer_layout()
        if ours is None or saved is None or ours == saved:
            self._load(state)
            return
        optimizer, hyper = state["optimizer"], self._saved_hyper_parameters()   # checked before any tensor loads
        if ours == "nested":
            _nested_from_flat(optimizer["param_groups"], hyper, self.path)
        else:
            _flat_from_nested(optimizer, hyper, self.path)
        per_parameter = ({"state": optimizer["state"]} if ours == "nested" else
                         {k: v for k, v in optimizer.items() if k.startswith("state.")})
        self._load({"model": state["model"], "optimizer": per_parameter})
        optimizer.update(per_parameter)

    def _saved_hyper_parameters(self) -> dict[str, Any]:
        """The checkpoint's `optimizer.param_groups.*` items, keyed without that prefix (a tensor one, e.g. a tensor lr,
        read into a tensor of its size and dtype)."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        items = {k: torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
                 for k, md in self.read_metadata().state_dict_metadata.items() if k.startswith(_GROUPS)}
        self._load(items)
        return {k.removeprefix(_GROUPS): v for k, v in items.items()}

    def _load(self, state: dict) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            dcp.load(state, storage_reader=self, planner=WeightsOnlyPlanner(self.path), no_dist=True)
        except CheckpointException as e:
            for failure, _ in e.failures.values():
                if isinstance(failure, ValueError):
                    raise failure from None
            raise

    def read_data(self, plan: Any, planner: Any) -> Any:
        rest = []
        files: dict[str, BinaryIO] = {}
        try:
            for req in plan.items:
                info = self.storage_data[req.storage_index]
                target = _direct_target(req, info, planner)
                if target is not None:
                    name = info.relative_path
                    if name not in files:
                        files[name] = open(Path(self.path) / name, "rb")
                    if _read_into(files[name], info.offset, info.length, target):
                        planner.commit_tensor(req, target)
                        continue
                rest.append(req)
        finally:
            for f in files.values():
                f.close()
        return super().read_data(dataclasses.replace(plan, items=rest), planner)


def _layout(optimizer: Any) -> str | None:
    """"nested" for torch's optimizer state dict, "flat" for its flattened form, None for no optimizer state."""
    if not optimizer:
        return None
    return "nested" if "param_groups" in optimizer else "flat"


def _flat_from_nested(optimizer: dict, groups: dict[str, Any], folder: str | Path) -> None:
    """Set each `param_groups.<parameter>.<key>` of the flat `optimizer` to the value of the saved parameter group
    listing that parameter (`groups`: the nested checkpoint's `<group>.<key>` items)."""
    saved: dict[str, dict[str, Any]] = {}
    for key, value in groups.items():
        index, _, name = key.partition(".")
        saved.setdefault(index, {})[name] = value
    group_of = {p: g for g in saved.values() for p in g.get("params", ())}
    wanted = {k: k.removeprefix("param_groups.").rpartition(".")[::2]   # (parameter, hyper-parameter)
              for k in optimizer if k.startswith("param_groups.")}
    missing = sorted({p for p, name in wanted.values() if name not in group_of.get(p, {})})
    if missing:
        raise ValueError(f"{folder}: the checkpoint's optimizer has no parameter group holding {missing} (it holds "
                         f"{sorted(group_of)}): it was written for another model or optimizer; build the same ones as "
                         f"the run that wrote it")
    optimizer.update({k: group_of[p][name] for k, (p, name) in wanted.items()})


def _nested_from_flat(param_groups: list[dict], flat: dict[str, Any], folder: str | Path) -> None:
    """Set each hyper-parameter of the nested `param_groups` to the saved value of its parameters (`flat`: the flat
    checkpoint's `<parameter>.<key>` items), which must agree within a group (an empty group keeps its own)."""
    for index, group in enumerate(param_groups):
        for name in [k for k in group if k != "params"] if group["params"] else []:
            values = {p: flat.get(f"{p}.{name}", _MISSING) for p in group["params"]}
            missing = [p for p, v in values.items() if v is _MISSING]
            if missing:
                raise ValueError(f"{folder}: the checkpoint's optimizer has no {name!r} for {missing}: it was written "
                                 f"for another model or optimizer; build the same ones as the run that wrote it")
            (first, value), *rest = values.items()
            other = next(((p, v) for p, v in rest if not _same(v, value)), None)
            if other is not None:
                raise ValueError(f"{folder}: the checkpoint gives the parameters of this optimizer's group {index} "
                                 f"different {name!r} ({first}: {value}, {other[0]}: {other[1]}): build the optimizer "
                                 f"with the parameter groups of the run that wrote it")
            group[name] = value


def _same(a: Any, b: Any) -> bool:
    """Whether two hyper-parameters are equal (a tensor one, e.g. a tensor lr, bitwise)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


class WeightsOnlyPlanner(DefaultLoadPlanner):
    """torch's `DefaultLoadPlanner`, each non-tensor item (a `torch.save` of its own) loaded with `weights_only=True`:
    numbers, strings, plain containers; anything else refused, a ValueError naming the file (in `folder`) and item.

    >>> dcp.load(state, storage_reader=reader, planner=WeightsOnlyPlanner(reader.path), no_dist=True)
    """

    def __init__(self, folder: str | Path, **options: Any):
        super().__init__(**options)
        self.folder = Path(folder)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            file = self.folder / self.metadata.storage_data[read_item.storage_index].relative_path
            raise ValueError(f"{file} (item {read_item.dest_index.fqn}) holds objects other than numbers, strings and "
                             f"plain containers: unpickling them could run code from the checkpoint, so cadence "
                             f"refuses them; resume from another checkpoint") from None
        if self.flatten_state_dict:  # where torch's `load_bytes` puts the item
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _direct_target(req: Any, info: Any, planner: Any) -> torch.Tensor | None:
    """The tensor `req` fills, when it can be read into directly: a whole saved tensor, no transform, a contiguous
    CPU target."""
    if req.type != LoadItemType.TENSOR or info.transform_descriptors or any(req.storage_offsets):
        return None
    target = planner.resolve_tensor(req).detach()
    if target.device.type != "cpu" or not target.is_contiguous() or tuple(target.shape) != tuple(req.lengths):
        return None
    return target


class _Tensor:
    """What the pickle of a saved tensor says: storage (dtype, key, element count), offset, size, stride."""

    def __init__(self, storage: tuple, offset: int, size: tuple, stride: tuple, *_: Any):
        self.storage, self.offset, self.size, self.stride = storage, offset, tuple(size), tuple(stride)


class _TensorPickle(pickle.Unpickler):
    """Reads the pickle of one `torch.save`d tensor without building anything: only torch's tensor rebuild, its
    storage types and an empty OrderedDict are known names, each standing for a record of its arguments; any other
    name refuses (the tensor then goes to torch's own reader)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _Tensor
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> tuple:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], torch.dtype)):
            raise pickle.UnpicklingError("not a storage")
        return pid[1], str(pid[2]), pid[4]  # dtype, record key, element count


def _read_into(f: BinaryIO, offset: int, length: int, target: torch.Tensor) -> bool:
    """Read the tensor `torch.save`d at [offset, offset + length) of `f` into `target`; False (nothing written) when
    it is not exactly `target`'s dtype, shape and contiguous layout, stored uncompressed in this machine's byte order.
    The record's zip directory and its first bytes (the pickle, the byte order) are read once each."""
    try:
        entries = _zip_entries(_read_at(f, offset + max(0, length - _TAIL), min(length, _TAIL)), length)
        if entries is None:
            return False
        head = _read_at(f, offset, min(length, _HEAD))
        root = next(iter(entries)).split("/", 1)[0]
        saved = _TensorPickle(io.BytesIO(_member(f, offset, head, entries[f"{root}/data.pkl"]))).load()
        order = entries.get(f"{root}/byteorder")
        byteorder = _member(f, offset, head, order).decode() if order is not None else "little"
        if not isinstance(saved, _Tensor):
            return False
        dtype, key, numel = saved.storage
        record = entries[f"{root}/data/{key}"]
        start = _data_start(f, offset, head, record)
    except (pickle.UnpicklingError, KeyError, ValueError, TypeError, EOFError, struct.error, StopIteration):
        return False  # UnicodeDecodeError is a ValueError
    size = target.numel() * target.element_size()
    if (dtype != target.dtype or saved.size != tuple(target.shape) or saved.offset != 0 or numel != target.numel()
            or saved.stride != target.stride() or byteorder != sys.byteorder or record[1] != size
            or start is None or start + size > length):
        return False
    if size and not read_exactly(f, offset + start, target):
        raise ValueError(f"{f.name} is truncated: a tensor's bytes at {offset + start} end early; resume from another "
                         f"checkpoint")
    return True


def _read_at(f: BinaryIO, position: int, size: int) -> bytes:
    f.seek(position)
    return f.read(size)


def _zip_entries(tail: bytes, length: int) -> dict[str, tuple[int, int, bytes]] | None:
    """{name: (local header offset, size, name)} of the stored (uncompressed) entries of the zip record of `length` bytes
    whose last bytes are `tail`, from its central directory; None when that is not all in `tail`, an entry is
    compressed, or the record is zip64 (a tensor of 4 GiB or more; torch's reader takes those)."""
    end = tail.rfind(b"PK\x05\x06")
    if end < 0 or end + _END.size > len(tail):
        return None
    count, directory_size, directory_offset = (_END.unpack_from(tail, end)[i] for i in (4, 5, 6))
    at = len(tail) - (length - directory_offset)
    if count == 0xFFFF or directory_offset == 0xFFFFFFFF or at < 0 or at + directory_size > end:
        return None
    entries = {}
    for _ in range(count):
        fields = _CENTRAL.unpack_from(tail, at)
        if fields[0] != b"PK\x01\x02" or fields[4] != zipfile.ZIP_STORED or 0xFFFFFFFF in (*fields[8:10], fields[16]):
            return None
        name_size, extra_size, comment_size = fields[10:13]
        name = tail[at + _CENTRAL.size: at + _CENTRAL.size + name_size]
        entries[name.decode()] = (fields[16], fields[9], name)
        at += _CENTRAL.size + name_size + extra_size + comment_size
    return entries


def _data_start(f: BinaryIO, offset: int, head: bytes, entry: tuple[int, int, bytes]) -> int | None:
    """Where the data of `entry` (from `_zip_entries`) starts, within the record; None unless its local header is
    there, naming it as the central directory does (a damaged length there would shift the bytes read)."""
    header_offset, _, name = entry
    local = head[header_offset: header_offset + _LOCAL_HEADER.size + len(name)]
    if len(local) < _LOCAL_HEADER.size + len(name):
        local = _read_at(f, offset + header_offset, _LOCAL_HEADER.size + len(name))
    header = _LOCAL_HEADER.unpack(local[:_LOCAL_HEADER.size])
    if header[0] != b"PK\x03\x04" or header[-2] != len(name) or local[_LOCAL_HEADER.size:] != name:
        return None
    return header_offset + _LOCAL_HEADER.size + header[-2] + header[-1]


def _member(f: BinaryIO, offset: int, head: bytes, entry: tuple[int, int, bytes]) -> bytes:
    """The bytes of a small entry (the pickle, the byte order), from `head` when they lie there."""
    start = _data_start(f, offset, head, entry)
    if start is None:
        raise ValueError("not a zip entry")
    data = head[start: start + entry[1]]
    return data if len(data) == entry[1] else _read_at(f, offset + start, entry[1])
