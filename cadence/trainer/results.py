"""What `Learner.show_results` shows: a few items of a loader, and a text table of their predictions.

>>> print_table(torch.tensor([[0.5, 1.0]]), torch.tensor([1]), torch.tensor([0]))
input       target  prediction
[0.5, 1.0]  1       0
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, Subset, default_collate


def pick_items(dl: Iterable, max_n: int, shuffle: bool, broadcast: Callable) -> Iterable:
    """A loader of `max_n` items of `dl`'s data set, in one batch: random ones with `shuffle` (the draw of
    process 0, sent to all with `broadcast`), else the first. A loader without a sized data set (a list of
    batches, a stream) gives its first batch."""
    inner = getattr(dl, "dl", None)
    if isinstance(inner, DataLoader) and not isinstance(dl, DataLoader):  # a DistributedDL: its loader
        dl = inner
    ds = getattr(dl, "dataset", None)
    if not isinstance(dl, DataLoader) or isinstance(ds, IterableDataset) or not hasattr(ds, "__len__"):
        return [next(iter(dl))]
    n = len(ds)
    idxs = torch.randperm(n)[:max_n].tolist() if shuffle else list(range(min(n, max_n)))
    idxs = broadcast(idxs)
    collate = dl.collate_fn if dl.batch_size is not None else default_collate  # batch_size=None: items come whole
    return DataLoader(Subset(ds, idxs), batch_size=max_n, collate_fn=collate)


def print_table(inputs: Any, targs: Any, decoded: Any) -> None:
    """One line per item: its input, target and decoded prediction, each a value, or its first values and shape."""
    n = len(_first_tensor(decoded))
    rows = [["input", "target", "prediction"]]
    rows += [[_cell(_item(b, i)) for b in (inputs, targs, decoded)] for i in range(n)]
    widths = [max(len(r[c]) for r in rows) for c in range(3)]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())


def _first_tensor(b: Any) -> torch.Tensor:
    if isinstance(b, torch.Tensor):
        return b
    return _first_tensor(next(iter(b.values() if isinstance(b, Mapping) else b)))


def _item(b: Any, i: int) -> Any:
    """Item `i` of a batch: a tensor's row, or the rows of a tuple's or dict's tensors; None stays None."""
    if isinstance(b, torch.Tensor):
        return b[i]
    if isinstance(b, Mapping):
        return {k: _item(v, i) for k, v in b.items()}
    if isinstance(b, (tuple, list)):
        return tuple(_item(v, i) for v in b)
    return b


def _cell(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, torch.Tensor):
        if x.numel() == 1:
            return _number(x.item())
        values = [_number(v) for v in x.flatten()[:4].tolist()]
        if x.numel() <= 4:
            return "[" + ", ".join(values) + "]"
        return "[" + ", ".join(values[:3]) + f", ...] of shape {tuple(x.shape)}"
    if isinstance(x, Mapping):
        return ", ".join(f"{k}: {_cell(v)}" for k, v in x.items())
    if isinstance(x, tuple):
        return ", ".join(_cell(v) for v in x)
    return str(x)


def _number(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
