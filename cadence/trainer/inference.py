"""Inference on a Learner: `validate`, `get_preds` (every item once, in data set order), `predict`, `tta`,
`show_results`.

>>> learn.validate()["accuracy"]
>>> preds, targs = learn.get_preds()                      # the validation set, in its order
>>> preds, targs, decoded = learn.get_preds(ds_idx=0, with_decoded=True)
>>> preds, targs = learn.tta(batch_tfms=lambda x: x + 0.1 * torch.randn_like(x))
>>> inputs, preds, targs = learn.show_results(max_n=4)   # and a table of them
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from ..loader_settings import loader_settings
from ..nested import map_tensors
from .callback import Callback, Order, event_methods
from .data import to_device, with_fastai_attrs
from .epoch_record import EpochRecord
from .events import CancelException
from .model_output import call_model, model_loss

# a loader's in-order copy lives as long as the loader: a distributed fit shards it once (it is keyed by id)
_ORDERED: "weakref.WeakKeyDictionary[DataLoader, DataLoader]" = weakref.WeakKeyDictionary()


def in_dataset_order(dl: Iterable) -> Iterable:
    """A copy of torch DataLoader `dl` that yields every item of its data set once, in order: no shuffling,
    no sampler, no dropped last batch; same batch size, collate_fn and workers. Other iterables as they are.

    >>> in_dataset_order(DataLoader(ds, batch_size=8, shuffle=True, drop_last=True))   # all of ds, 0..n-1
    """
    inner = getattr(dl, "dl", None)
    if isinstance(inner, DataLoader) and not isinstance(dl, DataLoader):  # a DistributedDL: its loader
        dl = inner
    if not isinstance(dl, DataLoader):
        return dl
    if dl not in _ORDERED:
        _ORDERED[dl] = with_fastai_attrs(_ordered_copy(dl))
    return _ORDERED[dl]


def _ordered_copy(dl: DataLoader) -> DataLoader:
    kw = loader_settings(dl)
    ds = dl.dataset
    if isinstance(ds, IterableDataset):
        return DataLoader(ds, batch_size=dl.batch_size, **kw)
    if dl.batch_size is not None:
        return DataLoader(ds, batch_size=dl.batch_size, shuffle=False, drop_last=False, **kw)
    batches = dl.batch_sampler if dl.batch_sampler is not None else dl.sampler
    bs = getattr(batches, "batch_size", None)
    if dl.batch_sampler is not None:  # a custom batch sampler: batches of its batch size (1 if it has none)
        return DataLoader(ds, batch_size=bs or 1, shuffle=False, drop_last=False, **kw)
    if isinstance(dl.sampler, BatchSampler):  # sampler=BatchSampler(...), batch_size=None: dataset[indices]
        return DataLoader(ds, sampler=BatchSampler(SequentialSampler(ds), bs, drop_last=False), batch_size=None, **kw)
    return DataLoader(ds, batch_size=None, shuffle=False, **kw)


def _decodes(loss_func: Any) -> Callable | None:
    """fastai's `loss_func.decodes`; for torch's class-index losses, the arg-max class."""
    decodes = getattr(loss_func, "decodes", None)
    if decodes is not None:
        return decodes
    inner = loss_func.func if isinstance(loss_func, functools.partial) else loss_func
    if isinstance(inner, (nn.CrossEntropyLoss, nn.NLLLoss)) or inner in (nn.functional.cross_entropy,
                                                                           nn.functional.nll_loss):
        return lambda p: p.argmax(dim=-1)
    return None


class _BatchTransform(Callback):
    """`tta`'s augmentation: `tfm(x)` on the first input of every batch."""

    order = Order.DEFAULT - 1

    def __init__(self, tfm: Callable):
        self.tfm = tfm

    def before_batch(self):
        xb = self.learn.xb
        self.learn.xb = (self.tfm(xb[0]), *xb[1:])


def _fire_on(cbs: list[Callback], events: tuple[str, ...]) -> None:
    """Each event to the callbacks `cbs` alone, in their order (an error names the callback and the event)."""
    for event in events:
        for cb in sorted(cbs, key=lambda c: c.order):
            handler = event_methods(cb).get(event)
            if handler is None:
                continue
            try:
                handler()
            except CancelException:
                raise
            except Exception as e:
                e.add_note(f"(raised in callback {type(cb).__name__} during event {event})")
                raise


