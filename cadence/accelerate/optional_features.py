"""Accelerator methods for features a run may not use, under Accelerate's names: LOMO's fused backward, models
loaded with a device map, context and Ulysses sequence parallelism, FP8. Each does what Accelerate does
when the feature is off, and refuses clearly what cadence cannot do.

>>> accelerator.lomo_backward(loss, learning_rate=1e-3)   # with lomo_optim's Lomo / AdaLomo prepared
>>> with accelerator.maybe_context_parallel(): loss = model(**batch).loss   # no context parallelism: plain block
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

__all__ = ["OptionalFeatures", "is_lomo"]


class OptionalFeatures:
    """Mixed into `Accelerator`: needs `self._optimizers`, `self.parallelism_config`, `self.num_processes`."""

    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        """Backward and update in one pass with the prepared LOMO optimizers (`lomo_optim.Lomo` / `AdaLomo`,
        which update each parameter as its gradient arrives; no `optimizer.step()` follows).

        >>> accelerator.lomo_backward(model(**batch).loss, learning_rate=1e-3)
        """
        if learning_rate is None:
            raise ValueError("lomo_backward needs the learning rate: lomo_backward(loss, learning_rate=...)")
        fused = [opt.optimizer for opt in self._optimizers if is_lomo(opt.optimizer)]
        if not fused:
            raise ValueError("lomo_backward runs LOMO optimizers (lomo_optim.Lomo or AdaLomo), and none was prepared: "
                             "pass one to accelerator.prepare, or call accelerator.backward(loss)")
        for opt in fused:
            opt.fused_backward(loss, learning_rate)

    def verify_device_map(self, model: nn.Module) -> bool:
        """True when `model` (or a submodule) was loaded with a device map spreading it over several devices
        (`from_pretrained(..., device_map="auto")`); such a model cannot be prepared on several processes."""
        return any(len(getattr(m, "hf_device_map", None) or {}) > 1 for m in model.modules())

    @contextlib.contextmanager
    def maybe_context_parallel(self, buffers: list[torch.Tensor] | None = None,
                               buffer_seq_dims: list[int] | None = None,
                               no_restore_buffers: set[torch.Tensor] | None = None) -> Iterator[None]:
        """Accelerate's block for context-parallel attention. cadence has no context parallelism (`cp_size` > 1
        is refused when the Accelerator is built), so the block runs as it is, buffers untouched."""
        yield

    def deepspeed_ulysses_dl_adapter(self, dl: Any, model: nn.Module) -> Any:
        """Accelerate's loader adapter for DeepSpeed Ulysses sequence parallelism: `dl` unchanged, as in
        Accelerate without it (cadence's sequence parallelism is the model-parallel strategy's)."""
        return dl

    @property
    def fp8_backend(self) -> str:
        """"NO": cadence trains in fp32, bf16 or fp16 (Accelerate's FP8BackendType.NO)."""
        return "NO"

    @property
    def context_parallel_rank(self) -> int:
        """0: no context parallelism (every process holds the whole sequence)."""
        return 0

    @property
    def pipeline_parallel_rank(self) -> int:
        """0: the Accelerator runs no pipeline (every process holds every layer; the Learner's model-parallel
        strategy has pipeline stages)."""
        return 0


def is_lomo(optimizer: Any) -> bool:
    """Whether `optimizer` is LOMO's (`lomo_optim.Lomo` / `AdaLomo`: it updates in its own fused backward).

    >>> is_lomo(torch.optim.SGD(model.parameters(), lr=0.1))
    False
    """
    return callable(getattr(optimizer, "fused_backward", None))

