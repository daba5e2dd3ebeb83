"""Learner methods (fastai's names) that switch on features built in `cadence.callbacks`.

Precision, distribution, checkpoints and the progress display are callbacks; these methods add
them to a Learner. They are defined here and attached to `Learner` when `cadence` is imported
(fastai's `@patch`, spelled out), so the dependency points one way: callbacks/ imports trainer/,
never the reverse.

>>> learn.to_bf16()
>>> with learn.distrib_ctx():
...     learn.fit(1)
>>> learn.save_state("checkpoints/manual")
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable

from ..trainer.callback import default_callbacks
from ..trainer.learner import Learner
from . import checkpoint   # looked up at call time: a test's fault injection wraps checkpoint.save_model
from .distributed import detach_distributed as _detach_distributed
from .distributed import distrib_ctx as _distrib_ctx
from .distributed import to_distributed as _to_distributed
from .precision import set_precision
from .progress import ProgressCallback

if ProgressCallback not in default_callbacks:
    default_callbacks.append(ProgressCallback)  # every new Learner shows progress (fastai's defaults.callbacks)


def _learner_method(fn: Callable) -> Callable:
    """Attach `fn` to `Learner` as the method of the same name."""
    fn.__qualname__ = f"Learner.{fn.__name__}"
    setattr(Learner, fn.__name__, fn)
    return fn


# ---------------------------------------------------------------------- precision
@_learner_method
def to_bf16(self) -> Learner:
    """Train with bf16 autocast (adds a `MixedPrecision("bf16")` callback).

    >>> learn.to_bf16().fit(1)
    """
    return set_precision(self, "bf16")


@_learner_method
def to_fp16(self, **scaler_kwargs) -> Learner:
    """Train with fp16 autocast and a GradScaler (`scaler_kwargs` go to `torch.amp.GradScaler`).

    >>> learn.to_fp16(init_scale=2.0**10)
    """
    return set_precision(self, "fp16", **scaler_kwargs)


@_learner_method
def to_fp32(self) -> Learner:
    """Back to full precision.

    >>> learn.to_bf16().to_fp32()
    """
    return set_precision(self, "no")


# ---------------------------------------------------------------------- distribution
@_learner_method
def distrib_ctx(self, sync_bn: bool = True, in_notebook: bool = False, strategy: Any = None, **strategy_kwargs):
    """Train on every launched process inside a `with` block (fastai's name); a no-op-like single process otherwise.

    The strategy comes from `strategy` (a name: "ddp", or a Strategy), else from the launcher
    (`$CADENCE_STRATEGY`), else DDP. `in_notebook` is accepted for fastai compatibility: under
    `notebook_launcher` the workers already carry the launcher's settings.

    >>> with learn.distrib_ctx():
    ...     learn.fit_one_cycle(3, 1e-2)
    """
    return _distrib_ctx(self, sync_bn=sync_bn, in_notebook=in_notebook, strategy=strategy, **strategy_kwargs)


@_learner_method
def to_distributed(self, strategy: Any = None, sync_bn: bool = True, **strategy_kwargs) -> Learner:
    """Shard the loaders, wrap the model, create the process group if needed; undo with `detach_distributed`.

    >>> learn.to_distributed("fsdp").fit(1); learn.detach_distributed()
    """
    return _to_distributed(self, strategy=strategy, sync_bn=sync_bn, **strategy_kwargs)


@_learner_method
def detach_distributed(self) -> Learner:
    """Restore the original loaders and module; destroy the process group if `to_distributed` created it.

    >>> learn.to_distributed().fit(1); learn.detach_distributed()
    """
    return _detach_distributed(self)


@_learner_method
def parallel_ctx(self, device_ids: list[int] | None = None):
    """fastai's single-process `nn.DataParallel` inside a `with` block; a no-op with fewer than two GPUs.

    >>> with learn.parallel_ctx():
    ...     learn.fit(1)
    """
    return self.distrib_ctx(strategy="dp", device_ids=device_ids)


@_learner_method
def to_parallel(self, device_ids: list[int] | None = None) -> Learner:
    """Wrap the model in `nn.DataParallel` when two or more GPUs exist; undo with `detach_parallel`.

    >>> learn.to_parallel().fit(1); learn.detach_parallel()
    """
    return self.to_distributed(strategy="dp", device_ids=device_ids)


@_learner_method
def detach_parallel(self) -> Learner:
    """Undo `to_parallel`.

    >>> learn.to_parallel().fit(1); learn.detach_parallel()
    """
    return self.detach_distributed()


# ---------------------------------------------------------------------- checkpoints
@_learner_method
def save_state(self, directory: str | Path) -> Path:
    """Write a complete checkpoint (weights, optimizer, counters, callback states, RNG, data position).

    >>> learn.save_state("checkpoints/manual")
    """
    return checkpoint.save_state(self, directory)


@_learner_method
def load_state(self, directory: str | Path) -> Learner:
    """Restore what `save_state` wrote; the next `fit` continues from it only through `fit(resume=...)`.

    >>> learn.load_state("checkpoints/manual")
    """
    checkpoint.load_state(self, directory)
    return self


@_learner_method
def save_model(self, directory: str | Path, max_shard_size: int | str = "2GB", merge_adapter: bool = False,
               safe_serialization: bool = True) -> Path:
    """Write the weights only, as `model.safetensors` or shards with an index (the Hugging Face layout);
    a peft model its adapter, or with `merge_adapter=True` the model with the adapter merged in;
    `safe_serialization=False`: `pytorch_model.bin` (or its shards) instead. Call it on every process, not under
    `if is_main_process:`: under FSDP and ZeRO-3 the weights are gathered from all of them (the main process writes).

    >>> learn.save_model("models/final")
    """
    return checkpoint.save_model(self, directory, max_shard_size, merge_adapter, safe_serialization)


# ---------------------------------------------------------------------- output
@_learner_method
@contextlib.contextmanager
def no_bar(self):
    """Train without the progress display for the duration of a `with` block; each epoch's row still goes to
    `learn.logger` (`print` by default: `[0, 0.52, 0.47, 0.81, '00:01']`, fastai's; `no_logging()` silences it).

    >>> with learn.no_bar():
    ...     learn.fit(1)
    """
    with self.removed_cbs([cb for cb in self.cbs if isinstance(cb, ProgressCallback)]):
        yield self
