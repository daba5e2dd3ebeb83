"""The directory rules of a checkpoint root: how checkpoints appear, are found and disappear.

    checkpoints/
      step-00000200/             a complete checkpoint; a second save at step 200 is step-00000200-1
      latest, best               text files naming a checkpoint directory
      .lock                      held by the job writing here (`lock.DirectoryLock`)
      .step-00000300.tmp/        a save in progress, or killed: never read, removed at the next start
      .step-00000100.deleted/    a prune in progress, or killed: removed at the next start

A checkpoint appears by one rename of its complete staged directory (`save_state`); `latest`
is rewritten atomically after that; a checkpoint disappears by a rename to its tombstone
first. So whenever a process is killed, every visible `step-*` directory is complete and
`latest` names one of them. A checkpoint is complete when its state.json is there and so is
every file it lists. Only a `step-*` directory directly under the root (not a
link) is ever removed.

>>> store = CheckpointStore("checkpoints"); store.clean()
>>> store.fresh_name(200, set(store.names())), store.find("latest")
('step-00000200', PosixPath('checkpoints/step-00000100'))
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path

from ...serialization import DELETED, STAGED, atomic_path, retire_dir

LATEST, BEST = "latest", "best"
STATE_FILE = "state.json"  # written last: a directory holding it is complete
_NAME = re.compile(r"step-(\d+)(?:-(\d+))?")


def step_key(name: str) -> tuple[int, int] | None:
    """("step-00000200-1") -> (200, 1): the step and how many saves of that step came before; None for other names."""
    m = _NAME.fullmatch(name)
    return (int(m[1]), int(m[2] or 0)) if m else None


def is_checkpoint_name(name: object) -> bool:
    """A name this store writes ("step-00000200", "step-00000200-1"): no path, no "..", nothing else."""
    return isinstance(name, str) and step_key(name) is not None


def missing_files(directory: Path) -> list[str]:
    """The files the checkpoint's state.json lists that are absent (state.json itself if absent)."""
    try:
        listed = json.loads((directory / STATE_FILE).read_text()).get("files", [])
    except FileNotFoundError:
        return [STATE_FILE]
    except (OSError, ValueError, AttributeError):
        return []  # unreadable, or not an object: read_state names the fault when it is loaded
    if not isinstance(listed, list):
        return []
    return [name for name in listed if not isinstance(name, str) or not (directory / name).is_file()]


def is_complete(directory: Path) -> bool:
    return (directory / STATE_FILE).is_file() and not missing_files(directory)


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The complete checkpoint directories under `root`, oldest step first."""
    found = [d for d in Path(root).glob("step-*") if step_key(d.name) and d.is_dir() and is_complete(d)]
    return sorted(found, key=lambda d: step_key(d.name))


class CheckpointStore:
    """The checkpoint directories under `root` (written by the main process only)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def clean(self) -> list[str]:
        """Remove what a killed save, prune or pointer update left behind; returns the names removed."""
        removed = []
        for p in self.root.glob(".*"):
            killed_save_or_prune = p.is_dir() and p.name.startswith(".step-") and p.name.endswith((STAGED, DELETED))
            killed_pointer_write = p.is_file() and p.name.startswith((f".{LATEST}.tmp", f".{BEST}.tmp"))
            if killed_save_or_prune:
                shutil.rmtree(p, ignore_errors=True)
            elif killed_pointer_write:
                p.unlink(missing_ok=True)
            if killed_save_or_prune or killed_pointer_write:
                removed.append(p.name)
        return removed

    def names(self) -> list[str]:
        """Every name under the root that a checkpoint could take ("step-..."), complete or not, sorted."""
        return sorted(p.name for p in self.root.glob("step-*") if step_key(p.name))

    @staticmethod
    def fresh_name(step: int, taken: set[str]) -> str:
        """`step-<step>`, or `step-<step>-<n>` when that step was saved before (its name in `taken`, the names under
        the root: `names()`): an existing checkpoint is never replaced."""
        base = name = f"step-{step:08d}"
        n = 0
        while name in taken:
            n += 1
            name = f"{base}-{n}"
        return name

    def point(self, pointer: str, name: str) -> None:
        """Make `pointer` ("latest" or "best") name checkpoint `name` (atomic)."""
        with atomic_path(self.root / pointer) as tmp:
            tmp.write_text(name)

    def pointed(self, pointer: str) -> str | None:
        """The checkpoint name `pointer` holds, or None."""
        file = self.root / pointer
        return file.read_text().strip() if file.is_file() else None

    def remove(self, name: str) -> None:
        """Delete checkpoint `name` (through a tombstone: a kill half-way leaves nothing that looks like it).

        Only a `step-*` directory directly under the root: any other name, or a link, is left alone.
        """
        tomb = self.retire(name)
        if tomb is not None:
            shutil.rmtree(tomb)

    def retire(self, name: str) -> Path | None:
        """Take checkpoint `name` away (renamed to its tombstone, which `clean` removes if nobody else does) and
        return the tombstone to delete; None when `name` is not a checkpoint directory (`remove`'s rule)."""
        path = self.root / name
        if is_checkpoint_name(name) and path.is_dir() and not path.is_symlink():
            return retire_dir(path)
        return None

    def complete(self) -> list[Path]:
        return complete_checkpoints(self.root)

    def find(self, which: str | os.PathLike) -> Path | None:
        """The checkpoint `which` names: "latest" (None when there is none), a name under `root`, or a path."""
        if str(which) == LATEST:
            name = self.pointed(LATEST)
            if name is not None and is_checkpoint_name(name) and (self.root / name / STATE_FILE).is_file():
                return self._whole(self.root / name)
            candidates = self.complete()  # no pointer yet, or one edited by hand
            if name is not None:   # a pointer to what is not there is said, not passed over
                warnings.warn(f"{self.root / LATEST} names {name!r}, which is not a complete checkpoint here; " +
                              (f"the newest complete one, {candidates[-1].name}, is used" if candidates else
                               "there is no other: the run starts afresh"), stacklevel=3)
            return candidates[-1] if candidates else None
        path = Path(which)
        path = path if path.is_dir() else self.root / path
        if not (path / STATE_FILE).is_file():
            raise FileNotFoundError(f"no complete checkpoint at {path} (a complete one holds {STATE_FILE}); "
                                    f"checkpoints in {self.root}: {[d.name for d in self.complete()]}")
        return self._whole(path)

    def _whole(self, path: Path) -> Path:
        """`path`, a checkpoint with a state.json; FileNotFoundError naming what is missing if a file it lists is."""
        missing = missing_files(path)
        if missing:
            raise FileNotFoundError(f"{path} has no {', '.join(missing)}: the checkpoint is incomplete (its "
                                    f"{STATE_FILE} lists them; was it copied in part, or written by two jobs?); resume "
                                    f"from another one: {[d.name for d in self.complete()]}")
        return path


def resolve(root: str | os.PathLike, which: str | os.PathLike) -> Path:
    """The checkpoint directory `which` names ("latest", a name under `root`, or a path); FileNotFoundError if none."""
    found = CheckpointStore(root).find(which)
    if found is None:
        raise FileNotFoundError(f"resume={str(which)!r} but {root} holds no complete checkpoint: this is a first run. "
                                f"Use fit(resume=\"auto\") to resume when there is a checkpoint and start fresh otherwise")
    return found
