"""DataLoaders: the train and valid loaders of a Learner, and moving batches to a device.

>>> dls = DataLoaders.from_dsets(train_ds, valid_ds, bs=64)
>>> dls.train.bs, dls.train.shuffle, dls.train.n      # fastai's loader attributes: 64, True, len(train_ds)
>>> dls.train.bs = 32                                  # as fastai's: the next epoch's batches have 32 items
>>> dls = DataLoaders(train_dl, valid_dl, device="cpu")
>>> xb, yb = dls.one_batch()                 # the train loader's first batch, on dls.device
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, TensorDataset

from ..loader_settings import loader_settings, rebatched
from ..nested import map_tensors


_CPU = torch.device("cpu")


def to_device(batch: Any, device: torch.device | str | None, non_blocking: bool = False) -> Any:
    """Move the tensors in `batch` (a tensor, or tuples, lists and dicts of them) to `device`.

    >>> to_device({"x": torch.ones(2), "ids": [torch.zeros(1)]}, torch.device("cpu"))["x"].device
    device(type='cpu')
    """
    if device is None:
        return batch
    if type(device) is str:
        device = torch.device(device)
    if type(batch) is tuple or type(batch) is list:  # the usual (x, y) batch, often already there: returned as is
        on_cpu = device == _CPU  # then `t.is_cpu` tells, at half the cost of making `t.device`
        for b in batch:
            if not (isinstance(b, torch.Tensor) and (b.is_cpu if on_cpu else b.device == device)):
                break
        else:
            return batch
    return map_tensors(lambda t: t if t.device == device else t.to(device, non_blocking=non_blocking), batch)


def to_detach(b: Any, cpu: bool = True) -> Any:
    """The tensors of `b` (tuples, lists and dicts of them) detached from the graph, moved to the CPU if `cpu`.

    >>> to_detach((pred, {"h": hidden}))        # no graph, on the CPU
    """
    return map_tensors(lambda t: t.detach().cpu() if cpu else t.detach(), b)


def n_batches(dl: Iterable) -> int | None:
    """`len(dl)`, or None for a loader without a length (a stream: an IterableDataset without __len__).

    >>> n_batches([(x, y)] * 3), n_batches(iter([]))
    (3, None)
    """
    try:
        return len(dl)
    except TypeError:
        return None


def _is_batch(obj: Any) -> bool:
    return isinstance(obj, (torch.Tensor, Mapping)) or (isinstance(obj, (list, tuple)) and len(obj) > 0)


def _check_loader(name: str, dl: Any) -> None:
    """TypeError naming what DataLoaders takes when `dl` is a dataset, a list of samples or not iterable."""
    takes = (f"DataLoaders({name}=...) takes a loader: a torch DataLoader or a list of batches (tuples of tensors); "
             f"for a dataset use DataLoader(ds, batch_size=64) or DataLoaders.from_dsets(train_ds, valid_ds, bs=64)")
    if dl is None or isinstance(dl, DataLoader):
        return
    if isinstance(dl, Dataset) and not isinstance(dl, IterableDataset):
        raise TypeError(f"{takes}; got the dataset {type(dl).__name__}")
    if not hasattr(dl, "__iter__"):
        raise TypeError(f"{takes}; got {type(dl).__name__}")
    if isinstance(dl, (list, tuple)) and dl and not _is_batch(dl[0]):
        raise TypeError(f"{takes}; got a {type(dl).__name__} whose first element {dl[0]!r} "
                        f"({type(dl[0]).__name__}) is a sample, not a batch")


def _dataset(dl: Iterable, name: str) -> Any:
    """`dl.dataset`; AttributeError naming what has none (a list of batches)."""
    ds = getattr(dl, "dataset", None)
    if ds is None:
        raise AttributeError(f"dls.{name}_ds: the {name} loader, a {type(dl).__name__}, has no data set; a torch "
                             f"DataLoader has one")
    return ds


def _batch_size(dl: Any) -> int | None:
    """The loader's batch size: `batch_size`, else its batch sampler's; None for a loader that has none."""
    bs = getattr(dl, "batch_size", None)
    return getattr(getattr(dl, "batch_sampler", None), "batch_size", None) if bs is None else bs


def _n_items(dl: Any) -> int | None:
    """fastai's `dl.n`: the items of the loader's data set; None for a stream without a length (whatever its
    `__len__` raises: TypeError, NotImplementedError, ...)."""
    try:
        return len(dl.dataset)
    except Exception:
        return None


def _shuffles(dl: Any) -> bool:
    """fastai's `dl.shuffle` for a torch loader: its sampler, or its batch sampler's, is a `RandomSampler`."""
    samplers = (getattr(dl, "sampler", None), getattr(getattr(dl, "batch_sampler", None), "sampler", None))
    return any(isinstance(s, RandomSampler) for s in samplers)


_FASTAI_ATTRS = {"bs": _batch_size, "shuffle": _shuffles, "n": _n_items}
# on a tagged loader: the names with_fastai_attrs set (a user's own are kept). On the loader itself, so that what is
# cadence's travels with it: handed back after distrib_ctx, pickled with the DataLoaders (torch.save(dls)), copied
_SET = "_cadence_fastai_attrs"


def with_fastai_attrs(dl: Any) -> Any:
    """`dl` with fastai's DataLoader attributes `bs`, `shuffle` and `n` (those it lacks), read off a torch DataLoader:
    its batch size, whether it draws a random order (fastai's rule for a torch loader: a `RandomSampler`, here also
    inside a batch sampler) and the items of its data set (None for a stream without a length). `n` is read again at
    each call (`dls.train` calls it), so a data set that grows is seen; a `bs` set to a new size is
    `DataLoaders`' to honour. Any other iterable (a list of batches, a custom loader that may shuffle by itself) gets
    none; cadence's DistributedDL has its own. Returns `dl`.

    >>> dl = with_fastai_attrs(DataLoader(range(10), batch_size=4, shuffle=True))
    >>> dl.bs, dl.shuffle, dl.n
    (4, True, 10)
    """
    if not isinstance(dl, DataLoader):
        return dl
    ours = getattr(dl, _SET, None)
    if ours is None:
        ours = tuple(name for name in _FASTAI_ATTRS if not hasattr(dl, name))
        try:
            setattr(dl, _SET, ours)
        except AttributeError:  # a loader that takes no new attributes: it goes without
            return dl
        for name in ours:
            setattr(dl, name, _FASTAI_ATTRS[name](dl))
    elif "n" in ours:
        dl.n = _n_items(dl)
    return dl


def _with_set_bs(dl: Any, name: str) -> Any:
    """`dl`, or a loader rebuilt with the batch size set on it since (fastai's `dls.train.bs = 8`): the same data set,
    sampler and settings (`rebatched`), and the user's own `shuffle` or `n`. A loader that cannot be rebuilt gets its
    `bs` back, and the error says what to do."""
    ours = getattr(dl, _SET, ()) if isinstance(dl, DataLoader) else ()
    if "bs" not in ours or dl.bs == _batch_size(dl):
        return dl
    wanted, dl.bs = dl.bs, _batch_size(dl)
    new = rebatched(dl, wanted, name)
    for attr in ("shuffle", "n"):
        if attr not in ours and hasattr(dl, attr):
            setattr(new, attr, getattr(dl, attr))
    return with_fastai_attrs(new)


def _as_dataset(items: Any) -> Any:
    """A map-style data set of `items`: a Dataset as it is, a tensor or array by rows, any other sequence by items."""
    if isinstance(items, Dataset):
        return items
    if isinstance(items, torch.Tensor) or type(items).__module__ == "numpy":
        return TensorDataset(torch.as_tensor(items))
    if not hasattr(items, "__len__") or not hasattr(items, "__getitem__"):
        raise TypeError(f"dls.test_dl takes a Dataset, a tensor or array, or a list of items; got "
                        f"{type(items).__name__}")
    return items


class _Inputs(Dataset):
    """The items of `ds` without their targets: a tuple item keeps its first `n_inp` elements (all but the last by
    default), as the training loop splits a batch; one input is given alone. A dict item (Hugging Face style) goes
    without its `target_keys`, as the loop gives the model a dict batch."""

    def __init__(self, ds: Any, n_inp: int | None, target_keys: tuple[str, ...] = ("labels",)):
        self.ds, self.n_inp, self.target_keys = ds, n_inp, target_keys

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> Any:
        item = self.ds[i]
        if isinstance(item, Mapping):
            return type(item)({k: v for k, v in item.items() if k not in self.target_keys})
        if not isinstance(item, (tuple, list)):
            return item
        n = self.n_inp or len(item) - 1 or 1
        return item[0] if n == 1 else tuple(item[:n])


def _default_device() -> torch.device:
    from ..distributed.env import default_device

    return default_device()


class DataLoaders:
    """A train loader, an optional valid loader, and the device their batches go to.

    Any iterable with `len()` works as a loader (a torch DataLoader, a list of batches).
    `n_inp` is how many leading elements of a batch go to the model (the rest are targets);
    by default all but the last. A batch may also be a dict (Hugging Face style): the model gets
    it as keyword arguments, and `target_keys` (default "labels") name the targets.

    A torch loader gets fastai's attributes `bs`, `shuffle` and `n` (`dls.train.bs`, `dls.valid.n`), read off it
    (`with_fastai_attrs`). Setting `bs` changes the batch size, as fastai's: torch fixes a loader's when built, so
    the next read of `dls.train` (`dls.valid`) finds it replaced by one rebuilt with that size, the same data set,
    sampler, collate_fn and workers. A fit counts its batches when it starts: set it between fits. Under
    `distrib_ctx` `dls.train` is a DistributedDL, whose `bs` is this process's, as fastai's.

    >>> dls = DataLoaders(train_dl, valid_dl)
    >>> dls.train, dls.valid, dls.device, dls.train_ds, dls.valid_ds
    >>> dls.train.bs, dls.train.shuffle, dls.train.n, dls.valid.shuffle
    >>> dls.train.bs = 8; learn.fit(1)       # batches of 8 from now on
    """

    def __init__(self, train: Iterable, valid: Iterable | None = None, device: torch.device | str | None = None,
                 n_inp: int | None = None, target_keys: Iterable[str] = ("labels",)):
        _check_loader("train", train)
        _check_loader("valid", valid)
        if n_inp is not None and (not isinstance(n_inp, int) or n_inp < 1):
            raise ValueError(f"n_inp must be a positive int (how many leading batch elements are inputs), got {n_inp!r}")
        target_keys = (target_keys,) if isinstance(target_keys, str) else tuple(target_keys)
        if not target_keys:
            raise ValueError("target_keys must name at least one key of the dict batches, e.g. target_keys=['labels']")
        self.train, self.valid, self.n_inp, self.target_keys = train, valid, n_inp, target_keys
        self.device = torch.device(device) if device is not None else _default_device()

    @classmethod
    def from_dsets(cls, train_ds: Dataset, valid_ds: Dataset | None = None, bs: int = 64, val_bs: int | None = None,
                   shuffle: bool = True, device: torch.device | str | None = None, n_inp: int | None = None,
                   target_keys: Iterable[str] = ("labels",), drop_last: bool = True, **kwargs) -> "DataLoaders":
        """Build torch DataLoaders as fastai's: the train one shuffled and without its last partial batch
        (`drop_last`), the valid one in order and whole.

        Extra keyword arguments (num_workers, collate_fn, ...) go to both loaders.

        >>> dls = DataLoaders.from_dsets(TensorDataset(x, y), TensorDataset(xv, yv), bs=64)
        """
        if not isinstance(bs, int) or bs < 1:
            raise ValueError(f"bs must be a positive int, got {bs!r}")
        if drop_last and hasattr(train_ds, "__len__") and not isinstance(train_ds, IterableDataset) \
                and len(train_ds) < bs:
            raise ValueError(f"train_ds has {len(train_ds)} items, fewer than bs={bs}: without its partial last "
                             f"batch (drop_last=True, fastai's default) the training loader has none; pass a "
                             f"smaller bs, or drop_last=False")
        pin = kwargs.pop("pin_memory", torch.cuda.is_available())
        train = DataLoader(train_ds, batch_size=bs, shuffle=shuffle, pin_memory=pin, drop_last=drop_last, **kwargs)
        valid = None
        if valid_ds is not None:
            valid = DataLoader(valid_ds, batch_size=val_bs or bs, shuffle=False, pin_memory=pin, **kwargs)
        return cls(train, valid, device=device, n_inp=n_inp, target_keys=target_keys)

    @property
    def train(self) -> Iterable:
        """The training loader (a torch DataLoader with fastai's `bs`, `shuffle`, `n`; any iterable of batches)."""
        self._train = with_fastai_attrs(_with_set_bs(self._train, "dls.train"))   # `n` read now: a grown data set
        return self._train

    @train.setter
    def train(self, dl: Iterable) -> None:  # a loader swapped in later gets the attributes too
        self._train = with_fastai_attrs(dl)

    @property
    def valid(self) -> Iterable | None:
        """The validation loader, or None (with fastai's `bs`, `shuffle`, `n` as `train`)."""
        self._valid = with_fastai_attrs(_with_set_bs(self._valid, "dls.valid"))
        return self._valid

    @valid.setter
    def valid(self, dl: Iterable | None) -> None:
        self._valid = with_fastai_attrs(dl)

    @property
    def train_ds(self) -> Any:
        """The training loader's data set (fastai's `dls.train_ds`).

        >>> x, y = dls.train_ds[0]
        """
        return _dataset(self.train, "train")

    @property
    def valid_ds(self) -> Any:
        """The validation loader's data set (fastai's `dls.valid_ds`); None without a validation loader.

        >>> len(dls.valid_ds)
        """
        return None if self.valid is None else _dataset(self.valid, "valid")

    @property
    def bs(self) -> int | None:
        """The training loader's batch size (fastai's `dls.bs`); None for a loader that has none (a list of batches).

        >>> DataLoaders.from_dsets(train_ds, valid_ds, bs=64).bs
        64
        """
        return _batch_size(self.train)

    def one_batch(self) -> Any:
        """The training loader's first batch, on `self.device` (fastai's `dls.one_batch()`: with shuffling,
        a random batch).

        >>> xb, yb = dls.one_batch()
        """
        for batch in self.train:
            return to_device(batch, self.device)
        raise ValueError("dls.one_batch(): the training loader yields no batch")

    def test_dl(self, test_items: Any, with_labels: bool = False, bs: int | None = None, **kwargs: Any) -> DataLoader:
        """A loader over new items for `get_preds(dl=...)` / `validate(dl=...)`, with the validation loader's
        settings (its batch size, collate_fn, workers, pin_memory; the training loader's without one), in order and
        whole (fastai's `dls.test_dl`).

        `test_items` is a Dataset, a tensor or array (one item per row), or a list of items. Without labels
        (`with_labels=False`, the default) each batch is the inputs alone: items that are tuples keep their first
        `n_inp` elements (all but the last by default, as the training loop splits a batch), dict items go without
        the `target_keys` (Hugging Face's "labels"), so the validation set itself gives a loader without its targets;
        a tensor's rows are inputs. `bs` and other keyword arguments
        (torch DataLoader's) override the validation loader's.

        >>> preds, _ = learn.get_preds(dl=learn.dls.test_dl(torch.randn(10, 4)))   # 10 new items, no labels
        """
        ds = _as_dataset(test_items)
        if not with_labels:
            ds = _Inputs(ds, self.n_inp, self.target_keys)
        like = self.valid if self.valid is not None else self.train
        settings = loader_settings(like) if isinstance(like, DataLoader) else {}
        bs = bs or _batch_size(like)
        if bs is None:
            raise ValueError(f"dls.test_dl: the validation loader, a {type(like).__name__}, has no batch size; "
                             f"pass one: dls.test_dl(items, bs=64)")
        loader = DataLoader(ds, batch_size=bs, shuffle=False, drop_last=False, **{**settings, **kwargs})
        return with_fastai_attrs(loader)

    def __getitem__(self, i: int) -> Iterable:
        return (self.train, self.valid)[i]

    def __repr__(self) -> str:
        return f"DataLoaders(train={len(self.train)} batches, valid={len(self.valid) if self.valid else None}, device={self.device})"
