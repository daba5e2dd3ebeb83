"""Disk space, sizes and failed writes, said so that a user knows what to do: the file, the free space there.

>>> check_writable("checkpoints", "checkpoint directory")   # OSError naming it when it cannot be written
>>> format_size(3 * 2**30), parse_size("500MiB")
('3.0 GiB', 524288000)
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from pathlib import Path

__all__ = ["free_space", "format_size", "parse_size", "write_failure", "advice", "check_writable", "OUT_OF_SPACE"]


def free_space(path: str | os.PathLike) -> str:
    """" (12.3 GiB free there)": the free space of the filesystem holding `path` (its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return f" ({format_size(shutil.disk_usage(p).free)} free there)"
    except OSError:
        return ""


def format_size(n: int) -> str:
    """4096 -> "4.0 KiB"."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def write_failure(error: BaseException) -> tuple[int | None, str, bool] | None:
    """(errno, why a write failed in a few words, whether space ran out); None when `error` is not a failed write."""
    from safetensors import SafetensorError

    if isinstance(error, OSError):
        return error.errno, error.strerror or str(error), error.errno in OUT_OF_SPACE
    if isinstance(error, SafetensorError):
        code = re.search(r"os error (\d+)", str(error))
        if code:
            return int(code[1]), os.strerror(int(code[1])), int(code[1]) in OUT_OF_SPACE
        return None, str(error).splitlines()[0][:200], False
    if isinstance(error, RuntimeError) and ("PytorchStreamWriter" in str(error) or "inline_container" in str(error)):
        return None, "torch.save could not write the whole file (a full disk, or a file-size limit)", True
    return None


def advice(where: str | os.PathLike, out_of_space: bool) -> str:
    """What to do after a failed write: make room (the free space there said) when space ran out, else move."""
    return f"{free_space(where)}; free some space or choose another directory" if out_of_space else \
        "; choose a writable directory"


def check_writable(directory: str | os.PathLike, what: str) -> Path:
    """Create `directory` if needed and check that a file can be written in it; OSError naming it otherwise.

    Run before training, so a read-only or mistyped path fails at once, not at the first save.

    >>> check_writable("checkpoints", "checkpoint directory")
    """
    directory = Path(directory)
    in_the_way = next((p for p in (directory, *directory.parents) if p.exists() and not p.is_dir()), None)
    if in_the_way is not None:
        raise NotADirectoryError(f"the {what} {directory} cannot be created: {in_the_way} is a file, not a directory; "
                                 f"choose another path")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".write-check")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OSError(e.errno, f"the {what} {directory} is not writable: {e.strerror or e}"
                               f"{advice(directory, e.errno in OUT_OF_SPACE)}") from None
    return directory


_SIZE_UNITS = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
               "TB": 10**12, "B": 1}


def parse_size(size: int | str, what: str = "size") -> int:
    """Bytes from an int or a string such as "2GB", "500MiB", "1.5 GiB" (ValueError naming `what` otherwise).

    >>> parse_size("10MiB"), parse_size("2GB"), parse_size(512)
    (10485760, 2000000000, 512)
    """
    if isinstance(size, int) and not isinstance(size, bool) and size >= 0:
        return size
    if isinstance(size, str):
        text = size.strip().upper()
        for unit, factor in _SIZE_UNITS.items():
            number = text[: -len(unit)].strip()
            if text.endswith(unit) and number.replace(".", "", 1).isdigit():
                return int(float(number) * factor)
    raise ValueError(f"{what} must be a number of bytes or a size such as '2GB' or '500MiB', got {size!r}")
