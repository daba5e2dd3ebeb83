"""Learner methods for features outside the training loop that the trainer package holds itself.

Compilation, export and the summary live here; the methods for features built in
`cadence.callbacks` (precision, distribution, checkpoints, the progress display) are attached to
`Learner` by `cadence/callbacks/learner_methods.py`, so the trainer package imports no callback.

>>> learn.compile(backend="inductor")
>>> learn.export()
>>> print(learn.summary())
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Self


class FeatureMethods:
    """Mixed into `Learner`: each method hands `self` to the module that implements the feature."""

    # ------------------------------------------------------------------ compilation
    def compile(self, **options) -> Self:
        """torch.compile the model, in place: its state dict keeps its names (no `_orig_mod.` prefix).

        `options` are torch.compile's (backend, mode, fullgraph, dynamic, options, disable), and
        cadence's `regional=True` (compile each repeated block once, not the whole model:
        `cadence.compile.compile_model`), checked before anything compiles. The user's module is compiled, inside the strategy's wrapper (DDP):
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

    def export(self, fname: str | Path = "export.pkl") -> Path:
        """Write the Learner for inference to the directory `path/fname` (fastai's `export.pkl` by default):
        weights as safetensors, the structure pickled.

        >>> learn.export(); learn = load_learner(learn.path/"export.pkl", trust_pickle=True)
        """
        from .export import export

        return export(self, fname)

    # ------------------------------------------------------------------ output
    @contextlib.contextmanager
    def no_logging(self):
        """Print no epoch results (header and one row per epoch) in a `with` block; the progress bar still
        shows (fastai's).

        >>> with learn.no_logging():
        ...     learn.fit(1)
        """
        with _switched_off(self, "log_epochs"):
            yield self

    @contextlib.contextmanager
    def no_mbar(self):
        """No epoch-level display in a `with` block: the bar of each pass only, without the epoch in it, and
        no results table (fastai's, where the table is written into the master bar it switches off).

        >>> with learn.no_mbar():
        ...     learn.fit(1)
        """
        with _switched_off(self, "create_mbar"):
            yield self

    def summary(self) -> str:
        """Layers with output shapes and parameter counts, totals, frozen groups and callbacks (fastai's summary).

        >>> print(learn.summary())
        """
        from .summary import summary

        return summary(self)


@contextlib.contextmanager
def _switched_off(learn: Any, flag: str):
    """`learn.<flag>` False for the block, as it was after."""
    saved = getattr(learn, flag)
    setattr(learn, flag, False)
    try:
        yield
    finally:
        setattr(learn, flag, saved)
