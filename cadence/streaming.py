"""Writing tensors from a device's memory to a file at the disk's speed: the copy of the next piece to host memory
runs while the last piece is written.

A plain save of GPU state copies each tensor to fresh host memory and then writes it, one after the other, so the
save takes the copy's time plus the disk's (torch.save copies each storage that way). Here device memory goes
through two page-locked buffers of `CHUNK_BYTES` in turn (`host_pieces`): the GPU copies the next piece into one
while the disk takes the other, and no more than the two buffers is held in host memory, whatever the state's size.
A CPU tensor is written from its own memory, its checksum summed in a thread meanwhile.

`save_torch_streaming` writes torch's own file format that way: `torch.save` lays the file out with its storages'
bytes left out (`torch.serialization.skip_data`), then each storage's bytes are written into their place and the
checksums the zip format and torch's serialization id hold are filled in: the file is the one `torch.save` writes,
byte for byte.

>>> with open("optimizer.pt", "wb") as f: save_torch_streaming(optimizer.state_dict(), f)  # on a GPU
>>> for piece in host_pieces(model.state_dict().values()): f.write(piece)
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import pickle
import struct
import threading
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO

import torch

CHUNK_BYTES = 64 << 20  # a piece of device memory copied to host memory at a time (two such buffers)


def host_pieces(tensors: Iterable[torch.Tensor], chunk_bytes: int = CHUNK_BYTES,
                staged: Callable[[torch.Tensor], bool] = lambda t: t.is_cuda) -> Iterator[memoryview]:
    """The bytes of `tensors`, in order, as host memory to write before asking for the next piece: a CPU tensor's own
    memory (a non-contiguous one copied first); a CUDA tensor's in pieces of at most `chunk_bytes`, copied into two
    page-locked buffers in turn, the next piece's copy running while the caller writes the last (`staged`: which
    tensors go through the buffers; the tests send CPU tensors there too); a non-contiguous CUDA tensor, or another
    device's, copied whole to host memory.

    >>> for piece in host_pieces(state.values()): f.write(piece)
    """
    buffers: list[torch.Tensor] = []
    in_flight: collections.deque = collections.deque()  # (host view, event or None, its buffer), oldest first
    for t in tensors:
        if not t.numel():
            continue
        if not staged(t) or t.device.type not in ("cuda", "cpu") or (t.is_cuda and not t.is_contiguous()):
            # another device's memory, or a strided view on the GPU (made contiguous there, it would take GPU memory)
            while in_flight:
                yield _arrived(in_flight, buffers)
            yield _host_bytes(t.detach().cpu())
            continue
        data = t.detach().contiguous().reshape(-1).view(torch.uint8)
        for start in range(0, data.numel(), chunk_bytes):
            piece = data[start:start + chunk_bytes]
            if len(in_flight) == 2:  # both buffers taken: the caller writes the older while the newer copies
                yield _arrived(in_flight, buffers)
            buffer = buffers.pop() if buffers else torch.empty(chunk_bytes, dtype=torch.uint8,
                                                               pin_memory=piece.is_cuda)
            view = buffer[:piece.numel()]
            # queued on the device's current stream, after the work queued there; the event says when it has landed
            view.copy_(piece, non_blocking=piece.is_cuda)
            event = None
            if piece.is_cuda:
                event = torch.cuda.Event(blocking=True)  # its wait sleeps rather than spinning a core
                event.record(torch.cuda.current_stream(piece.device))
            in_flight.append((view, event, buffer))
    while in_flight:
        yield _arrived(in_flight, buffers)


def _host_bytes(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes (a non-contiguous one copied first)."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _arrived(in_flight: collections.deque, buffers: list[torch.Tensor]) -> memoryview:
    """The oldest copy in flight, once it has arrived; its buffer is free again when the caller asks for more."""
    view, event, buffer = in_flight.popleft()
    if event is not None:
        event.synchronize()
    buffers.append(buffer)  # reused only after the caller has written `view` (the generator resumes after that)
    return _host_bytes(view)


# ---------------------------------------------------------------------------- torch's format
class _Unstreamable(Exception):
    """The file is not laid out as expected: written with plain `torch.save` instead."""


_SEEN = threading.local()  # what `torch.save` meets in this thread while `save_torch_streaming` lays a file out


def register_tagger(priority: int, tagger: Callable[[torch.UntypedStorage], str | None]) -> None:
    """Register `tagger` with torch's serialization registry, asked for every storage `torch.save` writes (a tag
    such as "cpu", or None: the next tagger's), at `priority` (torch's own: cpu 10, cuda 20, ...; an odd one, since
    two equal priorities would be compared as tuples). A reload of its module (autoreload) replaces the tagger an
    earlier load registered, instead of adding a second one. Loads are torch's own (its tags' deserializers).

    >>> register_tagger(-275, lambda storage: "cpu")   # every storage recorded as host memory
    """
    torch.serialization._package_registry[:] = [
        entry for entry in torch.serialization._package_registry
        if (getattr(entry[1], "__qualname__", ""), getattr(entry[1], "__module__", ""))
        != (tagger.__qualname__, tagger.__module__)]
    torch.serialization.register_package(priority, tagger, _restored_by_torch)


def _restored_by_torch(storage, location: str) -> None:
    return None  # tags are torch's own ("cpu", "cuda:0"): its own deserializers restore them


def _record_storage(storage: torch.UntypedStorage) -> None:
    """Asked first for every storage `torch.save` serializes: while `save_torch_streaming` lays a file out in this
    thread, keeps each new one, in the order torch names their records, and counts every call (one per reference
    the file's pickle holds, unless a save runs inside it). Tags none (None: the next tagger's)."""
    seen = getattr(_SEEN, "storages", None)
    if seen is not None:
        seen.setdefault(storage._cdata, storage)
        _SEEN.calls += 1


register_tagger(-273, _record_storage)  # before every other tagger, cadence's host tagger (-271) included


@contextlib.contextmanager
def _recording() -> Iterator[dict[int, torch.UntypedStorage]]:
    before = getattr(_SEEN, "storages", None), getattr(_SEEN, "calls", 0)
    _SEEN.storages, _SEEN.calls = {}, 0
    try:
        yield _SEEN.storages
    finally:
        _SEEN.storages, _SEEN.calls = before


def tensors_in(obj) -> Iterator[torch.Tensor]:
    """Every tensor in nested dicts, lists and tuples, in order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors_in(value)


