"""Learner methods that switch on features built outside the training loop.

Precision, distribution, checkpoints and the progress display live in `cadence.callbacks` and
`cadence.distributed`; these methods (fastai's names) import them only when called, so the
trainer package imports none of them.

>>> learn.to_bf16()
>>> with learn.distrib_ctx():
...     learn.fit(1)
>>> learn.save_state("checkpoints/manual")
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .learner import Learner


class FeatureMethods:
    """Mixed into `Learner`: each method hands `self` to the module that implements the feature."""

    # ------------------------------------------------------------------ precision
    def to_bf16(self) -> "Learner":
        """Train with bf16 autocast (adds a `MixedPrecision("bf16")` callback)."""
        return self._set_precision("bf16")

    def to_fp16(self, **scaler_kwargs) -> "Learner":
        """Train with fp16 autocast and a GradScaler (`scaler_kwargs` go to `torch.amp.GradScaler`)."""
        return self._set_precision("fp16", **scaler_kwargs)

    def to_fp32(self) -> "Learner":
        """Back to full precision."""
        return self._set_precision("no")

    def _set_precision(self, precision: str, **scaler_kwargs) -> "Learner":
        from ..callbacks.precision import set_precision

        return set_precision(self, precision, **scaler_kwargs)

    # ------------------------------------------------------------------ compilation
    def compile(self, **options) -> "Learner":
        """torch.compile the model, in place: its state dict keeps its names (no `_orig_mod.` prefix).

        `options` are torch.compile's (backend, mode, fullgraph, dynamic, options, disable), checked
        before anything compiles. The user's module is compiled, inside the strategy's wrapper (DDP):
        its forward then runs while DDP's is active, so torch's DDPOptimizer splits the graph at
        bucket boundaries, as for `torch.compile(DDP(model))`; compiling the DDP wrapper itself
        compiles nothing of a built-in module such as `nn.Sequential` (the DDP frame is skipped).
        Entering and leaving `distrib_ctx` recompile with the same options.

        >>> learn.compile(backend="inductor", mode="max-autotune")
        """
        from ..compile import compile_model, unwrap_compiled

        compile_model(self.strategy.unwrap(self.model), **options)
        self.model = unwrap_compiled(self.model)  # a model the user passed through torch.compile: compiled in place now
        self.compile_options = options
        return self

    def _set_compile(self, compile: Any) -> None:
        """Apply the Learner's `compile=` argument (None: what `cadence launch --dynamo_backend` asked for)."""
        from ..compile import resolve_compile

        options = resolve_compile(compile)
        self.compile_options = None
        if options is not None:
            self.compile(**options)

    # ------------------------------------------------------------------ distribution
    def distrib_ctx(self, sync_bn: bool = True, in_notebook: bool = False, strategy: Any = None, **strategy_kwargs):
        """Train on every launched process inside a `with` block (fastai's name); a no-op-like single process otherwise.

        The strategy comes from `strategy` (a name: "ddp", or a Strategy), else from the launcher
        (`$CADENCE_STRATEGY`), else DDP. `in_notebook` is accepted for fastai compatibility: under
        `notebook_launcher` the workers already carry the launcher's settings.

        >>> with learn.distrib_ctx():
        ...     learn.fit_one_cycle(3, 1e-2)
        """
        from ..callbacks.distributed import distrib_ctx

        return distrib_ctx(self, sync_bn=sync_bn, in_notebook=in_notebook, strategy=strategy, **strategy_kwargs)

    def to_distributed(self, strategy: Any = None, sync_bn: bool = True, **strategy_kwargs) -> "Learner":
        """Shard the loaders, wrap the model, create the process group if needed; undo with `detach_distributed`."""
        from ..callbacks.distributed import to_distributed

        return to_distributed(self, strategy=strategy, sync_bn=sync_bn, **strategy_kwargs)

    def detach_distributed(self) -> "Learner":
        """Restore the original loaders and module; destroy the process group if `to_distributed` created it."""
        from ..callbacks.distributed import detach_distributed

        return detach_distributed(self)

    def parallel_ctx(self, device_ids: list[int] | None = None):
        """fastai's single-process `nn.DataParallel` inside a `with` block; a no-op with fewer than two GPUs."""
        return self.distrib_ctx(strategy="dp", device_ids=device_ids)

    def to_parallel(self, device_ids: list[int] | None = None) -> "Learner":
        """Wrap the model in `nn.DataParallel` when two or more GPUs exist; undo with `detach_parallel`."""
        return self.to_distributed(strategy="dp", device_ids=device_ids)

    def detach_parallel(self) -> "Learner":
        """Undo `to_parallel`."""
        return self.detach_distributed()

    # ------------------------------------------------------------------ checkpoints
    def save_state(self, directory: str | Path) -> Path:
        """Write a complete checkpoint (weights, optimizer, counters, callback states, RNG, data position).

        >>> learn.save_state("checkpoints/manual")
        """
        from ..callbacks.checkpoint import save_state

        return save_state(self, directory)

    def load_state(self, directory: str | Path) -> "Learner":
        """Restore what `save_state` wrote; the next `fit` continues from it only through `fit(resume=...)`."""
        from ..callbacks.checkpoint import load_state

        load_state(self, directory)
        return self

    def save_model(self, directory: str | Path, max_shard_size: int | str = "2GB", merge_adapter: bool = False) -> Path:
        """Write the weights only, as `model.safetensors` or shards with an index (the Hugging Face layout);
        a peft model its adapter, or with `merge_adapter=True` the model with the adapter merged in."""
        from ..callbacks.checkpoint import save_model

        return save_model(self, directory, max_shard_size, merge_adapter)

    def export(self, fname: str | Path = "export") -> Path:
        """Write the Learner for inference to `path/fname/`: weights as safetensors, the structure pickled.

        >>> learn.export(); learn = load_learner("export", trust_pickle=True)
        """
        from .export import export

        return export(self, fname)

    # ------------------------------------------------------------------ output
    def summary(self) -> str:
        """Layers with output shapes and parameter counts, totals, frozen groups and callbacks (fastai's summary).

        >>> print(learn.summary())
        """
        from .summary import summary

        return summary(self)

    @contextlib.contextmanager
    def no_bar(self):
        """Train without the progress display for the duration of a `with` block."""
        from ..callbacks.progress import ProgressCallback

        with self.removed_cbs([cb for cb in self.cbs if isinstance(cb, ProgressCallback)]):
            yield self
