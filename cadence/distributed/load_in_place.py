"""A saved optimizer state read straight into the memory that holds its live counterpart.

A plain resume reads each file into fresh memory, which the engine then copies into the optimizer's tensors (fp32
masters) or keeps in their place (optimizer state): every byte copied twice, or the fresh memory's pages faulted in
and zeroed first (on a CPU host, worth more than the copy itself). Here the file is mapped (`torch.load(mmap=True)`:
its structure, no tensor read), each saved tensor with a live counterpart of its shape, dtype and memory (host or
CUDA) is read from the file into that counterpart (host; CUDA: copied from the file's pages) and stands in its place
in the loaded state; everything else is copied out of the mapping
(views of one storage stay views of one copy), so nothing loaded keeps the file mapped. The engine's own load then
copies the live tensors onto themselves (skipped by torch's `copy_`) or keeps them as the state (torch's
`Optimizer.load_state_dict` keeps a loaded tensor of the parameter's dtype and device as it is).

>>> state = load_mapped(path)                                      # None: a file in torch's legacy format
>>> load_optimizer_in_place(opt, state, path)                   # or, for another layout:
>>> targets = in_place_targets(state, opt.state, [g["params"] for g in opt.param_groups])
>>> state = copied_out(state, keep=[container[key] for container, key, _ in targets]); read_into(targets, path)
"""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO

import torch

from .staging import view_like


def load_mapped(path: str, map_location: Any = "cpu") -> Any | None:
    """`torch.load(weights_only=True)` of `path` with its storages mapped from the file, not read; None for a file
    in torch's legacy format, which cannot be mapped."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=True)
    except RuntimeError:
        return None


def fits(saved: Any, live: Any) -> bool:
    """Whether `saved` (a mapped host tensor) can be copied into `live` and stand in for it unchanged: a tensor of
    the same class, shape and dtype, `live` in host or CUDA memory."""
    return (type(saved) is torch.Tensor and type(live) in (torch.Tensor, torch.nn.Parameter)
            and saved.device.type == "cpu" and live.device.type in ("cpu", "cuda")
            and saved.dtype == live.dtype and saved.shape == live.shape)


Target = tuple[Any, Any, torch.Tensor]  # a loaded container, the key of a mapped tensor in it, the live tensor it fills


def in_place_targets(saved: dict, live: Mapping[torch.Tensor, dict], groups: Sequence[Sequence[torch.Tensor]]
                     ) -> list[Target]:
    """Where each tensor of `saved` (an optimizer's `state_dict()`, parameters by position, mapped) can be read into
    place: the live state tensor of the same parameter and name (`live`: the optimizer's `state`) that torch's
    `load_state_dict` would replace with the loaded one unchanged. `groups`: the optimizer's parameters group by group,
    in the order `load_state_dict` pairs them with the saved positions. Writes nothing (`read_into` does). None at
    all unless the saved groups have the same numbers of parameters (what `load_state_dict` checks); a live tensor
    shared by several parameters' states (one `step` for all), or one that `load_state_dict` would convert (another
    dtype or device than the parameter's; a `step` as the saved group's `fused`/`capturable` says), is left out."""
    saved_groups, state = saved.get("param_groups"), saved.get("state")
    if (not isinstance(saved_groups, list) or not isinstance(state, dict)
            or [len(g.get("params", ())) for g in saved_groups] != [len(g) for g in groups]):
        return []
    params = [p for g in groups for p in g]
    counts: dict[int, int] = {}
    for param in params:
        for t in live.get(param, {}).values():
            counts[id(t)] = counts.get(id(t), 0) + 1
    targets = []
    positions = ((i, g) for g in saved_groups for i in g["params"])
    for (position, group), param in zip(positions, params):
        saved_state, live_state = state.get(position), live.get(param, {})
        if not isinstance(saved_state, dict):
            continue
        on_device = group.get("fused") or group.get("capturable")  # torch moves `step` to the parameter's device
        for name, t in saved_state.items():
            target = live_state.get(name)
            if not (fits(t, target) and counts[id(target)] == 1):
                continue
            if name == "step":  # loaded as it is, or as float32 on the parameter's device
                kept = target.dtype == torch.float32 and target.device == param.device if on_device else (
                    target.device.type == "cpu")
            else:
                kept = target.device == param.device and (not param.is_floating_point() or target.dtype == param.dtype)
            if kept:
                targets.append((saved_state, name, target))
    return targets


def read_into(targets: Sequence[Target], path: str) -> None:
    """Fill each target's live tensor with its mapped tensor's bytes and put the live one in its place. `path` is the
    file they are mapped from: a live tensor in host memory is read from the file into (a read from the page cache,
    about the cost of a plain `torch.load`; copying out of the mapping faults its pages in one by one, 3x that
    here); one in GPU memory, or where the file's layout cannot be told for sure, is copied from the mapping."""
    offsets = file_offsets(path, [container[key] for container, key, _ in targets])
    reads = {id(target): offsets[id(container[key])] for container, key, target in targets
             if id(container[key]) in offsets and target.device.type == "cpu" and target.is_contiguous()}
    with open(path, "rb", buffering=0) as f:
        for container, key, target in targets:
            live = target.detach()
            if id(target) not in reads:
                live.copy_(container[key])
            elif _nbytes(live) and not read_exactly(f, reads[id(target)], live):
                raise ValueError(f"{path} ended inside a tensor's bytes (at {reads[id(target)]}) while it was "
                                 f"read: the file is truncated; resume from another checkpoint")
            container[key] = target


def read_exactly(f: BinaryIO, offset: int, target: torch.Tensor) -> bool:
    """Read `target`'s bytes (a contiguous host tensor) from `f` at `offset`, in as many reads as it takes (one
    read returns at most 2 GiB on Linux); False when the file ends first.

    >>> with open(path, "rb", buffering=0) as f: read_exactly(f, 4096, torch.empty(1024))
    """
    view, done, size = memoryview(target.view(-1).view(torch.uint8).numpy()), 0, _nbytes(target)
    f.seek(offset)
    while done < size:
        n = f.readinto(view[done:])
        if not n:
            return False
        done += n
    return True


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def file_offsets(path: str, mapped: Sequence[torch.Tensor]) -> dict[int, int]:
    """Where the bytes of each contiguous tensor of `mapped` (loaded from the torch file `path` by `load_mapped`)
    start in the file, by `id`; {} unless exactly one placement of the mapping fits: each storage at the file offset
    of a record of its size, all shifted by one base address (the mapping's)."""
    mapped = [t for t in mapped if t.is_contiguous()]
    if not mapped:
        return {}
    records = data_records(path)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in mapped}
    first, size = next(iter(storages.items()))
    bases = [first - offset for offset, n in records.items() if n == size
             and all(records.get(ptr - (first - offset)) == nbytes for ptr, nbytes in storages.items())]
    if len(bases) != 1:
        return {}
    return {id(t): t.untyped_storage().data_ptr() - bases[0] + t.storage_offset() * t.element_size() for t in mapped}