STREAM_CPU_BYTES = 16 << 20  # from this many bytes of CPU tensors, streaming beats torch.save (measured crossover)


def worth_streaming(obj) -> bool:
    """Whether `save_torch` streams nested dicts, lists and tuples `obj`: it holds a tensor in CUDA memory (copied to
    host memory while the disk writes), or `STREAM_CPU_BYTES` or more of CPU tensors, whose checksums are then
    summed in a thread while each is written (torch.save sums, then writes: 168 MiB of AdamW moments took 0.117 s
    with torch.save, 0.090 s streamed, fsync included)."""
    cpu_bytes = 0
    for t in tensors_in(obj):
        if t.is_cuda:
            return True
        cpu_bytes += t.nbytes if t.device.type == "cpu" else 0
    return cpu_bytes >= STREAM_CPU_BYTES


def save_torch_streaming(obj, f: BinaryIO) -> None:
    """`torch.save(obj, f)`, the same bytes, with each storage's bytes written through `host_pieces`: CUDA memory at
    about the disk's speed and in host memory of two pieces. `f`: a file opened for writing at its start (its path
    is reopened to read the layout back). Plain `torch.save` instead without torch's `skip_data` (torch < 2.5), with
    its CRC-32s turned off, for a tensor `skip_data` refuses (quantized, nested, XLA's) or a layout other than
    expected (an object whose pickling runs a `torch.save` of its own).

    >>> with open(path, "wb") as f: save_torch_streaming(optimizer.state_dict(), f)
    """
    skip_data = getattr(torch.serialization, "skip_data", None)
    if skip_data is None or not torch.serialization.get_crc32_options():
        return torch.save(obj, f)
    try:
        with _recording() as seen, skip_data():
            try:
                torch.save(obj, f)  # the layout: headers, pickle, directory; each storage's bytes left as a hole
            except RuntimeError as e:
                if "skip_data" not in str(e):  # a failed write, or what torch.save refuses too: as torch.save says
                    raise
                raise _Unstreamable from e
            calls = _SEEN.calls
        f.flush()
        _fill(f, list(seen.values()), calls)
    except _Unstreamable:
        f.seek(0)
        f.truncate()
        torch.save(obj, f)


def _fill(f: BinaryIO, storages: list[torch.UntypedStorage], calls: int) -> None:
    """Write each storage's bytes into its record of the file `torch.save` laid out with `skip_data`, then the
    checksums: each record's CRC-32 (its data descriptor and its central directory entry) and torch's serialization
    id, whose second half combines every record's CRC-32 in the order written. `calls`: the tagger's calls while
    laying out, which must be the pickle's references to storages (else a save ran inside it: `_Unstreamable`)."""
    with open(f.name, "rb") as reader:
        with zipfile.ZipFile(reader) as archive:
            entries = archive.infolist()
            central = _central_offsets(reader, archive.start_dir, len(entries))
            places = {e.filename: (_data_offset(reader, e), e, at) for e, at in zip(entries, central)}
        prefix = entries[0].filename.split("/")[0]
        records = [places.get(f"{prefix}/data/{key}") for key in range(len(storages))]
        if (len(places) != len(entries) or any(r is None for r in records)
                or sum(e.filename.startswith(f"{prefix}/data/") for e in entries) != len(storages)
                or any(r[1].file_size != s.nbytes() for r, s in zip(records, storages))):
            raise _Unstreamable
        files = (reader.fileno(), f.fileno())
        pickle_at, pickle_entry, _ = places[f"{prefix}/data.pkl"]
        if _storage_references(os.pread(files[0], pickle_entry.file_size, pickle_at)) != calls:
            raise _Unstreamable
        crcs = {e.filename: e.CRC for e in entries}
        pieces = host_pieces(torch.empty(0, dtype=torch.uint8, device=s.device).set_(s) for s in storages)
        with ThreadPoolExecutor(1, thread_name_prefix="checkpoint crc32") as checksums:
            for (offset, entry, _), storage in zip(records, storages):
                crc, position, end = 0, offset, offset + storage.nbytes()
                while position < end:
                    piece = next(pieces)
                    if piece.nbytes < _SUM_APART_BYTES:
                        crc = zlib.crc32(piece, crc)
                        _write_at(f.fileno(), piece, position)
                    else:  # summed in a thread while the piece is written (both free the GIL)
                        summed = checksums.submit(zlib.crc32, piece, crc)
                        _write_at(f.fileno(), piece, position)
                        crc = summed.result()
                    position += piece.nbytes
                crcs[entry.filename] = crc
        for name, (offset, entry, at) in places.items():
            if entry.file_size and not name.endswith(_SERIALIZATION_ID):  # an empty record has no descriptor, CRC 0
                _set_crc(files, offset + entry.file_size, at, crcs[name])
        _set_serialization_id(files, entries, places, crcs)


