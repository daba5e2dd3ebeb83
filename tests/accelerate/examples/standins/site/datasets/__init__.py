"""Offline stand-in for Hugging Face `datasets`: the part of its API Accelerate's examples use, in memory.

`load_dataset` reads the generated files under `$CADENCE_EXAMPLES_DATA` (see ../../build.py) for the two
hub data sets the examples download (GLUE MRPC, wikitext, TinyStories); anything else is refused by name.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from . import utils  # noqa: F401  (datasets.utils.logging.set_verbosity_*)

KNOWN = {("nyu-mll/glue", "mrpc"): "glue_mrpc", ("glue", "mrpc"): "glue_mrpc",
         ("roneneldan/TinyStories", None): "tinystories"}


class Dataset:
    """Columns of equal length; `ds[i]` is a row dict, `ds["col"]` a column list."""

    def __init__(self, columns: dict[str, list]):
        self._columns = {k: list(v) for k, v in columns.items()}

    @classmethod
    def from_rows(cls, rows: list[dict]) -> "Dataset":
        names = list(rows[0]) if rows else []
        return cls({k: [r[k] for r in rows] for k in names})

    @property
    def column_names(self) -> list[str]:
        return list(self._columns)

    @property
    def num_rows(self) -> int:
        return len(next(iter(self._columns.values()), []))

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, key):
        if isinstance(key, str):
            return list(self._columns[key])
        return {k: v[int(key)] for k, v in self._columns.items()}

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def select(self, indices) -> "Dataset":
        idx = [int(i) for i in indices]
        return Dataset({k: [v[i] for i in idx] for k, v in self._columns.items()})

    def shuffle(self, seed: int | None = None) -> "Dataset":
        order = list(range(len(self)))
        random.Random(seed).shuffle(order)
        return self.select(order)

    def rename_column(self, old: str, new: str) -> "Dataset":
        return Dataset({(new if k == old else k): v for k, v in self._columns.items()})

    def map(self, function, batched: bool = False, batch_size: int = 1000, remove_columns=None, **_ignored) -> "Dataset":
        """As `datasets`: batched functions take and return dicts of lists, 1,000 rows at a time."""
        remove = [remove_columns] if isinstance(remove_columns, str) else list(remove_columns or [])
        out: dict[str, list] = {}
        step = batch_size if batched else 1
        for start in range(0, len(self), step):
            chunk = {k: v[start:start + step] for k, v in self._columns.items()}
            result = dict(function(chunk if batched else {k: v[0] for k, v in chunk.items()}))
            kept = {k: v for k, v in chunk.items() if k not in remove and k not in result}
            merged = {**kept, **{k: (list(v) if batched else [v]) for k, v in result.items()}}
            for k, v in merged.items():
                out.setdefault(k, []).extend(v)
        return Dataset(out)

    def filter(self, function, input_columns=None, **_ignored) -> "Dataset":
        cols = [input_columns] if isinstance(input_columns, str) else input_columns
        keep = [i for i in range(len(self))
                if (function(*[self._columns[c][i] for c in cols]) if cols else function(self[i]))]
        return self.select(keep)

    def __repr__(self) -> str:
        return f"Dataset(features={self.column_names}, num_rows={self.num_rows})"


class IterableDataset:
    """The streaming kind, which the stand-in never builds (Accelerate's loaders check for it by type)."""


class DatasetDict(dict):
    """Splits by name; map/filter/rename_column apply to each."""

    def map(self, *args, **kwargs) -> "DatasetDict":
        return DatasetDict({k: v.map(*args, **kwargs) for k, v in self.items()})

    def filter(self, *args, **kwargs) -> "DatasetDict":
        return DatasetDict({k: v.filter(*args, **kwargs) for k, v in self.items()})

    def rename_column(self, old: str, new: str) -> "DatasetDict":
        return DatasetDict({k: v.rename_column(old, new) for k, v in self.items()})


def _folder(path: str, name: str | None) -> Path:
    key = KNOWN.get((path, name)) or ("wikitext" if path.split("/")[-1] == "wikitext" else None)
    if key is None:
        raise ConnectionError(f"offline stand-in for datasets: no local copy of {path!r} ({name!r}); "
                              f"it has {sorted(KNOWN)} and wikitext")
    return Path(os.environ["CADENCE_EXAMPLES_DATA"]) / key


def load_dataset(path: str, name: str | None = None, split: str | None = None, **_ignored):
    """The generated copy of a hub data set: a DatasetDict, or one split (`split="train[:5%]"` slices too)."""
    folder = _folder(path, name)
    splits = DatasetDict({f.stem: Dataset.from_rows([json.loads(line) for line in f.read_text().splitlines()])
                          for f in sorted(folder.glob("*.jsonl"))})
    if split is None:
        return splits
    base, _, part = split.partition("[")
    ds = splits[base]
    if not part:
        return ds
    lo, _, hi = part.rstrip("]").partition(":")
    bound = (lambda s: int(s[:-1]) * len(ds) // 100 if s.endswith("%") else int(s))
    return ds.select(range(bound(lo) if lo else 0, bound(hi) if hi else len(ds)))