class InferenceMethods:
    """Mixed into `Learner`: passes over a loader without training."""

    def _pick_dl(self, ds_idx: Any, dl: Iterable | None, what: str) -> Iterable:
        if not isinstance(ds_idx, int):  # validate(dl) / get_preds(dl): a loader given first
            ds_idx, dl = 1, ds_idx
        if dl is None:
            if ds_idx not in (0, 1):
                raise ValueError(f"{what}(ds_idx=...) takes 0 (train) or 1 (valid), got {ds_idx!r}")
            dl = self.dls[ds_idx]
        if dl is None:
            raise ValueError(f"{what} needs data: pass {what}(dl=...) or build DataLoaders with a validation set")
        return dl

    def validate(self, ds_idx: int | Iterable = 1, dl: Iterable | None = None,
                 cbs: Any = None) -> EpochRecord:
        """Run one validation pass over `dl` (default: `dls[ds_idx]`, the validation set); returns fastai's list
        `[valid_loss, *metrics]`, which also names its values (an `EpochRecord`: `res["accuracy"]`, `res.items()`),
        and sets `learn.final_record` to it.

        >>> loss, acc = learn.validate()
        >>> learn.validate()["accuracy"]
        """
        dl = self._pick_dl(ds_idx, dl, "validate")
        with self.validation_context(cbs=cbs):
            self._do_epoch_validate(dl)
        self.final_record = EpochRecord(self.recorder.pass_values())
        return self.final_record

    def get_preds(self, ds_idx: int | Iterable = 1, dl: Iterable | None = None, with_input: bool = False,
                  with_decoded: bool = False, with_loss: bool = False, act: Callable | None = None,
                  inner: bool = False, reorder: bool = True, cbs: Any = None, concat_dim: int = 0,
                  pad_index: Any = -100) -> tuple:
        """Predictions and targets for every item of `dl`'s data set (default: `dls[ds_idx]`), once each, in the
        data set's order, on any number of processes: a torch DataLoader is read in order, without
        shuffling, sampler or dropped last batch (as fastai's `dl.new(shuffled=False, drop_last=False)`).

        Returns `(inputs?, preds, targs, decoded?, losses?)` as fastai: inputs first if `with_input`,
        `decoded` (`loss_func.decodes(preds)`; the arg-max class for torch's cross entropy and NLL) if
        `with_decoded`, per-item losses last if `with_loss`. `act` is applied to the predictions
        (default: `loss_func.activation` if the loss defines one).

        fastai's flags: `reorder=False` reads a `dl` passed in as it is (its shuffling, sampler and dropped
        last batch; `dls[ds_idx]` is read in order either way, as in fastai), the results in the order it
        yields them; `concat_dim` is the dimension the batches are joined along (1 for sequence-first outputs);
        `inner=True` (a callback calling it during `fit`) leaves the fit's state (loader, batch, train or eval
        mode of every module) as it was. No progress is shown either way.

        Batches padded to different lengths (each to its own longest sequence, as transformers'
        `DataCollatorWithPadding` pads them) are padded to the longest of all, on every process, at the end of each
        dim with `pad_index` (default -100, transformers' Trainer's `padding_index` and its labels' ignore index):
        predictions, targets, inputs and losses alike. Each item keeps its own values at the start; mask the rest
        with `targs != -100`. Batches of one shape are joined as they are.

        >>> preds, targs = learn.get_preds()
        >>> inps, preds, targs, losses = learn.get_preds(ds_idx=0, with_input=True, with_loss=True,
        ...                                              act=partial(torch.softmax, dim=-1))
        >>> preds, targs = learn.get_preds(dl=shuffled_dl, reorder=False)     # in the loader's own order
        >>> logits, labels = learn.get_preds()       # dynamically padded batches: (items, longest, vocab), -100 after
        """
        from .gather import GatherPreds

        if with_loss and self.loss_func is None:
            raise ValueError("get_preds(with_loss=True): the model computes its own loss (loss_func=None), one "
                             "number per batch, so there is no loss per item; give the Learner a loss_func that "
                             "computes it from the predictions, or call get_preds without with_loss")
        picked = self._pick_dl(ds_idx, dl, "get_preds")
        given = dl is not None or not isinstance(ds_idx, int)
        dl = in_dataset_order(picked) if reorder or not given else picked
        gatherer = GatherPreds(with_input, with_loss, concat_dim, pad_index)
        with self.no_bar(), self.validation_context(cbs=[*_as_list(cbs), gatherer], inner=inner):
            self._do_epoch_validate(dl)
        act = act if act is not None else getattr(self.loss_func, "activation", None)
        out = list(gatherer.result(act))
        if with_decoded:
            decodes = _decodes(self.loss_func)
            pred_i = 1 if with_input else 0
            out.insert(pred_i + 2, decodes(out[pred_i]) if decodes is not None else out[pred_i])
        return tuple(out)

    @contextlib.contextmanager
    def validation_context(self, cbs: Any = None, inner: bool = False):
        """fastai's context of a validation pass, which `validate` and `get_preds` run in: no epoch results printed
        and no epoch-level display (`no_logging`, `no_mbar`), the callbacks `cbs` attached for the block.

        Unless `inner`, the callbacks in `cbs` get `before_fit` and `before_epoch` as the block starts and `after_epoch`
        and `after_fit` as it ends (an error inside included), as fastai's `with learn:`, and the batch state is
        cleared after. The Learner's own callbacks see only the pass's events, as in `validate`: the Recorder keeps
        its history (fastai's replaces `recorder.values` with the pass's row). `inner=True`, for a callback during
        `fit`, fires neither and leaves the fit's state (loader, batch, train or eval mode) as it was; the Recorder
        sits the pass out.

        >>> with learn.validation_context(cbs=[Timer()]):       # Timer: before_fit ... after_fit around the block
        ...     loss, acc = learn.validate()
        >>> with learn.validation_context(cbs=cbs, inner=True):  # in a callback: fastai's own use, in get_preds
        ...     learn._do_epoch_validate(dl=dl)
        """
        cbs = [cb() if isinstance(cb, type) else cb for cb in _as_list(cbs)]
        kept = self._kept_loop_state() if inner else contextlib.nullcontext()
        with kept, self.no_logging(), self.no_mbar(), self.added_cbs(cbs):
            if inner:
                yield
                return
            _fire_on(cbs, ("before_fit", "before_epoch"))
            try:
                yield
            finally:
                _fire_on(cbs, ("after_epoch", "after_fit"))
                self._end_cleanup()
                self._run_callbacks_again()   # fastai's validate fires after_fit, which resets `run`

    @contextlib.contextmanager
    def _kept_loop_state(self):
        """The loop's state (loader, batch, counters, train or eval mode of every module) restored after the block;
        the Recorder's metrics untouched (`inner_pass`: it sits the pass out, its training metrics accumulating)."""
        names = ("dl", "training", "iter", "n_iter", "xb", "yb", "pred", "_loss", "inner_pass")
        saved = {n: getattr(self, n, None) for n in names}
        modes = [(m, m.training) for m in self.model.modules()]
        self.inner_pass = True
        try:
            yield
        finally:
            for n, v in saved.items():
                setattr(self, n, v)
            self._handlers = self._train_handlers if self.training else self._valid_handlers
            for m, mode in modes:
                m.training = mode

    def show_results(self, ds_idx: int = 1, dl: Iterable | None = None, max_n: int = 9, shuffle: bool = True
                     ) -> tuple:
        """Predictions for `max_n` items of `dls[ds_idx]` (or `dl`), printed as a table of input, target and
        decoded prediction; returns `(inputs, preds, targs)` (`preds` after `act`, as `get_preds`).

        The items are random with `shuffle` (process 0's draw under distribution), else the first ones.
        fastai shows them decoded through the data's transforms (images, text); cadence loaders are plain
        torch loaders with none, so the table shows tensors: a value, or the first values and the shape.

        >>> inputs, preds, targs = learn.show_results(max_n=4)
        """
        from .results import pick_items, print_table

        if not isinstance(max_n, int) or max_n < 1:
            raise ValueError(f"show_results(max_n=...) is how many items to show, a positive int; got {max_n!r}")
        items = pick_items(self._pick_dl(ds_idx, dl, "show_results"), max_n, shuffle, self.strategy.broadcast)
        inputs, preds, targs, decoded = self.get_preds(dl=items, with_input=True, with_decoded=True)
        inputs, preds, targs, decoded = map_tensors(lambda t: t[:max_n], (inputs, preds, targs, decoded))
        if self.strategy.is_main:
            print_table(inputs, targs, decoded)
        return inputs, preds, targs

    @contextlib.contextmanager
    def loss_not_reduced(self):
        """`loss_func` with `reduction='none'` for the duration of a `with` block (fastai's).

        >>> with learn.loss_not_reduced(): per_item = learn.loss_func(preds, targs)
        """
        lf = self.loss_func
        if hasattr(lf, "reduction"):
            saved, lf.reduction = lf.reduction, "none"
            try:
                yield
            finally:
                lf.reduction = saved
        else:
            self.loss_func = functools.partial(lf, reduction="none")
            try:
                yield
            finally:
                self.loss_func = lf

    def tta(self, ds_idx: int = 1, dl: Iterable | None = None, n: int = 4, batch_tfms: Callable | None = None,
            beta: float | None = 0.25, use_max: bool = False, item_tfms: Any = None) -> tuple:
        """Test-time augmentation (fastai's): predictions of `n` passes with `batch_tfms` applied to the inputs,
        averaged (or their maximum with `use_max`), combined with the plain pass as `lerp(aug, plain, beta)`;
        `beta=None` returns both. Every item once, in data set order, as `get_preds`.

        cadence data has no train/valid transform split to switch: the augmentation is `batch_tfms`,
        a function of the input batch (fastai's default, the training transforms, needs it given here).

        >>> preds, targs = learn.tta(batch_tfms=lambda x: x.flip(-1), n=2)
        """
        if item_tfms is not None:
            raise ValueError("tta(item_tfms=...) needs fastai's item transforms; cadence loaders have none: "
                             "augment whole batches with tta(batch_tfms=fn), fn(x) -> augmented x")
        if batch_tfms is None:
            raise ValueError("tta needs the augmentation: tta(batch_tfms=fn) with fn(x) -> an augmented input batch")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"tta(n=...) is the number of augmented passes, a positive int; got {n!r}")
        aug = torch.stack([self.get_preds(ds_idx, dl, cbs=_BatchTransform(batch_tfms))[0] for _ in range(n)])
        aug = aug.max(0)[0] if use_max else aug.mean(0)
        preds, targs = self.get_preds(ds_idx, dl)[:2]
        if use_max:
            return torch.stack([preds, aug]).max(0)[0], targs
        return ((aug, preds) if beta is None else torch.lerp(aug, preds, beta)), targs

    def predict(self, item: Any, act: Callable | None = None) -> Any:
        """The model's output for one item (its input tensor, a tuple of them, or a dict of keyword inputs), without
        a batch dimension; a tuple or dict output comes back as one, each tensor without its batch dimension. A
        model that computes its loss (loss_func=None) gives its logits. It runs as a validation batch does: in the
        precision's autocast, the callbacks' `after_pred` on the output (so under `to_bf16()` / `to_fp16()` it comes
        back in fp32, as `get_preds`' do); the model's train or eval mode is left as it was.

        fastai's `predict` also decodes through the data's transforms; cadence has none: decode yourself.

        >>> probs = learn.predict(x_valid[0], act=partial(torch.softmax, dim=-1))
        >>> next_token_logits = learn.predict({"input_ids": ids})[-1]
        """
        xb = item if isinstance(item, (tuple, Mapping)) else (item,)
        xb = to_device(map_tensors(lambda x: x.unsqueeze(0), xb), self.strategy.device)
        with self._kept_loop_state(), torch.no_grad():   # callable from a callback during fit
            self.model.eval()
            self.training, self._handlers, self.xb, self.yb = False, self._valid_handlers, xb, ()
            with self._forward_context():
                self.pred = call_model(self.model, xb)
                if self.loss_func is None:
                    self.pred = model_loss(self.pred, training=False)[0]
                if self._handlers["after_pred"]:   # as in validation: MixedPrecision gives fp32
                    self._fire("after_pred")
            pred = self.pred
        act = act if act is not None else getattr(self.loss_func, "activation", None)
        pred = act(pred) if act is not None else pred
        return map_tensors(lambda t: t[0] if t.ndim else t, pred)   # a scalar (an auxiliary loss) stays


def _as_list(cbs: Any) -> list:
    if cbs is None:
        return []
    return list(cbs) if isinstance(cbs, (list, tuple)) else [cbs]
