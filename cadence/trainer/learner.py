"""Learner: the training loop, top to bottom.

Every feature (progress, precision, accumulation, checkpoints, trackers, distribution) is a
callback; backward and optimizer step go through `learn.strategy`. The loop itself is the
few `_do_*` methods below and `_with_events`, which runs one level of it with its events.
Attaching callbacks is in `callback_methods.py`, building the optimizer in `optimizer.py`.

>>> learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=accuracy)
>>> learn.fit_one_cycle(3, lr_max=1e-2)
>>> preds, targs = learn.get_preds()
>>> learn.save("stage1"); learn.load("stage1")
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..nested import map_tensors
from .callback import Callback, default_callbacks
from .callback_methods import CallbackMethods, learner_recorder, listify
from .data import DataLoaders, n_batches, to_detach, to_device
from .events import (CancelBackwardException, CancelBatchException, CancelEpochException,
                     CancelException, CancelFitException, CancelStepException, CancelTrainException,
                     CancelValidateException, Event)
from .features import FeatureMethods
from .fit_checks import check_trainable, warn_if_launched_alone
from .inference import InferenceMethods
from .model_output import call_model, describe, model_loss
from .optimizer import OptimizerMethods, check_opt_func, default_lr
from .recorder import Recorder
from .policies import FitPolicies, SkipToEpoch
from .schedule import n_groups, set_hyper
from .transfer import TransferMethods

_NO_CONTEXT = contextlib.nullcontext()
# errors a loss function raises that say nothing about its fit to the model's output: kept as raised
_NOT_A_MISFIT = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),
                 getattr(torch.distributed, "DistError", torch.cuda.OutOfMemoryError))
_LEVEL_EVENTS = {level: (f"before_{level}", f"after_cancel_{level}", f"after_{level}")
                 for level in ("fit", "epoch", "train", "validate", "batch", "backward", "step")}


class Learner(CallbackMethods, OptimizerMethods, FitPolicies, TransferMethods, FeatureMethods, InferenceMethods):
    """Trains `model` on `dls` with `loss_func`, an optimizer from `opt_func`, and callbacks.

    Args:
        dls: a `DataLoaders` (train and optional valid loader).
        model: any `nn.Module`; batches are split into inputs (`xb`, passed as `model(*xb)`)
            and targets (`yb`, passed as `loss_func(pred, *yb)`). A dict batch (Hugging Face
            style) goes in as `model(**xb)`, its `dls.target_keys` (default "labels") as targets.
        loss_func: `loss_func(pred, *yb)` -> scalar tensor; None when the model computes its own
            loss (`model(**batch).loss`, labels included): `learn.pred` is then its `logits`.
        opt_func: any callable `opt_func(params, lr=lr)` returning a `torch.optim.Optimizer`.
        lr: default learning rate (a float, or a `slice` / list for discriminative rates); by default
            the `lr` bound in `opt_func=partial(torch.optim.Adam, lr=...)` if there is one, else 1e-3.
        splitter: `splitter(model)` -> list of parameter groups (for discriminative rates).
        cbs, metrics: callbacks and metrics (functions `fn(preds, targs)` or `Metric`s).
        path, model_dir: `save`/`load` use `path/model_dir/<name>.safetensors`.
        wd: weight decay, set at each fit (`fit(wd=...)` for one fit); None keeps the optimizer's.
        strategy: how to run backward/step (`SingleDevice` by default; `distrib_ctx` swaps it).
        train_bn: BatchNorm layers of frozen parameter groups keep training (`freeze`, `fine_tune`).
        wd_bn_bias: weight decay on normalisation and bias parameters too (torch's optimizers' way, the
            default); False keeps them from decaying, fastai's default (each splitter group is then two
            optimizer groups; lrs, freezing and schedules still count splitter groups).
        moms: the momentum `fit_one_cycle` moves through (start, middle, end), fastai's default.
        compile: torch.compile the model: True (torch's defaults), a backend name, a dict of
            torch.compile options (and `regional=True`: each repeated block compiled once), False; None follows
            `cadence launch --dynamo_backend` (see `learn.compile`).

    >>> learn = Learner(dls, model, loss_func=F.cross_entropy, opt_func=torch.optim.SGD, lr=0.1)
    >>> learn.fit(2)
    """

    def __init__(self, dls: DataLoaders, model: nn.Module, loss_func: Callable | None = None,
                 opt_func: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW, lr: float | slice | None = None,
                 splitter: Callable[[nn.Module], Iterable] | None = None, cbs: Any = None, metrics: Any = None,
                 path: str | Path = ".", model_dir: str | Path = "models", wd: float | None = None, strategy: Any = None,
                 train_bn: bool = True, compile: bool | str | dict | None = None, wd_bn_bias: bool = True,
                 moms: tuple[float, float, float] = (0.95, 0.85, 0.95)):
        if not isinstance(dls, DataLoaders):
            raise TypeError(f"dls must be a cadence.DataLoaders, got {type(dls).__name__}: "
                            f"wrap your loaders as DataLoaders(train_dl, valid_dl)")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if loss_func is not None and not callable(loss_func):
            raise TypeError(f"loss_func must be callable as loss_func(pred, target), got {loss_func!r}")
        check_opt_func(opt_func)
        if strategy is None:
            from ..distributed.strategy import SingleDevice  # the default engine; trainer/ never needs more

            strategy = SingleDevice(dls.device)
        self.dls, self.loss_func, self.opt_func, self.splitter = dls, loss_func, opt_func, splitter
        self.lr = default_lr(opt_func) if lr is None else lr
        if lr is not None and default_lr(opt_func, None) not in (None, lr):
            warnings.warn(f"Learner(lr={lr!r}) and opt_func's lr={default_lr(opt_func)!r} differ: cadence trains at "
                          f"lr={lr!r} (fastai would take the opt_func's; see docs/fastai.md)", stacklevel=2)
        self.path, self.model_dir, self.wd, self.strategy = Path(path), Path(model_dir), wd, strategy
        self.train_bn, self.wd_bn_bias, self.moms = train_bn, wd_bn_bias, tuple(moms)
        self.model, self.opt = strategy.setup(model, self._make_opt)
        self._set_compile(compile)
        self.cbs: list[Callback] = []
        self._train_handlers: dict[str, tuple] = {}
        self._handlers = self._valid_handlers = self._train_handlers
        self._forward_cbs: list[Callback] = []
        self.training, self.n_epoch, self.steps_per_epoch, self._batches_per_epoch = False, 0, 0, 0
        self._sync_gradients = True
        self.epoch = self.iter = self.train_iter = self.step = 0
        self.dl = self.xb = self.yb = self.pred = self.loss_grad = None
        self._loss = torch.tensor(0.0)  # fastai's value before any batch
        self.final_record = None  # the last epoch's recorder row (fastai's); validate() sets it too
        self.inner_pass = False  # a get_preds(inner=True) running inside fit: the Recorder sits it out
        self.log_epochs = self.create_mbar = True  # what no_logging() / no_mbar() switch off (fastai's create_mbar)
        self.logger = print  # fastai's: where the Recorder writes each epoch's row when no progress display shows it
        cbs = [cb() if isinstance(cb, type) else cb for cb in listify(cbs)]
        others = [cb for cb in cbs if not isinstance(cb, Recorder)]
        self.add_cbs([learner_recorder(cbs, metrics), *_default_cbs(), *others])
        self("after_create")

    # ------------------------------------------------------------------ events
    def __call__(self, event: str | Event | Iterable[str | Event]) -> None:
        """Run every callback's handler for `event` (or for each of a list of events), in order.

        >>> learn("before_fit"); learn(["before_epoch", "before_train"])
        """
        if isinstance(event, (list, tuple)):
            for e in event:
                self._fire(e)
        else:
            self._fire(event)

    def _fire(self, event: str | Event) -> None:  # what `learn(event)` does; the loop calls it as a method (faster)
        try:
            handlers = self._handlers[event]
        except KeyError:
            raise ValueError(f"unknown event {str(event)!r}; events are listed in cadence.Event") from None
        for handler in handlers:
            try:
                handler()
            except CancelException:
                raise
            except Exception as e:
                e.add_note(f"(raised in callback {type(handler.__self__).__name__} during event {event})")
                raise

    # ------------------------------------------------------------------ gradient sync
    @property
    def sync_gradients(self) -> bool:
        """False while GradAccum accumulates: the micro-step's forward and backward keep gradients local."""
        return self._sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        if value != self._sync_gradients:
            self.strategy.set_gradient_sync(self.model, value)
        self._sync_gradients = value

    @property
    def metrics(self) -> list:
        """The metrics the Recorder computes at each validation (fastai's `learn.metrics`, settable).

        >>> learn.metrics = [accuracy, F1Score(average="macro")]
        """
        return self.recorder.metrics

    @metrics.setter
    def metrics(self, metrics: Any) -> None:
        self.recorder.metrics = listify(metrics)

    # ------------------------------------------------------------------ the loop
    def _with_events(self, f: Callable[[], None], level: str, cancel: type[Exception], final: Callable | None = None,
                     done: Callable | None = None):
        """before_<level>, f, after_cancel_<level> if cancelled, `done` (counters), after_<level>, `final`."""
        before, after_cancel, after = _LEVEL_EVENTS[level]
        try:
            if self._handlers[before]:  # most events have no handler by default: skip the call
                self._fire(before)
            f()
        except cancel:
            self._fire(after_cancel)
        if done is not None:
            done()
        if self._handlers[after]:
            self._fire(after)
        if final is not None:
            final()

    def fit(self, n_epoch: int, lr: float | slice | None = None, wd: float | None = None, cbs: Any = None,
            reset_opt: bool = False, resume: str | Path | None = None, start_epoch: int = 0) -> None:
        """Train for `n_epoch` epochs at learning rate `lr` (default `self.lr`) and weight decay `wd` (default
        `self.wd`; None: the optimizer's as it is), validating after each.

        `resume` continues a run saved by the `Checkpoint` callback exactly where it stopped,
        mid-epoch included: "auto" from the latest checkpoint if there is one (a fresh start
        otherwise: one command line for the first run, restarts and requeues), "latest" (there
        must be one), or a checkpoint name or path.

        `start_epoch` (fastai's) skips the epochs before it: training starts there, the counters and
        any schedule as if those epochs had run (e.g. after `learn.load` of a model saved then).
        `reset_opt=True` (fastai's) builds a new optimizer first (`create_opt`): its state starts afresh.

        >>> learn.fit(3, lr=1e-2)
        >>> learn.fit(1, lr=1e-3, reset_opt=True)              # no momentum carried over from the fit before
        >>> learn.fit(3, lr=1e-2, cbs=Checkpoint(every_n_steps=100), resume="auto")
        >>> learn.fit_one_cycle(10, 1e-2, start_epoch=4)       # epochs 4..9 of the 10-epoch schedule
        """
        if not isinstance(n_epoch, int) or n_epoch < 1:
            raise ValueError(f"n_epoch must be a positive int, got {n_epoch!r}")
        if not isinstance(start_epoch, int) or not 0 <= start_epoch < n_epoch:
            raise ValueError(f"start_epoch must be an int in [0, n_epoch={n_epoch}), got {start_epoch!r}")
        if not isinstance(reset_opt, bool):  # fastai's position: a `resume` passed 5th lands here
            raise TypeError(f"fit(reset_opt=...) is True or False, got {reset_opt!r}; pass resume= by name")
        if start_epoch and resume is not None:
            raise ValueError("fit(start_epoch=...) and fit(resume=...) both say where to start: a resumed run "
                             "continues where its checkpoint stopped; pass only one")
        check_trainable(self.strategy.state_template(self.model))   # the whole model: every pipeline stage
        warn_if_launched_alone()
        if start_epoch:
            cbs = [*listify(cbs), SkipToEpoch(start_epoch)]
        if reset_opt:
            self.create_opt()
        elif self.opt_func is not self._opt_built_with:
            warnings.warn("learn.opt_func was changed after the optimizer was built: this fit still uses the "
                          f"{type(self.opt).__name__} built with the Learner (fastai builds it lazily in fit); "
                          "call learn.create_opt() to use the new opt_func (see docs/fastai.md)", stacklevel=2)
        self._run_callbacks_again()  # one stopped outside a fit (in a validation) runs in this one
        if "lr_finder" in vars(self) and self.lr_finder not in self.cbs:
            del self.lr_finder  # the last sweep: fastai's callbacks tell lr_find's fit by hasattr(learn, "lr_finder")
        with self.added_cbs(cbs), self._fit_contexts():
            set_hyper(self.opt, "lr", self._group_lrs(self.lr if lr is None else lr, n_groups(self.opt)))
            wd = self.wd if wd is None else wd  # fastai's: each fit decays by learn.wd unless told otherwise
            if wd is not None:
                set_hyper(self.opt, "wd", wd)
            self.n_epoch, self.steps_per_epoch = n_epoch, n_batches(self.dls.train)  # None: a stream
            self._batches_per_epoch = self.steps_per_epoch
            self.epoch = self.iter = self.train_iter = self.step = 0
            if resume is not None:
                self._resume(resume)
            try:
                self._with_events(self._do_fit, "fit", CancelFitException, self._end_cleanup)
            finally:
                self._run_callbacks_again()

    @contextlib.contextmanager
    def _fit_contexts(self):
        """The `fit_context()` of every callback that has one (e.g. Checkpoint's signal handlers), around the fit."""
        with contextlib.ExitStack() as stack:
            for cb in [cb for cb in self.cbs if callable(getattr(cb, "fit_context", None))]:
                stack.enter_context(cb.fit_context())
            yield

    def _resume(self, which: str | Path) -> None:
        checkpoints = [cb for cb in self.cbs if callable(getattr(cb, "resume", None))]  # the Checkpoint callback
        if not checkpoints:
            raise ValueError("fit(resume=...) needs the Checkpoint callback that wrote the run: "
                             "pass cbs=[Checkpoint(...)] (same dir) to the Learner or to fit")
        checkpoints[0].resume(which)

    def _do_fit(self) -> None:
        for epoch in range(self.epoch, self.n_epoch):  # before_fit may have moved self.epoch (resume)
            self.epoch = epoch
            self._with_events(self._do_epoch, "epoch", CancelEpochException)

    def _do_epoch(self) -> None:
        self._do_epoch_train()
        if self.dls.valid is not None:
            self._do_epoch_validate()
        self._warn_shadowing()

    def _do_epoch_train(self) -> None:
        self.dl, self.training, self._handlers = self.dls.train, True, self._train_handlers
        self.model.train()
        self._with_events(self.all_batches, "train", CancelTrainException)

    def _do_epoch_validate(self, dl: Iterable | None = None) -> None:
        self.dl = self.dls.valid if dl is None else dl
        self.training, self._handlers = False, self._valid_handlers
        self.model.eval()
        with torch.no_grad():
            self._with_events(self.all_batches, "validate", CancelValidateException)

    def all_batches(self) -> None:
        """Run `one_batch` on every batch of `self.dl` (fastai's)."""
        self.n_iter = n_batches(self.dl)
        # a resumed loader starts mid-epoch and says where (DistributedDL.start_batch)
        for i, batch in enumerate(self.dl, getattr(self.dl, "start_batch", 0)):
            self.one_batch(i, batch)

    def one_batch(self, i: int, batch: Any) -> None:
        """Run the batch events for batch number `i` of the current loader."""
        # loss_grad keeps the last batch's graph until this batch's loss replaces it, as a plain loop's `loss`
        # variable does: freeing it first would make autograd rebuild every parameter's grad accumulator
        self.iter, self.pred, self._loss = i, None, None
        b = to_device(batch, self.strategy.device)
        if isinstance(b, (list, tuple)):  # (inputs..., targets...): all but the last are inputs unless n_inp says
            if type(b) is not tuple:
                b = tuple(b)
            n = self.dls.n_inp or len(b) - 1 or 1
            self.xb, self.yb = b[:n], b[n:]
        elif isinstance(b, Mapping):
            self.xb, self.yb = self._split_named(b)
        else:
            self.xb, self.yb = (b,), ()
        # a training batch counts as seen before any callback's after_batch (fastai's order), cancelled or not
        self._with_events(self._do_one_batch, "batch", CancelBatchException, None,
                          self._count_batch if self.training else None)

    def _count_batch(self) -> None:
        self.train_iter += 1

    def _split_named(self, b: Mapping) -> tuple[dict, tuple]:
        """A dict batch: the targets are its `dls.target_keys`; the model gets the rest (all of it when it computes its loss)."""
        keys = self.dls.target_keys
        yb = tuple(b[k] for k in keys if k in b)
        if self.loss_func is None:
            return dict(b), yb
        if not yb:
            raise ValueError(f"the batch has none of the target keys {list(keys)} (its keys: {list(b)}): "
                             f"set DataLoaders(..., target_keys=[...]), or loss_func=None if the model computes its loss")
        return {k: v for k, v in b.items() if k not in keys}, yb

    def _do_one_batch(self) -> None:
        if self._forward_cbs:
            with self._forward_context():
                self._pred_and_loss()
        else:
            self._pred_and_loss()
        if self._handlers["after_loss"]:
            self._fire("after_loss")
        if not self.training:
            return
        self._with_events(self._backward, "backward", CancelBackwardException)
        self._with_events(self._step, "step", CancelStepException)
        self.strategy.zero_grad(self.opt)

    def _pred_and_loss(self) -> None:
        xb = self.xb
        if hasattr(self.strategy, "forward_backward"):  # OwnsStep: a pipeline runs forward, loss and backward itself
            return self._engine_pred_and_loss()
        self.pred = call_model(self.model, xb)
        if self.loss_func is None:
            return self._own_loss()
        if self._handlers["after_pred"]:
            self._fire("after_pred")
        if not self.yb:
            if not self.training:  # inference on inputs only: no loss
                return
            raise ValueError("the training batch has no targets for loss_func: yield (inputs, targets) batches, "
                             "or set DataLoaders(n_inp=...) to say how many elements are inputs")
        try:
            loss = self.loss_func(self.pred, *self.yb)
        except _NOT_A_MISFIT:  # out of memory, a lost process: as raised (a batch-size finder catches the first)
            raise
        except Exception as e:
            raise ValueError(f"loss_func could not use the model's output: loss_func(pred, *yb) with pred "
                             f"{describe(self.pred)} and yb {describe(self.yb)} raised {type(e).__name__}: {e}. "
                             f"Check the model's output size and the targets.") from e
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            raise ValueError(f"loss_func must return a scalar tensor, got {describe(loss)}; use a reduction such as "
                             f"'mean'")
        self.loss_grad = self._loss = loss

    def _engine_pred_and_loss(self) -> None:
        """The strategy's `(pred, loss)` for the batch; its schedule already ran the backward (when training)."""
        self.pred, loss = self.strategy.forward_backward(self.model, self.xb, self.yb, self.loss_func, self.training)
        if self._handlers["after_pred"]:
            self._fire("after_pred")
        self.loss_grad = self._loss = loss

    def _own_loss(self) -> None:
        """A model computing its own loss (loss_func=None): `pred` is its `logits`, the loss its `loss`."""
        self.pred, loss = model_loss(self.pred, self.training)
        if self._handlers["after_pred"]:
            self._fire("after_pred")
        if loss is None:  # validation or inference without labels
            return
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            raise ValueError(f"the model's `loss` must be a scalar tensor, got {describe(loss)}")
        self.loss_grad = self._loss = loss

    @property
    def loss(self) -> torch.Tensor | None:
        """The current batch's loss, detached from the graph (detached when read: most steps never read it).

        A callback may set it (e.g. to report a different value). The Recorder records what it holds,
        reading `_loss` itself: `.item()` needs no detached copy.
        """
        loss = self._loss  # read once: the progress bar's thread reads this too
        return loss.detach() if loss is not None and loss.requires_grad else loss

    @loss.setter
    def loss(self, value: torch.Tensor | None) -> None:
        self._loss = value

    @property
    def x(self) -> Any:
        """fastai's alias: the batch's input (`xb[0]` when there is one, else `xb`)."""
        return _detuplify(self.xb)

    @property
    def y(self) -> Any:
        """fastai's alias: the batch's target (`yb[0]` when there is one, else `yb`)."""
        return _detuplify(self.yb)

    @property
    def smooth_loss(self) -> torch.Tensor:
        """fastai's `learn.smooth_loss`: the Recorder's smoothed training loss so far (`tensor(0.)` before any)."""
        value = self.recorder.smooth_loss
        return torch.tensor(0.0 if value is None else value)

    @property
    def pct_train(self) -> float | None:
        """The fraction of the fit's training batches done (fastai's); None for a loader without a length."""
        n = self._batches_per_epoch
        return self.train_iter / (self.n_epoch * n) if n and self.n_epoch else None

    def to_detach(self, b: Any, cpu: bool = True, gather: bool = True) -> Any:
        """The tensors of `b` detached, with `gather` concatenated over processes (every process must call
        it then), with `cpu` on the CPU (fastai's).

        >>> preds = learn.to_detach(learn.pred)          # this batch's predictions of every process
        """
        b = to_detach(b, cpu=False)
        if gather:
            b = map_tensors(self.strategy.gather, b)
        return to_detach(b, cpu=cpu)

    def _backward(self) -> None:
        self.strategy.backward(self.loss_grad)

    def _step(self) -> None:
        if self.strategy.step(self.opt):
            self.step += 1

    def _forward_context(self) -> contextlib.AbstractContextManager:
        cbs = self._forward_cbs
        if not cbs:
            return _NO_CONTEXT
        if len(cbs) == 1:
            return cbs[0].forward_context()
        stack = contextlib.ExitStack()
        for cb in cbs:
            stack.enter_context(cb.forward_context())
        return stack

    def _end_cleanup(self) -> None:
        self.dl = self.xb = self.yb = self.pred = self.loss = self.loss_grad = None

    # ------------------------------------------------------------------ saving
    def save(self, name: str | Path, with_opt: bool = True) -> Path:
        """Write the weights and (`with_opt`) the optimizer state to `path/model_dir/<name>/` as one unit.

        >>> learn.save("stage1")   # models/stage1/model.safetensors, models/stage1/optimizer.pt
        """
        from .saving import save

        return save(self, name, with_opt)

    def load(self, name: str | Path, device: int | str | torch.device | None = None, with_opt: bool = True,
             strict: bool = True) -> "Learner":
        """Load what `save` wrote (a name in `model_dir`, or a path); checked against the model before loading.

        fastai's arguments: `device` is where the files are read to (an int is that CUDA device; default the CPU),
        the model and optimizer keep theirs; `with_opt=False` loads the weights alone; `strict=False` loads the
        weights the model has a place for.

        >>> learn.load("stage1")
        >>> learn.load("stage1", device="cuda", with_opt=False)
        """
        from .saving import load

        if isinstance(device, bool):  # `load(name, False)`: with_opt was second before fastai's device
            raise TypeError(f"learn.load(name, device, with_opt, strict): device is a device, got {device!r}; "
                            f"pass with_opt= by name")
        load(self, name, with_opt, strict, torch.device("cuda", device) if isinstance(device, int) else device)
        return self

    def __repr__(self) -> str:
        return f"Learner(model={type(self.model).__name__}, dls={self.dls!r}, cbs={self.cbs})"


def _detuplify(x: Any) -> Any:
    return x[0] if isinstance(x, tuple) and len(x) == 1 else x


def _default_cbs() -> list[Callback]:
    return [cls() for cls in default_callbacks]  # the progress display, added by cadence.callbacks