def data_records(path: str) -> dict[int, int]:
    """The tensor data records of the torch file `path` (a zip archive, its members stored uncompressed): the file
    offset of each record's bytes -> its size. Read with Python's `zipfile`, not torch's file reader, whose record
    sizes and offsets are not there on every torch this supports (`get_record_size`: torch 2.10 on); {} for a file
    that is not such an archive, or a record compressed or not where its header says (its layout cannot be told)."""
    records = {}
    try:
        with open(path, "rb") as f, zipfile.ZipFile(f) as archive:
            for info in archive.infolist():
                if not info.filename.partition("/")[2].startswith("data/"):  # "<archive name>/data/<key>"
                    continue
                f.seek(info.header_offset)
                header = f.read(_LOCAL_HEADER.size)
                if info.compress_type != zipfile.ZIP_STORED or len(header) < _LOCAL_HEADER.size:
                    return {}
                signature, *_, name_length, extra_length = _LOCAL_HEADER.unpack(header)
                if signature != zipfile.stringFileHeader:
                    return {}
                records[info.header_offset + _LOCAL_HEADER.size + name_length + extra_length] = info.file_size
    except (OSError, zipfile.BadZipFile):
        return {}
    return records


_LOCAL_HEADER = struct.Struct(zipfile.structFileHeader)  # a zip member's local header (its name and extra follow)


def load_optimizer_in_place(opt: torch.optim.Optimizer, state: dict, path: str) -> None:
    """`opt.load_state_dict(state)` for a `state` read from `path` with `load_mapped`: each state tensor read from the
    file into the one `opt` holds for it (a trained optimizer: no second copy of its state alive during the load),
    the rest copied out of the mapping first, so nothing is written into `opt` before everything but those reads
    succeeded (a file cut while they run is named, and `opt` is then partly loaded: load again).

    >>> load_optimizer_in_place(opt, load_mapped(file), file)
    """
    targets = in_place_targets(state, opt.state, [g["params"] for g in opt.param_groups])
    state = copied_out(state, keep=[container[key] for container, key, _ in targets])
    read_into(targets, path)
    opt.load_state_dict(state)


def copied_out(state: Any, keep: Sequence[torch.Tensor]) -> Any:
    """`state` (just loaded: its dicts and lists are changed in place) with every tensor but those in `keep` copied
    out of its (mapped) storage into memory of its own, tensors viewing one storage still viewing one copy (a tensor
    subclass, or one not strided, cloned as it is)."""
    kept = {id(t) for t in keep}
    copies: dict[int, torch.UntypedStorage] = {}

    def out(data: Any) -> Any:
        if isinstance(data, torch.Tensor):
            if id(data) in kept:
                return data
            if type(data) not in (torch.Tensor, torch.nn.Parameter) or data.layout != torch.strided:
                return data.clone()
            storage = data.untyped_storage()
            if storage._cdata not in copies:
                copies[storage._cdata] = storage.clone()
            return view_like(data, copies[storage._cdata])
        if isinstance(data, (dict, list)):
            for key in (data.keys() if isinstance(data, dict) else range(len(data))):
                data[key] = out(data[key])
        elif isinstance(data, tuple):
            items = [out(o) for o in data]
            return type(data)(*items) if hasattr(data, "_fields") else type(data)(items)
        return data
    return out(state)
