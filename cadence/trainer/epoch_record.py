"""EpochRecord: one row of `recorder.values`, fastai's list that names its columns too.

fastai's `recorder.values` rows are lists `[train_loss, valid_loss, *metrics]` (no epoch, no time); cadence's
were dicts. A row is now both: a list of those values, and readable (and writable) by column name, the epoch
and the time included.

>>> row = EpochRecord({"epoch": 0, "train_loss": 0.5, "valid_loss": 0.4, "accuracy": 0.9, "time": 1.5})
>>> row, row[1], row["valid_loss"], row["epoch"], len(row)
([0.5, 0.4, 0.9], 0.4, 0.4, 0, 3)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_OUTSIDE = ("epoch", "time")  # columns fastai's list leaves out: read by name only
# fastai's column names that differ from cadence's: its `rmse` and `exp_rmspe` are AccumMetrics of `_rmse` and
# `_exp_rmspe`, named after those functions. cadence keeps its names and reads fastai's as the same columns.
FASTAI_COLUMNS = {"_rmse": "rmse", "_exp_rmspe": "exp_rmspe"}


def column(name: str, names: list[str]) -> str | None:
    """The column of `names` that `name` designates: `name` itself, or cadence's name for fastai's (`_rmse` is
    `rmse`, `valid__rmse` is `valid_rmse` with `train_metrics`); None when neither is there.

    >>> column("_rmse", ["train_loss", "valid_loss", "rmse"]), column("rmse", ["train_loss", "valid_loss", "rmse"])
    ('rmse', 'rmse')
    """
    if name in names:
        return name
    for prefix in ("", "train_", "valid_"):
        ours = FASTAI_COLUMNS.get(name[len(prefix):]) if name.startswith(prefix) else None
        if ours is not None and prefix + ours in names:
            return prefix + ours
    return None


class EpochRecord(list):
    """One epoch's results: fastai's list `[train_loss, valid_loss, *metrics]` that names its columns too.

    The list holds the Recorder's columns but `epoch` and `time`, in order (with `train_metrics`, fastai's
    `train_loss, train_<metric>..., valid_loss, valid_<metric>...`): positions, `len`, iteration, `==` with a
    list, `np.array(values)` work as on fastai's. Every column, `epoch` and `time` included, is also read and
    written by name (`row["accuracy"]`, `row["epoch"]`; fastai's names `_rmse` and `_exp_rmspe` read cadence's `rmse`
    and `exp_rmspe`); `keys()`, `items()`, `get()` and `as_dict()` work as
    on the dict rows cadence had, and `name in row` checks the column names.

    >>> row = EpochRecord({"epoch": 2, "train_loss": 0.5, "valid_loss": 0.4})
    >>> row["valid_loss"] = 0.3; row == [0.5, 0.3], row.as_dict()
    (True, {'epoch': 2, 'train_loss': 0.5, 'valid_loss': 0.3})
    """

    def __init__(self, columns: dict[str, Any]):
        self.names = [k for k in columns if k not in _OUTSIDE]
        self.outside = {k: columns[k] for k in _OUTSIDE if k in columns}
        super().__init__(columns[k] for k in self.names)

    def __reduce__(self) -> tuple:  # copy, deepcopy and pickle rebuild it from its columns
        return type(self), (self.as_dict(),)

    def __eq__(self, other: Any) -> bool:
        """Equal to a list of the same values (fastai's row), to a dict of the same columns (cadence's row), and to
        another record with the same columns and values."""
        if isinstance(other, (EpochRecord, Mapping)):
            return self.as_dict() == dict(other)
        return super().__eq__(other)

    def __ne__(self, other: Any) -> bool:
        return not self == other

    __hash__ = None  # a list: unhashable

    def _fixed(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a recorded epoch's columns are fixed: set a value by name or position "
                        "(row['accuracy'] = 0.9, row[1] = 0.3), or make a list of it first (list(row))")

    append = extend = insert = pop = remove = clear = sort = reverse = __delitem__ = __iadd__ = __imul__ = _fixed

    def keys(self) -> list[str]:
        """The column names, in order: `epoch`, the list's columns, `time` (when recorded)."""
        return [*(["epoch"] if "epoch" in self.outside else []), *self.names,
                *(["time"] if "time" in self.outside else [])]

    def as_dict(self) -> dict[str, Any]:
        """`{name: value}` for every column, in order (what the rows were before, and what a checkpoint stores)."""
        return {k: self[k] for k in self.keys()}

    def items(self) -> list[tuple[str, Any]]:
        """`(name, value)` for every column, as `as_dict().items()`.

        >>> dict(learn.recorder.values[-1].items())["valid_loss"]
        """
        return list(self.as_dict().items())

    def values(self) -> list[Any]:
        """Every column's value, `epoch` and `time` included, as `as_dict().values()` (`list(row)` is fastai's).

        >>> epoch, train_loss, valid_loss, *rest = learn.recorder.values[-1].values()
        """
        return list(self.as_dict().values())

    def get(self, name: str, default: Any = None) -> Any:
        """The value of column `name`, or `default` if this epoch did not record it.

        >>> learn.recorder.values[-1].get("accuracy", float("nan"))
        """
        return self[name] if name in self else default

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            key = column(key, self.names) or key   # fastai's `_rmse` reads `rmse`
            if key in self.outside:
                return self.outside[key]
            if key not in self.names:
                raise KeyError(f"{key!r}: this epoch recorded {self.keys()}")
            return super().__getitem__(self.names.index(key))
        if isinstance(key, int) and not -len(self) <= key < len(self):
            raise IndexError(f"this row has {len(self)} values ({', '.join(self.names)}); got position {key}")
        return super().__getitem__(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        if not isinstance(key, str):
            return super().__setitem__(key, value)
        if key in _OUTSIDE:
            self.outside[key] = value
        elif key in self.names:
            super().__setitem__(self.names.index(key), value)
        else:  # a new column, as a dict would take it: last in the list
            self.names.append(key)
            super().append(value)

    def __contains__(self, item: Any) -> bool:
        if isinstance(item, str):  # a column name (the values are numbers or None); fastai's `_rmse` too
            return column(item, self.keys()) is not None
        return super().__contains__(item)
