"""The Accelerator's collectives and process helpers (Accelerate's names), over `cadence.distributed.ops`.

>>> preds, refs = accelerator.gather_for_metrics((logits.argmax(-1), batch["labels"]))
>>> with accelerator.main_process_first(): ds = load_dataset(...)
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from ..distributed import ops
from .preparation import all_tensors
from .prepared import PreparedDataLoader
from .utils import gather_object

__all__ = ["ProcessHelpers"]


class ProcessHelpers:
    """Mixed into `Accelerator`: needs `self.state`, `self.gradient_state`, `self.device`, `self._metrics_group()`."""

    # ------------------------------------------------------------------ collectives
    def gather(self, tensor: Any) -> Any:
        """Every process's tensors concatenated on dim 0, in process order (`cadence.utils.gather`)."""
        from ..utils.operations import gather   # cadence.utils imports this package

        return gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """`gather` without the samples the loader being iterated added as padding: each sample counted once.

        Tensors (nested in tuples, lists, dicts) are gathered as tensors; other objects (strings)
        with `gather_object`, or whenever `use_gather_object`.

        >>> preds, refs = accelerator.gather_for_metrics((logits.argmax(-1), batch["labels"]))
        """
        dl = self.gradient_state.active_dataloader
        group = self._metrics_group()   # under tensor parallelism the dp group: a tp group's ranks hold the same samples
        if use_gather_object or not all_tensors(input_data):
            return self._gather_objects_for_metrics(input_data, dl, group)
        if dl is None:
            return ops.gather(input_data, group)
        return ops.gather_for_metrics(input_data, dl.base, group=group)

    def _gather_objects_for_metrics(self, data: Any, dl: PreparedDataLoader | None, group: Any = None) -> list:
        parts = ops.gather_object(list(data), group)
        if dl is None or dl.base.last_batch is None:
            return [x for part in parts for x in part]
        start = dl.base.last_batch[0]
        return [x for r, part in enumerate(parts)
                for x, real in zip(part, dl.base.real_mask(r, start, len(part)).tolist()) if real]

    def gather_object(self, obj: Any) -> list:
        """Every process's picklable `obj`; lists are concatenated (Accelerate's convention)."""
        return gather_object(obj)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """`cadence.utils.reduce` ("sum", "mean", "max", "min", "none"), summing by default; `scale` on XLA only."""
        from ..utils.operations import reduce   # cadence.utils imports this package

        return reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
        """Pad along `dim` to the largest size any process has (so the tensors can be gathered)."""
        return ops.pad_across_processes(tensor, dim, pad_index, pad_first)

    def split_between_processes(self, inputs: Any, apply_padding: bool = False):
        """Context manager giving this process its contiguous part of `inputs` (see `PartialState`)."""
        return self.state.split_between_processes(inputs, apply_padding)

    def set_trigger(self) -> None:
        """Raise a flag on this process; `check_trigger` sees it on every process (e.g. to stop early)."""
        self._trigger = True

    def check_trigger(self) -> bool:
        """True on every process when any process called `set_trigger` since the last check (which resets it)."""
        flag = ops.reduce(torch.tensor(float(self._trigger), device=self.device), "sum")
        self._trigger = False
        return bool(flag.item() > 0)

    # ------------------------------------------------------------------ processes
    def wait_for_everyone(self) -> None:
        self.state.wait_for_everyone()

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return self.state.main_process_first()

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return self.state.local_main_process_first()

    def on_main_process(self, function: Callable) -> Callable:
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: Callable) -> Callable:
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: Callable) -> Callable:
        return self.state.on_last_process(function)

    def on_process(self, function: Callable | None = None, process_index: int | None = None) -> Callable:
        return self.state.on_process(function, process_index)

    def on_local_process(self, function: Callable | None = None, local_process_index: int | None = None) -> Callable:
        return self.state.on_local_process(function, local_process_index)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` once, on the main process."""
        self.state.print(*args, **kwargs)
