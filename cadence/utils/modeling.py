"""`accelerate.utils.extract_model_from_parallel` under cadence."""

from __future__ import annotations

from torch import nn

from ..compile import unwrap_compiled

__all__ = ["extract_model_from_parallel"]


def extract_model_from_parallel(model: nn.Module, keep_fp32_wrapper: bool = True) -> nn.Module:
    """The user's module inside DDP / DataParallel / a DeepSpeed engine / torch.compile (FSDP2 shards in place).

    >>> extract_model_from_parallel(accelerator.prepare(model)) is model
    True
    """
    from ..accelerate.preparation import restore_forward

    while True:
        model = unwrap_compiled(model)
        inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            break
        model = inner
    if not keep_fp32_wrapper:
        restore_forward(model)
    return model
