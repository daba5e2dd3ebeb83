"""Saving and loading weights and optimizer state: safetensors, `weights_only` loads, atomic writes (used by every layer).

A file is written under a temporary name and renamed (`atomic_path`); a directory of files that
belong together (weights + optimizer) is written into a staged directory and renamed as a whole
(`replacing_dir`: `staging_dir`, `commit_dir`; `recover_dir` finishes or drops what a killed write left).
A target that is a symbolic link is written where the link points, staged next to that, the link kept.
A file that cannot be read raises ValueError naming the file; a write that fails (disk full, a
file-size limit, a read-only or missing directory) raises OSError naming the directory (and, when
space ran out, the free space there: `writing`, `disk.check_writable`), and leaves no staged directory behind.

>>> save_weights(model.state_dict(), "models/stage1.safetensors")
>>> state = load_weights("models/stage1.safetensors")
>>> check_state_dict(model, state)        # ValueError listing missing/unexpected keys, shape mismatches

Files saved from a `torch.compile`d model (keys starting `_orig_mod.`) load as the plain model's.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import socket
import struct
import threading
from pathlib import Path
from typing import Container, Iterator

import torch
from safetensors.torch import load_file
from torch import nn

from .disk import advice, write_failure
from .processes import process_exists
from .streaming import host_pieces, register_tagger, save_torch_streaming, worth_streaming

_ALIASES_KEY = "cadence_aliases"


def _real_path(path: str | os.PathLike) -> Path:
    """`path`, or where it points when it is a symbolic link: a linked target is written on the disk the link names."""
    path = Path(path)
    return Path(os.path.realpath(path)) if path.is_symlink() else path


_HOST = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:64]


def _drop_stale_temporaries(path: Path) -> None:
    """Remove the temporaries of `path` that writers on this host left when killed (their pid is gone)."""
    prefix, suffix = f".{path.name}.tmp", f"@{_HOST}"
    with contextlib.suppress(OSError), os.scandir(path.parent) as entries:
        for entry in entries:
            pid = entry.name[len(prefix):-len(suffix)]
            if entry.name.startswith(prefix) and entry.name.endswith(suffix) and pid.isdigit() and not process_exists(int(pid)):
                with contextlib.suppress(OSError):  # another save removed it first, or it is not ours to remove
                    os.unlink(entry.path)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path` (where it points, if a link); rename it onto `path` only if the block
    succeeds. The temporary is named by its writer (`.out.pt.tmp<pid>@<host>`): what a killed writer on this host left
    is removed by the next save of `path`; a live writer's is never touched.

    >>> with atomic_path("out.pt") as tmp: torch.save(obj, tmp)
    """
    path = _real_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _drop_stale_temporaries(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}@{_HOST}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_weights(state: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """Write a state dict as safetensors, atomically. Tied (shared) tensors are stored once.

    `metadata`: more string entries for the file's header (`save_model` stamps its save id there).

    The file loads with `safetensors.torch.load_file`; `load_weights` restores the tied names.
    """
    tensors, aliases, seen = {}, {}, {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.dtype, t.device) if t.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        tensors[name] = t
    with atomic_path(path) as tmp:
        write_safetensors(tensors, tmp, metadata={**(metadata or {}), _ALIASES_KEY: json.dumps(aliases)})


_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike,
                      metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` in the safetensors layout one tensor at a time, from their own memory, and fsync the file.

    safetensors' `save_file` builds the whole file in memory first: twice the model's size at the peak.
    Here a CPU tensor is written from its own memory (copied first only if it is not contiguous), and a device
    tensor through two page-locked buffers, the next piece's copy overlapping the last one's write (`host_pieces`).
    """
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key, t in tensors.items():
        size = t.numel() * t.element_size()
        header[key] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for piece in host_pieces(tensors.values()):
            f.write(piece)
        f.flush()
        os.fsync(f.fileno())


def load_weights(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read a safetensors file written by `save_weights` (or anyone else) into a state dict."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        state = load_file(str(path), device=str(device))
    except SafetensorError as e:
        raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupt: {e}); "
                         f"load another copy or another checkpoint") from None
    for alias, name in file_aliases(path, metadata, state).items():
        state[alias] = state[name]
    return strip_compile_prefix(state)


def file_aliases(path: str | os.PathLike, metadata: dict[str, str], stored: Container[str]) -> dict[str, str]:
    """{alias: stored name}: the tied names a safetensors header lists (`save_weights`), each checked against the
    names `stored` in the file; a header whose list is not an object, maps to a name the file lacks, or renames a
    tensor the file holds (loading another tensor under its name) raises ValueError naming the file.

    >>> file_aliases("model.safetensors", {"cadence_aliases": '{"lm_head.weight": "embed.weight"}'}, state)
    {'lm_head.weight': 'embed.weight'}
    """
    try:
        aliases = json.loads(metadata.get(_ALIASES_KEY, "{}"))
    except json.JSONDecodeError:
        aliases = None
    problem = None if isinstance(aliases, dict) else "is not a JSON object of names"
    for alias, name in (aliases or {}).items() if problem is None else ():
        if not isinstance(name, str) or name not in stored:
            problem = f"maps {alias!r} to {name!r}, which the file does not hold"
        elif alias in stored:
            problem = f"maps {alias!r}, a tensor the file holds, onto {name!r}"
        if problem:
            break
    if problem:
        raise ValueError(f"{path}: the {_ALIASES_KEY} entry of its header {problem}; the file is damaged or was not "
                         f"written by cadence: load another copy or another checkpoint")
    return aliases


COMPILE_PREFIX = "_orig_mod."


def strip_compile_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keys without torch.compile's `_orig_mod.` segment, which files saved from a `torch.compile`d model carry.

    >>> list(strip_compile_prefix({"_orig_mod.fc.weight": w, "module._orig_mod.fc.bias": b}))
    ['fc.weight', 'module.fc.bias']
    """
    if not any(COMPILE_PREFIX in k for k in state):
        return state
    return {".".join(p for p in k.split(".") if p != COMPILE_PREFIX[:-1]): v for k, v in state.items()}


def _full_shape(t: torch.Tensor) -> torch.Size:
    """A tensor's shape, or the whole parameter's for a DeepSpeed ZeRO-3 partition (`ds_shape`)."""
    return getattr(t, "ds_shape", t.shape)


def check_state_dict(model: nn.Module, state: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Raise ValueError, before anything is loaded, when `state` does not fit `model`."""
    expected = model.state_dict(keep_vars=True)  # parameters themselves: a ZeRO-3 partition knows its full shape
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [f"{k}: {tuple(state[k].shape)} in {source}, {tuple(_full_shape(expected[k]))} in model"
              for k in expected if k in state and state[k].shape != _full_shape(expected[k])]
    if missing or unexpected or shapes:
        lines = [f"the {source} does not fit this model (is it from another architecture?)"]
        for title, items in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", shapes)):
            if items:
                lines.append(f"  {title}: " + ", ".join(items[:20]) + (" ..." if len(items) > 20 else ""))
        raise ValueError("\n".join(lines))


def save_torch(obj, path: str | os.PathLike, zipfile: bool = True, host_tags: bool = True) -> None:
    """`torch.save` to `path` atomically, on disk (fsync) before it gets its name (`zipfile`: torch's format, else
    its legacy one; `host_tags`: under `host_tagged`); a state holding CUDA tensors, or 16 MiB of CPU tensors, is
    written through `save_torch_streaming` (the same bytes), the copy to host memory and the checksums overlapping
    the disk."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        with host_tagged() if host_tags else contextlib.nullcontext():
            if zipfile and worth_streaming(obj):
                save_torch_streaming(obj, f)
            else:
                torch.save(obj, f, _use_new_zipfile_serialization=zipfile)
        f.flush()
        os.fsync(f.fileno())


# kept on torch's module, so that a reload of this one (autoreload) shares it with functions imported before
_HOST_TAGS = vars(torch.serialization).setdefault("_cadence_host_tags", threading.local())


@contextlib.contextmanager
def host_tagged() -> Iterator[None]:
    """While in it, `torch.save` in this thread records every storage as host memory ("cpu"), wherever it is: a file
    written from a GPU's memory is then the very file written from a host copy of it (an async checkpoint's), and
    it loads as host tensors on any machine, GPU or not (the state is copied to its device when loaded into place).

    >>> with host_tagged(): torch.save(optimizer.state_dict(), f)
    """
    before, _HOST_TAGS.on = getattr(_HOST_TAGS, "on", False), True
    try:
        yield
    finally:
        _HOST_TAGS.on = before


def _host_tag(storage) -> str | None:
    return "cpu" if getattr(_HOST_TAGS, "on", False) else None


register_tagger(-271, _host_tag)  # before torch's own taggers (cpu 10, cuda 20, ...)


def load_torch(path: str | os.PathLike, map_location="cpu", mmap: bool = False):
    """`torch.load` with `weights_only=True`: tensors and plain containers only, never arbitrary objects.
    `mmap`: the tensors' storages mapped from the file, not read (a file in torch's legacy format is read).

    A file that is truncated, corrupt or holds other objects raises ValueError naming it.
    """
    try:
        if mmap:
            with contextlib.suppress(RuntimeError):  # torch's legacy format cannot be mapped; anything else fails below
                return torch.load(path, map_location=map_location, weights_only=True, mmap=True)
        return torch.load(path, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        # torch's message for a refused object suggests weights_only=False, i.e. running the file's code: never
        reason = "holds objects other than tensors" if isinstance(e, pickle.UnpicklingError) else "is truncated or corrupt"
        raise ValueError(f"{path} {reason}: it is corrupt or not a cadence checkpoint file; "
                         f"load another copy or another checkpoint") from None


# ---------------------------------------------------------------------------- directories
STAGED, REPLACED, DELETED = ".tmp", ".old", ".deleted"


def sibling(path: str | os.PathLike, suffix: str) -> Path:
    """The hidden name next to `path` (next to where it points, if a link: the same disk) that a write (".tmp"),
    replace (".old") or delete (".deleted") uses."""
    path = _real_path(path)
    return path.with_name(f".{path.name}{suffix}")


def staging_dir(target: str | os.PathLike) -> Path:
    """An empty directory next to `target` to write into; `commit_dir` then makes it `target` in one step.

    >>> staged = staging_dir("models/stage1"); save_weights(state, staged / "model.safetensors")
    >>> commit_dir(staged, "models/stage1")
    """
    staged = sibling(Path(target), STAGED)
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    return staged


def commit_dir(staged: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Make the complete directory `staged` visible as `target`, replacing any directory there (a link to a
    directory keeps pointing to the new one, where the old one was).

    A new name is one rename. A replace is two (old out of the way as ".old", then staged in):
    while ".old" exists the staged directory is known complete, so `recover_dir` finishes a
    replace that was killed between them, and the pair of files inside never mixes two saves.
    """
    staged, real = Path(staged), _real_path(target)
    if real.is_file():
        raise FileExistsError(f"{target} is a file, not a directory written by cadence: left as it is; pass another "
                              f"name or move it")
    if real.exists():
        old = sibling(real, REPLACED)
        _refuse_foreign_file(old)
        shutil.rmtree(old, ignore_errors=True)
        os.rename(real, old)
        os.rename(staged, real)
        shutil.rmtree(old)
    else:
        os.rename(staged, real)
    return Path(target)


@contextlib.contextmanager
def replacing_dir(target: str | os.PathLike, what: str) -> Iterator[Path]:
    """Yield an empty staged directory for `target`; when the block succeeds it becomes `target` whole (`commit_dir`).

    What a killed replace left is finished or dropped first (`recover_dir`); a failure leaves the previous `target`
    and no staged directory, a failed write raising OSError naming `target` (`writing`).

    >>> with replacing_dir("models/stage1", "saved model") as staged: save_weights(state, staged / "model.safetensors")
    """
    with writing(target, what, sibling(target, STAGED)):
        recover_dir(target)
        staged = staging_dir(target)
        yield staged
        commit_dir(staged, target)


def _refuse_foreign_file(old: Path) -> None:
    """Refuse to replace through `old` (the ".old" name) when a file is there: commit_dir moves only directories
    there, so it is someone's file (a fastai `export.pkl` an earlier cadence hid while exporting over it), never
    deleted here."""
    if old.is_file() or old.is_symlink():
        raise FileExistsError(f"{old} is a file, not a directory cadence moved aside (perhaps a fastai export.pkl an "
                              f"earlier cadence version hid there while exporting over it): left as it is. Move or "
                              f"rename it, then write {old.parent / old.name[1:].removesuffix('.old')} again")


def recover_dir(target: str | os.PathLike) -> None:
    """Finish a replace of `target` that was killed half-way; drop what a killed write or delete left."""
    target = _real_path(target)
    old, staged = sibling(target, REPLACED), sibling(target, STAGED)
    if old.is_file() or old.is_symlink():
        # not a replace of ours (commit_dir moves only directories there): a file an earlier version moved aside
        # is given back its name when that is free, else left as it is (commit_dir then refuses, naming it)
        if not target.exists() and not target.is_symlink():
            os.rename(old, target)
    elif old.exists():
        if not target.exists():
            os.rename(staged, target)  # staged was complete: the old directory moves away only then
        shutil.rmtree(old)
    shutil.rmtree(staged, ignore_errors=True)
    shutil.rmtree(sibling(target, DELETED), ignore_errors=True)


def remove_dir(path: str | os.PathLike) -> None:
    """Delete a directory; it first becomes a hidden ".deleted" tombstone, so a kill half-way never
    leaves a partial directory under its own name (`recover_dir` removes the tombstone)."""
    shutil.rmtree(retire_dir(path))


def retire_dir(path: str | os.PathLike) -> Path:
    """Rename a directory to its hidden ".deleted" tombstone (one step: nothing is left under its name) and return
    the tombstone, for the caller to delete when it likes (a kill before that: `recover_dir` removes it). A symbolic
    link is refused: what it points to is not cadence's to delete.

    >>> tomb = retire_dir("checkpoints/step-00000100"); threading.Thread(target=shutil.rmtree, args=(tomb,)).start()
    """
    path = Path(path)
    if path.is_symlink():
        raise ValueError(f"{path} is a symbolic link (to {os.readlink(path)}): cadence removes only directories it "
                         f"wrote, never what a link points to; remove the link yourself if it should go")
    tomb = sibling(path, DELETED)
    shutil.rmtree(tomb, ignore_errors=True)
    os.rename(path, tomb)
    return tomb


# ---------------------------------------------------------------------------- failed writes
@contextlib.contextmanager
def writing(target: str | os.PathLike, what: str, staged: str | os.PathLike | None = None) -> Iterator[None]:
    """Around writes to `target`: on any failure `staged` is removed (its space is freed now, not at the next
    start); a failed write (disk full, file-size limit, read-only) becomes an OSError naming `target`, what to do
    and, when space ran out, the free space there, instead of torch's `inline_container.cc` message or a
    SafetensorError.

    >>> with writing("models/stage1", "model", staged): save_weights(state, staged / "model.safetensors")
    """
    try:
        yield
    except BaseException as e:
        if staged is not None and not sibling(Path(target), REPLACED).exists():  # else recover_dir needs it
            shutil.rmtree(staged, ignore_errors=True)
        failure = write_failure(e)
        if failure is None:
            raise
        code, reason, out_of_space = failure
        message = f"could not write the {what} {target}: {reason}{advice(target, out_of_space)}" + (
            f". The previous {what} there, if any, is untouched" if staged is not None else "")
        raise (OSError(code, message) if code is not None else OSError(message)) from e


SAVE_ID_KEY = "cadence_save_id"  # one id per `save_model`, in every shard's header and in the index: shards of two saves never pass as one