_SERIALIZATION_ID = ".data/serialization_id"
_SUM_APART_BYTES = 1 << 20  # a piece this large has its checksum computed in a thread while it is written


class _Inert:
    """Whatever a pickle would build, built as nothing: counting its storage references runs none of its code."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Inert()

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        pass

    def append(self, value):
        pass

    def extend(self, values):
        pass


class _ReferenceCounter(pickle.Unpickler):
    references = 0

    def find_class(self, module: str, name: str) -> type:
        return _Inert

    def persistent_load(self, pid) -> _Inert:
        self.references += 1
        return _Inert()


def _storage_references(data: bytes) -> int:
    """How many storage references (persistent ids) torch's pickle `data` holds, read without building anything."""
    counter = _ReferenceCounter(io.BytesIO(data))
    try:
        counter.load()
    except Exception as e:  # a pickle it cannot walk with stand-ins
        raise _Unstreamable from e
    return counter.references


def _set_crc(files: tuple[int, int], descriptor: int, central_entry: int, crc: int) -> None:
    """Write `crc` into a record's data descriptor (at `descriptor`, after its bytes) and its central directory
    entry (`files`: the file's descriptors to read and to write); the local header's stays 0, as torch leaves it."""
    read, write = files
    if os.pread(read, 4, descriptor) != b"PK\x07\x08" or os.pread(read, 4, central_entry) != b"PK\x01\x02":
        raise _Unstreamable
    packed = struct.pack("<L", crc)
    _write_at(write, packed, descriptor + 4)
    _write_at(write, packed, central_entry + 16)


def _set_serialization_id(files: tuple[int, int], entries: list[zipfile.ZipInfo], places: dict, crcs: dict[str, int]) -> None:
    """torch's `.data/serialization_id`: 20 digits hashing the records' names (left as written) and 20 combining
    the CRC-32s of the records with a data descriptor (all but empty ones), in the order written, as c10's
    `hash_combine` does when torch's writer writes each descriptor."""
    name = next((e.filename for e in entries if e.filename.endswith(_SERIALIZATION_ID)), None)
    if name is None:
        return
    offset, entry, at = places[name]
    combined, mask = 0, (1 << 64) - 1
    for e in entries:
        if e.filename != name and e.file_size:
            combined ^= (crcs[e.filename] + 0x9E3779B9 + ((combined << 6) & mask) + (combined >> 2)) & mask
    text = os.pread(files[0], entry.file_size, offset)
    if len(text) != 40:
        raise _Unstreamable
    text = text[:20] + f"{combined:020d}".encode()
    _write_at(files[1], text, offset)
    _set_crc(files, offset + entry.file_size, at, zlib.crc32(text))


def _data_offset(reader: BinaryIO, entry: zipfile.ZipInfo) -> int:
    """Where a record's bytes start: after its local header, its name and its extra field (torch's alignment)."""
    reader.seek(entry.header_offset)
    header = reader.read(30)
    if header[:4] != b"PK\x03\x04" or entry.compress_type != zipfile.ZIP_STORED:
        raise _Unstreamable
    name_length, extra_length = struct.unpack("<2H", header[26:30])
    return entry.header_offset + 30 + name_length + extra_length


def _central_offsets(reader: BinaryIO, start: int, count: int) -> list[int]:
    """The offset of each central directory entry, in the directory's order (zipfile's `infolist` order)."""
    offsets, position = [], start
    for _ in range(count):
        reader.seek(position)
        entry = reader.read(46)
        if entry[:4] != b"PK\x01\x02":
            raise _Unstreamable
        offsets.append(position)
        position += 46 + sum(struct.unpack("<3H", entry[28:34]))
    return offsets


def _write_at(fd: int, data, position: int) -> None:
    """All of `data` at `position` of the file (`os.pwrite` may write less than asked)."""
    remaining = memoryview(data).cast("B")
    while remaining.nbytes:
        written = os.pwrite(fd, remaining, position)
        remaining, position = remaining[written:], position + written
